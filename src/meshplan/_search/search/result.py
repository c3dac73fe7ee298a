"""What a search finds: one row type and one result type for both searches.

:func:`meshplan.search_rules` ranks by a predicted step time (a row's ``cost``); without
a step (``ranked_by='static'``, which :func:`meshplan.search_layouts` is), by state bytes
and a static estimate of the bytes moved (a row's ``bytes_per_device`` and ``comm``).
Both give a :class:`SearchResult` of :class:`SearchRow`; the result's ``ranked_by``
says which ranking it holds, and so how it prints.

The example in :func:`meshplan.search_rules` runs a search; the methods here are
shown on that result in ``docs/layouts.md`` ("Searching the space of rules").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypedDict

from meshplan._errors import MeshError, error_for
from meshplan._plan.render.table import to_text
from meshplan._search.predict.cost import Cost
from meshplan._search.predict.pipeline import PipelineCost
from meshplan._search.predict.profiles import HardwareProfile
from meshplan._search.predict.report import unpriced_line
from meshplan._search.predict.trace import ThroughputUnit
from meshplan._spmd.rules import RulePairs, rules_to_json
from meshplan._text import human_bytes

if TYPE_CHECKING:
    from rich.console import Group

__all__ = [
    "PRUNE_REASONS",
    "CommEstimate",
    "PruneKind",
    "RankedBy",
    "RowStatus",
    "SearchCounts",
    "SearchResult",
    "SearchRow",
    "require_devices",
]

RowStatus: TypeAlias = Literal["ok", "pruned", "rejected"]
"""``'ok'``: ranked; ``'pruned'``: dropped by :func:`meshplan.search_rules` (its reason
``'<kind>: <detail>'``, the kind a :data:`PruneKind`); ``'rejected'``: refused by
:func:`meshplan.search_layouts` (its reason ``'<path>: <problem>'``)."""

PruneKind: TypeAlias = Literal["invalid", "batch", "idle", "symmetric", "memory"]
"""Why :func:`meshplan.search_rules` prunes a candidate."""

PRUNE_REASONS: tuple[PruneKind, ...] = ("invalid", "batch", "idle", "symmetric", "memory")
"""Why a candidate is pruned, in the order the checks run."""

RankedBy: TypeAlias = Literal["predicted", "static"]
"""``'predicted'``: by predicted step time (:func:`meshplan.search_rules`); ``'static'``:
by state bytes, then the static estimate of bytes moved (:func:`meshplan.search_layouts`)."""

CommEstimate = TypedDict(
    "CommEstimate", {"all-gather": int, "gradient-reduce": int, "activations": int | None}
)
"""The static estimate, bytes per step per device (:mod:`meshplan._search.search.static`);
``activations`` is ``None`` when the model's code decides it (tensor parallelism)."""


class SearchCounts(TypedDict):
    """How many candidates a search ``enumerated``, ``pruned`` (by kind), ``scored``,
    ``compiled`` and ``measured``."""

    enumerated: int
    pruned: dict[PruneKind, int]
    scored: int
    compiled: int
    measured: int


def require_devices(devices: int, doing: str) -> None:
    """Raises the one error of both searches for too few JAX devices to ``doing``.

    Example:
        >>> from meshplan._search.search.result import require_devices
        >>> require_devices(1, "measuring")
        >>> require_devices(10**6, "measuring")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        meshplan.MeshError: measuring needs 1000000 devices; JAX has ...
    """
    import jax

    have = jax.device_count()
    if have >= devices:
        return
    raise error_for(
        MeshError,
        "too-few-devices",
        "devices",
        f"{doing} needs {devices} devices; JAX has {have}",
        f"Set XLA_FLAGS=--xla_force_host_platform_device_count={devices} before JAX starts, "
        f"or search without measuring",
    )


@dataclasses.dataclass
class SearchRow:
    """One candidate: a mesh (axis -> size) under rules, and what the search found.

    ``layout``: a built-in's (or a given layout's) name, else ``'searched'``;
    ``status``/``reason``: :data:`RowStatus`; ``pruned_by``: why a row that is not ``ok``
    was dropped, as a record (a :data:`PruneKind`; read it, not the reason's text); ``rank``: 1 is the best; ``compiled``:
    what the compiled step showed (:func:`meshplan._search.measure.hlo.measure_step`). The
    predicted ranking fills ``cost`` (and ``measured_s``, the median step time when
    run); the static one fills ``bytes_per_device``, ``params_bytes_per_device``,
    ``comm``, ``idle_axes`` and ``fits``. ``pipeline``: a pipelined row's price (its
    schedule, bubble and sends: :func:`~meshplan._search.predict.pipeline.predict_pipeline`);
    ``None`` for every other row.
    """

    mesh: dict[str, int]
    rules: RulePairs
    layout: str = "searched"
    status: RowStatus = "ok"
    reason: str = ""
    rank: int | None = None
    cost: Cost | None = None
    compiled: dict[str, Any] | None = None
    measured_s: float | None = None
    fits: bool | None = None
    bytes_per_device: int | None = None
    params_bytes_per_device: int | None = None
    comm: CommEstimate | None = None
    idle_axes: tuple[str, ...] = ()
    pruned_by: PruneKind | None = None
    pipeline: PipelineCost | None = None

    @property
    def schedule_text(self) -> str:
        """A pipelined row's schedule: ``4 stages, 16 microbatches, bubble 16%`` (else ``''``)."""
        pp = self.pipeline
        if pp is None:
            return ""
        s = pp.schedule
        repeats = f" x {s.repeats} repeats" if s.repeats > 1 else ""
        return (
            f"{s.stages} stages{repeats}, {s.microbatches} microbatches, bubble {s.bubble:.0%}, "
            f"sends {human_bytes(pp.send_bytes)} over the {pp.link} link"
        )

    @property
    def mesh_text(self) -> str:
        return "x".join(str(s) for s in self.mesh.values())

    @property
    def axes_text(self) -> str:
        return ",".join(self.mesh)

    @property
    def measured(self) -> dict[str, Any] | None:
        """``compiled``, by the name :func:`meshplan.search_layouts` gave it."""
        return self.compiled

    @property
    def predicted_s(self) -> float | None:
        """The predicted step time in seconds (refined by the compile, when compiled)."""
        return None if self.cost is None else self.cost.step_s

    @property
    def rules_pairs(self) -> list[list[Any]]:
        """The rules as JSON-ready ``[name, axes]`` pairs (axes a name, a list or ``None``)."""
        return rules_to_json(self.rules)

    @property
    def short_rules(self) -> str:
        """The rules that split something: ``batch=data+fsdp embed=fsdp mlp=tensor``."""
        parts = []
        for n, a in self.rules:
            axes = a if isinstance(a, tuple) else (a,) if isinstance(a, str) else ()
            axes = tuple(x for x in axes if self.mesh.get(x, 1) > 1)
            if axes:
                parts.append(f"{n}={'+'.join(axes)}")
        return " ".join(parts) or "(all replicated)"

    @property
    def comm_text(self) -> str:
        """The static estimate as text (``-`` without one)."""
        if self.comm is None:
            return "-"
        known = human_bytes(self.comm["all-gather"] + self.comm["gradient-reduce"])
        return known if self.comm["activations"] is not None else f"{known} + activations n/a"

    def write_rules(self, path: str) -> None:
        """Writes the rules to ``path`` as JSON ``[name, axes]`` pairs (what
        :func:`meshplan.layouts.get_layout` reads back)."""
        import json

        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.rules_pairs, f)
            f.write("\n")

    def __str__(self) -> str:
        name = f"{self.mesh_text} {self.layout}"
        if self.status != "ok":
            return f"{name} ({self.status}: {self.reason})"
        if self.cost is not None:
            return f"{name} (predicted {self.cost.step_s * 1e3:.3f} ms/step)"
        text = f"{human_bytes(self.bytes_per_device or 0)}/device, comm est. {self.comm_text}/step"
        if self.compiled is not None:
            text += f", measured {human_bytes(self.compiled['collective_bytes'])}"
        return f"{name} ({text}{'' if self.fits else ', over budget'})"

    def to_dict(self, result: SearchResult | None = None) -> dict[str, Any]:
        """Plain data, every field (``None`` where this row's ranking does not fill it); with
        ``result`` (predicted rows), the prediction's fields of ``meshplan plan --json``
        (tokens/s, MFU, memory by kind against the budget: :mod:`meshplan._search.predict.report`)."""
        cost = self.cost
        data: dict[str, Any] = {
            "mesh": dict(self.mesh),
            "mesh_text": self.mesh_text,
            "mesh_shape": list(self.mesh.values()),
            "axis_names": list(self.mesh),
            "layout": self.layout,
            "rules": self.rules_pairs,
            "status": self.status,
            "reason": self.reason,
            "pruned_by": self.pruned_by,
            "rank": self.rank,
            "fits": self.fits,
            "bytes_per_device": self.bytes_per_device,
            "params_bytes_per_device": self.params_bytes_per_device,
            "comm": None if self.comm is None else dict(self.comm),
            "idle_axes": list(self.idle_axes),
            "predicted_step_s": self.predicted_s,
            "memory_bytes_per_device": None if cost is None else cost.memory_bytes,
            "state_bytes_per_device": None if cost is None else cost.state_bytes,
            "comm_bytes": None if cost is None else dict(cost.comm_bytes),
            "comm_by_axis": None if cost is None else dict(cost.comm_by_axis),
            "compute_s": None if cost is None else cost.compute_s,
            "comm_s": None if cost is None else cost.comm_s,
            "compiled": self.compiled,
            "measured": self.compiled,
            "measured_step_s": self.measured_s,
            "pipeline": None if self.pipeline is None else self.pipeline.to_dict(),
        }
        if cost is not None and result is not None and result.profile is not None:
            from meshplan._search.predict.report import prediction_fields

            budget = result.budget_bytes if result.budget_bytes is not None else cost.memory_bytes
            fields = prediction_fields(
                cost, result.tokens, result.devices, result.profile, budget, result.tokens_unit
            )
            data.update({k: v for k, v in fields.items() if k not in ("devices", "profile")})
        return data

    def _static_key(self) -> tuple[Any, ...]:
        """The static ranking: fits, state bytes, idle axes, unknown communication, bytes."""
        m, c = self.compiled, self.comm
        if m:
            unknown, comm = False, m["collective_bytes"]
        else:
            assert c is not None, "rows are ranked only once estimated (status 'ok')"
            unknown, comm = c["activations"] is None, c["all-gather"] + c["gradient-reduce"]
        return (not self.fits, self.bytes_per_device, bool(self.idle_axes), unknown, comm)


@dataclasses.dataclass
class SearchResult:
    """What a search found: ``rows`` (the ``ok`` ones ranked, then the others).

    ``ranked_by``: :data:`RankedBy`; ``profile``: the hardware the step time is
    predicted for (``None`` for the static ranking); ``budget_bytes``: bytes one
    device may hold (``None``: no budget); ``counts``: ``enumerated``, ``pruned`` (by
    kind), ``scored``, ``compiled``, ``measured``; ``seconds``: the search's wall time;
    ``path_rules``: the names :func:`meshplan.infer_names` gave a model that had none, as
    the ``(pattern, names)`` pairs :func:`meshplan.name_by_path` takes (``None`` for a
    named model; :meth:`write_names` writes them); ``pipeline_absent``: why the search
    priced no pipeline (no ``'layer'`` stack, no stage count that splits it...), or
    ``None`` where it did. Prints as a table (the static ranking's is a ``rich`` one), then ``best: ...``.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan, meshplan.layouts
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((1024,), jnp.float32), ("embed",))
        >>> result = meshplan.search_layouts({"w": w}, 2, {"fsdp": meshplan.layouts.fsdp})
        >>> print(result)
                      2 devices
          #  mesh  layout  state/device  comm est./step  notes
          1   1x2  fsdp        2.00 KiB        6.00 KiB
          2   2x1  fsdp        2.00 KiB        6.00 KiB
        best: 1x2 fsdp (2.00 KiB/device, comm est. 6.00 KiB/step)
        >>> result.ranked_by, meshplan.RuleSearchResult is meshplan.SearchResult
        ('static', True)
    """

    rows: list[SearchRow]
    devices: int
    profile: HardwareProfile | None = None
    budget_bytes: int | None = None
    counts: SearchCounts = dataclasses.field(
        default_factory=lambda: SearchCounts(
            enumerated=0, pruned={}, scored=0, compiled=0, measured=0
        )
    )
    seconds: float = 0.0
    batch: int | None = None
    tokens: int | None = None
    ranked_by: RankedBy = "predicted"
    tokens_unit: ThroughputUnit = "tokens"
    path_rules: Sequence[tuple[str, Sequence[str | None] | None]] | None = None
    pipeline_absent: str | None = None

    def write_names(self, path: str) -> None:
        """Writes :attr:`path_rules` to ``path`` as JSON ``[pattern, names]`` pairs (what
        ``--names`` and :func:`meshplan.layouts.get_names` read back).

        Example:
            >>> import json, os, tempfile
            >>> import meshplan
            >>> result = meshplan.SearchResult.__new__(meshplan.SearchResult)
            >>> result.path_rules = [("params/w", ("embed", "mlp"))]
            >>> path = os.path.join(tempfile.mkdtemp(), "names.json")
            >>> result.write_names(path)
            >>> json.load(open(path))
            [['params/w', ['embed', 'mlp']]]
        """
        import json

        pairs = [json.dumps([p, None if n is None else list(n)]) for p, n in self.path_rules or ()]
        with open(path, "w", encoding="utf-8") as f:
            f.write("[\n  " + ",\n  ".join(pairs) + "\n]\n")  # one pair a line

    @property
    def memory_budget_bytes(self) -> int | None:
        """``budget_bytes``, by the name :func:`meshplan.search_layouts` takes it.

        Example:
            >>> from meshplan._search.search.rule_search import example_search
            >>> result = example_search()  # search_rules' example, run once
            >>> result.memory_budget_bytes == result.budget_bytes == result.profile.memory_bytes
            True
        """
        return self.budget_bytes

    @property
    def ok(self) -> list[SearchRow]:
        """The rows that passed, ranked.

        Example:
            >>> from meshplan._search.search.rule_search import example_search
            >>> result = example_search()  # search_rules' example, run once
            >>> [r.rank for r in result.ok][:3]
            [1, 2, 3]
        """
        return [r for r in self.rows if r.status == "ok"]

    @property
    def best(self) -> SearchRow | None:
        """The first ranked row within the budget, or ``None`` when none is.

        Example:
            >>> from meshplan._search.search.rule_search import example_search
            >>> result = example_search()  # search_rules' example, run once
            >>> result.best.mesh_text, result.best.layout, result.best.short_rules
            ('1x8', 'tensor_parallel', 'mlp=model')
        """
        return next((r for r in self.ok if r.fits is not False), None)

    def best_builtin(self) -> SearchRow | None:
        """The first ``ok`` row of a built-in (or given) layout.

        Example:
            >>> from meshplan._search.search.rule_search import example_search
            >>> result = example_search()  # search_rules' example, run once
            >>> result.best_builtin().layout
            'tensor_parallel'
        """
        return next((r for r in self.ok if r.layout != "searched"), None)

    def row(self, mesh_text: str, layout: str) -> SearchRow:
        """The row of one candidate (the first, when generated rules share a mesh).

        Example:
            >>> from meshplan._search.search.rule_search import example_search
            >>> result = example_search()  # search_rules' example, run once
            >>> result.row("8x1", "fsdp").status, result.row("8x1", "fsdp").pruned_by
            ('pruned', 'symmetric')
        """
        for r in self.rows:
            if (r.mesh_text, r.layout) == (mesh_text, layout):
                return r
        raise KeyError(f"No candidate {mesh_text} {layout} in this search.")

    def table(self, top: int = 10) -> str:
        """The first ``top`` ranked rows of a predicted ranking and the pruning counts, as text.

        Example:
            >>> from meshplan._search.search.rule_search import example_search
            >>> result = example_search()  # search_rules' example, run once
            >>> print(result.table(1))  # doctest: +ELLIPSIS
            8 devices, profile h100, budget 74.51 GiB/device, batch 64
              #  mesh ...
              1  1x8 data,model ...
            enumerated ..., pruned ...
            best: 1x8 data,model mlp=model
        """
        if self.ranked_by == "static":
            return to_text(self)
        assert self.profile is not None
        budget = "none" if self.budget_bytes is None else human_bytes(self.budget_bytes)
        lines = [
            f"{self.devices} devices, profile {self.profile.name}, budget "
            f"{budget}/device" + (f", batch {self.batch}" if self.batch else ""),
            f"{'#':>3}  {'mesh':<14} {'predicted':>10} {'measured':>9} {'memory':>11} "
            f"{'all-reduce':>11} {'all-gather':>11}  rules",
        ]
        for r in self.ok[:top]:
            c = r.cost
            assert c is not None
            mesh = f"{r.mesh_text} {r.axes_text}"
            measured = "-" if r.measured_s is None else f"{r.measured_s * 1e3:.2f}ms"
            name = f" ({r.layout})" if r.layout != "searched" else ""
            name += f" [{r.schedule_text}]" if r.pipeline is not None else ""
            lines.append(
                f"{r.rank:>3}  {mesh:<14} {c.step_s * 1e3:>8.3f}ms {measured:>9} "
                f"{human_bytes(c.memory_bytes):>11} "
                f"{human_bytes(c.comm_bytes.get('all-reduce', 0)):>11} "
                f"{human_bytes(c.comm_bytes.get('all-gather', 0)):>11}  {r.short_rules}{name}"
            )
        pruned = self.counts["pruned"]
        lines.append(
            f"enumerated {self.counts['enumerated']}, pruned "
            + ", ".join(f"{k} {v}" for k, v in pruned.items() if v)
            + f"; scored {self.counts['scored']}, compiled {self.counts['compiled']}, "
            f"measured {self.counts['measured']}; {self.seconds:.1f} s"
        )
        if self.best is not None:
            lines.append(
                f"best: {self.best.mesh_text} {self.best.axes_text} {self.best.short_rules}"
            )
            if self.best.cost is not None and self.best.cost.unpriced:
                lines.append(unpriced_line(self.best.cost.unpriced))
            if self.best.cost is not None:
                lines += [f"note: {n}" for n in self.best.cost.notes]
        else:
            lines.append("best: none (no candidate passes and fits)")
        return "\n".join(lines)

    def __rich__(self) -> Group:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        if self.ranked_by != "static":
            return Group(Text(self.table()))
        n_measured = 3 * any(r.compiled for r in self.rows)
        title = f"{self.devices} devices" + (f", batch {self.batch}" if self.batch else "")
        if self.budget_bytes is not None:
            title += f", budget {human_bytes(self.budget_bytes)}/device"
        table = Table(title=title, box=None)
        names = ["#", "mesh", "layout", "state/device", "comm est./step", "measured comm"]
        for name in [*names, "XLA args", "XLA temp"][: 5 + n_measured]:
            table.add_column(name, justify="left" if name == "layout" else "right")
        table.add_column("notes")
        for r in self.rows:
            if r.status != "ok":
                cells = ["-", r.mesh_text, r.layout, "-", "-"] + ["-"] * n_measured
                table.add_row(*cells, Text(f"{r.status}: {r.reason}", style="red"), style="dim")
                continue
            m = r.compiled or {}
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
        return to_text(self) if self.ranked_by == "static" else self.table()

    def to_dict(self) -> dict[str, Any]:
        """Plain data: ``schema`` (``meshplan.rule_search/1`` for the predicted ranking,
        ``meshplan.search/1`` for the static one; the same fields), the search, ``best``
        and ``rows``.

        Example:
            >>> from meshplan._search.search.rule_search import example_search
            >>> result = example_search()  # search_rules' example, run once
            >>> data = result.to_dict()
            >>> data["schema"], data["best"]["mesh_shape"], data["best"]["rules"][1]
            ('meshplan.rule_search/1', [1, 8], ['mlp', 'model'])
        """
        schema = "meshplan.search/1" if self.ranked_by == "static" else "meshplan.rule_search/1"
        return {
            "schema": schema,
            "ranked_by": self.ranked_by,
            "devices": self.devices,
            "batch": self.batch,
            "profile": None if self.profile is None else self.profile.to_dict(),
            "budget_bytes": self.budget_bytes,
            "memory_budget_bytes": self.budget_bytes,
            "counts": self.counts,
            "seconds": self.seconds,
            "best": None if self.best is None else self.best.to_dict(self),
            "rows": [r.to_dict(self) for r in self.rows],
        }
