"""The price of a pipeline: a step whose rules give ``'stage'`` a mesh axis.

A model is traced once, without a pipeline (its parameters' ``'layer'`` stack is all a
trace sees of the layers). :func:`predict_pipeline` prices the same step on one stage's
devices (the mesh without the stage axes, the rules without them) with the planner's
:func:`~meshplan._search.predict.cost.predict`, then splits it as a pipeline of ``p`` stages runs it:

* **compute**: the layers' share of the step (``block_fraction``: the matmul FLOPs run in
  the layer loop, or the ``'layer'`` share of the parameters for an unrolled model) is
  divided over the ``p`` stages and stretched by the schedule's iterations,
  ``(M v + p - 1) / (M v)``: the bubble; the rest (embedding, head, loss) runs whole on
  every stage, as :mod:`meshplan.models.pipeline` does;
* **communication**: the collectives of one stage's devices (FSDP's gathers, tensor
  parallelism's reductions, the data-parallel gradient reduction) scale as the compute
  they belong to; the point-to-point sends, one activation forward and its gradient
  back per iteration, ``2 (M v + p - 1)`` sends of a microbatch's activation slice, go
  over the link the stage axis crosses (``fast`` within a host or slice, ``slow``
  across);
* **memory**: each stage's parameters and optimizer state (its ``1/p`` of the layer
  stack, the rest whole); the activations its layers keep for the backward pass, for
  the microbatches in flight: GPipe (this project's schedules) keeps every microbatch
  of every iteration, ``1F1B`` (Megatron-LM's, ``in_flight=p``) at most ``p``; the
  temporaries of the layers (the one being computed) are a microbatch's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, Literal

from meshplan._search.predict.collectives import collective_time, split_group
from meshplan._search.predict.cost import Cost, predict
from meshplan._search.predict.profiles import HardwareProfile
from meshplan._search.predict.trace import Workload
from meshplan._spmd.pipeline import PipelineSchedule, stage_axes
from meshplan._spmd.rules import LogicalRules, MeshAxes, mesh_axes_of

__all__ = [
    "PipelineCost",
    "block_fraction",
    "example_stack",
    "predict_pipeline",
    "stage_base",
]

Schedule = Literal["gpipe", "1f1b"]
"""Which microbatches a stage keeps activations for: all (``gpipe``) or ``p`` (``1f1b``)."""


@dataclasses.dataclass(frozen=True)
class PipelineCost:
    """A pipelined step's prediction and what it is made of.

    Attributes:
        cost: The step as a pipeline runs it (seconds; bytes per device of a stage).
        base: One stage's devices running the whole step without a pipeline.
        schedule: Stages, microbatches, repeats.
        block_fraction: The layers' share of the step's compute.
        bubble_s: Seconds of the step each stage waits (the schedule's bubble).
        send_s: Seconds of point-to-point sends (activations and their gradients).
        send_bytes: Bytes one device sends a step.
        link: ``'fast'`` (within a host or slice) or ``'slow'`` (across) for the sends.
    """

    cost: Cost
    base: Cost
    schedule: PipelineSchedule
    block_fraction: float
    bubble_s: float
    send_s: float
    send_bytes: int
    link: str

    def to_dict(self) -> dict[str, Any]:
        """The schedule and what it costs, as plain data (``--json``'s ``pipeline``)."""
        s = self.schedule
        return {
            "stages": s.stages,
            "microbatches": s.microbatches,
            "repeats": s.repeats,
            "iterations": s.iterations,
            "bubble": s.bubble,
            "bubble_s": self.bubble_s,
            "send_s": self.send_s,
            "send_bytes": self.send_bytes,
            "link": self.link,
            "block_fraction": self.block_fraction,
        }


def _without(rules: LogicalRules, axes: tuple[str, ...]) -> tuple[tuple[str, MeshAxes], ...]:
    """``rules`` with ``axes`` taken out of every rule (a rule left with none: unsharded)."""
    out: list[tuple[str, MeshAxes]] = []
    for name, entry in rules:
        kept = tuple(a for a in mesh_axes_of(entry) if a not in axes)
        out.append((name, None if not kept else kept[0] if len(kept) == 1 else kept))
    return tuple(out)


@functools.cache
def example_stack() -> Workload:
    """The traced gradient step of a scanned stack of 8 bfloat16 1024x1024 layers
    (``('layer', 'embed', 'mlp')``) on a batch of 256 rows, traced once per process: the
    examples of the pipeline's pricing share it.

    Example:
        >>> from meshplan._search.predict.pipeline import example_stack
        >>> example_stack() is example_stack(), example_stack().batch
        (True, 256)
    """
    import jax
    import jax.numpy as jnp

    from meshplan._search.predict.trace import trace_workload
    from meshplan._spmd.boxes import LogicallyPartitioned

    w = jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16)
    state = {"w": LogicallyPartitioned(w, ("layer", "embed", "mlp"))}

    def loss(w: jax.Array, x: jax.Array) -> jax.Array:
        out: jax.Array = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0].sum()
        return out

    def step(s: dict[str, LogicallyPartitioned[jax.ShapeDtypeStruct]], x: jax.Array) -> Any:
        return jax.grad(loss)(s["w"].value, x)

    return trace_workload(step, state, jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16))


def stage_base(
    workload: Workload, mesh: Mapping[str, int], rules: LogicalRules, profile: HardwareProfile
) -> Cost:
    """One stage's devices' price of the whole step: the mesh and the rules without the axes
    ``rules`` give ``'stage'`` (what :func:`predict_pipeline` splits into stages)."""
    axes, _ = stage_axes(rules, dict(mesh))
    sub = {a: n for a, n in mesh.items() if a not in axes}
    return predict(workload, sub, _without(rules, axes), profile)


def block_fraction(workload: Workload) -> float:
    """The share of a step's matmul FLOPs run inside its layer loop (``nn.scan``); for a
    model whose layers are unrolled, the ``'layer'``-named share of its parameters.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.predict.trace import trace_workload
        >>> from meshplan._search.predict.pipeline import block_fraction
        >>> def box(shape, names):
        ...     return meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)
        >>> state = {"w": box((3, 64, 64), ("layer", "embed", "mlp")), "head": box((64, 64), ("embed", "vocab"))}
        >>> def loss(p, x):
        ...     h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])[0]
        ...     return jnp.square(h @ p["head"]).sum()
        >>> work = trace_workload(lambda s, x: jax.grad(loss)(meshplan.unbox(s), x), state,
        ...                       jax.ShapeDtypeStruct((8, 64), jnp.float32))
        >>> round(block_fraction(work), 2)
        0.75
    """
    looped = total = 0.0
    for dot, count in workload.dots.items():
        flops = dot.flops * count
        total += flops
        if workload.trips(dot) > 1:
            looped += flops
    if looped and total:
        return looped / total
    params = [(names, shape) for names, shape, _ in workload.state if names is not None]
    layer = sum(math.prod(s) for n, s in params if "layer" in n)
    whole = sum(math.prod(s) for n, s in params)
    return layer / whole if whole else 0.0


def _state_layer_share(workload: Workload) -> float:
    """The share of the state's bytes in ``'layer'``-named arrays (the stages' to split)."""
    layer = whole = 0
    for names, shape, item in workload.state:
        nbytes = math.prod(shape) * item
        whole += nbytes
        layer += nbytes if names is not None and "layer" in names else 0
    return layer / whole if whole else 0.0


def _boundary_bytes(
    workload: Workload, mesh: Mapping[str, int], rules: LogicalRules, microbatches: int
) -> int:
    """Bytes of one microbatch's activation between two stages, on one device: its tokens
    over the devices that split ``'batch'``, times the model width and the compute dtype."""
    tokens = workload.tokens or 0
    embed = max(
        (s[n.index("embed")] for n, s, _ in workload.state if n is not None and "embed" in n),
        default=0,
    )
    item = max((d.lhs_itemsize for d in workload.dots), default=4)
    batch_axes = next((mesh_axes_of(e) for n, e in rules if n == "batch"), ())
    shards = math.prod(mesh.get(a, 1) for a in batch_axes)
    return math.ceil(tokens / microbatches / max(shards, 1)) * embed * item


def predict_pipeline(
    workload: Workload,
    mesh: Mapping[str, int],
    rules: LogicalRules,
    profile: HardwareProfile,
    *,
    microbatches: int,
    repeats: int = 1,
    schedule: Schedule = "gpipe",
    base: Cost | None = None,
) -> PipelineCost:
    """The predicted step of ``workload`` as a pipeline over the axes ``rules`` give ``'stage'``.

    Example:
        >>> from meshplan._search.predict.pipeline import example_stack, predict_pipeline
        >>> from meshplan._search.predict.profiles import get_profile
        >>> work = example_stack()  # 8 layers of 1024x1024, a batch of 256
        >>> rules = (("batch", "data"), ("stage", "pipeline"), ("layer", "pipeline"))
        >>> pp = predict_pipeline(work, {"pipeline": 4, "data": 2}, rules, get_profile("h100"),
        ...                       microbatches=8)
        >>> pp.schedule.bubble == 3 / 11, pp.link, pp.cost.state_bytes * 4 == pp.base.state_bytes
        (True, 'fast', True)

    Args:
        workload: The traced step (:func:`~meshplan._search.predict.trace.trace_workload`).
        mesh: Every mesh axis's size, the stage axes among them.
        rules: Rules that give ``'stage'`` (and the ``'layer'`` stack) the stage axes.
        profile: The hardware.
        microbatches: Microbatches per step.
        repeats: Layer groups per stage (the circular, or interleaved, schedule).
        schedule: ``'gpipe'`` (every microbatch's activations kept) or ``'1f1b'``.
        base: One stage's devices' price of the whole step, when known (it depends on
            the mesh and rules, not on the schedule: a search prices it once).

    Raises:
        ValueError: ``'stage'`` has no mesh axis of more than one device under ``rules``.
    """
    axes, p = stage_axes(rules, dict(mesh))
    if p <= 1:
        raise ValueError(
            f"the rules give 'stage' no mesh axis of more than one device on {dict(mesh)}; "
            "add ('stage', 'pipeline') and ('layer', 'pipeline') for a 'pipeline' mesh axis."
        )
    plan = PipelineSchedule(p, microbatches, repeats)
    sub = {a: n for a, n in mesh.items() if a not in axes}
    sub_rules = _without(rules, axes)
    base = predict(workload, sub, sub_rules, profile) if base is None else base
    fb = block_fraction(workload)
    stretch = plan.iterations / (microbatches * repeats)
    share = fb / p * stretch + (1 - fb)  # of one stage's devices' whole-step time
    work_s = (base.compute_s + base.memory_s) * share
    bubble_s = (base.compute_s + base.memory_s) * fb / p * (stretch - 1)
    comm_s = base.comm_s * share
    send = _boundary_bytes(workload, sub, sub_rules, microbatches)
    sends = 2 * plan.iterations
    send_s = sends * collective_time(profile, "collective-permute", dict(mesh), axes, send)
    _, domains = split_group(dict(mesh), axes, profile.domain_devices)
    sl = _state_layer_share(workload)
    in_flight = 1.0 if schedule == "gpipe" else min(p, microbatches) / microbatches
    acts = base.activation_bytes * (fb / p * stretch * in_flight + (1 - fb))
    label = "+".join(axes)
    cost = dataclasses.replace(
        base,
        step_s=work_s + comm_s + send_s,
        compute_s=base.compute_s * share,
        memory_s=base.memory_s * share,
        comm_s=comm_s + send_s,
        flops_per_device=base.flops_per_device * (fb / p + 1 - fb),
        comm_bytes={**base.comm_bytes, "collective-permute": send * sends},
        comm_by_axis={**base.comm_by_axis, label: send * sends},
        state_bytes=int(base.state_bytes * (sl / p + 1 - sl)),
        activation_bytes=int(acts),
        temporary_bytes=int(base.temporary_bytes * (fb / microbatches + 1 - fb)),
        batch_bytes=base.batch_bytes,
        collectives=base.collectives + sends,
        comm_total_s=base.comm_total_s * share + send_s,
    )
    link = "slow" if domains > 1 else "fast"
    return PipelineCost(cost, base, plan, fb, bubble_s, send_s, send * sends, link)
