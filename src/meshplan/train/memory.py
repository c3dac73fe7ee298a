"""Whether a train step fits in a device: the planner's prediction against what a device holds.

There is one memory model: the planner's (:mod:`meshplan._search.predict.memory`, the liveness of
the differentiated step's jaxpr, by logical names), which ``meshplan plan --profile`` and
``meshplan search`` report. :func:`memory_shortfall` traces the step a run will take (one
batch, with its optimizer), asks the planner for its peak per device under the run's mesh
and rules, and compares it with what a device holds (:func:`device_memory`). It says only
what the planner says cannot fit, as numbers (:class:`MemoryShortfall`): the caller words
them, and the fix, in its own terms (the command line's are flags).
"""

from __future__ import annotations

import dataclasses
import os

import jax
from jax.sharding import Mesh

from meshplan._search.predict.cost import Cost, predict
from meshplan._search.predict.profiles import get_profile, with_attention
from meshplan._search.predict.trace import trace_workload
from meshplan._spmd.rules import LogicalRules
from meshplan._text import human_bytes
from meshplan._types import PyTree
from meshplan.train.model import TrainModel

__all__ = ["MemoryShortfall", "device_memory", "largest_batch", "memory_shortfall", "step_memory"]

_HOST_BASELINE = 1 << 30
"""Host memory a CPU run needs besides its arrays (Python, JAX, XLA's compiler): about 1 GiB."""


@dataclasses.dataclass(frozen=True)
class MemoryShortfall:
    """A step that does not fit in a device (code ``'out-of-memory'``), in bytes per device.

    Attributes:
        need: What the step needs at its peak.
        state: Of which the state (parameters and optimizer state); the rest
            (activations, gradients, temporaries and the batch) grows with the batch.
        limit: What a device holds.
        source: Where ``limit`` comes from, in words.
        fits: The largest batch (rows of one step) whose step the planner fits in
            ``limit``, checked by predicting it (0: not one row); ``None``: not found.
    """

    need: int
    state: int
    limit: int
    source: str
    code: str = "out-of-memory"
    fits: int | None = None


def device_memory(mesh: Mesh) -> tuple[int, str] | None:
    """Bytes one device can hold, and where that number comes from; ``None`` if unknown.

    Emulated CPU devices share the host's memory: what is available now (not the total),
    less the process's own baseline and a 20% margin, split between the mesh's devices on
    this host (not every emulated device: a 2x4 mesh on 4,096 emulated devices uses 8).

    Example:
        >>> import jax
        >>> from meshplan.train.memory import device_memory
        >>> limit, source = device_memory(jax.make_mesh((2, 4), ("data", "model")))
        >>> limit > 0, "CPU device" in source
        (True, True)
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
    model: TrainModel, abstract: PyTree, batch: PyTree, mesh: Mesh, rules: LogicalRules
) -> Cost:
    """The planner's prediction of one train step of ``batch`` on ``mesh`` under ``rules``.

    ``abstract``: the state with the run's optimizer (its update is part of the step).
    Attention scores count as held on the CPU, and as fused away on accelerators, so an
    accelerator run is refused only when even the fused step cannot fit.
    """
    # On an accelerator the scores count as fused away (attention="flash"): a step is
    # refused only when even a flash kernel's step could not fit.
    attention = "xla" if mesh.devices.flat[0].platform == "cpu" else "flash"
    profile = with_attention(get_profile("cpu", mesh.devices.size), attention)
    work = trace_workload(model.step, abstract, batch, rules)
    return predict(work, dict(mesh.shape), rules, profile)


def memory_shortfall(
    model: TrainModel, abstract: PyTree, batch: PyTree, mesh: Mesh, rules: LogicalRules
) -> MemoryShortfall | None:
    """How a step of ``batch`` does not fit in a device, or ``None`` (it fits, or a
    device's memory is not known).

    ``batch`` is what a device holds at a time: with gradient accumulation, one
    microbatch (``jax.ShapeDtypeStruct``\\ s will do).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
        >>> from meshplan.train.memory import memory_shortfall
        >>> from meshplan.train.model import TrainModel
        >>> net = nn.Dense(4)
        >>> def loss(params, x):
        ...     return jnp.mean(net.apply({"params": params}, x) ** 2)
        >>> model = TrainModel(net, loss, jax.ShapeDtypeStruct((8, 16), jnp.float32))
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> print(memory_shortfall(model, model.abstract_state(optax.sgd(0.1)),
        ...                        jax.ShapeDtypeStruct((8, 16), jnp.float32), mesh, ()))
        None
    """
    found = device_memory(mesh)
    if found is None:
        return None
    limit, source = found
    cost = step_memory(model, abstract, batch, mesh, rules)
    if cost.memory_bytes <= limit:
        return None
    try:
        fits: int | None = largest_batch(
            model, abstract, batch, mesh, rules, limit, cost.memory_bytes
        )
    except Exception:  # a step that traces only at its own batch (a fixed reshape of it):
        fits = None  # the advice estimates the largest batch from this one step instead
    return MemoryShortfall(cost.memory_bytes, cost.state_bytes, limit, source, fits=fits)


def largest_batch(
    model: TrainModel,
    abstract: PyTree,
    batch: PyTree,
    mesh: Mesh,
    rules: LogicalRules,
    limit: int,
    need: int,
) -> int:
    """The largest batch (rows, the first dimension of ``batch``'s arrays) whose step the
    planner fits in ``limit`` bytes per device; ``need``: the step's at ``batch``.

    A line through the step's need at ``batch`` and at half of it (what does not grow with
    the batch, the state and the gradients, and what does), then the batch it gives is
    predicted, and made smaller while it does not fit (the largest point of a smaller step
    may be another one): at most four predictions more.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
        >>> from meshplan.train.memory import largest_batch, step_memory
        >>> from meshplan.train.model import TrainModel
        >>> net = nn.Dense(64)
        >>> def loss(params, x):
        ...     return jnp.mean(net.apply({"params": params}, x) ** 2)
        >>> x = jax.ShapeDtypeStruct((4096, 64), jnp.float32)
        >>> model = TrainModel(net, loss, x)
        >>> state, mesh = model.abstract_state(optax.sgd(0.1)), jax.make_mesh((2, 4), ("data", "model"))
        >>> need = step_memory(model, state, x, mesh, (("batch", "data"),)).memory_bytes
        >>> rows = largest_batch(model, state, x, mesh, (("batch", "data"),), need // 2, need)
        >>> 0 < rows < 4096
        True
        >>> fit = jax.ShapeDtypeStruct((rows, 64), jnp.float32)
        >>> step_memory(model, state, fit, mesh, (("batch", "data"),)).memory_bytes <= need // 2
        True
    """
    n = _rows(batch)
    half = max(n // 2, 1)
    at_half = step_memory(model, abstract, _resized(batch, half), mesh, rules).memory_bytes
    slope = (need - at_half) / max(n - half, 1)
    fixed = need - slope * n
    if slope <= 0 or fixed >= limit:
        return 0
    rows = min(int((limit - fixed) // slope), n - 1)
    for _ in range(3):
        if rows <= 0:
            return 0
        got = step_memory(model, abstract, _resized(batch, rows), mesh, rules).memory_bytes
        if got <= limit:
            return rows
        rows = min(rows - 1, int(rows * (limit - fixed) / max(got - fixed, 1)))
    return 0


def _rows(batch: PyTree) -> int:
    """The rows of a batch: its arrays' first dimension."""
    return int(jax.tree.leaves(batch)[0].shape[0])


def _resized(batch: PyTree, rows: int) -> PyTree:
    """``batch`` as abstract arrays of ``rows`` rows."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch)
