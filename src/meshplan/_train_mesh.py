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

    Raises:
        MeshError: there are fewer devices than the mesh needs.
    """
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(shape)
    if size > len(devices):
        raise MeshError(
            f"The mesh {shape[0]}x{shape[1]} needs {size} devices, but there are only "
            f"{len(devices)} ({devices[0].platform}).\nUse a smaller mesh, or more devices "
            f"(meshplan train --devices {size} emulates them on the CPU)."
        )
    return Mesh(np.array(devices[:size]).reshape(shape), MESH_AXES)
