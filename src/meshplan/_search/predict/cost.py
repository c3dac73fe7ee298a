"""Predicted step time of a traced step under a mesh and rules: compute + memory + communication.

:func:`predict` prices a :class:`meshplan._search.predict.trace.Workload` (every matmul and
the bytes of every other op, by logical names) on one candidate: each array's
dimensions map to mesh axes through the rules exactly as the sharding would
(``meshplan.logical_to_mesh_axes``, per array), and each ``dot_general`` is
partitioned the way XLA's SPMD partitioner does in the common cases:

* its *output* dimensions (batch, then one operand's free ones, then the
  other's) keep their mesh axes; an axis already taken by an earlier
  dimension means the operand holding it is **all-gathered** over that axis
  (FSDP: the weight's ``embed`` shard, when the batch holds the same axis).
  Where both operands' free dimensions claim one axis, a weight's gradient keeps
  the operand whose free dimensions carry a parameter's names (it is made in the
  parameter's sharding) and gathers the other; elsewhere the smaller is gathered;
* a *contracting* dimension split over an axis no output dimension holds
  leaves partial sums: the output is **all-reduced** over that axis (tensor
  parallelism's activation all-reduces; data parallelism's gradient
  reductions, where the contracting dimension is the batch), or
  **reduce-scattered** into the output's shards where the output flows into a
  constraint that shards it over that axis (``Dot.out_names``; Megatron's sequence
  parallelism) and the backend reduce-scatters;
* an operand whose dimension is not split where the other's is, is sliced
  locally (free);
* a contracting dimension split over an axis an output dimension also holds is
  either a gather of the operand or partial sums **reduce-scattered** into the
  output's shards, whichever moves fewer bytes, where the backend reduce-scatters
  (``HardwareProfile.reduce_scatter``; FSDP's weight gradients); an activation's
  operand (an output with ``'batch'``) is gathered once per array for every matmul
  that reads it (``Workload.operand_arrays``), and again for the backward pass where
  both passes read it (``regather``).

Per device, a matmul runs at the roofline: the larger of its FLOPs (divided by the
product of the axes that split it) over ``peak_flops * matmul_efficiency`` and the
bytes of its operands and output over ``memory_bandwidth`` (their sum where the
backend does not overlap them: ``HardwareProfile.matmul_bytes_serial``, XLA:CPU).
Other ops cost only the bytes XLA's fusions read and write
(:mod:`meshplan._search.predict.trace` counts what leaves a fusion); on a backend with
fused attention the scores cost nothing but their matmuls' FLOPs. Collectives are priced
by :mod:`meshplan._search.predict.collectives` (hierarchical where a group crosses
domains); a reduction over a split dimension (a
norm's statistics over a split ``mlp``, a softmax's over a split ``vocab``) all-reduces
its partial results (``Workload.reductions``); a logical constraint that moves a value's
axes (a mixture of experts' dispatch and combine) is an all-to-all or a gather
(:mod:`meshplan._search.predict.reshard`). Those on the critical path (tensor
parallelism's activation reductions) add up; the independent ones (weight gathers
and gradient reductions: arrays without a ``'batch'`` dimension) are combined up to
``combine_bytes`` (one latency per combined group) and hidden behind up to
``overlap`` of the compute: only what is left is exposed. A weight gathered for the
forward pass is gathered again for the backward pass where the profile says so
(``regather``: TPU and GPU).

The memory per device is :mod:`meshplan._search.predict.memory`'s: the state, the batch and
the largest point of the step's liveness program (activations and temporaries).

Bytes are reported as :func:`meshplan._search.measure.hlo.collective_bytes` counts them
(operands, per device, per step), so a prediction can be checked against a
compiled step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from meshplan._search.predict import attention
from meshplan._search.predict import memory as memory_model
from meshplan._search.predict.collectives import array_latency, collective_time
from meshplan._search.predict.lookups import lookup_notes
from meshplan._search.predict.profiles import HardwareProfile
from meshplan._search.predict.reshard import batch_first, reshard_collectives
from meshplan._search.predict.trace import Carried, Dot, Names, Workload, dedupe, dot_out_names
from meshplan._spmd.rules import (
    LogicalRules,
    logical_to_mesh_axes,
    mesh_axes_of,
    normalize_rules,
    split_axes,
)

__all__ = ["Cost", "predict", "predict_specs"]

Spec = tuple[tuple[str, ...], ...]


@dataclasses.dataclass
class Cost:
    """One candidate's prediction (seconds per step; bytes per device).

    ``comm_s``: the exposed communication (what compute does not hide); ``comm_total_s``:
    all of it; ``comm_bytes``: operand bytes by collective kind (as the HLO counts them);
    ``comm_by_axis``: the same by mesh axis group (``'data'``, ``'data+tensor'``);
    ``state_bytes``: parameters and optimizer state; ``batch_bytes``: the batch;
    ``activation_bytes``: values kept across layers at the peak (residuals for the
    backward pass, gradients); ``temporary_bytes``: the rest of the peak (the layer
    being computed, gathered weights, the optimizer update); ``accumulator_bytes``: the
    gradients accumulated over microbatches (:func:`predict`'s ``microbatches``);
    ``unpriced``: the primitives
    the planner does not understand, each ``'primitive at where (n runs)'``, priced
    conservatively (outputs replicated, declared FLOPs on every device): the prediction is
    an upper bound there; ``notes``: what the layout does that a user would not expect
    (an embedding lookup whose table's split XLA carries into the layers:
    :mod:`meshplan._search.predict.lookups`), each naming where and the fix;
    ``meeting_devices``: the devices of the largest group that a collective the step waits
    for meets (an activation's all-reduce, gather or all-to-all; not the weights' gathers
    and gradients' reductions, which can run beside compute); 1: none;
    ``first_touch_s``: of ``memory_s``, the seconds the step's temporaries cost as new
    memory (the profile's ``fresh_bytes`` and ``first_touch_s``: XLA:CPU's from 32 MiB a
    device); 0: none.
    """

    step_s: float
    compute_s: float
    memory_s: float
    comm_s: float
    flops_per_device: float
    comm_bytes: dict[str, int]
    comm_by_axis: dict[str, int]
    state_bytes: int
    activation_bytes: int
    collectives: int
    temporary_bytes: int = 0
    batch_bytes: int = 0
    comm_total_s: float = 0.0
    accumulator_bytes: int = 0
    unpriced: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    meeting_devices: int = 1
    first_touch_s: float = 0.0

    @property
    def memory_bytes(self) -> int:
        """State, batch, activations, temporaries and the gradient accumulator (with
        microbatches): the peak on one device."""
        return (
            self.state_bytes
            + self.batch_bytes
            + self.activation_bytes
            + self.temporary_bytes
            + self.accumulator_bytes
        )

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "memory_bytes": self.memory_bytes}


Resolved = dict[tuple[Names, tuple[Any, ...]], tuple[tuple[str, ...], ...]]
"""Mesh axes per dimension by ``(names, the rules that name one of them)``: what an array's
resolution depends on (rules naming none of its names are skipped), shared by candidates."""


class _Specs:
    """Mesh axes (of size > 1) per dimension of an array named ``names``, cached per
    candidate: the one resolver's answer (:func:`meshplan._spmd.rules.split_axes`).

    ``shared``: resolutions shared across the candidates of a search (:data:`Resolved`):
    the same answer, asked once per array and set of rules that name it. ``by_rules``:
    the answers of the candidates with the same rules (``{names: spec}``), shared where
    every axis the rules name splits (then the sizes do not change them); ``splits``:
    whether every axis does, where the caller knows."""

    def __init__(
        self,
        sizes: Mapping[str, int],
        rules: LogicalRules,
        shared: Resolved | None = None,
        normal: bool = False,
        by_rules: dict[Names, Spec] | None = None,
        splits: bool | None = None,
    ) -> None:
        # ``normal``: ``rules`` are pairs already (the search's generated candidates).
        self.sizes = sizes
        self.rules = rules if normal else normalize_rules(rules)
        self.bytes_cache: dict[tuple[Any, ...], int] = {}
        self.shared = shared
        # Every axis a rule names is in the mesh with a size above 1.
        self.every_axis_splits = (
            splits
            if splits is not None
            else all(sizes.get(a, 1) > 1 for _, axes in self.rules for a in mesh_axes_of(axes))
        )
        self.cache: dict[Names, Spec] = (
            by_rules if by_rules is not None and self.every_axis_splits else {}
        )
        self.state_of: Workload | None = None  # the workload ``state_total`` is of
        self.state_total: int | None = None

    def __call__(self, names: Names | None, ndim: int) -> Spec:
        if names is None:
            return ((),) * ndim
        spec = self.cache.get(names)
        if spec is None and any(isinstance(n, Carried) for n in names):
            spec = self.cache[names] = self._carried(names, ndim)
        if spec is None:
            if self.shared is None:
                spec = split_axes(names, self.rules, self.sizes)
            else:
                relevant = tuple(r for r in self.rules if r[0] in names)
                key = (names, relevant)
                axes = self.shared.get(key)
                if axes is None:
                    spec_all = logical_to_mesh_axes(names, relevant)
                    axes = self.shared[key] = tuple(mesh_axes_of(e) for e in spec_all)
                if self.every_axis_splits:  # nothing to drop (a generated candidate's rules)
                    spec = axes
                else:
                    sizes = self.sizes
                    spec = tuple(tuple(a for a in d if sizes.get(a, 1) > 1) for d in axes)
            self.cache[names] = spec
        return spec

    def _carried(self, names: Names, ndim: int) -> Spec:
        """A value made where an embedding table (or a weight) lies (:class:`Carried`): its
        other names resolved, its batch whole. XLA gives the rows the table's sharding,
        which is replicated over the batch's other axes too: with the batch over ``fsdp``
        and ``data`` and the table's ``embed`` over ``fsdp`` alone, every device holds the
        whole batch (GPT-Neo's step, compiled). Where the table's names take none of the
        batch's axes, resolved as a plain batch."""
        batch = set(self(("batch",), 1)[0])
        carriers = [n for n in names if isinstance(n, Carried)]
        if not any(batch & {a for d in self(n.by, len(n.by)) for a in d} for n in carriers):
            return self(tuple("batch" if isinstance(n, Carried) else n for n in names), ndim)
        return self(tuple(None if isinstance(n, Carried) else n for n in names), ndim)

    def split(self, spec: Spec) -> int:
        return math.prod(self.sizes[a] for axes in spec for a in axes)

    def shard_bytes(self, names: Names | None, shape: tuple[int, ...], item: int) -> int:
        """Bytes of one device's shard (rounded up per dimension)."""
        key = (names, shape, item)
        got = self.bytes_cache.get(key)
        if got is None:
            got, sizes = item, self.sizes
            for s, axes in zip(shape, self(names, len(shape)), strict=True):
                split = 1
                for a in axes:
                    split *= sizes[a]
                got *= -(-s // split)
            self.bytes_cache[key] = got
        return got


Coll = tuple[str, tuple[str, ...], int, Any]


def _dot_cost(
    dot: Dot,
    specs: _Specs,
    reduce_scatter: bool = False,
    params: frozenset[str] = frozenset(),
    backward: bool = True,
) -> tuple[float, list[Coll], int]:
    """Per-device FLOPs, the collectives ``(kind, axes, bytes, key)``, output bytes per device.

    ``key``: for an all-gather, the gathered array's (names, shape, axes): XLA gathers an
    array once per pass and reuses it (the rematerialised forward shares the backward's).
    ``backward``: the matmul runs in the backward pass (:func:`_batch_moved`)."""
    sizes = specs.sizes
    ls, rs = specs(dot.lhs_names, len(dot.lhs_shape)), specs(dot.rhs_names, len(dot.rhs_shape))
    (lc, rc), (lb, rb) = dot.contract, dot.batch
    carried = _carried_input(dot, specs, ls)
    if carried is not None:
        ls = specs(carried[0], len(dot.lhs_shape))
    used: set[str] = set()
    gather: dict[tuple[int, str], None] = {}
    out_axes: list[str] = []

    def take(axes: tuple[str, ...], side: int) -> None:
        for a in axes:
            if a in used:
                gather[(side, a)] = None
            else:
                used.add(a)
                out_axes.append(a)

    for i, j in zip(lb, rb, strict=True):
        take(ls[i] or rs[j], 0 if ls[i] else 1)
        if ls[i] and rs[j] and ls[i] != rs[j]:
            for a in rs[j]:
                gather[(1, a)] = None
    free = [(0, ls, lc, lb), (1, rs, rc, rb)]
    if _right_first(dot, params):
        free.reverse()
    for side, spec, contract, batch in free:
        for i in range(len(spec)):
            if i not in contract and i not in batch:
                take(spec[i], side)
    reduce: list[str] = []
    contract_used: dict[str, list[int]] = {}
    for i, j in zip(lc, rc, strict=True):
        for a in dict.fromkeys((*ls[i], *rs[j])):
            if a in used:
                sides = [s for s, spec in ((0, ls[i]), (1, rs[j])) if a in spec]
                contract_used.setdefault(a, []).extend(sides)
            else:
                used.add(a)
                reduce.append(a)
    out_elems = dot.flops // 2 // max(1, math.prod(dot.lhs_shape[i] for i in lc))
    out_bytes = out_elems * dot.itemsize // max(1, math.prod(sizes[a] for a in out_axes))
    shard = (
        (dot.lhs_size or math.prod(dot.lhs_shape)) * dot.lhs_itemsize // specs.split(ls),
        math.prod(dot.rhs_shape) * dot.rhs_itemsize // specs.split(rs),
    )
    scatter: list[str] = []
    whole: list[str] = []
    # an activation's output: its operand gathered, once per pass for every matmul reading it
    weight_out = not _batch_out(dot)
    for a, sides in contract_used.items():
        n = sizes[a]
        gathered = sum(shard[s] for s in set(sides)) * (n - 1)
        if reduce_scatter and weight_out and a in out_axes and out_bytes * (n - 1) < gathered:
            scatter.append(a)  # partial sums over ``a``, reduce-scattered into the output
        elif (
            not reduce_scatter
            and weight_out
            and a in out_axes
            and (len(set(sides)) > 1 or out_bytes * n <= gathered)
        ):  # one operand split there: gathered where that moves fewer bytes (an MLP's
            whole.append(a)  # gradient); partial sums of the whole output all-reduced, sliced
        else:
            for side in set(sides):
                gather[(side, a)] = None
    split = math.prod(sizes[a] for a in used)
    flops = dot.flops / split
    colls: list[Coll] = []
    if reduce_scatter and reduce and dot.out_names is not None:
        # partial sums flowing into a constraint that shards the output over their axes:
        # reduce-scattered into its shards (Megatron's sequence parallelism), the
        # unreduced output the operand, as an all-reduce's (and no slice after)
        into = {a for axes in specs(dot.out_names, len(dot.out_names)) for a in axes}
        if into_scatter := tuple(a for a in reduce if a in into):
            colls.append(("reduce-scatter", into_scatter, out_bytes, None))
            reduce = [a for a in reduce if a not in into]
    if reduce:
        colls.append(("all-reduce", tuple(reduce), out_bytes, None))
    if scatter:
        n = math.prod(sizes[a] for a in scatter)
        colls.append(("reduce-scatter", tuple(scatter), out_bytes * n, None))
    if whole:  # a backend without reduce-scatters (XLA on CPU): an all-reduce of it whole
        n = math.prod(sizes[a] for a in whole)
        colls.append(("all-reduce", tuple(whole), out_bytes * n, None))
    if carried is not None:  # its input gathered whole, its output made in the table's split
        colls.append(
            (
                "all-gather",
                carried[1],
                shard[0] // math.prod(sizes[a] for a in carried[1]),
                (dot.lhs_names, dot.lhs_shape, carried[1]),
            )
        )
    for side in (0, 1):
        axes = tuple(a for s, a in gather if s == side)
        if not axes:
            continue
        if (
            backward
            and not any(isinstance(n, Carried) for n in dot.out_names or ())
            and (moved := _batch_moved(dot, side, (ls, rs)[side], axes, out_axes))
        ):
            colls.append(("all-to-all", moved, out_bytes, None))
        shape = dot.lhs_shape if side == 0 else dot.rhs_shape
        names = dot.lhs_names if side == 0 else dot.rhs_names
        if idle := _idle_permute(specs, (ls, rs), axes, shard[side]):
            colls.append(("collective-permute", *idle, (names, shape, axes, "permute")))
        colls.append(("all-gather", axes, shard[side], (names, shape, axes)))
    return flops, colls, out_bytes


def _idle_permute(
    specs: _Specs, operands: tuple[Spec, Spec], axes: tuple[str, ...], shard: int
) -> tuple[tuple[str, ...], int] | None:
    """Where an operand's gather over ``axes`` meets mesh axes neither operand uses (idle)
    that together have at least as many devices, XLA first moves the operand's pieces onto
    the idle axes (a collective-permute of ``shard`` spread over them), then gathers over
    them: the idle axes and the bytes each device sends, or ``None``.

    Read in compiled programs (``tests/search/test_cost.py``): ``x[batch: data] @ w[None,
    embed: data]`` on a 2 x 4 mesh (data, model) permutes before the gather, and a weight's
    gradient is permuted back to its shard after its all-reduce (:func:`_predict_one`
    prices both); on 4 x 2, none."""
    idle = _idle_axes(specs.sizes, *operands)
    spread = math.prod(specs.sizes[a] for a in idle)
    need = math.prod(specs.sizes[a] for a in axes)
    if not idle or spread < need:
        return None
    return idle, shard * need // spread


def _idle_axes(sizes: Mapping[str, int], *specs: Sequence[tuple[str, ...]]) -> tuple[str, ...]:
    """The mesh axes of more than one device that none of ``specs`` uses, in mesh order."""
    taken = {a for spec in specs for d in spec for a in d}
    return tuple(a for a, n in sizes.items() if n > 1 and a not in taken)


def _beside_a_table(specs: _Specs, after: Names, src: Sequence[tuple[str, ...]], dst: Spec) -> bool:
    """Whether a lookup's indices, gathered to make its rows where the table lies
    (:class:`Carried`), are moved first: XLA permutes them where the mesh has an axis of
    more than one device besides theirs (compiled: ``s32[8, 32, 1]`` on 2 x 4 and 4 x 2
    meshes, none on 8; ``tests/search/test_cost.py``)."""
    return any(isinstance(n, Carried) for n in after) and bool(_idle_axes(specs.sizes, src, dst))


def _carried_input(dot: Dot, specs: _Specs, ls: Spec) -> tuple[Names, tuple[str, ...]] | None:
    """Where a matmul's output is made in a table's split (its ``out_names`` carry
    :class:`Carried`: a projection summed into the residual stream after an FSDP embedding
    lookup), its left operand's names with that batch, and the axes its batch loses (the
    operand gathered over them)."""
    out = dot.out_names
    carrier = next((n for n in out or () if isinstance(n, Carried)), None)
    if carrier is None or any(isinstance(n, Carried) for n in dot.lhs_names):
        return None
    names = tuple(carrier if n == "batch" else n for n in dot.lhs_names)
    spec = specs(names, len(names))
    lost = tuple(a for old, new in zip(ls, spec, strict=True) for a in old if a not in new)
    return (names, lost) if lost else None


def _batch_moved(
    dot: Dot, side: int, spec: Spec, axes: tuple[str, ...], out_axes: list[str]
) -> tuple[str, ...]:
    """The axes an activation's matmul output is moved back to its batch over: where the
    operand holding ``'batch'`` (a free dimension) is gathered over axes the other operand's
    free dimension keeps (a small gradient times a large weight split over the batch's
    axes: the head's backward under FSDP), the output is made split as the weight is, and
    XLA all-to-alls it to the batch's sharding that its consumers use: the rest of the
    backward pass, which reads the forward's values split by the batch. Asked of the
    backward's matmuls only: a forward output made so (an FSDP MLP's last projection into
    its loss, read from its compiled HLO: the input all-gathered f32[64,4096], the output
    f32[64,128]) is used in the weight's split, by the loss and its cotangent, not moved."""
    names = dot.lhs_names if side == 0 else dot.rhs_names
    contract = dot.contract[side]
    held = {a for i, n in enumerate(names) if n == "batch" and i not in contract for a in spec[i]}
    return tuple(a for a in axes if a in held and a in out_axes)


StateCounts = dict[tuple[Names | None, tuple[int, ...], int], int]
"""The state's arrays ``(names, shape, itemsize)`` and how many of each (a parameter, its
optimizer moments): :func:`state_counts`."""


def state_counts(workload: Workload) -> StateCounts:
    """How many of each ``(names, shape, itemsize)`` the state holds."""
    counts: StateCounts = {}
    for array in workload.state:
        counts[array] = counts.get(array, 0) + 1
    return counts


def _right_first(dot: Dot, params: frozenset[str]) -> bool:
    """Whether the right operand's free dimensions keep their mesh axes before the left's,
    where both claim one axis (the other operand is gathered over it): a weight's gradient
    (no ``'batch'`` in its output) is made in its parameter's sharding, which XLA's sharding
    propagation brings back from the parameter, so the operand whose free dimensions carry
    a parameter's names (``params``) keeps its axes; otherwise the larger operand does, and
    the smaller is gathered (fewer bytes moved and held)."""
    (lc, rc), (lb, rb) = dot.contract, dot.batch
    if not _batch_out(dot):
        left = any(n in params for i, n in enumerate(dot.lhs_names) if i not in lc and i not in lb)
        right = any(n in params for j, n in enumerate(dot.rhs_names) if j not in rc and j not in rb)
        if left != right:
            return right
    return math.prod(dot.lhs_shape) * dot.lhs_itemsize < math.prod(dot.rhs_shape) * dot.rhs_itemsize


def _out_array(dot: Dot) -> tuple[Names, tuple[int, ...], int]:
    """A matmul's output: its names (the constraint's where one names it, else as the
    trace names it: :func:`meshplan._search.predict.trace.dot_out_names`), shape, item size."""
    (lc, rc), (lb, rb) = dot.contract, dot.batch
    shape = (
        *(dot.lhs_shape[i] for i in lb),
        *(dot.lhs_shape[i] for i in range(len(dot.lhs_shape)) if i not in lc and i not in lb),
        *(dot.rhs_shape[j] for j in range(len(dot.rhs_shape)) if j not in rc and j not in rb),
    )
    if dot.out_names:
        names = dedupe(dot.out_names)
    else:
        names = dot_out_names(dot.lhs_names, dot.rhs_names, dot.contract, dot.batch)
    return names, shape, dot.itemsize


def state_bytes(workload: Workload, specs: _Specs, counts: StateCounts | None = None) -> int:
    """Per-device bytes of the state (shards rounded up, as ``explain`` counts them); asked
    once per candidate (the search asks before pricing, then :func:`predict_specs`).
    ``counts``: :func:`state_counts` of ``workload``, found once by a search."""
    if specs.state_total is None or specs.state_of is not workload:
        counts = counts if counts is not None else state_counts(workload)
        specs.state_of = workload
        specs.state_total = sum(n * specs.shard_bytes(*array) for array, n in counts.items())
    return specs.state_total


def _independent(kind: str, key: Any, dot: Dot) -> bool:
    """A collective no later op of its layer waits for: a weight's gather, a weight
    gradient's reduction (arrays without ``'batch'``)."""
    if kind == "all-gather":
        return "batch" not in (key[0] or ())
    return not _batch_out(dot)


def _batch_out(dot: Dot) -> bool:
    (lc, rc) = dot.contract
    keep = [n for i, n in enumerate(dot.lhs_names) if i not in lc]
    keep += [n for j, n in enumerate(dot.rhs_names) if j not in rc and j not in dot.batch[1]]
    return "batch" in keep


DotCache = dict[tuple[Any, ...], tuple[float, list[Coll], int]]
""":func:`_dot_cost` answers across candidates, keyed by what they depend on: the matmul, its
operands' mesh axes and those axes' sizes (:func:`_dot_key`)."""


def _dot_key(
    dot: Dot,
    specs: _Specs,
    reduce_scatter: bool,
    params: frozenset[str] = frozenset(),
    backward: bool = True,
) -> tuple[Any, ...]:
    """Everything :func:`_dot_cost` reads: the operands' specs, the spec of the constraint its
    output flows into (it decides a reduce-scatter), and the sizes of their axes."""
    ls, rs = specs(dot.lhs_names, len(dot.lhs_shape)), specs(dot.rhs_names, len(dot.rhs_shape))
    into = () if dot.out_names is None else specs(dot.out_names, len(dot.out_names))
    sizes = specs.sizes
    axes = tuple(sorted({a for spec in (ls, rs, into) for d in spec for a in d}))
    idle = tuple((a, sizes[a]) for a in _idle_axes(sizes, ls, rs, into))  # _idle_permute's
    key = (dot, ls, rs, into, tuple(sizes[a] for a in axes), axes, reduce_scatter, params, idle)
    return (*key, backward)


def _dot_cost_cached(
    dot: Dot,
    specs: _Specs,
    reduce_scatter: bool,
    cache: DotCache | None,
    params: frozenset[str] = frozenset(),
    backward: bool = True,
) -> tuple[float, list[Coll], int]:
    if cache is None:
        return _dot_cost(dot, specs, reduce_scatter, params, backward)
    key = _dot_key(dot, specs, reduce_scatter, params, backward)
    got = cache.get(key)
    if got is None:
        got = cache[key] = _dot_cost(dot, specs, reduce_scatter, params, backward)
    return got


def predict(
    workload: Workload,
    mesh: Mapping[str, int],
    rules: LogicalRules,
    profile: HardwareProfile,
    *,
    microbatches: int = 1,
) -> Cost:
    """The predicted step time and per-device bytes of ``workload`` on ``mesh`` under ``rules``.

    ``microbatches``: the step accumulates the gradients of this many runs of ``workload``
    (traced at one microbatch): compute, memory traffic and the collectives run once per
    microbatch (FSDP gathers the weights and reduces the gradients into their shards per
    microbatch), but for the reductions of weight gradients replicated over the reduced
    axes (accumulated whole, then reduced once, as DDP and Megatron do); the activations are one microbatch's, and the
    gradients are accumulated in the parameters' sharding (``Cost.accumulator_bytes``).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.predict.trace import trace_workload
        >>> from meshplan._search.predict.cost import predict
        >>> from meshplan._search.predict.profiles import get_profile
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((512, 512), jnp.float32), ("embed", "mlp"))
        >>> def step(state, x):
        ...     return jax.grad(lambda w: ((x @ w) ** 2).sum())(state["w"].value)
        >>> work = trace_workload(step, {"w": w}, jax.ShapeDtypeStruct((64, 512), jnp.float32))
        >>> dp = predict(work, {"data": 8}, (("batch", "data"),), get_profile("h100"))
        >>> dp.comm_bytes                # the weight gradient, all-reduced over data
        {'all-reduce': 1048576}
        >>> tp = predict(work, {"tensor": 8}, (("mlp", "tensor"),), get_profile("h100"))
        >>> tp.comm_bytes, tp.flops_per_device == dp.flops_per_device == work.flops / 8
        ({}, True)
        >>> four = predict(work, {"data": 8}, (("batch", "data"),), get_profile("h100"), microbatches=4)
        >>> four.comm_bytes, four.accumulator_bytes        # reduced once; one f32 gradient
        ({'all-reduce': 1048576}, 1048576)
        >>> round(four.compute_s / dp.compute_s, 6)
        4.0
    """
    return predict_specs(workload, _Specs(mesh, rules), profile, microbatches=microbatches)


def predict_specs(
    workload: Workload,
    specs: _Specs,
    profile: HardwareProfile,
    cache: DotCache | None = None,
    microbatches: int = 1,
) -> Cost:
    """:func:`predict` of a candidate's resolved specs; ``cache``: matmul costs shared by the
    candidates of one search (the same answers as without it, computed once)."""
    return _predict_one(workload, specs, profile, cache, max(1, microbatches))


def _sharded_over(specs: _Specs, dot: Dot, axes: tuple[str, ...]) -> bool:
    """Whether a weight gradient's array is split over some of ``axes``, the axes it is
    reduced over: FSDP accumulates it in its shard, reduced per microbatch; a replicated
    one (DDP) is accumulated whole and reduced once a step."""
    names, shape, _ = _out_array(dot)
    return any(a in axes for d in specs(names, len(shape)) for a in d)


def _accumulator_bytes(workload: Workload, specs: _Specs) -> int:
    """The gradients accumulated over microbatches: what the weight-gradient matmuls
    (outputs without ``'batch'``) produce, in their sharding."""
    return sum(
        specs.shard_bytes(*_out_array(dot)) * count
        for dot, count in workload.dots.items()
        if not _batch_out(dot)
    )


def _matmul_seconds(arithmetic_s: float, bytes_s: float, profile: HardwareProfile) -> float:
    """A matmul's seconds on one device: its arithmetic's and its bytes' (operands read, output
    written), overlapped (the roofline's larger) or one after the other
    (:attr:`HardwareProfile.matmul_bytes_serial`).

    Example:
        >>> import dataclasses
        >>> from meshplan._search.predict.profiles import get_profile
        >>> h100 = get_profile("h100")
        >>> serial = dataclasses.replace(h100, matmul_bytes_serial=True)
        >>> _matmul_seconds(2.0, 1.0, h100), _matmul_seconds(2.0, 1.0, serial)
        (2.0, 3.0)
    """
    if profile.matmul_bytes_serial:
        return arithmetic_s + bytes_s
    return max(arithmetic_s, bytes_s)


def _predict_one(
    workload: Workload,
    specs: _Specs,
    profile: HardwareProfile,
    cache: DotCache | None,
    micro: int,
) -> Cost:
    """:func:`predict_specs` of a step of ``micro`` runs of ``workload`` (microbatches):
    everything but the weight gradients' all-reduces (accumulated, then reduced once, as
    DDP and Megatron do) runs once per microbatch."""
    sizes = specs.sizes
    eff_flops = profile.peak_flops * profile.matmul_efficiency
    fused = profile.fused_attention
    flops, compute_s = 0.0, 0.0
    by_kind: dict[str, int] = {}
    by_axis: dict[str, int] = {}
    gathers: dict[Any, list[Any]] = {}  # key -> [kind, axes, bytes, count, dots, trips]
    dependent: list[tuple[str, tuple[str, ...], int, int]] = []
    independent: dict[tuple[str, tuple[str, ...], int], list[int]] = {}  # [bytes, runs]
    once: set[tuple[str, tuple[str, ...], int]] = set()  # reductions a step makes once
    gathered_extra: dict[Dot, dict[Any, int]] = {}
    unreduced: dict[Dot, int] = {}  # a weight gradient's partial sums beyond its shard
    summed: dict[Dot, int] = {}  # an activation's partial sums beyond its shard
    results: dict[Dot, int] = {}  # a weight gradient's all-reduced copy
    partial_sums: set[Dot] = set()  # activations all-reduced (a tensor-parallel projection)
    params = frozenset(workload.param_names)
    read: dict[Any, set[int]] = {}  # an activation's gather key: the arrays gathered
    relaid = 0  # XLA:CPU: gathered arrays copied into the reading matmul's layout (bytes)
    scores = [0.0, 0.0]  # fused attention's seconds per device: [producing, reading] scores
    for dot, count in workload.dots.items():
        trips = workload.trips(dot)  # runs in sequence; count / trips appear side by side
        moved_back = dot in workload.backward_dots and not workload.kept_whole
        f, colls, out_bytes = _dot_cost_cached(
            dot, specs, profile.reduce_scatter, cache, params, moved_back
        )
        flops += f * count
        score = fused and dot in workload.score_dots
        if score:  # one flash kernel: its efficiency, masked blocks skipped (attention.py)
            run = f * count * _causal(dot, workload, profile) / _attention_flops(dot, profile)
            scores[0 if attention.produces_scores(dot) else 1] += run
            compute_s += run
        else:
            moved = (
                _lhs_bytes(dot, specs)
                + specs.shard_bytes(dot.rhs_names, dot.rhs_shape, dot.rhs_itemsize)
                + out_bytes
            )
            bytes_s = moved / profile.memory_bandwidth
            compute_s += count * _matmul_seconds(f / eff_flops, bytes_s, profile)
        extra: dict[Any, int] = {}  # gathered arrays: the bytes each adds on a device
        for kind, axes, nbytes, key in colls:
            if key is not None:
                g = gathers.setdefault(key, [kind, axes, nbytes, 0, 0, 0])
                g[3] = max(g[3], count)
                g[4] += 1
                g[5] = max(g[5], trips)
                if kind != "all-gather":  # a permute before a weight's gather adds nothing
                    continue
                extra[key] = nbytes * (math.prod(sizes[a] for a in axes) - 1)
                if profile.fusion_reads:
                    relaid += count * relayout_bytes(specs, key, nbytes)
                if workload.arrays and "batch" in (key[0] or ()):
                    for side, (names, shape) in enumerate(
                        ((dot.lhs_names, dot.lhs_shape), (dot.rhs_names, dot.rhs_shape))
                    ):
                        if (names, shape) == key[:2]:
                            read.setdefault(key, set()).update(
                                workload.operand_arrays.get((dot, side), ())
                            )
            elif kind == "all-reduce" and _batch_out(dot):
                partial_sums.add(dot)
                dependent.append((kind, axes, nbytes, count))
                # partial sums of more than its shard (of the whole batch, where the operand
                # carries a table's split: Carried), all-reduced, then sliced to it
                kept = specs.shard_bytes(*_out_array(dot))
                if nbytes > kept:  # reduced as it is made: never held for a combined one
                    summed[dot] = summed.get(dot, 0) + nbytes - kept
            elif _independent(kind, key, dot):  # combined with those of the same trips
                if kind == "reduce-scatter":  # the partial sums beyond its reduced shard
                    kept = specs.shard_bytes(*_out_array(dot))
                    unreduced[dot] = unreduced.get(dot, 0) + max(0, nbytes - kept)
                elif kind == "all-reduce":
                    kept = specs.shard_bytes(*_out_array(dot))
                    unreduced[dot] = unreduced.get(dot, 0) + max(0, nbytes - kept)
                    if not profile.reduce_scatter:  # XLA on CPU: its result a buffer of
                        results[dot] = results.get(dot, 0) + nbytes  # its own (measured)
                if micro > 1 and not _sharded_over(specs, dot, axes):  # DDP: once a step
                    kind = f"{kind} once"
                    once.add((kind, axes, trips))
                ind = independent.setdefault((kind, axes, trips), [0, 0])
                ind[0] += nbytes * count
                ind[1] += count
            else:
                dependent.append((kind, axes, nbytes, count))
        gathered_extra[dot] = extra
    compute_s += attention.flash_recompute(*scores)  # the backward's q·kᵀ (linear: seconds)
    for (before, after, shape, item), count in workload.reshards.items():
        nbytes = specs.shard_bytes(before, shape, item)  # a constraint that moves axes
        order = batch_first(before)
        taken = specs(tuple(before[i] for i in order), len(shape))
        src = [taken[order.index(i)] for i in range(len(shape))]
        dst = specs(after, len(shape))
        for kind, axes in reshard_collectives(src, dst):
            if kind == "all-gather" and _beside_a_table(specs, after, src, dst):
                dependent.append(("collective-permute", axes, nbytes, count))
            dependent.append((kind, axes, nbytes, count))
    for (made, used, shape, item), count in workload.moves.items():
        nbytes = specs.shard_bytes(made, shape, item)  # rows moved between shardings
        for kind, axes in reshard_collectives(specs(made, len(shape)), specs(used, len(shape))):
            if kind == "all-to-all":
                dependent.append((kind, axes, nbytes, count))
    for key, count in workload.reductions.items():  # partial results over a split dimension
        axes, nbytes = _reduced_over(specs, *key)
        if axes:
            dependent.append(("all-reduce", axes, nbytes, count))
    for key, count in workload.realigned.items():  # a split dimension cut: pieces moved
        axes, nbytes, shifts = _pieces_moved(specs, *key)
        if shifts:  # one permute per piece and distance moved, its share of the bytes
            dependent.append(("collective-permute", axes, nbytes // shifts, count * shifts))
    for key, (kind, axes, nbytes, count, ndots, trips) in gathers.items():
        passes = min(2, ndots) if profile.regather else 1  # forward, again for the backward
        activation = "batch" in (key[0] or ())
        if kind == "collective-permute" and not activation:
            passes = 2  # the weight's, then its gradient's shard back
        if kind == "collective-permute" and activation:
            dependent.append((kind, axes, nbytes, count * passes))
        elif activation:
            if key in read:  # each array once per pass (again for the backward: regather)
                arrays = [workload.arrays[i] for i in read[key]]
                count, passes = sum(t * _gathers(profile, *rest) for t, *rest in arrays), 1
            dependent.append((kind, axes, nbytes, count * passes))
        else:
            ind = independent.setdefault((kind, axes, trips * passes), [0, 0])
            ind[0] += nbytes * count * passes
            ind[1] += count * passes
    for names, shape, item, act, trips, both, _ in workload.weight_reads:
        axes = _weight_gather_axes(specs, names, len(shape), act)
        if axes:  # gathered where the op reads it, again for the backward (regather)
            passes = 2 if profile.regather and both else 1
            ind = independent.setdefault(("all-gather", axes, trips * passes), [0, 0])
            ind[0] += specs.shard_bytes(names, shape, item) * trips * passes
            ind[1] += trips * passes
    also = _summed_with(workload, specs, independent) if profile.array_latency_s else {}
    n_coll, exposed, hidden = 0, 0.0, 0.0
    for kind, axes, nbytes, count in dependent:
        exposed += micro * count * collective_time(profile, kind, sizes, axes, nbytes)
        n_coll += micro * count
        _tally(by_kind, by_axis, kind, axes, micro * nbytes * count)
    for (kind, axes, count), (nbytes, runs) in independent.items():  # count: runs in sequence
        # per microbatch but replicated gradients' reductions (accumulated, reduced once)
        reps = 1 if (kind, axes, count) in once else micro
        summed_too = also.get((kind, axes, count), 0)  # norm scales', biases' gradients
        kind = kind.removesuffix(" once")
        per_run = nbytes / count if count else nbytes
        n_arrays = max(1, round(runs / count)) if count else runs
        if kind != "all-reduce" and not profile.combines_gathers:  # one per array
            groups = n_arrays
        elif profile.combine_bytes:  # small arrays merged up to the threshold, never split
            groups = max(1, min(n_arrays, math.ceil(per_run / profile.combine_bytes)))
        else:
            groups = 0
        if groups:  # one latency per group, the bandwidth term for all the bytes
            t = count * groups * collective_time(profile, kind, sizes, axes, per_run / groups)
            n_coll += reps * count * groups
        else:
            t = count * collective_time(profile, kind, sizes, axes, per_run)
            n_coll += reps * count
        if profile.array_latency_s:  # each array of a combined one meets the group again
            carried = n_arrays + summed_too
            t += count * (carried - max(1, groups)) * array_latency(profile, sizes, axes)
        hidden += reps * t
        _tally(by_kind, by_axis, kind, axes, int(reps * nbytes))
    traffic = 0
    reads = workload.fusion_reads if profile.fusion_reads else {}  # what fusions read
    for cells in (workload.traffic, reads):
        for (names, shape, score), nbytes in cells.items():
            if not (fused and score):
                traffic += nbytes // specs.split(specs(names, len(shape)))
    traffic += relaid
    memory_s = micro * traffic / profile.memory_bandwidth
    compute_s, flops = compute_s * micro, flops * micro
    flops += micro * workload.unpriced_flops  # whole on every device: not split
    compute_s += micro * workload.unpriced_flops / eff_flops
    covered = profile.overlap * (compute_s + memory_s)  # what compute can hide
    comm_s = exposed + max(0.0, hidden - covered) + profile.overlap_cost * min(hidden, covered)
    peak = _peak(workload, specs, profile, gathered_extra, unreduced, partial_sums, results, summed)
    activations = peak.activations + (
        held_broadcasts(workload, specs) if profile.holds_broadcasts else 0
    )
    accumulator = _accumulator_bytes(workload, specs) if micro > 1 else 0
    touched = first_touch(profile, activations + peak.temporaries + accumulator)
    memory_s += touched
    batch_bytes = micro * sum(specs.shard_bytes(n, s, i) for n, s, i in workload.batch_state)
    return Cost(
        step_s=compute_s + memory_s + comm_s,
        compute_s=compute_s,
        memory_s=memory_s,
        comm_s=comm_s,
        flops_per_device=flops,
        comm_bytes=by_kind,
        comm_by_axis=by_axis,
        state_bytes=state_bytes(workload, specs),
        activation_bytes=activations,
        collectives=n_coll,
        temporary_bytes=peak.temporaries,
        batch_bytes=batch_bytes,
        comm_total_s=exposed + hidden,
        accumulator_bytes=accumulator,
        unpriced=tuple(f"{p} at {w} ({n} runs)" for (p, w), n in workload.unpriced.items()),
        notes=lookup_notes(workload, specs),
        meeting_devices=max(
            (math.prod(sizes[a] for a in axes) for _, axes, _, n in dependent if n), default=1
        ),
        first_touch_s=touched,
    )


def held_broadcasts(workload: Workload, specs: _Specs) -> int:
    """Bytes a device holds of the broadcast operands of the forward pass's outer
    products (``Workload.held_broadcasts``: a norm's ``rsqrt`` and scale at the
    activation's shape), each split as the product is: XLA:CPU's default schedule writes
    them out and keeps them from the forward pass until the backward reads them. They are
    added to the peak's activations: all of them are alive where the forward pass ends.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from meshplan._search.predict.cost import _Specs, held_broadcasts
        >>> from meshplan._search.predict.step import linen_step
        >>> from meshplan._search.predict.trace import trace_workload
        >>> x = jax.ShapeDtypeStruct((8, 16, 32), jnp.float32)
        >>> state, step, batch = linen_step(nn.LayerNorm(), x)
        >>> work = trace_workload(step, state, batch)
        >>> held_broadcasts(work, _Specs({"data": 2}, (("batch", "data"),)))  # 2 x 16 KiB
        16384
    """
    return sum(n * specs.shard_bytes(*key) for key, n in workload.held_broadcasts.items())


def first_touch(profile: HardwareProfile, temporaries: int) -> float:
    """Seconds a step's ``temporaries`` (bytes a device) cost as new memory: all of them
    where they reach the profile's ``fresh_bytes`` (XLA:CPU allocates them as one buffer a
    call, new from the kernel from 32 MiB on), at its ``first_touch_s`` a byte; else 0.

    Example:
        >>> import dataclasses, meshplan
        >>> from meshplan._search.predict.cost import first_touch
        >>> cpu = dataclasses.replace(
        ...     meshplan.get_profile("h100"), fresh_bytes=32 << 20, first_touch_s=2e-9
        ... )
        >>> first_touch(cpu, 24 << 20), round(first_touch(cpu, 40 << 20), 4)
        (0.0, 0.0839)
    """
    if not profile.fresh_bytes or temporaries < profile.fresh_bytes:
        return 0.0
    return temporaries * profile.first_touch_s


def relayout_bytes(specs: _Specs, key: Any, nbytes: int) -> int:
    """Bytes XLA:CPU's copy of a gathered array moves for one matmul that reads it.

    ``key``: the gathered array's ``(names, shape, axes)``, ``nbytes``: one device's shard.
    XLA:CPU gathers into a layout whose outermost dimension is the gathered one (the
    shards then lie one after another); where that is not the array's outermost dimension
    of more than one element, each matmul reading the gathered array reads it through a
    copy into the row-major layout it reads (a loop fusion: the gathered bytes read and
    written); else none.

    Example:
        >>> from meshplan._search.predict.cost import _Specs, relayout_bytes
        >>> specs = _Specs({"data": 4, "tensor": 2}, (("batch", "data"), ("heads", "tensor")))
        >>> names, shape = ("batch", None, "heads", "kv"), (16, 64, 4, 16)
        >>> relayout_bytes(specs, (names, shape, ("tensor",)), 32768)  # heads: 2 * 64 KiB
        131072
        >>> relayout_bytes(specs, (("heads", "kv"), (4, 16), ("tensor",)), 128)  # outermost
        0
    """
    names, shape, axes = key[:3]
    if names is None:
        return 0
    spec = specs(names, len(shape))
    gathered = [i for i, d in enumerate(spec) if any(a in axes for a in d)]
    local = [s // specs.split((d,)) for s, d in zip(shape, spec, strict=True)]
    outer = next((i for i, n in enumerate(local) if n > 1), 0)
    if not gathered or gathered[0] <= outer:
        return 0
    return 2 * nbytes * math.prod(specs.sizes[a] for a in axes)


def _attention_flops(dot: Dot, profile: HardwareProfile) -> float:
    """The FLOP/s a fused attention kernel runs ``dot`` at: ``attention_efficiency`` of the
    peak, in proportion to ``dot``'s head dimension below the profile's
    ``attention_head_dim`` (where the kernels are bound by their scores)."""
    if not profile.attention_efficiency:
        return profile.peak_flops * profile.matmul_efficiency
    efficiency = profile.attention_efficiency
    if profile.attention_head_dim:
        efficiency *= min(1.0, attention.head_dim(dot) / profile.attention_head_dim)
    return profile.peak_flops * efficiency


def _causal(dot: Dot, workload: Workload, profile: HardwareProfile) -> float:
    """The fraction of a fused attention matmul's FLOPs that run: under a causal mask,
    the tiles not wholly masked (:func:`meshplan._search.predict.attention.causal_fraction`)."""
    if not profile.causal_block:
        return 1.0
    mask = attention.is_causal(dot, workload.causal_masks)
    return 1.0 if mask is None else attention.causal_fraction(*mask, profile.causal_block)


def _lhs_bytes(dot: Dot, specs: _Specs) -> int:
    """Bytes of a matmul's left operand on a device: a convolution's input as stored, not
    unfolded (:class:`meshplan._search.predict.trace.Dot`)."""
    got = specs.shard_bytes(dot.lhs_names, dot.lhs_shape, dot.lhs_itemsize)
    if dot.lhs_size is None:
        return got
    return got * dot.lhs_size // max(1, math.prod(dot.lhs_shape))


def _weight_gather_axes(specs: _Specs, names: Names, ndim: int, act: Names) -> tuple[str, ...]:
    """The mesh axes a parameter read by an elementwise op with an activation named ``act``
    is gathered over: those splitting one of its dimensions that do not split the
    activation's dimension of that name (a norm's ``embed`` scale under FSDP, where
    ``batch`` took the axis; none under tensor parallelism's split ``embed``)."""
    own = specs(names, ndim)
    other = dict(zip(act, specs(act, len(act)), strict=True))
    out: list[str] = []
    for name, axes in zip(names, own, strict=True):
        out += [a for a in axes if a not in other.get(name, ()) and a not in out]
    return tuple(a for a in specs.sizes if a in out)


def _gathers(profile: HardwareProfile, both: bool, named: bool) -> int:
    """How many times an activation read by matmuls of ``both`` passes or one is gathered:
    again for the backward pass where the profile regathers, or where no logical
    constraint ``named`` it and the backend gathers such an array again."""
    again = profile.regather or (profile.regathers_unnamed and not named)
    return 2 if both and again else 1


def _summed_with(
    workload: Workload,
    specs: _Specs,
    independent: Mapping[tuple[str, tuple[str, ...], int], Any],
) -> dict[tuple[str, tuple[str, ...], int], int]:
    """The parameters read by elementwise ops (a norm's scale, a bias) whose gradients
    join the matmuls' combined all-reduce of the same axes and trips: how many per run.

    Their gradients are sums over the activation's dimensions the parameter has not (the
    batch, the sequence), so their partial sums are all-reduced over the axes splitting
    those."""
    also: dict[tuple[str, tuple[str, ...], int], int] = {}
    for names, _, _, act, trips, _, forward in workload.weight_reads:
        if not forward:  # a loop's recomputation's copy of one read in the forward too
            continue
        summed = specs(act, len(act))
        split = {
            a for name, axes in zip(act, summed, strict=True) if name not in names for a in axes
        }
        axes = tuple(a for a in specs.sizes if a in split)
        for kind in ("all-reduce", "all-reduce once"):
            if (kind, axes, trips) in independent:
                also[(kind, axes, trips)] = also.get((kind, axes, trips), 0) + 1
    return also


def _reduced_over(
    specs: _Specs, names: Names, shape: tuple[int, ...], dims: tuple[int, ...], item: int
) -> tuple[tuple[str, ...], int]:
    """The mesh axes splitting a reduction's reduced dimensions (its partial results are
    all-reduced over them), and the bytes of one device's result."""
    spec = specs(names, len(shape))
    axes = tuple(a for a in specs.sizes if any(a in spec[d] for d in dims))
    kept = [
        -(-n // specs.split((s,)))
        for i, (n, s) in enumerate(zip(shape, spec, strict=True))
        if i not in dims
    ]
    return axes, item * math.prod(kept)


def _pieces_moved(
    specs: _Specs,
    names: Names,
    shape: tuple[int, ...],
    dim: int,
    pieces: tuple[tuple[int, int], ...],
    item: int,
) -> tuple[tuple[str, ...], int, int]:
    """The mesh axes splitting a cut dimension, one device's shard's bytes, and how many
    moves XLA makes: each piece (a slice's: the part it keeps) is split over the same
    devices as the whole, so each distance between where a part of a piece lies and where
    it goes is one collective-permute (a fused q/k/v projection's ``split`` over split heads: 7 permutes
    and 4 all-to-alls compiled in ``tests/search/test_cost.py``'s, 12 priced).

    Example:
        >>> from meshplan._search.predict.cost import _pieces_moved, _Specs
        >>> specs = _Specs({"tensor": 4}, (("heads", "tensor"),))
        >>> qkv = ((0, 64), (64, 128), (128, 192))
        >>> _pieces_moved(specs, ("batch", "heads"), (8, 192), 1, qkv, 4)  # fused q/k/v
        (('tensor',), 1536, 6)
    """
    axes = specs(names, len(shape))[dim]
    n = specs.split((axes,))
    if n == 1:
        return (), 0, 0
    shard = -(-shape[dim] // n)
    shifts = 0
    for lo, hi in pieces:  # a slice's one piece: the part it keeps
        part = -(-(hi - lo) // n)
        moved = {
            src - j  # where each part of device j's new shard lies now
            for j in range(n)
            for src in range(
                (lo + j * part) // shard, (min(lo + (j + 1) * part, hi) - 1) // shard + 1
            )
        }
        shifts += len(moved - {0})
    return tuple(axes), specs.shard_bytes(names, shape, item), shifts


def _tally(
    by_kind: dict[str, int], by_axis: dict[str, int], kind: str, axes: tuple[str, ...], n: int
) -> None:
    by_kind[kind] = by_kind.get(kind, 0) + n
    key = "+".join(axes)
    by_axis[key] = by_axis.get(key, 0) + n


def _peak(
    workload: Workload,
    specs: _Specs,
    profile: HardwareProfile,
    gathered: Mapping[Dot, Mapping[Any, int]],
    unreduced: Mapping[Dot, int] | None = None,
    partial_sums: set[Dot] | frozenset[Dot] = frozenset(),
    results: Mapping[Dot, int] | None = None,
    summed: Mapping[Dot, int] | None = None,
) -> memory_model.Peak:
    fused = profile.fused_attention
    program = workload.memory
    if not profile.rematerialize and workload.memory_kept is not None:
        program = workload.memory_kept  # every residual kept (XLA on CPU)
        if profile.late_gradients and workload.memory_late is not None:
            program = workload.memory_late  # the gradients' reductions run last (CPU)
    if program is None:
        return memory_model.Peak(0, 0, 0)

    def bytes_of(cell: memory_model.Cell) -> int:
        names, shape, item, score = cell
        if fused and score:
            return 0
        return specs.shard_bytes(names, shape, item)

    extra = [gathered.get(d, {}) for d in program.dots]
    partial = [(unreduced or {}).get(d, 0) for d in program.dots]
    running = [(summed or {}).get(d, 0) for d in program.dots]
    hoisted = (
        [d in partial_sums for d in program.dots] if profile.combines_remat_collectives else []
    )
    copies = [(results or {}).get(d, 0) for d in program.dots]
    held = _held_gradients(program, specs, copies)
    # XLA:CPU's program: the partial sums summed into one value, all-reduced together
    combined = [d in partial_sums for d in program.dots] if program.sums else []
    # XLA on CPU keeps a weight it gathered for the forward pass until the backward's read
    kept: Sequence[float] = (
        () if profile.regather else list(memory_model.kept_gathers(program, extra))
    )
    return memory_model.peak(
        program,
        bytes_of,
        extra,
        partial,
        profile.combine_bytes,
        hoisted,
        copies,
        held,
        combined,
        running,
        kept,
    )


def _held_gradients(
    program: memory_model.MemoryProgram, specs: _Specs, copies: list[int]
) -> list[float]:
    """Per matmul, the bytes of its output where it is a weight gradient whose all-reduce has
    a result of its own (XLA on CPU, combined into one all-reduce after the backward pass):
    XLA holds it until that runs (0: not held). Whole on every device (data parallel), or
    its shard (FSDP, whose partial sums beyond it are the matmul's unreduced bytes): XLA
    on CPU all-reduces an FSDP gradient's partial sums whole, then slices them, as a data
    parallel one (16 unrolled Llama layers: the same temporaries under both, 162.3 and
    162.6 MB), so the planner must not let the shard go into the update before then."""
    return [
        float(min(copy, specs.shard_bytes(*_out_array(dot)))) if copy else 0.0
        for dot, copy in zip(program.dots, copies, strict=True)
    ]
