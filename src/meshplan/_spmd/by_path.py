"""Logical names given by path: regular expressions over the paths ``explain`` prints.

For models written without meshplan (Hugging Face's Flax models, Equinox, plain
JAX, Linen or NNX modules that never call ``with_logical_partitioning``):
:func:`name_by_path` wraps every array whose path a pattern matches in a
:class:`~meshplan.LogicallyPartitioned` box (a Flax NNX variable gets the names as
its ``out_sharding`` metadata instead, as Flax NNX writes them), so that every
other function of meshplan sees a named model. T5X calls this "axis names
override"; the Hugging Face Flax examples map the same regexes to mesh axes
directly, with no logical names and so no rules to search.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Sequence
from typing import Any, TypeAlias, TypeVar

import jax

from meshplan._errors import LogicalNamesError, Problem, error_from_problems
from meshplan._spmd.boxes import LogicallyPartitioned, is_box
from meshplan._spmd.leaves import is_leaf, leaf_kind, unwrap
from meshplan._spmd.nnx import is_variable
from meshplan._spmd.rules import AxisNames, names_problem
from meshplan._text import count_text, path_text, paths_text, shape_text
from meshplan._types import Leaf

__all__ = [
    "PathRule",
    "PathRules",
    "UnnamedLeavesWarning",
    "check_path_rules",
    "name_by_path",
]

T = TypeVar("T")

PathRules: TypeAlias = Sequence[tuple[str, Sequence[Any] | None]]
"""``(pattern, names)`` pairs: a regex over a leaf's path, and one name (or None) per dimension
(``names=None``: leave the matched arrays as they are, on purpose)."""

_FIX = (
    "Give path_rules as (pattern, names) pairs: a regular expression matched in full against "
    "paths such as 'params/Dense_0/kernel', and a tuple of one logical name (or None) per "
    "dimension, e.g. (r'.*/kernel', ('embed', 'mlp'))."
)


class UnnamedLeavesWarning(UserWarning):
    """:func:`~meshplan.name_by_path` left arrays that no pattern matches unnamed (replicated).

    Attributes:
        paths: The paths of those arrays.
        unused: The patterns that matched no array (likely mistyped).
    """

    def __init__(self, message: str, paths: Sequence[str], unused: Sequence[str]) -> None:
        super().__init__(message)
        self.paths = tuple(paths)
        self.unused = tuple(unused)


@dataclasses.dataclass(frozen=True)
class PathRule:
    """One checked path rule: its index in the rules as given, its regex and its names."""

    index: int
    pattern: re.Pattern[str]
    names: AxisNames | None

    def where(self) -> str:
        """``"path_rules[2] ('.*/kernel')"``."""
        return f"path_rules[{self.index}] ({self.pattern.pattern!r})"


def _rule_problem(index: int, message: str) -> Problem:
    return Problem("error", f"path_rules[{index}]", message, _FIX, "path-rule")


def _check_rule(index: int, pair: object) -> PathRule | Problem:
    if isinstance(pair, str | bytes) or not isinstance(pair, Sequence) or len(pair) != 2:
        return _rule_problem(index, f"{pair!r} is not a (pattern, names) pair")
    pattern, names = pair
    if not isinstance(pattern, str):
        return _rule_problem(index, f"the pattern {pattern!r} is not a string")
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        return _rule_problem(index, f"the pattern {pattern!r} is not a regular expression ({e})")
    if names is None:
        return PathRule(index, compiled, None)
    problem = names_problem(names, what=f"the names of pattern {pattern!r}")
    if problem is not None:
        return Problem("error", f"path_rules[{index}]", problem.message, problem.fix, "path-rule")
    return PathRule(index, compiled, tuple(tuple(n) if isinstance(n, list) else n for n in names))


def check_path_rules(path_rules: PathRules) -> tuple[PathRule, ...]:
    """``path_rules`` checked: every bad pair, pattern and names found, raised once.

    Example:
        >>> from meshplan._spmd.by_path import check_path_rules
        >>> [r.where() for r in check_path_rules([(r".*/kernel", ("embed", "mlp"))])]
        ["path_rules[0] ('.*/kernel')"]
        >>> check_path_rules([("(", ("embed",)), (".*", "embed")])
        Traceback (most recent call last):
        ...
        meshplan.LogicalNamesError: Cannot name arrays by path (path_rules[i] is pair i, from 0):
          * path_rules[0]: the pattern '(' is not a regular expression (...)
          * path_rules[1]: the names of pattern '.*' must be a tuple ... got the bare string 'embed'
        ...
    """
    if isinstance(path_rules, str | bytes | dict) or not isinstance(path_rules, Sequence):
        problem = Problem(
            "error", "path_rules", f"not a sequence of pairs: {path_rules!r}", _FIX, "path-rule"
        )
        raise error_from_problems(LogicalNamesError, "Cannot name arrays by path:", [problem])
    checked = [_check_rule(i, pair) for i, pair in enumerate(path_rules)]
    problems = [c for c in checked if isinstance(c, Problem)]
    if problems:
        raise error_from_problems(
            LogicalNamesError,
            "Cannot name arrays by path (path_rules[i] is pair i, from 0):",
            problems,
        )
    return tuple(c for c in checked if isinstance(c, PathRule))


def _rank_problem(path: str, rule: PathRule, names: AxisNames, shape: Any) -> Problem:
    ndim = len(shape)
    return Problem(
        "error",
        path,
        f"{rule.where()} gives {count_text(len(names), 'name')} {names!r} to an array of shape "
        f"{shape_text(tuple(shape))} (rank {ndim})",
        f"Give one name (or None) per dimension ({count_text(ndim, 'name')}), or add an "
        f"earlier pattern for arrays of rank {ndim} at such paths.",
        "path-names-rank",
    )


def _named(leaf: Leaf, names: AxisNames) -> Leaf:
    """``leaf`` carrying ``names``: a variable's ``out_sharding``, else a new logical box."""
    if is_variable(leaf):
        return leaf.replace(out_sharding=names)
    if is_box(leaf):  # a box already: its names are replaced by the rule's (the value kept)
        return LogicallyPartitioned(unwrap(leaf)[2], names)
    return LogicallyPartitioned(leaf, names)


def _shape(leaf: Leaf) -> Leaf:
    if is_variable(leaf):
        return getattr(leaf.get_value(), "shape", None)
    if is_box(leaf):
        return getattr(unwrap(leaf)[2], "shape", None)
    return getattr(leaf, "shape", None)


def name_by_path(tree: T, path_rules: PathRules) -> T:
    """``tree`` with every array a pattern matches carrying that pattern's logical names.

    Each array's path, as :func:`meshplan.explain` prints it (``params/Dense_0/kernel``;
    ``transformer/h/0/attn/c_attn/kernel`` in a Hugging Face model's ``params``), is matched
    in full (``re.fullmatch``) against the patterns in order; the first match wins. A plain
    array (or ``jax.ShapeDtypeStruct``) is wrapped in
    ``meshplan.LogicallyPartitioned(array, names)``; a Flax NNX variable gets the names as
    its ``out_sharding`` (logical names once rules are in effect); an array that is boxed
    already gets the rule's names in a new ``LogicallyPartitioned`` box around its value
    (the rule overrides the names it had), and keeps its box when no pattern matches.
    ``names=None`` leaves the matched arrays as they are, on purpose.

    Works inside ``jax.jit`` and ``jax.eval_shape`` (boxes are pytree nodes), so an
    ``init`` can return named parameters.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> params = {"dense": {"kernel": jnp.zeros((4, 8)), "bias": jnp.zeros(8)}}
        >>> named = meshplan.name_by_path(params, [
        ...     (r".*/kernel", ("embed", "mlp")),
        ...     (r".*/bias", ("mlp",)),
        ... ])
        >>> named["dense"]["kernel"].names, named["dense"]["bias"].names
        (('embed', 'mlp'), ('mlp',))
        >>> meshplan.name_by_path(params, [(r".*/kernel", ("embed",))])
        Traceback (most recent call last):
        ...
        meshplan.LogicalNamesError: Cannot name arrays by path:
          * dense/kernel: path_rules[0] ('.*/kernel') gives 1 name ('embed',) to an array of shape (4, 8) (rank 2)
        Give one name (or None) per dimension (2 names), or add an earlier pattern ...

    Args:
        tree: PyTree pytree of arrays: Linen variables, a Flax NNX state, a Hugging Face
            model's ``params``, a plain dict, an abstract tree of ``jax.ShapeDtypeStruct``.
        path_rules: ``(pattern, names)`` pairs, first match wins.

    Returns:
        The same tree, the matched arrays carrying their names.

    Raises:
        LogicalNamesError: a pair, pattern or names that is not valid, or names whose
            length is not the rank of an array they match: every one, raised once.

    Warns:
        UnnamedLeavesWarning: arrays that no pattern matches (they stay replicated; scalars,
            which have nothing to name, are not listed), and patterns that match no array:
            one warning listing them all.
    """
    rules = check_path_rules(path_rules)
    problems: list[Problem] = []
    unmatched: list[str] = []
    used: set[int] = set()

    def name(keypath: object, leaf: Leaf) -> Leaf:
        shape = _shape(leaf)
        if shape is None:
            return leaf
        path = path_text(keypath)
        rule = next((r for r in rules if r.pattern.fullmatch(path)), None)
        if rule is None:
            kind = leaf_kind(leaf)
            if len(shape) and (kind is None or kind.read(leaf, None).kind == "unboxed"):
                unmatched.append(path)  # a scalar has no dimension to name: not listed
            return leaf
        used.add(rule.index)
        if rule.names is None:
            return leaf
        if len(rule.names) != len(shape):
            problems.append(_rank_problem(path, rule, rule.names, shape))
            return leaf
        return _named(leaf, rule.names)

    out: T = jax.tree_util.tree_map_with_path(name, tree, is_leaf=is_leaf)
    if problems:
        raise error_from_problems(LogicalNamesError, "Cannot name arrays by path:", problems)
    unused = [r.pattern.pattern for r in rules if r.index not in used]
    if unmatched or unused:
        warnings.warn(_warning(unmatched, unused), stacklevel=2)
    return out


def _warning(unmatched: list[str], unused: list[str]) -> UnnamedLeavesWarning:
    parts = []
    if unmatched:
        parts.append(
            f"{count_text(len(unmatched), 'array')} that no pattern matches "
            f"{'stays' if len(unmatched) == 1 else 'stay'} unnamed (replicated): "
            f"{paths_text(unmatched, 8)}"
        )
    if unused:
        parts.append(
            f"{count_text(len(unused), 'pattern')} matched no array: "
            f"{paths_text([repr(p) for p in unused], 8)}"
        )
    fix = (
        "Add a pattern for each (names=None leaves an array alone without this warning), "
        "and check the patterns against the paths meshplan.explain prints."
    )
    return UnnamedLeavesWarning("name_by_path: " + "; ".join(parts) + ". " + fix, unmatched, unused)
