"""What each JAX primitive is to the planner: one classification, each primitive listed once.

:data:`KINDS` puts every primitive the planner knows in one kind; every set the trace and the
memory model ask is a union of kinds (:data:`ELEMENTWISE`, :data:`RECOMPUTED`,
:data:`FUSES_OPERANDS`, :data:`EXPENSIVE`, :data:`BOUNDARY`, :data:`UNDERSTOOD`, :data:`REMAT`),
so no list is written twice. A primitive in no kind is one the planner does not understand:
priced conservatively and named in the prediction (:mod:`meshplan._search.predict.op_names`).
"""

from __future__ import annotations

__all__ = [
    "BOUNDARY",
    "CALL_PARAMS",
    "ELEMENTWISE",
    "EXPENSIVE",
    "FUSES_OPERANDS",
    "KINDS",
    "MATMULS",
    "RECOMPUTED",
    "REMAT",
    "SAME_LAYOUT",
    "UNDERSTOOD",
    "kind",
]


def _named(names: str) -> frozenset[str]:
    return frozenset(names.split())


KINDS: dict[str, frozenset[str]] = {
    # Elementwise ops XLA recomputes where their value is used rather than keep it: fusion
    # duplicates them into each consumer, and the rematerialisation pass, run against the
    # device's memory on GPU and TPU, recomputes them from operands alive anyway (a norm's
    # float32 copy, an activation's derivative, a one-hot of the targets).
    "cheap": _named(
        "abs add add_any and eq ge gt integer_pow le lt max min mul ne neg not or sign square"
        " sub xor"
    ),
    # The same, and expensive in XLA's ``InstructionFusion::IsExpensive`` (transcendentals, a
    # division by a value that is not a constant, square roots): fusion never duplicates one
    # into several consumers, so a value one computes, read on both sides of an op that ends
    # a fusion (tanh-GELU's tanh, softmax's exponentials), is written to memory once.
    "costly": _named(
        "cos div erf erf_inv exp exp2 expm1 log log1p logistic pow rsqrt sin sqrt tanh"
    ),
    # Expensive elementwise ops the memory model does not recompute. ``erfc`` (exact GELU's)
    # is no HLO op: XLA expands it through ``exp``, so it is as expensive (read in moe-dp's
    # buffer assignment: exact GELU's erfc and the exp(-x^2) of its derivative both kept
    # from the forward pass to the experts' backward, [batch, seq, expert, mlp] each).
    "costly_kept": _named("atan2 cbrt erfc tan"),
    # The other elementwise ops (lax's): every dimension of the result is an operand's.
    "elementwise": _named(
        "acos acosh asin asinh atan atanh ceil clz complex conj cosh digamma floor igamma"
        " igammac imag is_finite lgamma mulhi nextafter polygamma population_count real"
        " regularized_incomplete_beta rem round shift_left shift_right_arithmetic"
        " shift_right_logical sinh zeta bessel_i0e bessel_i1e random_gamma_grad"
    ),
    # Broadcasts, casts, slices and reshapes around elementwise ops: fused, recomputed too
    # (``tile``, ``jnp.tile``'s primitive: CLIP's class token, a broadcast XLA fuses).
    "layout": _named(
        "broadcast_in_dim convert_element_type copy copy_p expand_dims iota reshape select_n"
        " slice split squeeze stop_gradient pad tile"
    ),
    # Reductions that read a recomputed operand inside their own fusion (a norm's statistic).
    "reduction": _named(
        "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin"
    ),
    # Indexing, sorting and scans over an axis that end a fusion (their output is in memory).
    "indexing": _named(
        "gather scatter scatter-add scatter_add dynamic_slice dynamic_update_slice sort cumsum"
        " cumprod cummax cumlogsumexp argsort top_k"
    ),
    # Pooling: window reductions (``nn.max_pool``, ``nn.avg_pool``) and the max-pool's
    # gradient, which scatters to the selected inputs: each a kernel of its own, its output
    # in memory; a dimension the window leaves whole keeps its name (the batch, features).
    "window": _named(
        "reduce_window reduce_window_sum reduce_window_max reduce_window_min"
        " select_and_scatter_add select_and_gather_add"
    ),
    # The other ops whose names the trace gives as XLA would: structure, sharding, randomness.
    "structure": _named(
        "transpose concatenate rev clamp scatter-mul scatter_mul scatter-min scatter_min"
        " scatter-max scatter_max cummin reduce_xor reduce_precision bitcast_convert_type"
        " optimization_barrier sharding_constraint mesh_cast reshard pvary random_bits"
        " random_seed random_wrap random_unwrap random_fold_in random_split threefry2x32"
        " rng_bit_generator rng_uniform"
    ),
    "matmul": frozenset({"dot_general", "conv_general_dilated"}),
    "loop": frozenset({"scan", "while", "cond"}),
    # Calls whose body is rematerialised (``jax.checkpoint``, ``nn.remat``).
    "remat": frozenset({"remat", "remat2", "checkpoint"}),
    "call": _named(
        "pjit jit closed_call core_call custom_jvp_call custom_vjp_call custom_vjp_call_jaxpr"
    ),
    "collective": _named("all_gather psum all_to_all ppermute reduce_scatter"),
    # Ops that end a fusion and whose names the trace does not know.
    "opaque": frozenset({"fft", "custom_call"}),
}
"""Each known primitive's kind (module docstring)."""

_KIND_OF = {prim: name for name, prims in KINDS.items() for prim in prims}


def kind(primitive: str) -> str | None:
    """The kind of ``primitive`` in :data:`KINDS` (``None``: one the planner does not know).

    Example:
        >>> from meshplan._search.predict.primitives import kind
        >>> kind("tanh"), kind("dot_general"), kind("my_kernel")
        ('costly', 'matmul', None)
    """
    return _KIND_OF.get(primitive)


def _union(*kinds: str) -> frozenset[str]:
    return frozenset().union(*(KINDS[k] for k in kinds))


ELEMENTWISE = _union("cheap", "costly", "costly_kept", "elementwise")
"""Elementwise ops: every dimension of the result is an operand's (or a broadcast's)."""

RECOMPUTED = _union("cheap", "costly", "layout")
"""What XLA recomputes where its value is used rather than keep it (``"cheap"``)."""

FUSES_OPERANDS = RECOMPUTED | KINDS["reduction"]
"""Ops that read a recomputed value inside their own fusion, with no buffer for it; also
what XLA may recompute: those ops and the reductions over them (a norm's statistic)."""

EXPENSIVE = _union("costly", "costly_kept")
"""XLA's ``InstructionFusion::IsExpensive`` elementwise ops (``"costly"``)."""

BOUNDARY = _union("matmul", "loop", "remat", "call", "indexing", "window", "collective", "opaque")
"""Ops after which XLA writes a value to memory: what a loop fusion cannot hold in registers
(matmuls, control flow, calls, data movement, collectives). Elementwise ops, broadcasts,
reshapes and reductions fuse into their neighbours."""

UNDERSTOOD = _union("layout", "reduction", "indexing", "window", "structure")
"""The primitives besides elementwise ops, matmuls, loops and calls whose names the trace
gives as XLA would."""

REMAT = KINDS["remat"]
"""Rematerialised calls."""

MATMULS = KINDS["matmul"]
"""The ops priced as matmuls (:class:`meshplan._search.predict.trace.Dot`): a convolution is
the matmul of its unfolded input, its weight gathered and its gradient reduced as one's."""

SAME_LAYOUT = frozenset({"add", "add_any", "sub", "neg", "mul", "convert_element_type"})
"""Elementwise ops whose operands XLA's sharding propagation gives their result's sharding."""

CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")
"""The parameters that hold a call's body (``pjit``, ``remat``, custom derivatives)."""
