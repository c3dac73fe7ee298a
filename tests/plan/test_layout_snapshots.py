"""Golden snapshots: where each built-in layout puts every array of the Transformer.

A layout edit that moves a parameter fails here with the parameter, its old
and new spec, and its bytes per device. Rewrite after an intended change with
``MESHPLAN_UPDATE_SNAPSHOTS=1 .venv/bin/pytest tests/plan/test_layout_snapshots.py``.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import meshplan
import meshplan.layouts
from meshplan.models.transformer import Transformer, config_from_name
from meshplan.testing import assert_plan_matches

SNAPSHOTS = Path(__file__).parent / "snapshots"


@functools.cache
def tiny_state():
    model = Transformer(config_from_name("tiny"))

    def init(key):
        params = model.init(key, jnp.zeros((1, 8), jnp.int32))["params"]
        return train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)
        )

    return jax.eval_shape(init, jax.random.key(0))


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp", "tensor_parallel", "fsdp_tp"])
def test_transformer_plan_under_each_layout_matches_snapshot(layout):
    rules = meshplan.layouts.get_layout(layout)
    plan = meshplan.explain(tiny_state(), {"data": 2, "model": 4}, rules)
    assert not [p for p in plan.problems if p.severity == "error"]
    assert_plan_matches(plan, SNAPSHOTS / f"transformer_tiny_{layout}_2x4.json")


@pytest.mark.parametrize(
    ("layout", "state_fraction"),
    [("data_parallel", 1.0), ("fsdp", 1 / 8), ("tensor_parallel", 1 / 4), ("fsdp_tp", 1 / 8)],
)
def test_each_layout_keeps_the_share_of_state_its_docstring_promises(layout, state_fraction):
    plan = meshplan.explain(
        tiny_state(), {"data": 2, "model": 4}, meshplan.layouts.get_layout(layout)
    )
    share = plan.totals["all"].max_device_bytes / plan.totals["all"].bytes
    assert share == pytest.approx(state_fraction, rel=0.05)
