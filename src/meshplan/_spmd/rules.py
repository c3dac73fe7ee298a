"""Logical axis rules: the active rule set, its validation, and name resolution.

A rule set is an ordered sequence of ``(logical_name, mesh_axes)`` pairs, where
``mesh_axes`` is a mesh axis name, a tuple of them, ``None`` or
``PartitionSpec.UNCONSTRAINED``. Earlier rules take precedence.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict, overload

from jax.sharding import PartitionSpec

from meshplan._errors import LogicalNamesError, Problem, RulesError, error_from_problems

__all__ = [
    "AxisNames",
    "DimStatus",
    "LogicalNames",
    "LogicalRules",
    "LogicalSpecTree",
    "MeshAxes",
    "NamesKind",
    "RulePairs",
    "Rules",
    "get_logical_axis_rules",
    "logical_axis_rules",
    "logical_to_mesh_axes",
    "set_logical_axis_rules",
]

if TYPE_CHECKING:
    from jax._src.partition_spec import UnconstrainedSingleton as Unconstrained
else:
    Unconstrained = type(PartitionSpec.UNCONSTRAINED)

MeshAxes: TypeAlias = str | tuple[str, ...] | Unconstrained | None
"""One rule's mesh axes: a mesh axis name, a tuple of them, ``None`` (unsplit) or
``PartitionSpec.UNCONSTRAINED``."""
RulePairs: TypeAlias = tuple[tuple[str, MeshAxes], ...]
"""Rules, normalised: a tuple of ``(logical_name, mesh_axes)`` pairs."""
LogicalRules: TypeAlias = Sequence[tuple[str, MeshAxes | list[str]]]
"""Rules as a caller gives them: any sequence of pairs (tuples or lists, as Flax takes),
a :class:`Rules` among them."""
LogicalNames: TypeAlias = Sequence[str | tuple[str, ...] | list[str] | Unconstrained | None]
"""One array's axis names as a caller gives them, one entry per dimension: a logical (or
mesh axis) name, a tuple or list of mesh axes, ``None`` or ``PartitionSpec.UNCONSTRAINED``.
Flax's ``LogicalNames`` (``tuple[str | None, ...]``) is one."""
AxisNames: TypeAlias = tuple[MeshAxes, ...]
"""One array's axis names, normalised (:func:`normalize_names`): a tuple of entries."""
LogicalSpecTree: TypeAlias = (
    LogicalNames
    | PartitionSpec
    | Mapping[Any, "LogicalSpecTree"]
    | Sequence["LogicalSpecTree"]
    | None
)
"""A spec per leaf of a tree: :data:`LogicalNames`, a ``PartitionSpec`` or ``None``, or a
mapping or sequence of those (what ``with_logical_constraint`` takes for a tree)."""

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED


@dataclasses.dataclass(frozen=True)
class Rules(Sequence[tuple[str, MeshAxes]]):
    """Valid rules, normalised (:data:`RulePairs`), and where each pair stood in the rules given.

    ``positions[k]`` is the position of ``pairs[k]`` in what the caller gave, so that a
    problem found later names ``rules[i]`` as the caller wrote it (invalid pairs are
    dropped, and counted). A ``Rules`` is itself a sequence of pairs: every function
    that takes rules takes one.

    Example:
        >>> from meshplan._spmd.rules import Rules
        >>> rules = Rules.of([["batch", "data"], ["mlp", ["data", "model"]]])
        >>> rules.pairs, rules.positions, list(rules) == list(rules.pairs)
        ((('batch', 'data'), ('mlp', ('data', 'model'))), (0, 1), True)
    """

    pairs: RulePairs
    positions: tuple[int, ...]

    @classmethod
    def of(cls, rules: LogicalRules) -> Rules:
        """``rules`` validated and normalised; raises :class:`meshplan.RulesError` listing
        every bad pair."""
        return rules if isinstance(rules, Rules) else cls(normalize_rules(rules), ())._indexed()

    def _indexed(self) -> Rules:
        if self.positions or not self.pairs:
            return self
        return Rules(self.pairs, tuple(range(len(self.pairs))))

    @overload
    def __getitem__(self, i: int) -> tuple[str, MeshAxes]: ...
    @overload
    def __getitem__(self, i: slice) -> RulePairs: ...
    def __getitem__(self, i: int | slice) -> tuple[str, MeshAxes] | RulePairs:
        return self.pairs[i]

    def __len__(self) -> int:
        return len(self.pairs)

    def __iter__(self) -> Iterator[tuple[str, MeshAxes]]:
        return iter(self.pairs)

    def to_json(self) -> list[list[object]]:
        """The pairs as JSON-ready ``[name, axes]`` lists (axes a name, a list or ``None``).

        Example:
            >>> from meshplan._spmd.rules import Rules
            >>> Rules.of((("batch", ("data", "fsdp")), ("mlp", None))).to_json()
            [['batch', ['data', 'fsdp']], ['mlp', None]]
        """
        return rules_to_json(self.pairs)


def rules_to_json(rules: Sequence[tuple[str, MeshAxes]]) -> list[list[object]]:
    """Rules as JSON-ready ``[name, axes]`` lists: a tuple of axes becomes a list."""
    return [[n, list(a) if isinstance(a, tuple) else a] for n, a in rules]


class _Unassigned:
    """A logical name that no rule assigned (falsy, like Flax's sentinel)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "Unassigned"

    def __bool__(self) -> bool:
        return False


UNASSIGNED = _Unassigned()


# --------------------------------------------------------------------------
# The active rules (thread-local, like Flax's)
# --------------------------------------------------------------------------


class _ActiveRules(threading.local):
    rules: tuple[tuple[str, MeshAxes], ...] = ()


_active = _ActiveRules()


def set_logical_axis_rules(rules: LogicalRules) -> None:
    """Sets the active logical axis rules for the current thread.

    Example:
        >>> import meshplan
        >>> meshplan.set_logical_axis_rules((("batch", "data"), ("hidden", "model")))
        >>> meshplan.get_logical_axis_rules()
        (('batch', 'data'), ('hidden', 'model'))
        >>> meshplan.set_logical_axis_rules(())
    """
    _active.rules = normalize_rules(rules)


def get_logical_axis_rules() -> tuple[tuple[str, MeshAxes], ...]:
    """Returns the active logical axis rules; ``()`` when none were set.

    Example:
        >>> import meshplan
        >>> meshplan.get_logical_axis_rules()
        ()
    """
    return _active.rules


@contextlib.contextmanager
def logical_axis_rules(rules: LogicalRules) -> Iterator[None]:
    """Context manager that makes ``rules`` active and restores the previous ones on exit.

    Contexts nest: the innermost rules are active, and leaving it restores the
    enclosing ones.

    Example:
        >>> import meshplan
        >>> with meshplan.logical_axis_rules((("batch", "data"),)):
        ...     with meshplan.logical_axis_rules((("batch", None),)):
        ...         print(meshplan.logical_to_mesh_axes(("batch",)))
        ...     print(meshplan.logical_to_mesh_axes(("batch",)))
        P(None,)
        P('data',)
    """
    previous = _active.rules
    _active.rules = normalize_rules(rules)
    try:
        yield
    except ValueError as e:
        hint = _eager_logical_hint(e, _active.rules)
        if hint is None:
            raise
        raise hint from e
    finally:
        _active.rules = previous


_MISSING_AXIS = re.compile(r"Resource axis: (\S+) of (.+?) is not found in mesh: (\(.*?\))")


def _eager_logical_hint(error: ValueError, rules: RulePairs) -> LogicalNamesError | None:
    """meshplan's error for JAX's when Flax NNX placed a variable by *logical* names.

    ``nnx.Param(value, out_sharding=("embed", "patch"))`` under ``jax.set_mesh`` is placed
    at creation by Flax, which reads its own rules, not meshplan's: JAX then finds no
    mesh axis ``embed``. ``None`` for any other error (it propagates unchanged).
    """
    found = _MISSING_AXIS.search(str(error))
    if found is None or isinstance(error, LogicalNamesError):
        return None
    name, spec, mesh_axes = found.groups()
    if name not in {n for n, _ in rules}:
        return None
    problem = Problem(
        "error",
        "",
        f"Flax NNX placed a variable at creation (eager sharding) with out_sharding={spec}, "
        f"whose names are logical, but Flax does not read meshplan's rules: {name!r} is not "
        f"an axis of the mesh {mesh_axes}",
        "Give the variable meshplan's placement: nnx.Param(value, "
        "**meshplan.nnx_sharding(names)) or meshplan.with_nnx_partitioning(init, names); or "
        "create it with eager_sharding=False and place the state with meshplan.get_sharding "
        "(docs/nnx.md).",
        "nnx-eager-logical",
    )
    return LogicalNamesError(f"{problem.message}.\n{problem.fix}", [problem])


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------


_last_normal_rules: list[Any] = [None]
"""The last rule tuple found normal: the same object again needs no second check."""


def _is_mesh_axis_entry(axes: object) -> bool:
    if axes is None or axes is UNCONSTRAINED or isinstance(axes, str):
        return True
    return isinstance(axes, tuple | list) and all(isinstance(a, str) for a in axes)


_RULES_FIX = "Give rules as a sequence of pairs, e.g. (('batch', 'data'), ('hidden', 'model'))."
_RULE_FIX = _RULES_FIX


def _repeated_axes(axes: object) -> list[str]:
    """The mesh axes named more than once in one rule's tuple (or list) of axes."""
    if not isinstance(axes, tuple | list):
        return []
    return [a for a in dict.fromkeys(axes) if list(axes).count(a) > 1]


def rules_problems(rules: object) -> tuple[RulePairs, tuple[int, ...], list[Problem]]:
    """:func:`check_rules` as ``(pairs, index, problems)``."""
    valid, problems = check_rules(rules)
    return valid.pairs, valid.positions, problems


def check_rules(rules: object) -> tuple[Rules, list[Problem]]:
    """Checks ``rules``: the valid rules (normalised, with their positions), and one problem
    per bad one.

    Any sequence of pairs is accepted, as Flax does: tuples or lists (rules loaded
    from YAML or JSON), with a list or tuple for several mesh axes. Problems have
    the code ``'bad-rule'`` and the path ``'rules'`` (the whole is not a sequence
    of pairs) or ``'rules[i]'``.

    Example:
        >>> from meshplan._spmd.rules import check_rules
        >>> valid, problems = check_rules([["mlp", ["data", "model"]], ("embed", 3)])
        >>> valid.pairs, valid.positions
        ((('mlp', ('data', 'model')),), (0,))
        >>> problems[0].path, problems[0].code
        ('rules[1]', 'bad-rule')
    """
    if isinstance(rules, Rules):
        return rules._indexed(), []
    none = Rules((), ())
    if isinstance(rules, dict):
        return (
            none,
            [
                Problem(
                    "error",
                    "rules",
                    f"Logical axis rules must be an ordered sequence of (name, mesh_axes) pairs, "
                    f"got a dict: {rules!r}",
                    "Rule order sets precedence, so meshplan does not guess it from a dict. Use "
                    "tuple(rules.items()) if the dict's order is the one you mean.",
                    "bad-rule",
                )
            ],
        )
    if not isinstance(rules, Sequence) or isinstance(rules, str):
        return (
            none,
            [
                Problem(
                    "error",
                    "rules",
                    f"Logical axis rules must be a tuple or list of (name, mesh_axes) pairs, "
                    f"got {type(rules).__name__}: {rules!r}",
                    _RULES_FIX,
                    "bad-rule",
                )
            ],
        )
    if len(rules) == 2 and isinstance(rules[0], str) and _is_mesh_axis_entry(rules[1]):
        return (
            none,
            [
                Problem(
                    "error",
                    "rules",
                    f"Logical axis rules look like a single flat pair: {rules!r}",
                    f"Wrap it in a sequence of rules: ({tuple(rules)!r},).",
                    "bad-rule",
                )
            ],
        )
    valid: list[tuple[str, MeshAxes]] = []
    index: list[int] = []
    problems: list[Problem] = []
    for i, rule in enumerate(rules):
        if isinstance(rule, str) or not isinstance(rule, Sequence) or len(rule) != 2:
            problems.append(
                Problem(
                    "error",
                    f"rules[{i}]",
                    f"{rule!r} is not a (name, mesh_axes) pair",
                    _RULE_FIX,
                    "bad-rule",
                )
            )
            continue
        name, axes = rule
        bad = []
        if not isinstance(name, str):
            bad.append(f"the logical name must be a string, got {type(name).__name__}")
        if not _is_mesh_axis_entry(axes):
            bad.append(
                f"mesh axes must be a mesh axis name, a tuple of names, None or "
                f"PartitionSpec.UNCONSTRAINED, got {axes!r}"
            )
        repeated = _repeated_axes(axes) if not bad else []
        if repeated:
            once = tuple(dict.fromkeys(axes))
            problems.append(
                Problem(
                    "error",
                    f"rules[{i}]",
                    f"{tuple(rule)!r}: the mesh {'axis' if len(repeated) == 1 else 'axes'} "
                    f"{', '.join(map(repr, repeated))} {'is' if len(repeated) == 1 else 'are'} "
                    f"named twice; a dimension is split over each mesh axis at most once",
                    f"Name each mesh axis once in a rule, e.g. "
                    f"{(name, once if len(once) > 1 else once[0])!r}.",
                    "bad-rule",
                )
            )
            continue
        if bad:
            problems.append(
                Problem(
                    "error",
                    f"rules[{i}]",
                    f"{tuple(rule)!r}: {'; '.join(bad)}",
                    _RULE_FIX,
                    "bad-rule",
                )
            )
            continue
        valid.append((name, tuple(axes) if isinstance(axes, list) else axes))
        index.append(i)
    return Rules(tuple(valid), tuple(index)), problems


def normalize_rules(rules: object) -> RulePairs:
    """Validates ``rules`` and returns them as a hashable tuple of pairs.

    Lists (of pairs, or of mesh axes) become tuples. Every problem is reported at once.

    Example:
        >>> from meshplan._spmd.rules import normalize_rules
        >>> normalize_rules([["mlp", "tensor"], ["embed", ["data", "fsdp"]]])
        (('mlp', 'tensor'), ('embed', ('data', 'fsdp')))
    """
    if rules is _last_normal_rules[0]:
        return rules  # type: ignore[no-any-return]  # validated already (deeply immutable)
    if isinstance(rules, Rules):
        return rules.pairs
    if (
        isinstance(rules, tuple)
        and all(
            type(r) is tuple and len(r) == 2 and type(r[0]) is str and _is_mesh_axis_entry(r[1])
            for r in rules
        )
        and all(not isinstance(r[1], list) for r in rules)
        and all(type(r[1]) is not tuple or len(set(r[1])) == len(r[1]) for r in rules)
    ):
        _last_normal_rules[0] = rules
        return rules  # the common, already-normal case: no copy
    valid, problems = check_rules(rules)
    if problems:
        if len(problems) == 1 and problems[0].path == "rules":
            raise RulesError(f"{problems[0].message}.\n{problems[0].fix}", problems)
        raise error_from_problems(RulesError, "Invalid logical axis rules:", problems)
    return valid.pairs


def _is_dim_entry(name: object) -> bool:
    return _is_mesh_axis_entry(name)


def bad_entries(names: Sequence[object]) -> list[object]:
    """The entries of ``names`` that are not a name, a tuple of names, None or UNCONSTRAINED.

    Example:
        >>> from meshplan._spmd.rules import bad_entries
        >>> bad_entries(("embed", 3, ("data", "model"), None))
        [3]
    """
    return [n for n in names if not _is_dim_entry(tuple(n) if isinstance(n, list) else n)]


def names_problem(names: object, *, what: str = "array_dim_names") -> Problem | None:
    """The problem with one array's axis names, or None when they are valid.

    The problem has the code ``'names'`` and no path (the caller knows it).

    Example:
        >>> from meshplan._spmd.rules import names_problem
        >>> names_problem(("embed", "embed")).message
        "Unsupported: Dimensions ('embed',) occur more than once in array names ('embed', 'embed')"
        >>> names_problem(("embed", None)) is None
        True
    """
    if isinstance(names, str):
        return Problem(
            "error",
            "",
            f"{what} must be a tuple with one axis name per dimension, got the bare "
            f"string {names!r}",
            f"Write ({names!r},) for a 1-D array.",
            "names",
        )
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    elif not isinstance(names, tuple | list):
        return Problem(
            "error",
            "",
            f"{what} must be a tuple with one axis name (or None) per dimension, "
            f"got {type(names).__name__}: {names!r}",
            "Give a tuple such as ('embed', None).",
            "names",
        )
    names = tuple(tuple(n) if isinstance(n, list) else n for n in names)
    bad = [n for n in names if not _is_dim_entry(n)]
    if bad:
        return Problem(
            "error",
            "",
            f"{what} {names!r} holds entries that are not axis names: {bad!r}",
            "Each entry must be a name (str), a tuple of names, None or "
            "PartitionSpec.UNCONSTRAINED.",
            "names",
        )
    seen: set[str] = set()
    dups: list[str] = []  # every repeat, in the order the repeats occur
    for n in names:
        if isinstance(n, str):
            if n in seen:
                dups.append(n)
            seen.add(n)
    if dups:
        return Problem(
            "error",
            "",
            f"Unsupported: Dimensions {tuple(dict.fromkeys(dups))} occur more than "
            f"once in array names {names!r}",
            "Each logical name may name one dimension of an array; give the other dimension "
            "its own name (e.g. 'embed' and 'embed_out').",
            "names",
        )
    return None


def normalize_names(names: Any, *, what: str = "array_dim_names") -> tuple[Any, ...]:
    """Validates one array's axis names and returns them as a tuple (lists become tuples).

    Example:
        >>> from meshplan._spmd.rules import normalize_names
        >>> normalize_names(["embed", ["data", "model"], None])
        ('embed', ('data', 'model'), None)
    """
    if type(names) is tuple:  # fast path: a tuple of distinct str, None or UNCONSTRAINED
        seen: set[str] = set()
        for n in names:
            if type(n) is str:
                if n in seen:
                    break
                seen.add(n)
            elif n is not None and n is not UNCONSTRAINED:
                break
        else:
            return names
    problem = names_problem(names, what=what)
    if problem is not None:
        raise LogicalNamesError(f"{problem.message}.\n{problem.fix}", [problem])
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    return tuple(tuple(n) if isinstance(n, list) else n for n in names)


# --------------------------------------------------------------------------
# Resolution
# --------------------------------------------------------------------------


def mesh_axes_of(entry: object) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry, as a tuple (empty when unsharded).

    Example:
        >>> from jax.sharding import PartitionSpec
        >>> from meshplan._spmd.rules import mesh_axes_of
        >>> mesh_axes_of("model"), mesh_axes_of(("data", "model")), mesh_axes_of(None)
        (('model',), ('data', 'model'), ())
        >>> mesh_axes_of(PartitionSpec.UNCONSTRAINED)
        ()
    """
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple):
        return entry
    return ()  # None, UNCONSTRAINED, UNASSIGNED


# The name _plan_layout.py and _check_problems.py import (they are being refactored apart).
_axes_of = mesh_axes_of


NamesKind: TypeAlias = Literal["logical", "mesh", "unboxed"]
"""What an array's names are: logical names for the rules to resolve, mesh axes given
directly, or none (an array in no box or variable)."""

DimStatus: TypeAlias = Literal["rule", "mesh", "no-rule", "unnamed", "unconstrained", "unboxed"]
"""How one dimension was placed: by a rule, by mesh axes given directly, by no rule (a
logical name no rule places: replicated), unnamed (``None``), ``UNCONSTRAINED``, or as an
array with no names at all."""

SkipReason: TypeAlias = Literal[
    "dimension already assigned", "mesh axis taken", "tuple partly taken"
]
"""Why a rule that names a dimension did not place it."""


@dataclasses.dataclass(frozen=True)
class SkippedRule:
    """A rule that named a dimension but did not place it, and why."""

    rule_index: int
    rule: tuple[str, MeshAxes]
    reason: SkipReason
    taken_by: tuple[int, ...] = ()  # the dimensions already holding a requested mesh axis


@dataclasses.dataclass(frozen=True)
class DimResolution:
    """How one dimension of one array got its mesh axes."""

    name: object
    mesh_axes: object  # UNASSIGNED when no rule placed a logical name
    rule_index: int | None  # the rule that placed it, if any
    skipped: tuple[SkippedRule, ...] = ()


class _DimTrace(TypedDict):
    """What :func:`_resolve` records for one dimension as it goes (see :class:`DimResolution`)."""

    rule_index: int | None
    skipped: list[SkippedRule]


def _resolve(
    names: AxisNames,
    rules: tuple[tuple[str, MeshAxes], ...],
    trace: list[_DimTrace] | None,
) -> tuple[object, ...]:
    result: list[object] = [UNASSIGNED if isinstance(n, str) else n for n in names]
    used = {a for r in result for a in mesh_axes_of(r)}  # mesh axes held by some dimension
    for rule_index, (rule_name, rule_axes) in enumerate(rules):
        if rule_name not in names:
            continue
        pos = names.index(rule_name)
        wanted = mesh_axes_of(rule_axes)
        if result[pos] is UNASSIGNED and used.isdisjoint(wanted):
            result[pos] = rule_axes
            used.update(wanted)
            if trace is not None:
                trace[pos]["rule_index"] = rule_index
        elif trace is not None:
            taken_by = tuple(i for i, r in enumerate(result) if set(mesh_axes_of(r)) & set(wanted))
            reason: SkipReason
            if result[pos] is not UNASSIGNED:
                reason = "dimension already assigned"
            elif len(wanted) > 1 and not all(
                any(a in mesh_axes_of(result[i]) for i in taken_by) for a in wanted
            ):
                reason = "tuple partly taken"
            else:
                reason = "mesh axis taken"
            trace[pos]["skipped"].append(
                SkippedRule(rule_index, (rule_name, rule_axes), reason, taken_by)
            )
    return tuple(result)


@functools.lru_cache(maxsize=8192)
def _resolve_cached(
    names: AxisNames, rules: tuple[tuple[str, MeshAxes], ...]
) -> tuple[object, ...]:
    return _resolve(normalize_names(names), normalize_rules(rules), None)


def resolve(names: object, rules: LogicalRules) -> tuple[object, ...]:
    """Mesh axes per dimension, with ``UNASSIGNED`` where no rule matched a logical name."""
    try:
        return _resolve_cached(names, rules)
    except TypeError:  # unhashable: lists somewhere
        return _resolve(normalize_names(names), normalize_rules(rules), None)


def resolve_with_trace(names: object, rules: LogicalRules) -> tuple[DimResolution, ...]:
    """Like :func:`resolve`, recording for each dimension which rule placed it and which
    rules named it but were skipped."""
    names = normalize_names(names)
    pairs = normalize_rules(rules)
    trace: list[_DimTrace] = [{"rule_index": None, "skipped": []} for _ in names]
    result = _resolve(names, pairs, trace)
    return tuple(
        DimResolution(n, r, t["rule_index"], tuple(t["skipped"]))
        for n, r, t in zip(names, result, trace, strict=True)
    )


def split_axes(
    names: LogicalNames, rules: LogicalRules, sizes: Mapping[str, int]
) -> tuple[tuple[str, ...], ...]:
    """The mesh axes of size above 1 that each dimension of an array named ``names`` is
    split over: :func:`logical_to_mesh_axes`'s answer, on a mesh of ``sizes``.

    Example:
        >>> from meshplan._spmd.rules import split_axes
        >>> split_axes(("batch", "embed"), (("batch", ("data", "fsdp")), ("embed", "fsdp")),
        ...            {"data": 1, "fsdp": 4})
        (('fsdp',), ())
    """
    spec = logical_to_mesh_axes(names, rules)
    return tuple(tuple(a for a in mesh_axes_of(e) if sizes.get(a, 1) > 1) for e in spec)


def to_partition_spec(resolved: Sequence[object]) -> PartitionSpec:
    """``PartitionSpec`` from resolved axes, unassigned dimensions unsharded."""
    return PartitionSpec(*(None if r is UNASSIGNED else r for r in resolved))


@functools.lru_cache(maxsize=8192)
def _mesh_axes_cached(names: AxisNames, rules: tuple[object, ...]) -> PartitionSpec:
    # Not through _resolve_cached: a miss here would miss there too, and fill it for nothing.
    return to_partition_spec(_resolve(normalize_names(names), normalize_rules(rules), None))


@overload
def logical_to_mesh_axes(
    array_dim_names: LogicalNames | PartitionSpec, rules: LogicalRules | None = None
) -> PartitionSpec: ...
@overload
def logical_to_mesh_axes(array_dim_names: None, rules: LogicalRules | None = None) -> None: ...
def logical_to_mesh_axes(
    array_dim_names: LogicalNames | PartitionSpec | None,
    rules: LogicalRules | None = None,
) -> PartitionSpec | None:
    """Computes the mesh layout of one array from its logical dimension names.

    The rules are in order of precedence, and consist of pairs
    ``(ArrayDimensionName, MeshDimensionName)``, meaning that the given array
    dimension (if present and unused) should be sharded across the given mesh
    dimension (if present and unused). Dimensions that no rule assigns are
    unsharded; ``None`` and ``PartitionSpec.UNCONSTRAINED`` pass through.

    For example, given an array with::

        array_dim_names = ('batch', 'length', 'heads', 'features')

    and the layout rules::

        rules = (('batch', 'X'),
                 ('features', 'X'),
                 ('heads', 'Y'),
                 ('batch', 'Z'))

    this function returns ``PartitionSpec('X', None, 'Y', None)``: ``batch``
    takes ``X``, so ``features`` cannot; ``heads`` takes ``Y``; the second
    ``batch`` rule is skipped because ``batch`` is already placed.

    >>> import meshplan
    >>> rules = (('batch', 'X'), ('features', 'X'), ('heads', 'Y'), ('batch', 'Z'))
    >>> meshplan.logical_to_mesh_axes(('batch', 'length', 'heads', 'features'), rules)
    P('X', None, 'Y', None)

    Args:
        array_dim_names: One logical name (or ``None``) per dimension, or ``None``.
        rules: Rules to use instead of the active ones (see :func:`logical_axis_rules`).

    Returns:
        The ``PartitionSpec`` of the array, or ``None`` when ``array_dim_names`` is ``None``.

    Raises:
        LogicalNamesError: a name occurs twice, or the names are not a tuple.
        RulesError: the rules are not a sequence of ``(name, mesh_axes)`` pairs.
    """
    if array_dim_names is None:
        return None
    if rules is None:
        rules = _active.rules
    try:
        return _mesh_axes_cached(array_dim_names, rules)
    except TypeError:  # unhashable: lists (rules or names from YAML/JSON) somewhere
        names = normalize_names(array_dim_names)
        return _mesh_axes_cached(names, normalize_rules(rules))
