"""The one validator: how one array is laid out on a mesh, and every problem with it.

:func:`check_leaf` resolves one array's names through the rules and checks the
result against the mesh: the number of names against the rank, the names
themselves, mesh axes the mesh lacks, a mesh axis on two dimensions, and sizes
that do not divide. It depends only on (kind, names, shape, rules, mesh), so
callers that walk a tree build it once per distinct leaf. :func:`validate` is
the same check for one path, returning :class:`~meshplan.Problem` records.

Everything that checks a layout calls these: :func:`meshplan.explain` and
:func:`meshplan.check` (and so ``get_sharding(strict=True)``), the shardings of
a tree, checkpoint restore, the train command and the layout search. Nobody
parses an error's text: the problems carry a code, the path, the message and
the fix.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from meshplan._errors import Problem, Severity
from meshplan._spmd.mesh_info import MeshInfo, MeshLike, axis_names_fix, mesh_info
from meshplan._spmd.rules import (
    UNASSIGNED,
    UNCONSTRAINED,
    AxisNames,
    DimStatus,
    LogicalNames,
    LogicalRules,
    NamesKind,
    SkippedRule,
    bad_entries,
    get_logical_axis_rules,
    mesh_axes_of,
    names_problem,
    resolve_with_trace,
    rules_problems,
)
from meshplan._text import axes_text

__all__ = ["DimCheck", "LeafCheck", "check_leaf", "rank_problem", "validate"]

KINDS: tuple[NamesKind, ...] = ("logical", "mesh", "unboxed")


@dataclasses.dataclass(frozen=True)
class DimCheck:
    """How one dimension is placed: its mesh axes, the rule behind them, and what is wrong.

    Attributes:
        index: The dimension's position.
        size: Its size (``None`` without a shape).
        name: Its name: a logical name, mesh axes, or ``None``.
        entry: Its ``PartitionSpec`` entry (``None``: not split).
        mesh_axes: The mesh axes of ``entry``, as a tuple.
        shards: How many pieces the existing, not duplicated axes cut it into.
        status: ``'rule'``, ``'mesh'``, ``'no-rule'``, ``'unnamed'``,
            ``'unconstrained'`` or ``'unboxed'`` (see :class:`meshplan._plan.records.DimPlan`).
        rule_index: The index, in the rules as given, of the rule that placed it.
        rule: That rule.
        skipped: Rules that named it but were skipped (indices as given).
        missing_axes: Mesh axes the mesh does not have.
        duplicate_axes: Mesh axes an earlier dimension already uses.
        axis_sizes: The size of each of ``mesh_axes`` (0 when missing).
    """

    index: int
    size: int | None
    name: Any
    entry: object
    mesh_axes: tuple[str, ...]
    shards: int
    status: DimStatus
    rule_index: int | None
    rule: tuple[str, object] | None
    skipped: tuple[SkippedRule, ...]
    missing_axes: tuple[str, ...]
    duplicate_axes: tuple[str, ...]
    axis_sizes: tuple[int, ...]

    @property
    def divides(self) -> bool:
        """Whether the size divides evenly by the number of shards."""
        return self.size is None or self.size % self.shards == 0

    @property
    def padded_size(self) -> int | None:
        """The nearest size at or above ``size`` that divides by ``shards``."""
        return None if self.size is None else -(-self.size // self.shards) * self.shards


@dataclasses.dataclass(frozen=True)
class LeafCheck:
    """One array's layout: a :class:`DimCheck` per dimension, its spec, and its problems.

    ``problems`` have an empty path: :meth:`at` stamps one on. Their severity is
    ``'error'`` or, for names shorter than the rank, ``'info'``.
    """

    dims: tuple[DimCheck, ...]
    spec: PartitionSpec
    problems: tuple[Problem, ...]

    @property
    def errors(self) -> tuple[Problem, ...]:
        """The problems whose severity is ``'error'``."""
        return tuple(p for p in self.problems if p.severity == "error")

    def at(self, path: str) -> list[Problem]:
        """The problems, with ``path`` as their path."""
        return [dataclasses.replace(p, path=path) for p in self.problems]


def _problem(code: str, message: str, fix: str, severity: Severity = "error") -> Problem:
    return Problem(severity, "", message, fix, code)


def _axes_with_sizes(d: DimCheck) -> str:
    """``"mesh axis 'model' of size 4"`` or ``"mesh axes 'data'×'model' of sizes 2×4"``."""
    pairs = [(a, s) for a, s in zip(d.mesh_axes, d.axis_sizes, strict=True) if s]
    if len(pairs) == 1:
        return f"mesh axis {pairs[0][0]!r} of size {pairs[0][1]}"
    return (
        f"mesh axes {axes_text(tuple(a for a, _ in pairs))} of sizes "
        f"{'×'.join(str(s) for _, s in pairs)}"
    )


def rank_problem(names: AxisNames, shape: tuple[int, ...]) -> Problem:
    """The problem with ``len(names) != len(shape)``: an error for more names, information for fewer.

    Fewer names leave the trailing dimensions unsharded, as a shorter ``PartitionSpec`` does
    (Flax and JAX accept it; e.g. a ``DenseGeneral`` kernel (embed, heads, head_dim) named
    ``('embed', 'kv')``).

    Example:
        >>> from meshplan._spmd.validate import rank_problem
        >>> rank_problem(("embed",), (4, 8)).severity, rank_problem(("a", "b"), (4,)).code
        ('info', 'rank')
    """
    ndim = len(shape)
    if len(names) > ndim:
        return _problem(
            "rank",
            f"{len(names)} axis names {tuple(names)!r} for an array of rank {ndim} "
            f"(shape {tuple(shape)})",
            f"Give at most one name (or None) per dimension: {ndim} name{'' if ndim == 1 else 's'}.",
        )
    rest = ndim - len(names)
    return _problem(
        "padded-names",
        f"{len(names)} axis names {tuple(names)!r} for an array of rank {ndim} "
        f"(shape {tuple(shape)}): the trailing {rest} dimension{'s are' if rest > 1 else ' is'} "
        f"unsharded",
        "Nothing to do if that is meant (as with a shorter PartitionSpec); otherwise name "
        "every dimension.",
        "info",
    )


MAX_ELEMENTS = 2**56
"""The most elements an array may have (its bytes must fit a 64-bit count, 8 bytes each)."""


def shape_problems(shape: Any) -> list[Problem]:
    """``'bad-shape'`` problems of a shape: dims that are not whole numbers of 0 or more, or
    more elements than :data:`MAX_ELEMENTS` (``[]`` when it is a shape).

    Example:
        >>> from meshplan._spmd.validate import shape_problems
        >>> [p.message for p in shape_problems((-64, 128))]
        ['dim 0 has size -64: a size is a whole number of 0 or more']
        >>> shape_problems((64, 128))
        []
    """
    fix = "Give every dimension a whole-number size of 0 or more (check how the shape is computed)."
    try:
        dims = tuple(shape)
    except TypeError:
        return [_problem("bad-shape", f"shape {shape!r} is not a tuple of sizes", fix)]
    out = []
    for i, d in enumerate(dims):
        whole = isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_))
        if not whole or d < 0:
            out.append(
                _problem(
                    "bad-shape",
                    f"dim {i} has size {d!r}: a size is a whole number of 0 or more",
                    fix,
                )
            )
    if not out and math.prod(int(d) for d in dims) > MAX_ELEMENTS:
        count = math.prod(int(d) for d in dims)
        out.append(
            _problem(
                "bad-shape",
                f"shape {tuple(int(d) for d in dims)} has {count:.3g} elements, more than "
                f"2**56 ({MAX_ELEMENTS:.3g}): its bytes do not fit a 64-bit count",
                "Check the shape: 2**56 elements are 72 petabytes even at one byte each.",
            )
        )
    return out


def check_leaf(
    kind: NamesKind,
    names: tuple[Any, ...] | None,
    shape: tuple[int, ...] | None,
    rules: tuple[tuple[str, Any], ...],
    index_map: tuple[int, ...],
    mesh: MeshInfo,
) -> LeafCheck:
    """Resolves and checks one array. Never raises on bad names: they become problems.

    Args:
        kind: ``'logical'`` (names go through ``rules``), ``'mesh'`` (names are
            mesh axes) or ``'unboxed'`` (replicated).
        names: The names (``None`` when unboxed).
        shape: The array's shape (``None`` for a spec without a shape).
        rules: Valid, normalised rules (see :func:`meshplan._spmd.rules.rules_problems`).
        index_map: For each of ``rules``, its index in the rules as given.
        mesh: The mesh.

    Returns:
        A :class:`LeafCheck`.

    Example:
        >>> from meshplan._spmd.mesh_info import mesh_info
        >>> from meshplan._spmd.validate import check_leaf
        >>> leaf = check_leaf("logical", ("embed", "mlp"), (6, 8), (("embed", "model"),), (0,),
        ...                   mesh_info({"data": 2, "model": 4}))
        >>> leaf.spec, [(p.code, p.message) for p in leaf.problems]
        (P('model', None), [('indivisible', "dim 0 ('embed') of size 6 does not divide by 4 (mesh axis 'model' of size 4)")])
    """
    problems: list[Problem] = []
    sizes = mesh.shape
    if shape is not None:
        bad_shape = shape_problems(shape)
        if bad_shape:
            problems.extend(bad_shape)
            shape = None  # the names are still checked; no size, so no bytes
    ndim = len(shape) if shape is not None else len(names or ())
    work: tuple[object, ...] = (None,) * ndim if names is None else tuple(names)
    if shape is not None and names is not None and len(names) != ndim:
        problems.append(rank_problem(names, shape))
        work = (work + (None,) * ndim)[:ndim]

    trace = None
    if kind == "logical":
        bad = names_problem(work)
        if bad is not None:
            problems.append(bad)
            work = (None,) * ndim
        trace = resolve_with_trace(work, rules)
    elif kind == "mesh" and names is not None:  # a front end's mesh names (boxes check theirs)
        work = tuple(tuple(n) if isinstance(n, list) else n for n in work)
        bad_mesh = bad_entries(work)
        if bad_mesh:
            problems.append(
                _problem(
                    "names",
                    f"mesh axis names {work!r} hold entries that are not axis names: {bad_mesh!r}",
                    "Each entry must be a mesh axis name (str), a tuple of them, None or "
                    "PartitionSpec.UNCONSTRAINED.",
                )
            )
            work = tuple(None if n in bad_mesh else n for n in work)

    dims: list[DimCheck] = []
    entries: list[object] = []
    used: dict[str, int] = {}
    for i, name in enumerate(work):
        size = None if shape is None else int(shape[i])
        rule_index: int | None = None
        rule: tuple[str, object] | None = None
        skipped: tuple[SkippedRule, ...] = ()
        status: DimStatus
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
            elif res.rule_index is None:  # a tuple of mesh axes written in place of a name
                status = "mesh"
            else:
                status = "rule"
                rule_index, rule = index_map[res.rule_index], rules[res.rule_index]
        else:
            entry = name
            status = (
                "unnamed" if name is None else "unconstrained" if name is UNCONSTRAINED else "mesh"
            )
        entries.append(entry)
        axes = mesh_axes_of(entry)
        missing = tuple(a for a in axes if a not in sizes)
        dup = tuple(a for a in axes if a in used)
        for a in dup:
            problems.append(
                _problem(
                    "duplicate-axis",
                    f"mesh axis {a!r} is used by dims {used[a]} and {i}",
                    "Use each mesh axis for at most one dimension of an array.",
                )
            )
        for a in axes:
            used.setdefault(a, i)
        if missing and kind == "mesh":
            problems.append(
                _problem(
                    "unknown-axis",
                    f"dim {i} names mesh axis {axes_text(missing)}, which the mesh "
                    f"{sizes} does not have",
                    axis_names_fix(missing, mesh),
                )
            )
        shards = math.prod(sizes[a] for a in axes if a in sizes and a not in dup)
        dims.append(
            DimCheck(
                i,
                size,
                name,
                entry,
                axes,
                shards,
                status,
                rule_index,
                rule,
                skipped,
                missing,
                dup,
                tuple(sizes.get(a, 0) for a in axes),
            )
        )

    for d in dims:
        if not d.divides:
            named = kind == "logical" and isinstance(d.name, str)
            where = f"dim {d.index}" + (f" ({d.name!r})" if named else "")
            problems.append(
                _problem(
                    "indivisible",
                    f"{where} of size {d.size} does not divide by {d.shards} "
                    f"({_axes_with_sizes(d)})",
                    f"Pad dim {d.index} to {d.padded_size} (the nearest multiple of {d.shards}), "
                    f"or map it to mesh axes whose size divides {d.size}.",
                )
            )
    return LeafCheck(tuple(dims), PartitionSpec(*entries), tuple(problems))


def validate(
    path: str,
    shape: tuple[int, ...] | None,
    names: LogicalNames | PartitionSpec | None,
    mesh: MeshLike,
    rules: LogicalRules | None = None,
    *,
    kind: NamesKind = "logical",
) -> list[Problem]:
    """Every problem of one array laid out on ``mesh``: a code, the path, the message, the fix.

    The one validator: :func:`meshplan.check`, ``get_sharding(strict=True)``,
    checkpoint restore, the train command and the layout search all check
    layouts through it. Use it for an array meshplan does not see in a tree
    (a batch, an activation), or to validate a front end's leaves one by one.

    The rules are checked too (problems at ``rules`` or ``rules[i]``); a logical
    name that no rule places is not a problem here (it is replicated, as Flax
    does; :func:`meshplan.check` warns about it across a whole tree), and a
    rule that names a mesh axis the mesh lacks is reported for the dimension
    it would place.

    Args:
        path: Where the array is, e.g. ``'params/w'`` (``meshplan._text.path_text``).
        shape: Its shape, or ``None`` when only the names are known.
        names: One logical name (``kind='logical'``) or mesh axes (``kind='mesh'``)
            per dimension; fewer names than dimensions leave the rest unsharded.
        mesh: A ``Mesh``, ``AbstractMesh`` or mapping of axis sizes.
        rules: Logical axis rules; ``None`` uses the active ones.
        kind: ``'logical'``, ``'mesh'`` or ``'unboxed'``.

    Returns:
        The problems: the rules', then the array's; errors and information (``severity='info'``).

    Example:
        >>> import meshplan
        >>> for p in meshplan.validate("params/w", (6, 8), ("embed", "mlp"), {"model": 4},
        ...                            [["embed", "model"], ["mlp", "data"]]):
        ...     print(p.code, p.path, p.message)
        indivisible params/w dim 0 ('embed') of size 6 does not divide by 4 (mesh axis 'model' of size 4)
        unknown-axis params/w dim 1 ('mlp') is placed by rules[1] on mesh axis 'data', which the mesh {'model': 4} does not have
    """
    if kind not in KINDS:
        raise ValueError(f"validate requires kind in {KINDS}, got {kind=}.")
    info = mesh_info(mesh)
    valid, index_map, problems = rules_problems(
        get_logical_axis_rules() if rules is None else rules
    )
    leaf = check_leaf(kind, None if names is None else tuple(names), shape, valid, index_map, info)
    problems.extend(leaf.at(path))
    if kind == "logical":
        problems.extend(_rule_axis_problems(leaf, info, path))
    return problems


def _rule_axis_problems(leaf: LeafCheck, mesh: MeshInfo, path: str) -> list[Problem]:
    """A dimension that a rule places on a mesh axis the mesh lacks."""
    out = []
    for d in leaf.dims:
        if d.missing_axes and d.rule_index is not None:
            out.append(
                Problem(
                    "error",
                    path,
                    f"dim {d.index} ({d.name!r}) is placed by rules[{d.rule_index}] on mesh "
                    f"axis {axes_text(d.missing_axes)}, which the mesh {mesh.shape} does not have",
                    axis_names_fix(d.missing_axes, mesh),
                    "unknown-axis",
                )
            )
    return out
