"""``meshplan.search_layouts`` and ``meshplan search``: rejection, ranking, budget, measuring."""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import optax
import pytest

import meshplan
import meshplan.layouts
from meshplan._search.measure.hlo import measure_step
from meshplan.models.mlp import LogicalMLP, init_fn
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from meshplan.train.settings import TrainSettings
from meshplan.train.state import abstract_train_state


def boxed(shape: tuple[int, ...], names: tuple[str, ...]) -> meshplan.LogicallyPartitioned:
    return meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)


def big_params() -> dict:
    """One 4 MiB matrix and a bias: FSDP can split both over any 8-device mesh."""
    return {"params": {"w": boxed((1024, 1024), ("embed", "mlp")), "b": boxed((1024,), ("embed",))}}


def test_a_dimension_the_mesh_does_not_divide_is_rejected_with_the_reason():
    result = meshplan.search_layouts({"params": {"w": boxed((1024, 6), ("embed", "mlp"))}}, 4)
    row = result.row("1x4", "tensor_parallel")
    assert row.status == "rejected" and row.rank is None and row.bytes_per_device is None
    assert row.reason == (
        "params/w: dim 1 ('mlp') of size 6 does not divide by 4 (mesh axis 'model' of size 4)"
    )
    assert result.row("2x2", "tensor_parallel").status == "ok"  # 6 splits over model=2
    statuses = [r.status for r in result.rows]
    assert statuses == sorted(statuses)  # the ok rows first, then the rejected ones
    assert "rejected: params/w: dim 1 ('mlp') of size 6" in str(result)


def test_a_batch_that_does_not_divide_over_the_batch_axes_is_rejected():
    result = meshplan.search_layouts(big_params(), 4, batch=2)
    for mesh in ("1x4", "2x2", "4x1"):  # data_parallel splits the batch over all 4 devices
        row = result.row(mesh, "data_parallel")
        assert row.status == "rejected"
        assert row.reason.startswith("batch: dim 0 ('batch') of size 2 does not divide by 4")
    assert result.row("2x2", "tensor_parallel").status == "ok"  # batch over data=2 only
    assert result.row("4x1", "tensor_parallel").status == "rejected"


def test_rules_that_split_the_batch_over_an_axis_the_mesh_lacks_are_rejected():
    rules = (("batch", "dp"), ("embed", "data"))
    result = meshplan.search_layouts(big_params(), 4, {"mine": rules}, batch=6)
    for mesh in ("1x4", "2x2", "4x1"):
        row = result.row(mesh, "mine")
        assert row.status == "rejected" and row.rank is None
        assert row.reason.startswith("rules[0]: rule 0 ('batch', 'dp') names mesh axis 'dp'")
    assert result.best is None


def test_fsdp_ranks_before_data_parallel_for_big_parameters():
    result = meshplan.search_layouts(big_params(), 8, batch=32)
    assert (result.best.layout, result.best.mesh_text, result.best.rank) == ("fsdp", "1x8", 1)
    for mesh in ("1x8", "2x4", "4x2", "8x1"):
        fsdp, dp = result.row(mesh, "fsdp"), result.row(mesh, "data_parallel")
        assert fsdp.bytes_per_device * 8 == dp.bytes_per_device == (1024 * 1024 + 1024) * 4
        assert fsdp.rank < dp.rank
    ok = [r for r in result.rows if r.status == "ok"]
    assert [r.rank for r in ok] == list(range(1, len(ok) + 1))
    assert [r.bytes_per_device for r in ok] == sorted(r.bytes_per_device for r in ok)


def test_the_communication_estimate_follows_the_layout():
    result = meshplan.search_layouts(big_params(), 8)
    param_bytes = (1024 * 1024 + 1024) * 4
    # Data parallel: every gradient all-reduced, nothing gathered, no activation traffic.
    assert result.row("2x4", "data_parallel").comm == {
        "all-gather": 0,
        "gradient-reduce": param_bytes,
        "activations": 0,
    }
    # FSDP: the 1/8 shards gathered, the whole gradient reduced.
    assert result.row("2x4", "fsdp").comm == {
        "all-gather": param_bytes // 8,
        "gradient-reduce": param_bytes,
        "activations": 0,
    }
    # Tensor parallel: activation all-reduces are unknown statically.
    tp = result.row("2x4", "tensor_parallel")
    assert tp.comm["activations"] is None and "activations n/a" in tp.comm_text
    # On 8x1 the model axis has size 1: fsdp_tp is plain FSDP over data, fully known.
    assert result.row("8x1", "fsdp_tp").comm["activations"] == 0


def test_an_idle_mesh_axis_is_noted_and_ranks_after_real_parallelism():
    # Only 'embed' names: tensor_parallel splits nothing over 'model', and on 1x8 its
    # batch goes over data=1: the 8 devices all do the same work, with no communication.
    result = meshplan.search_layouts({"params": {"b": boxed((1024,), ("embed",))}}, 8)
    idle, dp = result.row("1x8", "tensor_parallel"), result.row("1x8", "data_parallel")
    assert idle.idle_axes == ("model",) and idle.comm["gradient-reduce"] == 0
    assert idle.reason == "idle 'model': its 8 positions do the same work"
    assert idle.bytes_per_device == dp.bytes_per_device and idle.rank > dp.rank
    assert dp.idle_axes == () and dp.reason == ""
    assert "idle 'model'" in str(result)


def test_a_memory_budget_puts_what_does_not_fit_last_and_best_fits():
    budget = 1 << 20  # FSDP's 0.5 MiB fits, data parallel's 4 MiB does not
    result = meshplan.search_layouts(big_params(), 8, memory_budget_bytes=budget)
    assert result.best.fits and result.best.bytes_per_device <= budget
    dp = result.row("2x4", "data_parallel")
    assert dp.status == "ok" and dp.fits is False
    assert dp.reason == "over the budget by 3.00 MiB"
    ok = [r for r in result.rows if r.status == "ok"]
    fits = [r.fits for r in ok]
    assert fits == sorted(fits, reverse=True) and True in fits and False in fits
    nothing = meshplan.search_layouts(big_params(), 8, memory_budget_bytes=1024)
    assert nothing.best is None
    assert "best: none" in str(nothing)
    assert nothing.to_dict()["best"] is None


def test_to_dict_is_plain_json():
    result = meshplan.search_layouts(big_params(), 4, batch=8, memory_budget_bytes=2 << 20)
    data = json.loads(json.dumps(result.to_dict()))
    assert data["schema"] == "meshplan.search/1"
    assert (data["devices"], data["batch"], data["memory_budget_bytes"]) == (4, 8, 2 << 20)
    assert data["best"]["mesh_text"] == "1x4" and data["best"]["layout"] == "fsdp"
    assert data["best"]["rules"][0] == ["batch", ["data", "model"]]
    assert data["best"]["mesh"] == {"data": 1, "model": 4}


def test_measure_compiles_the_step_and_finds_the_data_parallel_all_reduce():
    model = LogicalMLP(num_layers=1, depth=64, use_scan=False)
    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    init = functools.partial(init_fn, model=model, optimizer=optax.adam(1e-3))
    state = jax.eval_shape(init, jax.random.key(0), x)

    def step(state, x):
        grads = jax.grad(lambda p: state.apply_fn({"params": p}, x).sum())(state.params)
        return state.apply_gradients(grads=grads)

    layouts = {"data_parallel": meshplan.layouts.data_parallel}
    result = meshplan.search_layouts(
        state, 8, layouts, measure=True, step_fn=step, example_batch=x, top_k=1
    )
    assert result.batch == 8  # taken from the example batch
    first, second = result.rows[0], result.rows[1]
    assert first.measured is not None and second.measured is None
    param_bytes = 2 * 64 * 64 * 4
    assert first.comm["gradient-reduce"] == param_bytes
    assert first.measured["collectives"]["all-reduce"] >= param_bytes
    assert first.measured["xla_argument_bytes"] > 0
    assert "measured comm" in str(result)


def test_measure_needs_a_step_and_an_example_batch():
    with pytest.raises(meshplan.ArgumentError, match="step_fn= and example_batch="):
        meshplan.search_layouts(big_params(), 8, measure=True)


@pytest.mark.slow
def test_measuring_several_layouts_in_one_process_traces_each_under_its_own_rules():
    # JAX's trace cache does not know meshplan's active rules: a step traced under fsdp
    # must not be reused, with fsdp's activation constraints, for fsdp_tp on the same mesh.
    model = Transformer(config_from_name("tiny", num_layers=1))
    tx = optax.adam(1e-3)
    state = abstract_train_state(model, tx, TrainSettings(batch=8, seq_len=16))
    tokens = jax.ShapeDtypeStruct((8, 17), jnp.int32)

    def make_step():
        def step(state, tokens):
            return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

        return step

    mesh = {"data": 2, "model": 4}
    step = make_step()
    fsdp = measure_step(step, state, tokens, mesh, meshplan.layouts.fsdp)
    after_fsdp = measure_step(step, state, tokens, mesh, meshplan.layouts.fsdp_tp)
    fresh = measure_step(make_step(), state, tokens, mesh, meshplan.layouts.fsdp_tp)
    # The layouts move different bytes, so a reused trace would show here.
    assert fsdp["collectives"] != fresh["collectives"]
    assert after_fsdp["collectives"] == fresh["collectives"]


def test_a_top_k_below_one_is_refused():
    with pytest.raises(meshplan.ArgumentError, match=r"positive top_k, got top_k=-3"):
        meshplan.search_layouts(big_params(), 4, top_k=-3)
