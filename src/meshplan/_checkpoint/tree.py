"""Arrays by their path in a tree: how checkpoints name what they store.

A checkpoint keys every array by the parts of its path in the saved tree joined
with ``/`` (``params/Embed_0/embedding``, ``opt_state/1/0/mu/...``), so it can
be restored as nested dicts with no model code, or put back into a tree of the
same structure.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

from meshplan._errors import CheckpointError, error_for
from meshplan._spmd.leaves import array_leaves
from meshplan._spmd.rules import LogicalRules
from meshplan._text import path_text

__all__ = ["SavedNames", "flatten_state", "nest", "path_of", "unnest"]


def _key_name(key: object) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            name = str(getattr(key, attr))
            break
    else:  # pragma: no cover - a key type JAX may add later
        name = str(key)
    if "/" in name or not name:
        raise error_for(
            CheckpointError,
            "bad-tree-key",
            name,
            f"Cannot save a tree whose key {name!r} is empty or contains '/', got {key=}",
            "Rename the module or dict key: '/' separates path parts in checkpoints.",
        )
    return name


def path_of(keys: Any) -> str:
    """The checkpoint key of a JAX key path: meshplan's one path format (``params/w``).

    The same text as :func:`meshplan._text.path_text`, after checking that no part
    is empty or holds a ``/`` (which would make two paths one key).

    Example:
        >>> import jax
        >>> from meshplan._checkpoint.tree import path_of
        >>> [path_of(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, 2]})[0]]
        ['a/0', 'a/1']
    """
    keys = tuple(keys)
    for key in keys:
        _key_name(key)
    return path_text(keys)


@dataclasses.dataclass(frozen=True)
class SavedNames:
    """The axis names an array is saved with: logical names, or mesh axes (``logical=False``)."""

    names: tuple[Any, ...]
    logical: bool


def flatten_state(
    tree: object, rules: LogicalRules | None = None
) -> dict[str, tuple[Any, SavedNames | None]]:
    """Every array of ``tree`` by its path: ``{"params/w": (value, SavedNames or None)}``.

    The walk is meshplan's one leaf walk (:func:`meshplan._spmd.leaves.array_leaves`), so
    Linen boxes and Flax NNX variables are read alike (``rules`` decide whether an NNX
    variable's names are logical, as everywhere); unboxed arrays give ``None``.

    Example:
        >>> import jax.numpy as jnp, meshplan
        >>> from meshplan._checkpoint.tree import flatten_state
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(jnp.ones((2, 4)),
        ...                                                      ("embed", "mlp"))},
        ...         "step": jnp.int32(0)}
        >>> {k: (v.shape, n and n.names) for k, (v, n) in flatten_state(tree).items()}
        {'params/w': ((2, 4), ('embed', 'mlp')), 'step': ((), None)}
    """
    out: dict[str, tuple[object, SavedNames | None]] = {}
    for leaf in array_leaves(tree, rules)[0]:
        names = None
        if leaf.kind != "unboxed" and leaf.names is not None:
            names = SavedNames(tuple(leaf.names), leaf.kind == "logical")
        out[path_of(leaf.keypath)] = (leaf.value, names)
    return out


def nest(flat: Mapping[str, object]) -> dict[str, object]:
    """``{"a/b": x}`` -> ``{"a": {"b": x}}``.

    Example:
        >>> from meshplan._checkpoint.tree import nest
        >>> nest({"params/w": 1, "params/b": 2, "step": 3})
        {'params': {'w': 1, 'b': 2}, 'step': 3}
    """
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split("/")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def unnest(tree: Mapping[str, object], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """The inverse of :func:`nest`: ``(path, leaf)`` pairs of nested dicts.

    Example:
        >>> from meshplan._checkpoint.tree import unnest
        >>> list(unnest({"params": {"w": 1}, "step": 3}))
        [('params/w', 1), ('step', 3)]
    """
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from unnest(value, path + "/")
        else:
            yield path, value
