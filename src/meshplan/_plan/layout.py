"""Laying out one leaf: each dimension's mesh axes (and why), its problems, and its bytes.

:func:`build_layout` depends only on (kind, names, shape, dtype, rules, mesh),
so :func:`meshplan.explain` builds it once for all the leaves that share those.
"""

from __future__ import annotations

import math

import numpy as np
from jax.typing import DTypeLike

from meshplan._plan.records import DimPlan, LeafLayout
from meshplan._plan.shards import uneven_device_bytes
from meshplan._spmd.mesh_info import MeshInfo
from meshplan._spmd.rules import AxisNames, NamesKind
from meshplan._spmd.validate import check_leaf

__all__ = ["build_layout"]


def _itemsize(dtype: DTypeLike) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:
            size = 0
    return int(size)


def build_layout(
    kind: NamesKind,
    names: AxisNames | None,
    shape: tuple[int, ...] | None,
    dtype: DTypeLike,
    rules: tuple[tuple[str, object], ...],
    index_map: tuple[int, ...],
    mesh: MeshInfo,
) -> LeafLayout:
    """The layout of a leaf: every dimension's placement, the leaf's problems, its bytes.

    Never raises on bad names: a wrong rank, names the rules cannot resolve,
    unknown or repeated mesh axes and uneven splits become ``issues``.

    Args:
        kind: ``'logical'``, ``'mesh'`` or ``'unboxed'``.
        names: The names on the box (``None`` when unboxed).
        shape: The array's shape (``None`` for a spec without a shape).
        dtype: The array's dtype (``None`` without a shape).
        rules: Valid rules, normalised.
        index_map: For each of ``rules``, its index in the rules as given.
        mesh: The mesh.

    Returns:
        A :class:`LeafLayout`.
    """
    leaf = check_leaf(kind, names, shape, rules, index_map, mesh)
    if any(p.code == "bad-shape" for p in leaf.problems):
        shape = None  # reported; no bytes are counted for a shape that is none
    dims = [DimPlan.of(d) for d in leaf.dims]
    spec = leaf.spec
    itemsize = _itemsize(dtype)
    total_shards = math.prod(d.shards for d in dims)
    replication = max(mesh.size // total_shards, 1)
    if shape is None:
        shard_shape, nbytes, per_device, device_bytes = None, 0, 0, None
    else:
        shard_shape = tuple(d.shard_size or 0 for d in dims)
        nbytes = math.prod(shape) * itemsize
        per_device = math.prod(shard_shape) * itemsize
        device_bytes = None
        if not all(d.divides for d in dims):
            device_bytes = uneven_device_bytes(dims, mesh, itemsize)
            per_device = int(device_bytes.max(initial=0))
    return LeafLayout(
        kind=kind,
        names=None if names is None else tuple(names),
        shape=None if shape is None else tuple(int(s) for s in shape),
        dtype=str(dtype),
        itemsize=itemsize,
        dims=tuple(dims),
        spec=spec,
        shard_shape=shard_shape,
        bytes=nbytes,
        bytes_per_device=per_device,
        replication=replication,
        device_bytes=device_bytes,
        issues=leaf.problems,
    )
