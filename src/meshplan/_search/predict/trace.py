"""A step function's work, traced once: its matmuls and its memory traffic, by logical names.

:func:`trace_workload` runs ``jax.make_jaxpr`` on the *global* (unsharded)
step, once, with abstract inputs (no device, no compile), and walks the jaxpr
carrying a logical name per array dimension: the state's names come from its
boxes or NNX variables (the one leaf walk), each batch array's first dimension
is ``'batch'``. Names flow through the ops: a ``dot_general``'s output takes
its operands' batch and free dimensions' names, elementwise ops and
broadcasts keep them, transposes permute them, a reshape keeps the names of
the dimensions it leaves whole, reductions drop theirs; ``scan`` bodies are
walked once and counted ``length`` times, calls (``pjit``, ``remat``, custom
derivatives) are walked inline. Anything else gives unnamed (replicated)
dimensions.

The result, a :class:`Workload`, is what :mod:`meshplan._search.predict.cost` prices
under any mesh and rules: every ``dot_general`` (operand names and shapes,
FLOPs) and the bytes every other op writes, grouped by their names so a
candidate is priced in a few hundred operations, whatever the model's depth.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from meshplan._search.predict import memory, op_names
from meshplan._search.predict.fusion_reads import REDUCTIONS, FusionReads
from meshplan._search.predict.jaxpr_facts import call_body, facts, is_alias, live
from meshplan._search.predict.memory import MemoryProgram
from meshplan._search.predict.primitives import (
    BOUNDARY,
    CALL_PARAMS,
    ELEMENTWISE,
    SAME_LAYOUT,
    UNDERSTOOD,
)
from meshplan._spmd.leaves import array_leaves
from meshplan._spmd.rules import LogicalRules

__all__ = ["Dot", "ThroughputUnit", "Workload", "trace_workload"]

ThroughputUnit: typing.TypeAlias = typing.Literal["tokens", "examples"]
"""What a step's ``tokens`` count: token ids, or examples of a batch without them."""

Names = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Dot:
    """One ``dot_general`` signature: operand names and shapes, its dimension numbers.

    ``count``: how many times a step runs it (scan trips included); ``itemsize``:
    bytes per element of its output; ``out_names``: the names of its output's buffer
    where a logical constraint it flows into names it otherwise (``None`` where not):
    XLA produces the output in that sharding (partial sums reduce-scattered into it).
    A convolution is the matmul of its unfolded input (``[batch, *spatial, features x
    window]`` by ``[features x window, out features]``: its FLOPs), ``lhs_size`` the
    elements of the input as stored (read once, not once per window position).
    """

    lhs_names: Names
    rhs_names: Names
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    contract: tuple[tuple[int, ...], tuple[int, ...]]
    batch: tuple[tuple[int, ...], tuple[int, ...]]
    itemsize: int
    lhs_itemsize: int
    rhs_itemsize: int
    out_names: Names | None = None
    lhs_size: int | None = None

    @functools.cached_property
    def flops(self) -> int:
        """Global FLOPs of one run: 2 x every dimension's size (batch, free, contracting)."""
        lhs = math.prod(self.lhs_shape)
        rhs_free = math.prod(
            s for i, s in enumerate(self.rhs_shape) if i not in self.contract[1] + self.batch[1]
        )
        return 2 * lhs * rhs_free


@dataclasses.dataclass
class Workload:
    """What a step does, as :func:`trace_workload` found it.

    ``dots``: ``{Dot: count}``; ``traffic``: ``{(names, shape, score): bytes}`` that
    XLA's fusions read and write in memory per step (values a fusion keeps in
    registers are not counted: :func:`materialized`); ``score`` marks attention
    scores, which a fused attention kernel never writes; ``state``: ``[(names,
    shape, itemsize)]`` of the state's arrays (``None`` names: unboxed); ``names``:
    every logical name seen, in order of first appearance (state first);
    ``memory``: the liveness program (:mod:`meshplan._search.predict.memory`) of the step, with
    cheap residuals recomputed where used (as XLA does on TPU and GPU), ``memory_kept``
    the same with every residual kept (XLA on CPU), ``memory_late`` that in XLA:CPU's
    depth-first order, the gradients' reductions off its path deferred
    (:func:`meshplan._search.predict.memory.late_moves`);
    ``score_dots``: the dots that read or write attention scores; ``batch_state``: the
    batch arrays (names, shape, itemsize); ``tokens``: tokens (or examples) per step,
    ``tokens_unit`` says which (``'tokens'`` when the first batch array holds integer
    token ids);
    ``dot_trips``: ``{Dot: trips}``, the loop trips of one run (:meth:`trips`);
    ``operand_arrays``: ``{(Dot, side): indices in arrays}``, the arrays each matmul's
    operand reads (one array read by several matmuls is gathered once for them), and
    ``arrays``: per array ``(trips, whether both passes read it, whether a logical
    constraint names it)``: the loop trips it is made in, and whether the forward and the
    backward pass (autodiff's transpose) both read it, where an accelerator gathers it
    again rather than keep the gathered copy (XLA:CPU too, where no constraint names it);
    ``weight_reads``: ``(names, shape, itemsize, activation names, trips, both passes,
    forward)`` per parameter array an op other than a matmul reads with an activation (a
    norm's scale, a bias): the partitioner gathers it where the activation is not split as
    it is (a loop's recomputation in the backward pass reads its own copy: not forward);
    ``reshards``: ``{(names before, names after, shape, itemsize): count}`` of the
    model's logical constraints that rename a value (the dispatch of a mixture of
    experts: ``('batch', ..., 'embed')`` to ``('expert', 'expert_batch', ...)``), which
    :mod:`meshplan._search.predict.reshard` prices as all-to-alls or gathers;
    ``causal_masks``: ``(queries, keys)`` of the attention scores a mask that is no function
    of the batch (one built from iotas: a causal mask) selects from, whose masked blocks a flash kernel skips
    (:mod:`meshplan._search.predict.attention`);
    ``moves``: ``{(names as made, names as used, shape, itemsize): count}`` of values XLA's
    partitioner makes in one sharding and moves to another, keyed as ``reshards``: an
    embedding lookup's rows made where the table is split (its ``embed``) and used split by
    batch, its transpose's updates moved to where the table's gradient is split; priced as
    the all-to-alls of the axes that change dimension (an axis the value as used does not
    hold stays: partial sums reduced with the gradient, not gathered);
    ``unpriced``: ``{(primitive, where): runs}`` of the primitives the planner does not
    understand (:data:`meshplan._search.predict.primitives.UNDERSTOOD`), priced conservatively:
    outputs replicated, ``unpriced_flops`` (those they declare) on every device;
    ``lookups``: ``{(names from the table, names from the indices, where): runs}`` of the
    embedding lookups (a ``gather`` of a table's rows by the batch's indices) whose output
    no logical constraint names (traced with ``read_constraints``; else none is known): where the table's names and the indices' share a mesh axis
    (FSDP's ``embed`` and ``batch``), XLA's propagation gives the rows the table's split,
    and the layers after it run on the whole batch (:func:`meshplan._search.predict.cost.predict`
    says so in ``Cost.notes``);
    ``backward_dots``: the matmuls that run in the backward pass (autodiff's transpose);
    ``fusion_reads``: keyed as ``traffic``, the bytes XLA's loop fusions read besides
    (:mod:`meshplan._search.predict.fusion_reads`), priced where the profile says
    (``HardwareProfile.fusion_reads``);
    ``reductions``: ``{(operand names, operand shape, reduced dimensions, itemsize): runs}``
    of the reductions over named dimensions other than the batch (a norm's statistics over
    a split ``mlp``, a softmax's over a split ``vocab``): where a mesh axis splits a reduced
    dimension, the partial results are all-reduced over it;
    ``realigned``: ``{(names, shape, dimension, pieces, itemsize): runs}`` of the splits,
    slices and concatenations that cut a named dimension (a fused q/k/v projection's
    ``split``): where a mesh axis splits it, XLA splits each piece over the same devices,
    moving its parts between them (collective-permutes);
    ``parts``: ``(name, size)`` of the major part a forward reshape splits a named dimension
    into (Mistral's 64-wide key projection, ``kv_heads``, reshaped to 2 heads of 32:
    ``('kv_heads', 2)``): a mesh axis that does not divide the part cuts inside it (the
    backward pass's splits undo the forward's merges: not parts);
    ``head``: ``(its weight's names, where)`` of a head that reads one position of the
    sequence (a class token): where its weight's names and the batch share a mesh axis,
    XLA's propagation carries the weight's split back into the layers (``Cost.notes``);
    ``held_broadcasts``: ``{(names, shape, itemsize): arrays}`` of the forward pass's
    outer products outside loops (:func:`_outer_product`: a norm's ``rsqrt`` times its
    scale), two arrays of the product's shape each: their broadcast operands, which
    XLA:CPU's default schedule writes out and holds for the backward pass
    (``HardwareProfile.holds_broadcasts``).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 32), jnp.float32), ("embed", "mlp"))
        >>> work = meshplan.trace_workload(lambda s, x: (x @ s["w"].value).sum(), {"w": w},
        ...                                jax.ShapeDtypeStruct((16, 64), jnp.float32))
        >>> work.batch, work.param_names, work.tokens_unit
        (16, ('embed', 'mlp'), 'examples')
    """

    dots: dict[Dot, int]
    traffic: dict[tuple[Names, tuple[int, ...], bool], int]
    state: list[tuple[Names | None, tuple[int, ...], int]]
    names: tuple[str, ...]
    batch: int | None = None
    param_names: tuple[str, ...] = ()
    memory: MemoryProgram | None = None
    score_dots: frozenset[Dot] = frozenset()
    batch_state: list[tuple[Names, tuple[int, ...], int]] = dataclasses.field(default_factory=list)
    tokens: int | None = None
    reshards: dict[tuple[Names, Names, tuple[int, ...], int], int] = dataclasses.field(
        default_factory=dict
    )
    memory_kept: MemoryProgram | None = None
    tokens_unit: ThroughputUnit = "examples"
    dot_trips: dict[Dot, int] = dataclasses.field(default_factory=dict)
    operand_arrays: dict[tuple[Dot, int], frozenset[int]] = dataclasses.field(default_factory=dict)
    arrays: tuple[tuple[int, bool, bool], ...] = ()
    weight_reads: tuple[tuple[Names, tuple[int, ...], int, Names, int, bool, bool], ...] = ()
    causal_masks: frozenset[tuple[int, int]] = frozenset()
    unpriced: dict[tuple[str, str], int] = dataclasses.field(default_factory=dict)
    unpriced_flops: int = 0
    moves: dict[tuple[Names, Names, tuple[int, ...], int], int] = dataclasses.field(
        default_factory=dict
    )
    lookups: dict[tuple[Names, Names, str], int] = dataclasses.field(default_factory=dict)
    backward_dots: frozenset[Dot] = frozenset()
    memory_late: MemoryProgram | None = None
    fusion_reads: dict[tuple[Names, tuple[int, ...], bool], int] = dataclasses.field(
        default_factory=dict
    )
    reductions: dict[tuple[Names, tuple[int, ...], tuple[int, ...], int], int] = dataclasses.field(
        default_factory=dict
    )
    realigned: dict[tuple[Names, tuple[int, ...], int, tuple[tuple[int, int], ...], int], int] = (
        dataclasses.field(default_factory=dict)
    )
    parts: frozenset[tuple[str, int]] = frozenset()
    head: tuple[Names, str] | None = None
    held_broadcasts: dict[tuple[Names, tuple[int, ...], int], int] = dataclasses.field(
        default_factory=dict
    )

    @functools.cached_property
    def kept_whole(self) -> bool:
        """Whether the layers run whole in a table's split in both passes (a matmul reads a
        :class:`Carried` batch that is ``whole``): a backward matmul's output is used there,
        not moved back to the batch (:mod:`.cost`)."""
        return any(isinstance(n, Carried) and n.whole for d in self.dots for n in d.lhs_names)

    def trips(self, dot: Dot) -> int:
        """How many times one run of ``dot`` repeats in sequence: the trips of the loops
        around it (``dots[dot]`` divided by this is how often it appears in the unrolled
        program, runs whose collectives XLA may combine). Its count where not traced.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("embed", "mlp"))
            >>> def step(s, x):
            ...     body = lambda h, _: (h @ s["w"].value, None)
            ...     return jax.lax.scan(body, x, None, length=3)[0].sum()
            >>> work = meshplan.trace_workload(step, {"w": w}, jax.ShapeDtypeStruct((4, 8), jnp.float32))
            >>> [(work.dots[d], work.trips(d)) for d in work.dots]
            [(3, 3)]
        """
        return self.dot_trips.get(dot, self.dots.get(dot, 1))

    @property
    def flops(self) -> int:
        """Global matmul FLOPs of one step.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 32), jnp.float32), ("embed", "mlp"))
            >>> meshplan.trace_workload(lambda s, x: (x @ s["w"].value).sum(), {"w": w},
            ...                         jax.ShapeDtypeStruct((16, 64), jnp.float32)).flops
            65536
        """
        return sum(d.flops * n for d, n in self.dots.items())


_READ_AS_LOGICAL = (("meshplan.search: names are logical", None),)


def _outer_product(eqn: Any) -> bool:
    """Whether ``eqn`` multiplies two operands each broadcast into its result: a size-1
    dimension of each where the result's is larger (``[b, s, 1] * [1, 1, d]``: a norm's
    ``rsqrt`` times its scale, as Flax's ``LayerNorm`` and ``RMSNorm`` compute it).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.trace import _outer_product
        >>> f = lambda r, w, x: (r * w, x * r)
        >>> j = jax.make_jaxpr(f)(jnp.ones((2, 3, 1)), jnp.ones((1, 1, 4)), jnp.ones((2, 3, 4)))
        >>> [_outer_product(e) for e in j.jaxpr.eqns]
        [True, False]
    """
    if eqn.primitive.name != "mul" or len(eqn.invars) != 2:
        return False
    out = eqn.outvars[0].aval.shape
    shapes = [getattr(v.aval, "shape", ()) for v in eqn.invars]
    return all(
        len(s) == len(out) and any(a == 1 < b for a, b in zip(s, out, strict=True)) for s in shapes
    )


_BIASED = frozenset({"add", "sub", "mul", "convert_element_type"})
"""Ops that carry a value kept whole to their result where every other operand is
broadcast into it (a bias, a scale): :meth:`_Walker._follow_held`."""


class Carried(str):
    """``'batch'`` of a value XLA makes where an embedding table lies: where the table's names
    ``by`` (FSDP's ``embed``) share a mesh axis with the batch, its batch is whole (XLA gives
    the value the table's sharding, replicated over the batch's other axes too), and the
    value's own ``embed`` takes the table's split. Equal to ``'batch'`` (a batch dimension
    to every rule that asks), hashed apart from it (a key of its own wherever names are one).

    ``whole``: the split is kept through the layers' projections out of it (their partial
    sums all-reduced whole and used whole, not sliced back to the batch): where both passes
    run in the table's split (:func:`trace_workload`: a loss that reads its logits by no
    index of the batch, a loop body whose carry is in it)."""

    by: Names
    whole: bool

    def __new__(cls, by: Names, whole: bool = False) -> Carried:
        made = super().__new__(cls, "batch")
        made.by = by
        made.whole = whole
        return made

    def __hash__(self) -> int:
        return hash(("batch", self.by, self.whole))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Carried):
            return self.by == other.by and self.whole == other.whole
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __reduce__(self) -> Any:
        return (Carried, (self.by, self.whole))


def _renamed(a: Names, b: Names | None) -> bool:
    """Whether ``b`` is not ``a``, telling :class:`Carried` from ``'batch'``."""
    return (
        b is None
        or a != b
        or [isinstance(n, Carried) for n in a] != [isinstance(n, Carried) for n in b]
    )


def _nbytes(aval: Any) -> int:
    return int(np.prod(getattr(aval, "shape", ()))) * _itemsize(aval)


def _itemsize(aval: Any) -> int:
    try:
        return int(np.dtype(aval.dtype).itemsize)
    except TypeError:  # extended dtypes (PRNG keys)
        return 4


def _merge(a: Any, b: Any) -> Any:
    return a if a is not None else b


def _elementwise(
    out_shape: tuple[int, ...], ins: Sequence[tuple[Names, tuple[int, ...]]], forward: bool = False
) -> Names:
    names: list[Any] = [None] * len(out_shape)
    ranks = [-1] * len(out_shape)
    for n, shape in ins:
        if len(shape) != len(out_shape):
            continue
        for i, (name, size) in enumerate(zip(n, shape, strict=True)):
            rank = _rank(name, n, forward)
            if size == out_shape[i] and name is not None and rank > ranks[i]:
                names[i], ranks[i] = name, rank
    return tuple(names)


def _rank(name: Any, names: Names, forward: bool = False) -> int:
    """Which sharding XLA's propagation gives the result where operands meet (the first of
    the highest rank): a batch kept whole in a table's split (:class:`Carried`'s ``whole``)
    by a value that holds the table's names (the stream, its cotangent: split by them) over
    the plain ``'batch'``, which is over one that holds none of them (replicated: a
    projection's all-reduced output, the logits), sliced to the batch where it meets one
    split by it (the loss's targets). In the forward pass a batch in the table's split
    (:class:`Carried`) is over the plain ``'batch'`` too: a residual sum written
    ``block(x) + x`` stays in the stream's split, as XLA keeps it (GPT-Neo's ``attn_output +
    residual``: its second layer's projections all-reduce the whole batch); the backward
    pass's cotangent arrives split by the batch, and is moved into the split later."""
    if isinstance(name, Carried):
        if name.whole:
            return 3 if _holds_table(name, names) else 0
        return 2 if forward else 1
    return 1


def _holds_table(name: Carried, names: Names) -> bool:
    return any(n in names for n in name.by if n is not None)


def _unwhole(names: Names) -> Names:
    """``names`` with a batch kept whole in a table's split (inside a loop) as it is outside:
    :class:`Carried`, sliced back to the batch by a projection out of the split."""
    return tuple(Carried(n.by) if isinstance(n, Carried) and n.whole else n for n in names)


def _replicated_whole(names: Names) -> bool:
    """A value kept whole that holds none of the table's names (replicated: a projection's
    all-reduced output, the attention inside, the logits), as against the stream."""
    return any(_replicated(n, names) for n in names)


def _replicated(name: Any, names: Names) -> bool:
    return isinstance(name, Carried) and name.whole and not _holds_table(name, names)


def _batch_like(name: Any) -> bool:
    return name == "batch" or isinstance(name, Carried)


def _plain_batch(name: Any) -> bool:
    return name == "batch" and not isinstance(name, Carried)


def _reshape(names: Names, old: tuple[int, ...], new: tuple[int, ...]) -> Names:
    """Names of the dimensions a reshape leaves whole (same size, same prefix product), and
    of the major dimension where it splits one (``[.., 64]`` named ``heads`` to ``[.., 4,
    16]``: ``heads`` on the 4, as XLA splits the major part) or merges several (the major
    one's name).

    Example:
        >>> from meshplan._search.predict.trace import _reshape
        >>> _reshape(("batch", None, "heads"), (8, 32, 64), (8, 32, 4, 16))
        ('batch', None, 'heads', None)
    """
    out: list[Any] = [None] * len(new)
    prefix_old = {math.prod(old[:i]): i for i in range(len(old))}
    ends = {math.prod(old[: i + 1]) for i in range(len(old))}
    for j in range(len(new)):
        i = prefix_old.get(math.prod(new[:j]))
        if i is None or new[j] == 1:
            continue
        whole = old[i] == new[j]
        split = old[i] % new[j] == 0 and new[j] < old[i]
        merged = new[j] % old[i] == 0 and math.prod(new[: j + 1]) in ends
        if whole or split or merged:
            out[j] = names[i]
    return tuple(out)


def _parts(
    names: Names, shape: tuple[int, ...], out: Names, out_shape: tuple[int, ...]
) -> set[tuple[str, int]]:
    """``(name, size)`` of each named dimension a reshape splits, its name on the major part
    (:attr:`Workload.parts`).

    Example:
        >>> from meshplan._search.predict.trace import _parts
        >>> _parts(("batch", "kv_heads"), (8, 64), ("batch", "kv_heads", None), (8, 2, 32))
        {('kv_heads', 2)}
    """
    sizes = {n: s for n, s in zip(names, shape, strict=True) if type(n) is str}
    return {
        (n, s)
        for n, s in zip(out, out_shape, strict=True)
        if type(n) is str and n in sizes and s < sizes[n]
    }


def dot_out_names(
    lhs: Names,
    rhs: Names,
    contract: tuple[Sequence[int], Sequence[int]],
    batch: tuple[Sequence[int], Sequence[int]],
) -> Names:
    """A matmul's output names: its batch dimensions (the left's name, else the right's),
    the left's free dimensions, the right's, a repeated name dropped (:func:`dedupe`).

    Example:
        >>> from meshplan._search.predict.trace import dot_out_names
        >>> dot_out_names(("batch", "embed"), ("embed", "mlp"), ((1,), (0,)), ((), ()))
        ('batch', 'mlp')
    """
    (lc, rc), (lb, rb) = contract, batch
    out = [_merge(lhs[i], rhs[j]) for i, j in zip(lb, rb, strict=True)]
    out += [lhs[i] for i in range(len(lhs)) if i not in lc and i not in lb]
    out += [rhs[i] for i in range(len(rhs)) if i not in rc and i not in rb]
    summed = {lhs[i] for i in lc} | {rhs[i] for i in rc}
    # partial sums over the table's split, all-reduced and sliced back to the batch (unless
    # the layers run in the table's split: used whole)
    out = [
        "batch" if isinstance(n, Carried) and not n.whole and summed & set(n.by) - {None} else n
        for n in out
    ]
    return dedupe(tuple(out))


def dedupe(names: Names) -> Names:
    """``names`` with every repeat of a name dropped to ``None`` (the first one keeps it).

    An array's dimensions take one mesh axis each: two dimensions with one name (q·kᵀ
    gives ``('batch', 'heads', 'seq', 'seq')``) would be an invalid sharding.

    Example:
        >>> from meshplan._search.predict.trace import dedupe
        >>> dedupe(("batch", "heads", "seq", "seq"))
        ('batch', 'heads', 'seq', None)
    """
    seen: set[Any] = set()
    out: list[Any] = []
    for n in names:
        if n is not None and n in seen:
            out.append(None)
        else:
            seen.add(n)
            out.append(n)
    return tuple(out)


class _Walker:
    def __init__(self) -> None:
        self.dots: dict[Dot, int] = {}
        self.dot_trips: dict[Dot, int] = {}  # the loop trips of one run of a dot
        self.traffic: dict[tuple[Names, tuple[int, ...], bool], int] = {}
        self.seen: dict[str, None] = {}
        self.var_names: dict[Any, Names] = {}
        # The names of a value's buffer where a constraint gives it other names than its
        # operations do: XLA produces the constrained value in the constraint's sharding
        # (a matmul's partial sums reduce-scattered into it), so its buffer, and a
        # residual saved from it for the backward pass, is that shard.
        self.buffer_names: dict[Any, Names] = {}
        # Forward projections' outputs kept whole where they leave a table's split
        # (:meth:`_held_whole`): their buffers' names, for the memory programs only.
        self.held_whole: dict[Any, Names] = {}
        # The names of the weight of the first forward matmul that reads one position of a
        # sequence (a class token's head): XLA runs the layers before it in its split.
        self.head_by: Names | None = None
        # The weights (their parameters' arrays) a forward matmul made its output by in their
        # split (:meth:`_in_weights_split`): the backward's matmuls by them make theirs there.
        self.weights_split: set[Any] = set()
        self.split_by: set[Names] = set()  # the free names those outputs are Carried by
        # The forward matmuls (ids of their equations) that may (found by a first walk:
        # :func:`_walk`), those that would (their weights' free names), the values made from
        # each (``made_from``), and those whose values a later matmul contracts over them.
        self.split_eqns: frozenset[int] = frozenset()
        self.candidates: dict[int, Names] = {}
        self.made_from: dict[Any, frozenset[int]] = {}
        self.confirmed: set[int] = set()
        self.loop_whole = False  # a forward loop ran whole in a table's split (_loop_whole)
        self.anchored: set[int] = set()  # of those: held by a residual sum, a loop's carry
        self.head_site = "?"
        self.batch_named = False  # a logical constraint names an activation's batch (floats)
        self.producer: dict[Any, Any] = {}
        self.scores: set[Any] = set()  # vars holding attention scores
        self.score_dots: set[Dot] = set()
        # (queries, keys) of score arrays a mask that is no function of the batch selects
        # from (a causal mask built from iotas): a flash kernel skips the blocks it masks out
        # (meshplan._search.predict.attention)
        self.causal_masks: set[tuple[int, int]] = set()
        self.score_sizes: set[int] = set()  # elements of the q·kᵀ products seen
        self.consumers: dict[Any, list[str]] = {}
        # A call body's returned value: the call's output it becomes (XLA inlines the call,
        # so what reads that output reads the value: :meth:`readers`).
        self.returned_as: dict[Any, Any] = {}
        self.dot_by_eqn: dict[int, Dot] = {}
        # (eqn id, output, dot, times, operands, in the backward pass)
        self.dot_runs: list[tuple[int, Any, Dot, int, tuple[Any, ...], bool]] = []
        self.backward_dots: set[Dot] = set()  # as named by name_dot_outputs
        self.backward = False  # walking the backward pass (autodiff's transpose)
        self.alias: Mapping[Any, Any] = {}  # the walked jaxpr's aliases (jaxpr_facts.aliases)
        # Each array a matmul reads, by operand: ``{(dot, side): {array index}}``, and per
        # array ``(trips, read in the forward and the backward pass)``: which arrays are
        # the same, so that one gathered for several matmuls is gathered once per pass.
        self.operand_arrays: dict[tuple[Dot, int], frozenset[int]] = {}
        self.arrays: list[tuple[int, bool, bool]] = []
        self.materialized: set[Any] = set()  # values XLA writes to memory (not fused away)
        self.fusion_reads = FusionReads()  # the buffers a fusion's kernel reads (fusion_reads)
        self.read_traffic: dict[tuple[Names, tuple[int, ...], bool], int] = {}  # their bytes
        self.constlike: set[Any] = set()  # computed from no input (iotas, masks): recomputed
        # names of the activations a gather picks from, by shape (a loss's logits): the
        # zeros its transpose scatters into are named as they are
        self.picked_from: dict[tuple[int, ...], Names] = {}
        self.reshards: dict[tuple[Names, Names, tuple[int, ...], int], int] = {}
        # The broadcast operands of the forward pass's outer products outside loops, by
        # (names, shape, itemsize) of the product: Workload.held_broadcasts.
        self.held_broadcasts: dict[tuple[Names, tuple[int, ...], int], int] = {}
        self.looping = False  # walking a loop's body
        self.moves: dict[tuple[Names, Names, tuple[int, ...], int], int] = {}
        self.reductions: dict[tuple[Names, tuple[int, ...], tuple[int, ...], int], int] = {}
        self.realigned: dict[
            tuple[Names, tuple[int, ...], int, tuple[tuple[int, int], ...], int], int
        ] = {}
        self.parts: set[tuple[str, int]] = set()  # Workload.parts
        # Values computed from one parameter alone (its broadcast, its cast): ``{var: root}``,
        # the root being the parameter's array (a scanned layer's slice of it); and the
        # parameters other ops than matmuls read with an activation (a norm's scale):
        # ``{root: [names, shape, itemsize, activation names, trips, forward, backward]}``.
        self.weight_of: dict[Any, Any] = {}
        self.weight_reads: dict[Any, list[Any]] = {}
        self.unpriced: dict[tuple[str, str], int] = {}  # (primitive, where): runs
        self.unpriced_flops = 0
        self.site = "?"  # where the model runs the equation being walked (op_names.where)
        # The embedding lookups of the forward pass, ``[key, runs, constrained, (indices'
        # names, shape, itemsize)]`` (keyed as ``Workload.lookups``), and the values that
        # are one's rows as it made them (the gather's output, the call's that returns
        # it): ``{var: index in lookups}``.
        self.lookups: list[list[Any]] = []
        self.lookup_of: dict[Any, int] = {}
        # The model's logical constraints are in the program (trace_workload's
        # ``read_constraints``): a lookup no constraint names is known to be one.
        self.sees_constraints = False
        # A gather of the forward pass that reads an activation (not a parameter) by indices
        # that carry the batch (a loss's ``take_along_axis``, integer-label cross-entropy):
        # XLA partitions it, and its transpose's scatter, along the indices' batch, so the
        # backward pass arrives split by the batch; and whether the lookups' split is kept
        # whole through the layers (:class:`Carried`'s ``whole``: when none is).
        self.batch_indexed = False
        # the names of the forward pass's last activation of each shape: what a scatter
        # into zeros of that shape makes (:meth:`_picked`)
        self.by_shape: dict[tuple[int, ...], Names] = {}
        self.keep_whole = False
        # Where the split is kept whole: the matmuls (ids of their equations) whose partial
        # sums over the table's names made a value whole, by value (``origin``); those whose
        # value meets one split by the batch (``to_slice``: XLA propagates the batch's split
        # back to them), and those a walk slices to the batch (``sliced``: the last walk's).
        self.origin: dict[Any, frozenset[int]] = {}
        self.to_slice: set[int] = set()
        self.sliced: frozenset[int] = frozenset()

    def note(self, names: Names) -> None:
        for n in names:
            if isinstance(n, str):
                self.seen.setdefault(n)

    def walk_loop(self, body: Any, in_names: Sequence[Names], times: int) -> list[Names]:
        """:meth:`walk` of a loop's ``body`` (a scan's, a while's), :attr:`looping` set."""
        looping, self.looping = self.looping, True
        try:
            return self.walk(body, in_names, times)
        finally:
            self.looping = looping

    def walk(self, jaxpr: Any, in_names: Sequence[Names], times: int) -> list[Names]:
        env: dict[Any, Names] = {}

        def read(v: Any) -> Names:
            if isinstance(v, Literal):
                return (None,) * np.ndim(v.val)
            return env.get(v, (None,) * len(getattr(v.aval, "shape", ())))

        for v, n in zip(jaxpr.invars, in_names, strict=True):
            env[v] = n
            self.var_names[v] = n
            if v not in self.constlike and not self.fusion_reads.known(v):
                self._buffer(v, n)  # an input (a scan's slice): a buffer its kernels read
        found = facts(jaxpr)  # the one walk's facts of this jaxpr
        alias = found.alias  # a constraint's value is its input's buffer
        for v, prims in found.consumers.items():
            self.consumers.setdefault(v, []).extend(prims)
        producer = found.producer
        backward = self.backward
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            self.alias, self.producer = alias, producer
            self.backward = backward or "transpose(" in str(eqn.source_info.name_stack)
            site, here = self.site, op_names.where(eqn)
            self.site = here if here != "?" else site  # inside a library's jit: the caller's
            outs = [dedupe(n) for n in self.eqn(eqn, ins, times)]
            if not self.backward and not self.looping and _outer_product(eqn):
                key = (outs[0], tuple(eqn.outvars[0].aval.shape), _itemsize(eqn.outvars[0].aval))
                self.held_broadcasts[key] = self.held_broadcasts.get(key, 0) + 2
            if self.keep_whole:
                self._follow_whole(eqn, ins, outs)
            if self.held_whole and not self.backward:
                self._follow_held(eqn)
            if self.made_from and not self.backward and eqn.primitive.name != "dot_general":
                self._made_from(eqn, ins)
            self.site = site
            self._weights(eqn, ins, outs, times)
            self.backward = backward
            for v, n in zip(eqn.outvars, outs, strict=True):
                env[v] = n
                self.var_names[v] = n
                self.note(n)
                if (
                    v in self.materialized
                    and v not in self.constlike
                    and v not in self.fusion_reads.leaf
                ):
                    self._buffer(v, n)  # a loop's or a call's result: a buffer in memory
            if eqn.primitive.name in SAME_LAYOUT:
                self._constrain_forward(eqn, env, alias, producer)
                self._carry_back(eqn, outs, producer)
        for out, root in alias.items():  # the first constraint of a value names its buffer
            self.batch_named |= _floating(out.aval) and "batch" in env.get(out, ())
            if out in env and env[out] != env.get(root):
                self.buffer_names.setdefault(out, env[out])
                self._constrain_back(root, env[out], producer)
        return [read(v) for v in jaxpr.outvars]

    def _in_weights_split(
        self,
        eqn: Any,
        names: Names,
        operands: tuple[Names, Names],
        contract: tuple[Sequence[int], Sequence[int]],
        batch: tuple[Sequence[int], Sequence[int]],
    ) -> Names:
        """A matmul of an activation split by the batch by a larger weight whose output
        dimensions are named, whose output a later matmul contracts over those names: XLA
        makes the output where the weight lies (the activation gathered over the weight's
        axes: :func:`meshplan._search.predict.cost._right_first`) and keeps it there into
        that projection, which all-reduces its partial sums (read in a plain MLP's compiled
        FSDP step: ``x`` all-gathered f32[64,256], the hidden layer split by its units, its
        projection all-reduced f32[64,512]; Equinox's ``w @ x`` alike). Its batch is then
        :class:`Carried` in the weight's names; in the backward pass, where the forward made
        a value by that weight so (its cotangent is there too). A head into the loss is not:
        its output meets the targets, split by the batch; nor is one a residual sum or a
        loop's carry holds (:meth:`_made_from`)."""
        weights = [not isinstance(v, Literal) and v in self.weight_of for v in eqn.invars]
        if weights.count(True) != 1:
            return names
        side = weights.index(True)
        w, x = eqn.invars[side], eqn.invars[1 - side]
        if not self.backward and not isinstance(x, Literal):
            self._confirm(x, operands[1 - side], contract[1 - side])
            if self._reads_split(operands[1 - side], contract[1 - side]) or self._reads_rows(
                x, operands[1 - side], contract[1 - side]
            ):
                self.weights_split.add(self.weight_of[w])  # its cotangent made there too
        bound = {*contract[side], *batch[side]}
        free = tuple(n for j, n in enumerate(operands[side]) if j not in bound and n is not None)
        if (
            not free
            or isinstance(x, Literal)
            or not any(_plain_batch(n) for n in names)
            or any(isinstance(n, Carried) for n in names)
            or _nbytes(x.aval) >= _nbytes(w.aval)
        ):
            return names
        if self.backward:
            if self.weight_of[w] not in self.weights_split:
                return names
        else:
            self.candidates[id(eqn)] = free
            self.made_from[eqn.outvars[0]] = frozenset({id(eqn)})
            if id(eqn) not in self.split_eqns:
                return names
            self.weights_split.add(self.weight_of[w])
            self.split_by.add(free)
        return tuple(Carried(free, self.keep_whole) if _plain_batch(n) else n for n in names)

    def _reads_split(self, names: Names, contract: Sequence[int]) -> bool:
        """Whether a forward matmul contracts a value made in a weight's split (by
        :meth:`_in_weights_split`) over that weight's names: the next layer of a plain MLP,
        whose backward makes the hidden layer's cotangent in the same split (a classifier
        head's: no all-to-all back to the batch)."""
        return _contracts_carried(names, contract, self.split_by)

    def _reads_rows(self, x: Any, names: Names, contract: Sequence[int]) -> bool:
        """Whether a forward matmul contracts a lookup's rows, made in its table's split
        (:class:`Carried` by the table's names), over those names, where only matmuls read
        them: the input projection of an LSTM over an embedding (Flax's ``nn.RNN``). Its
        backward makes the rows' cotangent there too, gathering the small gates' cotangent
        whole (read in its compiled FSDP step: f32[16,512] all-gathered each step, no
        all-to-all before the table's scatter-add). Rows a residual sum or a norm reads
        meet the batch's split there, and their cotangent does too."""
        tables = {lookup[0][0] for lookup in self.lookups}
        return _contracts_carried(names, contract, tables) and all(
            c == "dot_general" for c in self.readers(x)
        )

    def _confirm(self, x: Any, names: Names, contract: Sequence[int]) -> None:
        """Notes the candidate matmuls (:meth:`_in_weights_split`) whose output ``x`` is
        made from, where this matmul contracts ``x`` over their weights' free names."""
        over = {names[j] for j in contract}
        for made in self.made_from.get(x, ()):
            if over & set(self.candidates[made]):
                self.confirmed.add(made)

    def _made_from(self, eqn: Any, ins: list[Names]) -> None:
        """What a forward op's outputs are made from (:attr:`made_from`), as its inputs; an
        elementwise op that meets such a value with another activation split by the batch
        (a residual sum) anchors it there (:attr:`anchored`): XLA's propagation gives the
        sum the batch's split, and the matmul's output with it."""
        made = [
            self.made_from.get(v, frozenset()) if not isinstance(v, Literal) else frozenset()
            for v in eqn.invars
        ]
        got = frozenset().union(*made)
        if not got:
            return
        for o in eqn.outvars:
            self.made_from[o] = self.made_from.get(o, frozenset()) | got
        if _elementwise_op(eqn):
            for v, m, n in zip(eqn.invars, made, ins, strict=True):
                if (
                    not isinstance(v, Literal)
                    and v not in self.weight_of
                    and v not in self.constlike
                    and any(_plain_batch(a) for a in n)
                ):
                    self.anchored.update(got - m)

    def _pass_made(self, outer: Sequence[Any], inner: Sequence[Any]) -> None:
        for o, i in zip(outer, inner, strict=False):
            if not isinstance(o, Literal) and o in self.made_from and not isinstance(i, Literal):
                self.made_from[i] = self.made_from[o]

    def _held_whole(
        self, out: Any, names: Names, operands: tuple[Names, Names], bound: tuple[set[int], ...]
    ) -> None:
        """Notes a forward projection out of a table's split (:class:`Carried`), its partial
        sums all-reduced whole, then sliced to the batch: XLA fuses the slice into the
        output's readers, so its buffer is the whole all-reduced result, alive while they
        are, the backward pass's among them (read in GPT-Neo's, Bloom's, BERT's compiled
        FSDP steps: each layer's ``c_fc`` f32[16,32,256] and ``k`` f32[16,32,128], whole;
        an Equinox head's ``w @ x`` under ``jax.vmap``, the activation on the right: its
        logits f32[1000,16,32], whole). Where the layers stay in the table's split
        (``keep_whole``), a projection's all-reduced output is held the same way: a bias
        added to it is fused into its readers, so the all-reduced buffer, not the sum, stays
        alive for the backward pass (BERT's classifier under FSDP: each layer's
        ``all-reduce.7`` f32[16,32,256], whole, from the forward pass into the backward)."""
        free = [
            n
            for side, names_ in enumerate(operands)
            for i, n in enumerate(names_)
            if i not in bound[side]
        ]
        carrier = next((n for n in free if isinstance(n, Carried) and not n.whole), None)
        if carrier is None and self.keep_whole and _replicated_whole(names):
            self.held_whole[out] = names
            return
        if carrier is None or any(isinstance(n, Carried) for n in names):
            return
        self.held_whole[out] = tuple(carrier if n == "batch" else n for n in names)

    def _a_token_of(self, v: Any) -> bool:
        """Whether ``v`` is one position of a sequence of activations (``x[:, 0]``, a class
        token), sliced from them, as it is (reshaped, cast) or through elementwise ops of
        its shape (a norm of it: CLIP's vision tower's post-LayerNorm); not a reduction over
        the sequence (a mean-pooled head)."""
        todo: list[Any] = [] if isinstance(v, Literal) else [v]
        seen: set[Any] = set()
        while todo and len(seen) < 64:
            u = todo.pop()
            eqn = None if u in seen else self.producer.get(u)
            seen.add(u)
            if eqn is None:
                continue
            prim = eqn.primitive.name
            if prim in ("slice", "dynamic_slice") and self._one_position(eqn):
                return True
            if prim in ("squeeze", "reshape"):
                todo.append(eqn.invars[0])
            elif prim in ELEMENTWISE:
                shape = u.aval.shape
                todo += [
                    x for x in eqn.invars if not isinstance(x, Literal) and x.aval.shape == shape
                ]
        return False

    def _one_position(self, eqn: Any) -> bool:
        """A slice of one position of one dimension of an array of the batch."""
        before, after = eqn.invars[0].aval.shape, eqn.outvars[0].aval.shape
        cut = [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b]
        names = self.var_names.get(eqn.invars[0], ())
        return len(cut) == 1 and after[cut[0]] == 1 and "batch" in names

    def _follow_held(self, eqn: Any) -> None:
        """A bias added to (or a scale multiplied into) a value kept whole
        (:meth:`_held_whole`): XLA fuses it into the readers too, so the whole buffer is
        what stays alive for them (GPT-Neo's ``c_fc`` with its bias: ``all-reduce.7``
        f32[16,32,256] alive into the backward pass)."""
        if eqn.primitive.name not in _BIASED or len(eqn.outvars) != 1:
            return
        shape = eqn.outvars[0].aval.shape
        vs = [v for v in eqn.invars if not isinstance(v, Literal)]
        held = [v for v in vs if v in self.held_whole and v.aval.shape == shape]
        if len(held) == 1 and all(v.aval.shape != shape for v in vs if v is not held[0]):
            self.held_whole[eqn.outvars[0]] = self.held_whole[held[0]]

    def _whole_dot(
        self,
        eqn: Any,
        lhs: Names,
        rhs: Names,
        contract: tuple[Sequence[int], Sequence[int]],
        batch: tuple[Sequence[int], Sequence[int]],
    ) -> tuple[Names, Names]:
        """A matmul's operands where the split is kept whole: as they are, its output whole
        (its origin noted where its partial sums over the table's names made it so), or, for
        a matmul whose value meets one split by the batch (``sliced``), with the split as
        outside a loop, so its output is sliced to the batch (the head: its logits)."""
        if id(eqn) in self.sliced:
            return _unwhole(lhs), _unwhole(rhs)
        got = frozenset().union(
            *(self.origin.get(v, frozenset()) for v in eqn.invars if not isinstance(v, Literal))
        )
        out = dot_out_names(lhs, rhs, contract, batch)
        outside = dot_out_names(_unwhole(lhs), _unwhole(rhs), contract, batch)
        if any(
            _plain_batch(a) and isinstance(b, Carried) for a, b in zip(outside, out, strict=True)
        ):
            got |= {id(eqn)}  # its partial sums over the table's names, used whole
        if got and _replicated_whole(out):
            self.origin[eqn.outvars[0]] = got
        return lhs, rhs

    def _follow_whole(self, eqn: Any, ins: list[Names], outs: list[Names]) -> None:
        """Follows the values kept whole from the matmuls that made them (``origin``), and
        notes those matmuls whose value meets one split by the batch (``to_slice``)."""
        prim = eqn.primitive.name
        if prim in ("dot_general", "scan") or call_body(eqn) is not None:
            return  # their own (self.eqn)
        got = frozenset().union(
            *(self.origin.get(v, frozenset()) for v in eqn.invars if not isinstance(v, Literal))
        )
        if got:
            for v, n in zip(eqn.outvars, outs, strict=True):
                if _replicated_whole(n):
                    self.origin[v] = got
        if len(outs) != 1 or not any(_plain_batch(x) for x in outs[0]):
            return
        for v, n in zip(eqn.invars, ins, strict=True):
            if isinstance(v, Literal) or len(n) != len(outs[0]):
                continue
            for x, y in zip(n, outs[0], strict=True):
                if _replicated(x, n) and _plain_batch(y):
                    self.to_slice.update(self.origin.get(v, ()))

    def _pass_origin(self, outer: Sequence[Any], inner: Sequence[Any]) -> None:
        for o, i in zip(outer, inner, strict=False):
            if not isinstance(o, Literal) and o in self.origin and not isinstance(i, Literal):
                self.origin[i] = self.origin[o]

    def _pass_held(self, outer: Sequence[Any], inner: Sequence[Any]) -> None:
        """A value kept whole (:meth:`_held_whole`) is so inside the call that reads it (a
        jitted ``gelu``), and so is what the call returns of it (its residuals)."""
        for o, i in zip(outer, inner, strict=False):
            if not isinstance(o, Literal) and o in self.held_whole and not isinstance(i, Literal):
                self.held_whole[i] = self.held_whole[o]

    def _into(self, outer: Sequence[Any], inner: Sequence[Any], sliced: int = -1) -> None:
        """A call's (a loop's) inner inputs are the outer parameters' arrays; from index
        ``sliced`` on, a scan's slices of them: arrays of their own."""
        for i, (o, n) in enumerate(zip(outer, inner, strict=False)):
            if isinstance(o, Literal) or o in self.constlike:  # an iota's mask: no buffer
                self.fusion_reads.computed.add(n)
            elif not 0 <= sliced <= i:  # XLA inlines the call: the inner input is the outer
                self.fusion_reads.same(n, o)
            if not isinstance(o, Literal) and o in self.weight_of:
                self.weight_of[n] = n if 0 <= sliced <= i else self.weight_of[o]

    def _weights(self, eqn: Any, ins: list[Names], outs: list[Names], times: int) -> None:
        """Follows values made from one parameter alone, and notes a parameter that an op
        other than a matmul reads with an activation (``x * scale``): the partitioner
        gathers it where its sharding is not the activation's (:mod:`.cost`)."""
        prim = eqn.primitive.name
        if prim == "dot_general" or call_body(eqn) is not None or prim in ("scan", "while", "cond"):
            return
        roots, acts = set(), []
        for v, n in zip(eqn.invars, ins, strict=True):
            if isinstance(v, Literal) or v in self.constlike:
                continue
            if v in self.weight_of:
                roots.add(self.weight_of[v])
            else:
                acts.append(n)
        if len(roots) == 1 and not acts:
            root = next(iter(roots))
            for o in eqn.outvars:
                self.weight_of[o] = root
        elif roots and not acts:  # several parameters joined (an LSTM's gate kernels)
            for o in eqn.outvars:
                self.weight_of[o] = o
        elif roots and times and _elementwise_op(eqn) and any("batch" in n for n in acts):
            for root in roots:
                shape = tuple(getattr(root.aval, "shape", ()))
                names = self.var_names.get(root, (None,) * len(shape))
                r = self.weight_reads.setdefault(
                    root, [names, shape, _itemsize(root.aval), outs[0], times, False, False]
                )
                r[4] = max(r[4], times)
                r[6 if self.backward else 5] = True

    def _constrain_forward(
        self, eqn: Any, env: dict[Any, Names], alias: dict[Any, Any], producer: dict[Any, Any]
    ) -> None:
        """An elementwise op of a constrained value (a residual stream's sum): its result,
        and its other operands of that shape (matmuls' partial sums, reduce-scattered into
        it), take the constrained value's buffer names, as XLA's sharding propagation does."""
        out = eqn.outvars[0]
        shape = getattr(out.aval, "shape", None)
        same = [u for u in eqn.invars if not isinstance(u, Literal) and u.aval.shape == shape]
        held = next((u for u in same if u in self.buffer_names or u in alias), None)
        if held is None or out in self.buffer_names:
            return
        names = self.buffer_names.get(held, env.get(held))
        if names is None:
            return
        self.buffer_names[out] = names
        for u in same:
            if u is not held:
                self._constrain_back(u, names, producer)

    def _carry_back(self, eqn: Any, outs: list[Names], producer: dict[Any, Any]) -> None:
        """A sum into a value that carries a table's split (:class:`Carried`: the residual
        stream after an embedding lookup under FSDP): its other operands (a projection's
        output) are made in that split, as XLA's propagation makes them (their input
        gathered whole)."""
        if not outs or not any(isinstance(n, Carried) for n in outs[0]):
            return
        shape = eqn.outvars[0].aval.shape
        for u in eqn.invars:
            if isinstance(u, Literal) or u.aval.shape != shape:
                continue
            if not any(isinstance(n, Carried) for n in self.var_names.get(u, ())):
                self._constrain_back(u, outs[0], producer)

    def _constrain_back(self, v: Any, names: Names, producer: dict[Any, Any]) -> None:
        """``v``'s buffer takes ``names``, and so do the operands of the same shape of the
        elementwise ops that made it (a sum of matmuls' partial results): XLA's sharding
        propagation carries a constraint back through them."""
        todo = [(v, producer)]
        while todo:
            x, made = todo.pop()
            if x in self.buffer_names or isinstance(x, Literal):
                continue
            self.buffer_names[x] = names
            eqn = made.get(x)
            sub = None if eqn is None else call_body(eqn)
            if eqn is not None and sub is not None:  # into the call that returns it
                todo.append((sub.outvars[eqn.outvars.index(x)], facts(sub).producer))
            elif eqn is not None and eqn.primitive.name in SAME_LAYOUT:
                shape = x.aval.shape
                todo += [
                    (u, made)
                    for u in eqn.invars
                    if not isinstance(u, Literal) and u.aval.shape == shape
                ]

    def name_dot_outputs(self) -> None:
        """Gives each dot whose output a constraint names otherwise (its buffer's names,
        known once the walk is done) those names as ``out_names``."""
        dots: dict[Dot, int] = {}
        trips: dict[Dot, int] = {}
        operands: dict[tuple[Dot, int], set[int]] = {}
        arrays: dict[Any, list[Any]] = {}  # var -> [index, trips, forward, backward]
        for key, out, dot, times, ins, backward in self.dot_runs:
            names = self.buffer_names.get(out)
            if names is not None and _renamed(names, self.var_names.get(out)):
                named = dataclasses.replace(dot, out_names=names)
                if dot in self.score_dots:
                    self.score_dots.add(named)
                dot = self.dot_by_eqn[key] = named
            if backward and times:
                self.backward_dots.add(dot)
            dots[dot] = dots.get(dot, 0) + times
            trips[dot] = max(trips.get(dot, 0), times)
            for side, v in enumerate(ins):
                if v is None:
                    continue
                a = arrays.setdefault(v, [len(arrays), times, False, False])
                a[1] = max(a[1], times)
                a[3 if backward else 2] = True
                operands.setdefault((dot, side), set()).add(a[0])
        self.dots, self.dot_trips = dots, trips
        self.operand_arrays = {k: frozenset(v) for k, v in operands.items()}
        self.arrays = [
            (t, fwd and bwd, v in self.buffer_names) for v, (_, t, fwd, bwd) in arrays.items()
        ]

    def buffer(self, v: Any) -> Names | None:
        """The names of ``v``'s buffer, where a constraint renamed it (else ``None``)."""
        return None if isinstance(v, Literal) else self.buffer_names.get(v)

    def _is_score_dot(self, eqn: Any, ins: list[Names]) -> bool:
        """A product of two activations that is larger than both: q·kᵀ (or its gradient
        dP = dO·vᵀ, also where the backward pass's transposes left dO without names: a
        product larger than both operands, of the size of the scores already seen, of an
        operand of the batch and one of at least 3 dimensions without names; a weight has
        names, or 2 dimensions where a model names nothing: an MLP's up-projection whose
        output is as large as the scores is no score)."""
        sizes = [math.prod(getattr(v.aval, "shape", ())) for v in eqn.invars]
        out = math.prod(eqn.outvars[0].aval.shape)
        if out <= max(sizes):
            return False
        (lc, _), _ = eqn.params["dimension_numbers"]
        if any(ins[0][i] == "batch" for i in lc if i < len(ins[0])):
            return False  # the batch summed over: a weight's gradient (xᵀ·dy), not scores
        if all("batch" in n for n in ins):
            self.score_sizes.add(out)
            return True
        unnamed = [len(n) >= 3 and all(x is None for x in n) for n in ins]
        batched = ["batch" in n for n in ins]
        return out in self.score_sizes and any(
            u and b for u, b in ((unnamed[0], batched[1]), (unnamed[1], batched[0]))
        )

    def _masks_scores(self, eqn: Any, ins: list[Names]) -> bool:
        """A ``select_n`` of scores by a predicate that is no function of the batch (a
        causal mask built from iotas; a padding mask carries the batch's names)."""
        if len(getattr(eqn.invars[0].aval, "shape", ())) < 2 or "batch" in ins[0]:
            return False
        return any(v in self.scores for v in eqn.invars[1:] if not isinstance(v, Literal))

    def _score_input(self, eqn: Any) -> bool:
        size = math.prod(getattr(eqn.outvars[0].aval, "shape", ())) if eqn.outvars else 0
        return any(
            v in self.scores and math.prod(v.aval.shape) == size
            for v in eqn.invars
            if not isinstance(v, Literal)
        )

    def eqn(self, eqn: Any, ins: list[Names], times: int) -> list[Names]:
        prim, p = eqn.primitive.name, eqn.params
        if prim in ("scan", "while", "cond"):  # a loop's outputs are buffers in memory
            self.materialized.update(eqn.outvars)
        shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        out_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        if prim == "dot_general":
            (lc, rc), (lb, rb) = p["dimension_numbers"]
            lhs, rhs = ins
            if self.keep_whole:
                lhs, rhs = self._whole_dot(eqn, lhs, rhs, (lc, rc), (lb, rb))
            plain = dot_out_names(lhs, rhs, (lc, rc), (lb, rb))
            names = self._in_weights_split(eqn, plain, (lhs, rhs), (lc, rc), (lb, rb))
            dot = Dot(
                lhs,
                rhs,
                shapes[0],
                shapes[1],
                (tuple(lc), tuple(rc)),
                (tuple(lb), tuple(rb)),
                _itemsize(eqn.outvars[0].aval),
                _itemsize(eqn.invars[0].aval),
                _itemsize(eqn.invars[1].aval),
                out_names=None if names is plain else names,
            )
            self.dots[dot] = self.dots.get(dot, 0) + times
            self.dot_trips[dot] = max(self.dot_trips.get(dot, 0), times)
            self.dot_by_eqn[id(eqn)] = dot
            operands = tuple(
                None if isinstance(v, Literal) else self.alias.get(v, v) for v in eqn.invars
            )
            self.dot_runs.append((id(eqn), eqn.outvars[0], dot, times, operands, self.backward))
            if self._is_score_dot(eqn, ins):
                self.scores.add(eqn.outvars[0])
                self.score_dots.add(dot)
            elif any(v in self.scores for v in eqn.invars if not isinstance(v, Literal)):
                self.score_dots.add(dot)
            self._count(eqn.outvars[0], names, times, eqn.outvars[0] in self.scores, dot_out=True)
            if not self.backward:
                self._held_whole(
                    eqn.outvars[0], names, (lhs, rhs), (set(lc) | set(lb), set(rc) | set(rb))
                )
                if self.head_by is None and self._a_token_of(eqn.invars[0]) and "batch" not in rhs:
                    self.head_by, self.head_site = rhs, self.site
            return [names]
        if prim == "conv_general_dilated":
            return [self._conv(eqn, ins, times)]
        if prim == "scan":
            body, length = p["jaxpr"], int(p["length"])
            nc, ncarry = p["num_consts"], p["num_carry"]
            body_in = [*ins[: nc + ncarry], *(n[1:] for n in ins[nc + ncarry :])]
            body_in[nc : nc + ncarry] = _carry_fixpoint(body.jaxpr, body_in, nc, ncarry)
            body_in = self._loop_whole(eqn, body_in, nc, ncarry, times)
            for outer, inner in zip(eqn.invars, body.jaxpr.invars, strict=True):
                if not isinstance(outer, Literal) and outer in self.scores:
                    self.scores.add(inner)
            self._into(eqn.invars, body.jaxpr.invars, nc + ncarry)
            self._pass_origin(eqn.invars, body.jaxpr.invars)
            self._pass_made(eqn.invars, body.jaxpr.invars)
            body_out = self.walk_loop(body.jaxpr, body_in, times * length)
            for inner in body.jaxpr.outvars[:ncarry]:  # a carry: one sharding every trip,
                if not isinstance(inner, Literal):  # the one it enters with
                    self.anchored.update(self.made_from.get(inner, ()))
            self._pass_origin(body.jaxpr.outvars, eqn.outvars)
            if not self.keep_whole:  # outside the loop, sliced to the batch by a projection
                body_out = [_unwhole(n) for n in body_out]
            for outer, inner in zip(eqn.outvars, body.jaxpr.outvars, strict=True):
                if not isinstance(inner, Literal) and inner in self.scores:
                    self.scores.add(outer)
            lead = next((n[0] for n in ins[nc + ncarry :] if n and n[0] is not None), None)
            same = facts(body.jaxpr).alias  # an output that is a value's own buffer
            for j, (outer, inner) in enumerate(zip(eqn.outvars, body.jaxpr.outvars, strict=True)):
                got = self.buffer(inner)  # a stacked output's buffer: each trip's, stacked
                if got is None and not isinstance(inner, Literal) and inner in same:
                    got = self.buffer(same[inner])
                if got is None and j < ncarry:  # a carry: one buffer, as the body constrains it
                    got = self.buffer(body.jaxpr.invars[nc + j])
                    if got is not None:  # and so is what the body writes into it
                        self._constrain_back(inner, got, facts(body.jaxpr).producer)
                if got is not None:
                    self.buffer_names.setdefault(outer, got if j < ncarry else (lead, *got))
            return [*body_out[:ncarry], *((lead, *n) for n in body_out[ncarry:])]
        if prim == "while":
            body = p["body_jaxpr"].jaxpr
            nc = p["body_nconsts"]
            carry = ins[p["cond_nconsts"] + nc :]
            consts = ins[p["cond_nconsts"] : p["cond_nconsts"] + nc]
            carry = _carry_fixpoint(body, [*consts, *carry], nc, len(carry))
            self._into(eqn.invars[p["cond_nconsts"] : p["cond_nconsts"] + nc], body.invars)
            return self.walk_loop(body, [*consts, *carry], times)
        if prim == "cond":
            branch = p["branches"][-1].jaxpr
            self._into(eqn.invars[1:], branch.invars)
            return self.walk(branch, ins[1:], times)
        for key in CALL_PARAMS:
            sub = p.get(key)
            if sub is not None:
                sub = getattr(sub, "jaxpr", sub)
                if len(sub.invars) == len(ins):
                    for outer, inner in zip(eqn.invars, sub.invars, strict=True):
                        if isinstance(outer, Literal) or outer in self.constlike:
                            self.constlike.add(inner)
                        if not isinstance(outer, Literal) and outer in self.scores:
                            self.scores.add(inner)
                    self._into(eqn.invars, sub.invars)
                    self._pass_origin(eqn.invars, sub.invars)
                    self._pass_held(eqn.invars, sub.invars)
                    self._pass_made(eqn.invars, sub.invars)
                    self._returns(sub, eqn.outvars)
                    result = self.walk(sub, ins, times)
                    self._pass_origin(sub.outvars, eqn.outvars)
                    self._pass_held(sub.outvars, eqn.outvars)
                    self._pass_made(sub.outvars, eqn.outvars)
                    alias = facts(sub).alias
                    for outer, inner in zip(eqn.outvars, sub.outvars, strict=True):
                        got = self.buffer(inner)
                        if got is not None:
                            self.buffer_names.setdefault(outer, got)
                        if not isinstance(inner, Literal) and inner in self.lookup_of:
                            self.lookup_of[outer] = self.lookup_of[inner]
                        if not isinstance(inner, Literal):  # a constant returned
                            inner = alias.get(inner, inner)
                        self.fusion_reads.same(outer, inner)
                        if not isinstance(inner, Literal) and inner in self.scores:
                            self.scores.add(outer)
                        if isinstance(inner, Literal) or inner in self.constlike:
                            self.constlike.add(outer)
                        elif inner in self.materialized or inner in sub.invars:
                            self.materialized.add(outer)
                    return result
        if prim not in BOUNDARY and all(
            isinstance(v, Literal) or v in self.constlike for v in eqn.invars
        ):
            self.constlike.update(eqn.outvars)
        if is_alias(eqn):
            x, y = eqn.invars[0], eqn.outvars[0]
            if not isinstance(x, Literal) and x in self.lookup_of:
                self.lookups[self.lookup_of[x]][2] = True  # its rows named by the model
            for group in (self.scores, self.constlike, self.materialized):
                if x in group:
                    group.add(y)
            self.fusion_reads.same(y, x)
            return [self._constraint(eqn, ins[0], shapes[0], times)]
        if prim == "select_n" and self._masks_scores(eqn, ins):
            self.causal_masks.add(shapes[0][-2:])
        if prim not in UNDERSTOOD and prim not in ELEMENTWISE:
            return self._unpriced(eqn, times)
        ins = self._picked(eqn, ins, shapes)
        outs = [dedupe(n) for n in self.other(prim, p, ins, shapes, out_shapes, not self.backward)]
        if times:
            self._moved(eqn, ins, outs, shapes, times)
            self._reduced(eqn, ins, shapes, times)
            self._cut(eqn, ins, outs, shapes, out_shapes, times)
            if prim == "reshape" and not self.backward:  # the backward's undo its merges
                self.parts |= _parts(ins[0], shapes[0], outs[0], out_shapes[0])
        score = prim not in BOUNDARY and self._score_input(eqn)
        for n, v in zip(outs, eqn.outvars, strict=True):
            if score:
                self.scores.add(v)
            fused = prim not in BOUNDARY
            reads = eqn.invars if fused else None
            self._count(
                v, n, times, score, boundary=not fused, reads=reads, kernel=prim in REDUCTIONS
            )
        return outs

    def _loop_whole(
        self, eqn: Any, body_in: list[Names], nc: int, ncarry: int, times: int
    ) -> list[Names]:
        """A loop body that reads a value in a table's split (:class:`Carried`: the scanned
        layers' stream, the backward's saved inputs) runs in it, whole, in both passes: XLA
        partitions the body once for every trip, its carry in one sharding (read from the
        scanned stack's compiled step: the rematerialised attention scores and the backward's
        all-reduced f32[16,32,4,16] the whole batch's). A carry that enters split by the
        batch (the backward's cotangent) takes that split, moved into it (an all-to-all).
        In the forward pass, a carry (or a constant) in the split does it; a scanned input
        alone does not (an LSTM over a lookup's rows: XLA all-reduces each step's input
        projection f32[16,512] whole and slices it to the batch, its carry split by the
        batch); in the backward pass, where a forward loop ran whole."""
        held = body_in if self.backward else body_in[: nc + ncarry]
        carried = next((n for names in held for n in names if isinstance(n, Carried)), None)
        if carried is None or (self.backward and not self.loop_whole):
            return body_in
        self.loop_whole = True
        whole = Carried(carried.by, True)
        out = [tuple(whole if n == "batch" else n for n in names) for names in body_in]
        for j in range(nc, nc + ncarry):
            v, before = eqn.invars[j], body_in[j]
            if times and not isinstance(v, Literal) and _renamed(before, out[j]):
                key = (before, _unwhole(out[j]), tuple(v.aval.shape), _itemsize(v.aval))
                if any(n == "batch" and not isinstance(n, Carried) for n in before):
                    self.moves[key] = self.moves.get(key, 0) + times
        return out

    def _moved(
        self,
        eqn: Any,
        ins: list[Names],
        outs: list[Names],
        shapes: list[tuple[int, ...]],
        times: int,
    ) -> None:
        """Notes the values the partitioner moves between shardings around an indexing op:
        a ``gather``'s rows are made in the table's sharding of its offset dimensions and
        used in the indices' (``moves``), a ``scatter``'s updates are moved to its result's
        sharding; ``top_k`` (and ``sort``) run on the whole of their operand, gathered
        (``reshards``; XLA's partitioner leaves them unpartitioned: the router's
        probabilities of the whole batch on every device)."""
        prim, p = eqn.primitive.name, eqn.params
        item = _itemsize(eqn.outvars[0].aval)
        if prim == "gather" and len(ins) == 2:
            blank = (None,) * len(ins[1])
            made = dedupe(
                op_names.gather_names(p, ins[0], blank, shapes, eqn.outvars[0].aval.shape)
            )
            self._lookup(eqn, ins, made, shapes, times)
            if eqn.outvars[0] in self.lookup_of:  # its rows made where the table lies
                carried = Carried(made, self.keep_whole)
                outs[0] = tuple(carried if n == "batch" else n for n in outs[0])
            key = (made, outs[0], tuple(eqn.outvars[0].aval.shape), item)
        elif prim.startswith("scatter") and len(ins) == 3:
            if "batch" in outs[0] and "batch" in ins[1]:
                # an activation's cotangent written at the batch's indices: the transpose
                # of a gather that read it so (the integer-label loss's, where the loss
                # itself is dead code and gone: a step that drops it)
                self.batch_indexed = True
            target = dedupe(op_names.scatter_update_names(p, outs[0], shapes))
            key = (ins[2], target, shapes[2], _itemsize(eqn.invars[2].aval))
        elif prim in ("top_k", "sort") and ins and any(n is not None for n in ins[0]):
            key = (ins[0], (None,) * len(ins[0]), shapes[0], _itemsize(eqn.invars[0].aval))
            self.reshards[key] = self.reshards.get(key, 0) + times
            return
        else:
            return
        if key[0] != key[1]:
            self.moves[key] = self.moves.get(key, 0) + times

    def _lookup(
        self, eqn: Any, ins: list[Names], made: Names, shapes: list[tuple[int, ...]], times: int
    ) -> None:
        """Notes an embedding lookup of the forward pass: a gather of a named table's rows
        (names it keeps from the table) by indices that carry the batch."""
        blank = (None,) * len(ins[0])
        shape = tuple(eqn.outvars[0].aval.shape)
        picked = op_names.gather_names(eqn.params, blank, ins[1], shapes, shape)
        table = eqn.invars[0]
        if not self.backward and "batch" in picked and table not in self.weight_of:
            self.batch_indexed = True  # an activation read by the batch's indices
        if (
            not self.sees_constraints
            or self.backward
            or "batch" not in picked
            or not any(made)
            or table not in self.weight_of
        ):
            return
        self.lookup_of[eqn.outvars[0]] = len(self.lookups)
        indices = (ins[1], shapes[1], _itemsize(eqn.invars[1].aval))
        self.lookups.append([(made, picked, self.site), times, False, indices])

    def _reduced(
        self, eqn: Any, ins: list[Names], shapes: list[tuple[int, ...]], times: int
    ) -> None:
        """Notes a reduction over named dimensions, none the batch (:attr:`Workload.reductions`;
        a sum over the batch is a gradient's, reduced with the weights' gradients)."""
        dims = tuple(eqn.params.get("axes", ())) if eqn.primitive.name in REDUCTIONS else ()
        names = ins[0] if ins else ()
        over = [names[d] for d in dims if d < len(names)]
        if any(n is not None for n in over) and not any(_batch_like(n) for n in over):
            key = (names, shapes[0], dims, _itemsize(eqn.outvars[0].aval))
            self.reductions[key] = self.reductions.get(key, 0) + times

    def _cut(
        self,
        eqn: Any,
        ins: list[Names],
        outs: list[Names],
        shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...]],
        times: int,
    ) -> None:
        """Notes a split, slice or concatenation of a named dimension, with its cuts
        (:attr:`Workload.realigned`)."""
        found = op_names.cuts(eqn.primitive.name, eqn.params, shapes, out_shapes)
        if found is None:
            return
        whole, dim, pieces = found
        names = ins[0] if whole == "in" else outs[0]
        shape = shapes[0] if whole == "in" else out_shapes[0]
        if pieces and dim < len(names) and names[dim] is not None:
            key = (names, shape, dim, pieces, _itemsize(eqn.outvars[0].aval))
            self.realigned[key] = self.realigned.get(key, 0) + times

    def _unpriced(self, eqn: Any, times: int) -> list[Names]:
        """A primitive the planner does not understand (a Pallas kernel, a custom call):
        priced conservatively, its outputs replicated and written to memory, its FLOPs
        (where it declares them: a Pallas kernel's ``cost_estimate``) run whole on every
        device; and named, with where the model runs it (``Workload.unpriced``)."""
        key = (eqn.primitive.name, self.site)
        if times:
            self.unpriced[key] = self.unpriced.get(key, 0) + times
            estimate = eqn.params.get("cost_estimate")
            self.unpriced_flops += int(getattr(estimate, "flops", 0) or 0) * times
        outs = [(None,) * len(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        for n, v in zip(outs, eqn.outvars, strict=True):
            self._count(v, n, times, False, boundary=True)
        return outs

    def _conv(self, eqn: Any, ins: list[Names], times: int) -> Names:
        """A convolution, counted as the matmul of its unfolded input (:class:`Dot`)."""
        p = eqn.params
        (lhs, rhs), (x, k), out = ins, eqn.invars, eqn.outvars[0]
        ls, rs, os_ = op_names.conv_dims(p)
        xs, ks, ys = tuple(x.aval.shape), tuple(k.aval.shape), tuple(out.aval.shape)
        inner = ks[rs[1]] * math.prod(ks[d] for d in rs[2:])
        dot = Dot(
            (lhs[ls[0]], *(None,) * len(os_[2:]), lhs[ls[1]]),
            (rhs[rs[1]], rhs[rs[0]]),
            (xs[ls[0]], *(ys[d] for d in os_[2:]), inner),
            (inner, ks[rs[0]]),
            ((len(os_) - 1,), (0,)),
            ((), ()),
            _itemsize(out.aval),
            _itemsize(x.aval),
            _itemsize(k.aval),
            lhs_size=math.prod(xs),
        )
        self.dots[dot] = self.dots.get(dot, 0) + times
        self.dot_trips[dot] = max(self.dot_trips.get(dot, 0), times)
        self.dot_by_eqn[id(eqn)] = dot
        operands = tuple(None if isinstance(v, Literal) else self.alias.get(v, v) for v in (x, k))
        self.dot_runs.append((id(eqn), out, dot, times, operands, self.backward))
        names = op_names.conv_names(p, lhs, rhs, ys)
        self._count(out, names, times, False, dot_out=True)
        return names

    def _constraint(self, eqn: Any, before: Names, shape: tuple[int, ...], times: int) -> Names:
        """The names a logical constraint gives its value (read back from the name mesh
        :func:`trace_workload` traces under: each name its own axis of size 1); a
        dimension it leaves unnamed keeps its name. A renamed value is a reshard."""
        spec = tuple(getattr(eqn.params.get("sharding"), "spec", ()))
        spec += (None,) * (len(shape) - len(spec))
        after = dedupe(
            tuple(
                (e if isinstance(e, str) else (e[0] if e else None)) or b
                for e, b in zip(spec[: len(shape)], before, strict=True)
            )
        )
        if after != before and times and eqn.invars[0] not in self.constlike:
            key = (before, after, shape, _itemsize(eqn.invars[0].aval))
            self.reshards[key] = self.reshards.get(key, 0) + times
        return after

    def _count(
        self,
        v: Any,
        names: Any,
        times: int,
        score: bool,
        *,
        boundary: bool = False,
        dot_out: bool = False,
        reads: Sequence[Any] | None = None,
        kernel: bool = False,
    ) -> None:
        """The bytes XLA moves for ``v``: written once and read by each consumer that is not
        fused with its producer, when it leaves a fusion (:data:`BOUNDARY`), and, for a
        value computed inside a fusion from ``reads`` (its equation's operands), the buffers
        its kernel reads where it is written or reduced (``kernel``):
        :mod:`meshplan._search.predict.fusion_reads`. A matmul's operands and output are
        priced with the matmul (:mod:`.cost`)."""
        if v in self.constlike:
            return  # XLA computes it where it is used (constant sinking, fusion)
        if reads is not None:
            self._fusion(v, names, times, score, reads, kernel)
        shape = tuple(getattr(v.aval, "shape", ()))
        size = math.prod(shape) * _itemsize(v.aval)
        consumers = self.readers(v)
        readers = sum(1 for c in consumers if c in BOUNDARY and c != "dot_general")
        if dot_out:
            moved = size * readers
            self.materialized.add(v)
        elif boundary or any(c in BOUNDARY or c == "return" for c in consumers):
            moved = size * (1 + readers)
            self.materialized.add(v)
        else:
            moved = 0
        if moved and times:
            cell = (names, shape, score)
            self.traffic[cell] = self.traffic.get(cell, 0) + moved * times
        if v in self.materialized:
            self.fusion_reads.buffer(v, (names, shape, score), size)

    def _fusion(
        self, v: Any, names: Any, times: int, score: bool, reads: Sequence[Any], kernel: bool
    ) -> None:
        """A value computed inside a fusion: where a kernel writes it (a consumer outside
        the fusion, or the program's result) or reduces into it (``kernel``), that kernel
        reads the buffers it is computed from; else it is made from them."""
        consumers = self.consumers.get(v, [])
        written = any(c in BOUNDARY or c == "return" for c in consumers)
        if not (written or kernel):
            self.fusion_reads.fused(v, reads)
            return
        if times:
            for cell, nbytes in self.fusion_reads.reads(reads):
                self.read_traffic[cell] = self.read_traffic.get(cell, 0) + nbytes * times
        if kernel and not written:  # a reduction's result: written, read by the next kernel
            shape = tuple(getattr(v.aval, "shape", ()))
            size = math.prod(shape) * _itemsize(v.aval)
            cell = (names, shape, score)
            if times:
                self.read_traffic[cell] = self.read_traffic.get(cell, 0) + size * times
            self.fusion_reads.buffer(v, cell, size)

    def _buffer(self, v: Any, names: Any) -> None:
        """``v`` is a buffer in memory (an input, a loop's result): what kernels read."""
        if isinstance(v, Literal) or not hasattr(v, "aval"):
            return
        shape = tuple(getattr(v.aval, "shape", ()))
        size = math.prod(shape) * _itemsize(v.aval)
        self.fusion_reads.buffer(v, (names, shape, v in self.scores), size)

    def _returns(self, body: Any, outer: Sequence[Any]) -> None:
        """Notes the call's outputs ``outer`` as what ``body``'s returned values become."""
        same = facts(body).alias
        for inner, out in zip(body.outvars, outer, strict=True):
            if not isinstance(inner, Literal) and type(out).__name__ != "DropVar":
                self.returned_as[same.get(inner, inner)] = out

    def readers(self, v: Any) -> list[str]:
        """The primitives that read ``v`` (``'return'``: an output of the step, or of a
        loop's body). A value a call (``jit``, ``custom_jvp``, ``checkpoint``) returns is
        read by what reads the call's output: XLA inlines the call, so its return ends no
        fusion (the integer labels' one-hot of ``jax.nn.one_hot``, under its own ``jit``, is
        fused into the loss that multiplies it, never written to memory)."""
        got = self.consumers.get(v, [])
        seen = {v}
        while "return" in got and v in self.returned_as:
            v = self.returned_as[v]
            if v in seen:
                break
            seen.add(v)
            got = [c for c in got if c != "return"] + self.consumers.get(v, [])
        return got

    def _picked(self, eqn: Any, ins: list[Names], shapes: list[tuple[int, ...]]) -> list[Names]:
        """``ins``, the zeros a gather's transpose scatters into named as what the gather
        picked from: the integer-label loss's logits' cotangent as the logits (XLA splits
        it by vocab, where a tensor axis splits the logits, not whole), found by the
        forward's last activation of that shape where the loss, its gather with it, is
        dead code (a step that drops it)."""
        prim = eqn.primitive.name
        if prim == "gather" and ins and "batch" in ins[0]:
            self.picked_from[shapes[0]] = ins[0]
        elif not self.backward:  # the forward's values of each shape: the logits, where the
            for v, n, shape in zip(eqn.invars, ins, shapes, strict=False):  # loss is dead
                if "batch" in n and not isinstance(v, Literal) and _floating(v.aval):
                    self.by_shape[shape] = n
        scatter = prim.startswith("scatter") and len(ins) == 3 and not any(ins[0])
        if scatter and eqn.invars[0] in self.constlike:
            picked = self.picked_from.get(shapes[0], self.by_shape.get(shapes[0], ins[0]))
            return [picked, *ins[1:]]
        return ins

    @staticmethod
    def other(
        prim: str,
        p: Any,
        ins: list[Names],
        shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...]],
        forward: bool = False,
    ) -> list[Names]:
        if prim == "transpose" and ins:
            return [tuple(ins[0][i] for i in p["permutation"])]
        if prim in ("top_k", "sort"):  # on the whole operand (gathered: Workload.reshards)
            return [(None,) * len(shape) for shape in out_shapes]
        if prim == "gather" and len(ins) == 2:
            return [op_names.gather_names(p, ins[0], ins[1], shapes, out_shapes[0])]
        if prim.startswith("scatter") and len(ins) == 3:
            return [op_names.scatter_names(p, ins[0], ins[1], ins[2], shapes)]
        if prim == "broadcast_in_dim" and ins:
            out: list[Any] = [None] * len(out_shapes[0])
            for i, d in enumerate(p["broadcast_dimensions"]):
                if shapes[0][i] == out_shapes[0][d]:
                    out[d] = ins[0][i]
            return [tuple(out)]
        if prim == "reshape" and ins:
            return [_reshape(ins[0], shapes[0], out_shapes[0])]
        if prim == "slice" and ins and len(ins[0]) == len(out_shapes[0]):
            return [ins[0]]  # a slice keeps its dimensions (logits[:, :-1] is still 'length')
        if prim == "split" and ins:  # each piece split as the whole (a fused q/k/v's)
            return [ins[0]] * len(out_shapes)
        if prim == "concatenate" and ins and all(n == ins[0] for n in ins):
            return [ins[0]]  # pieces named alike: the whole as they are
        if prim == "squeeze" and ins:
            dims = set(p["dimensions"])
            return [tuple(n for i, n in enumerate(ins[0]) if i not in dims)]
        if prim.startswith(("reduce_", "argmax", "argmin")) and "axes" in p and ins:
            axes = set(p["axes"])
            return [tuple(n for i, n in enumerate(ins[0]) if i not in axes)] * len(out_shapes)
        pairs = list(zip(ins, shapes, strict=True))
        return [_elementwise(shape, pairs, forward) for shape in out_shapes]


def _contracts_carried(names: Names, contract: Sequence[int], by: Collection[Names]) -> bool:
    """Whether a matmul operand named ``names`` holds a :class:`Carried` batch made in one of
    the splits ``by`` and is contracted (dimensions ``contract``) over a name of it."""
    over = {names[j] for j in contract}
    return any(isinstance(n, Carried) and n.by in by and over & set(n.by) for n in names)


def _elementwise_op(eqn: Any) -> bool:
    """An op of operands of its output's shape or broadcast to it (``mul``, ``add``,
    ``select_n``; a ``[1, 1, embed]`` scale): not an indexing op (an embedding's lookup,
    which the partitioner does where the table lies)."""
    if len(eqn.outvars) != 1:
        return False
    shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
    return all(
        isinstance(v, Literal)
        or (
            len(v.aval.shape) == len(shape)
            and all(a in (b, 1) for a, b in zip(v.aval.shape, shape, strict=True))
        )
        for v in eqn.invars
    )


def _carry_fixpoint(body: Any, body_in: list[Names], nc: int, ncarry: int) -> list[Names]:
    """A loop carry's names, filled in from what the body gives it back.

    A carry that enters a loop unnamed (a scanned layer's input, the first layer
    fed by the batch) leaves it named by the body (the layer's output takes its
    weight's ``embed``). XLA's sharding propagation gives the carry one sharding
    for every trip, so the names the body returns are merged into those it
    receives, until they settle (a dry walk each time, nothing counted).
    """
    carry = list(body_in[nc : nc + ncarry])
    for _ in range(3):
        out = _Walker().walk(body, [*body_in[:nc], *carry, *body_in[nc + ncarry :]], 0)
        merged = [
            tuple(_merge(a, b) for a, b in zip(c, o, strict=True)) if len(c) == len(o) else c
            for c, o in zip(carry, out[:ncarry], strict=True)
        ]
        if merged == carry:
            break
        carry = merged
    return carry


def constraint_names(state_names: Sequence[Names | None]) -> tuple[str, ...]:
    """The logical names a traced step's constraints are read for: the state's names,
    MaxText's ``activation_`` form of each, the sequence and expert names of
    :mod:`meshplan._search.predict.role_names`, and every name a built-in layout places.

    Example:
        >>> from meshplan._search.predict.trace import constraint_names
        >>> names = constraint_names([("embed", "mlp")])
        >>> names[:3], names[-2:], "length" in names, "expert_batch" in names
        (('embed', 'mlp', 'batch'), ('activation_embed', 'activation_mlp'), True, True)
    """
    from meshplan._search.predict.role_names import CONTEXT_NAMES, EXPERT_BATCH_NAMES, EXPERT_NAMES
    from meshplan.layouts import ALL_LAYOUTS

    own = [n for names in state_names if names for n in names if isinstance(n, str)]
    out = [*own, "batch", *CONTEXT_NAMES, *EXPERT_NAMES, *EXPERT_BATCH_NAMES]
    out += [*(n for r in ALL_LAYOUTS.values() for n, _ in r), *(f"activation_{n}" for n in own)]
    return tuple(dict.fromkeys(n for n in out if isinstance(n, str)))


_MESH_AXES = 32
"""The most axes ``jax.make_mesh`` takes (a numpy array of the devices, one dimension each)."""


def _name_mesh(
    names: Sequence[str],
) -> tuple[jax.sharding.Mesh, tuple[tuple[str, str | None], ...]]:
    """A mesh of one device, an axis of size 1 per name, and rules naming each name's
    axis; past :data:`_MESH_AXES`, the last names (MaxText's ``activation_`` forms
    first) name none, and constraints by them read as unsplit."""
    axes = tuple(names[:_MESH_AXES])
    auto = (jax.sharding.AxisType.Auto,) * len(axes)
    mesh = jax.make_mesh((1,) * len(axes), axes, axis_types=auto)
    return mesh, tuple((n, n if n in axes else None) for n in names)


def _make_jaxpr(
    step_fn: Callable[..., Any],
    abstract_state: Any,
    example_batch: Any,
    state: Sequence[tuple[Names | None, tuple[int, ...], int]],
    read_constraints: bool,
) -> tuple[Any, bool]:
    """``jax.make_jaxpr`` of the step without its dead code (:func:`live`: XLA runs none of
    it; a ``jax.grad`` step's loss); under the name mesh (``read_constraints``) when no
    mesh is active; and whether it was (the model's constraints are in it, by name)."""
    from meshplan._spmd.place import active_mesh
    from meshplan._spmd.rules import logical_axis_rules

    if read_constraints and active_mesh() is None:
        mesh, rules = _name_mesh(constraint_names([n for n, _, _ in state]))
        try:
            with jax.set_mesh(mesh), logical_axis_rules(rules):
                return live(jax.make_jaxpr(step_fn)(abstract_state, example_batch)), True
        except Exception:  # a step that names mesh axes itself: traced without
            pass
    return live(jax.make_jaxpr(step_fn)(abstract_state, example_batch)), False


def _walk(
    jaxpr: Any,
    in_names: list[Names],
    sees_constraints: bool,
    keep_whole: bool = False,
    sliced: frozenset[int] = frozenset(),
    split: frozenset[int] | None = None,
) -> _Walker:
    """One walk of the step; ``split``: the forward matmuls (ids of their equations) that
    make their output in their weight's split (:meth:`_Walker._in_weights_split`).
    ``None``: found by a first walk, then walked again with them where there are any."""
    walker = _walk_once(jaxpr, in_names, sees_constraints, keep_whole, sliced, split)
    if split is None and (found := frozenset(walker.confirmed - walker.anchored)):
        return _walk(jaxpr, in_names, sees_constraints, keep_whole, sliced, found)
    return walker


def _walk_once(
    jaxpr: Any,
    in_names: list[Names],
    sees_constraints: bool,
    keep_whole: bool,
    sliced: frozenset[int],
    split: frozenset[int] | None,
) -> _Walker:
    walker = _Walker()
    walker.sees_constraints = sees_constraints
    walker.keep_whole = keep_whole
    walker.sliced = sliced
    walker.split_eqns = split or frozenset()
    for n in in_names:
        walker.note(n)
    if len(jaxpr.invars) != len(in_names):  # leaves JAX did not make inputs: names unknown
        in_names = [(None,) * len(v.aval.shape) for v in jaxpr.invars]
    for v, n in zip(jaxpr.invars, in_names, strict=True):
        if "batch" not in n and any(isinstance(a, str) for a in n):
            walker.weight_of[v] = v  # a named state array: a parameter (or its optimizer state)
    walker.walk(jaxpr, in_names, 1)
    walker.name_dot_outputs()
    return walker


def _floating(x: Any) -> bool:
    """A floating-point array (an activation, images), not token ids or a mask."""
    return bool(jax.numpy.issubdtype(getattr(x, "dtype", np.int32), jax.numpy.floating))


def _carried_by(names: Names, by: Names) -> Names:
    return tuple(Carried(by) if n == "batch" else n for n in names)


def _is_tokens(leaf: Any) -> bool:
    """Token ids: an integer ``[batch, length]`` array."""
    shape = getattr(leaf, "shape", ())
    return len(shape) == 2 and bool(np.issubdtype(np.dtype(leaf.dtype), np.integer))


def _token_names(leaf: Any) -> Names:
    return ("batch", "length") if _is_tokens(leaf) else _batch_names(leaf)


def _batch_names(leaf: Any) -> Names:
    ndim = len(getattr(leaf, "shape", ()))
    return ("batch", *(None,) * (ndim - 1)) if ndim else ()


def trace_workload(
    step_fn: Callable[..., Any],
    abstract_state: Any,
    example_batch: Any,
    rules: LogicalRules | None = None,
    batch_names: Callable[[Any], Names] | None = None,
    read_constraints: bool = False,
) -> Workload:
    """Traces ``step_fn(abstract_state, example_batch)`` once and reads its work by logical names.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.predict.trace import trace_workload
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((64, 32), jnp.float32), ("embed", "mlp"))
        >>> work = trace_workload(lambda s, x: (x @ s["w"].value).sum(), {"w": w},
        ...                       jax.ShapeDtypeStruct((16, 64), jnp.float32))
        >>> [(d.lhs_names, d.rhs_names, n) for d, n in work.dots.items()], work.flops
        ([(('batch', None), ('embed', 'mlp'), 1)], 65536)
        >>> work.names
        ('embed', 'mlp', 'batch')

    Args:
        step_fn: ``step_fn(state, batch)``, not jitted (a jitted one is walked through).
        abstract_state: The state (boxes around ``ShapeDtypeStruct``s, NNX states, arrays).
        example_batch: The batch (arrays or ``ShapeDtypeStruct``s, any tree).
        rules: Rules for NNX variables whose names depend on them (else the active ones).
        batch_names: The names of one batch array (default: ``('batch', None, ...)``).
        read_constraints: Read the names of the model's logical constraints
            (:func:`meshplan.with_logical_constraint`): the step is traced under a mesh
            of one device with an axis of size 1 per logical name it may use
            (:func:`constraint_names`, the first 32: ``jax.make_mesh``'s most) and rules
            mapping each name to its axis, so that
            every constraint is left in the program with its names. Activations then
            carry ``length`` (context parallelism) and a mixture of experts' dispatch its
            ``expert``/``expert_batch``, which no parameter names (what
            :func:`meshplan.search_rules` does, to offer the ``context`` and ``expert``
            roles). Without a mesh or rules the constraints do nothing; a step that fails
            under that mesh (one that names mesh axes itself) is traced without it.
    """
    # Flax NNX names are logical only when rules are in effect (else mesh axes, as in Flax): a
    # search is looking for those rules, so it reads them as logical (a rule that names nothing).
    leaves, _ = array_leaves(abstract_state, rules or _READ_AS_LOGICAL)
    by_id = {id(leaf.value): leaf for leaf in leaves}
    flat_state = jax.tree.leaves(abstract_state)
    state_names: list[Names] = []
    state: list[tuple[Names | None, tuple[int, ...], int]] = []
    for x in flat_state:
        leaf = by_id.get(id(x))
        names = leaf.names if leaf is not None and leaf.kind == "logical" else None
        shape = tuple(getattr(x, "shape", ()))
        if names is not None and len(names) != len(shape):
            names = None
        state_names.append(tuple(names) if names is not None else (None,) * len(shape))
        state.append((tuple(names) if names is not None else None, shape, _itemsize(x)))
    flat_batch = jax.tree.leaves(example_batch)
    name_of = batch_names or _batch_names
    closed, sees = _make_jaxpr(step_fn, abstract_state, example_batch, state, read_constraints)
    in_names = [*state_names, *(tuple(name_of(b)) for b in flat_batch)]
    jaxpr = closed.jaxpr
    walker = _walk(jaxpr, in_names, sees)
    if batch_names is None and "length" in walker.seen and any(map(_is_tokens, flat_batch)):
        # The model names its sequence 'length': so is the token ids' second dimension
        # (the loss's targets, sliced from them, are never constrained by the model).
        name_of = _token_names
        in_names = [*state_names, *(tuple(name_of(b)) for b in flat_batch)]
        walker = _walk(jaxpr, in_names, sees)
    head = None if walker.batch_named else walker.head_by
    if head is not None and (not walker.lookups or any(map(_floating, flat_batch))):
        # A head on one position of the sequence (a class token): XLA's propagation carries
        # its weight's split back into the layers, which run on the whole batch in it, the
        # inputs gathered whole (Hugging Face's ViT under FSDP: f32[16,32,32,3] gathered),
        # unless the model constrains its activations to the batch (XLA then keeps them so).
        # Beside lookups (CLIP's text tower), only the inputs they do not read: the images.
        in_names = [
            *state_names,
            *(
                _carried_by(tuple(name_of(b)), head)
                if not walker.lookups or _floating(b)
                else tuple(name_of(b))
                for b in flat_batch
            ),
        ]
        walker = _walk(jaxpr, in_names, sees, split=walker.split_eqns)
    unconstrained = any(not lookup[2] for lookup in walker.lookups)
    if unconstrained and (not walker.batch_indexed or head is not None):
        # Nothing indexes an activation by the batch (a one-hot loss): the logits' cotangent
        # is made whole, where the head's partial sums left the logits, and the backward pass
        # runs in the lookups' split as the forward does; XLA keeps the layers' values whole
        # in both passes (read from the encoder-decoder's compiled step: its attention scores
        # f32[16,4,32,32], the whole batch's, saved for the backward). So does a class
        # token's head (Hugging Face's BERT classifier under FSDP: 8.5 MB of temporaries,
        # 3.2 data parallel).
        walker = _walk(jaxpr, in_names, sees, keep_whole=True, split=walker.split_eqns)
        for _ in range(3):  # the matmuls whose values meet the batch's split, sliced there
            sliced = walker.sliced | walker.to_slice
            if sliced == walker.sliced:
                break
            walker = _walk(
                jaxpr, in_names, sees, keep_whole=True, sliced=sliced, split=walker.split_eqns
            )
    batch = int(flat_batch[0].shape[0]) if flat_batch and flat_batch[0].shape else None
    params = tuple(dict.fromkeys(n for names, _, _ in state if names for n in names if n))
    var_names = {**walker.var_names, **walker.buffer_names}
    # The third program (XLA:CPU's: its depth-first order, the gradients' reductions
    # deferred, the values matmuls read transposed made in those copies, the arrays of the
    # ops it expands) only where any of them moves, is copied or is expanded: otherwise it
    # is the second one, and the cost model takes that.
    variants = [(True, False), (False, False)]
    moved = memory.late_moves(jaxpr, var_names, walker.materialized)
    if any(moved) or memory.copied(jaxpr, walker.materialized) or memory.expands(jaxpr):
        variants.append((False, True))
    held = {**walker.var_names, **walker.held_whole, **walker.buffer_names}
    programs = [
        memory.build(
            jaxpr,
            held,
            walker.scores,
            lambda e: walker.dot_by_eqn[id(e)],
            walker.materialized,
            recompute,
            late,
            moved,
            frozenset(walker.held_whole),
        )
        for recompute, late in variants
    ]
    batch_state = [
        (tuple(name_of(b)), tuple(getattr(b, "shape", ())), _itemsize(b)) for b in flat_batch
    ]
    unit: ThroughputUnit
    tokens, unit = batch, "examples"
    if flat_batch and _is_tokens(flat_batch[0]):
        tokens, unit = math.prod(flat_batch[0].shape), "tokens"  # sequences x positions
    return Workload(
        walker.dots,
        walker.traffic,
        state,
        tuple(walker.seen),
        batch,
        params,
        programs[0],
        frozenset(walker.score_dots),
        batch_state,
        tokens,
        {**walker.reshards, **_lookup_indices(walker)},
        programs[1],
        unit,
        walker.dot_trips,
        walker.operand_arrays,
        tuple(walker.arrays),
        tuple(
            (n, s, i, act, t, fwd and bwd, fwd)
            for n, s, i, act, t, fwd, bwd in walker.weight_reads.values()
        ),
        frozenset(walker.causal_masks),
        walker.unpriced,
        walker.unpriced_flops,
        walker.moves,
        _lookups(walker),
        frozenset(walker.backward_dots),
        memory_late=programs[2] if len(programs) > 2 else None,
        fusion_reads=walker.read_traffic,
        reductions=walker.reductions,
        realigned=walker.realigned,
        parts=frozenset(walker.parts),
        head=None if head is None else (head, walker.head_site),
        held_broadcasts=walker.held_broadcasts,
    )


def _lookups(walker: _Walker) -> dict[tuple[Names, Names, str], int]:
    """The embedding lookups whose rows no logical constraint names, with their runs."""
    out: dict[tuple[Names, Names, str], int] = {}
    for key, runs, constrained, _ in walker.lookups:
        if not constrained:
            out[key] = out.get(key, 0) + runs
    return out


def _lookup_indices(walker: _Walker) -> dict[tuple[Names, Names, tuple[int, ...], int], int]:
    """The reshards of the indices of the lookups whose rows no constraint names: XLA gathers
    them whole (``s32[batch, length, 1]``) to make the rows where the table lies, over the
    batch's axes the table's names take (:class:`Carried`), keyed as ``Workload.reshards``."""
    out: dict[tuple[Names, Names, tuple[int, ...], int], int] = {}
    for (made, _, _), runs, constrained, (names, shape, item) in walker.lookups:
        if not constrained:
            whole = tuple(Carried(made) if n == "batch" else n for n in names)
            key = (names, whole, shape, item)
            out[key] = out.get(key, 0) + runs
    return out
