"""The meshes ``meshplan train`` builds, from axis sizes (and axis names).

Two axes ``('data', 'model')`` by default (the built-in layouts' axes); any
number of named axes as ``{name: size}`` (``{'data': 2, 'fsdp': 2, 'tensor': 2}``,
as ``meshplan search`` prints them; the command line reads them from its text).
Every error carries a code (``'mesh-axis-names'``, ``'mesh-too-few-devices'``,
``'mesh-not-every-device'``) and a fix in terms of these functions; the command
line gives its own in flags.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from meshplan._errors import MeshError, error_for

__all__ = ["MESH_AXES", "make_mesh"]

MESH_AXES = ("data", "model")
"""Axis names of the meshes ``meshplan train`` builds without axis names (the layouts' axes)."""


def make_mesh(
    shape: Sequence[int] | Mapping[str, int],
    devices: Any = None,
    axes: Sequence[str] | None = None,
) -> Mesh:
    """A mesh with ``Auto`` axes on the first ``prod(shape)`` devices, by ``jax.make_mesh``.

    ``shape``: the axis sizes, or ``{name: size}``;
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
            MeshError,
            "mesh-axis-names",
            text,
            f"The mesh {text} has {len(sizes)} axes, but the axis names {names} are not one "
            f"distinct name per axis",
            f"Give one distinct name per axis (e.g. axes="
            f"{('data', 'fsdp', 'tensor', 'model')[: len(sizes)]}).",
        )
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(sizes)
    if size > len(devices):
        raise error_for(
            MeshError,
            "mesh-too-few-devices",
            text,
            f"The mesh {text} needs {size} devices, but there are only {len(devices)} "
            f"({devices[0].platform})",
            f"Use a smaller mesh, or more devices (on the CPU, XLA_FLAGS="
            f"--xla_force_host_platform_device_count={size} emulates them).",
        )
    if jax.process_count() > 1 and size < len(devices):
        processes, local = jax.process_count(), jax.local_device_count()
        raise error_for(
            MeshError,
            "mesh-not-every-device",
            text,
            f"The mesh {text} uses {size} of the {len(devices)} devices, but with {processes} "
            f"processes it must use all of them ({local} per process), so that every process "
            f"holds part of it",
            f"Use a mesh of {len(devices)} devices (e.g. shape ({processes}, {local})), or "
            f"fewer processes.",
        )
    return jax.make_mesh(
        sizes, names, axis_types=(AxisType.Auto,) * len(sizes), devices=devices[:size]
    )
