"""The ``('data', 'model')`` meshes ``meshplan train`` builds, from ``--mesh 2x4``-style text."""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshplan._errors import MeshError

__all__ = ["MESH_AXES", "make_mesh", "parse_mesh"]

MESH_AXES = ("data", "model")
"""Axis names of every mesh ``meshplan train`` builds (the layouts' axes)."""


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: sizes of the ``('data', 'model')`` axes; ``"8"`` means 8x1.

    Example:
        >>> from meshplan._train_mesh import parse_mesh
        >>> parse_mesh("2x4"), parse_mesh("8")
        ((2, 4), (8, 1))

    Raises:
        MeshError: ``text`` is not ``DATAxMODEL`` with positive integers.
    """
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) == 1:
        sizes = (sizes[0], 1)
    if len(sizes) != 2 or min(sizes) < 1:
        raise MeshError(
            f"Cannot read the mesh {text!r}: expected DATAxMODEL sizes of the mesh axes "
            f"{MESH_AXES}.\nWrite it like 2x4, 4x2, 8x1 or 1x1."
        )
    return sizes[0], sizes[1]


def make_mesh(shape: tuple[int, int], devices: Any = None) -> Mesh:
    """A mesh with ``Auto`` axes ``('data', 'model')`` on the first ``prod(shape)`` devices.

    Example:
        >>> from meshplan._train_mesh import make_mesh
        >>> dict(make_mesh((4, 2)).shape)
        {'data': 4, 'model': 2}

    With several processes (``jax.distributed``) the mesh must use every
    device of every process; ``jax.devices()`` lists them by process, so the
    first mesh axis splits over processes first.

    Raises:
        MeshError: there are fewer devices than the mesh needs, or, with
            several processes, the mesh leaves some devices out.
    """
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(shape)
    if size > len(devices):
        raise MeshError(
            f"The mesh {shape[0]}x{shape[1]} needs {size} devices, but there are only "
            f"{len(devices)} ({devices[0].platform}).\nUse a smaller mesh, or more devices "
            f"(meshplan train --devices {size} emulates them on the CPU)."
        )
    if jax.process_count() > 1 and size < len(devices):
        processes, local = jax.process_count(), jax.local_device_count()
        raise MeshError(
            f"The mesh {shape[0]}x{shape[1]} uses {size} of the {len(devices)} devices, but "
            f"with {processes} processes it must use all of them ({local} per process), so "
            f"that every process holds part of it.\nUse a mesh of {len(devices)} devices "
            f"(e.g. --mesh {processes}x{local}), or fewer processes."
        )
    return Mesh(np.array(devices[:size]).reshape(shape), MESH_AXES)
