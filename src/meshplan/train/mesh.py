"""The meshes ``meshplan train`` builds, from ``--mesh 2x4``-style text (and ``--axes``).

Two axes ``('data', 'model')`` by default (the built-in layouts' axes); any
number of named axes with ``--axes`` (``--mesh 2x2x2 --axes data,fsdp,tensor``,
as ``meshplan search`` prints them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from meshplan._errors import MeshError

__all__ = ["MESH_AXES", "make_mesh", "parse_mesh", "parse_mesh_shape"]

MESH_AXES = ("data", "model")
"""Axis names of the meshes ``meshplan train`` builds without ``--axes`` (the layouts' axes)."""


def parse_mesh_shape(text: str, axes: str | None = None) -> dict[str, int]:
    """``"2x4"`` -> ``{'data': 2, 'model': 4}``: mesh axis sizes from command-line text.

    One size means ``DATAx1``. Without ``axes`` the names are ``('data', 'model')``;
    ``axes`` (``"data,fsdp,model"``) names any number of axes.

    Example:
        >>> from meshplan.train.mesh import parse_mesh_shape
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
        raise MeshError(
            f"Cannot read the mesh {text!r}: expected positive axis sizes separated by 'x'.\n"
            f"Write it like 2x4, 4x2, 8 or 2x2x2 (the last with --axes a,b,c)."
        )
    names: tuple[str, ...]
    if axes is None:
        if len(sizes) == 1:
            sizes.append(1)
        if len(sizes) != len(MESH_AXES):
            raise MeshError(
                f"The mesh {text!r} has {len(sizes)} axes; the default names are "
                f"{MESH_AXES}.\nName them with --axes, e.g. --axes data,fsdp,model."
            )
        names = MESH_AXES
    else:
        names = tuple(a.strip() for a in axes.split(",") if a.strip())
        if len(names) != len(sizes) or len(set(names)) != len(names):
            raise MeshError(
                f"--axes {axes!r} gives {len(names)} distinct names for the {len(sizes)} "
                f"mesh axes of {text!r}.\nGive one distinct name per axis."
            )
    return dict(zip(names, sizes, strict=True))


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: sizes of the ``('data', 'model')`` axes; ``"8"`` means 8x1.

    Example:
        >>> from meshplan.train.mesh import parse_mesh
        >>> parse_mesh("2x4"), parse_mesh("8")
        ((2, 4), (8, 1))

    Raises:
        MeshError: as :func:`parse_mesh_shape`.
    """
    data, model = parse_mesh_shape(text).values()
    return data, model


def make_mesh(
    shape: Sequence[int] | Mapping[str, int],
    devices: Any = None,
    axes: Sequence[str] | None = None,
) -> Mesh:
    """A mesh with ``Auto`` axes on the first ``prod(shape)`` devices, by ``jax.make_mesh``.

    ``shape``: the axis sizes, or ``{name: size}`` (from :func:`parse_mesh_shape`);
    ``axes``: the names of a sequence of sizes (default ``('data', 'model')`` for
    two sizes). ``jax.make_mesh`` orders the devices by their topology on GPUs
    and TPUs.

    Example:
        >>> from meshplan.train.mesh import make_mesh
        >>> mesh = make_mesh((2, 2))  # on 8 devices: the first 4
        >>> dict(mesh.shape), [d.id for d in mesh.devices.flat], mesh.axis_types
        ({'data': 2, 'model': 2}, [0, 1, 2, 3], (Auto, Auto))
        >>> dict(make_mesh({"data": 2, "fsdp": 2, "tensor": 2}).shape)
        {'data': 2, 'fsdp': 2, 'tensor': 2}

    With several processes (``jax.distributed``) the mesh must use every
    device of every process; ``jax.devices()`` lists them by process, so the
    first mesh axis splits over processes first.

    Raises:
        MeshError: there are fewer devices than the mesh needs, or, with
            several processes, the mesh leaves some devices out, or ``axes``
            does not name each size once.
    """
    if isinstance(shape, Mapping):
        names, sizes = tuple(shape), tuple(int(v) for v in shape.values())
    else:
        sizes = tuple(int(v) for v in shape)
        names = tuple(axes) if axes is not None else MESH_AXES
    text = "x".join(str(s) for s in sizes)
    if len(names) != len(sizes) or len(set(names)) != len(names):
        raise MeshError(
            f"The mesh {text} has {len(sizes)} axes, but the axis names {names} are not one "
            f"distinct name per axis.\nGive one distinct name per axis (e.g. --axes "
            f"{','.join(('data', 'fsdp', 'tensor', 'model')[: len(sizes)])})."
        )
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(sizes)
    if size > len(devices):
        raise MeshError(
            f"The mesh {text} needs {size} devices, but there are only "
            f"{len(devices)} ({devices[0].platform}).\nUse a smaller mesh, or more devices "
            f"(meshplan train --devices {size} emulates them on the CPU)."
        )
    if jax.process_count() > 1 and size < len(devices):
        processes, local = jax.process_count(), jax.local_device_count()
        raise MeshError(
            f"The mesh {text} uses {size} of the {len(devices)} devices, but "
            f"with {processes} processes it must use all of them ({local} per process), so "
            f"that every process holds part of it.\nUse a mesh of {len(devices)} devices "
            f"(e.g. --mesh {processes}x{local}), or fewer processes."
        )
    return jax.make_mesh(
        sizes, names, axis_types=(AxisType.Auto,) * len(sizes), devices=devices[:size]
    )
