"""Running a candidate's step for real (``_search/measure/timing.py``): as a training loop
runs it, the state donated and fed back, where the step returns a new state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._search.measure.timing import prepare_step

RULES = (("batch", "data"),)


def _state():
    return {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32)}


def test_a_step_returning_its_state_runs_on_its_last_new_state_donated():
    def step(state, x):
        return {"w": state["w"] + 1.0 + 0.0 * x.sum()}

    prepared = prepare_step(
        step, _state(), jax.ShapeDtypeStruct((8, 8), jnp.float32), {"data": 8}, RULES
    )
    first = prepared.state["w"]
    assert prepared.donated and len(prepared.run(3)) == 3
    assert first.is_deleted()  # its buffers taken by the new state
    np.testing.assert_array_equal(np.asarray(prepared.state["w"]), np.full((8, 4), 4.0))


def test_a_step_returning_something_else_runs_each_time_on_the_same_state():
    def grads(state, x):
        return jax.grad(lambda w: (x[:, :4] @ w.T).sum())(state["w"])  # not a state

    prepared = prepare_step(
        grads, _state(), jax.ShapeDtypeStruct((8, 8), jnp.float32), {"data": 8}, RULES
    )
    kept = prepared.state["w"]
    assert not prepared.donated and len(prepared.run(2)) == 2
    assert not kept.is_deleted() and prepared.state["w"] is kept


def test_a_new_state_placed_apart_from_the_old_runs_undonated_on_the_same_state():
    def replicated(state, x):  # its new state comes back whole, the old one was split
        w = state["w"].value + 1.0 + 0.0 * x.sum()
        return {"w": jax.lax.with_sharding_constraint(w, P())}

    split = {"w": meshplan.LogicallyPartitioned(_state()["w"], ("batch", None))}
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    prepared = prepare_step(replicated, split, x, {"data": 8}, RULES)
    kept = prepared.state["w"]
    assert not prepared.donated and len(prepared.run(2)) == 2
    assert prepared.state["w"] is kept and not jax.tree.leaves(kept)[0].is_deleted()
