"""The :class:`Plan` object: a tree's leaf plans and totals, looked up by path, shown and saved.

The records themselves are :class:`~meshplan._plan.plan_data.PlanData`; ``Plan``
adds what calls the renderers (``_plan/render``) and
:func:`~meshplan._plan.problems.find_problems`, which read only those records.
"""

from __future__ import annotations

import functools
import json
import os
from typing import TYPE_CHECKING, Any

from meshplan._errors import Problem
from meshplan._plan.plan_data import PlanData
from meshplan._plan.problems import find_problems
from meshplan._plan.render.json_dict import plan_to_dict
from meshplan._plan.render.png import write_png
from meshplan._plan.render.table import plan_renderable, to_text
from meshplan._text import count_text, human_bytes

if TYPE_CHECKING:
    from rich.console import ConsoleRenderable

__all__ = ["Plan"]


class Plan(PlanData):
    """Where every array leaf of a tree goes on a mesh, and what it costs per device.

    Made by :func:`meshplan.explain`. ``print(plan)`` shows a table (long trees are
    summarised by their largest leaves; ``plan.table(full=True)`` has every
    row), ``plan[path]`` is one :class:`LeafPlan`, ``plan.to_json()`` the
    documented JSON, ``plan.save_png(path)`` a picture, and ``plan.problems``
    what :func:`meshplan.check` reports.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(
        ...     jax.ShapeDtypeStruct((8, 16), jnp.float32), ("embed", "mlp"))}}
        >>> plan = meshplan.explain(tree, {"data": 2, "model": 4}, (("mlp", "model"),))
        >>> plan
        <Plan of 1 leaf on data=2 × model=4 (8 devices): 512 B in all, 128 B on the fullest device>
        >>> len(plan), plan["params/w"].spec, [p.code for p in plan.problems]
        (1, P(None, 'model'), ['no-rule', 'idle-axis'])

    Attributes:
        mesh: The mesh's :class:`MeshInfo`.
        rules: The rules the plan used (``None`` when there were none).
        leaves: One :class:`LeafPlan` per array leaf, in tree order.
        totals: :class:`Totals` for ``'all'`` and for each group in ``GROUPS``.
        skipped_leaves: How many leaves were not arrays (``apply_fn``, ``tx``...).
    """

    # -- checking -------------------------------------------------------------

    @functools.cached_property
    def problems(self) -> list[Problem]:
        """What :func:`meshplan.check` reports for this plan (default threshold).

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((6,), jnp.float32), ("x",))}
            >>> [(p.severity, p.path, p.code) for p in meshplan.explain(tree, {"x": 4}).problems]
            [('error', 'w', 'indivisible')]
        """
        return find_problems(self)

    # -- rendering ------------------------------------------------------------

    def table(self, full: bool = False, max_rows: int = 24) -> ConsoleRenderable:
        """A ``rich`` renderable: the per-leaf table, totals and problems.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> from meshplan._plan.render.table import to_text
            >>> tree = {f"w{i}": meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((8, 4 * (i + 1)), jnp.float32), ("model", None))
            ...     for i in range(30)}
            >>> text = to_text(meshplan.explain(tree, {"model": 4}).table(max_rows=2))
            >>> "w29" in text, "w0 " in text, "… and 28 smaller leaves" in text
            (True, False, True)

        Args:
            full: Show every leaf. Otherwise a tree of more than ``max_rows``
                leaves shows its ``max_rows`` largest (per device), in tree order.
            max_rows: Rows to show when not ``full``.
        """
        return plan_renderable(self, self.problems, full=full, max_rows=max_rows)

    def __rich__(self) -> ConsoleRenderable:
        return self.table()

    def __str__(self) -> str:
        return to_text(self.table())

    def __repr__(self) -> str:
        t = self.totals["all"]
        return (
            f"<Plan of {count_text(t.leaves, 'leaf', 'leaves')} on {self.mesh.describe()}: "
            f"{human_bytes(t.bytes)} in all, {human_bytes(t.max_device_bytes)} on the fullest device>"
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data, in the stable schema ``meshplan.plan/1`` (docs/plan.md).

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
            ...                                   ("model", None))}
            >>> data = meshplan.explain(tree, {"model": 4}).to_dict()
            >>> data["schema"], data["leaves"][0]["spec"], data["totals"]["all"]["device_bytes"]
            ('meshplan.plan/1', ['model', None], [32, 32, 32, 32])
        """
        return plan_to_dict(self)

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string.

        Example:
            >>> import json, meshplan
            >>> json.loads(meshplan.explain({}, {"data": 2}).to_json())["mesh"]["shape"]
            {'data': 2}
        """
        return json.dumps(self.to_dict(), indent=indent)

    def save_png(
        self, path: str | os.PathLike[str], *, top: int = 6, title: str | None = None
    ) -> None:
        """Draws the plan: the mesh with each device's memory, and the ``top`` largest
        parameters as tiles coloured by the devices that hold them.

        Headless (matplotlib's Agg canvas); needs no display.

        Example:
            >>> import os, tempfile, jax, jax.numpy as jnp, meshplan
            >>> tree = {"params": {"w": meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((64, 32), jnp.float32), (None, "model"))}}
            >>> path = os.path.join(tempfile.mkdtemp(), "plan.png")
            >>> meshplan.explain(tree, {"data": 2, "model": 4}).save_png(path)
            >>> open(path, "rb").read(4)
            b'\x89PNG'
        """
        write_png(self, self.problems, path, top=top, title=title)
