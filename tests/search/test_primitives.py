"""Primitives beyond matmuls, priced as XLA runs them: convolutions' FLOPs."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import meshplan
from meshplan._search.rule_search import linen_step
from meshplan._search.trace import trace_workload

_INIT = nn.initializers.lecun_normal()


class _CNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        for features in (16, 32):
            x = nn.Conv(features, (3, 3), kernel_init=meshplan.with_logical_partitioning(
                _INIT, (None, None, None, "mlp")))(x)  # fmt: skip
            x = nn.relu(nn.GroupNorm(8)(x))
        return nn.Dense(10)(x.mean((1, 2)))


def test_convolutions_are_counted_as_xla_counts_their_flops():
    images = jax.ShapeDtypeStruct((16, 16, 16, 3), jnp.float32)
    labels = jax.ShapeDtypeStruct((16,), jnp.int32)

    def loss(logits, batch):
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    state, step, batch = linen_step(_CNN(), (images, labels), loss, optax.adam(1e-3))
    work = trace_workload(step, state, batch)
    xla = jax.jit(step).lower(state, batch).compile().cost_analysis()
    xla = xla[0] if isinstance(xla, list) else xla
    # XLA counts the elementwise ops too, and no multiply of a padded window position.
    assert 0.8 * xla["flops"] < work.flops < 1.25 * xla["flops"]
