"""``meshplan plan``/``search``'s built-in models from their flags (``cli/steps.py``)."""

from __future__ import annotations

import argparse

import jax
import pytest

from meshplan.cli.plan import abstract_state
from meshplan.cli.steps import step_and_batch
from meshplan.models.transformer import CONFIGS


@pytest.mark.parametrize("model", ["transformer", "transformer-nnx"])
def test_a_sequence_longer_than_the_presets_max_len_is_planned(model):
    seq = 4 * CONFIGS["tiny"].max_len
    args = argparse.Namespace(model=model, size="tiny", batch=2, seq=seq, experts=None)
    _, state = abstract_state(args)
    step, batch = step_and_batch(args)
    assert batch.shape == (2, seq + 1)
    new_state = jax.eval_shape(step, state, batch)  # raised "exceeds max_len" before
    shapes = lambda t: [x.shape for x in jax.tree.leaves(t)]  # noqa: E731
    # rotary positions have no parameters: the state the longer step trains is the same
    assert shapes(new_state) == shapes(state)
