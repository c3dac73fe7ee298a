"""Context parallelism: how many pieces ``length`` is split into, and the load-balanced order.

With a rule that maps ``length`` to a mesh axis (``('length', 'context')``,
as :data:`meshplan.layouts.context_parallel` has), each device holds a
contiguous piece of every sequence's activations. Under a causal mask the
piece at the end of the sequence attends to every earlier position and the
first piece to almost none: the last device does about ``2N - 1`` times the
attention work of the first. The load-balanced order (MaxText's and Megatron's
"zig-zag") cuts the sequence into ``2N`` chunks and gives shard ``i`` chunks
``i`` and ``2N - 1 - i``: one early and one late chunk each, the same work on
every shard.

The model itself does not care about the order: it reads the position of each
token (:func:`load_balanced_order` gives them) for its rotary or learned
positions and for the causal mask, so a permuted sequence with its permuted
positions gives the permuted logits. The loss is a mean over tokens, so
permuting the inputs and the targets alike leaves it unchanged (up to the order
of a float sum).

Example:
    >>> from meshplan.models.context import load_balanced_order
    >>> load_balanced_order(8, 2).tolist()  # 4 chunks of 2: shard 0 gets 0 and 3, shard 1 1 and 2
    [0, 1, 6, 7, 2, 3, 4, 5]
"""

from __future__ import annotations

import math

import numpy as np

import meshplan

__all__ = ["context_shards", "load_balanced_order"]


def context_shards() -> int:
    """How many pieces the active mesh and rules split the ``length`` of an activation into.

    1 without a mesh, without rules, or when no rule places ``length``.

    Example:
        >>> import jax, meshplan
        >>> from meshplan.models.context import context_shards
        >>> mesh = jax.make_mesh((2, 4), ("data", "context"))
        >>> rules = (("batch", "data"), ("length", "context"))
        >>> with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        ...     context_shards()
        4
        >>> context_shards()
        1
    """
    mesh = meshplan.active_mesh()
    rules = meshplan.get_logical_axis_rules()
    if mesh is None or not rules:
        return 1
    entry = meshplan.logical_to_mesh_axes(("batch", "length"), rules)[1]
    axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
    sizes = dict(mesh.shape)
    return math.prod(int(sizes[a]) for a in axes if a in sizes)


def load_balanced_order(length: int, shards: int) -> np.ndarray:
    """The positions of a sequence of ``length`` in load-balanced order for ``shards`` pieces.

    Position ``order[j]`` goes to slot ``j``; slots ``[i * length / shards, (i
    + 1) * length / shards)`` are shard ``i``'s, holding chunks ``i`` and ``2 *
    shards - 1 - i`` of ``2 * shards`` equal chunks. One shard: ``arange(length)``.

    Example:
        >>> from meshplan.models.context import load_balanced_order
        >>> load_balanced_order(12, 3).tolist()
        [0, 1, 10, 11, 2, 3, 8, 9, 4, 5, 6, 7]
        >>> load_balanced_order(6, 2)
        Traceback (most recent call last):
        ...
        ValueError: A sequence of 6 positions cannot be striped over 2 context shards: ...

    Raises:
        ValueError: ``length`` is not a multiple of ``2 * shards``.
    """
    if shards <= 1:
        return np.arange(length)
    if length % (2 * shards):
        raise ValueError(
            f"A sequence of {length} positions cannot be striped over {shards} context shards: "
            f"load balancing cuts it into {2 * shards} equal chunks.\nUse a sequence length "
            f"that is a multiple of {2 * shards} (e.g. {2 * shards * max(1, length // (2 * shards))})."
        )
    chunks = np.arange(length).reshape(2 * shards, -1)
    pieces = [chunks[i] for j in range(shards) for i in (j, 2 * shards - 1 - j)]
    return np.concatenate(pieces)
