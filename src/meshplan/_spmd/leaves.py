"""The one walk over a model's state: every array leaf with its path, kind, names and shape.

This is the seam a front end plugs into. A :class:`LeafKind` says what one kind
of container around an array is: Linen's metadata boxes (meshplan's, Flax's, or
anything with ``names``) and Flax NNX variables (their ``out_sharding``
metadata, :mod:`meshplan._spmd.nnx`) are the two built in; a leaf of no kind is
``'unboxed'`` (replicated). :func:`array_leaves` reads leaves through them, and
so do :func:`meshplan.explain`, :func:`meshplan.check`, the shardings
(:mod:`meshplan._spmd.shardings`: ``get_partition_spec``, ``get_sharding``,
``logical_to_mesh``, ``logical_to_mesh_sharding``), the strict checks
(:mod:`meshplan._spmd.tree_check`) and checkpoints (save and
``Restored.into``). So a new kind of metadata is taught to meshplan here, once:
one :class:`LeafKind`, given to :func:`register_leaf_kind`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from meshplan._spmd.boxes import LogicallyPartitioned, Partitioned, is_box
from meshplan._spmd.mesh_info import JaxMesh
from meshplan._spmd.nnx import is_variable, variable_names, variable_spec
from meshplan._spmd.rules import AxisNames, LogicalRules, NamesKind, logical_to_mesh_axes
from meshplan._types import Leaf, PyTree, StepFn

__all__ = [
    "ArrayLeaf",
    "LeafKind",
    "LeafNames",
    "array_leaves",
    "is_leaf",
    "is_spec_leaf",
    "leaf_kind",
    "register_leaf_kind",
    "unwrap",
]

Named = Callable[[PartitionSpec], NamedSharding]
"""A checked, cached ``NamedSharding`` on the mesh of one call, for a mesh spec."""


@dataclasses.dataclass(frozen=True, slots=True)
class LeafNames:
    """What a leaf says about its layout: ``(kind, names, value, own_rules)``.

    Attributes:
        kind: ``'logical'``, ``'mesh'`` or ``'unboxed'``.
        names: Its names (``None`` when unboxed).
        value: The array (or abstract value, or a spec) out of its container.
        own_rules: Rules carried by the container, if any (``None``: the rules in effect).
    """

    kind: NamesKind
    names: AxisNames | None
    value: Leaf
    own_rules: object


@dataclasses.dataclass(frozen=True)
class LeafKind:
    """One kind of container around an array, as every walk of meshplan reads it.

    Attributes:
        name: What it is, for messages and tests (``'linen-box'``, ``'nnx-variable'``).
        matches: Whether a value is one (the walks stop there: it is a leaf).
        read: ``(leaf, rules) -> LeafNames``: its names, value and own rules
            (``rules``: the caller's, ``None``: the active ones).
        spec: What :func:`meshplan.get_partition_spec` puts at the leaf
            (``cache``: one dict per call, for the kind's own use).
        sharding: ``(leaf, mesh, named, cache)``: what :func:`meshplan.get_sharding` puts
            at the leaf; ``named(spec)`` gives the checked ``NamedSharding`` of a mesh spec.
        with_value: The same container around a new value (a restored array).
        resolve: For a kind that may sit in a tree of *logical* specs
            (:func:`meshplan.logical_to_mesh`): ``(leaf, rules)`` -> its mesh spec
            (``None``: not an array). ``None`` when the kind never does.
        put: ``(leaf, out)``: what a tree of specs or shardings holds at such a
            leaf (the container around ``out``).
        logical: ``(leaf, rules)`` -> ``(logical spec, shape, own rules)`` for the strict
            check of a spec tree, or ``None`` when the leaf has no names.
    """

    name: str
    matches: Callable[[Leaf], bool]
    read: Callable[[Leaf, LogicalRules | None], LeafNames]
    spec: Callable[[Leaf, dict[object, object]], PartitionSpec]
    sharding: Callable[[Leaf, JaxMesh, Named, dict[object, object]], Leaf]
    with_value: StepFn
    resolve: Callable[[Leaf, LogicalRules | None], PartitionSpec | None] | None = None
    put: StepFn | None = None
    logical: (
        Callable[[Leaf, LogicalRules | None], tuple[PartitionSpec, Leaf, Leaf] | None] | None
    ) = None


@dataclasses.dataclass(frozen=True, slots=True)
class ArrayLeaf:
    """One array of a tree, as the validator and the plan see it.

    Attributes:
        keypath: Its JAX key path (``meshplan._text.path_text`` writes it).
        kind: ``'logical'``, ``'mesh'`` or ``'unboxed'``.
        names: Its names (``None`` when unboxed).
        shape: Its shape.
        dtype: Its dtype (``None`` when the value has none).
        own_rules: Rules carried by its box, if any.
        value: The array (or abstract value) itself, out of its box or variable.
    """

    keypath: tuple[object, ...]
    kind: NamesKind
    names: AxisNames | None
    shape: tuple[int, ...]
    dtype: Any
    own_rules: object
    value: Leaf = None


def unwrap(box: Leaf) -> tuple[NamesKind, Any, object, Leaf]:
    """``(kind, names, value, own_rules)`` of a box, however nested.

    Example:
        >>> import jax.numpy as jnp, meshplan
        >>> from meshplan._spmd.leaves import unwrap
        >>> unwrap(meshplan.LogicallyPartitioned(jnp.ones(2), ["embed"]))[:2]
        ('logical', ('embed',))
    """
    value = getattr(box, "value", None)
    while is_box(value):
        value = getattr(value, "value", None)
    names = getattr(box, "names", None)
    if names is None:
        return "unboxed", None, value, None
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    elif not isinstance(names, tuple):
        names = tuple(names) if isinstance(names, list) else names
    logical = isinstance(box, LogicallyPartitioned) or type(box).__name__ == "LogicallyPartitioned"
    return ("logical" if logical else "mesh"), names, value, getattr(box, "rules", None)


def array_leaves(tree: PyTree, rules: LogicalRules | None = None) -> tuple[list[ArrayLeaf], int]:
    """Every array leaf of ``tree`` in tree order, and how many leaves were not arrays.

    A leaf is an array when it (or the value in its box or variable) has a
    ``.shape``: ``jax.Array``, ``numpy`` arrays and ``jax.ShapeDtypeStruct``.
    A Flax NNX variable's path is the variable's (``layers/kernel``, not
    ``.../value``); its names are logical when rules are in effect (``rules``,
    else the active ones, or its own ``sharding_rules``), else mesh axes, as
    in Flax NNX (:func:`meshplan._spmd.nnx.variable_names`).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._spmd.leaves import array_leaves
        >>> tree = {"w": meshplan.Partitioned(jnp.ones((2, 4)), ("data", None)), "fn": print}
        >>> leaves, skipped = array_leaves(tree)
        >>> [(leaf.kind, leaf.names, leaf.shape) for leaf in leaves], skipped
        ([('mesh', ('data', None), (2, 4))], 1)
    """
    out: list[ArrayLeaf] = []
    skipped = 0
    for keypath, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        found = leaf_kind(leaf)
        kind: NamesKind
        if found is None:
            kind, names, value, own_rules = "unboxed", None, leaf, None
        else:
            read = found.read(leaf, rules)
            kind, names, value, own_rules = read.kind, read.names, read.value, read.own_rules
        shape = getattr(value, "shape", None)
        if shape is None:
            skipped += 1
            continue
        if type(shape) is not tuple:
            shape = tuple(shape)
        dtype = getattr(value, "dtype", None)
        out.append(ArrayLeaf(keypath, kind, names, shape, dtype, own_rules, value))
    return out, skipped


# -- the two kinds built in ---------------------------------------------------

_OWN_BOXES = (Partitioned, LogicallyPartitioned)  # exact types: spec is PartitionSpec(*names)


def _box_spec(box: Leaf, cache: dict[object, Any]) -> PartitionSpec:
    if type(box) in _OWN_BOXES:  # boxes with equal names share one spec
        spec = cache.get(("spec", box.names))
        if spec is None:
            spec = cache[("spec", box.names)] = box.get_partition_spec()
        return spec  # type: ignore[no-any-return]
    out: PartitionSpec = box.get_partition_spec()  # a box of any kind: Flax's method
    return out


def _box_sharding(box: Leaf, mesh: JaxMesh, named: Named, cache: dict[object, object]) -> Leaf:
    if type(box) is Partitioned:  # checked already for these names: skip the spec
        shape = getattr(box.value, "shape", None)
        if shape is None or len(shape) == len(box.names):
            sharding = cache.get(("sharding", box.names))
            if sharding is not None:
                return sharding
        sharding = cache[("sharding", box.names)] = named(box._checked_spec())
        return sharding
    return box.get_sharding(mesh)


LINEN_BOX = LeafKind(
    name="linen-box",
    matches=is_box,
    read=lambda box, rules: LeafNames(*unwrap(box)),
    spec=_box_spec,
    sharding=_box_sharding,
    with_value=lambda box, value: box.replace_boxed(value),
)
"""Linen's metadata boxes: meshplan's ``Partitioned``/``LogicallyPartitioned``, any Flax
``AxisMetadata``. In a tree of specs or shardings a box becomes its spec or sharding."""


def _variable_read(var: Leaf, rules: LogicalRules | None) -> LeafNames:
    info = variable_names(var, rules)
    return LeafNames(info.kind, info.names, var.get_value(), info.rules)


def _variable_sharding(var: Leaf, mesh: JaxMesh, named: Named, cache: dict[object, object]) -> Leaf:
    spec = variable_spec(var)
    return var.replace(None if spec is None else named(spec))


def _variable_resolve(var: Leaf, rules: LogicalRules | None) -> PartitionSpec | None:
    """A variable's logical spec through ``rules``: its value when that is a spec (the result
    of ``nnx.get_partition_spec``), else its ``out_sharding`` names read as logical names."""
    value = var.get_value()
    if isinstance(value, PartitionSpec):
        return logical_to_mesh_axes(value, rules)
    return variable_spec(var, rules, logical=True)


def _variable_logical(
    var: Leaf, rules: LogicalRules | None
) -> tuple[PartitionSpec, Leaf, Leaf] | None:
    """Its spec value, or its names read as logical; with its shape and own rules."""
    names = variable_names(var, rules)
    value = var.get_value()
    if isinstance(value, PartitionSpec):
        return value, None, names.rules
    if names.names is None:
        return None
    return PartitionSpec(*names.names), getattr(value, "shape", None), names.rules


NNX_VARIABLE = LeafKind(
    name="nnx-variable",
    matches=is_variable,
    read=_variable_read,
    spec=lambda var, cache: var.replace(variable_spec(var)),
    sharding=_variable_sharding,
    with_value=lambda var, value: var.replace(value),
    resolve=_variable_resolve,
    put=lambda var, out: var.replace(out),
    logical=_variable_logical,
)
"""Flax NNX variables: their ``out_sharding`` metadata (:mod:`meshplan._spmd.nnx`). In a
tree of specs or shardings a variable stays, holding its spec or sharding, as in Flax NNX."""


# -- the registry ---------------------------------------------------------------

_KINDS: list[LeafKind] = [NNX_VARIABLE, LINEN_BOX]
_BY_TYPE: dict[type, LeafKind | None] = {}
"""The kind of each type seen: every leaf of a state asks, so ``matches`` runs once a type."""


def leaf_kind(x: Leaf) -> LeafKind | None:
    """The :class:`LeafKind` of ``x``, or ``None`` for a plain leaf (an array, a number).

    Example:
        >>> import jax.numpy as jnp, meshplan
        >>> from meshplan._spmd.leaves import leaf_kind
        >>> leaf_kind(meshplan.Partitioned(jnp.ones(2), ("data",))).name, leaf_kind(jnp.ones(2))
        ('linen-box', None)
    """
    t = type(x)
    if t in _BY_TYPE:
        return _BY_TYPE[t]
    found = _BY_TYPE[t] = next((k for k in _KINDS if k.matches(x)), None)
    return found


def is_leaf(x: object) -> bool:
    """Where the walks stop: a value of some :class:`LeafKind` (a box, a Flax NNX variable)."""
    return leaf_kind(x) is not None


def is_spec_leaf(x: object) -> bool:
    """Where a walk of a *logical spec* tree stops: a spec, or a kind that may sit there."""
    if isinstance(x, PartitionSpec):
        return True
    found = leaf_kind(x)
    return found is not None and found.resolve is not None


def register_leaf_kind(kind: LeafKind) -> Callable[[], None]:
    """Teaches every walk of meshplan a new kind of container; returns what unregisters it.

    It is asked before the built-in kinds. ``kind.matches`` must depend on a value's
    type only (the answer is kept per type).

    Example:
        >>> from meshplan._spmd.leaves import LINEN_BOX, leaf_kind, register_leaf_kind
        >>> import dataclasses
        >>> class Tagged:  # a value with mesh axes, as a new front end might carry
        ...     def __init__(self, value, axes): self.value, self.axes = value, axes
        >>> kind = dataclasses.replace(LINEN_BOX, name="tagged",
        ...                            matches=lambda x: isinstance(x, Tagged))
        >>> unregister = register_leaf_kind(kind)
        >>> leaf_kind(Tagged(None, ())).name
        'tagged'
        >>> unregister()
        >>> leaf_kind(Tagged(None, ())) is None
        True
    """
    _KINDS.insert(0, kind)
    _BY_TYPE.clear()

    def unregister() -> None:
        if kind in _KINDS:
            _KINDS.remove(kind)
        _BY_TYPE.clear()

    return unregister
