"""A step of N accumulated microbatches: FSDP's gathers and gradient reductions per
microbatch, replicated gradients reduced once, one microbatch's activations, and the
accumulator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import get_profile
from meshplan._search.predict.step import split_batch
from meshplan._search.predict.trace import trace_workload

D, BATCH = 1024, 256
FSDP = (("batch", "data"), ("embed", "data"), ("mlp", None))
DP = (("batch", "data"), ("embed", None), ("mlp", None))


def _mlp():
    box = meshplan.LogicallyPartitioned
    state = {
        "wi": box(jax.ShapeDtypeStruct((D, 4 * D), jnp.float32), ("embed", "mlp")),
        "wo": box(jax.ShapeDtypeStruct((4 * D, D), jnp.float32), ("mlp", "embed")),
    }

    def step(state, x):
        def loss(p):
            h = jax.nn.gelu(x @ p["wi"].value)
            return ((h @ p["wo"].value) ** 2).mean()

        return jax.grad(loss)(state)

    return step, state, jax.ShapeDtypeStruct((BATCH, D), jnp.float32)


@pytest.fixture(scope="module")
def micro():
    """The workload of one of 4 microbatches, and of the whole batch."""
    step, state, batch = _mlp()
    names = lambda b: ("batch", "embed")  # noqa: E731  (the features are the weights' embed)
    return (
        trace_workload(step, state, split_batch(batch, 4), batch_names=names),
        trace_workload(step, state, batch, batch_names=names),
    )


def test_fsdp_gathers_and_reduce_scatters_per_microbatch_with_one_microbatch_of_activations(
    micro,
):
    one, whole = micro
    h100 = get_profile("h100")
    mesh = {"data": 8}
    single = predict(one, mesh, FSDP, h100)
    four = predict(one, mesh, FSDP, h100, microbatches=4)
    assert four.compute_s == pytest.approx(4 * single.compute_s)
    assert four.flops_per_device == pytest.approx(predict(whole, mesh, FSDP, h100).flops_per_device)
    # the weights gathered and their sharded gradients reduced per microbatch
    assert {"all-gather", "all-reduce"} <= set(four.comm_bytes)
    assert four.comm_bytes == {k: 4 * v for k, v in single.comm_bytes.items()}
    # activations of one microbatch, far below the whole batch's; the accumulator: the
    # f32 gradients of both weights in their FSDP shards
    assert four.activation_bytes == single.activation_bytes
    assert four.activation_bytes < predict(whole, mesh, FSDP, h100).activation_bytes
    assert four.accumulator_bytes == 2 * D * 4 * D * 4 // 8
    assert four.memory_bytes == single.memory_bytes + four.accumulator_bytes + 3 * (
        single.batch_bytes
    )


def test_an_fsdp_mlp_is_predicted_with_the_collective_kinds_xla_compiles(micro):
    from meshplan._search.measure.hlo import measure_step

    one, _ = micro
    step, state, batch = _mlp()
    compiled = measure_step(step, state, split_batch(batch, 4), {"data": 8}, FSDP)
    predicted = predict(one, {"data": 8}, FSDP, get_profile("h100")).comm_bytes
    assert set(predicted) == set(compiled["collectives"])


def test_replicated_gradients_are_all_reduced_once_per_step_as_ddp_does(micro):
    one, _ = micro
    h100 = get_profile("h100")
    single = predict(one, {"data": 8}, DP, h100)
    four = predict(one, {"data": 8}, DP, h100, microbatches=4)
    assert four.comm_bytes == single.comm_bytes == {"all-reduce": 2 * D * 4 * D * 4}


def test_search_rules_prices_the_accumulated_step_and_reports_the_whole_batch():
    step, state, batch = _mlp()
    result = meshplan.search_rules(
        8, state, step, batch, profile="h100", compile_top=0, microbatches=4
    )
    whole = meshplan.search_rules(8, state, step, batch, profile="h100", compile_top=0)
    assert result.batch == whole.batch == BATCH
    assert result.best.cost.accumulator_bytes > 0
    assert result.best.cost.flops_per_device == pytest.approx(whole.best.cost.flops_per_device)


@pytest.mark.parametrize(("microbatches", "fragment"), [(3, "do not divide"), (0, "at least 1")])
def test_a_bad_number_of_microbatches_is_refused_naming_it(microbatches, fragment):
    step, state, batch = _mlp()
    with pytest.raises(meshplan.ArgumentError, match=fragment) as info:
        meshplan.search_rules(
            8, state, step, batch, profile="h100", compile_top=0, microbatches=microbatches
        )
    assert [p.code for p in info.value.problems] == ["bad-microbatches"]
