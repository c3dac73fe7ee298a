"""The one walk over a model's state: every array leaf with its path, kind, names and shape.

This is the seam a front end plugs into. :func:`array_leaves` reads Linen's
metadata boxes (meshplan's, Flax's, or anything with ``names``) and Flax NNX
variables (their ``out_sharding`` metadata, :mod:`meshplan._spmd.nnx`); a leaf
without either is ``'unboxed'`` (replicated). :func:`meshplan.explain`,
:func:`meshplan.check` and the strict shardings all walk a tree through it, so a
new kind of metadata is taught to meshplan here, once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec

from meshplan._spmd.boxes import LogicallyPartitioned, is_box
from meshplan._spmd.nnx import is_variable, variable_names

__all__ = ["ArrayLeaf", "array_leaves", "is_leaf", "unwrap"]


def is_leaf(x: Any) -> bool:
    """Where the walk stops: a metadata box or a Flax NNX variable."""
    return is_box(x) or is_variable(x)


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

    keypath: tuple[Any, ...]
    kind: str
    names: tuple[Any, ...] | None
    shape: tuple[int, ...]
    dtype: Any
    own_rules: Any
    value: Any = None


def unwrap(box: Any) -> tuple[str, Any, Any, Any]:
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


def array_leaves(tree: Any, rules: Any = None) -> tuple[list[ArrayLeaf], int]:
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
        if is_variable(leaf):
            info = variable_names(leaf, rules)
            kind, names, value, own_rules = info.kind, info.names, leaf.get_value(), info.rules
        elif is_box(leaf):
            kind, names, value, own_rules = unwrap(leaf)
        else:
            kind, names, value, own_rules = "unboxed", None, leaf, None
        shape = getattr(value, "shape", None)
        if shape is None:
            skipped += 1
            continue
        if type(shape) is not tuple:
            shape = tuple(shape)
        dtype = getattr(value, "dtype", None)
        out.append(ArrayLeaf(keypath, kind, names, shape, dtype, own_rules, value))
    return out, skipped
