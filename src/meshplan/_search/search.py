"""Searching for a layout: every mesh shape and rule set, checked, sized and ranked.

A candidate (mesh shape, layout) is *rejected* when :func:`meshplan.check` finds
an error or the batch does not divide by the devices ``'batch'`` is split over.
The others rank by: within the budget, then state bytes on the fullest device
(``explain``), then whether a mesh axis is *idle* (splits neither the batch nor
a parameter: its devices repeat the same work), then communication: a *static
estimate*, bytes per step per device counted as operands (as
:func:`meshplan._search.hlo.collective_bytes` does), from the plan's ``params``. With
``B`` the mesh axes (size > 1) of ``'batch'``: ``all-gather`` is the shard of
each parameter split over ``B`` (FSDP); ``gradient-reduce`` (if ``B``) is each
parameter as a device computes with it, its shard times its FSDP split;
``activations`` is 0 unless a parameter is split over an axis outside ``B``
(tensor parallelism: its activation all-reduces depend on the model's code, so
``None``, "n/a", ranked after a known estimate). Optimizer state never moves.
``measure=True`` compiles a step for the first ``top_k`` and records its HLO
collectives and XLA ``memory_analysis()``; among those, measured bytes rank.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import jax

from meshplan._errors import ArgumentError, MeshError
from meshplan._plan.explain import explain
from meshplan._plan.plan import Plan
from meshplan._plan.render.table import to_text
from meshplan._search.hlo import measure_step
from meshplan._spmd.rules import logical_to_mesh_axes, mesh_axes_of
from meshplan._spmd.validate import validate
from meshplan._text import human_bytes
from meshplan.layouts import get_layout

__all__ = ["SearchResult", "SearchRow", "mesh_shapes", "search_layouts"]

DEFAULT_LAYOUTS = ("data_parallel", "fsdp", "tensor_parallel", "fsdp_tp")
"""The canned layouts of :mod:`meshplan.layouts` that ``search_layouts`` tries by default."""

CommEstimate = TypedDict(
    "CommEstimate", {"all-gather": int, "gradient-reduce": int, "activations": int | None}
)
"""A row's static estimate, bytes per step per device (module docstring); ``activations``
is ``None`` when the model's code decides it (tensor parallelism)."""


def mesh_shapes(devices: int, n_axes: int = 2) -> list[tuple[int, ...]]:
    """Every ordered shape of ``n_axes`` axes whose sizes multiply to ``devices``.

    Example:
        >>> from meshplan._search.search import mesh_shapes
        >>> mesh_shapes(8)
        [(1, 8), (2, 4), (4, 2), (8, 1)]
    """
    if n_axes == 1:
        return [(devices,)]
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    return [(d, *rest) for d in divisors for rest in mesh_shapes(devices // d, n_axes - 1)]


@dataclasses.dataclass
class SearchRow:
    """One candidate: a mesh shape (``mesh``, axis sizes) under a layout (``layout``, ``rules``).

    ``status``: ``'ok'`` or ``'rejected'`` (``reason``: why; else notes: idle axes, over budget);
    ``comm``: the estimate; ``measured``: :func:`meshplan._search.hlo.measure_step`'s; ``rank``: 1 is best.
    """

    mesh: dict[str, int]
    layout: str
    rules: Any
    status: str = "ok"
    reason: str = ""
    fits: bool | None = None
    bytes_per_device: int | None = None
    params_bytes_per_device: int | None = None
    comm: CommEstimate | None = None
    measured: dict[str, Any] | None = None
    idle_axes: tuple[str, ...] = ()
    rank: int | None = None

    @property
    def mesh_text(self) -> str:
        return "x".join(str(s) for s in self.mesh.values())

    @property
    def comm_text(self) -> str:
        if self.comm is None:
            return "-"
        known = human_bytes(self.comm["all-gather"] + self.comm["gradient-reduce"])
        return known if self.comm["activations"] is not None else f"{known} + activations n/a"

    def _sort_key(self) -> tuple[Any, ...]:
        m, c = self.measured, self.comm
        if m:
            unknown, comm = False, m["collective_bytes"]
        else:
            assert c is not None, "rows are ranked only once estimated (status 'ok')"
            unknown, comm = c["activations"] is None, c["all-gather"] + c["gradient-reduce"]
        return (not self.fits, self.bytes_per_device, bool(self.idle_axes), unknown, comm)

    def __str__(self) -> str:
        if self.status != "ok":
            return f"{self.mesh_text} {self.layout} (rejected: {self.reason})"
        text = f"{human_bytes(self.bytes_per_device or 0)}/device, comm est. {self.comm_text}/step"
        if self.measured is not None:
            text += f", measured {human_bytes(self.measured['collective_bytes'])}"
        return f"{self.mesh_text} {self.layout} ({text}{'' if self.fits else ', over budget'})"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["rules"] = [[n, list(a) if isinstance(a, tuple) else a] for n, a in self.rules]
        return {**data, "mesh_text": self.mesh_text}


@dataclasses.dataclass
class SearchResult:
    """What :func:`search_layouts` found.

    ``rows``: every :class:`SearchRow`, the ``ok`` ones ranked, then the rejected
    ones; ``best``: the first ``ok`` row within the budget, or ``None``. Prints
    as a ``rich`` table (``str`` gives its text), then ``best: ...``.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan, meshplan.layouts
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((1024,), jnp.float32), ("embed",))
        >>> print(meshplan.search_layouts({"w": w}, 2, {"fsdp": meshplan.layouts.fsdp}))
                      2 devices
          #  mesh  layout  state/device  comm est./step  notes
          1   1x2  fsdp        2.00 KiB        6.00 KiB
          2   2x1  fsdp        2.00 KiB        6.00 KiB
        best: 1x2 fsdp (2.00 KiB/device, comm est. 6.00 KiB/step)
    """

    rows: list[SearchRow]
    best: SearchRow | None
    devices: int
    batch: int | None = None
    memory_budget_bytes: int | None = None

    def row(self, mesh_text: str, layout: str) -> SearchRow:
        """The row of one candidate.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((1024, 6), jnp.float32), ("embed", "mlp"))
            >>> meshplan.search_layouts({"params": {"w": w}}, 4).row("2x2", "tensor_parallel").comm
            {'all-gather': 0, 'gradient-reduce': 12288, 'activations': None}
        """
        for r in self.rows:
            if (r.mesh_text, r.layout) == (mesh_text, layout):
                return r
        raise KeyError(f"No candidate {mesh_text} {layout} in this search.")

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        n_measured = 3 * any(r.measured for r in self.rows)
        title = f"{self.devices} devices" + (f", batch {self.batch}" if self.batch else "")
        if self.memory_budget_bytes is not None:
            title += f", budget {human_bytes(self.memory_budget_bytes)}/device"
        table = Table(title=title, box=None)
        names = ["#", "mesh", "layout", "state/device", "comm est./step", "measured comm"]
        for name in [*names, "XLA args", "XLA temp"][: 5 + n_measured]:
            table.add_column(name, justify="left" if name == "layout" else "right")
        table.add_column("notes")
        for r in self.rows:
            if r.status != "ok":
                cells = ["-", r.mesh_text, r.layout, "-", "-"] + ["-"] * n_measured
                table.add_row(*cells, Text(f"rejected: {r.reason}", style="red"), style="dim")
                continue
            m = r.measured or {}
            keys = ("collective_bytes", "xla_argument_bytes", "xla_temp_bytes")
            measured = [human_bytes(m[k]) if m.get(k) is not None else "-" for k in keys]
            cells = [str(r.rank), r.mesh_text, r.layout, human_bytes(r.bytes_per_device or 0)]
            cells += [r.comm_text, *measured[:n_measured]]
            table.add_row(*cells, Text(r.reason, style="yellow"))
        best = self.best
        return Group(
            table, Text(f"best: {best}" if best else "best: none (no candidate is ok and fits)")
        )

    def __str__(self) -> str:
        return to_text(self)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``schema`` ``meshplan.search/1``): the search, ``best`` and ``rows``.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((1024, 6), jnp.float32), ("embed", "mlp"))
            >>> data = meshplan.search_layouts({"params": {"w": w}}, 4).to_dict()
            >>> data["best"]["mesh_text"], len(data["rows"]), data["rows"][-1]["status"]
            ('1x4', 12, 'rejected')
        """
        best = None if self.best is None else self.best.to_dict()
        fields = ("devices", "batch", "memory_budget_bytes")
        return {"schema": "meshplan.search/1", **{f: getattr(self, f) for f in fields},
                "best": best, "rows": [r.to_dict() for r in self.rows]}  # fmt: skip


def _estimate(
    plan: Plan, batch_axes: tuple[str, ...], sizes: Mapping[str, int]
) -> tuple[CommEstimate, tuple[str, ...]]:
    """The static communication estimate (module docstring), and the idle mesh axes."""
    data_axes = {a for a in batch_axes if sizes[a] > 1}
    gather, reduce, used = 0, 0, set(data_axes)
    for leaf in (leaf for leaf in plan.leaves if leaf.group == "params"):
        axes = [a for e in leaf.spec for a in mesh_axes_of(e) if sizes.get(a, 1) > 1]
        fsdp = math.prod(sizes[a] for a in axes if a in data_axes)
        gather += leaf.bytes_per_device if fsdp > 1 else 0
        reduce += leaf.bytes_per_device * fsdp if data_axes else 0
        used.update(axes)
    comm: CommEstimate = {"all-gather": gather, "gradient-reduce": reduce, "activations": None if used - data_axes else 0}  # fmt: skip
    return comm, tuple(a for a in sizes if sizes[a] > 1 and a not in used)


def _evaluate(row: SearchRow, state: Any, batch: int | None, budget: int | None) -> None:
    plan = explain(state, row.mesh, row.rules)
    errors = [p for p in plan.problems if p.severity == "error"]
    if errors:
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        row.status, row.reason = "rejected", f"{errors[0].path}: {errors[0].message}{more}"
        return
    axes = mesh_axes_of(logical_to_mesh_axes(("batch",), row.rules)[0])
    if batch is not None:  # the batch is one more array for the validator: (batch,) named 'batch'
        bad = [p for p in validate("batch", (batch,), ("batch",), row.mesh, row.rules)
               if p.severity == "error"]  # fmt: skip
        if bad:
            row.status, row.reason = "rejected", f"{bad[0].path}: {bad[0].message}"
            return
    row.bytes_per_device = plan.totals["all"].max_device_bytes
    row.params_bytes_per_device = plan.totals["params"].max_device_bytes
    row.comm, row.idle_axes = _estimate(plan, axes, row.mesh)
    over = None if budget is None else row.bytes_per_device - budget
    row.fits = over is None or over <= 0
    notes = [f"idle {a!r}: its {row.mesh[a]} positions do the same work" for a in row.idle_axes]
    if over is not None and over > 0:
        notes.append(f"over the budget by {human_bytes(over)}")
    row.reason = "; ".join(notes)


def search_layouts(
    abstract_state: Any,
    devices: int,
    layouts: Mapping[str, Any] | Sequence[str] | None = None,
    *,
    axis_names: tuple[str, ...] = ("data", "model"),
    batch: int | None = None,
    memory_budget_bytes: int | None = None,
    measure: bool = False,
    step_fn: Callable[[Any, Any], Any] | None = None,
    example_batch: Any = None,
    top_k: int = 3,
) -> SearchResult:
    """Tries every mesh shape of ``devices`` under every layout, and ranks what works.

    Rejects, with the reason, what :func:`meshplan.check` or the ``batch`` rejects; ranks
    the rest by budget, per-device bytes, communication (``meshplan._search.search`` has the model).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = jax.ShapeDtypeStruct((1024, 6), jnp.float32)
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}}
        >>> result = meshplan.search_layouts(tree, 4, batch=8)
        >>> print(result.best)
        1x4 fsdp (6.00 KiB/device, comm est. 30.00 KiB/step)
        >>> print(result.row("1x4", "tensor_parallel").reason)
        params/w: dim 1 ('mlp') of size 6 does not divide by 4 (mesh axis 'model' of size 4)

    Args:
        abstract_state: What :func:`meshplan.explain` takes (``jax.eval_shape`` of init).
        devices: How many devices the mesh has.
        layouts: ``{name: rules}``, or names of built-in layouts (``meshplan.layouts``);
            ``None``: the four canned layouts (``DEFAULT_LAYOUTS``).
        axis_names: The mesh axis names the rules use.
        batch: Global batch size (default: ``example_batch``'s, else unchecked).
        memory_budget_bytes: State bytes one device may hold.
        measure: Compile ``step_fn`` for the first ``top_k`` (needs ``devices`` devices).
        step_fn: ``step_fn(state, batch)``; each batch array's first dim is ``'batch'``.
        example_batch: The batch: a ``ShapeDtypeStruct``, an array, or a tree.
        top_k: How many candidates to measure.

    Raises:
        ArgumentError: ``measure`` without ``step_fn`` or ``example_batch``.
        MeshError: ``measure`` with fewer JAX devices than ``devices``.
    """
    if layouts is None:
        layouts = DEFAULT_LAYOUTS
    if not isinstance(layouts, Mapping):  # names of built-in layouts (or rules files)
        layouts = {name: get_layout(name) for name in layouts}
    if batch is None and example_batch is not None:
        batch = int(jax.tree.leaves(example_batch)[0].shape[0])
    if top_k < 1:
        raise ArgumentError(f"search_layouts requires a positive top_k, got {top_k=}.")
    if measure and (step_fn is None or example_batch is None):
        raise ArgumentError("measure=True compiles a step: pass step_fn= and example_batch=.")
    if measure and jax.device_count() < devices:
        fix = f"Set XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts."
        raise MeshError(f"Measuring needs {devices} devices; JAX has {jax.device_count()}.\n{fix}")
    rows = [
        SearchRow(dict(zip(axis_names, shape, strict=True)), name, rules)
        for shape in mesh_shapes(devices, len(axis_names))
        for name, rules in layouts.items()
    ]
    for row in rows:
        _evaluate(row, abstract_state, batch, memory_budget_bytes)
    ok = sorted((r for r in rows if r.status == "ok"), key=SearchRow._sort_key)
    if measure:
        assert step_fn is not None  # measure without step_fn was refused above
        for row in ok[:top_k]:
            row.measured = measure_step(step_fn, abstract_state, example_batch, row.mesh, row.rules)
        ok[:top_k] = sorted(ok[:top_k], key=SearchRow._sort_key)
    for i, row in enumerate(ok, 1):
        row.rank = i
    best = next((r for r in ok if r.fits), None)
    rows = ok + [r for r in rows if r.status != "ok"]
    return SearchResult(rows, best, devices, batch, memory_budget_bytes)
