"""A plan as plain data: the stable JSON schema ``meshplan.plan/1`` (``docs/plan.md``).

One function per level of the schema (plan, leaf, dimension, totals), so the
whole layout reads in one place.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from meshplan._spmd.rules import UNCONSTRAINED

if TYPE_CHECKING:
    from meshplan._plan.plan import Plan
    from meshplan._plan.records import DimPlan, LeafPlan
    from meshplan._plan.totals import Totals

__all__ = ["SCHEMA", "dim_to_dict", "leaf_to_dict", "plan_to_dict", "totals_to_dict"]

SCHEMA = "meshplan.plan/1"
"""Identifies the layout of :func:`plan_to_dict`; bumped on any incompatible change."""


def plan_to_dict(plan: Plan) -> dict[str, Any]:
    """The whole document: schema, mesh, rules, leaves, skipped leaves, totals."""
    return {
        "schema": SCHEMA,
        "mesh": {
            "axis_names": list(plan.mesh.axis_names),
            "shape": plan.mesh.shape,
            "devices": plan.mesh.size,
            "device_ids": list(plan.mesh.device_ids),
        },
        "rules": None
        if plan.rules is None
        else [[name, _json_entry(axes)] for name, axes in plan.rules],
        "leaves": [leaf_to_dict(leaf) for leaf in plan.leaves],
        "skipped_leaves": plan.skipped_leaves,
        "totals": {g: totals_to_dict(t) for g, t in plan.totals.items()},
    }


def leaf_to_dict(leaf: LeafPlan) -> dict[str, Any]:
    """The ``leaves[i]`` entry."""
    return {
        "path": leaf.path,
        "group": leaf.group,
        "kind": leaf.kind,
        "shape": None if leaf.shape is None else list(leaf.shape),
        "dtype": leaf.dtype,
        "names": None if leaf.names is None else [_json_entry(n) for n in leaf.names],
        "spec": [_json_entry(e) for e in leaf.spec],
        "shard_shape": None if leaf.shard_shape is None else list(leaf.shard_shape),
        "bytes": leaf.bytes,
        "bytes_per_device": leaf.bytes_per_device,
        "replication": leaf.replication,
        "uneven": leaf.uneven,
        "dims": [dim_to_dict(d) for d in leaf.dims],
    }


def dim_to_dict(dim: DimPlan) -> dict[str, Any]:
    """The ``leaves[i].dims[j]`` entry."""
    return {
        "name": _json_entry(dim.name),
        "size": dim.size,
        "mesh_axes": list(dim.mesh_axes),
        "shards": dim.shards,
        "shard_size": dim.shard_size,
        "status": dim.status,
        "rule": dim.rule_index,
        "missing_axes": list(dim.missing_axes),
        "duplicate_axes": list(dim.duplicate_axes),
        "skipped": [
            {"rule": s.rule_index, "reason": s.reason, "taken_by": list(s.taken_by)}
            for s in dim.skipped
        ],
        "why": dim.why,
    }


def totals_to_dict(totals: Totals) -> dict[str, Any]:
    """The ``totals[group]`` entry."""
    return {
        "leaves": totals.leaves,
        "bytes": totals.bytes,
        "max_device_bytes": totals.max_device_bytes,
        "ideal_bytes": totals.ideal_bytes,
        "device_bytes": list(totals.device_bytes),
    }


def _json_entry(entry: Any) -> Any:
    """A name or spec entry as JSON: ``'UNCONSTRAINED'``, a list for a tuple, else itself."""
    if entry is UNCONSTRAINED:
        return "UNCONSTRAINED"
    if isinstance(entry, tuple):
        return list(entry)
    return entry
