"""The logical names of the outputs of indexing, sorting and convolution primitives.

XLA's sharding propagation passes an operand's sharding through the dimensions an op
leaves whole: a ``gather``'s batch dimensions (the indices', and the operand's batching
dimensions: ``take_along_axis`` over the vocabulary keeps the batch split) and its
offset dimensions taken whole (an embedding lookup's ``embed``); a ``scatter``'s result
is its operand's, with the updates' names where they write whole dimensions (an
embedding's gradient, a ``take_along_axis``'s transpose); ``top_k``, ``sort`` and
cumulative ops keep every dimension but the one they work along; a convolution's output
takes the input's batch and spatial dimensions and the kernel's output features. Each
function here gives those names, from the primitive's own dimension numbers, to
:mod:`meshplan._search.predict.trace` (``None``: a dimension not named).

:data:`meshplan._search.predict.primitives.UNDERSTOOD` lists the primitives whose names
the trace gives as XLA would (with elementwise ops, matmuls, convolutions, loops and calls);
any other is priced conservatively (its outputs replicated, written to memory) and named in
the prediction, with where the model runs it (:func:`where`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

__all__ = [
    "conv_dims",
    "conv_names",
    "gather_names",
    "scatter_names",
    "scatter_update_names",
    "where",
]

Names = tuple[Any, ...]


def gather_names(
    p: Any,
    operand: Names,
    indices: Names,
    shapes: Sequence[tuple[int, ...]],
    out_shape: tuple[int, ...],
) -> Names:
    """A ``gather``'s output names: its batch dimensions the indices' (or, for batching
    dimensions, the operand's), its offset dimensions the operand's where taken whole.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.op_names import gather_names
        >>> j = jax.make_jaxpr(lambda t, i: jnp.take(t, i, axis=0))(jnp.ones((10, 4)),
        ...                                                      jnp.ones((2, 3), jnp.int32))
        >>> eqn = j.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns[-1]
        >>> shapes = [v.aval.shape for v in eqn.invars]
        >>> gather_names(eqn.params, ("vocab", "embed"), ("batch", None, None), shapes, (2, 3, 4))
        ('batch', None, 'embed')
    """
    dn = p["dimension_numbers"]
    op_shape, idx_shape = shapes[0], shapes[1]
    offset = tuple(dn.offset_dims)
    skipped = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
    kept = [d for d in range(len(op_shape)) if d not in skipped]
    batching = dict(
        zip(
            getattr(dn, "start_indices_batching_dims", ()),
            getattr(dn, "operand_batching_dims", ()),
            strict=True,
        )
    )
    slice_sizes = tuple(p.get("slice_sizes", op_shape))
    out: list[Any] = [None] * len(out_shape)
    batch_dims = [i for i in range(len(out_shape)) if i not in offset]
    for k, i in enumerate(batch_dims):  # the indices' dimensions, the index vector's left out
        if k < len(indices) - 1 or (k < len(indices) and idx_shape[k] == out_shape[i]):
            name = indices[k]
            if name is None and k in batching:
                name = operand[batching[k]]
            out[i] = name
    for i, d in zip(offset, kept, strict=False):
        if slice_sizes[d] == op_shape[d] == out_shape[i]:
            out[i] = operand[d]
    return tuple(out)


def scatter_names(
    p: Any, operand: Names, indices: Names, updates: Names, shapes: Sequence[tuple[int, ...]]
) -> Names:
    """A ``scatter``'s (``scatter-add``'s) output names: its operand's, where the operand
    has none the updates' window dimensions' and the indices' batching dimensions'.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.op_names import scatter_names
        >>> j = jax.make_jaxpr(jax.grad(lambda t, i: jnp.take(t, i, axis=0).sum()))(
        ...     jnp.ones((10, 4)), jnp.ones((2, 3), jnp.int32))
        >>> eqn = [e for e in j.jaxpr.eqns if e.primitive.name == "jit"][-1]
        >>> eqn = eqn.params["jaxpr"].jaxpr.eqns[-1]
        >>> shapes = [v.aval.shape for v in eqn.invars]
        >>> scatter_names(eqn.params, (None, None), ("batch",) + (None,) * 2,
        ...               ("batch", None, "embed"), shapes)
        (None, 'embed')
    """
    out = list(operand)
    window, batching = _scatter_dims(p, shapes)
    for u, d in window:
        if out[d] is None:
            out[d] = updates[u]
    for b, d, k in batching:
        if out[d] is None and k < len(indices):
            out[d] = indices[k]
        if out[d] is None and b is not None:
            out[d] = updates[b]
    return tuple(out)


def _scatter_dims(
    p: Any, shapes: Sequence[tuple[int, ...]]
) -> tuple[list[tuple[int, int]], list[tuple[int | None, int, int]]]:
    """A ``scatter``'s dimension pairs: ``(update dim, operand dim)`` of each whole window
    dimension, and ``(update dim or None, operand dim, index dim)`` of each batching one."""
    dn = p["dimension_numbers"]
    op_shape, upd_shape = shapes[0], shapes[-1]
    op_batching = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batching = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    skipped = set(dn.inserted_window_dims) | set(op_batching)
    kept = [d for d in range(len(op_shape)) if d not in skipped]
    window = [
        (u, d)
        for u, d in zip(dn.update_window_dims, kept, strict=False)
        if upd_shape[u] == op_shape[d]
    ]
    scatter_dims = [u for u in range(len(upd_shape)) if u not in set(dn.update_window_dims)]
    batching = [
        (scatter_dims[k] if k < len(scatter_dims) else None, d, k)
        for d, k in zip(op_batching, idx_batching, strict=True)
    ]
    return window, batching


def scatter_update_names(p: Any, out: Names, shapes: Sequence[tuple[int, ...]]) -> Names:
    """The names a ``scatter``'s updates take where its result is ``out``: each window
    dimension its result's dimension's, each dimension of a batching dimension its result's
    too, the other scatter dimensions none (the sharding XLA moves the updates to before
    scattering them locally: an embedding gradient's rows, split as the table is).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.op_names import scatter_update_names
        >>> j = jax.make_jaxpr(jax.grad(lambda t, i: jnp.take(t, i, axis=0).sum()))(
        ...     jnp.ones((10, 4)), jnp.ones((2, 3), jnp.int32))
        >>> eqn = [e for e in j.jaxpr.eqns if e.primitive.name == "jit"][-1]
        >>> eqn = eqn.params["jaxpr"].jaxpr.eqns[-1]
        >>> scatter_update_names(eqn.params, ("vocab", "embed"), [v.aval.shape for v in eqn.invars])
        (None, None, 'embed')
    """
    names: list[Any] = [None] * len(shapes[-1])
    window, batching = _scatter_dims(p, shapes)
    for u, d in window:
        names[u] = out[d]
    for b, d, _ in batching:
        if b is not None:
            names[b] = out[d]
    return tuple(names)


def conv_dims(p: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(lhs, rhs, out)`` layouts of a ``conv_general_dilated``: each as (batch or output
    feature, feature or input feature, spatial...) dimension indices."""
    dn = p["dimension_numbers"]
    return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)


def conv_names(p: Any, lhs: Names, rhs: Names, out_shape: tuple[int, ...]) -> Names:
    """A convolution's output names: the input's batch, the kernel's output features, the
    input's spatial dimensions where the output keeps their size (a ``'SAME'`` padding).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.op_names import conv_names
        >>> j = jax.make_jaxpr(lambda x, k: jax.lax.conv_general_dilated(
        ...     x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))(
        ...     jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 16)))
        >>> eqn = j.jaxpr.eqns[0]
        >>> conv_names(eqn.params, ("batch", None, None, None), (None, None, None, "mlp"),
        ...            (2, 8, 8, 16))
        ('batch', None, None, 'mlp')
    """
    ls, rs, os_ = conv_dims(p)
    out: list[Any] = [None] * len(out_shape)
    if p.get("batch_group_count", 1) == 1:
        out[os_[0]] = lhs[ls[0]]
    out[os_[1]] = rhs[rs[0]]
    return tuple(out)


def where(eqn: Any) -> str:
    """Where the model runs ``eqn``: its scope of modules and transformations, and the
    line of the user's code (``'Block_0/attention (model.py:42)'``; what JAX's own
    errors print).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.op_names import where
        >>> j = jax.make_jaxpr(lambda x: jax.lax.cumsum(x))(jnp.ones(4))
        >>> where(j.jaxpr.eqns[0]).startswith("<doctest")
        True
    """
    scope = str(eqn.source_info.name_stack)
    try:
        from jax._src import source_info_util

        line = source_info_util.summarize(eqn.source_info)
    except (ImportError, AttributeError):  # JAX moved it: the scope alone
        line = ""
    if scope and line:
        return f"{scope} ({line})"
    return scope or line or "?"


def cuts(
    prim: str,
    params: Any,
    shapes: Sequence[tuple[int, ...]],
    out_shapes: Sequence[tuple[int, ...]],
) -> tuple[str, int, tuple[tuple[int, int], ...]] | None:
    """The pieces a ``split``, ``slice`` or ``concatenate`` cuts one dimension into:
    ``('in' or 'out': the whole array's side, the dimension, each piece's (start, stop))``.
    A slice has one piece, the part it keeps.

    Example:
        >>> from meshplan._search.predict.op_names import cuts
        >>> cuts("split", {"axis": 2, "sizes": (64, 64, 64)}, [(8, 32, 192)], [(8, 32, 64)] * 3)
        ('in', 2, ((0, 64), (64, 128), (128, 192)))
        >>> cuts("concatenate", {"dimension": 0}, [(3, 4), (5, 4)], [(8, 4)])
        ('out', 0, ((0, 3), (3, 8)))
        >>> cuts("slice", {"start_indices": (0, 0), "limit_indices": (4, 128), "strides": None},
        ...      [(4, 129)], [(4, 128)])
        ('in', 1, ((0, 128),))
    """
    if prim == "split":
        ends = list(itertools.accumulate(int(s) for s in params["sizes"]))
        return "in", int(params["axis"]), tuple(itertools.pairwise([0, *ends]))
    if prim == "concatenate":
        dim = int(params["dimension"])
        ends = list(itertools.accumulate(s[dim] for s in shapes))
        return "out", dim, tuple(itertools.pairwise([0, *ends]))
    if prim == "slice" and shapes and not any(s != 1 for s in params.get("strides") or ()):
        cut = [
            (d, ((int(lo), int(hi)),))
            for d, (lo, hi, n) in enumerate(
                zip(params["start_indices"], params["limit_indices"], shapes[0], strict=True)
            )
            if (lo, hi) != (0, n)
        ]
        if len(cut) == 1:
            return "in", cut[0][0], cut[0][1]
    return None
