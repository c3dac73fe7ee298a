"""Searching for a layout: every mesh shape and rule set, checked, sized and ranked.

The step-less ranking of the one search: :func:`search_layouts` takes given layouts
(no generated rules, nothing traced) and returns the :class:`SearchResult` of
:class:`SearchRow` that :func:`meshplan.search_rules` returns, ``ranked_by``
``'static'``; with a step, ``search_rules(..., layouts=..., max_axes=0)`` searches the
same layouts by predicted step time.

A candidate (mesh shape, layout) is *rejected* when :func:`meshplan.check` finds
an error or the batch does not divide by the devices ``'batch'`` is split over.
The others rank by: within the budget, then state bytes on the fullest device
(``explain``), then whether a mesh axis is *idle* (splits neither the batch nor
a parameter: its devices repeat the same work), then communication: a *static
estimate*, bytes per step per device counted as operands (as
:func:`meshplan._search.hlo.collective_bytes` does), from the plan's ``params``. With
``B`` the mesh axes (size > 1) of ``'batch'``: ``all-gather`` is the shard of
each parameter split over ``B`` (FSDP); ``gradient-reduce`` (if ``B``) is each
parameter as a device computes with it, its shard times its FSDP split;
``activations`` is 0 unless a parameter is split over an axis outside ``B``
(tensor parallelism: its activation all-reduces depend on the model's code, so
``None``, "n/a", ranked after a known estimate). Optimizer state never moves.
``measure=True`` compiles a step for the first ``top_k`` and records its HLO
collectives and XLA ``memory_analysis()``; among those, measured bytes rank.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import jax

from meshplan._errors import ArgumentError, error_for
from meshplan._plan.explain import explain
from meshplan._plan.plan import Plan
from meshplan._search.candidates import layout_candidates, mesh_shapes
from meshplan._search.hlo import measure_step
from meshplan._search.result import (
    CommEstimate,
    PruneKind,
    SearchCounts,
    SearchResult,
    SearchRow,
    require_devices,
)
from meshplan._spmd.rules import (
    LogicalRules,
    RulePairs,
    check_rules,
    logical_to_mesh_axes,
    mesh_axes_of,
)
from meshplan._spmd.validate import validate
from meshplan._text import human_bytes
from meshplan.layouts import get_layout

__all__ = ["SearchResult", "SearchRow", "mesh_shapes", "search_layouts"]

DEFAULT_LAYOUTS = ("data_parallel", "fsdp", "tensor_parallel", "fsdp_tp")
"""The canned layouts of :mod:`meshplan.layouts` that ``search_layouts`` tries by default."""


def _estimate(
    plan: Plan, batch_axes: tuple[str, ...], sizes: Mapping[str, int]
) -> tuple[CommEstimate, tuple[str, ...]]:
    """The static communication estimate (module docstring), and the idle mesh axes."""
    data_axes = {a for a in batch_axes if sizes[a] > 1}
    gather, reduce, used = 0, 0, set(data_axes)
    for leaf in (leaf for leaf in plan.leaves if leaf.group == "params"):
        axes = [a for e in leaf.spec for a in mesh_axes_of(e) if sizes.get(a, 1) > 1]
        fsdp = math.prod(sizes[a] for a in axes if a in data_axes)
        gather += leaf.bytes_per_device if fsdp > 1 else 0
        reduce += leaf.bytes_per_device * fsdp if data_axes else 0
        used.update(axes)
    comm: CommEstimate = {"all-gather": gather, "gradient-reduce": reduce, "activations": None if used - data_axes else 0}  # fmt: skip
    return comm, tuple(a for a in sizes if sizes[a] > 1 and a not in used)


def _evaluate(
    row: SearchRow, state: Any, batch: int | None, budget: int | None
) -> PruneKind | None:
    """Fills ``row``'s static estimate, or says why the checks reject it (its pruned kind)."""
    plan = explain(state, row.mesh, row.rules)
    errors = [p for p in plan.problems if p.severity == "error"]
    if errors:
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        row.status, row.reason = "rejected", f"{errors[0].path}: {errors[0].message}{more}"
        return "invalid"
    axes = mesh_axes_of(logical_to_mesh_axes(("batch",), row.rules)[0])
    if batch is not None:  # the batch is one more array for the validator: (batch,) named 'batch'
        bad = [p for p in validate("batch", (batch,), ("batch",), row.mesh, row.rules)
               if p.severity == "error"]  # fmt: skip
        if bad:
            row.status, row.reason = "rejected", f"{bad[0].path}: {bad[0].message}"
            return "batch"
    row.bytes_per_device = plan.totals["all"].max_device_bytes
    row.params_bytes_per_device = plan.totals["params"].max_device_bytes
    row.comm, row.idle_axes = _estimate(plan, axes, row.mesh)
    over = None if budget is None else row.bytes_per_device - budget
    row.fits = over is None or over <= 0
    notes = [f"idle {a!r}: its {row.mesh[a]} positions do the same work" for a in row.idle_axes]
    if over is not None and over > 0:
        notes.append(f"over the budget by {human_bytes(over)}")
    row.reason = "; ".join(notes)
    return None


def _as_given(rules: LogicalRules) -> RulePairs:
    """The rules normalised; malformed ones as given, for :func:`meshplan.explain` to reject
    every candidate of the layout with the problem (``rules[i]: ...``)."""
    valid, problems = check_rules(rules)
    return cast(RulePairs, tuple(rules)) if problems else valid.pairs


def search_layouts(
    abstract_state: Any,
    devices: int,
    layouts: Mapping[str, LogicalRules] | Sequence[str] | None = None,
    *,
    axis_names: tuple[str, ...] = ("data", "model"),
    batch: int | None = None,
    memory_budget_bytes: int | None = None,
    measure: bool = False,
    step_fn: Callable[[Any, Any], Any] | None = None,
    example_batch: Any = None,
    top_k: int = 3,
) -> SearchResult:
    """The step-less search: given layouts over every mesh shape, ranked by bytes.

    :func:`meshplan.search_rules` restricted to ``layouts`` and the shapes of
    ``axis_names``, for a state without a step: nothing is traced, so the ranking is
    static (within the budget, state bytes per device, idle axes, then the bytes
    moved, as the module docstring says). Rejects, with the reason, what
    :func:`meshplan.check` or the ``batch`` rejects. It returns the same
    :class:`SearchResult` of :class:`SearchRow` as ``search_rules``, ``ranked_by``
    ``'static'``. With a step, ``search_rules(devices, state, step, batch, layouts=...,
    max_axes=0)`` searches the same layouts by predicted step time.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = jax.ShapeDtypeStruct((1024, 6), jnp.float32)
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}}
        >>> result = meshplan.search_layouts(tree, 4, batch=8)
        >>> print(result.best)
        1x4 fsdp (6.00 KiB/device, comm est. 30.00 KiB/step)
        >>> print(result.row("1x4", "tensor_parallel").reason)
        params/w: dim 1 ('mlp') of size 6 does not divide by 4 (mesh axis 'model' of size 4)
        >>> result.row("2x2", "tensor_parallel").comm
        {'all-gather': 0, 'gradient-reduce': 12288, 'activations': None}
        >>> data = result.to_dict()
        >>> data["schema"], data["best"]["mesh_text"], len(data["rows"]), data["rows"][-1]["status"]
        ('meshplan.search/1', '1x4', 12, 'rejected')

    Args:
        abstract_state: What :func:`meshplan.explain` takes (``jax.eval_shape`` of init).
        devices: How many devices the mesh has.
        layouts: ``{name: rules}``, or names of built-in layouts (``meshplan.layouts``);
            ``None``: the four canned layouts (``DEFAULT_LAYOUTS``).
        axis_names: The mesh axis names the rules use.
        batch: Global batch size (default: ``example_batch``'s, else unchecked).
        memory_budget_bytes: State bytes one device may hold.
        measure: Compile ``step_fn`` for the first ``top_k`` (needs ``devices`` devices).
        step_fn: ``step_fn(state, batch)``; each batch array's first dim is ``'batch'``.
        example_batch: The batch: a ``ShapeDtypeStruct``, an array, or a tree.
        top_k: How many candidates to measure.

    Raises:
        ArgumentError: ``measure`` without ``step_fn`` or ``example_batch``.
        MeshError: ``measure`` with fewer JAX devices than ``devices`` (code
            ``'too-few-devices'``, as :func:`meshplan.search_rules` raises).
    """
    t0 = time.perf_counter()
    if layouts is None:
        layouts = DEFAULT_LAYOUTS
    if not isinstance(layouts, Mapping):  # names of built-in layouts (or rules files)
        layouts = {name: get_layout(name) for name in layouts}
    given = {n: _as_given(r) for n, r in layouts.items()}
    if batch is None and example_batch is not None:
        batch = int(jax.tree.leaves(example_batch)[0].shape[0])
    if top_k < 1:
        raise error_for(
            ArgumentError, "bad-top-k", "top_k",
            f"search_layouts requires a positive top_k, got {top_k=}", "Pass top_k=1 or more.",
        )  # fmt: skip
    if measure and (step_fn is None or example_batch is None):
        raise error_for(
            ArgumentError, "missing-argument", "step_fn",
            "measure=True compiles a step, and step_fn= or example_batch= is missing",
            "Pass step_fn= and example_batch=.",
        )  # fmt: skip
    if measure:
        require_devices(devices, "measuring")
    candidates = layout_candidates(devices, given, axis_names)
    rows = [SearchRow(c.mesh, c.rules, c.layout) for c in candidates]
    pruned: dict[PruneKind, int] = {"invalid": 0, "batch": 0}
    for row in rows:
        kind = _evaluate(row, abstract_state, batch, memory_budget_bytes)
        if kind is not None:
            pruned[kind] += 1
    ok = sorted((r for r in rows if r.status == "ok"), key=SearchRow._static_key)
    compiled = 0
    if measure:
        assert step_fn is not None  # measure without step_fn was refused above
        for row in ok[:top_k]:
            row.compiled = measure_step(step_fn, abstract_state, example_batch, row.mesh, row.rules)
            compiled += 1
        ok[:top_k] = sorted(ok[:top_k], key=SearchRow._static_key)
    for i, row in enumerate(ok, 1):
        row.rank = i
    counts = SearchCounts(enumerated=len(rows), pruned=pruned, scored=len(ok),
                          compiled=compiled, measured=0)  # fmt: skip
    return SearchResult(
        ok + [r for r in rows if r.status != "ok"], devices, None, memory_budget_bytes, counts,
        time.perf_counter() - t0, batch, ranked_by="static",
    )  # fmt: skip
