"""From a tree of boxed or abstract values to the ``PartitionSpec``/``NamedSharding`` trees
that ``jax.jit`` takes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from meshplan._errors import (
    LogicalNamesError,
    MeshError,
    MeshplanError,
    Problem,
    error_for,
    error_from_problems,
)
from meshplan._spmd.leaves import is_leaf, is_spec_leaf, leaf_kind
from meshplan._spmd.mesh_info import JaxMesh
from meshplan._spmd.place import active_mesh, check_spec
from meshplan._spmd.rules import LogicalRules, logical_to_mesh_axes, normalize_rules
from meshplan._spmd.tree_check import raise_for_errors, spec_errors, tree_errors
from meshplan._text import path_text
from meshplan._types import Leaf, PyTree

__all__ = [
    "get_partition_spec",
    "get_sharding",
    "logical_to_mesh",
    "logical_to_mesh_sharding",
]

_REPLICATED = PartitionSpec()


def _plain_spec(x: Leaf) -> PartitionSpec | None:
    """The spec of a leaf of no kind: replicated when it is an array, else ``None``."""
    return _REPLICATED if hasattr(x, "shape") else None


def _leaf_problems(path: str, error: MeshplanError) -> list[Problem]:
    """The error's problems at ``path`` (its message as one problem when it has none)."""
    if error.problems:
        return [dataclasses.replace(p, path=path) for p in error.problems]
    return [Problem("error", path, str(error), "", "error")]


def _map_collecting(
    fn: Callable[[object], object], tree: PyTree, is_leaf: Callable[[Leaf], bool]
) -> PyTree:
    """``tree_map`` that, when leaves fail, walks again by path and raises once for all."""
    try:
        return jax.tree_util.tree_map(fn, tree, is_leaf=is_leaf)
    except MeshplanError as e:
        original = e
    problems: list[Problem] = []
    first: MeshplanError | None = None
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        try:
            fn(leaf)
        except MeshplanError as e:
            first = first or e
            problems.extend(_leaf_problems(path_text(keypath), e))
    if first is None:  # no single leaf fails: the error is not about a leaf, so keep it as it is
        raise original
    n = len({p.path for p in problems})
    header = f"{n} lea{'f' if n == 1 else 'ves'} cannot be partitioned:"
    raise error_from_problems(type(first), header, problems)


def _logical_spec(x: Leaf) -> PartitionSpec:
    """``x`` if it is a ``PartitionSpec``; otherwise an error saying what to pass instead."""
    if isinstance(x, PartitionSpec):
        return x
    problem = Problem(
        "error",
        "",
        f"expected a logical PartitionSpec (or None) at each leaf, got {type(x).__name__}: {x!r}",
        "Pass meshplan.get_partition_spec(tree) for a tree of boxes or arrays, or write each "
        "leaf as PartitionSpec('embed', ...), not a tuple.",
        "names",
    )
    raise LogicalNamesError(f"{problem.message}.\n{problem.fix}", [problem])


def _named(mesh: JaxMesh, spec: PartitionSpec, cache: dict[PartitionSpec, NamedSharding]) -> Any:
    sharding = cache.get(spec)
    if sharding is None:
        check_spec(spec, mesh, "an array")
        sharding = cache[spec] = NamedSharding(mesh, spec)
    return sharding


def _mesh_or_active(mesh: JaxMesh | None, caller: str) -> Any:
    """``mesh``, else the mesh of ``jax.set_mesh`` (or a legacy ``with mesh:``), else an error."""
    if mesh is not None:
        return mesh
    try:
        concrete = jax.sharding.get_mesh()
    except ValueError:  # under a trace with an abstract mesh only
        concrete = None
    if concrete is not None and not concrete.empty:
        return concrete
    active = active_mesh()
    if active is not None:
        return active
    raise error_for(
        MeshError,
        "no-mesh",
        "mesh",
        f"{caller} got mesh=None and no mesh is active",
        "Pass a mesh (jax.make_mesh((2, 4), ('data', 'model'))), or call it inside "
        "`with jax.set_mesh(mesh):`.",
    )


def get_partition_spec(tree: PyTree) -> PyTree:
    """Tree of ``PartitionSpec``s for a tree of boxed, array or abstract leaves.

    A box gives its own spec (logical names for logical boxes); an unboxed leaf
    with a ``.shape`` (arrays, ``jax.ShapeDtypeStruct``) gives ``PartitionSpec()``;
    any other leaf gives ``None``.

    A Flax NNX state or module (``nnx.state``, ``nnx.split``) gives what
    ``nnx.get_partition_spec`` gives: the same structure, each variable holding
    its mesh ``PartitionSpec``. Its ``out_sharding`` names go through the
    active rules (and the variable's own ``sharding_rules``) as Linen's do;
    with no rules in effect they are mesh axes, as in Flax NNX (``docs/nnx.md``).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> tree = {"w": meshplan.Partitioned(jnp.ones((4, 8)), ("data", None)),
        ...         "step": jnp.zeros(()), "name": "adam"}
        >>> meshplan.get_partition_spec(tree)
        {'name': None, 'step': P(), 'w': P('data', None)}
        >>> from flax import nnx
        >>> w = nnx.Param(jnp.ones((8, 4)), out_sharding=("embed", "hidden"), eager_sharding=False)
        >>> state = nnx.state(nnx.Dict(w=w))
        >>> with meshplan.logical_axis_rules((("embed", "data"), ("hidden", "model"))):
        ...     specs = meshplan.get_partition_spec(state)
        >>> specs["w"].get_value()
        P('data', 'model')
    """
    cache: dict[object, object] = {}

    def leaf(x: PyTree) -> PyTree:
        kind = leaf_kind(x)
        return _plain_spec(x) if kind is None else kind.spec(x, cache)

    return _map_collecting(leaf, tree, is_leaf)


def get_sharding(tree: PyTree, mesh: jax.sharding.Mesh | None, *, strict: bool = False) -> PyTree:
    """Tree of ``NamedSharding``s on ``mesh``, by the same walk as :func:`get_partition_spec`.

    Non-array leaves (such as a ``TrainState``'s ``apply_fn``) give ``None``.
    Logical boxes are mapped through their own or the active rules. With
    ``strict=True`` the tree is first checked as :func:`meshplan.check` does,
    and every error (a size that does not divide, an unknown mesh axis, ...)
    is raised at once as a ``ShardingValidationError`` naming each path.

    ``mesh=None`` uses the active mesh (``jax.set_mesh``), and is an error when
    none is active. An ``AbstractMesh`` (``mesh.abstract_mesh``) gives shardings
    that ``jax.jit`` accepts only under ``jax.set_mesh`` of a concrete mesh of
    the same shape: outside one, pass the concrete ``Mesh`` (``meshplan.check``
    warns about this with the code ``'abstract-mesh'``).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32),
        ...                                   (None, "model"))}
        >>> meshplan.get_sharding(tree, mesh)["w"].spec
        P(None, 'model')
    """
    mesh = _mesh_or_active(mesh, "get_sharding")
    if strict:
        raise_for_errors(tree_errors(tree, mesh), mesh)
    cache: dict[PartitionSpec, NamedSharding] = {}
    kinds_cache: dict[object, object] = {}

    def named(spec: PartitionSpec) -> NamedSharding:
        sharding: NamedSharding = _named(mesh, spec, cache)
        return sharding

    def leaf(x: PyTree) -> PyTree:
        kind = leaf_kind(x)
        if kind is not None:
            return kind.sharding(x, mesh, named, kinds_cache)
        spec = _plain_spec(x)
        return None if spec is None else named(spec)

    return _map_collecting(leaf, tree, is_leaf)


def logical_to_mesh(tree: PyTree, rules: LogicalRules | None = None) -> PyTree:
    """:func:`logical_to_mesh_axes` over a tree of logical ``PartitionSpec``s.

    Example:
        >>> import meshplan
        >>> from jax.sharding import PartitionSpec as P
        >>> meshplan.logical_to_mesh({"w": P("embed", "hidden"), "step": P()},
        ...                          (("hidden", "model"),))
        {'step': P(), 'w': P(None, 'model')}
    """
    if rules is not None:
        rules = normalize_rules(rules)

    def leaf(x: PyTree) -> PyTree:
        kind = leaf_kind(x)
        if kind is not None and kind.resolve is not None and kind.put is not None:
            return kind.put(x, kind.resolve(x, rules))
        return logical_to_mesh_axes(_logical_spec(x), rules)

    return _map_collecting(leaf, tree, is_spec_leaf)


def logical_to_mesh_sharding(
    tree: PyTree,
    mesh: jax.sharding.Mesh | None,
    rules: LogicalRules | None = None,
    *,
    strict: bool = False,
) -> PyTree:
    """Tree of logical ``PartitionSpec``s to a tree of ``NamedSharding``s on ``mesh``.

    With ``strict=True`` the specs and rules are first checked as
    :func:`meshplan.check` does (rules that are not pairs, rules naming mesh
    axes the mesh lacks, ...; the specs carry no sizes, so divisibility is
    not checked) and every error is raised at once as a
    ``ShardingValidationError``.

    Example:
        >>> import jax, meshplan
        >>> from jax.sharding import PartitionSpec as P
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> out = meshplan.logical_to_mesh_sharding({"w": P("embed", "hidden")}, mesh,
        ...                                        (("hidden", "model"),))
        >>> out["w"].spec
        P(None, 'model')
    """
    mesh = _mesh_or_active(mesh, "logical_to_mesh_sharding")
    if strict:
        raise_for_errors(spec_errors(tree, mesh, rules), mesh)
    if rules is not None:
        rules = normalize_rules(rules)  # once, not per leaf: lists from YAML/JSON become tuples
    cache: dict[PartitionSpec, NamedSharding] = {}

    def leaf(x: PyTree) -> PyTree:  # None is an empty subtree: it stays None
        kind = leaf_kind(x)
        if kind is not None and kind.resolve is not None and kind.put is not None:
            spec = kind.resolve(x, rules)
            return kind.put(x, None if spec is None else _named(mesh, spec, cache))
        return _named(mesh, logical_to_mesh_axes(_logical_spec(x), rules), cache)

    return _map_collecting(leaf, tree, is_spec_leaf)
