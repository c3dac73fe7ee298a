"""The planner's memory per device against XLA's ``memory_analysis()`` of compiled steps.

A Llama-style decoder (``meshplan.models.llama``) compiled here on 8 CPU devices, under
remat none, full and dots-saveable, scanned or looped, data parallel, FSDP and tensor
parallel. The arguments (state and batch) must match exactly; the temporaries (what the
step keeps for its backward pass and its largest transient) within 20%, or, where the
model is known to miss by more, the case is listed as such (``xfail`` with why).
"""

from __future__ import annotations

import functools

import pytest

from meshplan._search.measure.hlo import measure_step
from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import get_profile
from meshplan._search.predict.trace import trace_workload
from meshplan.models.llama import LlamaConfig, llama_step
from xla_suite import AS_ON_ACCELERATORS, CPU_LIKE, LAYOUTS

# The layouts, the compile options and the CPU-like profile are the suite's (xla_suite.py),
# shared with tests/search/test_xla_suite.py.

# Where the planner misses by more than 20%: none. (Full remat under FSDP was 1.7x until the
# model held the layers' unreduced weight gradients until their combined reduction, as
# XLA's combiner makes it: 1.13x; dots-saveable unrolled 1.9-2.4x until the residuals that
# jax.checkpoint(prevent_cse=True) passes through a no-op reduce_precision were counted as
# the saved matmuls' buffers: 1.05-1.18x; full remat, unrolled, tensor parallel 2.4x until
# the profile's combines_remat_collectives: 1.21x. XLA's all-reduce combiner on CPU, the
# pass cpu-all-reduce-combiner, merges each layer's rematerialised partial-sum all-reduce
# with the forward pass's own: 75.0 MiB of temporaries, 47.2 with that pass disabled; the
# model's hoisted values add 30.7 MiB to its 31.3.)
MISSES: dict[tuple[str, bool, str], str] = {}

CASES = [
    pytest.param(
        remat,
        scan,
        layout,
        marks=[pytest.mark.xfail(reason=MISSES[(remat, scan, layout)], strict=True)]
        if (remat, scan, layout) in MISSES
        else [],
        id=f"{remat}-{'scan' if scan else 'loop'}-{layout}",
    )
    for remat in ("none", "full", "dots")
    for scan in (True, False)
    for layout in LAYOUTS
]
# Full remat of unrolled layers keeps each layer's input for the backward pass: deeper.
# With CASES' 4 layers, a prediction flat in the depth fails here (it once gave 4, 8 and 16
# layers alike). 16 layers under FSDP: the deepest the issue asks for, where the held
# gradient shards once put the prediction at 0.79 of XLA's.
DEEP = [
    *(pytest.param(8, layout, id=f"full-loop-8-layers-{layout}") for layout in ("dp", "fsdp")),
    pytest.param(16, "fsdp", id="full-loop-16-layers-fsdp"),
]


@functools.cache
def _step(remat: str, scan: bool, layers: int = 4):
    cfg = LlamaConfig(
        embed=256,
        heads=8,
        kv_heads=8,
        head_dim=32,
        mlp=1024,
        layers=layers,
        vocab=1024,
        remat=remat,
        scan=scan,
        dtype="float32",
    )
    state, step, batch = llama_step(cfg, 16, 256)
    return state, step, batch, trace_workload(step, state, batch)


@pytest.mark.parametrize(("remat", "scan", "layout"), CASES)
@pytest.mark.slow
def test_memory_per_device_matches_xla_memory_analysis(remat, scan, layout):
    _check(remat, scan, layout, 4)


@pytest.mark.parametrize(("layers", "layout"), DEEP)
@pytest.mark.slow
def test_unrolled_full_remat_keeps_each_layers_input(layers, layout):
    _check("full", False, layout, layers)


def _check(remat: str, scan: bool, layout: str, layers: int) -> None:
    state, step, batch, work = _step(remat, scan, layers)
    mesh, rules = LAYOUTS[layout]
    cost = predict(work, mesh, rules, CPU_LIKE)
    xla = measure_step(step, state, batch, mesh, rules, True, AS_ON_ACCELERATORS)
    assert cost.state_bytes + cost.batch_bytes == xla["xla_argument_bytes"]
    predicted = cost.activation_bytes + cost.temporary_bytes
    assert abs(predicted - xla["xla_temp_bytes"]) <= 0.2 * xla["xla_temp_bytes"]


def test_remat_keeps_less_than_no_remat_and_fused_attention_keeps_no_scores():
    *_, none = _step("none", True)
    *_, full = _step("full", True)
    mesh, rules = LAYOUTS["fsdp"]
    h100 = get_profile("h100")
    kept = {name: predict(w, mesh, rules, h100) for name, w in (("none", none), ("full", full))}
    assert kept["full"].activation_bytes < kept["none"].activation_bytes / 2
    unfused = predict(none, mesh, rules, get_profile("cpu"))
    assert kept["none"].activation_bytes < unfused.activation_bytes  # no [b, h, s, s] scores


def test_a_layer_inputs_partial_sums_are_held_for_one_combined_all_reduce():
    """Under tensor parallelism the gradient of an input three projections read (q/k/v) is
    three partial sums; XLA:CPU all-reduces them in one combined all-reduce (a tuple of
    three, compiled), so all three are alive until it runs, and its three results beside
    them: the planner's temporaries within 20% of XLA's (1.10; 0.70 before it held them)."""
    import jax
    import jax.numpy as jnp

    import meshplan
    from meshplan._search.measure.hlo import compile_candidate

    w = jax.ShapeDtypeStruct((64, 256), jnp.float32)
    state = {p: meshplan.LogicallyPartitioned(w, ("embed", "heads")) for p in "qkv"}
    state["in"] = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((64, 64), jnp.float32), (None, "embed")
    )

    def step(state, x):
        def loss(p):
            y = jnp.tanh(x @ p["in"])  # the layer input whose gradient is summed
            h = jnp.tanh(y @ p["q"]) * jnp.tanh(y @ p["k"]) * jnp.tanh(y @ p["v"])
            return (h**2).sum()

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    mesh, rules = {"data": 2, "tensor": 4}, (("batch", "data"), ("heads", "tensor"))
    hlo = compile_candidate(step, state, x, mesh, rules)[0].as_text()
    assert "all-reduce(" in hlo and "(f32[128,64]{1,0}, f32[128,64]{1,0}, f32[128,64]" in hlo
    cost = predict(trace_workload(step, state, x), mesh, rules, CPU_LIKE)
    xla = measure_step(step, state, x, mesh, rules, True, AS_ON_ACCELERATORS)
    predicted = cost.activation_bytes + cost.temporary_bytes
    assert abs(predicted - xla["xla_temp_bytes"]) <= 0.2 * xla["xla_temp_bytes"]
