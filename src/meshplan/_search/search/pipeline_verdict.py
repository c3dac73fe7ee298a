"""Pipelines in a search: the built-in pipeline layouts on every mesh of the devices,
priced among the search's rows, and whether a pipeline axis pays against the best without.

The prices are :func:`~meshplan._search.predict.pipeline.predict_pipeline`'s. A model is
pipelined along its ``'layer'`` stack (the scanned blocks): the layouts
:data:`meshplan.layouts.pipeline`, :data:`~meshplan.layouts.pp_fsdp` and
:data:`~meshplan.layouts.pp_tp` on ``pipeline x data`` (and ``pipeline x data x model``)
meshes whose stage count divides the layers, with the microbatch count that prices
fastest among ``p``, ``2p``, ``4p`` and ``8p`` (those that split the batch over
``data``). Only a step that runs its layers as a pipeline where the rules give ``'stage'`` an
axis (:func:`meshplan.pipeline_layers`, as :mod:`meshplan.models.pipeline` calls it) is priced
so (:func:`runs_stages`): a step that never reads ``'stage'`` (a plain ``nn.scan`` of its
blocks) runs no pipeline under those rules, whatever the backend. Its ``'layer'`` stack split
over ``pipeline`` is gathered whole for the loop (once for the forward pass and once for the
backward, read in XLA's compiled step) and every device runs every layer on its share of the
batch: no stage shifts, no ``collective-permute``. ``pipeline`` is the first mesh axis, so
on more devices than one host or slice holds it is the axis that crosses the slow link
(InfiniBand, DCN): a pipeline across slices.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshplan._search.predict.pipeline import predict_pipeline, stage_base
from meshplan._search.predict.profiles import HardwareProfile
from meshplan._search.predict.trace import Workload
from meshplan._search.search.result import PruneKind, SearchResult, SearchRow
from meshplan._search.search.roles import RoleVerdict, Term, VerdictKind
from meshplan._spmd.rules import MeshAxes, RulePairs, mesh_axes_of, normalize_rules
from meshplan._spmd.validate import validate
from meshplan._text import human_bytes
from meshplan.layouts import pipeline, pp_fsdp, pp_tp

__all__ = [
    "PIPELINE_LAYOUTS",
    "PipelineRows",
    "layer_count",
    "pipeline_rows",
    "pipeline_verdict",
    "runs_stages",
]

PIPELINE_LAYOUTS: dict[str, RulePairs] = {"pipeline": pipeline, "pp_fsdp": pp_fsdp, "pp_tp": pp_tp}
"""The built-in pipeline layouts a search tries (:mod:`meshplan.layouts`)."""

_KEEP = ("batch", "stage", "layer")

Rules = tuple[tuple[str, MeshAxes], ...]


def layer_count(workload: Workload) -> int | None:
    """The size of the state's ``'layer'`` stack (the scanned blocks), or ``None`` when the
    state has none, or stacks of different sizes.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.predict.trace import trace_workload
        >>> from meshplan._search.search.pipeline_verdict import layer_count
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((6, 8, 8), jnp.float32),
        ...                                   ("layer", "embed", "mlp"))
        >>> work = trace_workload(lambda s, x: x @ s["w"].value[0], {"w": w},
        ...                       jax.ShapeDtypeStruct((4, 8), jnp.float32))
        >>> layer_count(work)
        6
    """
    sizes = {s[n.index("layer")] for n, s, _ in workload.state if n is not None and "layer" in n}
    return sizes.pop() if len(sizes) == 1 else None


def runs_stages(
    step_fn: Any, abstract_state: Any, example_batch: Any, rules: RulePairs = pipeline
) -> bool:
    """Whether ``step_fn`` computes anything else where ``rules`` give ``'stage'`` mesh axes:
    it runs its layers as a pipeline (:func:`meshplan.pipeline_layers`), or refuses to.

    Traced twice under an abstract mesh (no devices) where the stage axes have 2 devices and
    the others 1: with ``rules``, and with ``'stage'`` on no axis; the two programs are
    compared. A step that fails to trace under either is taken to read the stage (a
    pipeline that cannot run on 2 stages refuses so).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.search.pipeline_verdict import runs_stages
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((4, 8, 8), jnp.float32),
        ...                                   ("layer", "embed", "mlp"))
        >>> def step(s, x):  # a plain scan of the layers: no pipeline
        ...     return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, s["w"].value)[0]
        >>> runs_stages(step, {"w": w}, jax.ShapeDtypeStruct((8, 8), jnp.float32))
        False
    """
    import jax

    from meshplan._spmd.pipeline import STAGE
    from meshplan._spmd.rules import logical_axis_rules

    pairs = normalize_rules(rules)
    staged = {a for n, e in pairs if n == STAGE for a in mesh_axes_of(e)}
    axes = tuple(dict.fromkeys(a for _, e in pairs for a in mesh_axes_of(e)))
    if not staged:
        return False
    sizes = tuple(2 if a in staged else 1 for a in axes)
    mesh = jax.sharding.AbstractMesh(
        sizes, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes)
    )
    off = tuple((n, None if n == STAGE else e) for n, e in pairs)
    programs = []
    for each in (pairs, off):
        # A new function each time: JAX's trace cache does not know the active rules.
        def step(state: Any, batch: Any) -> Any:
            return step_fn(state, batch)

        try:
            with jax.sharding.use_abstract_mesh(mesh), logical_axis_rules(each):
                programs.append(str(jax.make_jaxpr(step)(abstract_state, example_batch)))
        except Exception:
            return True
    return programs[0] != programs[1]


def _rules(layout: RulePairs, names: list[str]) -> Rules:
    """A pipeline layout's rules for this model: the names it has (and ``batch``, ``stage``,
    ``layer``), then every other name it has, unsplit."""
    own = [(n, a) for n, a in layout if n in names or n in _KEEP]
    given = {n for n, _ in own}
    return (*own, *((n, None) for n in names if n not in given))


def _meshes(devices: int, layers: int, tensor: bool) -> list[dict[str, int]]:
    """``pipeline x data`` (``x model`` with ``tensor``) meshes of ``devices``, the stage
    count dividing ``layers``; ``data`` and ``model`` above one where ``tensor``."""
    out = []
    for p in range(2, min(devices, layers) + 1):
        if devices % p or layers % p:
            continue
        if not tensor:
            out.append({"pipeline": p, "data": devices // p})
            continue
        rest = devices // p
        out += [
            {"pipeline": p, "data": rest // t, "model": t}
            for t in range(2, rest + 1)
            if rest % t == 0
        ]
    return out


def _has_model(rules: RulePairs) -> bool:
    """Whether ``rules`` name a ``model`` axis (tensor parallelism inside each stage)."""
    return any("model" in mesh_axes_of(a) for _, a in normalize_rules(rules))


def _invalid(workload: Workload, mesh: dict[str, int], rules: Rules) -> str | None:
    """The first error :func:`meshplan.validate` finds for one of the state's arrays."""
    for names, shape in dict.fromkeys((n, s) for n, s, _ in workload.state if n is not None):
        for p in validate("state", shape, names, mesh, rules):
            if p.severity == "error":
                return p.message
    return None


def _microbatches(p: int, data: int, batch: int) -> list[int]:
    """The microbatch counts tried: ``p``, ``2p``, ``4p``, ``8p`` that split ``batch`` over ``data``."""
    return [m for m in (p, 2 * p, 4 * p, 8 * p) if batch % (m * data) == 0]


class PipelineRows:
    """What :func:`pipeline_rows` found: ``rows`` (priced, fitting or pruned), how many
    candidates it ``enumerated``, how many it ``pruned`` by kind, and ``absent``: why no
    pipeline was tried (``None`` where one was)."""

    def __init__(self) -> None:
        self.rows: list[SearchRow] = []
        self.enumerated = 0
        self.pruned: dict[PruneKind, int] = {}
        self.absent: str | None = None

    def prune(self, row: SearchRow, kind: PruneKind, detail: str) -> None:
        row.status, row.pruned_by, row.reason = "pruned", kind, f"{kind}: {detail}"
        self.pruned[kind] = self.pruned.get(kind, 0) + 1
        self.rows.append(row)


def pipeline_rows(
    workload: Workload,
    devices: int,
    profile: HardwareProfile,
    budget: int,
    *,
    microbatches: int = 1,
    layouts: Mapping[str, RulePairs] = PIPELINE_LAYOUTS,
    staged: bool = True,
) -> PipelineRows:
    """The built-in pipeline layouts on every mesh of ``devices`` whose stages split the
    layers, each with its fastest microbatch count, as search rows: ``ok`` (within
    ``budget``) or pruned (``invalid``, ``batch``, ``memory``) with the reason.
    ``layouts``: the pipeline layouts tried (their axes ``pipeline``, ``data`` and, where
    they name it, ``model``); ``microbatches``: the search's gradient accumulation (a
    pipeline is not priced with one); ``staged``: whether the step runs a pipeline where the
    rules give ``'stage'`` an axis (:func:`runs_stages`; none is priced where it does not).

    Example:
        >>> from meshplan._search.predict.pipeline import example_stack
        >>> from meshplan._search.predict.profiles import get_profile
        >>> from meshplan._search.search.pipeline_verdict import pipeline_rows
        >>> found = pipeline_rows(example_stack(), 8, get_profile("h100"), 80 * 2**30)
        >>> row = next(r for r in found.rows if r.mesh == {"pipeline": 4, "data": 2})
        >>> row.layout, row.pipeline.schedule.microbatches, row.schedule_text.split(", ")[:2]
        ('pipeline', 4, ['4 stages', '4 microbatches'])
    """
    found = PipelineRows()
    layers = layer_count(workload)
    batch = workload.batch
    if not layouts:
        found.absent = "the layouts searched (layouts=) have no pipeline"
        return found
    if microbatches > 1:
        found.absent = (
            f"the step accumulates {microbatches} microbatches (gradient accumulation): a "
            "pipeline's own microbatches replace them; search without it to price one"
        )
        return found
    if layers is None or layers < 2 or batch is None:
        found.absent = (
            "the model has no 'layer' stack of scanned blocks to cut into stages"
            if layers is None or layers < 2
            else "the batch size is unknown"
        )
        return found
    if not staged:
        found.absent = (
            "the step runs no pipeline where the rules give 'stage' an axis (its layers are "
            "not meshplan.pipeline_layers): its 'layer' stack would be gathered whole and "
            "every layer run on every device"
        )
        return found
    names = [n for n in workload.names if n not in _KEEP]
    tried = False
    for layout, rules_of in layouts.items():
        for mesh in _meshes(devices, layers, _has_model(rules_of)):
            if layout == "pp_fsdp" and mesh["data"] == 1:
                continue  # the same as 'pipeline'
            tried = True
            found.enumerated += 1
            rules = _rules(rules_of, names)
            row = SearchRow(dict(mesh), rules, layout)
            _price(row, workload, profile, budget, found, batch)
    if not tried:
        found.absent = (
            f"no pipeline of {devices} devices splits {layers} layers into stages "
            "(a stage count above one that divides both)"
        )
    return found


def _price(
    row: SearchRow,
    workload: Workload,
    profile: HardwareProfile,
    budget: int,
    found: PipelineRows,
    batch: int,
) -> None:
    """Prices one pipeline candidate with each microbatch count: the fastest that fits, else
    the one of least memory, pruned."""
    mesh, rules = row.mesh, row.rules
    error = _invalid(workload, mesh, rules)
    if error is not None:
        found.prune(row, "invalid", error)
        return
    p, data = mesh["pipeline"], mesh["data"]
    ms = _microbatches(p, data, batch)
    if not ms:
        found.prune(
            row,
            "batch",
            f"a batch of {batch} does not split into {p} or more "
            f"microbatches ({p}, {2 * p}, {4 * p} or {8 * p}) over {data} data devices",
        )
        return
    base = stage_base(workload, mesh, rules, profile)
    priced = [
        predict_pipeline(workload, mesh, rules, profile, microbatches=m, base=base) for m in ms
    ]
    fits = [pp for pp in priced if pp.cost.memory_bytes <= budget]
    if not fits:
        least = min(priced, key=lambda pp: pp.cost.memory_bytes)
        row.cost, row.pipeline = least.cost, least
        found.prune(
            row,
            "memory",
            f"{human_bytes(least.cost.memory_bytes)} per device is over "
            f"the budget of {human_bytes(budget)} (with {least.schedule.microbatches} "
            f"microbatches)",
        )
        return
    best = min(fits, key=lambda pp: pp.cost.step_s)
    row.cost, row.pipeline = best.cost, best
    found.rows.append(row)


def _uses(row: SearchRow) -> bool:
    return row.mesh.get("pipeline", 1) > 1 and row.pipeline is not None


def pipeline_verdict(result: SearchResult) -> RoleVerdict:
    """Whether ``result``'s best layout is a pipeline, and why (or why not).

    Reads the search's own rows (the pipelines :func:`pipeline_rows` priced among them),
    as :func:`~meshplan._search.search.roles.role_verdict` does for ``context`` and
    ``expert``: ``memory`` when only one side fits, else the term of the step
    (``communication``, ``compute``, ``memory traffic``) the best pipeline saves most
    (proposed) or adds most (not), with its schedule; ``absent`` when no pipeline was
    priced (``result.pipeline_absent`` says why).

    Example:
        >>> from meshplan._search.search.rule_search import example_search
        >>> from meshplan._search.search.pipeline_verdict import pipeline_verdict
        >>> verdict = pipeline_verdict(example_search())  # one weight: no layer stack
        >>> verdict.kind, verdict.reason
        ('absent', "no pipeline: the model has no 'layer' stack of scanned blocks to cut into stages")
    """
    budget = result.budget_bytes
    # What each priced row needs (a row pruned by its state alone: the state's bytes).
    need = [
        (r.cost.memory_bytes if r.cost is not None else r.bytes_per_device, _uses(r))
        for r in result.rows
        if r.cost is not None or r.pruned_by == "memory"
    ]
    with_ = [r for r in result.ok if _uses(r) and r.fits is not False]
    without = [r for r in result.ok if not _uses(r) and r.fits is not False]
    w, n = (with_[0] if with_ else None), (without[0] if without else None)
    mem_w = min((m for m, uses in need if uses and m is not None), default=None)
    mem_n = min((m for m, uses in need if not uses and m is not None), default=None)
    best = result.best
    proposed = best is not None and _uses(best)

    def verdict(
        kind: VerdictKind, reason: str, terms: dict[Term, float] | None = None
    ) -> RoleVerdict:
        return RoleVerdict("pipeline", proposed, kind, reason, w, n, mem_n, mem_w, terms or {})

    if not any(r.pipeline is not None for r in result.rows):
        return verdict("absent", f"no pipeline: {result.pipeline_absent or 'none was priced'}")
    if w is None or n is None:
        side, least = ("without", mem_n) if n is None else ("with", mem_w)
        return verdict(
            "memory",
            f"{side} a pipeline nothing fits: the least memory per device "
            f"is {'unknown' if least is None else human_bytes(least)}, over the budget "
            f"of {'none' if budget is None else human_bytes(budget)}"
            + (
                f"; the pipeline fits: {w.mesh_text} {w.layout}, {w.schedule_text}"
                if w is not None
                else ""
            ),
        )
    cw, cn = w.cost, n.cost
    assert cw is not None and cn is not None
    terms: dict[Term, float] = {
        "communication": cw.comm_s - cn.comm_s,
        "compute": cw.compute_s - cn.compute_s,
        "memory traffic": cw.memory_s - cn.memory_s,
    }
    kind = min(terms, key=terms.__getitem__) if proposed else max(terms, key=terms.__getitem__)
    parts = [f"{k} {d * 1e3:+.2f} ms" for k, d in sorted(terms.items(), key=lambda kv: -abs(kv[1]))]
    reason = (
        f"pipeline {'pays' if proposed else 'does not pay'}: {', '.join(parts)} with it (step "
        f"{cw.step_s * 1e3:.2f} against {cn.step_s * 1e3:.2f} ms; best pipeline {w.mesh_text} "
        f"{w.axes_text} {w.layout}: {w.schedule_text})"
    )
    return verdict(kind, reason, terms)
