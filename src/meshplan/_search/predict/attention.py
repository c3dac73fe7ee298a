"""Attention's matmuls as a fused (flash) kernel runs them.

The trace (:mod:`meshplan._search.predict.trace`) marks the matmuls that read or write attention
scores (``Workload.score_dots``: q·kᵀ, p·v and their gradients, as XLA's unfused program
has them) and the score arrays a constant mask selects from (``Workload.causal_masks``:
a causal mask built from iotas, as ``jax.nn.dot_product_attention(..., is_causal=True)``
and most decoders write it). On a backend with fused attention
(``HardwareProfile.fused_attention``) those matmuls run as one kernel, priced here:

* at the kernel's own fraction of the peak (``HardwareProfile.attention_efficiency``),
  not the weight matmuls' (``matmul_efficiency``): flash kernels keep their tiles'
  softmax on chip and reach a different fraction of peak than large GEMMs; below a head
  dimension where the softmax bounds the kernel (``attention_head_dim``: Pallas' kernels on
  a TPU v5e take the same time per score at head dimension 64 as at 128), that fraction
  falls with the head dimension (:func:`head_dim`);
* under a causal mask, only the blocks of ``causal_block`` keys that are not wholly
  masked run: ``(n + 1) / 2n`` of the scores for ``n`` blocks along the keys (FlashAttention
  2 and 3, cuDNN's and Pallas' splash kernels skip them);
* the backward kernel recomputes the scores (q·kᵀ) from the saved log-sum-exp rather than
  read the probabilities the unfused program keeps: one more score-sized matmul per
  backward pass. The unfused program has per attention one score-producing matmul in the
  forward pass (q·kᵀ) and one in the backward (dP = dO·vᵀ), and one score-reading matmul
  in the forward (p·v) and three in the backward (dV, dQ, dK), each of the same FLOPs; a
  rematerialised forward adds one of each. So the backward passes number half the
  difference of the reading and the producing ones, whatever the remat.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from meshplan._search.predict.trace import Dot

__all__ = ["causal_fraction", "flash_recompute", "head_dim", "is_causal", "produces_scores"]


def produces_scores(dot: Dot) -> bool:
    """Whether ``dot``'s output is larger than both its operands: q·kᵀ (or dP = dO·vᵀ).

    Example:
        >>> from meshplan._search.predict.attention import produces_scores
        >>> from meshplan._search.predict.trace import Dot
        >>> qk = Dot(("batch", None, "heads", "kv"), ("batch", None, "heads", "kv"),
        ...          (2, 64, 4, 16), (2, 64, 4, 16), ((3,), (3,)), ((0, 2), (0, 2)), 4, 2, 2)
        >>> produces_scores(qk)
        True
    """
    return _out_size(dot) > max(math.prod(dot.lhs_shape), math.prod(dot.rhs_shape))


def _out_size(dot: Dot) -> int:
    (lc, rc), (_, rb) = dot.contract, dot.batch
    rhs_free = math.prod(s for j, s in enumerate(dot.rhs_shape) if j not in rc and j not in rb)
    return math.prod(s for i, s in enumerate(dot.lhs_shape) if i not in lc) * rhs_free


def _score_shape(dot: Dot) -> tuple[int, ...]:
    """The shape of the score array ``dot`` reads or writes (its output or larger operand)."""
    if produces_scores(dot):
        (lc, rc), (lb, rb) = dot.contract, dot.batch
        return (
            *(dot.lhs_shape[i] for i in lb),
            *(s for i, s in enumerate(dot.lhs_shape) if i not in lc and i not in lb),
            *(s for j, s in enumerate(dot.rhs_shape) if j not in rc and j not in rb),
        )
    if math.prod(dot.lhs_shape) >= math.prod(dot.rhs_shape):
        return dot.lhs_shape
    return dot.rhs_shape


def head_dim(dot: Dot) -> float:
    """The FLOPs per score of ``dot`` over two: the head dimension (q·kᵀ contracts it, p·v
    and the gradients keep it).

    Example:
        >>> from meshplan._search.predict.attention import head_dim
        >>> from meshplan._search.predict.trace import Dot
        >>> qk = Dot(("batch", None, "heads", "kv"), ("batch", None, "heads", "kv"),
        ...          (2, 64, 4, 16), (2, 64, 4, 16), ((3,), (3,)), ((0, 2), (0, 2)), 4, 2, 2)
        >>> head_dim(qk)
        16.0
    """
    contracted = math.prod(dot.lhs_shape[i] for i in dot.contract[0])
    return _out_size(dot) * contracted / math.prod(_score_shape(dot))


def is_causal(dot: Dot, masks: Iterable[tuple[int, int]]) -> tuple[int, int] | None:
    """The ``(queries, keys)`` of the constant mask ``dot``'s scores are selected by, if any.

    Example:
        >>> from meshplan._search.predict.attention import is_causal
        >>> from meshplan._search.predict.trace import Dot
        >>> qk = Dot(("batch", None, "heads", "kv"), ("batch", None, "heads", "kv"),
        ...          (2, 64, 4, 16), (2, 64, 4, 16), ((3,), (3,)), ((0, 2), (0, 2)), 4, 2, 2)
        >>> is_causal(qk, {(64, 64)}), is_causal(qk, {(128, 128)})
        ((64, 64), None)
    """
    shape = list(_score_shape(dot))
    for q, k in masks:
        rest = list(shape)
        if q in rest:
            rest.remove(q)
            if k in rest:
                return q, k
    return None


def causal_fraction(queries: int, keys: int, block: int) -> float:
    """The fraction of a causal score matrix a kernel with ``block``-wide tiles computes.

    Example:
        >>> from meshplan._search.predict.attention import causal_fraction
        >>> causal_fraction(2048, 2048, 128)     # 16 blocks: 136 of 256 tiles
        0.53125
        >>> causal_fraction(2048, 2048, 0)       # no blocks skipped
        1.0
    """
    if block <= 0:
        return 1.0
    nq, nk = -(-queries // block), -(-keys // block)
    # query block i (of nq) sees key blocks up to its diagonal, offset when keys > queries
    seen = sum(min(nk, nk - nq + i + 1) for i in range(nq))
    return max(seen, 0) / (nq * nk)


def flash_recompute(producing: float, reading: float) -> float:
    """The FLOPs a flash backward adds by recomputing q·kᵀ: one score-sized matmul per
    backward pass, half the excess of the score-reading matmuls' FLOPs over the
    score-producing ones' (module docstring).

    Example:
        >>> from meshplan._search.predict.attention import flash_recompute
        >>> flash_recompute(producing=2.0, reading=4.0)   # no remat: 1 backward
        1.0
        >>> flash_recompute(producing=1.0, reading=1.0)   # inference: none
        0.0
    """
    return max(0.0, reading - producing) / 2
