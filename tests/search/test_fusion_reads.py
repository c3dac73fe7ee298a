"""The bytes XLA's loop fusions read (``_search/predict/fusion_reads.py``), against XLA:CPU."""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import optax

from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import get_profile
from meshplan._search.predict.trace import trace_workload

_TX = optax.adam(1e-3)


def _adam_step(state, grads):
    updates, opt = _TX.update(grads, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}


def _adam():
    params = {"w": jnp.zeros((256, 512)), "b": jnp.zeros((512,))}
    state = {"params": params, "opt": _TX.init(params)}
    return state, jax.tree.map(jnp.ones_like, params)


def test_adams_update_moves_the_bytes_xla_cpu_counts_for_it():
    state, grads = _adam()
    work = trace_workload(_adam_step, state, grads)
    written, read = sum(work.traffic.values()), sum(work.fusion_reads.values())
    cost = jax.jit(_adam_step).lower(state, grads).compile().cost_analysis()
    xla = (cost[0] if isinstance(cost, list) else cost)["bytes accessed"]
    # three kernels per parameter, each reading its buffers: ~10x the parameter's bytes
    assert read > 2 * written
    assert abs((written + read) / xla - 1) < 0.05, (written, read, xla)


def test_only_a_profile_that_says_so_prices_what_fusions_read():
    state, grads = _adam()
    work = trace_workload(_adam_step, state, grads)
    h100 = get_profile("h100")
    cpu_like = h100.__class__(**{**h100.to_dict(), "fusion_reads": True})
    without = predict(work, {"data": 1}, (), h100)
    with_reads = predict(work, {"data": 1}, (), cpu_like)
    total = sum(work.traffic.values()) + sum(work.fusion_reads.values())
    assert without.memory_s == sum(work.traffic.values()) / h100.memory_bandwidth
    assert with_reads.memory_s == total / h100.memory_bandwidth


_EMBED_SPLIT = (
    ("batch", ("data",)),
    ("embed", "tensor"),
    ("heads", "tensor"),
    ("mlp", "tensor"),
    ("kv", None),
)


def _array_bytes(text: str) -> int:
    """Bytes of the arrays an HLO shape names (``f32[4,64,128]{1,0,2}``; tuples summed)."""
    item = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1}
    total = 0
    for dtype, dims in re.findall(r"\b(f32|s32|bf16|f16|pred)\[([\d,]*)\]", text):
        total += item[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _copies_of_gathers(hlo: str) -> tuple[int, int]:
    """``(copies, bytes)`` of the loop fusions that copy an all-gather's result, each
    reading and writing it."""
    shapes, copies, moved = {}, 0, 0
    for line in hlo[hlo.index("\nENTRY") :].splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+) = (.+?) (all-gather|fusion)\((.*)", line)
        if not m:
            continue
        name, shape, op, rest = m.groups()
        if op == "all-gather":
            shapes[name] = _array_bytes(shape)
            continue
        operands = re.findall(r"%[\w.\-]+", rest.split("), ")[0])
        if "kind=kLoop" in rest and "copy" in name and len(operands) == 1 and operands[0] in shapes:
            copies += 1
            moved += shapes[operands[0]] + _array_bytes(shape)
    return copies, moved


def test_a_gathered_activation_is_copied_into_the_layout_its_matmul_reads():
    # The suite's ViT with its activations' embed split over tensor (a searched layout):
    # XLA:CPU gathers an activation split on a dimension inside it (heads, mlp, embed) with
    # that dimension outermost, then copies it into the layout each reading matmul reads.
    from meshplan._search.measure.hlo import compile_candidate
    from meshplan._search.predict.cost import _dot_cost, _Specs, relayout_bytes
    from xla_suite import suite_step

    state, step, batch = suite_step("vit", 1)
    mesh = {"tensor": 2, "data": 4}
    work = trace_workload(step, state, batch)
    specs = _Specs(mesh, _EMBED_SPLIT)
    params = frozenset(work.param_names)
    predicted = 0
    for dot, count in work.dots.items():
        _, colls, _ = _dot_cost(dot, specs, False, params, dot in work.backward_dots)
        predicted += count * sum(relayout_bytes(specs, c[3], c[2]) for c in colls if c[3])
    compiled, _, _ = compile_candidate(step, state, batch, mesh, _EMBED_SPLIT)
    copies, xla = _copies_of_gathers(compiled.as_text())
    assert copies >= 8, copies
    assert abs(predicted / xla - 1) < 0.2, (predicted, xla)
    # the same matmuls on data parallelism gather nothing: no copy priced
    dp = _Specs({"data": 8}, (("batch", "data"),))
    assert not any(
        relayout_bytes(dp, c[3], c[2])
        for dot in work.dots
        for c in _dot_cost(dot, dp, False, params)[1]
        if c[3]
    )


def test_xla_cpu_gathers_an_activation_no_constraint_names_again_for_the_backward():
    # The same ViT and layout: each activation a matmul gathers (split on embed, heads or
    # mlp) is gathered for the forward matmul and again for the weight gradient's, as no
    # logical constraint names it (XLA:CPU keeps the gathered copy of a named one).
    import dataclasses

    from meshplan._search.measure.hlo import collective_bytes, compile_candidate
    from meshplan._search.predict.cost import predict
    from meshplan._search.predict.profiles import BACKENDS, get_profile
    from xla_suite import suite_step

    state, step, batch = suite_step("vit", 1)
    mesh = {"tensor": 2, "data": 4}
    work = trace_workload(step, state, batch, read_constraints=True)
    assert not any(named for _, both, named in work.arrays if both)
    cpu = dataclasses.replace(get_profile("h100"), **BACKENDS["cpu"], regather=False)
    compiled, _, _ = compile_candidate(step, state, batch, mesh, _EMBED_SPLIT)
    gathered = collective_bytes(compiled.as_text())["all-gather"]
    assert predict(work, mesh, _EMBED_SPLIT, cpu).comm_bytes["all-gather"] == gathered
    once = dataclasses.replace(cpu, regathers_unnamed=False)
    assert predict(work, mesh, _EMBED_SPLIT, once).comm_bytes["all-gather"] < gathered
