"""A plan as plain data: the stable JSON schema ``meshplan.plan/1`` (``docs/plan.md``).

The top level (schema, mesh, rules, skipped leaves) is built here; each leaf,
dimension and total builds its own entry (``LeafPlan.to_dict``,
``DimPlan.to_dict``, ``Totals.to_dict``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan._plan.records import json_entry

if TYPE_CHECKING:
    from meshplan._plan.plan_data import PlanData

__all__ = ["SCHEMA", "plan_to_dict"]

SCHEMA = "meshplan.plan/1"
"""Identifies the layout of :func:`plan_to_dict`; bumped on any incompatible change."""


def plan_to_dict(plan: PlanData) -> dict[str, object]:
    """The whole document: schema, mesh, rules, leaves, skipped leaves, totals.

    Example:
        >>> import meshplan
        >>> from meshplan._plan.render.json_dict import plan_to_dict
        >>> data = plan_to_dict(meshplan.explain({}, {"data": 2}, ()))
        >>> data["schema"], data["mesh"]["device_ids"], data["rules"], data["leaves"]
        ('meshplan.plan/1', [0, 1], None, [])
    """
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
        else [[name, json_entry(axes)] for name, axes in plan.rules],
        "leaves": [leaf.to_dict() for leaf in plan.leaves],
        "skipped_leaves": plan.skipped_leaves,
        "totals": {g: t.to_dict() for g, t in plan.totals.items()},
    }
