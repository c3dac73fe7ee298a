"""Mixture-of-experts routing: top-k choices, capacity, dispatch and combine tensors, the aux loss.

The GShard/Switch recipe, as pure functions of arrays (the Linen and the NNX
Transformers call them alike). Each sequence of a batch is one *group*: its
``length`` tokens are routed together, and each expert takes at most
``capacity`` of them (:func:`expert_capacity`). A token's ``k`` choices are
served in order of priority: every token's first choice before any token's
second, then by position. A choice that finds its expert full is *dropped*:
that token's output misses that expert's part (the residual connection still
carries the token), and :func:`route` counts it.

The tensors and their logical names (so that any rules place them):

=====================  ==================================================
``router``              ``('embed', 'expert')``: token -> expert logits
``wi``, ``wo``          ``('expert', 'embed', 'mlp')``, ``('expert', 'mlp', 'embed')``
dispatch, combine       ``('batch', 'length', 'expert', 'capacity')``
expert inputs           ``('expert', 'expert_batch', 'capacity', 'embed')``
=====================  ==================================================

``expert_batch`` is the batch once the tokens are with their experts: rules
give it the batch's mesh axes less the expert's (:data:`meshplan.layouts.expert_parallel`),
so moving tokens from ``batch``-sharded to ``expert``-sharded is an all-to-all
over the ``expert`` mesh axis, and back after the experts ran.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from meshplan.models.moe import expert_capacity, route
    >>> probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (2, 8, 4)))
    >>> capacity = expert_capacity(8, num_experts=4, top_k=2, capacity_factor=1.0)
    >>> routing = route(probs, top_k=2, capacity=capacity)
    >>> capacity, routing.dispatch.shape, float(routing.dispatch.sum(axis=(2, 3)).max()) <= 2
    (4, (2, 8, 4, 4), True)
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["MOE_AXIS_NAMES", "Routing", "expert_capacity", "route"]

MOE_AXIS_NAMES = ("expert", "expert_batch", "capacity")
"""The logical names a mixture-of-experts block adds to the Transformer's vocabulary."""

Array = jax.Array


class Routing(NamedTuple):
    """What :func:`route` decides for a batch of groups.

    Attributes:
        dispatch: ``[batch, length, expert, capacity]``: 1 where a token takes
            a slot of an expert, else 0.
        combine: The same, weighted by the token's (renormalised) gate.
        aux_loss: The Switch load-balancing loss ``E * sum_e f_e * p_e``
            (``f_e``: the fraction of choices routed to expert ``e``, ``p_e``:
            its mean router probability); 1 when balanced.
        dropped: How many choices (token, expert) found their expert full.
        routed: How many choices there were (``batch * length * top_k``).
    """

    dispatch: Array
    combine: Array
    aux_loss: Array
    dropped: Array
    routed: Array


def expert_capacity(length: int, *, num_experts: int, top_k: int, capacity_factor: float) -> int:
    """Slots per expert per group: ``ceil(capacity_factor * top_k * length / num_experts)``.

    At ``capacity_factor = 1`` a perfectly balanced router drops nothing; at
    ``num_experts / top_k`` nothing is ever dropped.

    Example:
        >>> from meshplan.models.moe import expert_capacity
        >>> expert_capacity(128, num_experts=8, top_k=2, capacity_factor=1.25)
        40
    """
    return max(1, math.ceil(capacity_factor * top_k * length / num_experts))


def route(probs: Array, *, top_k: int, capacity: int) -> Routing:
    """Top-``k`` routing of ``probs[batch, length, expert]`` with ``capacity`` slots per expert.

    Every sequence is a group. The gates of a token's ``k`` choices are
    renormalised to sum to 1 (as GShard's top-2 and Mixtral do).

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan.models.moe import route
        >>> probs = jnp.array([[[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]]])  # 3 tokens, all to expert 0
        >>> r = route(probs, top_k=1, capacity=2)
        >>> r.dispatch[0, :, 0].tolist(), int(r.dropped), int(r.routed)
        ([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]], 1, 3)
    """
    batch, length, experts = probs.shape
    gates, index = jax.lax.top_k(probs, top_k)  # [b, l, k]
    gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
    chosen = jax.nn.one_hot(index, experts, dtype=jnp.int32)  # [b, l, k, e]
    # Priority: all first choices, then all second choices, ...; by position within each.
    by_priority = jnp.swapaxes(chosen, 1, 2).reshape(batch, top_k * length, experts)
    slot = jnp.cumsum(by_priority, axis=1) - 1  # the slot each choice would take
    kept = (by_priority > 0) & (slot < capacity)
    slot = jnp.swapaxes(slot.reshape(batch, top_k, length, experts), 1, 2)  # [b, l, k, e]
    kept = jnp.swapaxes(kept.reshape(batch, top_k, length, experts), 1, 2)
    taken = jax.nn.one_hot(slot, capacity, dtype=probs.dtype) * kept[..., None]  # [b,l,k,e,c]
    dispatch = jnp.sum(taken, axis=2)
    combine = jnp.sum(taken * gates[:, :, :, None, None].astype(probs.dtype), axis=2)
    fraction = jnp.mean(jnp.sum(chosen, axis=2).astype(jnp.float32), axis=(0, 1)) / top_k
    mean_prob = jnp.mean(probs.astype(jnp.float32), axis=(0, 1))
    aux_loss = experts * jnp.sum(fraction * mean_prob)
    routed = jnp.asarray(batch * length * top_k, jnp.float32)
    dropped = routed - jnp.sum(kept.astype(jnp.float32))
    return Routing(dispatch, combine, aux_loss, dropped, routed)
