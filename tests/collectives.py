"""Reading compiled steps for the parallelism tests: collectives and the devices they span."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import meshplan

_GROUPS = re.compile(
    r"replica_groups=(\{\{[0-9,{}]*\}\}|\[[0-9,]+\]<=\[[0-9,]+\](?:T\([0-9,]+\))?"
    r"|mesh\[[^\]]*\] \{[^}]*\})"
)


def replica_groups(text: str) -> list[frozenset[int]]:
    """The device groups of one ``replica_groups=...`` attribute (explicit, iota or mesh form).

    The mesh form, ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}``: the device ids laid out
    row-major in that shape, one group along the named axes for every position of the others.
    """
    if text.startswith("mesh["):
        shape_text, _, grouped_text = text[5:].partition("] {")
        axes = re.findall(r"'([^']+)'=(\d+)", shape_text)
        names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
        grouped = [names.index(a) for a in re.findall(r"'([^']+)'", grouped_text)]
        ids = np.arange(int(np.prod(sizes))).reshape(sizes)
        rest = [i for i in range(len(sizes)) if i not in grouped]
        size = int(np.prod([sizes[i] for i in grouped]))
        rows = ids.transpose(rest + grouped).reshape(-1, size)
        return [frozenset(int(d) for d in row) for row in rows]
    if text.startswith("{{"):
        return [
            frozenset(int(d) for d in g.split(",") if d) for g in re.findall(r"\{([0-9,]+)\}", text)
        ]
    shape_text, rest = text[1:].split("]<=[", 1)
    shape = [int(s) for s in shape_text.split(",")]
    source_text, _, perm = rest.partition("]")
    source = [int(s) for s in source_text.split(",")]
    ids = np.arange(int(np.prod(source))).reshape(source)
    if perm.startswith("T("):
        ids = ids.transpose([int(s) for s in perm[2:-1].split(",")])
    return [frozenset(int(d) for d in row) for row in ids.reshape(shape)]


def collective_groups(hlo: str, kind: str) -> list[list[frozenset[int]]]:
    """The replica groups of every ``kind`` collective (``all-to-all``, ``all-gather``, ...)."""
    found = []
    for line in hlo.splitlines():
        if re.search(rf"\s{re.escape(kind)}(-start)?\(", line):
            match = _GROUPS.search(line)
            if match:
                found.append(replica_groups(match.group(1)))
    return found


def axis_groups(mesh: jax.sharding.Mesh, axis: str) -> set[frozenset[int]]:
    """The groups of devices (by their index in the mesh's flat device list) along ``axis``."""
    names = list(mesh.axis_names)
    ids = np.arange(mesh.size).reshape(mesh.devices.shape)
    moved = np.moveaxis(ids, names.index(axis), -1).reshape(-1, mesh.shape[axis])
    return {frozenset(int(d) for d in row) for row in moved}


def train_losses(
    init: Callable[[jax.Array], Any],
    loss: Callable[[Any, Any], jax.Array],
    batches: list[np.ndarray],
    mesh: jax.sharding.Mesh,
    rules: Any,
    lr: float = 3e-3,
) -> list[float]:
    """Losses of ``len(batches)`` AdamW steps of ``loss``, the state placed by ``rules`` on ``mesh``."""
    tx = optax.adamw(lr)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        abstract = jax.eval_shape(init, jax.random.key(0))
        shardings = meshplan.get_sharding(abstract, mesh, strict=True)
        params = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
        opt_state = jax.jit(tx.init)(params)

        @jax.jit
        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            value, grads = jax.value_and_grad(loss)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        losses = []
        for batch in batches:
            params, opt_state, value = step(params, opt_state, batch)
            losses.append(float(value))
    return losses


def counting_batches(steps: int, batch: int = 8, length: int = 32) -> list[np.ndarray]:
    """Counting sequences (random start and stride) of ``length + 1`` tokens: learnable fast."""
    rng = np.random.default_rng(0)
    out = []
    for _ in range(steps):
        start = rng.integers(0, 256, (batch, 1))
        stride = rng.integers(1, 4, (batch, 1))
        out.append(((start + stride * np.arange(length + 1)) % 256).astype(np.int32))
    return out
