"""The active mesh, and applying a ``PartitionSpec`` to a value on Auto or Explicit meshes."""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from meshplan._errors import LogicalNamesError, MeshError
from meshplan._spmd.rules import mesh_axes_of

__all__ = ["active_mesh", "apply_spec"]


def _legacy_mesh() -> Mesh | None:
    """The mesh of a legacy ``with mesh:`` block (JAX keeps it apart from ``jax.set_mesh``)."""
    try:
        from jax._src.mesh import thread_resources
    except ImportError:  # pragma: no cover - a JAX without the legacy context
        return None
    mesh = thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def active_mesh() -> Any:
    """The mesh in effect: ``jax.set_mesh(...)``'s, else a legacy ``with mesh:``'s, else None.

    Example:
        >>> import meshplan
        >>> meshplan.active_mesh() is None
        True
    """
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        return abstract
    return _legacy_mesh()


def _axis_types(mesh: Any) -> tuple[Any, ...]:
    return tuple(getattr(mesh, "axis_types", ()) or ())


def split_count(entry: Any, sizes: Mapping[str, int]) -> int:
    """How many parts the mesh axes of one ``PartitionSpec`` entry cut a dimension into.

    Example:
        >>> from meshplan._spmd.mesh import split_count
        >>> split_count(("data", "model"), {"data": 2, "model": 4}), split_count(None, {})
        (8, 1)
    """
    return math.prod(sizes[a] for a in mesh_axes_of(entry))


def uneven_dimensions(
    shape: tuple[int, ...], spec: Any, sizes: Mapping[str, int]
) -> list[tuple[int, tuple[str, ...], int]]:
    """``(dimension, mesh axes, parts)`` of every dimension ``spec`` cannot split evenly.

    Dimensions mapped to an axis that ``sizes`` lacks are left to the caller.

    Example:
        >>> from meshplan._spmd.mesh import uneven_dimensions
        >>> uneven_dimensions((6, 8), ("model", "data"), {"data": 2, "model": 4})
        [(0, ('model',), 4)]
    """
    out = []
    for dim, (size, entry) in enumerate(zip(shape, tuple(spec), strict=False)):
        axes = mesh_axes_of(entry)
        if any(a not in sizes for a in axes):
            continue
        parts = split_count(entry, sizes)
        if size % parts:
            out.append((dim, axes, parts))
    return out


def check_rank(spec: PartitionSpec, shape: tuple[int, ...], what: str, *, exact: bool) -> None:
    """Raises when ``spec`` has more entries than ``shape`` has dimensions (or differs, if exact)."""
    n = len(spec)
    if n > len(shape) or (exact and n != len(shape)):
        raise LogicalNamesError(
            f"{what} gives {n} axis names {tuple(spec)!r} for an array of rank {len(shape)} "
            f"(shape {tuple(shape)}).\nGive exactly one name (or None) per dimension."
        )


def _fill_unconstrained(value: Any, spec: PartitionSpec) -> PartitionSpec:
    """Explicit meshes have no 'unconstrained': keep the value's current sharding there."""
    if not any(e is PartitionSpec.UNCONSTRAINED for e in spec):
        return spec
    current = tuple(jax.typeof(value).sharding.spec)
    current = current + (None,) * (len(spec) - len(current))
    return PartitionSpec(
        *(c if e is PartitionSpec.UNCONSTRAINED else e for e, c in zip(spec, current, strict=False))
    )


def check_axes_exist(spec: PartitionSpec, mesh: Any, context: str) -> None:
    """Raises :class:`MeshError` when ``spec`` names mesh axes that ``mesh`` lacks.

    Example:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> from meshplan._spmd.mesh import check_axes_exist
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> check_axes_exist(P("data", "model"), mesh, "spec")  # fine: returns None
        >>> check_axes_exist(P("modle"), mesh, "spec")
        Traceback (most recent call last):
        ...
        meshplan.MeshError: spec: the mesh {'data': 2, 'model': 4} has no axis 'modle'.
        Did you mean 'model'? Use the mesh's axis names ('data', 'model'), or map logical names to them with rules.
    """
    missing = [a for e in spec for a in mesh_axes_of(e) if a not in mesh.axis_names]
    if missing:
        guess = [g for a in missing for g in difflib.get_close_matches(a, mesh.axis_names, n=1)]
        raise MeshError(
            f"{context}: the mesh {dict(mesh.shape)} has no axis "
            f"{', '.join(map(repr, missing))}.\n"
            + (f"Did you mean {guess[0]!r}? " if guess else "")
            + f"Use the mesh's axis names {tuple(mesh.axis_names)!r}, or map logical names "
            f"to them with rules."
        )


def apply_spec(value: Any, spec: PartitionSpec, mesh: Any = None, *, what: str = "value") -> Any:
    """Constrains ``value`` to ``spec`` on ``mesh`` (or the active mesh).

    On a mesh whose axes are ``Auto`` this is ``jax.lax.with_sharding_constraint``;
    on one whose axes are ``Explicit`` it is ``jax.sharding.reshard``. With no mesh
    given and none active, the value is returned unchanged.
    """
    abstract = jax.sharding.get_abstract_mesh()
    if mesh is not None:
        target, named = mesh, isinstance(mesh, Mesh)
    elif not abstract.empty:
        target, named = abstract, False  # JAX resolves a bare spec against the context mesh
        if not isinstance(value, jax.core.Tracer):
            # Outside jit a bare spec fails on a single-device value: use the concrete mesh.
            try:
                concrete = jax.sharding.get_mesh()
            except ValueError:  # under a trace (jit, eval_shape) with a constant value
                concrete = None
            if concrete is not None and not concrete.empty:
                target, named = concrete, True
    else:
        target, named = _legacy_mesh(), True
        if target is None:
            return value
    shape = getattr(value, "shape", None)
    if shape is not None:
        check_rank(spec, tuple(shape), what, exact=False)
    check_axes_exist(spec, target, f"Cannot constrain {what} to {spec}")
    types = set(_axis_types(target))
    if types <= {AxisType.Auto}:
        sharding = NamedSharding(target, spec) if named else spec
        return jax.lax.with_sharding_constraint(value, sharding)
    if types == {AxisType.Explicit}:
        spec = _fill_unconstrained(value, spec)
        return jax.sharding.reshard(value, NamedSharding(target, spec) if named else spec)
    raise MeshError(
        f"Cannot constrain {what} to {spec} on a mesh with mixed axis types "
        f"{dict(zip(target.axis_names, _axis_types(target), strict=True))}.\n"
        f"Use a mesh whose axes are all Auto or all Explicit "
        f"(jax.make_mesh(..., axis_types=(AxisType.Explicit,) * n))."
    )
