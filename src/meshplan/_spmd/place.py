"""Placing a value: the active mesh, and a ``PartitionSpec`` applied on Auto or Explicit meshes."""

from __future__ import annotations

import math
from typing import Any, TypeVar, cast

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from meshplan._errors import LogicalNamesError, MeshError, error_for, error_from_problems
from meshplan._spmd.mesh_info import JaxMesh, mesh_info
from meshplan._spmd.validate import check_leaf

T = TypeVar("T")

__all__ = ["UnevenShardWarning", "active_mesh", "apply_spec"]


def _legacy_mesh() -> Mesh | None:
    """The mesh of a legacy ``with mesh:`` block (JAX keeps it apart from ``jax.set_mesh``)."""
    try:
        from jax._src.mesh import thread_resources
    except ImportError:  # pragma: no cover - a JAX without the legacy context
        return None
    mesh = thread_resources.env.physical_mesh
    return None if mesh.empty else mesh


def active_mesh() -> JaxMesh | None:
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


def _axis_types(mesh: JaxMesh) -> tuple[object, ...]:
    return tuple(getattr(mesh, "axis_types", ()) or ())


def _fill_unconstrained(value: object, spec: PartitionSpec) -> PartitionSpec:
    """Explicit meshes have no 'unconstrained': keep the value's current sharding there."""
    if not any(e is PartitionSpec.UNCONSTRAINED for e in spec):
        return spec
    current = tuple(jax.typeof(value).sharding.spec)
    current = current + (None,) * (len(spec) - len(current))
    return PartitionSpec(
        *(c if e is PartitionSpec.UNCONSTRAINED else e for e, c in zip(spec, current, strict=False))
    )


class UnevenShardWarning(UserWarning):
    """A dimension an Explicit mesh cannot split evenly was left unsharded (:func:`apply_spec`)."""


def _divisible(spec: PartitionSpec, mesh: JaxMesh, what: str, shape: Any) -> PartitionSpec:
    """``spec`` without the axes of any dimension they do not divide, with a warning.

    An ``Auto`` mesh pads such a dimension; ``jax.sharding.reshard`` on an ``Explicit``
    one refuses it. The common case is Flax's ``model.init(key, jnp.zeros((1, ...)))``:
    a batch of one constrained to ``('batch', ...)``. The value is then left unsharded
    along that dimension, and a warning says so.
    """
    if shape is None:
        return spec
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    entries, dropped, splits = list(spec), [], [1]
    for i, (entry, size) in enumerate(zip(entries, shape, strict=False)):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        split = 1
        for a in axes:
            split *= sizes.get(a, 1)
        if split > 1 and size % split:
            dropped.append(f"dimension {i} (size {size}) over {'x'.join(axes)} ({split} ways)")
            entries[i] = None
            splits.append(split)
    if not dropped:
        return spec
    import warnings

    warnings.warn(
        f"{what}: on an Explicit mesh {'; '.join(dropped)} cannot be split evenly, so it is "
        f"left unsharded here (an Auto mesh would pad it). Use sizes divisible by the mesh "
        f"axes (e.g. model.init with a batch of {math.lcm(*splits)}), "
        f"or initialise through jax.eval_shape and jit(init, out_shardings=...).",
        UnevenShardWarning,
        stacklevel=4,
    )
    return PartitionSpec(*entries)


def check_spec(spec: PartitionSpec, mesh: JaxMesh, what: str, shape: Any = None) -> None:
    """Raises for what the validator finds wrong with a mesh ``spec`` for one array on ``mesh``.

    More names than the array has dimensions is a :class:`LogicalNamesError`; a
    mesh axis the mesh lacks, or one used twice, a :class:`MeshError`. Fewer names
    than dimensions are fine (the rest are unsharded), and sizes that do not
    divide are left to the caller (``meshplan.check`` reports them).

    Example:
        >>> import jax
        >>> from jax.sharding import PartitionSpec as P
        >>> from meshplan._spmd.place import check_spec
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> check_spec(P("data", "model"), mesh, "w")  # fine: returns None
        >>> check_spec(P("modle"), mesh, "w")
        Traceback (most recent call last):
        ...
        meshplan.MeshError: Cannot lay out w as P('modle',) on the mesh {'data': 2, 'model': 4}:
          * dim 0 names mesh axis 'modle', which the mesh {'data': 2, 'model': 4} does not have
        Did you mean 'model'? Use the mesh's axis names ('data', 'model'), or map logical names to them with rules.
    """
    info = mesh_info(mesh)
    shape = None if shape is None else tuple(shape)
    leaf = check_leaf("mesh", tuple(spec), shape, (), (), info)
    errors = [p for p in leaf.errors if p.code != "indivisible"]
    if errors:
        error = LogicalNamesError if errors[0].code == "rank" else MeshError
        raise error_from_problems(
            error, f"Cannot lay out {what} as {spec} on the mesh {info.shape}:", errors
        )


def apply_spec(
    value: T, spec: PartitionSpec, mesh: JaxMesh | None = None, *, what: str = "value"
) -> T:
    """Constrains ``value`` to ``spec`` on ``mesh`` (or the active mesh).

    On a mesh whose axes are ``Auto`` this is ``jax.lax.with_sharding_constraint``;
    on one whose axes are ``Explicit`` it is ``jax.sharding.reshard``. With no mesh
    given and none active, the value is returned unchanged.
    """
    abstract = jax.sharding.get_abstract_mesh()
    target: JaxMesh | None
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
    check_spec(spec, target, what, getattr(value, "shape", None))
    types = set(_axis_types(target))
    if types <= {AxisType.Auto}:
        sharding = NamedSharding(target, spec) if named else spec
        # with_sharding_constraint and reshard are unannotated in JAX; both return the value
        # (an array, or a tree of them) as it came in, with the new sharding.
        return cast(T, jax.lax.with_sharding_constraint(value, sharding))
    if types == {AxisType.Explicit}:
        spec = _divisible(
            _fill_unconstrained(value, spec), target, what, getattr(value, "shape", None)
        )
        return cast(T, jax.sharding.reshard(value, NamedSharding(target, spec) if named else spec))
    raise error_for(
        MeshError,
        "mixed-axis-types",
        what,
        f"Cannot constrain {what} to {spec} on a mesh with mixed axis types "
        f"{dict(zip(target.axis_names, _axis_types(target), strict=True))}",
        "Use a mesh whose axes are all Auto or all Explicit "
        "(jax.make_mesh(..., axis_types=(AxisType.Explicit,) * n)).",
    )
