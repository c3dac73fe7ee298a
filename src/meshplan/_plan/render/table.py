"""Showing a plan in a terminal: a ``rich`` table of its leaves, its totals and its problems."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from meshplan._text import count_text, human_bytes, shape_text
from meshplan._types import Leaf

if TYPE_CHECKING:
    from rich.console import Console, ConsoleOptions, RenderResult

    from meshplan._errors import Problem
    from meshplan._plan.plan_data import PlanData
    from meshplan._plan.records import LeafPlan

__all__ = ["plan_renderable", "to_text"]

_GROUP_STYLE = {"params": "", "optimizer": "dim", "other": "dim italic"}
_MAX_PROBLEMS_SHOWN = 8


def _spec_text(spec: object) -> str:
    return str(spec)


def _names_text(leaf: LeafPlan) -> str:
    if leaf.kind != "logical" or leaf.names is None:
        return ""
    return ", ".join("None" if n is None else str(n) for n in leaf.names)


def _dim_notes(leaf: LeafPlan) -> list[tuple[str, str]]:
    """The notable things about a leaf's dimensions, shortest first: ``(text, style)``."""
    notes: list[tuple[str, str]] = []
    unmatched = [str(d.name) for d in leaf.dims if d.status == "no-rule" and not d.skipped]
    if unmatched:
        notes.append((f"no rule: {', '.join(unmatched)}", "yellow"))
    for d in leaf.dims:
        label = str(d.name) if isinstance(d.name, str) else f"dim {d.index}"
        skips = [
            f"rule {s.rule_index} skipped ({s.reason})"
            for s in d.skipped
            if s.reason != "dimension already assigned"
        ]
        if d.status == "no-rule" and skips:
            notes.append((f"{label}: {', '.join(skips)}: replicated", "yellow"))
        elif skips:
            notes.append((f"{label}: {', '.join(skips)}", "dim"))
        if d.missing_axes:
            notes.append((f"{label}: no mesh axis {', '.join(map(repr, d.missing_axes))}", "red"))
        elif d.duplicate_axes:
            used = ", ".join(map(repr, d.duplicate_axes))
            notes.append((f"{label}: {used} already used by another dim", "red"))
        elif d.shards == 1 and d.mesh_axes:
            notes.append((f"{label}: {'×'.join(d.mesh_axes)} has size 1", "dim"))
        if d.status == "unconstrained":
            notes.append((f"{label}: unconstrained", ""))
        if not d.divides:
            notes.append((f"{label}: {d.size} ∤ {d.shards}, pad to {d.padded_size}", "red"))
    return notes


def _why_text(leaf: LeafPlan) -> Leaf:
    """The notes cell, literal text (a name or reason with brackets is not rich markup)."""
    from rich.text import Text

    if leaf.kind == "unboxed":
        return Text("unboxed", style="dim")
    notes = _dim_notes(leaf)
    out = Text()
    for i, (note, style) in enumerate(notes):
        out.append(("; " if i else "") + note, style=style)
    return out


def _rows(plan: PlanData, full: bool, max_rows: int) -> tuple[list[LeafPlan], int]:
    leaves = plan.leaves
    if full or len(leaves) <= max_rows:
        return list(leaves), 0
    order = sorted(range(len(leaves)), key=lambda i: (-leaves[i].bytes_per_device, i))
    keep = sorted(order[:max_rows])
    return [leaves[i] for i in keep], len(leaves) - len(keep)


class PlanView:
    """A plan's table, totals and problems; lays itself out for the console's width.

    From 150 columns it shows shapes, dtypes and logical names; narrower, only
    the path, mesh spec, bytes per device, replication and notes.
    """

    def __init__(
        self, plan: PlanData, problems: Sequence[Problem], full: bool, max_rows: int
    ) -> None:
        self.plan, self.problems, self.full, self.max_rows = plan, problems, full, max_rows

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        wide = options.max_width >= 150
        yield from _parts(self.plan, self.problems, self.full, self.max_rows, wide=wide)


def plan_renderable(
    plan: PlanData, problems: Sequence[Problem], *, full: bool = False, max_rows: int = 24
) -> PlanView:
    """The table of a plan, its totals, and its ``problems``, as one ``rich`` renderable."""
    return PlanView(plan, problems, full, max_rows)


def _parts(
    plan: PlanData, problems: Sequence[Problem], full: bool, max_rows: int, wide: bool
) -> list[Any]:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rules = plan.rules
    rules_text = "none" if not rules else ", ".join(f"{n}→{a}" for n, a in rules)
    title = Text.assemble(
        ("Sharding plan", "bold"), Text(f" on {plan.mesh.describe()} · rules: {rules_text}")
    )

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, expand=False, show_edge=False)
    rows, hidden = _rows(plan, full, max_rows)
    widest = max((len(leaf.path) for leaf in rows), default=4)
    table.add_column("path", overflow="fold", min_width=min(widest, 36 if wide else 24))
    if wide:
        table.add_column("shape dtype", no_wrap=True)
        table.add_column("logical names", overflow="fold")
    table.add_column("mesh spec", overflow="fold")
    table.add_column("per device", justify="right", no_wrap=True)
    table.add_column("held by", justify="right", no_wrap=True)
    table.add_column("notes", overflow="fold", min_width=12)
    for leaf in rows:
        everyone = leaf.replication == plan.mesh.size and plan.mesh.size > 1
        cells: list[Any] = [Text(leaf.path)]  # user text: printed literally, never as markup
        if wide:
            cells += [Text(f"{shape_text(leaf.shape)} {leaf.dtype}"), Text(_names_text(leaf))]
            per_device = f"{shape_text(leaf.shard_shape)} {human_bytes(leaf.bytes_per_device)}"
        else:
            per_device = human_bytes(leaf.bytes_per_device)
        cells += [
            Text(_spec_text(leaf.spec)),
            per_device,
            "all" if everyone else str(leaf.replication),
            _why_text(leaf),
        ]
        table.add_row(*cells, style=_GROUP_STYLE.get(leaf.group, ""))
    if not rows:
        table.caption = "(no array leaves)"
        table.caption_justify = "left"
    if hidden:
        rest = sum(leaf.bytes for leaf in plan.leaves) - sum(leaf.bytes for leaf in rows)
        table.caption = (
            f"… and {hidden} smaller leaves ({human_bytes(rest)} in all); "
            f"plan.table(full=True) lists every leaf"
        )
    totals = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("", "leaves", "in all", "fullest device", "ideal", "spread"):
        totals.add_column(name, justify="right" if name else "left", no_wrap=True)
    for group, t in plan.totals.items():
        if group != "all" and t.leaves == 0:
            continue
        totals.add_row(
            f"[bold]{group}[/]" if group == "all" else group,
            str(t.leaves),
            human_bytes(t.bytes),
            human_bytes(t.max_device_bytes),
            human_bytes(t.ideal_bytes),
            f"{t.efficiency:.0%}",
        )

    parts: list[object] = [title, table, totals]
    if plan.stages:
        parts.append(_stages(plan))
    if problems and problems[0].code == "no-names":  # said first: the table shows nothing named
        first = problems[0]
        parts.insert(1, Text.from_markup("[yellow]![/] ") + Text(f"{first.message}. {first.fix}"))
    if problems:
        n_err = sum(p.severity == "error" for p in problems)
        n_warn = sum(p.severity == "warning" for p in problems)
        n_info = len(problems) - n_err - n_warn
        notes = f", {count_text(n_info, 'note')}" if n_info else ""
        parts.append(
            Text.from_markup(
                f"[bold]{count_text(n_err, 'error')}, {count_text(n_warn, 'warning')}{notes}[/] "
                f"(meshplan.check lists them all):"
            )
        )
        marks = {"error": "[red]✗[/]", "warning": "[yellow]![/]"}
        for p in problems[:_MAX_PROBLEMS_SHOWN]:
            mark = marks.get(p.severity, "[blue]i[/]")
            parts.append(Text.from_markup(f"  {mark} ") + Text(f"{p.path}: {p.message}"))
        if len(problems) > _MAX_PROBLEMS_SHOWN:
            parts.append(Text(f"  … {len(problems) - _MAX_PROBLEMS_SHOWN} more"))
    return parts


def to_text(renderable: object, width: int = 180) -> str:
    """Renders ``renderable`` to plain text (no colour codes).

    Example:
        >>> from meshplan._plan.render.table import to_text
        >>> print(to_text("[bold]hi[/]"), end="")
        hi
    """
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(renderable)
    return out.getvalue().rstrip() + "\n"


def _stages(plan: PlanData) -> object:
    """One row per pipeline stage: its parameters and its fullest device's bytes."""
    from rich import box
    from rich.table import Table

    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("stage", "parameters", "params, fullest device", "all, fullest device"):
        table.add_column(name, justify="right", no_wrap=True)
    for s in plan.stages:
        table.add_row(
            str(s.stage),
            f"{s.parameters:,}",
            human_bytes(s.param_bytes),
            human_bytes(s.device_bytes),
        )
    return table
