"""The Llama decoder's remat policies: ``full_block`` reruns the whole block, as PyTorch's
checkpoint does, in the compiled program and in the planner's count alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from meshplan.models.llama import REMATS, LlamaConfig, _read_in_backward, llama_step

B, S, E, M, LAYERS = 4, 128, 256, 1024, 2
DOWN = 2 * B * S * M * E  # one down-projection's forward FLOPs


def _flops(remat: str) -> tuple[float, float]:
    """The planner's FLOPs and XLA's for one step (layers unrolled: XLA counts each)."""
    cfg = LlamaConfig(embed=E, mlp=M, layers=LAYERS, remat=remat, scan=False, dtype="float32")
    state, step, tokens = llama_step(cfg, B, S)
    work = meshplan.trace_workload(step, state, tokens, read_constraints=True)
    planned = meshplan.predict(workload=work, mesh={"data": 1}, rules=(), profile="h100")
    compiled = jax.jit(step).lower(state, tokens).compile()
    return planned.cost.flops_per_device, compiled.cost_analysis()["flops"]


def test_full_block_reruns_the_down_projection_that_full_leaves_out():
    (plan_full, xla_full), (plan_block, xla_block) = _flops("full"), _flops("full_block")
    assert plan_block - plan_full == LAYERS * DOWN
    assert xla_block - xla_full == pytest.approx(LAYERS * DOWN, rel=0.01)


def test_full_block_keeps_what_full_keeps():
    cfgs = [LlamaConfig(layers=LAYERS, remat=r, dtype="float32") for r in ("full", "full_block")]
    steps = [llama_step(c, B, S) for c in cfgs]  # (state, step, tokens)
    works = [meshplan.trace_workload(step, state, tokens) for state, step, tokens in steps]
    memory = [
        meshplan.predict(workload=w, mesh={"data": 1}, rules=(), profile="h100").memory_bytes
        for w in works
    ]
    assert memory[0] == memory[1]
    assert "full_block" in REMATS


def test_the_value_read_in_the_backward_leaves_the_gradient_as_it_was():
    z = jax.random.normal(jax.random.PRNGKey(0), (3, 5))
    plain = jax.grad(lambda z: jnp.sin(z).sum())(z)
    read = jax.grad(lambda z: jnp.sin(_read_in_backward(z)).sum())(z)
    np.testing.assert_array_equal(read, plain)
