"""Sharding constraints written in logical axis names."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
from jax.sharding import PartitionSpec

from meshplan._errors import UnmatchedLogicalAxisError, error_for
from meshplan._spmd.mesh_info import JaxMesh
from meshplan._spmd.place import active_mesh, apply_spec
from meshplan._spmd.rules import (
    UNASSIGNED,
    LogicalNames,
    LogicalRules,
    LogicalSpecTree,
    get_logical_axis_rules,
    resolve,
)
from meshplan._types import Leaf

__all__ = ["RulesFallback", "logical_dot_general", "with_logical_constraint"]

T = TypeVar("T")


class RulesFallback(enum.Enum):
    """What a constraint does when a logical name matches no rule.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> x, rules = jnp.ones((8, 4)), (("batch", "data"),)  # no rule for 'embed'
        >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        ...     print(meshplan.with_logical_constraint(x, ("batch", "embed"), rules).sharding.spec)
        ...     try:
        ...         meshplan.with_logical_constraint(
        ...             x, ("batch", "embed"), rules, fallback=meshplan.RulesFallback.RAISE_ERROR)
        ...     except meshplan.UnmatchedLogicalAxisError as e:
        ...         print(str(e).splitlines()[0])
        P('data', None)
        Axis names ('batch', 'embed') did not match a rule: ('embed',) has no rule in ...
    """

    AXIS_IS_UNSHARDED = "axis_is_unsharded"
    """Treat the dimension as unsharded (``None``)."""
    RAISE_ERROR = "raise_error"
    """Raise :class:`UnmatchedLogicalAxisError`."""
    NO_CONSTRAINT = "no_constraint"
    """Leave the value unconstrained."""


def _is_axis_entry(x: object) -> bool:
    return isinstance(x, str) or x is PartitionSpec.UNCONSTRAINED or x is None


def _is_logical_spec(x: object) -> bool:
    return (
        x is None
        or isinstance(x, PartitionSpec)
        or (isinstance(x, tuple) and all(_is_axis_entry(e) for e in x))
    )


def _constrain_one(
    spec: Any, x: Leaf, *, rules: LogicalRules, mesh: JaxMesh | None, fallback: RulesFallback
) -> Leaf:
    if spec is None:
        return x
    resolved = resolve(spec, rules)
    unmatched = [n for n, r in zip(tuple(spec), resolved, strict=True) if r is UNASSIGNED]
    if unmatched:
        if fallback is RulesFallback.RAISE_ERROR:
            raise error_for(
                UnmatchedLogicalAxisError,
                "unmatched-name",
                str(unmatched[0]),
                f"Axis names {tuple(spec)!r} did not match a rule: {tuple(unmatched)!r} "
                f"has no rule in {tuple(rules)!r}",
                f"Add a rule for it (e.g. ({unmatched[0]!r}, None) to keep it unsharded), or "
                f"use fallback=RulesFallback.AXIS_IS_UNSHARDED.",
            )
        if fallback is RulesFallback.NO_CONSTRAINT:
            return x
    mesh_spec = PartitionSpec(*(None if r is UNASSIGNED else r for r in resolved))
    return apply_spec(x, mesh_spec, mesh, what=f"a value constrained to {tuple(spec)!r}")


def with_logical_constraint(
    x: T,
    logical_axis_resources: LogicalSpecTree,
    rules: LogicalRules | None = None,
    mesh: jax.sharding.Mesh | None = None,
    fallback: RulesFallback = RulesFallback.AXIS_IS_UNSHARDED,
) -> T:
    """``with_sharding_constraint`` written in logical axis names.

    The logical names are mapped to mesh axes by ``rules`` (or the active
    ones). It does nothing when no rules are given or active, when the spec
    is ``None``, or when no mesh is given or active. On an ``Explicit`` mesh it
    reshards (``jax.sharding.reshard``) instead of constraining.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> rules = (("batch", "data"), ("embed", "model"))
        >>> with jax.set_mesh(mesh):
        ...     y = jax.jit(lambda x: meshplan.with_logical_constraint(
        ...         x * 2, ("batch", "embed"), rules))(jnp.ones((8, 16)))
        >>> y.sharding.spec
        P('data', 'model')

    Args:
        x: An array or a tree of arrays.
        logical_axis_resources: Logical names per dimension (a tuple or
            ``PartitionSpec``), ``None``, or a tree of those matching ``x``.
        rules: Rules to use instead of the active ones.
        mesh: Mesh to use instead of the active one.
        fallback: What to do with a logical name that matches no rule.

    Returns:
        ``x`` with the constraint applied.
    """
    if rules is None:
        rules = get_logical_axis_rules()
    if not rules or logical_axis_resources is None:
        return x
    if mesh is None and active_mesh() is None:
        return x

    def one(spec: object, value: object) -> Leaf:
        return _constrain_one(spec, value, rules=rules, mesh=mesh, fallback=fallback)

    # tree_map is typed as returning Any: the result is x's tree, each leaf constrained.
    if _is_logical_spec(logical_axis_resources):
        return cast(T, jax.tree_util.tree_map(lambda v: one(logical_axis_resources, v), x))
    return cast(T, jax.tree_util.tree_map(one, logical_axis_resources, x, is_leaf=_is_logical_spec))


def explicit_out_sharding(
    logical_names: LogicalNames | PartitionSpec, rules: LogicalRules | None = None
) -> PartitionSpec | None:
    """The mesh spec of ``logical_names`` when the active mesh has Explicit axes, else None.

    On an Explicit mesh an op whose output sharding is ambiguous (a contraction
    over a sharded dimension) needs ``out_sharding=``; on an Auto mesh the
    compiler chooses. Pass this to such ops to write one model for both:
    ``jnp.dot(y, w, out_sharding=meshplan.explicit_out_sharding(('batch', 'embed')))``.

    Example:
        >>> import jax, meshplan
        >>> meshplan.explicit_out_sharding(("batch", "embed"), (("batch", "data"),)) is None
        True
        >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        ...     meshplan.explicit_out_sharding(("batch", "embed"), (("batch", "data"),))
        P('data', None)
    """
    from jax.sharding import AxisType

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AxisType.Explicit not in tuple(mesh.axis_types):
        return None
    if rules is None:
        rules = get_logical_axis_rules()
    resolved = resolve(logical_names, rules)
    return PartitionSpec(*(None if r is UNASSIGNED else r for r in resolved))


def logical_dot_general(
    out_names: LogicalNames | PartitionSpec, rules: LogicalRules | None = None
) -> Callable[..., object]:
    """A ``dot_general`` for Flax layers whose output is sharded by logical names.

    On an Explicit mesh, a contraction over a dimension split in both operands (a
    row-parallel kernel: ``nn.DenseGeneral(axis=(-2, -1))`` over ``heads``, or an
    attention output projection) is ambiguous and JAX asks for ``out_sharding``. Flax
    layers take the contraction as ``dot_general=`` (``nn.Dense``, ``nn.DenseGeneral``,
    ``nn.Einsum``) or ``out_dot_general_cls=`` (``nn.MultiHeadDotProductAttention``):
    this one passes :func:`explicit_out_sharding` of ``out_names`` (``None``, the
    compiler's choice, on an Auto mesh).

    Example:
        >>> import flax.linen as nn, jax, jax.numpy as jnp, meshplan
        >>> rules = (("batch", "data"), ("heads", "model"))
        >>> init = meshplan.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("heads", "kv", "embed"))
        >>> out = nn.DenseGeneral(16, axis=(-2, -1), kernel_init=init,
        ...     dot_general=meshplan.logical_dot_general(("batch", "embed")))
        >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))), \\
        ...         meshplan.logical_axis_rules(rules):
        ...     x = jnp.ones((8, 4, 8), out_sharding=jax.P("data", "model"))
        ...     print(jax.jit(out.init_with_output)(jax.random.key(0), x)[0].sharding.spec)
        P('data', None)
    """

    def dot_general(
        lhs: Any,
        rhs: Any,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
        **kwargs: object,
    ) -> object:
        kwargs.setdefault("out_sharding", explicit_out_sharding(out_names, rules))
        return jax.lax.dot_general(
            lhs,
            rhs,
            dimension_numbers,
            precision=precision,
            preferred_element_type=preferred_element_type,
            **kwargs,
        )

    return dot_general
