"""The notes a prediction carries where a weight's split spreads into the layers: an
embedding lookup's table, a class token's head.

Under FSDP (``('batch', 'fsdp'), ('embed', 'fsdp')``) an embedding table is split on
``embed`` over the axis the batch is split over. XLA's sharding propagation gives the
lookup's rows the table's sharding (its indices gathered whole), and the activations that
follow carry it: the layers run on the whole batch split by ``embed``, each projection's
partial sums all-reduced whole and its input gathered whole. A logical constraint of the
lookup's output to the batch resets it (:data:`meshplan._search.predict.trace.Workload`'s
``lookups`` are the lookups no constraint names).
"""

from __future__ import annotations

from collections.abc import Callable

from meshplan._search.predict.trace import Names, Workload

__all__ = ["lookup_notes"]

Resolve = Callable[[Names, int], tuple[tuple[str, ...], ...]]


def lookup_notes(workload: Workload, resolve: Resolve) -> tuple[str, ...]:
    """A note per embedding lookup whose table is split over the mesh axes of its batch.

    ``resolve(names, ndim)``: the mesh axes of each dimension of an array named ``names``.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.predict.lookups import lookup_notes
        >>> from meshplan._spmd.rules import split_axes
        >>> t = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((256, 64), jnp.float32), ("vocab", "embed"))
        >>> work = meshplan.trace_workload(lambda s, x: jnp.take(s["t"].value, x, axis=0).sum(),
        ...                                {"t": t}, jax.ShapeDtypeStruct((16, 32), jnp.int32),
        ...                                read_constraints=True)
        >>> fsdp = (("batch", "fsdp"), ("embed", "fsdp"))
        >>> [note] = lookup_notes(work, lambda n, d: split_axes(n, fsdp, {"fsdp": 8}))
        >>> note.split("; ")[1][:57]
        "constrain the lookup's output to ('batch', None, 'embed')"
        >>> lookup_notes(work, lambda n, d: split_axes(n, (("batch", "data"),), {"data": 8}))
        ()
    """
    notes = []
    for (made, picked, where), runs in workload.lookups.items():
        batch = {a for axes in resolve(picked, len(picked)) for a in axes}
        shared = _split_with(made, resolve, batch)
        if shared is None:
            continue
        name, over = shared
        wanted = tuple(p if p is not None else m for p, m in zip(picked, made, strict=True))
        fix = _fix("the lookup's output", wanted, name, over)
        notes.append(
            f"the embedding lookup at {where} ({runs} runs) reads a table split on {name!r} "
            f"over {over!r}, the mesh axis its batch is split over: XLA's sharding propagation "
            f"gives its rows the table's split, and the layers after it run on the whole batch "
            f"split by {name!r} (each projection's partial sums all-reduced whole, its input "
            f"gathered whole); {fix}"
        )
    return (*notes, *_head_note(workload, resolve))


def _split_with(names: Names, resolve: Resolve, batch: set[str]) -> tuple[str, str] | None:
    """The first of ``names`` split over a mesh axis of ``batch``, and its axes (``a+b``)."""
    for name, axes in zip(names, resolve(names, len(names)), strict=True):
        if set(axes) & batch:
            return name, "+".join(axes)
    return None


def _fix(what: str, wanted: Names, name: str, over: str) -> str:
    """The fix both notes name: a constraint, or a name no rule maps to the batch's axes."""
    return (
        f"constrain {what} to {wanted!r} (nn.with_logical_constraint), or give the "
        f"activations' {name!r} a logical name of its own that no rule maps to {over!r}"
    )


def _head_note(workload: Workload, resolve: Resolve) -> tuple[str, ...]:
    """A note where a class token's head reads a weight split over the batch's mesh axes."""
    if workload.head is None:
        return ()
    names, where = workload.head
    shared = _split_with(names, resolve, {a for axes in resolve(("batch",), 1) for a in axes})
    if shared is None:
        return ()
    name, over = shared
    fix = _fix("the layers' activations", ("batch", None, name), name, over)
    return (
        f"the head at {where} reads one position of the sequence (a class token) with a "
        f"weight split on {name!r} over {over!r}, the mesh axis its batch is split over: "
        f"XLA's sharding propagation carries that split back into the layers, which run "
        f"on the whole batch split by {name!r} (the inputs gathered whole); {fix}",
    )
