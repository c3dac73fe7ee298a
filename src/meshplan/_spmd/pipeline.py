"""Pipeline parallelism: a stack of layers run as stages, microbatches shifted between them.

The layers are a scanned stack (every parameter has a leading ``'layer'``
dimension of ``L``). A pipeline of ``p`` stages and ``v`` repeats cuts it into
``v * p`` groups of ``L / (v * p)`` consecutive layers; stage ``s`` holds groups
``s, s + p, s + 2p, ...`` (with ``v = 1``, GPipe: one contiguous group; with
``v > 1``, the circular schedule). The batch is cut into ``M`` microbatches.

The schedule is a loop of ``M * v + p - 1`` iterations (``jax.lax.scan``). In
each, every stage applies its group to the activation it holds, all stages at
once (``jax.vmap`` over a ``'stage'`` dimension that the rules map to a mesh
axis, ``spmd_axis_name`` so that the constraints inside a layer keep it); then
the activations move one stage on (``jnp.roll`` of the stage dimension, which
XLA lowers to a collective permute), stage 0 takes the next microbatch, and
what the last stage finished is kept (for the next repeat, or as the output).
Its gradient is JAX's: the loop run backwards, GPipe's all-backwards phase.
Every stage works on a microbatch in ``M * v`` of the iterations and is idle
in the other ``p - 1``: the bubble, ``(p - 1) / (M * v + p - 1)``.

Each activation carries the number of the microbatch it holds (``-1``: none),
shifted with it; :func:`pipeline_layers` can return what every stage held at
every iteration, so the bubble is measured from the data that moved, not
computed from the formula.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshplan._errors import MeshError, Problem, error_for
from meshplan._spmd.constraints import with_logical_constraint
from meshplan._spmd.mesh_info import MeshLike
from meshplan._spmd.place import active_mesh, apply_spec
from meshplan._spmd.rules import LogicalRules, get_logical_axis_rules, mesh_axes_of, resolve
from meshplan._types import PyTree

__all__ = ["PipelineSchedule", "pipeline_layers", "stage_axes"]

STAGE = "stage"
"""The logical name of the stage dimension; rules map it to a mesh axis (``'pipeline'``)."""


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """``stages`` stages, ``microbatches`` microbatches, ``repeats`` layer groups per stage.

    Example:
        >>> from meshplan import PipelineSchedule
        >>> gpipe = PipelineSchedule(stages=4, microbatches=8)
        >>> gpipe.iterations, round(gpipe.bubble, 4)
        (11, 0.2727)
        >>> gpipe.work(3, 1), gpipe.work(0, 1)
        ((2, 0), None)
        >>> PipelineSchedule(stages=4, microbatches=8, repeats=2).bubble < gpipe.bubble
        True
    """

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def iterations(self) -> int:
        """Iterations of the loop: ``microbatches * repeats + stages - 1``.

        Example:
            >>> from meshplan import PipelineSchedule
            >>> PipelineSchedule(stages=4, microbatches=8, repeats=2).iterations
            19
        """
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The idle fraction of every stage: ``(p - 1) / (M * v + p - 1)``.

        Example:
            >>> from meshplan import PipelineSchedule
            >>> PipelineSchedule(stages=2, microbatches=3).bubble
            0.25
        """
        return (self.stages - 1) / self.iterations

    def work(self, iteration: int, stage: int) -> tuple[int, int] | None:
        """``(microbatch, repeat)`` that ``stage`` works on at ``iteration``; ``None``: idle.

        Example:
            >>> from meshplan import PipelineSchedule
            >>> circular = PipelineSchedule(stages=2, microbatches=2, repeats=2)
            >>> [circular.work(t, 1) for t in range(circular.iterations)]
            [None, (0, 0), (1, 0), (0, 1), (1, 1)]
        """
        k = iteration - stage
        if not 0 <= k < self.microbatches * self.repeats:
            return None
        return k % self.microbatches, k // self.microbatches

    def layers_per_stage(self, layers: int) -> int:
        """Consecutive layers in each of a stage's ``repeats`` groups.

        Example:
            >>> from meshplan import PipelineSchedule
            >>> PipelineSchedule(stages=4, microbatches=8, repeats=2).layers_per_stage(16)
            2
        """
        return layers // (self.stages * self.repeats)

    def problems(self, layers: int, batch: int | None = None) -> list[Problem]:
        """What stops this schedule from running ``layers`` layers on a batch of ``batch``.

        Example:
            >>> from meshplan import PipelineSchedule
            >>> [p.code for p in PipelineSchedule(4, 2, 3).problems(layers=8, batch=6)]
            ['pipeline-layers', 'pipeline-microbatches']
        """
        p, m, v = self.stages, self.microbatches, self.repeats
        found = []
        for name, value in (("stages", p), ("microbatches", m), ("repeats", v)):
            if value < 1:
                found.append(
                    _problem(
                        "pipeline-count",
                        name,
                        f"{name} must be 1 or more, got {value}",
                        f"Pass {name} of 1 or more.",
                    )
                )
        if found:
            return found
        if layers % (p * v):
            near = max(p * v, round(layers / (p * v)) * p * v)
            found.append(
                _problem(
                    "pipeline-layers",
                    "layers",
                    f"{layers} layers do not split into {p} stages x {v} repeats "
                    f"({p * v} groups of equal size)",
                    f"Use a number of layers that is a multiple of {p * v} (e.g. {near}), or "
                    f"stages x repeats that divide {layers}.",
                )
            )
        if p > 1 and m < p:
            found.append(
                _problem(
                    "pipeline-microbatches",
                    "microbatches",
                    f"{m} microbatches are fewer than the {p} stages: stages would wait for work "
                    f"that never comes (bubble {(p - 1) / self.iterations:.0%})",
                    f"Use {p} microbatches or more (a multiple of {p}, e.g. {2 * p}: bubble "
                    f"{(p - 1) / (2 * p * v + p - 1):.0%}).",
                )
            )
        if batch is not None and batch % m:
            found.append(
                _problem(
                    "pipeline-batch",
                    "batch",
                    f"a batch of {batch} does not split into {m} microbatches",
                    f"Use a batch that is a multiple of {m} (e.g. {max(m, round(batch / m) * m)}), "
                    f"or a number of microbatches that divides {batch}.",
                )
            )
        return found


def _problem(code: str, path: str, message: str, fix: str) -> Problem:
    return Problem("error", path, message, fix, code)


def stage_axes(
    rules: LogicalRules | None = None, mesh: MeshLike | None = None
) -> tuple[tuple[str, ...], int]:
    """The mesh axes the ``'stage'`` name maps to under ``rules``, and the stages they make.

    ``mesh`` (or the active mesh; a dict of axis sizes will do) gives the sizes;
    ``((), 1)`` when ``'stage'`` has no rule or no mesh is known.

    Example:
        >>> from meshplan._spmd.pipeline import stage_axes
        >>> stage_axes((("stage", "pipeline"), ("batch", "data")), {"pipeline": 4, "data": 2})
        (('pipeline',), 4)
        >>> stage_axes((("batch", "data"),), {"data": 8})
        ((), 1)
    """
    rules = get_logical_axis_rules() if rules is None else rules
    mesh = active_mesh() if mesh is None else mesh
    if not rules or mesh is None:
        return (), 1
    axes = mesh_axes_of(resolve((STAGE,), rules)[0])
    sizes = dict(mesh) if isinstance(mesh, Mapping) else dict(mesh.shape)
    axes = tuple(a for a in axes if a in sizes)
    return axes, math.prod(sizes[a] for a in axes)


def _check_auto(axes: tuple[str, ...]) -> None:
    """The stage axes are ``Auto``: the shift of the stage dimension (``jnp.roll``) is
    XLA's to lower; JAX's ``Explicit`` sharding types cannot slice a sharded dimension."""
    mesh = active_mesh()
    types = dict(
        zip(getattr(mesh, "axis_names", ()), getattr(mesh, "axis_types", ()) or (), strict=False)
    )
    explicit = [a for a in axes if types.get(a) == jax.sharding.AxisType.Explicit]
    if explicit:
        raise error_for(
            MeshError,
            "pipeline-explicit",
            "stage",
            f"A pipeline's stage axes must be Auto, but {', '.join(map(repr, explicit))} "
            f"is Explicit (JAX cannot shift activations along an Explicit sharded dimension)",
            "Build the mesh with jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * n) "
            "(meshplan train builds Auto meshes).",
        )


def _microbatched(x: jax.Array, m: int) -> jax.Array:
    """``x[batch, ...]`` as ``[m, batch / m, ...]``: rows ``i, i + m, ...`` are microbatch ``i``.

    Each microbatch takes rows from every shard of a batch split over devices, so
    the cut moves nothing.
    """
    return jnp.swapaxes(x.reshape(x.shape[0] // m, m, *x.shape[1:]), 0, 1)


def _unmicrobatched(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _by_stage(params: PyTree, schedule: PipelineSchedule, axes: tuple[str, ...]) -> PyTree:
    """``[L, ...]`` leaves as ``[p, v, L / (v p), ...]``: stage ``s``, repeat ``r`` holds layers
    ``(r p + s) L / (v p)`` onwards; the stage dimension on ``axes``."""
    p, v = schedule.stages, schedule.repeats

    def split(a: jax.Array) -> jax.Array:
        lps = a.shape[0] // (p * v)
        a = jnp.swapaxes(a.reshape(v, p, lps, *a.shape[1:]), 0, 1)
        if not axes:
            return a
        entry = axes[0] if len(axes) == 1 else axes
        rest = (PartitionSpec.UNCONSTRAINED,) * (a.ndim - 3)
        return apply_spec(a, PartitionSpec(entry, None, None, *rest), what="a pipeline stage")

    return jax.tree.map(split, params)


def pipeline_layers(
    layer_fn: Callable[[object, jax.Array], jax.Array],
    params: PyTree,
    x: jax.Array,
    schedule: PipelineSchedule,
    names: Sequence[str | None],
    *,
    with_activity: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """``x`` through a stack of layers, as a pipeline of ``schedule.stages`` stages.

    The same as ``jax.lax.scan`` of ``layer_fn`` over ``params`` (every leaf with a
    leading layer dimension), computed by the schedule of :class:`PipelineSchedule`.
    The stage dimension is named ``'stage'``: the active rules map it to mesh axes
    (``('stage', 'pipeline')``), and the stage computation is vmapped with those
    axes as ``spmd_axis_name``; with no rule, the stages run vmapped on the same
    devices (the same result).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan import PipelineSchedule, pipeline_layers
        >>> w = jax.random.normal(jax.random.key(0), (8, 4, 4)) / 2
        >>> x = jax.random.normal(jax.random.key(1), (6, 4))
        >>> def layer(w, x):
        ...     return jnp.tanh(x @ w)
        >>> plain, _ = jax.lax.scan(lambda x, w: (layer(w, x), None), x, w)
        >>> piped, held = pipeline_layers(layer, w, x, PipelineSchedule(2, 3, repeats=2),
        ...                               ("batch", "embed"), with_activity=True)
        >>> bool(jnp.allclose(plain, piped, atol=1e-6)), held.shape
        (True, (7, 2))
        >>> int((held >= 0).sum()), held.size  # busy: 2 stages x 6 of 7 iterations
        (12, 14)

    Args:
        layer_fn: ``layer_fn(layer_params, x) -> x``, one layer.
        params: The stacked layers' parameters (unboxed arrays).
        x: The input, its first dimension the batch.
        schedule: Stages, microbatches and repeats.
        names: ``x``'s logical names (``('batch', 'length', 'embed')``).
        with_activity: Also return ``int32[iterations, stages]``: the microbatch
            (``repeat * microbatches + microbatch``) each stage held, ``-1`` idle.

    Returns:
        The output (``x``'s shape), or ``(output, activity)``.
    """
    p, m, v = schedule.stages, schedule.microbatches, schedule.repeats
    axes, _ = stage_axes()
    _check_auto(axes)
    spmd = None if not axes else axes[0] if len(axes) == 1 else axes
    staged = _by_stage(params, schedule, axes)
    inputs = _microbatched(x, m)
    state_names = (STAGE, *names)
    buffer_names = (None, *names)

    def stage_fn(stage_params: PyTree, h: jax.Array, held: jax.Array) -> jax.Array:
        repeat = jnp.clip(held // m, 0, v - 1)
        group = jax.tree.map(
            lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, False), stage_params
        )

        def one(h: jax.Array, layer: PyTree) -> tuple[jax.Array, None]:
            return layer_fn(layer, h), None

        return jax.lax.scan(one, h, group)[0]

    run = jax.vmap(stage_fn, spmd_axis_name=spmd)
    first = jnp.arange(p) == 0

    def iteration(carry: PyTree, t: jax.Array) -> tuple[Any, jax.Array]:
        out, held, done = carry
        nxt = jnp.where(t < m, inputs[jnp.minimum(t, m - 1)], done[t % m])
        shifted = jnp.roll(out, 1, axis=0)
        h = jnp.where(first.reshape(p, *(1,) * (out.ndim - 1)), nxt[None], shifted)
        h = with_logical_constraint(h, state_names)
        held = jnp.where(first, jnp.where(t < m * v, t, -1), jnp.roll(held, 1))
        out = with_logical_constraint(run(staged, h, held), state_names)
        last = held[p - 1]  # one slot written (kept as it was while the last stage idles)
        slot = jnp.maximum(last, 0) % m
        kept = jax.lax.dynamic_index_in_dim(done, slot, 0, keepdims=False)
        done = jax.lax.dynamic_update_index_in_dim(
            done, jnp.where(last >= 0, out[p - 1], kept), slot, 0
        )
        return (out, held, with_logical_constraint(done, buffer_names)), held

    out0 = with_logical_constraint(jnp.zeros((p, *inputs.shape[1:]), x.dtype), state_names)
    held0 = jnp.full((p,), -1, jnp.int32)
    done0 = with_logical_constraint(jnp.zeros_like(inputs), buffer_names)
    (_, _, done), activity = jax.lax.scan(
        iteration, (out0, held0, done0), jnp.arange(schedule.iterations)
    )
    y = _unmicrobatched(done)
    return (y, activity) if with_activity else y
