"""Attention priced as flash kernels run it: its own efficiency, causal blocks skipped, the
backward's recompute of the scores; the trace tells attention's matmuls and masks apart."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan._search.predict import attention
from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import get_profile, with_attention
from meshplan._search.predict.trace import trace_workload

B, S, D, H = 8, 512, 256, 4
RULES = (("batch", "data"), ("heads", None), ("embed", None), ("kv", None))


def _attention_step(causal: bool):
    """One attention layer written with ``jax.nn.dot_product_attention`` (no meshplan model)."""
    box = meshplan.LogicallyPartitioned
    state = {
        n: box(jax.ShapeDtypeStruct((D, H, D // H), jnp.bfloat16), ("embed", "heads", "kv"))
        for n in ("q", "k", "v")
    }

    def step(state, x):
        def loss(p):
            q, k, v = (jnp.einsum("bse,ehd->bshd", x, p[n].value) for n in ("q", "k", "v"))
            out = jax.nn.dot_product_attention(q, k, v, is_causal=causal).astype(jnp.float32)
            return jnp.square(out).sum()  # not linear in p·v: its forward is no dead code

        return jax.grad(loss)(state)

    return step, state, jax.ShapeDtypeStruct((B, S, D), jnp.bfloat16)


@pytest.fixture(scope="module")
def works():
    return {c: trace_workload(*_attention_step(c)) for c in (True, False)}


def test_the_trace_marks_a_causal_mask_and_not_a_full_one(works):
    assert works[True].causal_masks == frozenset({(S, S)})
    assert works[False].causal_masks == frozenset()
    # q·kᵀ and dP produce scores; p·v, dV, dQ, dK read them
    kinds = sorted(attention.produces_scores(d) for d in works[True].score_dots)
    assert len(works[True].score_dots) >= 2 and True in kinds and False in kinds


def _compute(work, profile):
    return predict(work, {"data": 8}, RULES, profile).compute_s


def test_a_causal_mask_runs_only_the_blocks_on_and_below_the_diagonal(works):
    h100 = with_attention(get_profile("h100"), "flash")
    block = S // 4  # 4 blocks of keys: 10 of 16 tiles run

    def attention(block: int) -> float:  # compute(eff 0.5) - compute(eff 1): the attention's
        at = [
            dataclasses.replace(h100, causal_block=block, attention_efficiency=e) for e in (0.5, 1)
        ]
        return _compute(works[True], at[0]) - _compute(works[True], at[1])

    full, causal = attention(0), attention(block)
    assert causal / full == pytest.approx(10 / 16, rel=1e-6)
    # a mask that is not causal skips nothing
    assert _compute(works[False], dataclasses.replace(h100, causal_block=block)) == pytest.approx(
        _compute(works[False], dataclasses.replace(h100, causal_block=0))
    )


def test_attention_runs_at_its_own_efficiency_with_the_backward_recompute(works):
    h100 = dataclasses.replace(with_attention(get_profile("h100"), "flash"), causal_block=0)
    work = works[False]
    # attention's time is its FLOPs / (efficiency x peak): differences against efficiency 1
    # leave the weights' matmuls out: F/peak x (1/0.5 - 1) and F/peak x (1/0.25 - 1)
    weights = _compute(work, dataclasses.replace(h100, attention_efficiency=1.0))
    fast = _compute(work, dataclasses.replace(h100, attention_efficiency=0.5)) - weights
    slow = _compute(work, dataclasses.replace(h100, attention_efficiency=0.25)) - weights
    assert slow / fast == pytest.approx(3.0, rel=1e-6)
    # the unfused program's 6 score matmuls, and a 7th: the flash backward's q·kᵀ
    qk = 2 * B * S * S * D / 8  # one score matmul's FLOPs per device
    assert fast * h100.peak_flops == pytest.approx(7 * qk, rel=1e-6)


def test_without_fused_attention_the_scores_are_weight_matmuls_and_memory_traffic(works):
    cpu_like = dataclasses.replace(get_profile("h100"), fused_attention=False, causal_block=128)
    cost = predict(works[True], {"data": 8}, RULES, cpu_like)
    plain = predict(works[True], {"data": 8}, RULES, dataclasses.replace(cpu_like, causal_block=0))
    assert cost.compute_s == plain.compute_s  # no kernel: nothing skipped, nothing recomputed


def test_a_kernel_bound_by_its_scores_runs_a_smaller_head_dim_at_a_smaller_efficiency(works):
    """A v5e's Pallas kernels take the same time per score at head dimension 64 as at 128:
    below ``attention_head_dim`` the efficiency scales with ``d`` (here 64); from it, it is
    ``attention_efficiency`` (the kernel's FLOPs bound it)."""
    h100 = with_attention(get_profile("h100"), "flash")

    def compute(efficiency: float, head_dim: int) -> float:
        at = dataclasses.replace(h100, attention_efficiency=efficiency, attention_head_dim=head_dim)
        return _compute(works[True], at)

    at_own = compute(0.3, 64) - compute(0.6, 64)  # A / 0.3 - A / 0.6 = A / 0.6
    at_half = compute(0.3, 128) - compute(0.3, 64)  # A / 0.15 - A / 0.3 = A / 0.3
    assert at_half / at_own == pytest.approx(2, rel=1e-6)
    assert compute(0.3, 16) == pytest.approx(compute(0.3, 0), rel=1e-9)  # d = 64 >= 16
    v5e = get_profile("tpu_v5e")  # measured: 0.16, 0.30 and 0.35 at 64, 128 and 256
    efficiency = [
        v5e.attention_efficiency * min(1, d / v5e.attention_head_dim) for d in (64, 128, 256)
    ]
    assert efficiency == pytest.approx([0.15, 0.30, 0.35], abs=0.01)
