"""Totals of a plan by pipeline stage: the parameters and bytes each stage holds.

A stage is a position on the mesh axes the rules give the logical name
``'stage'`` (:data:`meshplan.layouts.pipeline`); its devices hold the same
layers. A plan whose rules give ``'stage'`` no mesh axis has no stages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from meshplan._spmd.pipeline import stage_axes

if TYPE_CHECKING:
    from meshplan._plan.records import LeafPlan
    from meshplan._plan.totals import Totals
    from meshplan._spmd.mesh_info import MeshInfo

__all__ = ["StageTotals", "stage_totals"]


@dataclasses.dataclass(frozen=True)
class StageTotals:
    """What one pipeline stage holds.

    Attributes:
        stage: Its index (its position on the stage's mesh axes, row-major).
        parameters: Parameters (elements of the ``params`` leaves) its devices hold together.
        param_bytes: Bytes of parameters on its fullest device.
        device_bytes: Bytes of everything (parameters, optimizer state) on its fullest device.
    """

    stage: int
    parameters: int
    param_bytes: int
    device_bytes: int


def _stage_split(leaf: LeafPlan, axes: tuple[str, ...], sizes: dict[str, int]) -> int:
    """Into how many stage pieces ``leaf`` is cut (1: every stage holds all of it)."""
    return math.prod(sizes[a] for d in leaf.dims for a in d.mesh_axes if a in axes)


def stage_totals(
    leaves: Sequence[LeafPlan], mesh: MeshInfo, rules: Any, totals: dict[str, Totals]
) -> tuple[StageTotals, ...]:
    """One :class:`StageTotals` per stage; ``()`` when ``'stage'`` has no mesh axis.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan import layouts
        >>> w = jax.ShapeDtypeStruct((8, 64, 32), jnp.float32)
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(w, ("layer", "embed", "mlp"))}}
        >>> plan = meshplan.explain(tree, {"pipeline": 4, "data": 2}, layouts.pp_fsdp)
        >>> [(s.stage, s.parameters, s.param_bytes) for s in plan.stages]
        [(0, 4096, 8192), (1, 4096, 8192), (2, 4096, 8192), (3, 4096, 8192)]
    """
    sizes = mesh.shape
    axes, stages = stage_axes(rules or (), sizes)
    if stages <= 1:
        return ()
    coords = np.unravel_index(np.arange(mesh.size), mesh.axis_sizes)
    picked = [mesh.axis_names.index(a) for a in axes]
    stage_of = np.ravel_multi_index(
        tuple(coords[i] for i in picked), tuple(mesh.axis_sizes[i] for i in picked)
    )
    params = [leaf for leaf in leaves if leaf.group == "params"]
    held = sum(math.prod(leaf.shape) // _stage_split(leaf, axes, sizes) for leaf in params)
    on_params = np.asarray(totals["params"].device_bytes)
    on_all = np.asarray(totals["all"].device_bytes)
    return tuple(
        StageTotals(s, held, int(on_params[stage_of == s].max()), int(on_all[stage_of == s].max()))
        for s in range(stages)
    )
