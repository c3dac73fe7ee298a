"""The tiles of a plan picture: the largest parameters, cut into the pieces devices hold."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshplan._plan.render.colors import ERROR, INK, MUTED
from meshplan._plan.render.png_mesh import DETAILED_DEVICES
from meshplan._plan.shards import shard_holders
from meshplan._text import human_bytes, shape_text

if TYPE_CHECKING:
    from meshplan._plan.plan_data import PlanData
    from meshplan._plan.records import LeafPlan

__all__ = ["draw_tiles", "largest_layouts"]


def largest_layouts(plan: PlanData, top: int) -> list[tuple[LeafPlan, int]]:
    """The ``top`` largest distinct layouts of the params (else of everything)."""
    pool = [leaf for leaf in plan.leaves if leaf.group == "params" and leaf.shape] or [
        leaf for leaf in plan.leaves if leaf.shape
    ]
    seen: dict[tuple[object, ...], list[Any]] = {}
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


def _fill_tile(ax: Any, x: float, y: float, w: float, h: float, colors: list[object]) -> None:
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


def _draw_pieces_image(
    ax: Any,
    holders: dict[tuple[int, ...], list[int]],
    color_of: dict[int, object],
    ndim: int,
    row_dims: list[int],
    col_dims: list[int],
    n_rows: int,
    n_cols: int,
    box: tuple[float, float, float, float],
) -> None:
    """Thousands of pieces: an image instead of a patch (and stripes) per piece."""
    import numpy as np

    image = np.full((n_rows, n_cols, 4), 0.87)
    for i in range(n_rows):
        for j in range(n_cols):
            key = [0] * ndim
            if row_dims:
                key[row_dims[0]] = i
            if col_dims:
                key[col_dims[0]] = j
            devs = holders.get(tuple(key), [])
            if devs:
                image[i, j] = color_of[devs[0]]
    x0, y0, width, height = box
    ax.imshow(
        image, extent=(x0, x0 + width, y0 + height, y0), interpolation="nearest", aspect="auto"
    )


def _label_fit(ax: Any, text: str, tw: float, th: float) -> tuple[float, int] | None:
    """The font size and rotation at which ``text`` fits a ``tw`` x ``th`` piece, or ``None``.

    Pieces are in the axes' data units (the array drawn within ``0..1``): labels wider
    than their piece would run into their neighbours' (``0,41,52,63,7``), so a thin piece
    gets its label turned, smaller, or none.
    """
    fig = ax.get_figure()
    box = ax.get_position()
    inch = min(box.width * fig.get_figwidth(), box.height * fig.get_figheight()) / 1.04
    wide, tall = tw * inch * 0.9, th * inch * 0.9  # inches, less a margin
    for rotation in (0, 90):  # across first, smaller, before turning it
        for size in (8.0, 6.5, 5.0):
            long, short = len(text) * size * 0.62 / 72 + 0.06, size * 1.5 / 72
            across, up = (wide, tall) if rotation == 0 else (tall, wide)
            if long <= across and short <= up:
                return size, rotation
    return None


def draw_tiles(ax: Any, leaf: LeafPlan, count: int, plan: PlanData, colors: list[object]) -> None:
    """``leaf`` cut into its pieces, each coloured by the devices holding it."""
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
    if (
        n_rows * n_cols > DETAILED_DEVICES
    ):  # one image: a pixel per piece, its first holder's colour
        _draw_pieces_image(
            ax,
            holders,
            color_of,
            len(dims),
            row_dims,
            col_dims,
            n_rows,
            n_cols,
            (x0, y0, width, height),
        )
    for i in range(n_rows if n_rows * n_cols <= DETAILED_DEVICES else 0):
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
                fit = _label_fit(ax, text, tw, th)
                if fit is None:  # no room in this piece: its colour says which device holds it
                    continue
                size, rotation = fit
                ax.text(
                    x + tw / 2,
                    y + th / 2,
                    text,
                    ha="center",
                    va="center",
                    fontsize=size,
                    rotation=rotation,
                    color=INK,
                    weight="bold",
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.85},
                )
    ax.add_patch(Rectangle((x0, y0), width, height, fill=False, edgecolor=INK, lw=1))
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
        return ERROR if not dims[k].divides else MUTED

    if col_dims:
        ax.text(
            0.5,
            y0 + height + 0.03,
            dim_label(col_dims[0]),
            ha="center",
            va="top",
            fontsize=8,
            color=dim_color(col_dims[0]),
        )
    if row_dims:
        ax.text(
            x0 - 0.03,
            0.5,
            dim_label(row_dims[0]),
            ha="right",
            va="center",
            rotation=90,
            fontsize=8,
            color=dim_color(row_dims[0]),
        )
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
        f"{_short_path(leaf.path)}{alike}\n{shape_text(leaf.shape)} {leaf.dtype}\n{leaf.spec}"
        f"\n{human_bytes(leaf.bytes_per_device)} per device · each piece on {copies}{sliced}",
        fontsize=8,
        color=INK,
        loc="center",
    )
