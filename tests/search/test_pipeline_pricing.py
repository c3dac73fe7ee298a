"""The planner's price of a pipeline (``meshplan._search.predict.pipeline``): the bubble, the sends
between stages over the link the stage axis crosses, each stage's memory, and published
pipelined runs (``benchmarks/published_pipeline.py``) within 25%."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan._search.predict.pipeline import block_fraction, predict_pipeline
from meshplan._search.predict.profiles import get_profile
from meshplan._search.predict.trace import trace_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import published_pipeline

RULES = (("batch", "data"), ("stage", "pipeline"), ("layer", "pipeline"), ("embed", None))


@pytest.fixture(scope="module")
def work():
    w = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((16, 2048, 2048), jnp.bfloat16), ("layer", "embed", "mlp")
    )

    def loss(w, x):
        return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0].sum()

    x = jax.ShapeDtypeStruct((512, 2048), jnp.bfloat16)
    return trace_workload(lambda s, x: jax.grad(loss)(s["w"].value, x), {"w": w}, x)


def test_more_microbatches_shrink_the_bubble_as_the_schedule_says(work):
    h100 = get_profile("h100")
    mesh = {"pipeline": 4, "data": 2}
    times, sends = {}, {}
    for m in (4, 16, 64):
        pp = predict_pipeline(work, mesh, RULES, h100, microbatches=m)
        assert pp.schedule.bubble == pytest.approx(3 / (m + 3))
        assert pp.bubble_s == pytest.approx(
            (pp.base.compute_s + pp.base.memory_s) * pp.block_fraction / 4 * 3 / m
        )
        times[m], sends[m] = pp.cost.step_s - pp.send_s, pp.send_s
    assert times[4] > times[16] > times[64]  # the bubble shrinks ...
    assert sends[4] < sends[16] < sends[64]  # ... and each iteration's sends add a latency
    circular = predict_pipeline(work, mesh, RULES, h100, microbatches=4, repeats=2)
    assert circular.schedule.bubble == pytest.approx(3 / 11)


def test_each_stage_holds_its_share_of_the_layers(work):
    pp = predict_pipeline(
        work, {"pipeline": 4, "data": 2}, RULES, get_profile("h100"), microbatches=8
    )
    assert block_fraction(work) == 1.0
    assert pp.cost.state_bytes * 4 == pp.base.state_bytes
    assert pp.cost.flops_per_device * 4 == pytest.approx(pp.base.flops_per_device)
    assert pp.cost.comm_bytes["collective-permute"] == pp.send_bytes > 0


def test_sends_cross_the_slow_link_when_stages_sit_on_other_hosts(work):
    h100 = get_profile("h100")  # 8 GPUs a host
    inside = predict_pipeline(work, {"pipeline": 4, "data": 2}, RULES, h100, microbatches=8)
    across = predict_pipeline(work, {"pipeline": 4, "data": 8}, RULES, h100, microbatches=8)
    assert (inside.link, across.link) == ("fast", "slow")
    assert across.send_s / across.send_bytes > inside.send_s / inside.send_bytes


def test_rules_without_a_stage_axis_are_refused(work):
    with pytest.raises(ValueError, match="no mesh axis of more than one device"):
        predict_pipeline(
            work, {"data": 8}, (("batch", "data"),), get_profile("h100"), microbatches=8
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["Megatron-LM 145.6B (PP 8)", "BLOOM-176B (PP 12)"])
def test_a_published_pipelined_run_is_predicted_within_25_percent_and_fits(name):
    row = next(r for r in published_pipeline.pipeline_rows() if r.name == name)
    result = published_pipeline.run_pipeline_row(row)
    assert abs(result["error"]) <= 0.25, result
    assert result["fits"], result


def _stack(layers, width, rows, budget=None, profile="h100"):
    """A search of a scanned stack of ``layers`` square weights, and its pipeline verdict."""
    from meshplan._search.search.pipeline_verdict import pipeline_verdict

    w = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16), ("layer", "embed", "mlp")
    )

    def loss(w, x):
        x = meshplan.with_logical_constraint(x, ("batch", "embed"))
        h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
        return h.astype(jnp.float32).sum()

    x = jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
    work = trace_workload(lambda s, x: jax.grad(loss)(s["w"].value, x), {"w": w}, x)

    def search(devices):
        result = meshplan.search_rules(
            devices, workload=work, profile=profile, compile_top=0, memory_budget_bytes=budget
        )
        return result, pipeline_verdict(result)

    return search


def test_a_pipeline_across_hosts_pays_where_the_search_best_reduces_over_infiniband():
    result, verdict = _stack(16, 8192, 4096)(16)  # two 8-GPU hosts
    assert verdict.proposed and verdict.kind == "communication", verdict.reason
    assert verdict.terms["communication"] < 0
    assert "pipeline pays" in verdict.reason and "over the slow link" in verdict.reason
    best = result.best  # the search's own top row is the pipeline, with its schedule
    assert best is verdict.with_row and best.mesh["pipeline"] == 2  # a stage per host
    assert best.pipeline.link == "slow" and best.pipeline.schedule.microbatches == 16
    assert best.cost.step_s < verdict.without_row.cost.step_s
    row = result.to_dict()["best"]
    assert row["layout"] in ("pipeline", "pp_tp") and row["pipeline"]["stages"] == 2
    assert row["pipeline"]["bubble"] == pytest.approx(1 / 17)


def test_a_pipeline_does_not_pay_where_compute_dominates_and_the_gradients_are_small():
    result, verdict = _stack(8, 256, 65536)(8)  # one host: no slow link to spare
    assert not verdict.proposed, verdict.reason
    assert verdict.kind in ("communication", "compute"), verdict.reason
    assert verdict.terms["compute"] > 0  # the bubble
    assert "pipeline does not pay" in verdict.reason and "bubble" in verdict.reason
    assert verdict.with_row.status == "ok" and verdict.with_row.rank > result.best.rank


def test_the_pipeline_is_the_only_layout_that_fits_when_no_weight_dimension_divides():
    # 1001 = 7 x 11 x 13: no data, FSDP or tensor axis of 8 devices splits a weight; the
    # 8 layers of 2 MB each split over stages.
    result, verdict = _stack(8, 1001, 256, budget=12 * 2**20)(8)
    assert verdict.proposed and verdict.kind == "memory", verdict.reason
    assert verdict.without_row is None and verdict.min_memory_without > 12 * 2**20
    assert "without a pipeline nothing fits" in verdict.reason
    assert result.best.layout in ("pipeline", "pp_fsdp") and result.best.pipeline is not None
    assert result.best.cost.memory_bytes <= 12 * 2**20
    assert all(r.pipeline is not None for r in result.ok)


def test_a_multi_slice_search_puts_the_pipeline_across_the_slices():
    # 512 TPU v5e chips: two 256-chip slices joined by DCN.
    result, verdict = _stack(32, 8192, 8192, profile="tpu_v5e")(512)
    assert verdict.proposed, verdict.reason
    best = result.best
    assert best.mesh["pipeline"] == 2 and best.pipeline.link == "slow"
    assert next(iter(best.mesh)) == "pipeline"  # the outer axis: the one across DCN


def test_no_pipeline_splits_three_layers_over_eight_devices():
    result, verdict = _stack(3, 1024, 256)(8)
    assert (verdict.proposed, verdict.kind) == (False, "absent")
    assert "splits 3 layers" in verdict.reason
    assert result.pipeline_absent is not None
    assert not any(r.pipeline is not None for r in result.rows)
