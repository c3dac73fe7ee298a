"""A plan as a PNG (matplotlib, headless): mesh and memory on top, the largest tiles below."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan._plan.render.colors import INK, MUTED, device_colors
from meshplan._plan.render.png_mesh import draw_memory_bars, draw_mesh, grid_shape
from meshplan._plan.render.png_tiles import draw_tiles, largest_layouts
from meshplan._text import count_text, human_bytes

if TYPE_CHECKING:
    from meshplan._errors import Problem
    from meshplan._plan.plan_data import PlanData

__all__ = ["write_png"]


_BOLD_WIDTH = 0.62
"""Width of an average bold character, in font sizes (DejaVu Sans, matplotlib's default)."""


def _fit_size(text: str, width_in: float, size: float, smallest: float = 8.0) -> float:
    """The font size, at most ``size`` and at least ``smallest``, at which ``text`` fits."""
    return max(smallest, min(size, width_in * 72 / max(1, len(text)) / _BOLD_WIDTH))


def _fitted(text: str, width_in: float, size: float) -> str:
    """``text``, cut in its middle with ``…`` only where even the smallest size is too wide.

    Example:
        >>> from meshplan._plan.render.png import _fitted
        >>> _fitted("short", 10.0, 14.0)
        'short'
        >>> long = _fitted("a" * 400 + " · mesh data=2 × model=4", 6.0, 14.0)
        >>> len(long) < 400, long.endswith("model=4"), "…" in long
        (True, True, True)
    """
    fits = int(width_in * 72 / (_fit_size(text, width_in, size) * _BOLD_WIDTH))
    if len(text) <= fits:
        return text
    keep = max(fits - 1, 8)
    return text[: keep // 2] + "…" + text[len(text) - (keep - keep // 2) :]


def write_png(
    plan: PlanData,
    problems: Sequence[Problem],
    path: str | os.PathLike[str],
    *,
    top: int = 6,
    title: str | None = None,
) -> None:
    """Draws ``plan`` into a PNG at ``path``, counting the errors in ``problems``.

    See :meth:`meshplan.Plan.save_png`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    colors = device_colors(plan.mesh.size)
    rows, cols, _, _ = grid_shape(plan)
    largest = largest_layouts(plan, top)
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
        1 + tile_rows,
        1,
        height_ratios=heights,
        top=1 - head / fig_h,
        bottom=0.03,
        left=0.05,
        right=0.97,
        hspace=0.45,
    )
    top_gs = gs[0].subgridspec(1, 2, width_ratios=[min(max(cols, 2), 8) * 1.0, 4.0], wspace=0.18)
    draw_mesh(fig.add_subplot(top_gs[0]), plan, colors)
    draw_memory_bars(fig.add_subplot(top_gs[1]), plan, colors)
    if n_tiles:
        for r in range(tile_rows):
            row_gs = gs[1 + r].subgridspec(1, tile_cols, wspace=0.25)
            for c in range(tile_cols):
                k = r * tile_cols + c
                if k < n_tiles:
                    leaf, count = largest[k]
                    draw_tiles(fig.add_subplot(row_gs[c]), leaf, count, plan, colors)

    t = plan.totals["all"]
    heading = f"{title or 'Sharding plan'} · mesh {plan.mesh.describe()}"
    fig.text(
        0.05,
        1 - 0.32 / fig_h,
        _fitted(heading, 0.9 * fig_w, 14.0),
        fontsize=_fit_size(heading, 0.9 * fig_w, 14.0),
        weight="bold",
        color=INK,
    )
    n_err = sum(p.severity == "error" for p in problems)
    status = f" · {count_text(n_err, 'error')}" if n_err else ""
    fig.text(
        0.05,
        1 - 0.6 / fig_h,
        f"{t.leaves} arrays, {human_bytes(t.bytes)} in all · fullest device "
        f"{human_bytes(t.max_device_bytes)} · ideal {human_bytes(t.ideal_bytes)} "
        f"({t.efficiency:.0%} spread){status}",
        fontsize=10,
        color=INK,
    )
    if n_tiles:
        fig.text(
            0.05,
            1 - 0.82 / fig_h,
            "Below: the largest parameters, cut into the pieces the devices hold; each piece "
            "is coloured by its device (striped when several devices hold the same piece).",
            fontsize=8.5,
            color=MUTED,
            style="italic",
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", facecolor="white")
