"""The top of a plan picture: the mesh as a grid of devices with their memory, and a bar chart."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from meshplan._plan.render.colors import GROUP_COLORS, INK, MUTED
from meshplan._plan.totals import GROUPS
from meshplan._text import human_bytes

if TYPE_CHECKING:
    from meshplan._plan.plan_data import PlanData

__all__ = ["DETAILED_DEVICES", "draw_memory_bars", "draw_mesh", "grid_shape"]

DETAILED_DEVICES = 256
"""Up to this many devices each is drawn as its own cell and bar; above, as one image (a pod's
16,384 devices would otherwise be 16,384 patches: minutes of matplotlib)."""


def grid_shape(plan: PlanData) -> tuple[int, int, str, str]:
    """Mesh drawn as rows × columns: the first axis down, the others across."""
    names, sizes = plan.mesh.axis_names, plan.mesh.axis_sizes
    if len(sizes) == 0:
        return 1, 1, "", ""
    if len(sizes) == 1:
        return 1, sizes[0], "", names[0]
    return sizes[0], math.prod(sizes[1:]), names[0], " × ".join(names[1:])


def draw_mesh(ax: Any, plan: PlanData, colors: list[object]) -> None:
    """The devices as a grid, each with its id, its bytes and a bar of them by group."""
    rows, cols, row_name, col_name = grid_shape(plan)
    totals = plan.totals
    full = max(totals["all"].max_device_bytes, 1)
    ax.set_xlim(-0.15, cols + 0.05)
    ax.set_ylim(rows + 0.05, -0.35)
    ax.set_aspect("equal")
    ax.axis("off")
    if plan.mesh.size > DETAILED_DEVICES:
        _draw_mesh_image(ax, plan, rows, cols, full)
    else:
        _draw_mesh_cells(ax, plan, colors, cols, full)
    if col_name:
        ax.annotate(
            "",
            xy=(cols - 0.05, -0.12),
            xytext=(0.06, -0.12),
            arrowprops={"arrowstyle": "->", "color": MUTED, "lw": 1},
        )
        ax.text(cols / 2, -0.2, f"{col_name} ({cols})", ha="center", fontsize=9, color=MUTED)
    if row_name:
        ax.annotate(
            "",
            xy=(-0.06, rows - 0.05),
            xytext=(-0.06, 0.06),
            arrowprops={"arrowstyle": "->", "color": MUTED, "lw": 1},
        )
        ax.text(
            -0.1,
            rows / 2,
            f"{row_name} ({rows})",
            rotation=90,
            va="center",
            ha="right",
            fontsize=9,
            color=MUTED,
        )


def _draw_mesh_cells(ax: Any, plan: PlanData, colors: list[Any], cols: int, full: int) -> None:
    """Each device a rounded cell with its id, its bytes and a bar of them by group."""
    from matplotlib.patches import FancyBboxPatch, Rectangle

    totals = plan.totals
    for k, dev in enumerate(plan.mesh.device_ids):
        r, c = divmod(k, cols)
        x, y = c + 0.06, r + 0.06
        w, h = 0.88, 0.88
        ax.add_patch(
            FancyBboxPatch(
                (x, y),
                w,
                h,
                boxstyle="round,pad=0,rounding_size=0.06",
                facecolor=(*colors[k][:3], 0.13),
                edgecolor=colors[k],
                linewidth=2.2,
            )
        )
        nbytes = totals["all"].device_bytes[k]
        if cols <= 8:
            ax.text(x + 0.07, y + 0.2, f"device {dev}", fontsize=9, weight="bold", color=INK)
            ax.text(x + 0.07, y + 0.43, human_bytes(nbytes), fontsize=9, color=INK)
        else:  # small cells: the id only (the bar chart has the bytes)
            ax.text(
                x + w / 2,
                y + 0.35,
                str(dev),
                fontsize=max(5.0, 9 * 8 / cols),
                weight="bold",
                color=INK,
                ha="center",
                va="center",
            )
        # memory bar: stacked by group, full width = the fullest device
        bx, by, bw, bh = x + 0.07, y + 0.6, w - 0.14, 0.14
        ax.add_patch(Rectangle((bx, by), bw, bh, facecolor="white", edgecolor="#bbbbbb", lw=0.6))
        offset = 0.0
        for group in GROUPS:
            part = totals[group].device_bytes[k] / full * bw
            if part > 0:
                ax.add_patch(
                    Rectangle((bx + offset, by), part, bh, facecolor=GROUP_COLORS[group], lw=0)
                )
            offset += part
        ideal = totals["all"].ideal_bytes / full * bw
        ax.plot([bx + ideal, bx + ideal], [by - 0.03, by + bh + 0.03], color=INK, lw=1)


def _draw_mesh_image(ax: Any, plan: PlanData, rows: int, cols: int, full: int) -> None:
    """Many devices: one image, each pixel a device shaded by its bytes (darker: fuller)."""
    import numpy as np

    grid = np.asarray(plan.totals["all"].device_bytes, dtype=float).reshape(rows, cols) / full
    ax.imshow(
        grid,
        cmap="Blues",
        vmin=0.0,
        vmax=1.0,
        extent=(0, cols, rows, 0),
        interpolation="nearest",
        aspect="auto",
    )
    low, high = grid.min() * full, grid.max() * full
    ax.text(
        cols / 2,
        rows + 0.02 * rows,
        f"{plan.mesh.size} devices: {human_bytes(low)} to "
        f"{human_bytes(high)} each (darker: fuller)",
        ha="center",
        va="top",
        fontsize=9,
        color=MUTED,
    )


def draw_memory_bars(ax: Any, plan: PlanData, colors: list[object]) -> None:
    """Bytes per device, stacked by group, against the ideal (an even split)."""
    totals = plan.totals
    n = plan.mesh.size
    xs = range(n)
    bottom = [0.0] * n
    scale, unit = _unit(totals["all"].max_device_bytes)
    many = n > DETAILED_DEVICES  # one filled band per group, not n bars
    for group in GROUPS:
        values = [b / scale for b in totals[group].device_bytes]
        if any(values):
            if many:
                top = [a + b for a, b in zip(bottom, values, strict=True)]
                ax.fill_between(
                    xs, bottom, top, step="mid", color=GROUP_COLORS[group], lw=0, label=group
                )
            else:
                ax.bar(
                    xs, values, bottom=bottom, color=GROUP_COLORS[group], width=0.72, label=group
                )
            bottom = [a + b for a, b in zip(bottom, values, strict=True)]
    ideal = totals["all"].ideal_bytes / scale
    ax.axhline(ideal, color=INK, lw=1, ls="--")
    ax.text(n - 0.5, ideal, " ideal", va="bottom", ha="right", fontsize=8, color=INK)
    step = max(1, math.ceil(n / (16 if n <= 1024 else 6)))  # at most 16 labels (6 when long)
    shown = list(xs)[::step]
    ax.set_xticks(shown, [str(plan.mesh.device_ids[k]) for k in shown], fontsize=8)
    for tick, k in zip(ax.get_xticklabels(), shown, strict=True):
        tick.set_color(colors[k])
        tick.set_fontweight("bold")
    ax.set_xlabel("device", fontsize=9, color=MUTED)
    ax.set_ylabel(unit, fontsize=9, color=MUTED)
    ax.tick_params(axis="y", labelsize=8, colors=MUTED)
    ax.spines[["top", "right"]].set_visible(False)
    ax.set_ylim(0, max([*bottom, ideal]) * 1.18 or 1)
    if any(bottom):
        ax.legend(fontsize=8, frameon=False, loc="upper left", ncols=3)
    ax.set_title("memory per device", fontsize=10, loc="left", color=INK)


def _unit(n: int) -> tuple[float, str]:
    for scale, unit in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return float(scale), unit
    return 1.0, "bytes"
