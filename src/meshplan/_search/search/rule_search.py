"""Searching the space of rules: candidates generated, pruned, priced, a few compiled.

:func:`search_rules` traces the step once (:mod:`meshplan._search.predict.trace`), builds
every candidate (:mod:`meshplan._search.search.candidates`: the built-in layouts, then
generated meshes of 1 to 3 axes with rules), prunes by symmetry, the
validator (:func:`meshplan.validate` on every distinct array and the batch),
idle axes and the memory budget, predicts the step time of every survivor
(:mod:`meshplan._search.predict.cost`) and ranks by it. Only the first ``compile_top``
are compiled (when this process has the devices) to refine with the HLO's
exact collective bytes and XLA's memory analysis; ``measure=True`` runs the
first ``measure_top`` for real and ranks them by measured time. Nothing needs
devices unless it compiles or measures: a 16,384-device search is analytic.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence, Set
from typing import TYPE_CHECKING, Any, TypeAlias, Unpack

import jax

from meshplan._errors import ArgumentError, error_for
from meshplan._search.measure.hlo import measure_step
from meshplan._search.predict.cost import (
    DotCache,
    Resolved,
    _Specs,
    predict_specs,
    state_bytes,
    state_counts,
)
from meshplan._search.predict.infer import name_unnamed
from meshplan._search.predict.inputs import check_search_args, whole_number
from meshplan._search.predict.profiles import get_profile, runs_here, with_attention
from meshplan._search.predict.step import check_microbatches, linen_step, split_batch
from meshplan._search.predict.trace import Names, Workload, trace_workload
from meshplan._search.search.candidates import (
    ALL_ROLES,
    CONTEXT_NAMES,
    Candidate,
    generate,
    layout_candidates,
)
from meshplan._search.search.options import (
    SearchChecks,
    SearchHardware,
    SearchKeywords,
    SearchSpace,
    search_options,
)
from meshplan._search.search.pipeline_verdict import (
    PIPELINE_LAYOUTS,
    layer_count,
    pipeline_rows,
    runs_stages,
)
from meshplan._search.search.result import (
    PRUNE_REASONS,
    PruneKind,
    RankedBy,
    SearchCounts,
    SearchResult,
    SearchRow,
    require_devices,
)
from meshplan._search.search.rule_record import Places, RuleRecord, place_ids, signature_key
from meshplan._search.search.static import as_given, static_rows
from meshplan._spmd.rules import (
    LogicalRules,
    RulePairs,
    logical_to_mesh_axes,
    mesh_axes_of,
    normalize_rules,
    rules_problems,
)
from meshplan._spmd.validate import validate
from meshplan._text import human_bytes
from meshplan.layouts import LAYOUTS, get_layout

if TYPE_CHECKING:
    import flax.linen as nn
    import optax

__all__ = [
    "PRUNE_REASONS",
    "RuleRow",
    "RuleSearchResult",
    "example_search",
    "search_rules",
]

RuleRow = SearchRow
"""The row of :func:`search_rules`: :class:`meshplan._search.search.result.SearchRow` (one row type)."""

RuleSearchResult = SearchResult
"""What :func:`search_rules` returns: :class:`meshplan.SearchResult` (one result type)."""

Leaves = list[tuple[Names, tuple[int, ...]]]
"""The distinct (names, shape) of the state's arrays."""


@functools.cache
def example_search() -> SearchResult:
    """The search of :func:`search_rules`'s example, run once per process: the examples of
    :class:`meshplan.SearchResult`'s methods share it.

    It is ``meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)``
    of one 4096x4096 weight ``('embed', 'mlp')`` and a batch of 64.

    Example:
        >>> from meshplan._search.search.rule_search import example_search
        >>> example_search() is example_search(), example_search().devices
        (True, 8)
    """
    import jax.numpy as jnp

    from meshplan._spmd.boxes import LogicallyPartitioned

    w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
    state = {"w": LogicallyPartitioned(w, ("embed", "mlp"))}

    def step(s: Any, x: Any) -> Any:
        return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)

    x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
    return search_rules(8, state, step, x, profile="h100", compile_top=0)


TIE = 0.03
"""Predictions within 3% of each other are ties (the cost model is not that exact, and a
measured CPU profile moves that much from run to run): broken by a fixed order."""


def _step(row: SearchRow) -> float:
    return row.cost.step_s if row.cost is not None else math.inf


def _rank(rows: list[SearchRow], ranked_by: RankedBy = "predicted") -> list[SearchRow]:
    """Rows by predicted time; ties (:data:`TIE`) broken deterministically: built-in layouts,
    fewer mesh axes, smaller groups for the collectives the step waits for
    (``Cost.meeting_devices``: such a collective waits for the slowest device of its group,
    which the time model does not count), less memory, then the mesh and rules' text; rows
    just compiled again by their refined times, with the same ties (a compile pins the
    collective bytes, not the time model's precision). ``'static'``: by
    :meth:`~meshplan._search.search.result.SearchRow._static_key` (within the budget, state bytes,
    idle axes, then the bytes moved; measured bytes where compiled), stable."""
    if ranked_by == "static":
        return sorted(rows, key=SearchRow._static_key)
    out: list[SearchRow] = []
    for group in _time_groups(rows):
        group.sort(
            key=lambda r: (
                r.layout == "searched",
                len(r.mesh),
                r.cost.meeting_devices if r.cost else 1,
                r.cost.memory_bytes if r.cost else 0,
                r.mesh_text,
                r.axes_text,
                r.short_rules,
            )
        )
        out += group
    return out


def _time_groups(rows: Sequence[SearchRow]) -> list[list[SearchRow]]:
    """``rows`` by predicted time in groups of ties: each the rows within :data:`TIE` of the
    fastest not in an earlier group."""
    by_time = sorted(rows, key=_step)
    groups: list[list[SearchRow]] = []
    i = 0
    while i < len(by_time):
        limit = _step(by_time[i]) * (1 + TIE)
        j = i + 1
        while j < len(by_time) and _step(by_time[j]) <= limit:
            j += 1
        groups.append(by_time[i:j])
        i = j
    return groups


def ties(rows: Sequence[SearchRow]) -> list[list[int]]:
    """The ranks of the rows predicted within :data:`TIE` of each other (a tie, which
    :func:`_rank` orders by a fixed order, not by time), for each tie of two or more.

    Example:
        >>> from meshplan._search.search.rule_search import example_search, ties
        >>> ties(example_search().ok)
        [[11, 12], [14, 15, 16]]
    """
    groups = _time_groups([r for r in rows if r.cost is not None and r.rank is not None])
    return [sorted(r.rank for r in g if r.rank is not None) for g in groups if len(g) > 1]


def _own_rules(rules: RulePairs, workload: Workload) -> RulePairs:
    """A built-in layout's rules for this model: only the names the model has (``batch``
    too), then every other name it has, unsplit, so that a rules file written from it names
    all of them (``meshplan check`` then finds nothing unknown)."""
    model = set(workload.names) | {"batch"}
    own = [(n, a) for n, a in rules if n in model]
    given = {n for n, _ in own}
    return (*own, *((n, None) for n in workload.names if n not in given))


def _signature(
    c: Candidate,
    hierarchical: bool,
    leaves: Leaves,
    batch_names: Names,
    places: Places,
    specs: _Specs | None = None,
) -> tuple[tuple[int, int], ...]:
    """What makes two candidates the same: where each mesh axis splits the state's arrays
    and the batch (dimension by dimension), whatever its name. Axes that split the same
    dimensions are one axis of their product (merged) unless the profile's links differ
    by position (``hierarchical``: then mesh order counts too). ``places``: each place
    as an int, shared by the candidates of a search (:func:`signature_key`); a generated
    candidate's is its rules' :class:`RuleRecord`'s, the same."""
    specs = specs if specs is not None else _Specs(c.mesh, c.rules)
    found: dict[str, list[tuple[int, int]]] = {}
    arrays = [*leaves, (batch_names, (0,) * len(batch_names))]
    for i, (names, shape) in enumerate(arrays):
        for d, axes in enumerate(specs(names, len(shape))):
            for a in axes:
                found.setdefault(a, []).append((i, d))
    where = {a: tuple(w) for a, w in found.items()}
    place = place_ids(where, [a for a, s in c.mesh.items() if s > 1], places)
    return signature_key(c.mesh, place, hierarchical)


def _divides(c: Candidate, leaves: Leaves, specs: _Specs | None = None) -> int | None:
    """The index of the first leaf whose split does not divide its shape (fast), or None."""
    specs = specs if specs is not None else _Specs(c.mesh, c.rules)
    for i, (names, shape) in enumerate(leaves):
        for size, axes in zip(shape, specs(names, len(shape)), strict=True):
            if axes and size % math.prod(c.mesh[a] for a in axes):
                return i
    return None


class _Checks:
    """What :func:`meshplan.validate` would find that a fast divisibility pass cannot, asked
    once per distinct rules and once per leaf for a whole search, not per candidate.

    A generated candidate whose rules have no error, whose rules name only axes of its
    mesh, and whose leaves have no error of their own (names, rank, shape: asked with no
    mesh and no rules) can only be rejected by the validator for a dimension that does not
    divide (logical names never resolve to one axis twice), which :func:`_divides` finds.
    """

    def __init__(self) -> None:
        self.rules: dict[Any, bool] = {}
        self.leaves: dict[tuple[Names, tuple[int, ...]], bool] = {}
        self.errors: dict[tuple[Any, ...], str | None] = {}

    def first_error(
        self,
        path: str,
        shape: tuple[int, ...],
        names: Names,
        c: Candidate,
        fast: bool,
        record: RuleRecord | None = None,
    ) -> str | None:
        """The first error :func:`meshplan.validate` reports for one array, or None.

        ``fast`` (:meth:`only_divisibility`): its answer is then that of the array's
        resolved axes and their sizes, whatever the rest of the candidate, and is asked
        once per such key (``record``: ``c``'s rules', which resolve the array once)."""
        if not fast:
            return _first_error(validate(path, shape, names, c.mesh, c.rules))
        entries = (
            record.entries_of(names)
            if record is not None
            else tuple(logical_to_mesh_axes(names, c.rules))
        )
        sizes = tuple(c.mesh[a] for e in entries for a in mesh_axes_of(e))
        key = (path, shape, names, entries, sizes)
        if key not in self.errors:
            self.errors[key] = _first_error(validate(path, shape, names, c.mesh, c.rules))
        return self.errors[key]

    def rules_clean(self, rules: RulePairs) -> bool:
        got = self.rules.get(rules)
        if got is None:
            _, _, problems = rules_problems(rules)
            got = self.rules[rules] = not any(p.severity == "error" for p in problems)
        return got

    def leaf_clean(self, names: Names, shape: tuple[int, ...]) -> bool:
        key = (names, shape)
        got = self.leaves.get(key)
        if got is None:
            plain = all(n is None or isinstance(n, str) for n in names)
            got = self.leaves[key] = plain and not any(
                p.severity == "error" for p in validate("state", shape, names, {}, ())
            )
        return got

    def only_divisibility(self, c: Candidate, leaves: Leaves) -> bool:
        """Whether only a dimension that does not divide can make ``c`` invalid."""
        if c.layout != "searched" or not self.rules_clean(c.rules):
            return False
        for _, axes in c.rules:
            if any(a not in c.mesh for a in mesh_axes_of(axes)):
                return False
        return all(self.leaf_clean(names, shape) for names, shape in leaves)


def _first_error(problems: list[Any]) -> str | None:
    return next((p.message for p in problems if p.severity == "error"), None)


def _ask(
    checks: _Checks | None,
    path: str,
    shape: tuple[int, ...],
    names: Names,
    c: Candidate,
    fast: bool,
    record: RuleRecord | None = None,
) -> str | None:
    """The validator's first error for one array of ``c``, through ``checks`` when given."""
    if checks is not None:
        return checks.first_error(path, shape, names, c, fast, record)
    return _first_error(validate(path, shape, names, c.mesh, c.rules))


Pruned: TypeAlias = tuple[PruneKind, str]
"""Why a candidate is pruned: its kind, as a record, and the reason ``'<kind>: <detail>'``
written from it (never read back)."""


def _pruned(kind: PruneKind, detail: str) -> Pruned:
    return kind, f"{kind}: {detail}"


_SYMMETRIC = _pruned("symmetric", "the same splits as a candidate listed before")


def _prune(
    c: Candidate,
    batch: int | None,
    batch_names: Names,
    leaves: Leaves,
    acts: Names,
    specs: _Specs | None = None,
    checks: _Checks | None = None,
    record: RuleRecord | None = None,
) -> Pruned | None:
    """Why the validator (or an idle axis) rejects ``c`` (its kind and reason), or ``None``.
    ``record``: what
    ``c``'s rules decide (a generated candidate's, where it :meth:`~RuleRecord.applies`),
    found once for the candidates of a search that share them; with ``checks``.

    A fast divisibility pass finds the leaf to ask :func:`meshplan.validate` about; rules
    naming axes the mesh lacks (given layouts) are asked about for every leaf. With
    ``checks`` (a search's), a generated candidate that only divisibility can reject and
    whose leaves all divide is not asked about again (:class:`_Checks`): the same answer."""
    specs = specs if specs is not None else _Specs(c.mesh, c.rules)
    given = c.layout != "searched"
    if record is not None:
        first = record.first_indivisible(c.mesh)
        fast = record.clean  # checks.only_divisibility(c, leaves), found once per rules
    else:
        first = _divides(c, leaves, specs)
        fast = checks is not None and checks.only_divisibility(c, leaves)
    if not (fast and first is None):
        for names, shape in leaves if given or first is None else [leaves[first]]:
            error = _ask(checks, "state", shape, names, c, fast, record)
            if error is not None:
                return _pruned("invalid", error)
    if batch is not None:
        shape = (batch,) + (1,) * (len(batch_names) - 1)
        axes = record.batch_axes if record is not None else specs(batch_names, len(shape))[0]
        split = math.prod(c.mesh[a] for a in axes)
        if not (fast and batch > 0 and batch % split == 0):
            error = _ask(checks, "batch", shape, batch_names, c, fast, record)
            if error is not None:
                return _pruned("batch", error)
    if record is not None:
        used: Set[str] = record.used
    else:
        used = {a for names, shape in leaves for axes in specs(names, len(shape)) for a in axes}
        used |= {a for axes in specs(batch_names, len(batch_names)) for a in axes}
        used |= {a for axes in specs(acts, len(acts)) for a in axes}
    idle = [a for a, s in c.mesh.items() if s > 1 and a not in used]
    if idle:
        return _pruned("idle", f"mesh axis {idle[0]!r} ({c.mesh[idle[0]]}) splits nothing")
    return None


def _reshaped_dims(workload: Workload) -> list[tuple[str, int]]:
    """``(name, size)`` of the dimensions a state name names at a size no state array has it
    at, where a reshape splits it (:attr:`Workload.parts`: Mistral's 2 key/value heads of its
    64-wide key projection) or a matmul reads it (GPT-2's 12 heads of its 2,304-wide fused
    one)."""
    held = {
        (n, s)
        for names, shape, _ in workload.state
        if names
        for n, s in zip(names, shape, strict=False)
    }
    read = {
        (n, s)
        for dot in workload.dots
        for names, shape in ((dot.lhs_names, dot.lhs_shape), (dot.rhs_names, dot.rhs_shape))
        for n, s in zip(names or (), shape, strict=False)
    }
    params = set(workload.param_names)
    found = {
        (n, s)
        for n, s in read | workload.parts
        if type(n) is str and n in params and (n, s) not in held
    }
    return sorted(found)


def _uneven(dims: Sequence[tuple[str, int]], specs: _Specs) -> Pruned | None:
    """Why a candidate splits a reshaped dimension (:func:`_reshaped_dims`) over more
    devices than divide it, or ``None``: XLA pads it and moves it between devices, which
    the planner does not price. An axis that splits the batch does not split them there
    (FSDP's: the step's arrays give it to the batch, their first dimension)."""
    batch = set(specs(("batch",), 1)[0])
    for name, size in dims:
        axes = [a for a in specs((name,), 1)[0] if a not in batch]
        split = math.prod(specs.sizes[a] for a in axes)
        if size % split:
            where = ", ".join(f"{a!r} of size {specs.sizes[a]}" for a in axes)
            return _pruned(
                "invalid",
                f"{name!r} has size {size} inside the step (a reshape of a state array's "
                f"dimension), which does not divide by {split} (mesh axis {where}): XLA "
                f"would pad it and move it between devices; split {name!r} over axes whose "
                f"devices divide {size}, or leave it unsplit",
            )
    return None


def search_rules(
    devices: int,
    abstract_state: Any = None,
    step_fn: Callable[[Any, Any], Any] | None = None,
    example_batch: Any = None,
    *,
    model: nn.Module | None = None,
    loss: Callable[[Any, Any], Any] | None = None,
    optimizer: optax.GradientTransformation | None = None,
    workload: Workload | None = None,
    space: SearchSpace | None = None,
    hardware: SearchHardware | None = None,
    checks: SearchChecks | None = None,
    ranked_by: RankedBy | None = None,
    batch: int | None = None,
    microbatches: int = 1,
    **keywords: Unpack[SearchKeywords],
) -> SearchResult:
    """Searches meshes of ``devices`` and logical rules for the fastest predicted step.

    Give the step as ``(abstract_state, step_fn, example_batch)``, or a Flax Linen
    ``model`` with ``example_batch`` (its inputs) and optionally ``loss``/``optimizer``
    (:func:`linen_step` builds the step), or a traced ``workload``. A state with no
    names at all (a Hugging Face or Equinox model, plain arrays) is named first from
    its step's dataflow (:func:`meshplan.infer_names`); the result's ``path_rules``
    are those names, for :func:`meshplan.name_by_path` or ``--names``.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
        >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
        >>> def step(state, x):
        ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(state["w"].value)
        >>> result = meshplan.search_rules(8, state, step, jax.ShapeDtypeStruct((64, 4096), jnp.float32),
        ...                                profile="h100", compile_top=0)
        >>> result.best.mesh_text, result.best.layout    # Megatron-style: the weight split by columns
        ('1x8', 'tensor_parallel')
        >>> result.counts["enumerated"] > result.counts["scored"] > 0
        True

        :class:`meshplan.SearchResult`'s examples use this search
        (:func:`example_search`); ``max_axes=0`` searches only the ``layouts``.

        Without a step (only ``abstract_state``), or with ``ranked_by='static'``, nothing
        is traced: only the ``layouts`` are searched, over every shape of ``axis_names``,
        each checked by :func:`meshplan.explain` (rejected with the path and the problem),
        and ranked by memory per device (:mod:`meshplan._search.search.static`: within the
        budget, state bytes on the fullest device, idle axes, then a static estimate of the
        bytes moved); a step, when given, is only compiled (``compile_top``).
        :func:`meshplan.search_layouts` is this search.

        >>> static = meshplan.search_rules(8, state, layouts=["fsdp", "data_parallel"])
        >>> static.ranked_by, static.best.mesh_text, static.best.layout, static.profile
        ('static', '1x8', 'fsdp', None)

        What is searched, what it is priced on and what is compiled are three records
        (:class:`meshplan.SearchSpace`, :class:`meshplan.SearchHardware`,
        :class:`meshplan.SearchChecks`); their fields are also taken as keywords, as
        before the records (``profile="h100"`` is ``hardware=SearchHardware("h100")``):

        >>> again = meshplan.search_rules(8, state, step, jax.ShapeDtypeStruct((64, 4096), jnp.float32),
        ...                               hardware=meshplan.SearchHardware("h100"),
        ...                               checks=meshplan.SearchChecks(compile_top=0))
        >>> again.best.mesh_text == result.best.mesh_text
        True

    Args:
        devices: The device count (any: nothing runs unless compiling or measuring).
        abstract_state: The state (``jax.eval_shape`` of init), boxed or NNX.
        step_fn: ``step_fn(state, batch)``, not jitted.
        example_batch: The batch (its arrays' first dimension is ``'batch'``).
        model: A Flax Linen module, in place of the three above (with ``example_batch``).
        loss: ``loss(outputs, batch)`` for ``model``.
        optimizer: An Optax optimizer for ``model`` (default Adam).
        workload: A traced workload (skips tracing).
        space: What is tried (:class:`meshplan.SearchSpace`: ``layouts``, default all
            built-in layouts on ``('data', 'model')`` and the pipeline layouts where the
            model has a ``layer`` stack; ``names``, default every name but ``layer``;
            ``roles``, ``data``, ``fsdp``, ``tensor``, and ``context``, ``expert`` where
            the model has such names; ``max_axes``, 0 for the layouts only;
            ``axis_names``, the layouts' mesh axes).
        hardware: What the step is priced on (:class:`meshplan.SearchHardware`:
            ``profile``, ``'cpu'`` measured here, ``'h100'``, ``'tpu_v5e'``... or a
            :class:`meshplan.HardwareProfile`; ``memory_budget_bytes``, default the
            profile's memory).
        checks: What is compiled and run (:class:`meshplan.SearchChecks`:
            ``compile_top``, needing ``devices`` JAX devices, else none; ``measure``,
            ``measure_top``, ``measure_steps``: the first rows run and ranked by the
            median measured time).
        **keywords: Any field of the three records, as before them
            (:class:`~meshplan._search.search.options.SearchKeywords`); not with the
            record it belongs to.
        ranked_by: ``'predicted'`` (by predicted step time: needs a step) or ``'static'``
            (by memory per device: no step is traced); default: ``'predicted'`` with a
            step, ``'static'`` without one.
        batch: The global batch size the static ranking checks (default: the
            ``example_batch``'s, else unchecked); with a step, the example batch's.
        microbatches: The step accumulates gradients over this many microbatches of the
            ``example_batch`` (split along its first dimension; a ``workload`` is one
            microbatch's): priced as :func:`meshplan._search.predict.cost.predict` does, with one
            microbatch's activations; compiled and measured candidates run one microbatch.

    Raises:
        ArgumentError: neither a state, a step nor a model; ``ranked_by='predicted'``
            without a step; a ``batch`` other than the example batch's.
        MeshError: ``measure`` with fewer JAX devices than ``devices`` (code
            ``'too-few-devices'``, as :func:`meshplan.search_layouts` raises).
    """
    t0 = time.perf_counter()
    space, hardware, checks = search_options(space, hardware, checks, keywords)
    profile, memory_budget_bytes = hardware.profile, hardware.memory_budget_bytes
    layouts, names, roles = space.layouts, space.names, space.roles
    max_axes, axis_names = space.max_axes, space.axis_names
    compile_top, measure = checks.compile_top, checks.measure
    measure_top, measure_steps = checks.measure_top, checks.measure_steps
    check_microbatches(microbatches)
    check_search_args(
        devices=devices,
        budget=memory_budget_bytes,
        roles=roles,
        all_roles=ALL_ROLES,
        max_axes=max_axes,
        names=names,
        batch=batch,
        counts={
            "compile_top": compile_top,
            "measure_top": measure_top,
            "measure_steps": measure_steps,
        },
    )
    if memory_budget_bytes is not None:  # a whole number: 16e9 is 16_000_000_000
        memory_budget_bytes = whole_number(memory_budget_bytes)
    if model is not None:
        if example_batch is None:
            raise error_for(
                ArgumentError,
                "missing-argument",
                "example_batch",
                "search_rules(model=...) needs example_batch= (the model's inputs)",
                "Pass example_batch=, a batch of the model's inputs (arrays or ShapeDtypeStructs).",
            )
        abstract_state, step_fn, example_batch = linen_step(model, example_batch, loss, optimizer)
    if ranked_by == "static" or (
        ranked_by is None and workload is None and step_fn is None and abstract_state is not None
    ):
        _generated_only(roles, max_axes, names)
        return _static_search(
            devices,
            abstract_state,
            step_fn,
            example_batch,
            layouts,
            axis_names,
            batch,
            memory_budget_bytes,
            compile_top,
            measure,
            measure_top,
            measure_steps,
            t0,
        )
    path_rules = None
    if workload is None:
        if step_fn is None or abstract_state is None or example_batch is None:
            raise error_for(
                ArgumentError,
                "missing-argument",
                "step_fn",
                "search_rules has no step to trace",
                "Pass (abstract_state, step_fn, example_batch), or model= with example_batch=, "
                "or workload=.",
            )
        example_batch = split_batch(example_batch, microbatches)
        inferred = name_unnamed(step_fn, abstract_state, example_batch)
        if inferred is not None:  # a model with no names: named from its step's dataflow
            path_rules, abstract_state, step_fn, workload = inferred
        else:
            workload = trace_workload(step_fn, abstract_state, example_batch, read_constraints=True)
    whole = None if workload.batch is None else workload.batch * microbatches
    if batch is not None and batch != whole:
        raise error_for(
            ArgumentError,
            "bad-batch",
            "batch",
            f"search_rules got batch={batch}, and its example batch holds {whole}",
            "Leave batch= out: with a step, the batch is the example batch's.",
        )
    _check_measure(measure, step_fn, devices)
    have_devices = jax.device_count() >= devices
    prof = with_attention(get_profile(profile, devices), hardware.attention)
    budget = memory_budget_bytes if memory_budget_bytes is not None else prof.memory_bytes
    named = _named(layouts)
    # Layouts with a stage (the pipelines) are priced as pipelines, on their own meshes.
    piped_layouts = (
        PIPELINE_LAYOUTS
        if layouts is None
        else {
            n: normalize_rules(r)
            for n, r in named.items()
            if any(k == "stage" for k, _ in normalize_rules(r))
        }
    )
    given = {
        n: _own_rules(normalize_rules(r), workload)
        for n, r in named.items()
        if n not in piped_layouts
    }
    search_names = [n for n in (names or workload.param_names) if n != "layer"]
    if names is None:  # activations' own names (MaxText's activation_embed) may split too
        search_names += [
            n for n in workload.names if n.startswith("activation_") and n not in CONTEXT_NAMES
        ]
    other = [n for n in workload.names if n not in search_names and n != "batch"]
    candidates = layout_candidates(devices, given, axis_names, layouts_first=True)
    candidates += generate(devices, search_names, other_names=other, max_axes=max_axes, roles=roles)
    hierarchical = devices > prof.domain_devices
    leaves = list(dict.fromkeys((n, s) for n, s, _ in workload.state if n is not None))
    batch = workload.batch
    batch_names: Names = ("batch",)
    pruned: dict[PruneKind, int] = dict.fromkeys(PRUNE_REASONS, 0)
    acts = tuple(n for n in workload.names if n in CONTEXT_NAMES or n.startswith("activation_"))
    sig_arrays = [*leaves, (acts, (0,) * len(acts))] if acts else leaves
    reshaped = _reshaped_dims(workload)
    seen: set[Any] = set()
    rows: list[SearchRow] = []
    out: list[SearchRow] = []
    validity = _Checks()
    dot_cache: DotCache = {}  # matmul costs, shared by the candidates with the same splits
    resolved: Resolved = {}  # arrays' resolutions, shared by the candidates with the same rules
    # What depends on a generated candidate's rules alone (where every axis they name
    # splits), found once per rules and shared by the many mesh shapes of the same axes:
    # each array's spec, where each axis splits, the axes used, what must divide.
    records: dict[RulePairs, RuleRecord] = {}
    in_state = state_counts(workload)
    places: Places = {}  # where an axis splits, as an int: signatures of ints
    for c in candidates:
        searched = c.layout == "searched"
        record = records.get(c.rules) if searched else None
        if searched and record is None:
            clean = validity.rules_clean(c.rules) and all(validity.leaf_clean(*a) for a in leaves)
            record = records[c.rules] = RuleRecord(
                c.rules, resolved, leaves, sig_arrays, batch_names, acts, clean, places
            )
        if record is not None and record.applies(c.mesh):
            # A generated candidate with the splits of one listed before is that candidate
            # (asked first: it is cheaper than the validator, and most are).
            sig = signature_key(c.mesh, record.place, hierarchical)
            if sig in seen:
                pruned["symmetric"] += 1
                continue
            specs = _Specs(c.mesh, c.rules, resolved, True, record.specs, splits=True)
        else:
            record = None
            # one per candidate, for every question; a generated candidate's rules are pairs
            specs = _Specs(c.mesh, c.rules, resolved, searched)
            sig = _signature(c, hierarchical, sig_arrays, batch_names, places, specs)
        row = SearchRow(c.mesh, c.rules, c.layout)
        if searched and sig in seen:
            why: Pruned | None = _SYMMETRIC
        else:
            why = _prune(c, batch, batch_names, leaves, acts, specs, validity, record)
            why = why or _uneven(reshaped, specs)
            if why is None and sig in seen:
                why = _SYMMETRIC
            if searched or why is None:
                seen.add(sig)
        if why is None:
            held = state_bytes(workload, specs, in_state)
            row.bytes_per_device = held  # the state's (the closest to fit, when nothing does)
            if held > budget:  # the state alone: no need to price the step
                why = _pruned(
                    "memory",
                    f"the state alone, {human_bytes(held)} per device, "
                    f"is over the budget of {human_bytes(budget)}",
                )
        if why is None:
            row.cost = predict_specs(workload, specs, prof, dot_cache, microbatches)
            if row.cost.memory_bytes > budget:
                why = _pruned(
                    "memory",
                    f"{human_bytes(row.cost.memory_bytes)} per device is "
                    f"over the budget of {human_bytes(budget)}",
                )
        if why is not None:
            kind, row.reason = why
            row.status, row.pruned_by = "pruned", kind
            pruned[kind] += 1
            if c.layout != "searched" or kind != "symmetric":
                out.append(row)
            continue
        rows.append(row)
    # A step traced here is asked whether it pipelines at all (a plain scan of its layers
    # does not); a workload given alone is taken to (its step is not known).
    staged = (
        step_fn is None
        or abstract_state is None
        or not piped_layouts
        or microbatches > 1
        or (layer_count(workload) or 0) < 2
        or runs_stages(step_fn, abstract_state, example_batch, next(iter(piped_layouts.values())))
    )
    piped = pipeline_rows(
        workload,
        devices,
        prof,
        budget,
        microbatches=microbatches,
        layouts=piped_layouts,
        staged=staged,
    )
    rows += [r for r in piped.rows if r.status == "ok"]
    out += [r for r in piped.rows if r.status != "ok"]
    for kind, n in piped.pruned.items():
        pruned[kind] += n
    scored = sum(1 for r in [*rows, *out] if r.cost is not None)
    compile_top = compile_top if have_devices else 0
    rows, compiled, measured = _finish(
        rows,
        "predicted",
        step_fn,
        abstract_state,
        example_batch,
        compile_top,
        measure,
        measure_top,
        measure_steps,
        runs_here(prof),
    )
    counts = SearchCounts(
        enumerated=len(candidates) + piped.enumerated,
        pruned=pruned,
        scored=scored,
        compiled=compiled,
        measured=measured,
    )
    for row in rows:
        row.fits = True  # every ranked row fits: the others were pruned as "memory"
    return SearchResult(
        rows + out,
        devices,
        prof,
        budget,
        counts,
        time.perf_counter() - t0,
        None if batch is None else batch * microbatches,
        None if workload.tokens is None else workload.tokens * microbatches,
        tokens_unit=workload.tokens_unit,
        path_rules=path_rules,
        pipeline_absent=piped.absent,
    )


def _generated_only(roles: Sequence[str], max_axes: int, names: Sequence[str] | None) -> None:
    """Refuses ``roles``, ``max_axes`` and ``names`` other than their defaults where no step is
    traced: they shape generated candidates, and a step-less search has only the layouts."""
    given = [
        f"{k}={v!r}"
        for k, v, default in (
            ("roles", tuple(roles), ALL_ROLES),
            ("max_axes", max_axes, 3),
            ("names", names, None),
        )
        if v != default
    ]
    if given:
        raise error_for(
            ArgumentError,
            "generated-without-step",
            given[0].split("=")[0],
            f"search_rules without a step searches only the layouts: {', '.join(given)} "
            f"shape generated candidates and would be ignored",
            "Give the step (step_fn= and example_batch=, or model=) to search generated rules, "
            "or leave them out.",
        )


def _named(
    layouts: Mapping[str, LogicalRules] | Sequence[str] | None,
) -> Mapping[str, LogicalRules]:
    """The ``layouts`` by name: every built-in one when None; names (of built-in layouts or
    rules files) read with :func:`meshplan.layouts.get_layout`."""
    if layouts is None:
        return LAYOUTS
    if isinstance(layouts, Mapping):
        return layouts
    return {name: get_layout(name) for name in layouts}


def _check_measure(measure: bool, step_fn: object, devices: int) -> None:
    """``measure=True`` runs the step: it needs one, and the devices to run it on."""
    if not measure:
        return
    if step_fn is None:
        raise error_for(
            ArgumentError,
            "missing-argument",
            "step_fn",
            "search_rules(measure=True) runs the step, and none was given",
            "Pass step_fn= or model=.",
        )
    require_devices(devices, "measure=True (running the step)")


def _static_search(
    devices: int,
    abstract_state: Any,
    step_fn: Callable[[Any, Any], Any] | None,
    example_batch: Any,
    layouts: Mapping[str, LogicalRules] | Sequence[str] | None,
    axis_names: tuple[str, ...],
    batch: int | None,
    budget: int | None,
    compile_top: int,
    measure: bool,
    measure_top: int,
    measure_steps: int,
    t0: float,
) -> SearchResult:
    """:func:`search_rules` without a trace: the ``layouts`` over every shape of
    ``axis_names``, sized and checked (:func:`meshplan._search.search.static.static_rows`), then
    ranked, compiled and measured as every search is (:func:`_finish`)."""
    if abstract_state is None:
        raise error_for(
            ArgumentError,
            "missing-argument",
            "abstract_state",
            "search_rules(ranked_by='static') sizes a state, and none was given",
            "Pass abstract_state= (jax.eval_shape of init), or model= with example_batch=.",
        )
    _check_measure(measure, step_fn, devices)
    if batch is None and example_batch is not None:
        batch = int(jax.tree.leaves(example_batch)[0].shape[0])
    given = {n: as_given(r) for n, r in _named(layouts).items()}
    candidates = layout_candidates(devices, given, axis_names)
    rows, out, pruned = static_rows(abstract_state, candidates, batch, budget)
    compile_top = compile_top if jax.device_count() >= devices else 0
    rows, compiled, measured = _finish(
        rows,
        "static",
        step_fn,
        abstract_state,
        example_batch,
        compile_top,
        measure,
        measure_top,
        measure_steps,
        False,  # static rows carry no prediction to refine
    )
    counts = SearchCounts(
        enumerated=len(candidates),
        pruned=pruned,
        scored=len(rows),
        compiled=compiled,
        measured=measured,
    )
    return SearchResult(
        rows + out,
        devices,
        None,
        budget,
        counts,
        time.perf_counter() - t0,
        batch,
        ranked_by="static",
    )


def _finish(
    rows: list[SearchRow],
    ranked_by: RankedBy,
    step_fn: Callable[[Any, Any], Any] | None,
    abstract_state: Any,
    example_batch: Any,
    compile_top: int,
    measure: bool,
    measure_top: int,
    measure_steps: int,
    here: bool,
) -> tuple[list[SearchRow], int, int]:
    """The one ranking of every search: the ``ok`` rows ranked (:func:`_rank`), the first
    ``compile_top`` compiled and ranked again with what the compile showed, the first
    ``measure_top`` run and ranked by measured time, then numbered. Returns the rows and
    how many were compiled and measured. ``here``: the profile is this machine's backend, so
    what its compiler says (collective bytes, temporaries) replaces the prediction."""
    rows = _rank(rows, ranked_by)
    compiled = 0
    if compile_top and step_fn is not None:
        # A pipelined row's step is not this step (the stages are the model's to run):
        # priced, never compiled or run here.
        for row in rows[:compile_top]:
            if row.pipeline is not None:
                continue
            row.compiled = measure_step(step_fn, abstract_state, example_batch, row.mesh, row.rules)
            compiled += 1
            if here:
                _refine(row)
        rows[:compile_top] = _rank(rows[:compile_top], ranked_by)
    measured = 0
    if measure and step_fn is not None:
        from meshplan._search.measure.timing import prepare_step

        at = [i for i, r in enumerate(rows) if r.pipeline is None][:measure_top]
        top = [rows[i] for i in at]
        prepared = [
            prepare_step(step_fn, abstract_state, example_batch, r.mesh, r.rules) for r in top
        ]
        samples: list[list[float]] = [[] for _ in top]
        for _ in range(measure_steps):  # interleaved: noise hits every candidate alike
            for i, p in enumerate(prepared):
                # The first step after switching programs pays for the switch (caches,
                # the thread pool). Keep the second.
                samples[i] += p.run(2)[1:]
        for row, s in zip(top, samples, strict=True):
            row.measured_s = statistics.median(s)
        measured = len(top)
        for i, row in zip(at, sorted(top, key=lambda r: r.measured_s or 0), strict=True):
            rows[i] = row
    for i, row in enumerate(rows, 1):
        row.rank = i
    return rows, compiled, measured


def _refine(row: SearchRow) -> None:
    """Scale the predicted communication time by the compiled step's bytes over the predicted."""
    cost, comp = row.cost, row.compiled
    if cost is None or comp is None:
        return
    predicted = sum(cost.comm_bytes.values())
    exact = comp["collective_bytes"]
    if predicted and exact:
        scale = exact / predicted
        extra = cost.comm_s * (scale - 1)
        cost.comm_s += extra
        cost.step_s += extra
    temp = comp.get("xla_temp_bytes")
    if temp is not None:
        cost.activation_bytes = int(temp)
