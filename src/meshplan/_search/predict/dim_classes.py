"""Which array dimensions of a step are one dimension: classes of ``(array, dimension)``.

:func:`dim_classes` walks the step's jaxpr with the tracer's walk
(:class:`meshplan._search.predict.trace._Walker`, which goes into scans, loops, conditionals
and calls) and joins, in a union-find, every two dimensions the program makes one:
a ``dot_general``'s contracting and batch dimensions with each other and its free
dimensions with its output's; an elementwise op's operands with its result,
dimension by dimension where the sizes agree (a broadcast ``[1, embed]`` joins only
``embed``); a broadcast's, a transpose's, a squeeze's and a reduction's kept
dimensions; a gather's offset dimensions with the table's (an embedding's features)
and its batch dimensions with the indices'; a scatter's the same way; a scan's
consts, carries and slices with its body's, and the scanned stack's leading
dimension with every other stacked value's (one class per scan: its ``length``).

A reshape that splits or merges dimensions records a *product*: the whole dimension
is its factors, major first (``[b, l, heads*kv] -> [b, l, heads, kv]``), and so is a
``split`` into equal parts (a fused ``qkv`` kernel: ``3 x (heads*kv)``). Products
are closed under congruence: two wholes of the same factors are one class, and two
splits of one class into the same sizes have the same factors, so the forward
pass's reshape and the backward pass's meet.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from meshplan._search.predict.jaxpr_facts import call_body
from meshplan._search.predict.trace import Names, _Walker

__all__ = ["DimClasses", "Node", "dim_classes"]

Node = tuple[Any, int]
"""One dimension: ``(array, index)``; the array is a jaxpr variable or a made-up key
(a scan's length, a split's count)."""

Nodes = tuple[Node, ...]


def _shape(v: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in getattr(getattr(v, "aval", None), "shape", ()))


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[Node, Node] = {}
        self.size: dict[Node, int] = {}

    def add(self, node: Node, size: int) -> Node:
        if node not in self.parent:
            self.parent[node] = node
            self.size[node] = size
        return node

    def find(self, node: Node) -> Node:
        root = node
        while self.parent.setdefault(root, root) != root:
            root = self.parent[root]
        while self.parent[node] != root:
            self.parent[node], node = root, self.parent[node]
        return root

    def union(self, a: Node, b: Node) -> bool:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[rb] = ra
        return True


@dataclasses.dataclass
class DimClasses:
    """The classes of a step's dimensions, and what the program does with them.

    ``find(node)``: a dimension's class (its root node); ``size``: a class's size;
    ``products``: ``[(whole, factors)]``, major factor first; ``scans``: the roots of
    the scanned stacks' leading dimensions; ``rows``: ``[(node, by token ids, the table's
    other dimensions)]`` of every gather that picks rows of an array (an embedding's
    lookup), with whether its indices are computed from the batch's integer arrays alone; ``dots``: ``[(contract, batch, lhs free, rhs free, weight side)]`` of every
    matmul of the forward pass, each a tuple of the left operand's nodes (the free ones: each operand's),
    the weight side 0 or 1 where that operand is computed from the state alone (a
    weight), ``'acts'`` where both are computed from the batch (attention's q·kᵀ), else
    ``None``; ``state``: the nodes of each state
    array's dimensions, in ``jax.tree.leaves`` order; ``batch``: the batch's first
    dimension (``None`` without a batch); ``id_dims``: the dimensions of the values
    computed from the batch's token ids and constants alone (a one-hot of them: its
    ``vocab``), and of the logits an integer-label loss picks by them (``vocab``: an
    untied head's); ``batch_dims``: the batch arrays' own dimensions; ``reduced``: the
    dimensions a reduction of an activation runs over (a norm's: the residual stream).
    """

    uf: _UnionFind
    products: list[tuple[Node, tuple[Node, ...]]]
    scans: set[Node]
    rows: list[tuple[Node, bool, Nodes]]
    dots: list[tuple[Nodes, Nodes, Nodes, Nodes, int | str | None]]
    state: list[tuple[Node, ...]]
    batch: Node | None
    id_dims: list[Node] = dataclasses.field(default_factory=list)
    batch_dims: list[Node] = dataclasses.field(default_factory=list)
    reduced: list[Node] = dataclasses.field(default_factory=list)

    def find(self, node: Node) -> Node:
        """The class of ``node`` (its root)."""
        return self.uf.find(node)

    def size(self, node: Node) -> int:
        """The size of ``node``'s dimension."""
        return self.uf.size[self.uf.find(node)]

    def factors(self, node: Node) -> list[tuple[Node, ...]]:
        """Every factorisation of ``node``'s class: the classes it was split or merged into."""
        root = self.find(node)
        return [tuple(map(self.find, f)) for w, f in self.products if self.find(w) == root]


class _Links(_Walker):
    """The tracer's walk, joining dimensions at each equation before it walks it on.

    A body (a call's, a scan's) may be one jaxpr shared by several calls (JAX caches
    them: ``jnp.take``'s helpers): its variables are told apart by the walk into it
    (``ctx``, a number per entry), or two calls would join their arrays' dimensions.
    """

    def __init__(self, uf: _UnionFind) -> None:
        super().__init__()
        self.uf = uf
        self.products: list[tuple[Node, tuple[Node, ...]]] = []
        self.scans: set[Node] = set()
        self.rows: list[tuple[Node, bool, Nodes]] = []
        self.dot_facts: list[Any] = []
        self.from_batch: set[Any] = set()  # values computed from the batch
        self.from_state: set[Any] = set()  # values computed from the state alone
        # values computed from the batch's integer arrays (token ids) and constants alone
        # (a one-hot), and the dimensions they have
        self.from_ids: set[Any] = set()
        self.const: set[Any] = set()  # computed from no input (the jaxpr's constants, iotas)
        # token ids counted along the sequence (RoBERTa's positions: a cumsum of the ids'
        # mask), which index a position table, not the vocabulary
        self.counted: set[Any] = set()
        self.reduced: list[Node] = []  # what a reduction of an activation runs over
        self.id_dims: list[Node] = []
        self.made = itertools.count()
        self.entries = itertools.count(1)
        self.ctx = 0  # the walk into the body being walked
        self.inner = 0  # the walk into the body of the equation being linked

    # -- nodes -------------------------------------------------------------------------
    def key(self, v: Any, ctx: int | None = None) -> Any:
        return (self.ctx if ctx is None else ctx, v)

    def node(self, v: Any, d: int, ctx: int | None = None) -> Node:
        return self.uf.add((self.key(v, ctx), d), _shape(v)[d])

    def join(
        self, a: Any, da: int, b: Any, db: int, ca: int | None = None, cb: int | None = None
    ) -> None:
        if isinstance(a, Literal) or isinstance(b, Literal):
            return
        sa, sb = _shape(a), _shape(b)
        if sa[da] == sb[db] and sa[da] > 1:
            self.uf.union(self.node(a, da, ca), self.node(b, db, cb))

    def same(
        self, a: Any, b: Any, offset: int = 0, ca: int | None = None, cb: int | None = None
    ) -> None:
        """Join ``a``'s dimensions with ``b``'s from ``offset`` on (a scan's slice)."""
        if isinstance(a, Literal) or isinstance(b, Literal):
            return
        for d in range(len(_shape(a))):
            if d + offset < len(_shape(b)):
                self.join(a, d, b, d + offset, ca, cb)

    def fresh(self, size: int, kind: str = "made") -> Node:
        """A dimension no array has: a merge's whole (``'made'``), a split's count
        (``'count'``: counts of one size are alike, :func:`_close`)."""
        return self.uf.add((kind, next(self.made)), size)

    def product(self, whole: Node, factors: Sequence[Node]) -> None:
        factors = [f for f in factors if self.uf.size[f] > 1]
        if len(factors) > 1:
            self.products.append((whole, tuple(factors)))

    def has(self, group: set[Any], v: Any, ctx: int | None = None) -> bool:
        return not isinstance(v, Literal) and self.key(v, ctx) in group

    # -- the walk ----------------------------------------------------------------------
    def eqn(self, eqn: Any, ins: list[Names], times: int) -> list[Names]:
        outer = self.ctx
        body = eqn.primitive.name in ("scan", "while", "cond") or call_body(eqn)
        self.inner = next(self.entries) if body else outer
        inner = self.inner
        self.flow(eqn)
        self.link(eqn)
        self.ctx = inner
        try:
            outs = super().eqn(eqn, ins, times)
        finally:
            self.ctx = outer
        for out, res in self.outputs(eqn):  # what the body computes, the call gives
            for group in self.groups():
                if self.has(group, res, inner):
                    group.add(self.key(out))
        return outs

    def groups(self) -> tuple[set[Any], ...]:
        """The sets of values :meth:`flow` keeps, which a body's values share with a call's."""
        return (self.from_batch, self.from_state, self.from_ids, self.const, self.counted)

    def flow(self, eqn: Any) -> None:
        """Which values come from the batch, which from the state alone, which from token
        ids alone (and which of those count them: positions), and which from no input."""
        vs = [v for v in eqn.invars if not isinstance(v, Literal)]
        outs = [self.key(v) for v in eqn.outvars]
        if any(self.has(self.from_batch, v) for v in vs):
            self.from_batch.update(outs)
        elif vs and all(self.has(self.from_state, v) for v in vs):
            self.from_state.update(outs)
        if any(self.has(self.counted, v) for v in vs) or (
            eqn.primitive.name.startswith("cum") and any(self.has(self.from_ids, v) for v in vs)
        ):
            self.counted.update(outs)
        if all(self.has(self.const, v) for v in vs) and eqn.primitive.name not in _BODIES:
            self.const.update(outs)
        elif any(self.has(self.from_ids, v) for v in vs) and all(
            self.has(self.from_ids, v) or self.has(self.const, v) for v in vs
        ):
            self.from_ids.update(outs)
            for out in eqn.outvars:
                self.id_dims += [self.node(out, d) for d, s in enumerate(_shape(out)) if s > 1]
        for outer, inner in self.inputs(eqn):
            for group in self.groups():
                if self.has(group, outer):
                    group.add(self.key(inner, self.inner))

    def inputs(self, eqn: Any) -> Iterator[tuple[Any, Any]]:
        """``(outer, inner)`` of every input a body of ``eqn`` receives."""
        prim, p = eqn.primitive.name, eqn.params
        pairs: Iterator[tuple[Any, Any]]
        if prim == "scan":
            pairs = zip(eqn.invars, p["jaxpr"].jaxpr.invars, strict=True)
        elif prim == "while":
            n = p["cond_nconsts"]
            pairs = zip(eqn.invars[n:], p["body_jaxpr"].jaxpr.invars, strict=True)
        elif prim == "cond":
            pairs = (
                (o, i)
                for b in p["branches"][-1:]
                for o, i in zip(eqn.invars[1:], b.jaxpr.invars, strict=True)
            )
        else:
            sub = call_body(eqn)
            pairs = iter(()) if sub is None else zip(eqn.invars, sub.invars, strict=True)
        return ((o, i) for o, i in pairs if not isinstance(o, Literal))

    def outputs(self, eqn: Any) -> Iterator[tuple[Any, Any]]:
        """``(outer, inner)`` of every output a body of ``eqn`` gives back (the walked
        branch's, for a conditional: the one the tracer walks)."""
        prim, p = eqn.primitive.name, eqn.params
        pairs: Iterator[tuple[Any, Any]]
        if prim == "scan":
            pairs = zip(eqn.outvars, p["jaxpr"].jaxpr.outvars, strict=True)
        elif prim == "while":
            pairs = zip(eqn.outvars, p["body_jaxpr"].jaxpr.outvars, strict=True)
        elif prim == "cond":
            pairs = zip(eqn.outvars, p["branches"][-1].jaxpr.outvars, strict=True)
        else:
            sub = call_body(eqn)
            pairs = iter(()) if sub is None else zip(eqn.outvars, sub.outvars, strict=True)
        return ((o, i) for o, i in pairs if not isinstance(i, Literal))

    def link(self, eqn: Any) -> None:
        prim = eqn.primitive.name
        rule = _RULES.get(prim)
        if rule is not None:
            rule(self, eqn)
        elif prim == "scan":
            self.scan(eqn)
        elif prim in ("while", "cond") or call_body(eqn) is not None:
            for outer, inner in self.inputs(eqn):
                self.same(outer, inner, cb=self.inner)
            for outer, inner in self.outputs(eqn):
                self.same(outer, inner, cb=self.inner)
            if prim == "while":  # a carry is one value on every trip
                body = eqn.params["body_jaxpr"].jaxpr
                nc = eqn.params["body_nconsts"]
                for inner, out in zip(body.invars[nc:], body.outvars, strict=True):
                    self.same(inner, out, ca=self.inner, cb=self.inner)
        elif prim.startswith(("reduce_", "argmax", "argmin")) and "axes" in eqn.params:
            self.reduce(eqn)
        elif prim.startswith("scatter"):
            self.scatter(eqn)
        else:
            self.elementwise(eqn)

    # -- the rules -----------------------------------------------------------------------
    def elementwise(self, eqn: Any) -> None:
        """Operands of the output's rank: each dimension with the output's of its size."""
        for out in eqn.outvars:
            rank = len(_shape(out))
            for v in eqn.invars:
                if not isinstance(v, Literal) and len(_shape(v)) == rank:
                    self.same(v, out)

    def dot(self, eqn: Any) -> None:
        lhs, rhs = eqn.invars
        out = eqn.outvars[0]
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        for i, j in zip(lc, rc, strict=True):
            self.join(lhs, i, rhs, j)
        for k, (i, j) in enumerate(zip(lb, rb, strict=True)):
            self.join(lhs, i, rhs, j)
            self.join(lhs, i, out, k)
        k = len(lb)
        free: list[list[int]] = [[], []]
        for operand, (v, c, b) in enumerate(((lhs, lc, lb), (rhs, rc, rb))):
            for i in range(len(_shape(v))):
                if i not in c and i not in b:
                    self.join(v, i, out, k)
                    free[operand].append(i)
                    k += 1
        weight = [
            self.has(self.from_state, v) and not self.has(self.from_batch, v) for v in (lhs, rhs)
        ]
        acts = all(self.has(self.from_batch, v) for v in (lhs, rhs))
        side: int | str | None = (
            0
            if weight[0] and not weight[1]
            else 1
            if weight[1] and not weight[0]
            else "acts"
            if acts
            else None
        )
        if not self.backward:  # autodiff's transposes repeat the forward pass's matmuls
            lhs_nodes = [self.node(lhs, i) for i in range(len(_shape(lhs)))]
            rhs_nodes = [self.node(rhs, i) for i in range(len(_shape(rhs)))]
            self.dot_facts.append(
                (
                    tuple(lhs_nodes[i] for i in lc),
                    tuple(lhs_nodes[i] for i in lb),
                    tuple(lhs_nodes[i] for i in free[0]),
                    tuple(rhs_nodes[i] for i in free[1]),
                    side,
                )
            )

    def transpose(self, eqn: Any) -> None:
        x, out = eqn.invars[0], eqn.outvars[0]
        for j, i in enumerate(eqn.params["permutation"]):
            self.join(x, i, out, j)

    def broadcast(self, eqn: Any) -> None:
        x, out = eqn.invars[0], eqn.outvars[0]
        for i, d in enumerate(eqn.params["broadcast_dimensions"]):
            self.join(x, i, out, d)

    def squeeze(self, eqn: Any) -> None:
        x, out = eqn.invars[0], eqn.outvars[0]
        kept = [i for i in range(len(_shape(x))) if i not in set(eqn.params["dimensions"])]
        for j, i in enumerate(kept):
            self.join(x, i, out, j)

    def reduce(self, eqn: Any) -> None:
        x = eqn.invars[0]
        kept = [i for i in range(len(_shape(x))) if i not in set(eqn.params["axes"])]
        if self.has(self.from_batch, x):
            self.reduced += [self.node(x, i) for i in eqn.params["axes"] if _shape(x)[i] > 1]
        for out in eqn.outvars:
            for j, i in enumerate(kept):
                self.join(x, i, out, j)

    def reshape(self, eqn: Any) -> None:
        x, out = eqn.invars[0], eqn.outvars[0]
        if isinstance(x, Literal):
            return
        for old, new in _reshape_groups(_shape(x), _shape(out)):
            if len(old) == 1 and len(new) == 1:
                self.join(x, old[0], out, new[0])
                continue
            olds = [self.node(x, i) for i in old]
            news = [self.node(out, j) for j in new]
            whole = olds[0] if len(olds) == 1 else news[0] if len(news) == 1 else None
            if whole is None:
                whole = self.fresh(math.prod(_shape(x)[i] for i in old))
            if len(olds) > 1:
                self.product(whole, olds)
            if len(news) > 1:
                self.product(whole, news)

    def split(self, eqn: Any) -> None:
        """``jnp.split``: the other dimensions joined; equal parts are a product (count, part)."""
        x, axis = eqn.invars[0], int(eqn.params["axis"])
        sizes = [int(s) for s in eqn.params["sizes"]]
        for out in eqn.outvars:
            for d in range(len(_shape(x))):
                if d != axis:
                    self.join(x, d, out, d)
        self._parts(x, axis, list(eqn.outvars), sizes)

    def concatenate(self, eqn: Any) -> None:
        out, axis = eqn.outvars[0], int(eqn.params["dimension"])
        parts = [v for v in eqn.invars if not isinstance(v, Literal)]
        for v in parts:
            for d in range(len(_shape(out))):
                if d != axis:
                    self.join(v, d, out, d)
        if len(parts) == len(eqn.invars):
            self._parts(out, axis, parts, [_shape(v)[axis] for v in parts])

    def _parts(self, whole: Any, axis: int, parts: list[Any], sizes: list[int]) -> None:
        if len(sizes) < 2 or len(set(sizes)) != 1 or sizes[0] < 2:
            return
        for v in parts[1:]:
            self.join(parts[0], axis, v, axis)
        count = self.fresh(len(sizes), "count")
        self.product(self.node(whole, axis), [count, self.node(parts[0], axis)])

    def gather(self, eqn: Any) -> None:
        table, indices = eqn.invars[:2]
        out = eqn.outvars[0]
        dn = eqn.params["dimension_numbers"]
        sizes = eqn.params["slice_sizes"]
        skipped = set(dn.collapsed_slice_dims) | set(getattr(dn, "operand_batching_dims", ()))
        kept = [i for i in range(len(_shape(table))) if i not in skipped]
        for i, j in zip(kept, dn.offset_dims, strict=True):
            if sizes[i] == _shape(table)[i]:
                self.join(table, i, out, j)
        batch_out = [j for j in range(len(_shape(out))) if j not in dn.offset_dims]
        for k, j in enumerate(batch_out):
            if k < len(_shape(indices)) - 1:
                self.join(indices, k, out, j)
        batching = zip(
            getattr(dn, "operand_batching_dims", ()),
            getattr(dn, "start_indices_batching_dims", ()),
            strict=True,
        )
        for i, k in batching:  # take_along_axis: the table's batch dimensions, the indices'
            self.join(table, i, indices, k)
        if self.has(self.from_batch, table) and self.has(self.from_ids, indices):
            # the logits an integer-label loss picks by the token ids: their vocab
            self.id_dims += [self.node(table, i) for i in dn.collapsed_slice_dims]
        elif not isinstance(table, Literal) and not self.has(self.from_batch, table):
            by_ids = self.has(self.from_ids, indices) and not self.has(self.counted, indices)
            dims = range(len(_shape(table)))
            # a row indexed is collapsed, or kept of size 1 (Equinox's ``weight[x]`` under
            # ``jax.vmap``: slices (1, features) at (id, 0))
            one = [i for i in dn.start_index_map if sizes[i] == 1 and i not in skipped]
            for i in [*dn.collapsed_slice_dims, *one]:
                if _shape(table)[i] > 1:
                    rest = tuple(
                        self.node(table, d) for d in dims if d != i and _shape(table)[d] > 1
                    )
                    self.rows.append((self.node(table, i), by_ids, rest))

    def scatter(self, eqn: Any) -> None:
        operand, indices, updates = eqn.invars[:3]
        out = eqn.outvars[0]
        self.same(operand, out)
        dn = eqn.params["dimension_numbers"]
        skipped = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
        kept = [i for i in range(len(_shape(operand))) if i not in skipped]
        for i, j in zip(kept, dn.update_window_dims, strict=False):
            self.join(operand, i, updates, j)
        scatter = [j for j in range(len(_shape(updates))) if j not in dn.update_window_dims]
        for k, j in enumerate(scatter):
            if k < len(_shape(indices)) - 1:
                self.join(indices, k, updates, j)

    def conv(self, eqn: Any) -> None:
        lhs, rhs = eqn.invars
        out = eqn.outvars[0]
        dn = eqn.params["dimension_numbers"]
        ls, rs, os_ = dn.lhs_spec, dn.rhs_spec, dn.out_spec
        if eqn.params.get("feature_group_count", 1) == 1:
            self.join(lhs, ls[1], rhs, rs[1])
        self.join(rhs, rs[0], out, os_[1])
        if eqn.params.get("batch_group_count", 1) == 1:
            self.join(lhs, ls[0], out, os_[0])

    def scan(self, eqn: Any) -> None:
        p = eqn.params
        body = p["jaxpr"].jaxpr
        nc, ncarry = p["num_consts"], p["num_carry"]
        length = self.uf.add(("scan", id(eqn)), int(p["length"]))
        self.scans.add(length)
        ctx = self.inner
        for k, (outer, inner) in enumerate(zip(eqn.invars, body.invars, strict=True)):
            self.same(inner, outer, 1 if k >= nc + ncarry else 0, ca=ctx)
            if k >= nc + ncarry and not isinstance(outer, Literal) and _shape(outer)[0] > 1:
                self.uf.union(length, self.node(outer, 0))
        for k, (outer, inner) in enumerate(zip(eqn.outvars, body.outvars, strict=True)):
            self.same(inner, outer, 1 if k >= ncarry else 0, ca=ctx)
            if k < ncarry:
                self.same(eqn.invars[nc + k], outer)
                self.same(body.invars[nc + k], inner, ca=ctx, cb=ctx)
            elif _shape(outer)[0] > 1:
                self.uf.union(length, self.node(outer, 0))

    def slice(self, eqn: Any) -> None:
        """Dimensions a slice keeps whole are joined; an aligned part of one dimension (the
        first half of a rotary embedding's ``kv``) is a product (count, part)."""
        x, out = eqn.invars[0], eqn.outvars[0]
        if isinstance(x, Literal):
            return
        old, new = _shape(x), _shape(out)
        cut = [d for d in range(len(old)) if old[d] != new[d]]
        for d in range(len(old)):
            if d not in cut:
                self.join(x, d, out, d)
        strides = eqn.params.get("strides")
        if len(cut) == 1 and (strides is None or all(s == 1 for s in strides)):
            d = cut[0]
            start = int(eqn.params["start_indices"][d])
            if new[d] > 1 and old[d] % new[d] == 0 and start % new[d] == 0:
                count = self.fresh(old[d] // new[d], "count")
                self.product(self.node(x, d), [count, self.node(out, d)])


def _integer(v: Any) -> bool:
    try:
        return bool(np.issubdtype(np.dtype(v.aval.dtype), np.integer))
    except TypeError:  # a key
        return False


_BODIES = ("scan", "while", "cond")

_RULES: dict[str, Callable[[_Links, Any], None]] = {
    "slice": _Links.slice,
    "dot_general": _Links.dot,
    "transpose": _Links.transpose,
    "broadcast_in_dim": _Links.broadcast,
    "squeeze": _Links.squeeze,
    "reshape": _Links.reshape,
    "split": _Links.split,
    "concatenate": _Links.concatenate,
    "gather": _Links.gather,
    "conv_general_dilated": _Links.conv,
    "iota": lambda links, eqn: None,
}


def _reshape_groups(
    old: tuple[int, ...], new: tuple[int, ...]
) -> list[tuple[list[int], list[int]]]:
    """The dimensions of ``old`` and ``new`` (size 1 left out) in the smallest groups of
    equal products: ``(8, 16, 64) -> (8, 16, 4, 16)`` is ``[([0], [0]), ([1], [1]),
    ([2], [2, 3])]``."""
    a = [i for i, s in enumerate(old) if s != 1]
    b = [j for j, s in enumerate(new) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        ga, gb = [a[i]], [b[j]]
        pa, pb = old[a[i]], new[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb and i < len(a):
                ga.append(a[i])
                pa *= old[a[i]]
                i += 1
            elif pb < pa and j < len(b):
                gb.append(b[j])
                pb *= new[b[j]]
                j += 1
            else:
                return groups
        groups.append((ga, gb))
    return groups


def _is_count(node: Node) -> bool:
    return bool(node[0] == "count")


def _close(uf: _UnionFind, products: list[tuple[Node, tuple[Node, ...]]]) -> None:
    """Congruence: wholes of the same factors are one class; one class split into the
    same sizes has the same factors. A count (``k`` parts) is any count of that size,
    and never joins a dimension."""

    def key(f: Node) -> Node:
        return ("count", uf.size[f]) if _is_count(f) else uf.find(f)

    changed = True
    while changed:
        changed = False
        by_factors: dict[tuple[Node, ...], Node] = {}
        by_whole: dict[tuple[Node, tuple[int, ...]], tuple[Node, ...]] = {}
        for whole, factors in products:
            seen = by_factors.setdefault(tuple(map(key, factors)), whole)
            changed |= uf.union(seen, whole)
            sizes = tuple(uf.size[uf.find(f)] for f in factors)
            other = by_whole.setdefault((uf.find(whole), sizes), factors)
            for f, g in zip(factors, other, strict=True):
                if not (_is_count(f) or _is_count(g)):
                    changed |= uf.union(f, g)


def dim_classes(step_fn: Callable[..., Any], abstract_state: Any, example_batch: Any) -> DimClasses:
    """The classes of the dimensions of ``step_fn(abstract_state, example_batch)``.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.dim_classes import dim_classes
        >>> state = {"w1": jax.ShapeDtypeStruct((64, 256), jnp.float32),
        ...          "w2": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
        >>> step = lambda s, x: jax.grad(lambda s: (x + (x @ s["w1"]) @ s["w2"]).sum())(s)
        >>> c = dim_classes(step, state, jax.ShapeDtypeStruct((8, 64), jnp.float32))
        >>> (w1, h1), (h2, w2) = c.state
        >>> c.find(h1) == c.find(h2), c.find(w1) == c.find(w2), c.find(w1) == c.find(h1)
        (True, True, False)
    """
    closed = jax.make_jaxpr(step_fn)(abstract_state, example_batch)
    jaxpr = closed.jaxpr
    n_state = len(jax.tree.leaves(abstract_state))
    uf = _UnionFind()
    links = _Links(uf)
    for k, v in enumerate(jaxpr.invars):
        (links.from_state if k < n_state else links.from_batch).add(links.key(v))
        if k >= n_state and _integer(v):
            links.from_ids.add(links.key(v))
    links.const.update(links.key(v) for v in jaxpr.constvars)
    in_names = [(None,) * len(_shape(v)) for v in jaxpr.invars]
    links.walk(jaxpr, in_names, 1)
    dots = list(links.dot_facts)
    state = [tuple(links.node(v, d) for d in range(len(_shape(v)))) for v in jaxpr.invars[:n_state]]
    batch_in = jaxpr.invars[n_state:]
    batch = links.node(batch_in[0], 0) if batch_in and _shape(batch_in[0]) else None
    _close(uf, links.products)
    inputs = [links.node(v, d) for v in batch_in for d in range(len(_shape(v))) if _shape(v)[d] > 1]
    return DimClasses(
        uf,
        links.products,
        links.scans,
        links.rows,
        dots,
        state,
        batch,
        links.id_dims,
        inputs,
        links.reduced,
    )
