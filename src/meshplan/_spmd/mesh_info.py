"""The mesh as a plan sees it: axis names, their sizes, and the device ids in mesh order."""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from typing import TypeAlias

import numpy as np
from jax.sharding import AbstractMesh, Mesh

from meshplan._errors import MeshError, error_for
from meshplan._text import count_text

__all__ = ["JaxMesh", "MeshInfo", "MeshLike", "axis_names_fix", "mesh_info"]

JaxMesh: TypeAlias = Mesh | AbstractMesh
"""A JAX mesh: a ``Mesh`` of devices, or an ``AbstractMesh`` of axis names and sizes only."""
MeshLike: TypeAlias = Mesh | AbstractMesh | Mapping[str, int]
"""What a plan takes as a mesh: a :data:`JaxMesh`, or a mapping of axis sizes such as
``{'data': 2, 'model': 4}``."""


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """The shape of a mesh: axis names, their sizes, and the device ids in mesh order.

    Attributes:
        axis_names: The mesh axis names, major to minor.
        axis_sizes: The size of each axis.
        device_ids: Device ids in row-major mesh order (``0..n-1`` for an
            ``AbstractMesh`` or a plain mapping of axis sizes).
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_ids: tuple[int, ...]

    @property
    def shape(self) -> dict[str, int]:
        """``{axis_name: size}``, like ``Mesh.shape``."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    @property
    def size(self) -> int:
        """The number of devices."""
        return math.prod(self.axis_sizes)

    def describe(self) -> str:
        """``'data=2 × model=4 (8 devices)'``."""
        axes = " × ".join(f"{n}={s}" for n, s in self.shape.items()) or "no axes"
        return f"{axes} ({count_text(self.size, 'device')})"


def mesh_info(mesh: MeshLike | MeshInfo) -> MeshInfo:
    """Reads axis names, sizes and device ids from a ``Mesh``, ``AbstractMesh`` or mapping.

    Example:
        >>> from meshplan._spmd.mesh_info import mesh_info
        >>> mesh_info({"data": 2, "model": 4}).describe()
        'data=2 × model=4 (8 devices)'
    """
    if isinstance(mesh, MeshInfo):
        return mesh
    if isinstance(mesh, Mapping):
        names, sizes = tuple(mesh), tuple(mesh.values())
        ids = None
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
        names = tuple(mesh.axis_names)
        shape = mesh.shape
        sizes = tuple(shape[n] for n in names) if isinstance(shape, Mapping) else tuple(shape)
        try:
            ids = tuple(int(d.id) for d in np.asarray(mesh.devices).flat)
        except (AttributeError, ValueError, TypeError):  # AbstractMesh has no devices
            ids = None
    else:
        raise error_for(
            MeshError,
            "not-a-mesh",
            "mesh",
            f"A plan needs a mesh (jax.sharding.Mesh, AbstractMesh, or a mapping of axis "
            f"sizes such as {{'data': 2, 'model': 4}}), got {type(mesh).__name__}: {mesh!r}",
            "Build one with jax.make_mesh((2, 4), ('data', 'model')).",
        )
    bad = [
        (n, s)
        for n, s in zip(names, sizes, strict=True)
        if not isinstance(n, str) or not _is_pos(s)
    ]
    if bad or len(set(names)) != len(names):
        raise error_for(
            MeshError,
            "bad-mesh-axes",
            "mesh",
            f"A mesh needs distinct string axis names with positive integer sizes, got "
            f"{dict(zip(names, sizes, strict=True))!r}",
            "Name each axis once, e.g. {'data': 2, 'model': 4}.",
        )
    sizes = tuple(int(s) for s in sizes)
    if ids is None or len(ids) != math.prod(sizes):
        ids = tuple(range(math.prod(sizes)))
    return MeshInfo(names, sizes, ids)


def _is_pos(s: object) -> bool:
    return isinstance(s, int | np.integer) and not isinstance(s, bool) and bool(s > 0)


def axis_names_fix(missing: tuple[str, ...], mesh: MeshInfo) -> str:
    """The fix for naming mesh axes ``missing`` that ``mesh`` lacks: the nearest name, if any.

    Example:
        >>> from meshplan._spmd.mesh_info import axis_names_fix, mesh_info
        >>> axis_names_fix(("modle",), mesh_info({"data": 2, "model": 4}))
        "Did you mean 'model'? Use the mesh's axis names ('data', 'model'), or map logical names to them with rules."
    """
    guess = [m for a in missing for m in difflib.get_close_matches(a, mesh.shape, n=1)]
    hint = f"Did you mean {guess[0]!r}? " if guess else ""
    return (
        f"{hint}Use the mesh's axis names {mesh.axis_names!r}, or map logical names to them "
        f"with rules."
    )
