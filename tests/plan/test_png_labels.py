"""The PNG's piece labels fit their pieces, and a long title keeps the mesh in view."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from meshplan._plan.render.png import _fit_size, _fitted
from meshplan._plan.render.png_tiles import _label_fit


def _axes():
    fig = Figure(figsize=(3, 3))
    return fig.add_axes((0, 0, 1, 1))


@pytest.mark.parametrize(
    ("text", "tw", "th", "expected"),
    [
        ("0,4", 0.25, 0.25, (8.0, 0)),  # a roomy piece: across, full size
        ("0,4", 0.06, 0.5, (6.5, 90)),  # a thin, tall piece: turned (smaller)
        ("0", 0.5, 0.06, (6.5, 0)),  # a flat piece: across, smaller, not turned
        ("0,1,2,3,4,5,6,7", 0.02, 0.02, None),  # no room: no label, the colour says it
    ],
)
def test_piece_labels_fit_or_are_left_out(text, tw, th, expected):
    assert _label_fit(_axes(), text, tw, th) == expected


def test_a_long_title_is_shrunk_then_cut_in_the_middle_keeping_the_mesh():
    title = "mypkg.models:" + "a_very_long_factory_name_" * 12 + " · mesh data=2 × model=4"
    assert _fit_size(title, 10.0, 14.0) == 8.0
    shown = _fitted(title, 10.0, 14.0)
    assert shown.startswith("mypkg.models:") and shown.endswith("model=4") and "…" in shown
    assert len(shown) * 8.0 * 0.62 / 72 <= 10.0
    assert _fitted("Transformer (tiny) · mesh data=2 × model=4", 10.0, 14.0).endswith("model=4")
