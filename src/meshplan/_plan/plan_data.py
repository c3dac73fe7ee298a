"""The records of a whole plan: its mesh, rules, leaf plans and totals, as plain data.

:class:`PlanData` is what the renderers (``_plan/render``) and
:func:`~meshplan._plan.problems.find_problems` read; the public
:class:`~meshplan.Plan` adds the showing and checking on top of it.
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Iterator
from typing import Any

from meshplan._errors import Problem
from meshplan._plan.records import LeafPlan
from meshplan._plan.stages import StageTotals, stage_totals
from meshplan._plan.totals import Totals, group_totals
from meshplan._spmd.mesh_info import MeshInfo

__all__ = ["PlanData"]


class PlanData:
    """Where every array leaf of a tree goes on a mesh: the records, nothing shown or checked.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._plan.plan_data import PlanData
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8,), jnp.float32), ("x",))}
        >>> plan = meshplan.explain(tree, {"x": 4})
        >>> isinstance(plan, PlanData), len(plan), plan["w"].bytes_per_device
        (True, 1, 8)

    Attributes:
        mesh: The mesh's :class:`MeshInfo`.
        rules: The rules the plan used (``None`` when there were none).
        leaves: One :class:`LeafPlan` per array leaf, in tree order.
        skipped_leaves: How many leaves were not arrays (``apply_fn``, ``tx``...).
        rule_problems: The validator's problem for each invalid rule (left out
            of ``rules``), or for rules that are not a sequence of pairs.
        rule_index_map: For each rule in ``rules``, its index in the rules as given.
        totals: :class:`Totals` for ``'all'`` and for each group in ``GROUPS``.
    """

    def __init__(
        self,
        mesh: MeshInfo,
        rules: tuple[tuple[str, Any], ...] | None,
        leaves: list[LeafPlan],
        skipped_leaves: int,
        rule_problems: list[Problem],
        rule_index_map: tuple[int, ...],
    ) -> None:
        self.mesh = mesh
        self.rules = rules
        self.leaves = tuple(leaves)
        self.skipped_leaves = skipped_leaves
        self.rule_problems = rule_problems
        self.rule_index_map = rule_index_map
        self.totals: dict[str, Totals] = group_totals(self.leaves, mesh.size)
        self._by_path: dict[str, LeafPlan] | None = None

    @functools.cached_property
    def stages(self) -> tuple[StageTotals, ...]:
        """What each pipeline stage holds (``'stage'`` on mesh axes); ``()`` without a pipeline."""
        return stage_totals(self.leaves, self.mesh, self.rules, self.totals)

    def __len__(self) -> int:
        return len(self.leaves)

    def __iter__(self) -> Iterator[LeafPlan]:
        return iter(self.leaves)

    def __getitem__(self, path: str) -> LeafPlan:
        if self._by_path is None:
            self._by_path = {leaf.path: leaf for leaf in self.leaves}
        try:
            return self._by_path[path]
        except KeyError:
            close = difflib.get_close_matches(path, self._by_path, n=3)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(f"No array leaf at {path!r} in this plan.{hint}") from None
