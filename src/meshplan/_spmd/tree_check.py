"""The validator over a whole tree: every error, found once, raised once.

:func:`tree_errors` walks a tree (:func:`meshplan._spmd.leaves.array_leaves`),
checks each distinct leaf with :func:`meshplan._spmd.validate.check_leaf`, and
adds the errors only a whole tree shows: logical names with no rules at all,
and a rule naming a mesh axis the mesh lacks. :func:`meshplan.check` reports the
same errors (plus warnings) from a plan, through the functions here, so each
check is written once. ``get_sharding(strict=True)`` and
``logical_to_mesh_sharding(strict=True)`` call :func:`tree_errors` and
:func:`raise_for_errors`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

from meshplan._errors import Problem, ShardingValidationError, problem_message
from meshplan._spmd.leaves import array_leaves, is_spec_leaf, leaf_kind
from meshplan._spmd.mesh_info import JaxMesh, MeshInfo, MeshLike, axis_names_fix, mesh_info
from meshplan._spmd.rules import LogicalRules, get_logical_axis_rules, mesh_axes_of, rules_problems
from meshplan._spmd.validate import LeafCheck, check_leaf
from meshplan._text import axes_text, count_text, human_bytes, path_text, paths_text, rule_text
from meshplan._types import PyTree

__all__ = [
    "no_names_in_tree",
    "no_names_problem",
    "no_rules_problem",
    "only_unmatched",
    "raise_for_errors",
    "rule_axis_problems",
    "spec_errors",
    "tree_errors",
]

_MAX_BULLETS = 40


NO_NAMES_FIX = (
    "Name the arrays' dimensions: meshplan.name_by_path(tree, [(path_regex, names), ...]) "
    "for a model written without names, or meshplan.infer_names(step_fn, state, batch) to "
    "infer them from the train step; or box them in the model (with_logical_partitioning)."
)
"""How to name a model that carries no names (code ``'no-names'``): the library's words."""


def no_names_problem(paths: Sequence[str], nbytes: int) -> Problem:
    """Rules given, and no array carries a name: the rules place nothing, all is replicated.

    Example:
        >>> from meshplan._spmd.tree_check import no_names_problem
        >>> print(no_names_problem(["params/wte", "params/h/0/w"], 3 << 20).message)
        no array carries a logical name: the rules place nothing, and every device holds all
        2 arrays (params/wte, params/h/0/w; 3.00 MiB)
    """
    return Problem(
        "warning",
        paths[0],
        f"no array carries a logical name: the rules place nothing, and every device holds all "
        f"{count_text(len(paths), 'array')} ({paths_text(paths)}; {human_bytes(nbytes)})",
        NO_NAMES_FIX,
        "no-names",
    )


def no_names_in_tree(tree: PyTree, rules: LogicalRules | None) -> Problem | None:
    """The ``'no-names'`` problem of ``tree`` under ``rules`` (the active ones if ``None``), or
    ``None`` when some array carries names, or no rules are in effect.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._spmd.tree_check import no_names_in_tree
        >>> tree = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
        >>> no_names_in_tree(tree, (("embed", "data"),)).code, no_names_in_tree(tree, ())
        ('no-names', None)
    """
    in_effect = get_logical_axis_rules() if rules is None else rules
    if not in_effect:
        return None
    leaves, _ = array_leaves(tree, in_effect)
    if not leaves or any(leaf.kind != "unboxed" for leaf in leaves):
        return None
    nbytes = sum(math.prod(leaf.shape) * _itemsize(leaf.dtype) for leaf in leaves)
    return no_names_problem([path_text(leaf.keypath) for leaf in leaves], nbytes)


def _itemsize(dtype: DTypeLike) -> int:
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        return 0


def no_rules_problem(paths: Sequence[str]) -> Problem:
    """Leaves with logical names, and no rules given or active: all replicated."""
    return Problem(
        "error",
        paths[0],
        f"{count_text(len(paths), 'leaf', 'leaves')} ({paths_text(paths)}) have logical axis "
        f"names but no rules are given or active, so every logical dimension is replicated",
        "Pass rules=..., or call inside `with meshplan.logical_axis_rules(rules):`.",
        "no-rules",
    )


def rule_axis_problems(
    rules: Sequence[tuple[str, object]],
    index_map: Sequence[int],
    mesh: MeshInfo,
    users: Mapping[int, Sequence[str]],
) -> list[Problem]:
    """A rule that names a mesh axis the mesh lacks (``users``: the paths each rule places)."""
    out = []
    for i, (name, axes) in zip(index_map, rules, strict=True):
        missing = tuple(a for a in mesh_axes_of(axes) if a not in mesh.shape)
        if missing:
            placed = users.get(i, ())
            used = (
                f" (it places {count_text(len(placed), 'leaf', 'leaves')}: {paths_text(placed)})"
                if placed
                else ""
            )
            out.append(
                Problem(
                    "error",
                    f"rules[{i}]",
                    f"{rule_text(i, (name, axes))} names mesh axis {axes_text(missing)}, which "
                    f"the mesh {mesh.shape} does not have{used}",
                    axis_names_fix(missing, mesh),
                    "rule-unknown-axis",
                )
            )
    return out


def only_unmatched(dims: Sequence[Any]) -> bool:
    """Whether a logical leaf's named dimensions all lack a rule (``dims``: their ``status``)."""
    return any(d.status == "no-rule" for d in dims) and all(
        d.status in ("no-rule", "unnamed") for d in dims
    )


def tree_errors(tree: PyTree, mesh: JaxMesh, rules: LogicalRules | None = None) -> list[Problem]:
    """Every error in how ``tree`` would be laid out on ``mesh``, as :func:`meshplan.check` finds.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._spmd.tree_check import tree_errors
        >>> tree = {"w": meshplan.LogicallyPartitioned(
        ...     jax.ShapeDtypeStruct((6,), jnp.float32), ("embed",))}
        >>> [(p.path, p.code) for p in tree_errors(tree, {"x": 4}, [["embed", "x"]])]
        [('w', 'indivisible')]
    """
    info = mesh_info(mesh)
    valid, index_map, errors = rules_problems(get_logical_axis_rules() if rules is None else rules)
    cache: dict[object, LeafCheck] = {}
    users: dict[int, list[str]] = {}
    without_rules: list[str] = []
    leaves, _ = array_leaves(tree, rules)
    for leaf in leaves:
        key: tuple[object, ...] | None = (leaf.kind, leaf.names, leaf.shape, leaf.own_rules)
        try:
            checked = cache.get(key)
        except TypeError:  # unhashable names
            key, checked = None, None
        if checked is None:
            if leaf.own_rules is not None and leaf.kind == "logical":
                r, m, _ = rules_problems(leaf.own_rules)
            else:
                r, m = valid, index_map
            checked = check_leaf(leaf.kind, leaf.names, leaf.shape, r, m, info)
            if key is not None:
                cache[key] = checked
        path = path_text(leaf.keypath)
        errors.extend(p for p in checked.at(path) if p.severity == "error")
        if leaf.kind == "logical" and not valid and only_unmatched(checked.dims):
            without_rules.append(path)
        for d in checked.dims:
            if d.status == "rule" and d.rule_index is not None:
                users.setdefault(d.rule_index, []).append(path)
    if without_rules:
        errors.append(no_rules_problem(without_rules))
    errors.extend(rule_axis_problems(valid, index_map, info, users))
    return errors


def spec_errors(tree: PyTree, mesh: JaxMesh, rules: LogicalRules | None = None) -> list[Problem]:
    """:func:`tree_errors` for a tree of *logical* ``PartitionSpec``s (no shapes, so no sizes).

    Example:
        >>> from jax.sharding import PartitionSpec as P
        >>> from meshplan._spmd.tree_check import spec_errors
        >>> [(p.path, p.code) for p in spec_errors({"w": P("embed")}, {"data": 2}, [("embed", "dta")])]
        [('rules[0]', 'rule-unknown-axis')]
    """
    info = mesh_info(mesh)
    valid, index_map, errors = rules_problems(get_logical_axis_rules() if rules is None else rules)
    users: dict[int, list[str]] = {}
    for keypath, spec in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_spec_leaf)[0]:
        r, m = valid, index_map
        shape = None
        kind = leaf_kind(spec)
        if kind is not None and kind.logical is not None:  # e.g. an NNX variable
            found = kind.logical(spec, rules)
            if found is None:  # no names
                continue
            spec, shape, own_rules = found
            if own_rules is not None:
                r, m, _ = rules_problems(own_rules)
        if not isinstance(spec, PartitionSpec):
            continue
        path = path_text(keypath)
        shape_t = None if shape is None else tuple(shape)
        checked = check_leaf("logical", tuple(spec), shape_t, r, m, info)
        errors.extend(p for p in checked.at(path) if p.severity == "error")
        for d in checked.dims:
            if d.status == "rule" and d.rule_index is not None:
                users.setdefault(d.rule_index, []).append(path)
    errors.extend(rule_axis_problems(valid, index_map, info, users))
    return errors


def raise_for_errors(problems: Sequence[Problem], mesh: MeshLike | MeshInfo) -> None:
    """Raises one :class:`ShardingValidationError` listing every error, if there are any.

    The error's ``problems`` are all of ``problems`` (warnings included).

    Example:
        >>> import meshplan
        >>> from meshplan._spmd.tree_check import raise_for_errors
        >>> raise_for_errors([meshplan.Problem("warning", "w", "m", "f", "replicated")], {"x": 2})
    """
    errors = [p for p in problems if p.severity == "error"]
    if not errors:
        return
    info = mesh_info(mesh)
    n = len(errors)
    header = (
        f"The sharding plan has {n} error{'s' if n != 1 else ''}. The mesh has shape "
        f"{info.shape}, axis names {info.axis_names!r} ({info.size} devices):"
    )
    lines = [f"{p.path}: {p.message}" for p in errors[:_MAX_BULLETS]]
    if n > _MAX_BULLETS:
        lines.append(f"... and {n - _MAX_BULLETS} more (meshplan.check(...) lists them all)")
    fixes = list(dict.fromkeys(p.fix for p in errors))
    if len(fixes) > 8:
        fixes = [*fixes[:8], f"... ({len(fixes) - 8} more)"]
    fix = "To fix:\n" + "\n".join(f"  - {f}" for f in fixes)
    raise ShardingValidationError(problem_message(header, lines, fix), problems)
