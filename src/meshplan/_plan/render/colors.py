"""The colours of plan pictures: ink, groups, and one colour per device."""

from __future__ import annotations

__all__ = ["ERROR", "GROUP_COLORS", "INK", "MUTED", "device_colors"]

GROUP_COLORS = {"params": "#4C72B0", "optimizer": "#DD8452", "other": "#8C8C8C"}
INK = "#222222"
MUTED = "#6b6b6b"
ERROR = "#c0392b"


def device_colors(n: int) -> list[object]:
    """``n`` distinct colours, one per device in mesh order."""
    from matplotlib import colormaps

    if n <= 10:
        cmap = colormaps["tab10"]
        return [cmap(i) for i in range(n)]
    if n <= 20:
        cmap = colormaps["tab20"]
        return [cmap(i) for i in range(n)]
    cmap = colormaps["turbo"]
    return [cmap(0.05 + 0.9 * i / (n - 1)) for i in range(n)]
