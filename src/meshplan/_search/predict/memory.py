"""Memory per device of a traced step: its state, what it keeps for the backward pass, its peak.

The step's jaxpr, as :func:`meshplan._search.predict.trace.trace_workload` traced it, is the
program JAX's autodiff wrote: the forward pass, the residuals partial evaluation chose
to keep (following ``jax.checkpoint``/``nn.remat`` and their policies: a rematerialised
block keeps only its inputs and what its policy saves, and recomputes the rest inside the
backward pass), then the backward pass and the optimizer update. So the values it keeps
are JAX's own choice; this module only asks how long each one lives.

:func:`build` walks the program in order (scan and loop bodies once, as XLA runs one
iteration at a time, inside the buffers of the loop's stacked outputs; calls inline)
and records, at every equation, which values are alive, each as a *cell* (its logical
names, shape and item size, so that one candidate prices it in a few vector products).
A value is alive from the equation that defines it to its last use; the step's inputs
(state, batch) are the arguments and its outputs the new state (XLA counts both apart
from its temporaries, and a donated state aliases them). A value a sharding constraint
names is priced by the constraint's names (:mod:`meshplan._search.predict.trace` gives each
buffer the names XLA's sharding propagation would). Where the device has a memory limit
XLA works to (``recompute``: TPU, GPU), the cheap elementwise values autodiff keeps (a
norm's float32 copy, an activation's derivative, the targets' one-hot) are recomputed
where they are used, from values kept anyway, instead of being kept
(:func:`recompute_sources`); a scan's stacked outputs are always kept. On the CPU, a value
cheap ops compute that a matmul reads transposed is made again for each of its readers
from its sources, kept until the last (:func:`copied`).

:func:`peak` prices the program on a candidate: each cell's bytes per device (its shape
split by the mesh axes its names map to), plus, at each matmul, the all-gathered operand
the partitioner materialises (FSDP's gathered weight), and returns the largest point,
split into *activations* (values defined before the top-level equation where the peak
falls: the residuals, the gradients so far) and *temporaries* (the current layer's
values, gathered weights, the optimizer update's intermediates).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

import numpy as np
from jax.extend.core import Literal

from meshplan._search.predict.jaxpr_facts import Facts, call_body, facts, is_alias, is_expensive
from meshplan._search.predict.primitives import (
    CALL_PARAMS,
    FUSES_OPERANDS,
    KINDS,
    MATMULS,
    REMAT,
)

__all__ = [
    "Hoist",
    "MemoryProgram",
    "Peak",
    "build",
    "copied",
    "kept_expensive",
    "late_moves",
    "peak",
    "recompute_sources",
    "transposed",
]

REDUCTIONS = KINDS["reduction"]

Cell = tuple[tuple[Any, ...], tuple[int, ...], int, bool]
"""(names, shape, itemsize, score)"""


@dataclasses.dataclass
class MemoryProgram:
    """Alive cells at every point of a step (module docstring).

    ``long``/``short``: ``[points, cells]`` counts of values defined before the point's
    top-level equation, and of those defined within it; ``dot``: per point, the index in
    ``dots`` of the matmul running there (``-1``: none); ``output``: counts of the step's
    outputs (the updated state), not temporaries; ``scope``: per point, the loop body
    (a scanned layer) it runs in, an index in ``scopes`` (``-1``: none), whose entries
    list the matmuls of each body; ``ran``: ``[points, dots]``, how many times each matmul
    has run before the point since the start of its loop iteration (or of the step, outside
    loops): the gradients whose reductions XLA may still be combining; ``hoists``: the
    rematerialised regions of unrolled layers (:class:`Hoist`), which a collective combiner
    may run in the forward pass; ``sums``: the matmuls whose outputs are summed into one
    value (a layer input's gradient from its q/k/v or gate/up projections), each as ``(the
    point of the last of them, their indices in dots, the cell of one output)``; ``at``:
    per point, the places in the walk's order of top-level equations it occurs at.
    """

    cells: list[Cell]
    long: np.ndarray
    short: np.ndarray
    dot: np.ndarray
    dots: list[Any]
    output: np.ndarray
    scope: np.ndarray | None = None
    scopes: list[list[int]] = dataclasses.field(default_factory=list)
    ran: np.ndarray | None = None
    hoists: list[Hoist] = dataclasses.field(default_factory=list)
    sums: list[tuple[int, tuple[int, ...], int]] = dataclasses.field(default_factory=list)
    at: list[frozenset[int]] = dataclasses.field(default_factory=list)

    def sizes(self, bytes_of: Callable[[Cell], int]) -> np.ndarray:
        """Bytes per device of each cell, by ``bytes_of``."""
        return np.array([float(bytes_of(c)) for c in self.cells])

    @functools.cached_property
    def places(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, place)``: the places each point occurs at (``at``), flattened in the
        points' order, and where each point's begin (points that occur nowhere left out)."""
        counts = np.array([len(at) for at in self.at], dtype=int)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        return starts, np.array([t for at in self.at for t in sorted(at)], dtype=float)

    @functools.cached_property
    def dot_places(self) -> list[np.ndarray | None]:
        """Per matmul of ``dots``, the places it runs at (``None``: inside a loop)."""
        out: list[np.ndarray | None] = []
        for d in range(len(self.dots)):
            rows = np.flatnonzero(self.dot == d)
            inside = self.scope is not None and bool((self.scope[rows] >= 0).any())
            out.append(None if inside else np.unique([t for r in rows for t in self.at[r]]))
        return out


@dataclasses.dataclass(frozen=True)
class Hoist:
    """A rematerialised region of an unrolled layer (a top-level ``checkpoint``/``remat``
    equation of the backward pass: the layer's recomputation, then its transpose).

    ``at``: the top-level equation of the region; ``triggers``: per matmul of the region,
    in its order, ``(index in dots, between, counts)``: if that matmul is the region's
    first whose output is a partial sum (all-reduced), and XLA's combiner merges that
    all-reduce with the forward pass's own of the same layer, the matmul and every value
    it depends on in the region run as soon as their inputs exist (after the top-level
    equation that makes the last of them), and the values of them the rest of the region
    reads (``counts`` per cell) stay alive until the region: through the points
    ``between`` marks (a point stands for every place of the step it occurs at, and is
    marked where one of them lies between).
    """

    at: int
    triggers: list[tuple[int, np.ndarray, np.ndarray]]


@dataclasses.dataclass(frozen=True)
class Peak:
    """The largest point of a step's memory on one device (bytes).

    ``activations``: alive across the top-level equation of the peak (residuals kept for
    the backward pass, gradients so far); ``temporaries``: the rest (the layer being
    computed, gathered weights, the optimizer update); ``outputs``: the updated state.
    """

    activations: int
    temporaries: int
    outputs: int

    @property
    def total(self) -> int:
        return self.activations + self.temporaries


def _itemsize(v: Any) -> int:
    try:
        return int(np.dtype(v.aval.dtype).itemsize)
    except TypeError:  # not a NumPy dtype (a key, a token): priced as 4 bytes
        return 4


def _nbytes(v: Any) -> int:
    return int(math.prod(getattr(v.aval, "shape", ()))) * _itemsize(v)


def recompute_sources(jaxpr: Any, direct: bool = False) -> dict[Any, frozenset[Any]]:
    """``{value: the values it is recomputed from}`` for the values of ``jaxpr`` that only
    elementwise ops and reductions (:data:`meshplan._search.predict.primitives.RECOMPUTED`,
    directly or inside calls) compute from its inputs and from the results of other ops
    (matmuls, loops, gathers): what XLA can recompute where it is used. ``direct``: the
    operands each is computed from (a call's: its inputs), rather than those other ops'
    results. Read from the one walk of ``jaxpr`` (:attr:`.jaxpr_facts.Facts.sources`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.memory import recompute_sources
        >>> j = jax.make_jaxpr(lambda w, x: jnp.tanh((x @ w).sum(0)).astype(jnp.bfloat16))(
        ...     jnp.ones((8, 8)), jnp.ones((4, 8)))
        >>> product = j.jaxpr.eqns[0].outvars[0]      # the matmul's result: kept
        >>> recompute_sources(j.jaxpr)[j.jaxpr.outvars[0]] == {product}
        True
    """
    found = facts(jaxpr)
    return dict(found.direct_sources if direct else found.sources)


class _Builder:
    def __init__(
        self,
        names: Mapping[Any, Any],
        scores: set[Any],
        dot_of: Callable[[Any], Any],
        materialized: set[Any] | None,
        recompute: bool = True,
        whole: frozenset[Any] = frozenset(),
    ) -> None:
        self.names, self.scores, self.dot_of = names, scores, dot_of
        self.whole = whole
        self.materialized, self.recompute = materialized, recompute
        # the values the equations late_moves defers read: XLA recomputes those cheap
        # ops make in the moved ones' fusions (from what is kept until then), not keep them
        self.late_reads: set[Any] = set()
        self.copies = False  # XLA:CPU makes a value a matmul reads transposed in that copy
        # the fused values the moved equations read that XLA writes to memory where they
        # are made (:func:`_kept_late`): not recomputed in the late fusions
        self.late_inputs: set[Any] = set()
        self.kept_late: set[Any] = set()
        self.cells: dict[Cell, int] = {}
        self.points: dict[
            tuple[Any, ...],
            tuple[dict[int, int], dict[int, int], int, int, tuple[tuple[int, int], ...], set[int]],
        ] = {}
        self.scope = -1  # the loop body being walked (an index in scopes)
        self.scopes: list[list[int]] = []  # each loop body's matmuls
        self.dots: dict[Any, int] = {}
        self.ran: dict[int, int] = {}  # matmuls run since the loop iteration (step) began
        self.top = -1  # the top-level equation being walked
        self.defined: dict[Any, int] = {}  # a top-level value: the equation defining it
        self.hoists: list[tuple[int, list[tuple[int, int, dict[int, int]]]]] = []
        self.sums: list[tuple[tuple[Any, ...], tuple[int, ...], int]] = []

    def cell(self, v: Any, outer: bool = False) -> int | None:
        fused = self.materialized is not None and v not in self.materialized
        if not outer and fused and v not in self.kept_late:
            return None  # fused into its consumers: never in memory
        shape = tuple(getattr(v.aval, "shape", ()))
        item = _itemsize(v)
        if not math.prod(shape) * item:
            return None
        return self._cell_of(v, shape, item, v in self.scores)

    def _cell_of(self, v: Any, shape: tuple[int, ...], item: int, score: bool = False) -> int:
        """The cell of an array of ``v``'s names, of ``shape`` and ``item`` bytes an element."""
        names = tuple(self.names.get(v, (None,) * len(shape)))
        return self.cells.setdefault((names, shape, item, score), len(self.cells))

    def add(self, long: dict[int, int], short: dict[int, int], dot: int) -> tuple[Any, ...]:
        ran = tuple(sorted(self.ran.items()))
        key = (tuple(sorted(long.items())), tuple(sorted(short.items())), dot, self.scope, ran)
        # the top-level equations a point occurs at, for the hoisted regions (:class:`Hoist`)
        self.points.setdefault(key, (long, short, dot, self.scope, ran, set()))[5].add(self.top)
        if dot >= 0 and self.scope >= 0 and dot not in self.scopes[self.scope]:
            self.scopes[self.scope].append(dot)
        return key

    def walk(
        self,
        jaxpr: Any,
        long: dict[int, int],
        short: dict[int, int],
        top: bool,
        skip: set[Any],
    ) -> None:
        """Record the points of ``jaxpr`` over the outer alive cells ``long``/``short``.

        ``skip``: variables not counted (inputs and outputs held by an outer buffer)."""
        found = facts(jaxpr)
        alias = found.alias  # a constraint's value is its input's buffer
        skip = skip | {alias[v] for v in skip if v in alias}
        last: dict[Any, float] = dict(found.last_use)  # extended where values are recomputed
        recomputed = self._recomputed(jaxpr, alias, last, skip)
        self._fused_sources(jaxpr, last, skip)
        if top and self.late_reads and not self.recompute:
            recomputed |= self._recomputed(jaxpr, alias, last, skip, self.late_reads)
            self.kept_late = _kept_late(self.late_inputs, self.materialized, recomputed)
        if self.copies:  # what a late gradient reads is kept where made, not made again
            recomputed |= self._copied(jaxpr, last, skip, recomputed | self.late_inputs)
        alive: dict[Any, int] = {}  # var -> cell, defined here and still alive
        # XLA:CPU's program only: the max-pools it expands, the partial sums it combines
        expanded = [e for e in jaxpr.eqns if e.primitive.name == EXPANDED] if self.copies else []
        pooled = {e.invars[1] for e in expanded}
        summed = _summed_matmuls(jaxpr) if self.copies else {}
        for v in jaxpr.invars:
            if v in skip or v not in last:
                continue
            c = self.cell(v)
            if c is not None:
                alive[v] = c
        for i, eqn in enumerate(jaxpr.eqns):
            if top:
                self.top = i
                self.defined.update((v, i) for v in eqn.outvars)
            if is_alias(eqn):
                continue
            prim = eqn.primitive.name
            if top and prim in REMAT:
                self._hoist(eqn, i)
            outs = {}
            for v in eqn.outvars:
                if type(v).__name__ == "DropVar" or v in skip or v in alias or v in recomputed:
                    continue
                c = self.cell(v)
                if c is not None and v in last:
                    outs[v] = c
            here_long, here_short = dict(long), dict(short)
            for v, c in alive.items():
                if last[v] < i:  # a recomputed value's source, freed once it was recomputed
                    continue
                target = here_long if top else here_short
                target[c] = target.get(c, 0) + 1
            if prim not in FUSES_OPERANDS:  # a recomputed operand exists while it is read
                body = found.bodies[i]
                whole = None if body is None else facts(body).whole_inputs
                for k, u in enumerate(eqn.invars):
                    v = None if isinstance(u, Literal) else alias.get(u, u)
                    c = self.cell(v) if v in recomputed else None
                    if c is not None and (whole is None or k in whole):
                        here_short[c] = here_short.get(c, 0) + 1
            sub = self._sub(eqn)
            if sub is not None:
                body, inner_skip, loop = sub
                with_outs = dict(here_short)
                if loop:  # a loop's outputs are allocated first; its body writes into them
                    for c in outs.values():
                        with_outs[c] = with_outs.get(c, 0) + 1
                outer_scope, outer_ran = self.scope, self.ran
                if loop and prim == "scan":  # a scanned layer: its weights are gathered together
                    self.scope = len(self.scopes)
                    self.scopes.append([])
                if loop:  # collectives are not combined across a loop's iterations
                    self.ran = {}
                self.walk(body, here_long, with_outs, False, inner_skip)
                self.scope = outer_scope
                if loop:
                    self.ran = outer_ran
            else:
                for c in outs.values():
                    here_short[c] = here_short.get(c, 0) + 1
                dot = -1
                if prim in MATMULS:
                    d = self.dot_of(eqn)
                    dot = self.dots.setdefault(d, len(self.dots))
                if self.copies:  # the arrays of the ops XLA:CPU expands
                    for c, m in self._expansion(eqn, pooled).items():
                        here_short[c] = here_short.get(c, 0) + m
                key = self.add(here_long, here_short, dot)
                if i in summed and outs:
                    made = tuple(
                        self.dots.setdefault(self.dot_of(e), len(self.dots)) for e in summed[i]
                    )
                    self.sums.append((key, made, next(iter(outs.values()))))
                if dot >= 0:
                    self.ran[dot] = self.ran.get(dot, 0) + 1
            for v in [v for v in alive if last.get(v, -1) <= i]:
                del alive[v]
            alive.update(outs)

    def _expansion(self, eqn: Any, pooled: set[Any]) -> dict[int, int]:
        """The arrays XLA:CPU makes for a max-pool whose gradient it expands
        (:data:`EXPANDED`) while ``eqn`` runs, as cells with their counts: at the forward
        pool (its operand in ``pooled``), an ``s32`` index array per dimension of the
        operand and the window maxima's indices (pooled-shaped); at the gradient, those
        indices, concatenated."""
        prim = eqn.primitive.name
        if prim == EXPANDED:
            source, operand = eqn.invars[:2]
            arrays = [(source, len(operand.aval.shape))]
        elif prim in POOLS and eqn.invars[0] in pooled:
            operand, rank = eqn.invars[0], len(eqn.invars[0].aval.shape)
            arrays = [(operand, rank), (eqn.outvars[0], rank)]
        else:
            return {}
        made: dict[int, int] = {}
        for v, count in arrays:
            c = self._cell_of(v, tuple(v.aval.shape), 4)  # s32 indices, f32 maxima
            made[c] = made.get(c, 0) + count
        return made

    def _hoist(self, eqn: Any, at: int) -> None:
        """Record the region of a top-level rematerialised call (:class:`Hoist`)."""
        body = call_body(eqn)
        if body is None:
            return
        outer = dict(zip(body.invars, eqn.invars, strict=True))
        producer = facts(body).defined
        outputs = {v for v in body.outvars if not isinstance(v, Literal)}
        triggers = []
        for m, e in enumerate(body.eqns):
            if e.primitive.name not in MATMULS:
                continue
            ancestors, stack, inputs = set(), [m], set()
            while stack:
                k = stack.pop()
                if k in ancestors:
                    continue
                ancestors.add(k)
                for u in body.eqns[k].invars:
                    if isinstance(u, Literal):
                        continue
                    if u in producer:
                        stack.append(producer[u])
                    elif u in outer and not isinstance(outer[u], Literal):
                        inputs.add(outer[u])
            earliest = max((self.defined.get(u, -1) for u in inputs), default=-1)
            read_after = {
                u
                for k, x in enumerate(body.eqns)
                if k not in ancestors
                for u in x.invars
                if not isinstance(u, Literal)
            } | outputs
            counts: dict[int, int] = {}
            for k in sorted(ancestors):
                x = body.eqns[k]
                if is_alias(x):
                    continue
                for v in x.outvars:
                    if v not in read_after or type(v).__name__ == "DropVar":
                        continue
                    c = self.cell(v)
                    if c is not None:
                        counts[c] = counts.get(c, 0) + 1
            dot = self.dots.setdefault(self.dot_of(e), len(self.dots))
            triggers.append((dot, earliest, counts))
        if triggers:
            self.hoists.append((at, triggers))

    def _recomputed(
        self,
        jaxpr: Any,
        alias: Mapping[Any, Any],
        last: dict[Any, float],
        skip: set[Any],
        only: set[Any] | None = None,
    ) -> set[Any]:
        """The values of ``jaxpr`` XLA recomputes where they are used instead of keeping
        them (:func:`recompute_sources`): those whose sources are in memory (kept by XLA, or
        held by an outer buffer), where keeping the sources alive until the value's last use
        (``last`` is extended) costs no more than the value itself."""
        out: set[Any] = set()
        if not self.recompute and only is None:
            return out
        found = facts(jaxpr)
        whole = found.whole_reads
        held: dict[Any, frozenset[Any]] = {}  # a recomputed value: the kept values it needs
        for v, operands in found.direct_sources.items():
            if only is not None and v not in only:
                continue
            sources = frozenset().union(*(held.get(u, frozenset({u})) for u in operands))
            if not sources:  # computed from constants: recomputed from nothing
                held[v] = sources
            if v in alias or v not in last or not sources:
                continue
            inner = [x for x in sources if x not in skip]
            if self.materialized is not None and any(x not in self.materialized for x in inner):
                continue  # a source fused away: not in memory to recompute from
            late = [x for x in inner if last.get(x, -1) < last[v]]
            extra, reads = sum(map(_nbytes, late)), whole.get(v, [])
            if extra > _nbytes(v) or (late and reads and extra == _nbytes(v)):
                continue  # keeping its sources would cost more, or as much and its reads more
            # Read whole last (a matmul's operand), the value is recomputed just before that
            # read and exists during it: its sources, if kept only for it, are freed by then.
            until = last[v] - 0.5 if reads and reads[-1] == last[v] else last[v]
            for x in late:
                last[x] = max(last.get(x, -1), until)
            out.add(v)
            held[v] = sources
        return out

    def _fused_sources(self, jaxpr: Any, last: dict[Any, float], skip: set[Any]) -> None:
        """A value fused into its readers (not materialized) computed from one XLA keeps
        whole (``self.whole``: a projection's all-reduced result, sliced to the batch in
        the fusions that read it) keeps that one alive until its last read, the backward
        pass's too (``last`` is extended): GPT-Neo's and Bloom's ``gelu`` inputs under FSDP,
        their slices and biases recomputed where the backward reads them."""
        if self.materialized is None or not self.whole:
            return
        made, direct = self.materialized, facts(jaxpr).direct_sources
        read: dict[Any, frozenset[Any]] = {}  # a fused value: the values in memory it reads
        for v, operands in direct.items():
            if v in made:
                continue
            read[v] = frozenset().union(
                *(
                    read.get(u, frozenset()) if u in direct and u not in made else {u}
                    for u in operands
                )
            )
            for u in read[v] & self.whole if v in last else ():
                if u not in skip and last.get(u, -1) < last[v]:
                    last[u] = last[v]

    def _copied(
        self, jaxpr: Any, last: dict[Any, float], skip: set[Any], done: set[Any]
    ) -> set[Any]:
        """The values of ``jaxpr`` XLA makes where each is read (:func:`copied`), not kept
        between: their sources in memory stay alive until their last read (``last`` is
        extended, as :meth:`_recomputed` does); ``done``: values recomputed already."""
        found = facts(jaxpr)
        out: set[Any] = set()
        for v, sources in _copies(jaxpr, self.materialized).items():
            if v in done or v not in last:
                continue
            reads = found.whole_reads[v]
            until = last[v] - 0.5 if reads[-1] == last[v] else last[v]
            for x in sources - skip:
                last[x] = max(last.get(x, -1), until)
            out.add(v)
        return out

    def _sub(self, eqn: Any) -> tuple[Any, set[Any], bool] | None:
        p, prim = eqn.params, eqn.primitive.name
        if prim == "scan":
            body = p["jaxpr"].jaxpr
            return body, _vars(*body.invars, *body.outvars), True
        if prim == "while":
            body = p["body_jaxpr"].jaxpr
            return body, _vars(*body.invars, *body.outvars), True
        if prim == "cond":
            branch = max(p["branches"], key=lambda b: len(b.jaxpr.eqns)).jaxpr
            return branch, set(branch.invars), False
        for key in CALL_PARAMS:
            sub = p.get(key)
            if sub is not None:
                sub = getattr(sub, "jaxpr", sub)
                if len(sub.invars) == len(eqn.invars):
                    return sub, set(sub.invars), False
        return None


def transposed(eqn: Any) -> tuple[Any, ...]:
    """The operands matmul ``eqn`` reads through a transposed copy: XLA:CPU's row-major
    matmul reads the left operand's contracting dimensions last and the right one's first.
    So a left operand contracted before a free dimension is copied (a weight gradient's
    activation gradient, contracted over the batch), and so is a right one of a matmul
    without batch dimensions contracted after a free one: the input of Equinox's
    ``Linear`` under ``jax.vmap`` (``w @ x``, the features x's last dimension), its
    LayerNorm made in that copy (read in its compiled HLO). Attention's batched matmuls
    read their right operand as laid out (Hugging Face's ViT: its FSDP temporaries
    1.12 -> 1.28 of XLA's when counted as copies).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.memory import transposed
        >>> g, x = jnp.ones((8, 4)), jnp.ones((8, 3))       # [batch, out], [batch, in]
        >>> grad = jax.make_jaxpr(lambda g, x: jnp.einsum("bo,bi->oi", g, x))(g, x)
        >>> back = jax.make_jaxpr(lambda g, w: g @ w)(g, jnp.ones((4, 3)))
        >>> w_at_x = jax.make_jaxpr(lambda w, x: jnp.einsum("oi,bi->ob", w, x))(
        ...     jnp.ones((4, 3)), x
        ... )
        >>> [len(transposed(j.jaxpr.eqns[0])) for j in (grad, back, w_at_x)]
        [1, 0, 1]
    """
    if eqn.primitive.name != "dot_general" or len(eqn.invars) != 2:
        return ()
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    lfree, rfree = _free(lhs, lc, lb), _free(rhs, rc, rb)
    out = []
    if lfree and lc and min(lc) < max(lfree):
        out.append(lhs)
    if rfree and rc and not rb and max(rc) > min(rfree):
        out.append(rhs)
    return tuple(v for v in out if not isinstance(v, Literal))


def _free(v: Any, contract: Sequence[int], batch: Sequence[int]) -> list[int]:
    """The free dimensions of matmul operand ``v``."""
    ndim = len(getattr(v.aval, "shape", ()))
    return [d for d in range(ndim) if d not in contract and d not in batch]


def copied(jaxpr: Any, materialized: set[Any] | None) -> bool:
    """Whether any value of ``jaxpr`` (or of a body it calls or loops over) is one XLA:CPU
    makes again where each reader reads it (:func:`_copies`); ``materialized``: the values
    written to memory, as :func:`build` takes them."""
    if materialized is not None:
        materialized = materialized | facts(jaxpr).kept_expensive
    stack, seen = [jaxpr], set()
    while stack:
        j = stack.pop()
        if id(j) in seen:
            continue
        seen.add(id(j))
        if _copies(j, materialized):
            return True
        stack.extend(sub for e in j.eqns for sub in _bodies(e))
    return False


EXPANDED = "select_and_scatter_add"
"""A max-pool's gradient, which XLA:CPU expands (its ``SelectAndScatterExpander``), and
computes with the forward pool: a variadic reduce-window over the operand and an ``s32``
index array per dimension of it (``iota``s, each the operand's size) gives each window's
maximum and its indices; the backward pass concatenates the indices and scatters the
incoming gradient into zeros at them. Read in the compiled HLO of Flax's MNIST example
CNN with ``nn.max_pool`` (``tests/search/test_primitives.py``)."""

POOLS = frozenset({"reduce_window_max", "reduce_window_min"})
"""The forward pools whose gradient is :data:`EXPANDED`."""


def expands(jaxpr: Any) -> bool:
    """Whether ``jaxpr`` (or a body it calls or loops over) runs an op XLA:CPU expands into
    arrays of its own (:data:`EXPANDED`).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn
        >>> from meshplan._search.predict.memory import expands
        >>> pool = lambda x: nn.max_pool(x, (2, 2), strides=(2, 2)).sum()
        >>> expands(jax.make_jaxpr(jax.grad(pool))(jnp.ones((1, 4, 4, 1))).jaxpr)
        True
    """
    stack = [jaxpr]
    while stack:
        j = stack.pop()
        if any(e.primitive.name == EXPANDED for e in j.eqns):
            return True
        stack.extend(sub for e in j.eqns for sub in _bodies(e))
    return False


def _summed_matmuls(jaxpr: Any) -> dict[int, list[Any]]:
    """The matmuls of ``jaxpr`` whose outputs are summed into one value (``add_any`` chains:
    a layer input's gradient from the projections that read it), two or more, by the index
    of the last of them.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.memory import _summed_matmuls
        >>> def loss(x, q, k):
        ...     return (x @ q).sum() + (x @ k).sum()
        >>> g = jax.make_jaxpr(jax.grad(loss))(jnp.ones((2, 4)), jnp.ones((4, 3)), jnp.ones((4, 3)))
        >>> [len(dots) for dots in _summed_matmuls(g.jaxpr).values()]  # x's gradient
        [2]
    """
    producer = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}
    chained = {
        u for e in jaxpr.eqns if e.primitive.name == "add_any" for u in e.invars if u in producer
    }
    out: dict[int, list[Any]] = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "add_any" or eqn.outvars[0] in chained:
            continue
        leaves, stack = [], list(eqn.invars)
        while stack:
            u = stack.pop()
            e = jaxpr.eqns[producer[u]] if u in producer else None
            if e is not None and e.primitive.name == "add_any":
                stack.extend(e.invars)
            elif e is not None and e.primitive.name in MATMULS:
                leaves.append(producer[u])
        if len(leaves) > 1:
            out[max(leaves)] = [jaxpr.eqns[k] for k in sorted(leaves)]
    return out


def _bodies(eqn: Any) -> list[Any]:
    """The jaxprs ``eqn`` runs: a loop's body, a cond's branches, a call's body."""
    p = eqn.params
    subs = [p.get("jaxpr"), p.get("body_jaxpr"), *(p.get("branches") or ()), call_body(eqn)]
    return [getattr(s, "jaxpr", s) for s in subs if s is not None]


def _copies(jaxpr: Any, materialized: set[Any] | None) -> dict[Any, frozenset[Any]]:
    """``{value: its sources in memory}`` for the values of ``jaxpr`` that cheap ops compute
    and a matmul reads transposed (:func:`transposed`): XLA:CPU fuses their computation into
    that transposed copy, and again into a kernel of their own for their other readers (read
    in moe-dp's buffer assignment: exact GELU's input gradient made twice, in the copy the
    first expert weight's gradient reads and again for the input gradient, its sources
    alive until the second; in the Llama decoder's the SiLU MLP's gate and up gradients),
    so none is kept between its reads; its sources are (:func:`_in_memory`)."""
    found = facts(jaxpr)
    out: dict[Any, frozenset[Any]] = {}
    for v in (found.alias.get(u, u) for eqn in jaxpr.eqns for u in transposed(eqn)):
        made = found.producer.get(v)
        if v in out or v not in found.direct_sources or made is None or _never_copied(made):
            continue  # an input, another op's result, or expensive (never made twice)
        if materialized is None or v in materialized:
            out[v] = _in_memory(jaxpr, v, found, materialized)
    return out


def _never_copied(eqn: Any) -> bool:
    """An op XLA's fusion never makes twice: an expensive one, or a reduction."""
    return is_expensive(eqn) or eqn.primitive.name in REDUCTIONS


def _in_memory(jaxpr: Any, v: Any, found: Facts, materialized: set[Any] | None) -> frozenset[Any]:
    """The values in memory XLA computes ``v`` from where it fuses ``v``'s computation: its
    operands, through those fused away, up to values written to memory, those
    :func:`_never_copied` makes, or inputs. Before ``v``'s own fusion (the equations since
    the last that ends one), only through an op of one operand as large as its result (a
    scale, a bias, a transpose XLA reads as a layout): a value of several made earlier (a
    residual stream's sum) is one XLA writes to memory, not one it computes again from
    every layer's."""
    start = _fusion_start(jaxpr, found.defined[v])
    out: set[Any] = set()
    stack, seen = list(found.direct_sources[v]), set()
    while stack:
        x = stack.pop()
        u = found.alias.get(x, x)
        if u in seen:
            continue
        seen.add(u)
        made = found.producer.get(u)
        if materialized is None or u in materialized or made is None or _never_copied(made):
            out.add(u)
            continue
        operands = [x for x in made.invars if not isinstance(x, Literal)]
        if found.defined[u] < start and sum(_whole(x, u, found) for x in operands) > 1:
            out.add(u)  # not in memory by the model: nothing counted for it
            continue
        stack.extend(operands)
    return frozenset(out)


def _whole(x: Any, u: Any, found: Facts) -> bool:
    """Whether operand ``x`` of ``u`` is as large as ``u`` (not a broadcast of less)."""
    made = found.producer.get(x)
    if made is not None and made.primitive.name == "broadcast_in_dim":
        x = made.invars[0]
    return math.prod(getattr(x.aval, "shape", ())) >= math.prod(getattr(u.aval, "shape", ()))


def _fusion_start(jaxpr: Any, at: int) -> int:
    """The first equation of the fusion equation ``at`` is in: after the last before it that
    ends one (neither fused with its operands nor a constraint)."""
    for i in range(at - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if eqn.primitive.name not in FUSES_OPERANDS and not is_alias(eqn):
            return i + 1
    return 0


def kept_expensive(jaxpr: Any) -> set[Any]:
    """The values of ``jaxpr`` (and of the bodies it calls or loops over) that an expensive
    elementwise op computes and that are read after an op ending a fusion that follows
    their definition (:data:`meshplan._search.predict.primitives.EXPENSIVE`): XLA writes
    them to memory instead of recomputing them in the later fusion. Read from the one walk
    of ``jaxpr`` (:attr:`.jaxpr_facts.Facts.kept_expensive`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.memory import kept_expensive
        >>> def f(w, x):
        ...     t = jnp.tanh(x)
        ...     return (t @ w) * t
        >>> j = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((4, 4)))
        >>> kept_expensive(j.jaxpr) == {j.jaxpr.eqns[0].outvars[0]}
        True
    """
    return set(facts(jaxpr).kept_expensive)


def _vars(*vs: Any) -> set[Any]:
    """The variables of ``vs`` (a body may return a literal: a constant output)."""
    return {v for v in vs if not isinstance(v, Literal)}


class _Between:
    """Which of the points, each a set of times, has a time strictly between two times: a
    search in all the times sorted, not a scan of every point's (a 48-layer step has
    thousands of points and of hoists).

    Example:
        >>> from meshplan._search.predict.memory import _Between
        >>> _Between([{1, 5}, {3}, {7}])(2, 7).tolist()
        [True, True, False]
    """

    def __init__(self, times: Sequence[Set[int]]) -> None:
        pairs = sorted((t, k) for k, ts in enumerate(times) for t in ts)
        self.times = np.array([t for t, _ in pairs], dtype=np.int64)
        self.points = np.array([k for _, k in pairs], dtype=np.int64)
        self.n = len(times)

    def __call__(self, after: int, before: int) -> np.ndarray:
        lo = np.searchsorted(self.times, after, side="right")
        hi = np.searchsorted(self.times, before, side="left")
        out = np.zeros(self.n, dtype=bool)
        out[self.points[lo:hi]] = True
        return out


def build(
    jaxpr: Any,
    names: Mapping[Any, Any],
    scores: set[Any],
    dot_of: Callable[[Any], Any],
    materialized: set[Any] | None = None,
    recompute: bool = True,
    late: bool = False,
    moved: Sequence[bool] | None = None,
    whole: frozenset[Any] = frozenset(),
) -> MemoryProgram:
    """The liveness program of a step's (closed) ``jaxpr`` (module docstring).

    ``names``: each variable's logical names; ``scores``: the variables holding attention
    scores; ``dot_of(eqn)``: the :class:`meshplan._search.predict.trace.Dot` of a ``dot_general``;
    ``materialized``: the values XLA writes to memory (others are fused away; ``None``: all);
    ``recompute``: cheap residuals are recomputed where used (:func:`recompute_sources`), as
    XLA does on a device with a memory limit to fit (GPU, TPU), not on the CPU; ``late``: the
    top-level equations run in the order of XLA:CPU's depth-first scheduler from the one
    all-reduce that combines every gradient (:func:`_dfs_order`), which defers the
    gradients off the path to the first it reaches; a fused value read by the gradients'
    reductions :func:`late_moves` defers that is not recomputed there is kept
    from where it is made (:func:`_kept_late`), the values a matmul reads transposed are
    made where each is read (:func:`copied`), as XLA:CPU fuses them, and a max-pool's index
    arrays are counted where XLA:CPU makes them (:data:`EXPANDED`); ``moved``:
    :func:`late_moves` of the same arguments, where the caller has it; ``whole``: the
    values XLA keeps whole where it fuses their slices into their readers (a projection's
    all-reduced result out of an FSDP table's split), alive until the last read of any
    value fused from them.
    """
    if materialized is not None:
        materialized = materialized | facts(jaxpr).kept_expensive
    b = _Builder(names, scores, dot_of, materialized, recompute, whole)
    b.copies = late  # XLA:CPU's program: its late gradients and its transposed copies
    if late:
        if moved is None:
            moved = _late_moves(jaxpr, names, materialized)
        b.late_reads = _late_reads(jaxpr, moved)
        b.late_inputs = _late_inputs(jaxpr, moved)
        order = _dfs_order(jaxpr, names, materialized)
        jaxpr = jaxpr.replace(eqns=[jaxpr.eqns[k] for k in order])
    b.walk(jaxpr, {}, {}, True, set(jaxpr.invars) | set(jaxpr.outvars))
    outputs: dict[int, int] = {}
    for v in dict.fromkeys(v for v in jaxpr.outvars if not isinstance(v, Literal)):
        if v in set(jaxpr.invars):
            continue
        c = b.cell(v, outer=True)
        if c is not None:
            outputs[c] = outputs.get(c, 0) + 1
    ncell = max(1, len(b.cells))
    pts = list(b.points.values()) or [({}, {}, -1, -1, (), {-1})]
    long = np.zeros((len(pts), ncell))
    short = np.zeros((len(pts), ncell))
    ran = np.zeros((len(pts), max(1, len(b.dots))))
    for k, (lo, sh, _, _, before, _) in enumerate(pts):
        for c, m in lo.items():
            long[k, c] = m
        for c, m in sh.items():
            short[k, c] = m
        for d, m in before:
            ran[k, d] = m
    out = np.zeros(ncell)
    for c, m in outputs.items():
        out[c] = m
    cells = sorted(b.cells, key=lambda c: b.cells[c])
    if not cells:
        cells = [((), (), 0, False)]
    dots = sorted(b.dots, key=lambda d: b.dots[d])
    hoists = []
    between = _Between([p[5] for p in pts])
    for at, triggers in b.hoists:
        rows = []
        for dot, earliest, counts in triggers:
            row = np.zeros(ncell)
            for c, m in counts.items():
                row[c] = m
            rows.append((dot, between(earliest, at), row))
        hoists.append(Hoist(at, rows))
    index = {key: k for k, key in enumerate(b.points)}
    sums = [(index[key], made, c) for key, made, c in b.sums]
    return MemoryProgram(
        cells,
        long,
        short,
        np.array([p[2] for p in pts]),
        dots,
        out,
        np.array([p[3] for p in pts]),
        b.scopes,
        ran,
        hoists,
        sums,
        [frozenset(p[5]) for p in pts],
    )


def kept_gathers(program: MemoryProgram, gathered: Sequence[Mapping[Any, int]]) -> np.ndarray:
    """Per point of ``program``, the bytes of gathered weights alive between their readers
    (XLA on CPU: the backward pass's gather of a weight is the forward's, kept): per weight
    (``gathered``'s keys, as :func:`peak` takes them) read at places ``t1 < ... < tn`` of the
    step's top-level order, a point at ``t`` holds ``min(reads before t, reads after t)``
    of them, the layers' reads nested (a layer's forward and its input gradient's matmul
    read its weight; the last layer's are the innermost pair). Read in the compiled FSDP
    step of an MLP-Mixer: each block's gathered up-projection f32[128,256] alive from its
    forward matmul to its backward one. Not inside loops (a scanned layer gathers its
    slice in each trip).

    Example:
        >>> import numpy as np
        >>> from meshplan._search.predict.memory import MemoryProgram, kept_gathers
        >>> empty = np.zeros((5, 1))
        >>> at = [{1, 8}, {2}, {4, 6}, {5}, {9}]     # where each point occurs
        >>> program = MemoryProgram([((), (), 4, False)], empty, empty,
        ...     np.array([0, -1, 0, -1, -1]), ["w @ x: two layers' forward and backward"],
        ...     np.zeros(1), np.array([-1] * 5), at=[frozenset(t) for t in at])
        >>> kept_gathers(program, [{("embed", "mlp"): 100}])    # read at 1, 4, 6 and 8
        array([  0., 100., 100., 200.,   0.])
    """
    out = np.zeros(len(program.dot))
    if not program.at or not len(gathered):
        return out
    reads: dict[Any, list[np.ndarray]] = {}
    size: dict[Any, int] = {}
    for runs, g in zip(program.dot_places, gathered, strict=True):
        for key, nbytes in g.items():
            if runs is not None and nbytes and not _activation(key):
                reads.setdefault(key, []).append(runs)
                size[key] = max(size.get(key, 0), nbytes)
    starts, place = program.places
    occurs = np.array([bool(at) for at in program.at])
    for key, read in reads.items():
        ts = np.unique(np.concatenate(read))
        before = np.searchsorted(ts, place, "left")
        after = len(ts) - np.searchsorted(ts, place, "right")
        held = np.maximum.reduceat(np.minimum(before, after), starts[occurs])
        out[occurs] += held * size[key]
    return out


def _activation(key: Any) -> bool:
    """A gathered array's key names a batch dimension: an activation, gathered as it is used."""
    return isinstance(key, tuple) and bool(key) and "batch" in (key[0] or ())


def _released(program: MemoryProgram, size: np.ndarray, held: Sequence[float]) -> np.ndarray:
    """Per point, the bytes of the held matmul outputs that have run, and the running one's,
    beyond the values without a ``'batch'`` dimension the program keeps alive there
    (gradients, as made or transposed: the running matmul's output among them)."""
    assert program.ran is not None
    per_dot = np.asarray(held, float)
    need = program.ran @ per_dot
    running = program.dot >= 0
    need[running] += per_dot[program.dot[running]]
    params = np.array([0.0 if "batch" in (c[0] or ()) else 1.0 for c in program.cells])
    alive = (np.asarray(program.long) + np.asarray(program.short)) @ (size * params)
    return np.asarray(np.maximum(0.0, need - alive))


def peak(
    program: MemoryProgram,
    bytes_of: Callable[[Cell], int],
    gathered: Sequence[Mapping[Any, int]] = (),
    unreduced: Sequence[float] = (),
    combine_bytes: int = 0,
    partial_sums: Sequence[bool] = (),
    results: Sequence[float] = (),
    held: Sequence[float] = (),
    combined: Sequence[bool] = (),
    summed: Sequence[float] = (),
    kept: Sequence[float] = (),
) -> Peak:
    """The largest point of ``program`` with cells sized by ``bytes_of``.

    ``gathered``: per matmul of ``program.dots``, the arrays the partitioner gathers for it
    (``{(names, shape, axes): bytes added}``). Inside a scanned layer every weight the layer
    gathers (an array without ``'batch'``) is alive at once: XLA starts those gathers ahead
    of the matmuls, and a weight gathered for one matmul serves the others that read it.
    Elsewhere, and for gathered activations, only the running matmul's.

    ``unreduced``: per matmul, the bytes its output holds before its reduction beyond
    the reduced shard (a weight gradient's partial sums, reduce-scattered over FSDP's
    axis): alive while it runs, and, where XLA combines the reductions (up to
    ``combine_bytes`` of them, each no larger), until the combined collective runs:
    those of the matmuls run before the point (in its loop iteration, or the step), up
    to ``combine_bytes``.

    ``partial_sums``: per matmul, whether its output is all-reduced (a partial sum) and
    the combiner merges a rematerialised one with the forward's (``[]``: it does not):
    each of ``program.hoists`` whose first such matmul is one keeps that matmul's
    recomputation from when its inputs exist (:class:`Hoist`).

    ``results``: per matmul, the bytes of its all-reduce's result (a weight gradient's,
    data parallel) where the backend gives it a buffer of its own beside the partial sums
    (XLA on CPU, measured; :mod:`.cost` passes none elsewhere), allocated when the
    combined collective runs, after the last matmul whose reduction it combines (up to
    ``combine_bytes``): at the points of its loop iteration (or the step) where the most
    of them have run.

    ``held``: per matmul, the bytes of its output where that output (a weight gradient, whole
    on every device or its FSDP shard) is held until the combined all-reduce runs (0: not
    held): at every point, those made before it (in its loop iteration, or the step) and the
    one it runs are alive, and what of them the program no longer keeps alive there (it
    lets a gradient go into the update as it is made, or fuses away the transpose the
    update reads) is counted alive: a gradient made early in the backward pass is held
    through the rest of it (read in moe-dp's buffer assignment: both expert weights'
    gradients alive in the experts' backward, from their matmuls to the combined
    all-reduce; at the second's matmul, the first's beside the second's output).

    ``combined``: per matmul, whether its output is a partial sum XLA all-reduces where
    the all-reduces of the outputs summed into one value are combined into one (XLA on
    CPU: a layer input's gradient from its q/k/v projections, under tensor parallelism):
    at the last of them (``program.sums``), every one of those partial sums is alive, and
    the combined all-reduce's results beside them, where the program holds two (the last
    output and the sum so far): ``2 n - 2`` more outputs for ``n`` matmuls.

    ``summed``: per matmul, the bytes its output holds beyond its shard where it is an
    activation's partial sums, all-reduced as they are made (a projection out of an FSDP
    table's split): alive while it runs, never held for a combined collective.

    ``kept``: per point, the bytes of gathered weights kept between their readers
    (:func:`kept_gathers`; ``[]``: none, each gathered again where it is read).
    """
    size = program.sizes(bytes_of)
    lo, sh = program.long @ size, program.short @ size
    extra = np.zeros(len(lo))
    if len(gathered):
        per_dot = np.array([float(sum(g.values())) for g in gathered])
        has = program.dot >= 0
        extra[has] = per_dot[program.dot[has]]
        if program.scope is not None and program.scopes:
            layer = np.array(
                [
                    float(
                        sum(
                            {
                                k: v
                                for d in dots
                                for k, v in gathered[d].items()
                                if not _activation(k)
                            }.values()
                        )
                    )
                    for dots in program.scopes
                ]
                + [0.0]
            )
            acts = np.array(
                [float(sum(v for k, v in g.items() if _activation(k))) for g in gathered]
            )
            inside = program.scope >= 0  # the layer's weights, and the running matmul's activation
            extra[inside] = layer[program.scope[inside]]
            both = inside & has
            extra[both] += acts[program.dot[both]]
    if len(unreduced) and any(unreduced):
        own = np.array([float(u) for u in unreduced])
        has = program.dot >= 0
        extra[has] += own[program.dot[has]]
        if combine_bytes and program.ran is not None:
            pending = program.ran @ np.where(own <= combine_bytes, own, 0.0)
            extra += np.minimum(pending, combine_bytes)
    if len(kept):
        extra += np.asarray(kept, dtype=float)
    if len(summed) and any(summed):
        has = program.dot >= 0
        extra[has] += np.array([float(u) for u in summed])[program.dot[has]]
    if len(results) and any(results) and combine_bytes and program.ran is not None:
        copies = program.ran @ np.where(np.array(results) <= combine_bytes, results, 0.0)
        scope = program.scope if program.scope is not None else np.zeros(len(copies), int)
        last = np.zeros(len(copies), bool)
        for s in np.unique(scope):
            inside = scope == s
            last |= inside & (copies == copies[inside].max())
        extra += np.where(last, np.minimum(copies, combine_bytes), 0.0)
        if any(held):
            extra += _released(program, size, held)
    if any(partial_sums):
        for h in program.hoists:
            first = next((t for t in h.triggers if partial_sums[t[0]]), None)
            if first is not None:
                _, between, row = first
                lo = lo + np.where(between, row @ size, 0.0)
    if any(combined):
        for at, made, cell in program.sums:
            if all(combined[d] for d in made):
                extra[at] += (2 * len(made) - 2) * size[cell]
    total = lo + sh + extra
    k = int(np.argmax(total)) if len(total) else 0
    return Peak(int(lo[k]), int(sh[k] + extra[k]), int(program.output @ size))


def _has_batch(names: Mapping[Any, Any], v: Any) -> bool:
    return "batch" in (names.get(v) or ())


def late_moves(jaxpr: Any, names: Mapping[Any, Any], materialized: set[Any] | None) -> list[bool]:
    """Per equation of ``jaxpr``, whether XLA:CPU's memory-optimised scheduler defers it to
    the end of the backward pass: a reduction over the batch that reaches only the gradients
    (a weight gradient's matmul or convolution, a bias's or a norm scale's sum), and what
    reads it. One all-reduce after the backward pass combines every gradient (XLA on CPU),
    so nothing waits for them before it. A reduction whose gradient (the activation it
    reads that was made last) another reduction reads too (a weight's and its bias's, a
    norm's scale's) frees nothing by running, so it waits, and what it reads stays alive
    until the end of the backward pass; one that reads its gradient alone runs in place
    (read in XLA's schedules: the ViT's and the CNN's biased and normalised layers
    deferred, the bias-free Llama MLP's and the experts' weight gradients in place). An
    equation whose outputs are fused into such reductions alone (``materialized``: the
    values written to memory, with the expensive values XLA keeps; ``None``: all) moves
    with them. Top level only. :func:`build` with ``late=True`` walks the program in the
    scheduler's depth-first order (:func:`_dfs_order`); this rule gives the values the
    deferred fusions read.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.memory import late_moves
        >>> def f(w, x):                             # x: [batch, d]
        ...     y = x @ w
        ...     grad = jnp.einsum("bi,bj->ij", x, y)     # sums over the batch, both
        ...     return grad, y.sum(0), jnp.tanh(y)       # reading y
        >>> j = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((8, 4))).jaxpr
        >>> x, (y, grad, bias, t) = j.invars[1], (e.outvars[0] for e in j.eqns)
        >>> names = {x: ("batch", None), y: ("batch", None), t: ("batch", None),
        ...          grad: (None, None), bias: (None,)}
        >>> late_moves(j, names, None)   # the weight's gradient and the bias's sum
        [False, True, True, False]
    """
    if materialized is not None:
        materialized = materialized | facts(jaxpr).kept_expensive
    return _late_moves(jaxpr, names, materialized)


def _late_moves(jaxpr: Any, names: Mapping[Any, Any], materialized: set[Any] | None) -> list[bool]:
    """:func:`late_moves` of ``materialized`` as given."""
    eqns, walked = jaxpr.eqns, facts(jaxpr)
    producer, defined = walked.producer, walked.defined

    found: dict[Any, set[Any]] = {}

    def sources(u: Any) -> set[Any]:  # the values in memory a fused operand is read from
        e = producer.get(u)
        if materialized is None or u in materialized or e is None:
            return {u}
        if e.primitive.name not in FUSES_OPERANDS:
            return {u}
        if u not in found:
            found[u] = set().union(*(sources(x) for x in e.invars if not isinstance(x, Literal)))
        return found[u]

    reads: dict[int, set[Any]] = {}  # a reduction over the batch: the activations it reads
    for i in _gradient_reductions(jaxpr, names):
        ins = [u for u in eqns[i].invars if not isinstance(u, Literal)]
        got = set().union(*(sources(u) for u in ins))
        reads[i] = {u for u in got if _has_batch(names, u)}
    shared: dict[Any, int] = {}
    for got in reads.values():
        for u in got:
            shared[u] = shared.get(u, 0) + 1
    moved = [False] * len(eqns)
    late: set[Any] = set()  # the values the moved equations define
    for i, eqn in enumerate(eqns):
        ins = [u for u in eqn.invars if not isinstance(u, Literal)]
        # its gradient (the activation it reads made last) read by another reduction too
        # (a bias's sum): running it frees nothing of that, so the scheduler defers it
        made = max(reads.get(i, ()), key=lambda u: defined.get(u, -1), default=None)
        waits = made is not None and shared[made] > 1
        if waits or any(u in late for u in ins):
            moved[i] = True
            late.update(eqn.outvars)
    readers = walked.readers
    for i in reversed(range(len(eqns))):  # fused into moved equations alone: moved with them
        eqn = eqns[i]
        if moved[i] or materialized is None or any(o in materialized for o in eqn.outvars):
            continue
        users = [k for o in eqn.outvars for k in readers.get(o, [])]
        if users and all(moved[k] for k in users) and eqn.primitive.name in FUSES_OPERANDS:
            moved[i] = True
    return moved


def _late_reads(jaxpr: Any, moved: Sequence[bool]) -> set[Any]:
    """The values the equations :func:`late_gradients` runs last (``moved``) read, and those
    cheap ops make them from (:func:`recompute_sources`): what XLA may compute again inside
    the late fusions from values kept until then, rather than keep."""
    walked = facts(jaxpr)
    direct, whole = walked.direct_sources, walked.whole_reads
    stack = [
        u
        for e, m in zip(jaxpr.eqns, moved, strict=True)
        if m
        for u in e.invars
        if not isinstance(u, Literal)
    ]
    out: set[Any] = set()
    while stack:
        u = stack.pop()
        if u in out or any(not moved[k] for k in whole.get(u, ())):
            continue  # read whole by an op in its place too: in memory there, then kept
        out.add(u)
        stack.extend(direct.get(u, ()))
    return out


def _late_inputs(jaxpr: Any, moved: Sequence[bool]) -> set[Any]:
    """The values the equations :func:`late_gradients` runs last (``moved``) read that the
    others define."""
    late = {v for e, m in zip(jaxpr.eqns, moved, strict=True) if m for v in e.outvars}
    return {
        u
        for e, m in zip(jaxpr.eqns, moved, strict=True)
        if m
        for u in e.invars
        if not isinstance(u, Literal) and u not in late
    }


def _kept_late(inputs: set[Any], materialized: set[Any] | None, recomputed: set[Any]) -> set[Any]:
    """Of ``inputs`` (:func:`_late_inputs`), the fused values (not in ``materialized``) that
    are not recomputed in the late fusions from values kept until then: kept in memory from
    where they are made, as their sources would cost more kept (XLA's late fusion reads
    what is in memory: a value fused where it is made is read late from a buffer)."""
    if materialized is None:
        return set()
    return {u for u in inputs if u not in materialized and u not in recomputed}


def _gradient_reductions(jaxpr: Any, names: Mapping[Any, Any]) -> list[int]:
    """The indices of ``jaxpr``'s equations that sum the batch away and reach only gradients
    (a weight gradient's matmul, a bias's or a norm scale's sum): every value they make is
    a gradient (:func:`_gradient_values`)."""
    grads = _gradient_values(jaxpr, names)
    return [
        i
        for i, eqn in enumerate(jaxpr.eqns)
        if eqn.outvars and all(o in grads for o in eqn.outvars)
    ]


def _gradient_values(jaxpr: Any, names: Mapping[Any, Any]) -> set[Any]:
    """The gradients ``jaxpr``'s equations make from values that carry the batch: their
    names known, without the batch, and reaching no value that carries it (an activation):
    a reduction's over the batch, or a call's or a loop's gradient outputs."""
    down: set[Any] = set()  # the values that reach an activation
    for eqn in reversed(jaxpr.eqns):
        if any(_has_batch(names, o) or o in down for o in eqn.outvars):
            down.update(u for u in eqn.invars if not isinstance(u, Literal))
    return {
        o
        for eqn in jaxpr.eqns
        if any(_has_batch(names, u) for u in eqn.invars if not isinstance(u, Literal))
        for o in eqn.outvars
        if o in names and not _has_batch(names, o) and o not in down
    }


def _dfs_order(jaxpr: Any, names: Mapping[Any, Any], materialized: set[Any] | None) -> list[int]:
    """The order in which XLA:CPU's memory-optimised scheduler runs ``jaxpr``'s top-level
    equations (``names``: each variable's logical names; ``materialized``: the values
    written to memory, ``None``: all).

    That scheduler is XLA's depth-first one (``DFSMemoryScheduler``, alone in this jaxlib):
    from the root it visits each instruction's operands, those made from the most bytes
    first, and runs an instruction after its operands. Its graph is the fused one
    (:func:`_fused_operands`), whose root is the one all-reduce that combines every
    gradient (the pass ``cpu-all-reduce-combiner``): its operands make the gradients
    (:func:`_gradient_values`: the reductions over the batch, the calls and loops that
    return gradients), and what reads a gradient (the update) reads it. The first layer's
    weight gradient, made from the most, is visited first, and the whole backward pass
    runs on its way; a weight gradient off
    that path waits until the all-reduce's walk reaches it, what it reads alive until
    then. (XLA compares the count of an operand's extra users before its bytes; that count
    saturates on a training step's graph, so the bytes decide: read in decoder-tp's
    schedule, reproduced.) An equation fused into its readers runs just before the first.
    """
    eqns = jaxpr.eqns
    defined = facts(jaxpr).defined
    outs = [defined[v] for v in jaxpr.outvars if not isinstance(v, Literal) and v in defined]
    grads = _gradient_values(jaxpr, names)
    combined = len(eqns)  # the all-reduce of every gradient, virtual
    kept = None if materialized is None else materialized | set(jaxpr.outvars)
    direct = [
        list(
            dict.fromkeys(
                combined if u in grads else defined[u]
                for u in e.invars
                if not isinstance(u, Literal) and u in defined
            )
        )
        for e in eqns
    ]
    direct.append(sorted({defined[u] for u in grads}))
    node = [
        kept is None
        or not e.outvars
        or e.primitive.name not in FUSES_OPERANDS
        or any(o in kept or o in grads for o in e.outvars)
        for e in eqns
    ] + [True]
    preds = _fused_operands(direct, node)
    size = {
        i: sum(_nbytes(v) for v in eqns[i].outvars if type(v).__name__ != "DropVar")
        for i in preds
        if i != combined
    }
    size[combined] = sum(_nbytes(u) for u in grads)
    total = _made_from(preds, size)
    used = {k for ps in preds.values() for k in ps}
    roots = [i for i in preds if i not in used and i not in outs]
    roots += sorted(dict.fromkeys(outs), key=lambda k: (-total[k], k))
    order: list[int] = []
    done: set[int] = set()
    for x in _post_order(roots, preds, lambda k: (-total[k], k)):
        if x == combined:
            continue
        order += _fused_into(x, direct, node, done)
    return order + [i for i in range(len(eqns)) if i not in done]


def _fused_operands(direct: Sequence[Sequence[int]], node: Sequence[bool]) -> dict[int, list[int]]:
    """Per node (``node[i]``: equation ``i``'s values are written to memory), the nodes it
    reads, directly or through the fused equations it reads (``direct``: each equation's
    operands' equations)."""
    through: dict[int, list[int]] = {}  # a fused equation: the nodes it is made from
    for k in range(len(direct)):
        if not node[k]:
            through[k] = list(
                dict.fromkeys(q for p in direct[k] for q in ([p] if node[p] else through[p]))
            )
    return {
        i: list(dict.fromkeys(q for p in direct[i] for q in ([p] if node[p] else through[p])))
        for i in range(len(direct))
        if node[i]
    }


def _made_from(preds: Mapping[int, Sequence[int]], size: Mapping[int, int]) -> dict[int, int]:
    """Per node, its bytes and those of all it is made from (``preds``: its operands), an
    operand counted once per path to it, as XLA's scheduler sums them."""
    total: dict[int, int] = {}
    for x in _post_order(list(preds), preds, lambda k: k):
        total[x] = size[x] + sum(total[k] for k in preds[x])
    return total


def _post_order(
    roots: Sequence[int], preds: Mapping[int, Sequence[int]], key: Callable[[int], Any]
) -> list[int]:
    """The nodes reached from ``roots`` depth first, each after its operands (``preds``),
    which are visited in the order of ``key``."""
    out: list[int] = []
    seen: set[int] = set()
    for root in roots:
        stack: list[tuple[int, Any]] = [(root, None)]
        while stack:
            x, todo = stack.pop()
            if todo is None:
                if x in seen:
                    continue
                seen.add(x)
                todo = iter(sorted(preds[x], key=key))
            nxt = next((k for k in todo if k not in seen), None)
            if nxt is None:
                out.append(x)
            else:
                stack += [(x, todo), (nxt, None)]
    return out


def _fused_into(
    x: int, direct: Sequence[Sequence[int]], node: Sequence[bool], done: set[int]
) -> list[int]:
    """Node ``x`` after the fused equations its fusion reads that have not run (``done``,
    updated), in their order."""
    fused: set[int] = set()
    stack = [k for k in direct[x] if not node[k]]
    while stack:
        k = stack.pop()
        if k not in fused and k not in done:
            fused.add(k)
            stack += [p for p in direct[k] if not node[p]]
    done.update(fused | {x})
    return [*sorted(fused), x]
