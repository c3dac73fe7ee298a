"""The step-less figures of the one search: state bytes per device and a static estimate of
the bytes moved, for a candidate with no step to trace.

:func:`meshplan.search_rules` without a step (``ranked_by='static'``, what
:func:`meshplan.search_layouts` asks for) sizes each candidate here instead of pricing a
traced step: :func:`static_rows` checks it with :func:`meshplan.explain` (every error is a
rejection, with the path and the problem) and the ``batch`` with the one validator, then
fills the row's figures; the search ranks the rows (``SearchRow._static_key``).

The figures: ``bytes_per_device``, the state bytes on the fullest device (``explain``);
``idle_axes``, the mesh axes (size > 1) that split neither the batch nor a parameter (their
devices repeat the same work); ``comm``, bytes per step per device counted as operands (as
:func:`meshplan._search.measure.hlo.collective_bytes` does), from the plan's ``params``. With ``B``
the mesh axes (size > 1) of ``'batch'``: ``all-gather`` is the shard of each parameter
split over ``B`` (FSDP); ``gradient-reduce`` (if ``B``) is each parameter as a device
computes with it, its shard times its FSDP split; ``activations`` is 0 unless a parameter
is split over an axis outside ``B`` (tensor parallelism: its activation all-reduces depend
on the model's code, so ``None``, "n/a", ranked after a known estimate). Optimizer state
never moves.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from meshplan._plan.explain import explain
from meshplan._plan.plan import Plan
from meshplan._search.search.candidates import Candidate
from meshplan._search.search.result import CommEstimate, PruneKind, SearchRow
from meshplan._spmd.rules import (
    LogicalRules,
    RulePairs,
    check_rules,
    logical_to_mesh_axes,
    mesh_axes_of,
)
from meshplan._spmd.validate import validate
from meshplan._text import human_bytes

__all__ = ["as_given", "static_rows"]

STATIC_PRUNE_REASONS: tuple[PruneKind, ...] = ("invalid", "batch")
"""What rejects a candidate of the step-less ranking, counted in this order."""


def as_given(rules: LogicalRules) -> RulePairs:
    """The rules normalised; malformed ones as given, for :func:`meshplan.explain` to reject
    every candidate of the layout with the problem (``rules[i]: ...``).

    Example:
        >>> from meshplan._search.search.static import as_given
        >>> as_given([("batch", ["data"])]), as_given([("batch", "data", "model")])
        ((('batch', ('data',)),), (('batch', 'data', 'model'),))
    """
    valid, problems = check_rules(rules)
    return cast(RulePairs, tuple(rules)) if problems else valid.pairs


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
    comm: CommEstimate = {
        "all-gather": gather,
        "gradient-reduce": reduce,
        "activations": None if used - data_axes else 0,
    }
    return comm, tuple(a for a in sizes if sizes[a] > 1 and a not in used)


def _evaluate(
    row: SearchRow, state: Any, batch: int | None, budget: int | None
) -> PruneKind | None:
    """Fills ``row``'s static figures, or says why the checks reject it (its kind)."""
    plan = explain(state, row.mesh, row.rules)
    errors = [p for p in plan.problems if p.severity == "error"]
    if errors:
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        row.status, row.reason = "rejected", f"{errors[0].path}: {errors[0].message}{more}"
        return "invalid"
    axes = mesh_axes_of(logical_to_mesh_axes(("batch",), row.rules)[0])
    if batch is not None:  # the batch is one more array for the validator: (batch,) named 'batch'
        bad = [
            p
            for p in validate("batch", (batch,), ("batch",), row.mesh, row.rules)
            if p.severity == "error"
        ]
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


def static_rows(
    state: Any, candidates: list[Candidate], batch: int | None, budget: int | None
) -> tuple[list[SearchRow], list[SearchRow], dict[PruneKind, int]]:
    """The candidates' rows, sized (``ok``) or rejected with the reason, and the rejections
    counted by kind: ``(ok, rejected, pruned)``. Unranked: the search ranks them."""
    rows = [SearchRow(c.mesh, c.rules, c.layout) for c in candidates]
    pruned: dict[PruneKind, int] = dict.fromkeys(STATIC_PRUNE_REASONS, 0)
    for row in rows:
        kind = row.pruned_by = _evaluate(row, state, batch, budget)
        if kind is not None:
            pruned[kind] += 1
    return [r for r in rows if r.status == "ok"], [r for r in rows if r.status != "ok"], pruned
