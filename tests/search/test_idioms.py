"""Common JAX idioms in a loss, traced and priced on a 2 x 4 mesh: none stops the planner,
and each primitive is understood (``fft`` is named, priced whole, as an unknown one is)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import meshplan
from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import get_profile

W = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 128), jnp.float32), ("embed", "mlp"))
X = jax.ShapeDtypeStruct((16, 32, 64), jnp.float32)
MESH = {"data": 2, "model": 4}
RULES = (("batch", "data"), ("mlp", "model"), ("length", None))


def _heads(h):
    return h.reshape(16, 32, 4, 32)


IDIOMS = {
    "norm": lambda h: jnp.linalg.norm(h, axis=-1).mean(),
    "logsumexp": lambda h: jax.nn.logsumexp(h, axis=-1).mean(),
    "cumsum": lambda h: jnp.cumsum(h, axis=1).mean(),
    "cumsum_split": lambda h: jnp.cumsum(h, axis=-1).mean(),
    "cond": lambda h: lax.cond(h.sum() > 0, lambda a: a * 2, lambda a: a, h).mean(),
    "fori_loop": lambda h: lax.fori_loop(0, 3, lambda i, a: jnp.sin(a), h).mean(),
    "where": lambda h: jnp.where(h > 0, h, 0.1 * h).mean(),
    "sort": lambda h: jnp.sort(h, axis=-1)[..., -1].mean(),
    "argsort": lambda h: jnp.take_along_axis(h, jnp.argsort(h, axis=-1), -1).mean(),
    "top_k": lambda h: lax.top_k(h, 4)[0].mean(),
    "softmax_where": lambda h: jax.nn.softmax(h, where=h > 0).mean(),
    "einsum_ellipsis": lambda h: jnp.einsum("...d,...d->...", h, h).mean(),
    "scan_reverse": lambda h: lax.scan(
        lambda c, a: (c + a, None), jnp.zeros(h.shape[1:]), h, reverse=True
    )[0].mean(),
    "pad": lambda h: jnp.pad(h, ((0, 0), (1, 1), (0, 0))).mean(),
    "tile": lambda h: (jnp.tile(h[:1], (16, 1, 1)) * h).mean(),  # CLIP's class token
    "roll": lambda h: (jnp.roll(h, 1, axis=1) * h).mean(),
    "fft": lambda h: jnp.abs(jnp.fft.rfft(h, axis=1)).mean(),
    "var": lambda h: h.var(),
    "std_ddof": lambda h: jnp.std(h, axis=-1, ddof=1).mean(),
    "median": lambda h: jnp.median(h, axis=-1).mean(),
    "quantile": lambda h: jnp.quantile(h, 0.9),
    "clip": lambda h: jnp.clip(h, -0.5, 0.5).mean(),
    "max_pool": lambda h: lax.reduce_window(
        h, -jnp.inf, lax.max, (1, 2, 1), (1, 2, 1), "VALID"
    ).mean(),
    "dynamic_slice": lambda h: lax.dynamic_slice_in_dim(h, 3, 8, axis=1).mean(),
    "dynamic_update_slice": lambda h: lax.dynamic_update_slice_in_dim(
        h, jnp.ones((16, 2, 128)), 5, axis=1
    ).mean(),
    "fancy_index": lambda h: h[:, jnp.array([0, 5, 7])].mean(),
    "at_set": lambda h: h.at[:, 3].set(0.0).mean(),
    "segment_sum": lambda h: jax.ops.segment_sum(
        h.reshape(-1, 128), jnp.arange(16 * 32) % 7, 7
    ).mean(),
    "checkpoint_policy": lambda h: jax.checkpoint(
        lambda a: jnp.sin(a) * a, policy=jax.checkpoint_policies.dots_saveable
    )(h).mean(),
    "relu6": lambda h: jax.nn.relu6(h).mean(),
    "glu": lambda h: jax.nn.glu(h, axis=-1).mean(),
    "one_hot_argmax": lambda h: (jax.nn.one_hot(jnp.argmax(h, -1), 128) * h).sum(),
    "complex": lambda h: jnp.abs(h.astype(jnp.complex64) * 1j).mean(),
    "bf16_round_trip": lambda h: h.astype(jnp.bfloat16).astype(jnp.float32).mean(),
    "integer_mask": lambda h: (h * (jnp.arange(128) % 3 == 0)).mean(),
    "triu": lambda h: jnp.triu(h[0, :, :32]).mean(),
    "dot_product_attention": lambda h: jax.nn.dot_product_attention(
        _heads(h), _heads(h), _heads(h), is_causal=True
    ).mean(),
    "vmap": lambda h: jax.vmap(lambda r: r @ r.T)(h).mean(),
    "remat_scan": lambda h: lax.scan(
        jax.checkpoint(lambda c, _: (jnp.sin(c), None)), h, None, length=3
    )[0].mean(),
    "stop_gradient": lambda h: (lax.stop_gradient(h) * h).mean(),
    "map": lambda h: lax.map(lambda r: r.sum(), h).mean(),
    "associative_scan": lambda h: lax.associative_scan(jnp.add, h, axis=1).mean(),
    "exact_gelu": lambda h: jax.nn.gelu(h, approximate=False).mean(),
    "dropout_mask": lambda h: (h * jax.random.bernoulli(jax.random.key(0), 0.9, h.shape)).mean(),
}
NAMED_UNKNOWN = {"fft": {"fft"}}  # priced whole on every device, named in the prediction


@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_a_loss_written_with_a_common_idiom_is_traced_and_priced(idiom):
    def step(state, x):
        def loss(p):
            h = meshplan.with_logical_constraint(x, ("batch", "length", "embed")) @ p["w"]
            return IDIOMS[idiom](jnp.tanh(h))

        return jax.grad(loss)({k: v.value for k, v in state.items()})

    work = meshplan.trace_workload(step, {"w": W}, X, read_constraints=True)
    cost = predict(work, MESH, RULES, get_profile("cpu"))
    assert cost.step_s > 0 and cost.flops_per_device > 0
    assert {prim for prim, _ in work.unpriced} == NAMED_UNKNOWN.get(idiom, set())
