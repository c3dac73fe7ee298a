"""A pipeline is priced only for a step that runs one: the planner's collectives for the
pipeline layouts against the compiled HLO on 8 CPU devices. A step whose layers are a plain
``nn.scan`` never reads ``'stage'``: under the pipeline rules XLA gathers its ``'layer'``
stack whole and runs every layer on every device, with no collective-permute, so the search
prices no pipeline for it; the Transformer of :mod:`meshplan.models` runs its blocks as
stages and its compiled step permutes activations between them, as the planner's sends."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan import layouts
from meshplan._search.measure.hlo import collective_counts, compile_candidate
from meshplan._search.search.pipeline_verdict import runs_stages
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from xla_suite import suite_step

MESH = {"pipeline": 4, "data": 2}


def _rules(state, step, batch):
    """The ``pipeline`` layout's rules for the model, as the search prices them."""
    work = meshplan.trace_workload(step, state, batch, read_constraints=True)
    return next(
        r.rules
        for r in meshplan.search_rules(8, workload=work, profile="h100", compile_top=0).rows
        if r.layout == "pipeline" and r.mesh == MESH
    )


@functools.cache
def _transformer():
    cfg = config_from_name(
        "tiny", num_heads=4, embed_dim=32, mlp_dim=64, max_len=64, num_layers=4, microbatches=4
    )
    model = Transformer(cfg)
    state = jax.eval_shape(
        lambda k: model.init(k, jnp.zeros((1, 32), jnp.int32))["params"], jax.random.key(0)
    )

    def step(state, batch):
        return jax.grad(lambda p: loss_fn(meshplan.unbox(p), batch, model=model))(state)

    return state, step, jax.ShapeDtypeStruct((16, 32), jnp.int32)


def test_a_plain_scan_of_layers_runs_no_pipeline_and_is_not_priced_as_one():
    state, step, batch = suite_step("scanned", 1)
    assert not runs_stages(step, state, batch)
    hlo = compile_candidate(step, state, batch, MESH, _rules(state, step, batch))[0].as_text()
    counts = collective_counts(hlo)
    assert counts["collective-permute"] == 0  # no stage shifts: the layers are not stages
    assert counts["all-gather"] > 0  # the 'layer' stack gathered whole for the loop
    result = meshplan.search_rules(8, state, step, batch, profile="cpu", compile_top=0)
    assert not any(r.pipeline is not None for r in result.rows)
    assert "runs no pipeline" in (result.pipeline_absent or "")


def test_a_pipelined_step_is_priced_with_the_sends_its_compiled_step_runs():
    state, step, batch = _transformer()
    assert runs_stages(step, state, batch)
    rules = _rules(state, step, batch)
    hlo = compile_candidate(step, state, batch, MESH, rules)[0].as_text()
    assert collective_counts(hlo)["collective-permute"] > 0
    result = meshplan.search_rules(8, state, step, batch, profile="cpu", compile_top=0)
    row = next(r for r in result.rows if r.layout == "pipeline" and r.mesh == MESH)
    assert row.cost is not None and row.cost.comm_bytes["collective-permute"] > 0


@pytest.mark.parametrize("layout", ["pipeline", "pp_tp"])
def test_a_step_that_cannot_run_the_stages_is_taken_to_read_them(layout):
    """A pipeline that refuses two stages (here: 3 layers) still reads the stage rules."""
    cfg = config_from_name("tiny", num_heads=4, embed_dim=32, mlp_dim=64, num_layers=3)
    model = Transformer(cfg)
    state = jax.eval_shape(
        lambda k: model.init(k, jnp.zeros((1, 32), jnp.int32))["params"], jax.random.key(0)
    )

    def step(state, batch):
        return jax.grad(lambda p: loss_fn(meshplan.unbox(p), batch, model=model))(state)

    batch = jax.ShapeDtypeStruct((8, 32), jnp.int32)
    assert runs_stages(step, state, batch, layouts.get_layout(layout))
