"""One registry of example models (models/registry.py), read by plan, search, train and factory."""

import argparse

import jax
import pytest

from meshplan.cli.factory import BUILT_IN_MODELS, model_problem
from meshplan.cli.plan import abstract_state, load_rules
from meshplan.cli.steps import example_of
from meshplan.cli.trained_models import MODELS
from meshplan.models.registry import EXAMPLE_MODELS, example


def _args(name):
    return argparse.Namespace(model=name, size="tiny", layers=2, depth=16, scan=False)


@pytest.mark.parametrize("name", list(EXAMPLE_MODELS))
def test_each_example_model_builds_a_state_with_names_and_a_step_that_traces(name):
    built = example_of(_args(name))
    state = built.model.abstract_state()
    batch = built.batch(4, 16)
    after = jax.eval_shape(built.model.step, state, batch)
    assert jax.tree.structure(after.params) == jax.tree.structure(state.params)
    what, planned = abstract_state(_args(name))
    assert what == built.what
    assert jax.tree.map(lambda x: x.shape, planned.params) == jax.tree.map(
        lambda x: x.shape, state.params
    )


def test_every_command_knows_the_same_models():
    assert tuple(EXAMPLE_MODELS) == BUILT_IN_MODELS
    assert all(model_problem(name) is None for name in EXAMPLE_MODELS)
    trained = {n: m.api for n, m in EXAMPLE_MODELS.items() if m.sequence}
    assert trained == MODELS == {"transformer": "Flax Linen", "transformer-nnx": "Flax NNX"}
    assert {n: load_rules(None, n)[0] for n in EXAMPLE_MODELS} == {
        n: m.rules for n, m in EXAMPLE_MODELS.items()
    }


def test_an_unknown_model_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model 'gpt': expected one of mlp, transformer"):
        example("gpt", None)
