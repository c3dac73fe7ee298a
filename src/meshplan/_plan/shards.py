"""Which devices hold which piece of an array, and the bytes each holds when pieces differ."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from meshplan._plan.records import DimPlan, LeafPlan
    from meshplan._spmd.mesh_info import MeshInfo

__all__ = ["shard_holders", "uneven_device_bytes"]


def _shard_index(dim: DimPlan, mesh: MeshInfo) -> npt.NDArray[np.int64]:
    """For every device (flat, mesh order), the index of its piece along ``dim``."""
    grid = np.indices(mesh.axis_sizes).reshape(len(mesh.axis_sizes), -1)
    index = np.zeros(mesh.size, dtype=np.int64)
    seen: set[str] = set()
    for a in dim.mesh_axes:
        if a in mesh.axis_names and a not in seen:
            seen.add(a)
            k = mesh.axis_names.index(a)
            index = index * mesh.axis_sizes[k] + grid[k]
    return index


def uneven_device_bytes(
    dims: Sequence[DimPlan], mesh: MeshInfo, itemsize: int
) -> npt.NDArray[np.int64]:
    """Exact bytes on each device when some pieces are shorter than others."""
    out = np.full(mesh.size, itemsize, dtype=np.int64)
    for d in dims:
        assert d.size is not None and d.shard_size is not None
        start = _shard_index(d, mesh) * d.shard_size
        out *= np.clip(d.size - start, 0, d.shard_size)
    return out


def shard_holders(leaf: LeafPlan, mesh: MeshInfo) -> dict[tuple[int, ...], list[int]]:
    """For each piece of ``leaf`` (by its index along every dimension), the devices holding it.

    Device ids are ``mesh.device_ids``. Used to draw the plan.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._plan.shards import shard_holders
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
        ...                                   (None, "model"))}
        >>> plan = meshplan.explain(tree, {"data": 2, "model": 2})
        >>> shard_holders(plan["w"], plan.mesh)
        {(0, 0): [0, 2], (0, 1): [1, 3]}
    """
    idx = np.stack([_shard_index(d, mesh) for d in leaf.dims], axis=1) if leaf.dims else None
    holders: dict[tuple[int, ...], list[int]] = {}
    for k, dev in enumerate(mesh.device_ids):
        key = () if idx is None else tuple(int(i) for i in idx[k])
        holders.setdefault(key, []).append(dev)
    return holders
