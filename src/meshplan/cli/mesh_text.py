"""``--mesh 2x4`` (and ``--axes``) read as mesh axis sizes: ``{'data': 2, 'model': 4}``.

Reading the command line's text is the command line's job; the library's
:func:`meshplan.train.device_mesh.make_mesh` takes the sizes. The errors carry the
codes ``'mesh-unreadable'``, ``'mesh-axes-unnamed'`` and ``'mesh-axis-names'``,
worded in flags by :func:`meshplan.cli.devices.mesh_flag_advice`.
"""

from __future__ import annotations

from meshplan._errors import MeshError, error_for
from meshplan.train.device_mesh import MESH_AXES

__all__ = ["parse_mesh", "parse_mesh_shape"]


def parse_mesh_shape(text: str, axes: str | None = None) -> dict[str, int]:
    """``"2x4"`` -> ``{'data': 2, 'model': 4}``: mesh axis sizes from command-line text.

    One size means ``DATAx1``. Without ``axes`` the names are ``('data', 'model')``;
    ``axes`` (``"data,fsdp,model"``) names any number of axes.

    Example:
        >>> from meshplan.cli.mesh_text import parse_mesh_shape
        >>> parse_mesh_shape("2x4"), parse_mesh_shape("8"), parse_mesh_shape("4×2")
        ({'data': 2, 'model': 4}, {'data': 8, 'model': 1}, {'data': 4, 'model': 2})
        >>> parse_mesh_shape("2x2x2", "data,fsdp,model")
        {'data': 2, 'fsdp': 2, 'model': 2}

    Raises:
        MeshError: the sizes are not positive integers separated by ``x``, or
            ``axes`` does not give one distinct name per size.
    """
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        sizes = [int(p) for p in parts]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise error_for(
            MeshError,
            "mesh-unreadable",
            str(text),
            f"Cannot read the mesh {text!r}: expected positive axis sizes separated by 'x'",
            "Write it like '2x4', '4x2', '8' or '2x2x2' (the last with axes='a,b,c').",
        )
    names: tuple[str, ...]
    if axes is None:
        if len(sizes) == 1:
            sizes.append(1)
        if len(sizes) != len(MESH_AXES):
            raise error_for(
                MeshError,
                "mesh-axes-unnamed",
                str(text),
                f"The mesh {text!r} has {len(sizes)} axes; the default names are {MESH_AXES}",
                "Name them with axes, e.g. axes='data,fsdp,model'.",
            )
        names = MESH_AXES
    else:
        names = tuple(a.strip() for a in axes.split(",") if a.strip())
        if len(names) != len(sizes) or len(set(names)) != len(names):
            raise error_for(
                MeshError,
                "mesh-axis-names",
                str(text),
                f"The axis names {axes!r} are {len(set(names))} distinct names for the "
                f"{len(sizes)} mesh axes of {text!r}",
                "Give one distinct name per axis.",
            )
    return dict(zip(names, sizes, strict=True))


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: sizes of the ``('data', 'model')`` axes; ``"8"`` means 8x1.

    Example:
        >>> from meshplan.cli.mesh_text import parse_mesh
        >>> parse_mesh("2x4"), parse_mesh("8")
        ((2, 4), (8, 1))

    Raises:
        MeshError: as :func:`parse_mesh_shape`.
    """
    data, model = parse_mesh_shape(text).values()
    return data, model
