"""Showing a plan: a ``rich`` table for terminals, a PNG for people (matplotlib, headless)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from meshplan._plan import GROUPS, LeafPlan, Plan, _human, shard_holders

__all__ = ["plan_renderable", "save_png", "to_text"]

_GROUP_STYLE = {"params": "", "optimizer": "dim", "other": "dim italic"}
_MAX_PROBLEMS_SHOWN = 8


# --------------------------------------------------------------------------
# Text
# --------------------------------------------------------------------------


def _spec_text(spec: Any) -> str:
    return str(spec)


def _shape_text(shape: tuple[int, ...] | None) -> str:
    return "-" if shape is None else "(" + ", ".join(str(s) for s in shape) + ")"


def _names_text(leaf: LeafPlan) -> str:
    if leaf.kind != "logical" or leaf.names is None:
        return ""
    return ", ".join("None" if n is None else str(n) for n in leaf.names)


def _dim_notes(leaf: LeafPlan) -> list[str]:
    """The notable things about a leaf's dimensions, shortest first."""
    notes = []
    unmatched = [str(d.name) for d in leaf.dims if d.status == "no-rule" and not d.skipped]
    if unmatched:
        notes.append(f"[yellow]no rule: {', '.join(unmatched)}[/]")
    for d in leaf.dims:
        label = str(d.name) if isinstance(d.name, str) else f"dim {d.index}"
        skips = [
            f"rule {s.rule_index} skipped ({s.reason})"
            for s in d.skipped
            if s.reason != "dimension already assigned"
        ]
        if d.status == "no-rule" and skips:
            notes.append(f"[yellow]{label}: {', '.join(skips)}: replicated[/]")
        elif skips:
            notes.append(f"[dim]{label}: {', '.join(skips)}[/]")
        if d.missing_axes:
            notes.append(f"[red]{label}: no mesh axis {', '.join(map(repr, d.missing_axes))}[/]")
        elif d.duplicate_axes:
            used = ", ".join(map(repr, d.duplicate_axes))
            notes.append(f"[red]{label}: {used} already used by another dim[/]")
        elif d.shards == 1 and d.mesh_axes:
            notes.append(f"[dim]{label}: {'×'.join(d.mesh_axes)} has size 1[/]")
        if d.status == "unconstrained":
            notes.append(f"{label}: unconstrained")
        if not d.divides:
            notes.append(f"[red]{label}: {d.size} ∤ {d.shards}, pad to {d.padded_size}[/]")
    return notes


def _why_text(leaf: LeafPlan) -> str:
    if leaf.kind == "unboxed":
        return "[dim]unboxed[/]"
    return "; ".join(_dim_notes(leaf))


def _rows(plan: Plan, full: bool, max_rows: int) -> tuple[list[LeafPlan], int]:
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

    def __init__(self, plan: Plan, full: bool, max_rows: int) -> None:
        self.plan, self.full, self.max_rows = plan, full, max_rows

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield from _parts(self.plan, self.full, self.max_rows, wide=options.max_width >= 150)


def plan_renderable(plan: Plan, *, full: bool = False, max_rows: int = 24) -> Any:
    """The table of a plan, its totals, and its problems, as one ``rich`` renderable."""
    return PlanView(plan, full, max_rows)


def _parts(plan: Plan, full: bool, max_rows: int, wide: bool) -> list[Any]:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    rules = plan.rules
    rules_text = "none" if not rules else ", ".join(f"{n}→{a}" for n, a in rules)
    title = Text.assemble(
        ("Sharding plan", "bold"), f" on {plan.mesh.describe()} · rules: {rules_text}"
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
        cells = [leaf.path]
        if wide:
            cells += [f"{_shape_text(leaf.shape)} {leaf.dtype}", _names_text(leaf)]
            per_device = f"{_shape_text(leaf.shard_shape)} {_human(leaf.bytes_per_device)}"
        else:
            per_device = _human(leaf.bytes_per_device)
        cells += [
            _spec_text(leaf.spec),
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
            f"… and {hidden} smaller leaves ({_human(rest)} in all); "
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
            _human(t.bytes),
            _human(t.max_device_bytes),
            _human(t.ideal_bytes),
            f"{t.efficiency:.0%}",
        )

    parts: list[Any] = [title, table, totals]
    problems = plan.problems
    if problems:
        n_err = sum(p.severity == "error" for p in problems)
        n_warn = len(problems) - n_err
        parts.append(
            Text.from_markup(
                f"[bold]{n_err} error{'s' if n_err != 1 else ''}, {n_warn} "
                f"warning{'s' if n_warn != 1 else ''}[/] (meshplan.check lists them all):"
            )
        )
        for p in problems[:_MAX_PROBLEMS_SHOWN]:
            mark = "[red]✗[/]" if p.severity == "error" else "[yellow]![/]"
            parts.append(Text.from_markup(f"  {mark} ") + Text(f"{p.path}: {p.message}"))
        if len(problems) > _MAX_PROBLEMS_SHOWN:
            parts.append(Text(f"  … {len(problems) - _MAX_PROBLEMS_SHOWN} more"))
    return parts


def to_text(renderable: Any, width: int = 180) -> str:
    """Renders ``renderable`` to plain text (no colour codes).

    Example:
        >>> from meshplan._render import to_text
        >>> print(to_text("[bold]hi[/]"), end="")
        hi
    """
    from rich.console import Console

    out = io.StringIO()
    Console(file=out, width=width, color_system=None, force_terminal=False).print(renderable)
    return out.getvalue().rstrip() + "\n"


# --------------------------------------------------------------------------
# Picture
# --------------------------------------------------------------------------

_GROUP_COLORS = {"params": "#4C72B0", "optimizer": "#DD8452", "other": "#8C8C8C"}
_INK = "#222222"
_MUTED = "#6b6b6b"
_ERROR = "#c0392b"


def _device_colors(n: int) -> list[Any]:
    from matplotlib import colormaps

    if n <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(n)]
    cmap = colormaps["turbo"]
    return [cmap(0.05 + 0.9 * i / (n - 1)) for i in range(n)]


def _grid_shape(plan: Plan) -> tuple[int, int, str, str]:
    """Mesh drawn as rows × columns: the first axis down, the others across."""
    names, sizes = plan.mesh.axis_names, plan.mesh.axis_sizes
    if len(sizes) == 0:
        return 1, 1, "", ""
    if len(sizes) == 1:
        return 1, sizes[0], "", names[0]
    return sizes[0], math.prod(sizes[1:]), names[0], " × ".join(names[1:])


def _largest(plan: Plan, top: int) -> list[tuple[LeafPlan, int]]:
    """The ``top`` largest distinct layouts of the params (else of everything)."""
    pool = [leaf for leaf in plan.leaves if leaf.group == "params" and leaf.shape] or [
        leaf for leaf in plan.leaves if leaf.shape
    ]
    seen: dict[tuple[Any, ...], list[Any]] = {}
    for leaf in pool:
        key = (leaf.shape, leaf.dtype, leaf.spec)
        if key in seen:
            seen[key][1] += 1
        else:
            seen[key] = [leaf, 1]
    ranked = sorted(seen.values(), key=lambda e: -e[0].bytes)
    return [(leaf, count) for leaf, count in ranked[:top]]


def _short_path(path: str, limit: int = 46) -> str:
    if len(path) <= limit:
        return path
    parts = path.split("/")
    out = parts[-1]
    for p in reversed(parts[:-1]):
        if len(out) + len(p) + 2 > limit:
            return "…/" + out
        out = f"{p}/{out}"
    return out


def _draw_mesh(ax: Any, plan: Plan, colors: list[Any]) -> None:
    from matplotlib.patches import FancyBboxPatch, Rectangle

    rows, cols, row_name, col_name = _grid_shape(plan)
    totals = plan.totals
    full = max(totals["all"].max_device_bytes, 1)
    ax.set_xlim(-0.15, cols + 0.05)
    ax.set_ylim(rows + 0.05, -0.35)
    ax.set_aspect("equal")
    ax.axis("off")
    for k, dev in enumerate(plan.mesh.device_ids):
        r, c = divmod(k, cols)
        x, y = c + 0.06, r + 0.06
        w, h = 0.88, 0.88
        ax.add_patch(
            FancyBboxPatch(
                (x, y), w, h, boxstyle="round,pad=0,rounding_size=0.06",
                facecolor=(*colors[k][:3], 0.13), edgecolor=colors[k], linewidth=2.2,
            )
        )  # fmt: skip
        nbytes = totals["all"].device_bytes[k]
        if cols <= 8:
            ax.text(x + 0.07, y + 0.2, f"device {dev}", fontsize=9, weight="bold", color=_INK)
            ax.text(x + 0.07, y + 0.43, _human(nbytes), fontsize=9, color=_INK)
        else:  # small cells: the id only (the bar chart has the bytes)
            ax.text(x + w / 2, y + 0.35, str(dev), fontsize=max(5.0, 9 * 8 / cols),
                    weight="bold", color=_INK, ha="center", va="center")  # fmt: skip
        # memory bar: stacked by group, full width = the fullest device
        bx, by, bw, bh = x + 0.07, y + 0.6, w - 0.14, 0.14
        ax.add_patch(Rectangle((bx, by), bw, bh, facecolor="white", edgecolor="#bbbbbb", lw=0.6))
        offset = 0.0
        for group in GROUPS:
            part = totals[group].device_bytes[k] / full * bw
            if part > 0:
                ax.add_patch(
                    Rectangle((bx + offset, by), part, bh, facecolor=_GROUP_COLORS[group], lw=0)
                )
            offset += part
        ideal = totals["all"].ideal_bytes / full * bw
        ax.plot([bx + ideal, bx + ideal], [by - 0.03, by + bh + 0.03], color=_INK, lw=1)
    if col_name:
        ax.annotate(
            "", xy=(cols - 0.05, -0.12), xytext=(0.06, -0.12),
            arrowprops={"arrowstyle": "->", "color": _MUTED, "lw": 1},
        )  # fmt: skip
        ax.text(cols / 2, -0.2, f"{col_name} ({cols})", ha="center", fontsize=9, color=_MUTED)
    if row_name:
        ax.annotate(
            "", xy=(-0.06, rows - 0.05), xytext=(-0.06, 0.06),
            arrowprops={"arrowstyle": "->", "color": _MUTED, "lw": 1},
        )  # fmt: skip
        ax.text(-0.1, rows / 2, f"{row_name} ({rows})", rotation=90, va="center", ha="right",
                fontsize=9, color=_MUTED)  # fmt: skip


def _draw_bars(ax: Any, plan: Plan, colors: list[Any]) -> None:
    totals = plan.totals
    n = plan.mesh.size
    xs = range(n)
    bottom = [0.0] * n
    scale, unit = _unit(totals["all"].max_device_bytes)
    for group in GROUPS:
        values = [b / scale for b in totals[group].device_bytes]
        if any(values):
            ax.bar(xs, values, bottom=bottom, color=_GROUP_COLORS[group], width=0.72, label=group)
            bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ideal = totals["all"].ideal_bytes / scale
    ax.axhline(ideal, color=_INK, lw=1, ls="--")
    ax.text(n - 0.5, ideal, " ideal", va="bottom", ha="right", fontsize=8, color=_INK)
    step = max(1, math.ceil(n / 16))  # at most 16 labels
    shown = list(xs)[::step]
    ax.set_xticks(shown, [str(plan.mesh.device_ids[k]) for k in shown], fontsize=8)
    for tick, k in zip(ax.get_xticklabels(), shown, strict=True):
        tick.set_color(colors[k])
        tick.set_fontweight("bold")
    ax.set_xlabel("device", fontsize=9, color=_MUTED)
    ax.set_ylabel(unit, fontsize=9, color=_MUTED)
    ax.tick_params(axis="y", labelsize=8, colors=_MUTED)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_ylim(0, max([*bottom, ideal]) * 1.18 or 1)
    if any(bottom):
        ax.legend(fontsize=8, frameon=False, loc="upper left", ncols=3)
    ax.set_title("memory per device", fontsize=10, loc="left", color=_INK)


def _unit(n: int) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return float(scale), unit
    return 1.0, "bytes"


def _view_dims(leaf: LeafPlan) -> tuple[list[int], list[int]]:
    """Which dims are drawn as rows/columns (the split ones first, then the largest);
    the others are shown at their piece 0."""
    nd = len(leaf.dims)
    if nd == 0:
        return [], []
    if nd == 1:
        return [], [0]
    split = [d.index for d in leaf.dims if d.shards > 1]
    rest = sorted(
        (d.index for d in leaf.dims if d.shards == 1), key=lambda i: -(leaf.dims[i].size or 0)
    )
    row, col = sorted((split + rest)[:2])
    return [row], [col]


_STRIPE = 0.045


def _fill_tile(ax: Any, x: float, y: float, w: float, h: float, colors: list[Any]) -> None:
    """A solid tile for one holder; diagonal stripes of each holder's colour for several."""
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Rectangle

    base = Rectangle((x, y), w, h, facecolor=colors[0] if colors else "#dddddd", lw=0)
    ax.add_patch(base)
    if len(colors) < 2:
        return
    polys, fills = [], []
    k = 0
    start = x - h - _STRIPE
    while start < x + w:
        polys.append(
            [(start, y + h), (start + _STRIPE, y + h), (start + _STRIPE + h, y), (start + h, y)]
        )
        fills.append(colors[k % len(colors)])
        start += _STRIPE
        k += 1
    stripes = PolyCollection(polys, facecolors=fills, linewidths=0, antialiased=True)
    ax.add_collection(stripes)
    stripes.set_clip_path(base)


def _draw_tiles(ax: Any, leaf: LeafPlan, count: int, plan: Plan, colors: list[Any]) -> None:
    from matplotlib.patches import Rectangle

    holders = shard_holders(leaf, plan.mesh)
    color_of = dict(zip(plan.mesh.device_ids, colors, strict=True))
    row_dims, col_dims = _view_dims(leaf)
    dims = leaf.dims
    n_rows = dims[row_dims[0]].shards if row_dims else 1
    n_cols = dims[col_dims[0]].shards if col_dims else 1
    size_r = dims[row_dims[0]].size if row_dims else 1
    size_c = dims[col_dims[0]].size if col_dims else 1
    assert size_r is not None and size_c is not None
    # the drawn rectangle keeps the array's aspect, within 1:3..3:1
    ratio = min(max(size_r / max(size_c, 1), 1 / 3), 3)
    width, height = (1.0, ratio) if ratio <= 1 else (1 / ratio, 1.0)
    x0, y0 = (1 - width) / 2, (1 - height) / 2
    tw, th = width / n_cols, height / n_rows
    label_pieces = n_rows * n_cols <= 16
    for i in range(n_rows):
        for j in range(n_cols):
            key = [0] * len(dims)
            if row_dims:
                key[row_dims[0]] = i
            if col_dims:
                key[col_dims[0]] = j
            devs = holders.get(tuple(key), [])
            x, y = x0 + j * tw, y0 + i * th
            _fill_tile(ax, x, y, tw, th, [color_of[d] for d in devs])
            ax.add_patch(Rectangle((x, y), tw, th, fill=False, edgecolor="white", lw=2))
            if label_pieces:
                text = ",".join(map(str, devs)) if len(devs) < plan.mesh.size else "all"
                if len(devs) == plan.mesh.size and plan.mesh.size > 1:
                    text = "all"
                ax.text(
                    x + tw / 2, y + th / 2, text, ha="center", va="center", fontsize=8,
                    color=_INK, weight="bold",
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
                )  # fmt: skip
    ax.add_patch(Rectangle((x0, y0), width, height, fill=False, edgecolor=_INK, lw=1))
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(1.02, -0.02)
    ax.set_aspect("equal")
    ax.axis("off")

    def dim_label(k: int) -> str:
        d = dims[k]
        name = f"{d.name} " if isinstance(d.name, str) and leaf.kind == "logical" else ""
        split = f" / {'×'.join(d.mesh_axes)}" if d.mesh_axes and d.shards > 1 else ""
        uneven = f" (uneven: {d.size} ∤ {d.shards})" if not d.divides else ""
        return f"{name}{d.size}{split}{uneven}"

    def dim_color(k: int) -> str:
        return _ERROR if not dims[k].divides else _MUTED

    if col_dims:
        ax.text(0.5, y0 + height + 0.03, dim_label(col_dims[0]), ha="center", va="top",
                fontsize=8, color=dim_color(col_dims[0]))  # fmt: skip
    if row_dims:
        ax.text(x0 - 0.03, 0.5, dim_label(row_dims[0]), ha="right", va="center", rotation=90,
                fontsize=8, color=dim_color(row_dims[0]))  # fmt: skip
    alike = f"  (+{count - 1} alike)" if count > 1 else ""
    lead = [k for k in range(len(dims)) if k not in row_dims + col_dims and dims[k].shards > 1]
    sliced = ""
    if lead:
        sliced = "\nshowing piece 0 of " + ", ".join(
            f"{dims[k].name if isinstance(dims[k].name, str) else 'dim ' + str(k)}"
            f"={dims[k].size} / {'×'.join(dims[k].mesh_axes)}"
            for k in lead
        )
    copies = "1 device" if leaf.replication == 1 else f"{leaf.replication} devices"
    ax.set_title(
        f"{_short_path(leaf.path)}{alike}\n{_shape_text(leaf.shape)} {leaf.dtype}\n{leaf.spec}"
        f"\n{_human(leaf.bytes_per_device)} per device · each piece on {copies}{sliced}",
        fontsize=8, color=_INK, loc="center",
    )  # fmt: skip


def save_png(plan: Plan, path: Any, *, top: int = 6, title: str | None = None) -> None:
    """Draws ``plan`` into a PNG at ``path`` (see :meth:`Plan.save_png`)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = _device_colors(plan.mesh.size)
    rows, cols, _, _ = _grid_shape(plan)
    largest = _largest(plan, top)
    n_tiles = len(largest)
    tile_cols = min(max(n_tiles, 1), 4)
    tile_rows = math.ceil(n_tiles / tile_cols) if n_tiles else 0

    fig_w = max(11.0, 2.9 * tile_cols)
    mesh_h = max(2.6, min(1.15 * rows + 0.9, 6.0))
    head = 1.25
    fig_h = head + mesh_h + 3.2 * tile_rows
    fig = Figure(figsize=(fig_w, fig_h), dpi=110, facecolor="white")
    FigureCanvasAgg(fig)
    heights = [mesh_h] + [3.2] * tile_rows
    gs = fig.add_gridspec(
        1 + tile_rows, 1, height_ratios=heights, top=1 - head / fig_h, bottom=0.03,
        left=0.05, right=0.97, hspace=0.45,
    )  # fmt: skip
    top_gs = gs[0].subgridspec(1, 2, width_ratios=[min(max(cols, 2), 8) * 1.0, 4.0], wspace=0.18)
    _draw_mesh(fig.add_subplot(top_gs[0]), plan, colors)
    _draw_bars(fig.add_subplot(top_gs[1]), plan, colors)
    if n_tiles:
        for r in range(tile_rows):
            row_gs = gs[1 + r].subgridspec(1, tile_cols, wspace=0.25)
            for c in range(tile_cols):
                k = r * tile_cols + c
                if k < n_tiles:
                    leaf, count = largest[k]
                    _draw_tiles(fig.add_subplot(row_gs[c]), leaf, count, plan, colors)

    t = plan.totals["all"]
    heading = title or "Sharding plan"
    fig.text(0.05, 1 - 0.32 / fig_h, f"{heading} · mesh {plan.mesh.describe()}",
             fontsize=14, weight="bold", color=_INK)  # fmt: skip
    n_err = sum(p.severity == "error" for p in plan.problems)
    status = f" · {n_err} error{'s' if n_err != 1 else ''}" if n_err else ""
    fig.text(
        0.05, 1 - 0.6 / fig_h,
        f"{t.leaves} arrays, {_human(t.bytes)} in all · fullest device {_human(t.max_device_bytes)}"
        f" · ideal {_human(t.ideal_bytes)} ({t.efficiency:.0%} spread){status}",
        fontsize=10, color=_INK,
    )  # fmt: skip
    if n_tiles:
        fig.text(
            0.05, 1 - 0.82 / fig_h,
            "Below: the largest parameters, cut into the pieces the devices hold; each piece "
            "is coloured by its device (striped when several devices hold the same piece).",
            fontsize=8.5, color=_MUTED, style="italic",
        )  # fmt: skip
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", facecolor="white")
