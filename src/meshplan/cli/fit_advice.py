"""When nothing fits: the closest candidate, and the changes that would make it fit, re-priced.

Each change is checked, not guessed: the closest candidate's rules are searched again
(:func:`meshplan.search_rules` restricted to them, over every mesh shape of their axes)
under the change: another ``--remat`` policy (``--model llama``), a smaller ``--batch``
(the built-in models), more ``--devices`` (the same global batch).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from meshplan._text import human_bytes, human_seconds

__all__ = ["closest", "fit_changes", "row_text"]


def closest(result: Any, workload: Any = None) -> Any:
    """The priced candidate with the least memory per device; where the state alone was over
    the budget everywhere, the one with the least state, priced here (with ``workload``);
    ``None`` when no candidate was valid."""
    priced = [r for r in result.rows if r.cost is not None]
    if priced or workload is None:
        return min(priced, key=lambda r: r.cost.memory_bytes, default=None)
    sized = [r for r in result.rows if r.pruned_by == "memory" and r.bytes_per_device]
    row = min(sized, key=lambda r: r.bytes_per_device, default=None)
    if row is not None:
        import meshplan

        row.cost = meshplan.predict(
            workload=workload, mesh=row.mesh, rules=row.rules, profile=result.profile
        ).cost
    return row


def row_text(row: Any) -> str:
    name = row.layout if row.layout not in ("searched", "closest") else row.short_rules
    return (
        f"{row.mesh_text} {row.axes_text} {name} at {human_bytes(row.cost.memory_bytes)}/device "
        f"(predicted {human_seconds(row.cost.step_s)}/step)"
    )


def _priced(
    row: Any, result: Any, devices: int, step: tuple[Any, Any, Any] | None, workload: Any
) -> tuple[bool, str, dict[str, Any]]:
    """``row``'s rules searched again on ``devices`` for ``step`` (or ``workload``): whether the
    best fits, the line that says so, and the data."""
    import meshplan

    if step is not None:
        state, step_fn, batch = step
        workload = meshplan.trace_workload(step_fn, state, batch, read_constraints=True)
    found = meshplan.search_rules(
        devices,
        workload=workload,
        layouts={row.layout if row.layout != "searched" else "closest": row.rules},
        axis_names=tuple(row.mesh),
        max_axes=0,
        profile=result.profile,
        memory_budget_bytes=result.budget_bytes,
        compile_top=0,
    )
    best = found.best
    if best is not None:
        return True, f"fits: {row_text(best)}", {"fits": True, "row": best.to_dict(found)}
    near = closest(found, workload)
    if near is None:
        why = next((r.reason for r in found.rows if r.reason), "no candidate")
        return False, f"no valid mesh ({why})", {"fits": False, "row": None}
    return False, f"still over: {row_text(near)}", {"fits": False, "row": near.to_dict(found)}


def fit_changes(
    args: argparse.Namespace,
    result: Any,
    row: Any,
    workload: Any,
    step_of: Callable[..., tuple[Any, Any, Any]] | None,
) -> list[tuple[str, bool, str, dict[str, Any]]]:
    """``(flag, fits, line, data)`` per change tried on ``row`` (the closest candidate):
    ``step_of(batch=..., remat=...)`` re-traces the built-in model (``None`` for a factory,
    whose step is its own: only more devices are tried)."""
    out: list[tuple[str, bool, str, dict[str, Any]]] = []

    def tried(flag: str, step: tuple[Any, Any, Any] | None, devices: int) -> bool:
        fits, line, data = _priced(row, result, devices, step, workload)
        out.append((flag, fits, line, data))
        return fits

    if step_of is not None and getattr(args, "remat", None) not in (None, "full", "full_block"):
        for policy in ("minimal", "full"):  # the cheaper recomputation first
            if policy != args.remat and tried(
                f"--remat {policy}", step_of(remat=policy), result.devices
            ):
                break
    if step_of is not None and result.batch:
        b = result.batch // 2
        for _ in range(3):
            if b < 1 or tried(f"--batch {b}", step_of(batch=b), result.devices):
                break
            b //= 2
    for k in (2, 4):  # the same global batch; then the same batch per device
        n = result.devices * k
        if tried(f"--devices {n}", None, n):
            break
        if out[-1][3]["row"] is None and step_of is not None and result.batch:
            b = result.batch * k
            if tried(f"--devices {n} --batch {b}", step_of(batch=b), n):
                break
    return out
