"""The meshes ``meshplan train`` builds, from ``'2x4'``-style text (and axis names).

Two axes ``('data', 'model')`` by default (the built-in layouts' axes); any
number of named axes with ``axes`` (``parse_mesh_shape('2x2x2', 'data,fsdp,tensor')``,
as ``meshplan search`` prints them). Every error carries a code (``'mesh-unreadable'``,
``'mesh-axes-unnamed'``, ``'mesh-axis-names'``, ``'mesh-too-few-devices'``,
``'mesh-not-every-device'``) and a fix in terms of these functions; the command
line gives its own in flags (:func:`meshplan.cli.devices.mesh_flag_advice`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from meshplan._errors import MeshError, error_for

__all__ = ["MESH_AXES", "make_mesh", "parse_mesh", "parse_mesh_shape"]

MESH_AXES = ("data", "model")
"""Axis names of the meshes ``meshplan train`` builds without axis names (the layouts' axes)."""


def parse_mesh_shape(text: str, axes: str | None = None) -> dict[str, int]:
    """``"2x4"`` -> ``{'data': 2, 'model': 4}``: mesh axis sizes from command-line text.

    One size means ``DATAx1``. Without ``axes`` the names are ``('data', 'model')``;
    ``axes`` (``"data,fsdp,model"``) names any number of axes.

    Example:
        >>> from meshplan.train.device_mesh import parse_mesh_shape
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
            MeshError, "mesh-unreadable", str(text),
            f"Cannot read the mesh {text!r}: expected positive axis sizes separated by 'x'",
            "Write it like '2x4', '4x2', '8' or '2x2x2' (the last with axes='a,b,c').",
        )  # fmt: skip
    names: tuple[str, ...]
    if axes is None:
        if len(sizes) == 1:
            sizes.append(1)
        if len(sizes) != len(MESH_AXES):
            raise error_for(
                MeshError, "mesh-axes-unnamed", str(text),
                f"The mesh {text!r} has {len(sizes)} axes; the default names are {MESH_AXES}",
                "Name them with axes, e.g. axes='data,fsdp,model'.",
            )  # fmt: skip
        names = MESH_AXES
    else:
        names = tuple(a.strip() for a in axes.split(",") if a.strip())
        if len(names) != len(sizes) or len(set(names)) != len(names):
            raise error_for(
                MeshError, "mesh-axis-names", str(text),
                f"The axis names {axes!r} are {len(set(names))} distinct names for the "
                f"{len(sizes)} mesh axes of {text!r}",
                "Give one distinct name per axis.",
            )  # fmt: skip
    return dict(zip(names, sizes, strict=True))


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: sizes of the ``('data', 'model')`` axes; ``"8"`` means 8x1.

    Example:
        >>> from meshplan.train.device_mesh import parse_mesh
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
        >>> from meshplan.train.device_mesh import make_mesh
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
        raise error_for(
            MeshError, "mesh-axis-names", text,
            f"The mesh {text} has {len(sizes)} axes, but the axis names {names} are not one "
            f"distinct name per axis",
            f"Give one distinct name per axis (e.g. axes="
            f"{('data', 'fsdp', 'tensor', 'model')[: len(sizes)]}).",
        )  # fmt: skip
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(sizes)
    if size > len(devices):
        raise error_for(
            MeshError, "mesh-too-few-devices", text,
            f"The mesh {text} needs {size} devices, but there are only {len(devices)} "
            f"({devices[0].platform})",
            f"Use a smaller mesh, or more devices (on the CPU, XLA_FLAGS="
            f"--xla_force_host_platform_device_count={size} emulates them).",
        )  # fmt: skip
    if jax.process_count() > 1 and size < len(devices):
        processes, local = jax.process_count(), jax.local_device_count()
        raise error_for(
            MeshError, "mesh-not-every-device", text,
            f"The mesh {text} uses {size} of the {len(devices)} devices, but with {processes} "
            f"processes it must use all of them ({local} per process), so that every process "
            f"holds part of it",
            f"Use a mesh of {len(devices)} devices (e.g. shape ({processes}, {local})), or "
            f"fewer processes.",
        )  # fmt: skip
    return jax.make_mesh(
        sizes, names, axis_types=(AxisType.Auto,) * len(sizes), devices=devices[:size]
    )
