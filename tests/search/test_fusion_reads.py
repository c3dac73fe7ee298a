"""The bytes XLA's loop fusions read (``_search/predict/fusion_reads.py``), against XLA:CPU."""

from __future__ import annotations

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
