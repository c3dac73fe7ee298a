"""Laying out one leaf: each dimension's mesh axes (and why), its problems, and its bytes.

:func:`build_layout` depends only on (kind, names, shape, dtype, rules, mesh),
so :func:`meshplan.explain` builds it once for all the leaves that share those.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from meshplan._plan.records import DimPlan, LeafLayout
from meshplan._plan.shards import uneven_device_bytes
from meshplan._spmd.mesh_info import MeshInfo, axis_names_fix
from meshplan._spmd.rules import (
    UNASSIGNED,
    UNCONSTRAINED,
    SkippedRule,
    _axes_of,
    resolve_with_trace,
)
from meshplan._text import axes_text

__all__ = ["build_layout"]


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:
            size = 0
    return int(size)


def build_layout(
    kind: str,
    names: tuple[Any, ...] | None,
    shape: tuple[int, ...] | None,
    dtype: Any,
    rules: tuple[tuple[str, Any], ...],
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
    issues: list[tuple[str, str, str]] = []
    sizes = mesh.shape
    ndim = len(shape) if shape is not None else len(names or ())
    work_names: tuple[Any, ...] = (None,) * ndim if names is None else tuple(names)
    if shape is not None and names is not None and len(names) != ndim:
        issues.append(
            (
                "rank",
                f"{len(names)} axis names {tuple(names)!r} for an array of rank {ndim} "
                f"(shape {tuple(shape)})",
                f"Give exactly one name (or None) per dimension: {ndim} names.",
            )
        )
        work_names = (work_names + (None,) * ndim)[:ndim]

    trace = None
    if kind == "logical":
        try:
            trace = resolve_with_trace(work_names, rules)
        except (ValueError, TypeError) as e:
            head, _, fix = str(e).partition("\n")
            issues.append(
                ("names", head.rstrip("."), fix or "Give one axis name (or None) per dimension.")
            )
            work_names = (None,) * ndim
            trace = resolve_with_trace(work_names, ())

    dims: list[DimPlan] = []
    entries: list[Any] = []
    used: dict[str, int] = {}
    for i, name in enumerate(work_names):
        size = None if shape is None else int(shape[i])
        rule_index = rule = None
        skipped: tuple[SkippedRule, ...] = ()
        if kind == "unboxed":
            entry, status = None, "unboxed"
        elif trace is not None:
            res = trace[i]
            entry = None if res.mesh_axes is UNASSIGNED else res.mesh_axes
            skipped = tuple(
                SkippedRule(index_map[s.rule_index], s.rule, s.reason, s.taken_by)
                for s in res.skipped
            )
            if name is None:
                status = "unnamed"
            elif name is UNCONSTRAINED or entry is UNCONSTRAINED:
                status = "unconstrained"
            elif res.mesh_axes is UNASSIGNED:
                status = "no-rule"
            else:
                status = "rule"
                rule_index = index_map[res.rule_index] if res.rule_index is not None else None
                rule = rules[res.rule_index] if res.rule_index is not None else None
        else:
            entry = name
            status = (
                "unnamed" if name is None else "unconstrained" if name is UNCONSTRAINED else "mesh"
            )
        entries.append(entry)
        axes = _axes_of(entry)
        missing = tuple(a for a in axes if a not in sizes)
        dup = tuple(a for a in axes if a in used)
        for a in dup:
            issues.append(
                (
                    "duplicate-axis",
                    f"mesh axis {a!r} is used by dims {used[a]} and {i}",
                    "Use each mesh axis for at most one dimension of an array.",
                )
            )
        for a in axes:
            used.setdefault(a, i)
        if missing and kind == "mesh":
            issues.append(
                (
                    "unknown-axis",
                    f"dim {i} names mesh axis {axes_text(missing)}, which the mesh "
                    f"{mesh.shape} does not have",
                    axis_names_fix(missing, mesh),
                )
            )
        axis_sizes = tuple(sizes.get(a, 0) for a in axes)
        shards = math.prod(sizes[a] for a in axes if a in sizes and a not in dup)
        shard_size = None if size is None else -(-size // shards)
        dims.append(
            DimPlan(
                i, size, name, axes, shards, shard_size, status, rule_index, rule,
                skipped, missing, dup, axis_sizes,
            )
        )  # fmt: skip

    for d in dims:
        if not d.divides:
            named = kind == "logical" and isinstance(d.name, str)
            where = f"dim {d.index}" + (f" ({d.name!r})" if named else "")
            issues.append(
                (
                    "indivisible",
                    f"{where} of size {d.size} does not divide by {d.shards} "
                    f"({_axes_with_sizes(d)})",
                    f"Pad dim {d.index} to {d.padded_size} (the nearest multiple of {d.shards}), "
                    f"or map it to mesh axes whose size divides {d.size}.",
                )
            )

    spec = PartitionSpec(*entries)
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
        issues=tuple(issues),
    )


def _axes_with_sizes(d: DimPlan) -> str:
    """``"mesh axis 'model' of size 4"`` or ``"mesh axes 'data'×'model' of sizes 2×4"``."""
    pairs = [(a, s) for a, s in zip(d.mesh_axes, d.axis_sizes, strict=True) if s]
    if len(pairs) == 1:
        return f"mesh axis {pairs[0][0]!r} of size {pairs[0][1]}"
    return (
        f"mesh axes {axes_text(tuple(a for a, _ in pairs))} of sizes "
        f"{'×'.join(str(s) for _, s in pairs)}"
    )
