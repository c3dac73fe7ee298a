"""Whether a ``meshplan train`` step fits in a device, checked before any array is created.

There is one memory model: the planner's (:mod:`meshplan._search.memory`, the liveness of
the differentiated step's jaxpr, by logical names), which ``meshplan plan --profile`` and
``meshplan search`` report. This module traces the step the run will take (one microbatch,
with its optimizer), asks the planner for its peak per device under the run's mesh and
rules, and compares it with what a device holds (:func:`device_memory`). It refuses only
what the planner says cannot fit, with the numbers and a flag-level fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshplan._errors import Problem
from meshplan._search.cost import Cost, predict
from meshplan._search.profiles import get_profile
from meshplan._search.trace import trace_workload
from meshplan._spmd.rules import LogicalRules
from meshplan._text import human_bytes
from meshplan.train.model import TrainModel
from meshplan.train.settings import TrainSettings

__all__ = ["device_memory", "memory_problem", "step_memory"]

_HOST_BASELINE = 1 << 30
"""Host memory a CPU run needs besides its arrays (Python, JAX, XLA's compiler): about 1 GiB."""


def device_memory(mesh: Mesh) -> tuple[int, str] | None:
    """Bytes one device can hold, and where that number comes from; ``None`` if unknown.

    Emulated CPU devices share the host's memory: what is available now (not the total),
    less the process's own baseline and a 20% margin, split between the mesh's devices on
    this host (not every emulated device: a 2x4 mesh on 4,096 emulated devices uses 8).
    """
    device = jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # not every backend has them
        stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.platform} device memory"
    if device.platform != "cpu":
        return None
    try:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return None
    here = {d.id for d in jax.local_devices()}
    count = max(sum(d.id in here for d in mesh.devices.flat), 1)
    usable = max(int(available * 0.8) - _HOST_BASELINE, 0)
    return usable // count, (
        f"this host's {human_bytes(available)} of available memory, less about "
        f"{human_bytes(_HOST_BASELINE)} for the process and a 20% margin, shared by the mesh's "
        f"{count} CPU device{'s' * (count != 1)}"
    )


def step_memory(
    model: TrainModel, abstract: Any, batch: jax.ShapeDtypeStruct, mesh: Mesh, rules: LogicalRules
) -> Cost:
    """The planner's prediction of one train step of ``batch`` on ``mesh`` under ``rules``.

    ``abstract``: the state with the run's optimizer (its update is part of the step).
    Attention scores count as held on the CPU, and as fused away on accelerators, so an
    accelerator run is refused only when even the fused step cannot fit.
    """
    platform = mesh.devices.flat[0].platform
    profile = dataclasses.replace(
        get_profile("cpu", mesh.devices.size), fused_attention=platform != "cpu"
    )
    work = trace_workload(model.step, abstract, batch, rules)
    return predict(work, dict(mesh.shape), rules, profile)


def memory_problem(
    model: TrainModel,
    abstract: Any,
    settings: TrainSettings,
    mesh: Mesh,
    rules: LogicalRules,
    batch_shards: int,
    remat: bool,
) -> Problem | None:
    """Why the run's step does not fit in a device (code ``'out-of-memory'``), or ``None``.

    The step of one microbatch (``batch / grad_accum`` sequences of ``seq_len + 1``
    tokens) is what a device holds at a time; ``batch_shards`` devices share it.
    """
    found = device_memory(mesh)
    if found is None:
        return None
    limit, source = found
    micro = max(settings.batch // settings.grad_accum, 1)
    tokens = jax.ShapeDtypeStruct((micro, settings.seq_len + 1), jnp.int32)
    cost = step_memory(model, abstract, tokens, mesh, rules)
    need = cost.memory_bytes
    if need <= limit:
        return None
    state = cost.state_bytes
    rest = need - state  # activations, gradients, temporaries and the batch: they grow with it
    sequences = math.ceil(micro / batch_shards)
    per_sequence = max(rest // max(sequences, 1), 1)
    room = max(limit - state, 0) // per_sequence
    largest = room * batch_shards * settings.grad_accum
    fix = (
        f"Use --batch {largest} or less (each device holds about {room:,} sequences of "
        f"{settings.seq_len} bytes besides the state), a shorter --seq"
        f"{'' if remat else ', --remat'}, or a mesh and layout that split 'batch' over "
        f"more devices."
        if room >= 1
        else "The state alone does not fit: use a smaller model, or a layout that splits it "
        "over more devices (fsdp, fsdp_tp)."
    )
    return Problem(
        "error",
        "",
        f"--batch {settings.batch} needs about {human_bytes(need)} per device "
        f"({human_bytes(state)} of parameters and AdamW state, and about {human_bytes(rest)} "
        f"of activations for its {sequences:,} sequences of {settings.seq_len} bytes, with "
        f"the gradients and the step's temporaries, as meshplan plan --profile predicts "
        f"them), but a device has about {human_bytes(limit)} ({source})",
        fix,
        "out-of-memory",
    )
