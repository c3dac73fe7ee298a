"""Predicted step time of a traced step under a mesh and rules: compute + memory + communication.

:func:`predict` prices a :class:`meshplan._search.trace.Workload` (every matmul and
the bytes of every other op, by logical names) on one candidate: each array's
dimensions map to mesh axes through the rules exactly as the sharding would
(``meshplan.logical_to_mesh_axes``, per array), and each ``dot_general`` is
partitioned the way XLA's SPMD partitioner does in the common cases:

* its *output* dimensions (batch, then the left operand's free ones, then the
  right's) keep their mesh axes; an axis already taken by an earlier
  dimension means the operand holding it is **all-gathered** over that axis
  (FSDP: the weight's ``embed`` shard, when the batch holds the same axis);
* a *contracting* dimension split over an axis no output dimension holds
  leaves partial sums: the output is **all-reduced** over that axis (tensor
  parallelism's activation all-reduces; data parallelism's gradient
  reductions, where the contracting dimension is the batch);
* an operand whose dimension is not split where the other's is, is sliced
  locally (free).

Per device, a matmul costs its FLOPs divided by the product of the axes that
split it, over the profile's ``peak_flops``; every other op costs the bytes it
writes per device over ``memory_bandwidth``; a collective over a group of ``n``
devices costs ``latency_s`` plus, for an all-reduce of ``b`` bytes,
``2 (n - 1) / n * b`` and, for an all-gather of a ``b``-byte shard,
``(n - 1) * b``, over the slowest axis of the group (``HardwareProfile.axis_bandwidth``).
The three add up: no overlap of compute and communication is assumed.

Bytes are reported as :func:`meshplan._search.hlo.collective_bytes` counts them
(operands, per device, per step), so a prediction can be checked against a
compiled step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from meshplan._search.profiles import HardwareProfile
from meshplan._search.trace import Dot, Names, Workload
from meshplan._spmd.rules import logical_to_mesh_axes, mesh_axes_of

__all__ = ["Cost", "predict"]

Spec = tuple[tuple[str, ...], ...]


@dataclasses.dataclass
class Cost:
    """One candidate's prediction (seconds per step; bytes per device).

    ``comm_bytes``: operand bytes by collective kind (as the HLO counts them);
    ``comm_by_axis``: the same by mesh axis group (``'data'``, ``'data+tensor'``).
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

    @property
    def memory_bytes(self) -> int:
        """State plus the activation estimate, per device."""
        return self.state_bytes + self.activation_bytes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Specs:
    """Mesh axes (of size > 1) per dimension of an array named ``names``, cached."""

    def __init__(self, sizes: Mapping[str, int], rules: Any) -> None:
        self.sizes, self.rules = sizes, tuple(rules)
        self.cache: dict[Names, Spec] = {}

    def __call__(self, names: Names | None, ndim: int) -> Spec:
        if names is None:
            return ((),) * ndim
        spec = self.cache.get(names)
        if spec is None:
            pspec = logical_to_mesh_axes(names, self.rules)
            spec = tuple(
                tuple(a for a in mesh_axes_of(e) if self.sizes.get(a, 1) > 1) for e in pspec
            )
            self.cache[names] = spec
        return spec

    def split(self, spec: Spec) -> int:
        return math.prod(self.sizes[a] for axes in spec for a in axes)


def _dot_cost(
    dot: Dot, specs: _Specs
) -> tuple[float, list[tuple[str, tuple[str, ...], int, Any]], int]:
    """Per-device FLOPs, the collectives ``(kind, axes, bytes, key)``, output bytes per device.

    ``key``: for an all-gather, the gathered array's (names, shape, axis): XLA gathers an
    array once per step and reuses it (forward, backward, rematerialised forward)."""
    sizes = specs.sizes
    ls, rs = specs(dot.lhs_names, len(dot.lhs_shape)), specs(dot.rhs_names, len(dot.rhs_shape))
    (lc, rc), (lb, rb) = dot.contract, dot.batch
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
    for i in range(len(ls)):
        if i not in lc and i not in lb:
            take(ls[i], 0)
    for j in range(len(rs)):
        if j not in rc and j not in rb:
            take(rs[j], 1)
    reduce: list[str] = []
    for i, j in zip(lc, rc, strict=True):
        for a in dict.fromkeys((*ls[i], *rs[j])):
            if a in used:
                if a in ls[i]:
                    gather[(0, a)] = None
                if a in rs[j]:
                    gather[(1, a)] = None
            else:
                used.add(a)
                reduce.append(a)
    split = math.prod(sizes[a] for a in used)
    flops = dot.flops / split
    out_elems = dot.flops // 2 // math.prod(dot.lhs_shape[i] for i in lc)
    out_bytes = out_elems * dot.itemsize // max(1, math.prod(sizes[a] for a in out_axes))
    colls: list[tuple[str, tuple[str, ...], int, Any]] = []
    if reduce:
        colls.append(("all-reduce", tuple(reduce), out_bytes, None))
    for side in (0, 1):
        axes = tuple(a for s, a in gather if s == side)
        if not axes:
            continue
        shape, spec = (dot.lhs_shape, ls) if side == 0 else (dot.rhs_shape, rs)
        item = dot.lhs_itemsize if side == 0 else dot.rhs_itemsize
        names = dot.lhs_names if side == 0 else dot.rhs_names
        nbytes = math.prod(shape) * item // specs.split(spec)
        colls.append(("all-gather", axes, nbytes, (names, shape, axes)))
    return flops, colls, out_bytes


def state_bytes(workload: Workload, specs: _Specs) -> int:
    """Per-device bytes of the state (shards rounded up, as ``explain`` counts them)."""
    total = 0
    for names, shape, item in workload.state:
        spec = specs(names, len(shape))
        total += item * math.prod(
            -(-s // math.prod(specs.sizes[a] for a in axes))
            for s, axes in zip(shape, spec, strict=True)
        )
    return total


def predict(
    workload: Workload, mesh: Mapping[str, int], rules: Any, profile: HardwareProfile
) -> Cost:
    """The predicted step time and per-device bytes of ``workload`` on ``mesh`` under ``rules``.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.trace import trace_workload
        >>> from meshplan._search.cost import predict
        >>> from meshplan._search.profiles import get_profile
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
    """
    specs = _Specs(mesh, rules)
    sizes = specs.sizes
    flops, comm_s, n_coll = 0.0, 0.0, 0
    by_kind: dict[str, int] = {}
    by_axis: dict[str, int] = {}
    act = 0
    bw_cache: dict[str, float] = {}

    def bandwidth(axes: tuple[str, ...]) -> float:
        return min(bw_cache.setdefault(a, profile.axis_bandwidth(sizes, a)) for a in axes)

    gathers: dict[Any, tuple[str, tuple[str, ...], int, int]] = {}
    colls_all: list[tuple[str, tuple[str, ...], int, int]] = []
    for dot, count in workload.dots.items():
        f, colls, out_bytes = _dot_cost(dot, specs)
        flops += f * count
        act += out_bytes * count
        for kind, axes, nbytes, key in colls:
            if key is None:
                colls_all.append((kind, axes, nbytes, count))
            elif key not in gathers or gathers[key][3] < count:
                gathers[key] = (kind, axes, nbytes, count)
    for kind, axes, nbytes, count in [*colls_all, *gathers.values()]:
        if True:
            n = math.prod(sizes[a] for a in axes)
            moved = 2 * (n - 1) / n * nbytes if kind == "all-reduce" else (n - 1) * nbytes
            comm_s += count * (profile.latency_s + moved / bandwidth(axes))
            n_coll += count
            by_kind[kind] = by_kind.get(kind, 0) + nbytes * count
            key = "+".join(axes)
            by_axis[key] = by_axis.get(key, 0) + nbytes * count
    traffic = 0
    for (names, shape), nbytes in workload.traffic.items():
        traffic += nbytes // specs.split(specs(names, len(shape)))
    compute_s = flops / profile.peak_flops
    memory_s = traffic / profile.memory_bandwidth
    return Cost(
        step_s=compute_s + memory_s + comm_s,
        compute_s=compute_s,
        memory_s=memory_s,
        comm_s=comm_s,
        flops_per_device=flops,
        comm_bytes=by_kind,
        comm_by_axis=by_axis,
        state_bytes=state_bytes(workload, specs),
        activation_bytes=act // 3,
        collectives=n_coll,
    )
