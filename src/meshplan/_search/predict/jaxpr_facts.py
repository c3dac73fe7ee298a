"""One walk of a jaxpr: the facts of its equations that the trace and the memory model both read.

:func:`facts` walks a jaxpr's equations once, in order, and records what depends on the
program alone (not on the names a trace gives its values, nor on a candidate): which
values are a sharding constraint's input's own buffer (:attr:`Facts.alias`), each
equation's call body, who makes and who reads each value and where it is last read,
the primitives that consume it, the reads that need it whole in memory, the values cheap
ops recompute and from what, the equations that end a fusion and the expensive values
read across one. A call's, loop's or remat's body gets facts of its own, found once
(:func:`facts` of the body), which the walk reads where it needs them. The facts of a
jaxpr are kept while the jaxpr lives: the trace's naming walks, the memory programs
built from it (:mod:`meshplan._search.predict.memory`) and their checks read them instead
of walking it again.

:mod:`meshplan._search.predict.primitives` classifies the primitives.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import TypeAlias

import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var

from meshplan._search.predict.primitives import CALL_PARAMS, EXPENSIVE, FUSES_OPERANDS

__all__ = [
    "Atom",
    "Facts",
    "aliases",
    "call_body",
    "facts",
    "is_alias",
    "is_expensive",
    "live",
]

Atom: TypeAlias = Var | Literal
"""An equation's operand: a variable or a literal."""


def is_alias(eqn: JaxprEqn) -> bool:
    """A sharding constraint of one variable: the same buffer (a reshard is priced apart);
    or a ``reduce_precision`` to its value's own precision, which changes nothing (XLA's
    simplifier removes it): what ``jax.checkpoint`` with ``prevent_cse`` (unrolled layers)
    passes the residuals it saves through, so a saved matmul's output is still that
    matmul's buffer, kept for the backward pass.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.jaxpr_facts import is_alias
        >>> j = jax.make_jaxpr(lambda x: jax.lax.reduce_precision(x, 8, 23) * 2)(jnp.ones(4))
        >>> [is_alias(e) for e in j.jaxpr.eqns]
        [True, False]
    """
    if len(eqn.invars) != 1 or len(eqn.outvars) != 1 or isinstance(eqn.invars[0], Literal):
        return False
    name = eqn.primitive.name
    if name == "reduce_precision":
        try:
            info = jnp.finfo(eqn.invars[0].aval.dtype)  # type: ignore[attr-defined,no-untyped-call]
        except (TypeError, ValueError):
            return False
        p = eqn.params
        return bool(p.get("exponent_bits") == info.nexp and p.get("mantissa_bits") == info.nmant)
    return bool(name == "sharding_constraint")


def live(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` without the equations whose values nothing reads, as XLA runs it (its
    dead-code elimination): the loss a ``jax.grad`` step computes and drops, the primal
    outputs of a ``jax.vjp`` nobody uses. Every input is kept, read or not.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.jaxpr_facts import live
        >>> step = lambda w, x: jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)
        >>> j = jax.make_jaxpr(step)(jnp.ones((4, 4)), jnp.ones((8, 4)))
        >>> "reduce_sum" in str(j), "reduce_sum" in str(live(j)), len(live(j).jaxpr.invars)
        (True, False, 2)
    """
    from jax._src.interpreters import partial_eval as pe

    used = [True] * len(closed.jaxpr.outvars)
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, used, instantiate=True)
    return ClosedJaxpr(jaxpr, closed.consts)


def call_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The body of a call (``pjit``, ``remat``, custom derivatives) with ``eqn``'s arity.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.jaxpr_facts import call_body
        >>> j = jax.make_jaxpr(lambda x: jax.jit(jnp.sin)(x))(jnp.ones(4))
        >>> [e.primitive.name for e in call_body(j.jaxpr.eqns[0]).eqns]
        ['sin']
    """
    if eqn.primitive.name in ("scan", "while", "cond"):
        return None
    for key in CALL_PARAMS:
        sub = eqn.params.get(key)
        if sub is not None and len(_open(sub).invars) == len(eqn.invars):
            return _open(sub)
    return None


def _open(jaxpr: Jaxpr | ClosedJaxpr) -> Jaxpr:
    """A closed jaxpr's jaxpr; a jaxpr itself."""
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def aliases(jaxpr: Jaxpr | ClosedJaxpr) -> dict[Var, Var]:
    """``{output: input}`` of ``jaxpr``'s sharding constraints, chains resolved, and of the
    calls (``pjit``...) that give back one of their inputs (a constraint inside them):
    :attr:`Facts.alias`.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.jaxpr_facts import aliases
        >>> j = jax.make_jaxpr(lambda x: jax.lax.reduce_precision(x, 8, 23) * 2)(jnp.ones(4))
        >>> aliases(j.jaxpr) == {j.jaxpr.eqns[0].outvars[0]: j.jaxpr.invars[0]}
        True
    """
    return facts(jaxpr).alias


@dataclasses.dataclass(frozen=True, eq=False)
class Facts:
    """What one walk of a jaxpr found (module docstring); read, never changed.

    ``alias``: :func:`aliases`; ``bodies``: per equation, its call body (:func:`call_body`);
    ``producer``/``defined``: each value's equation and its index; ``readers``: each value's
    reading equations (indices, one per operand); ``last_use``: each value's (through its
    aliases) last reading equation other than a constraint, the outputs' ``len(eqns)``;
    ``last_read``: the same counting constraints, outputs not; ``consumers``: each value's
    (through its aliases) reading primitives in order, ``'return'`` for an output;
    ``whole_reads``: each value's equations that read it whole (a matmul's operand, a
    loop's input; not an op fused with it, nor a constraint); ``whole_inputs``: the inputs
    this jaxpr, as a body, reads whole; ``sources``: the values cheap ops (elementwise,
    reductions: :data:`meshplan._search.predict.primitives.FUSES_OPERANDS`, directly or in
    calls) compute, with the values they are recomputed from (the results of other ops,
    the inputs), ``direct_sources`` with their operands instead; ``splits``: whether any
    equation (or one in a call) ends a fusion; ``kept_expensive``: the values (here and in
    bodies) an expensive elementwise op computes that are read after an op ending a fusion
    that follows them (:func:`meshplan._search.predict.memory.kept_expensive`).
    """

    alias: dict[Var, Var]
    bodies: tuple[Jaxpr | None, ...]
    producer: dict[Var, JaxprEqn]
    defined: dict[Var, int]
    readers: dict[Var, list[int]]
    last_use: dict[Var, int]
    last_read: dict[Var, int]
    consumers: dict[Var, list[str]]
    whole_reads: dict[Var, list[int]]
    whole_inputs: frozenset[int]
    sources: dict[Var, frozenset[Var]]
    direct_sources: dict[Var, frozenset[Var]]
    splits: bool
    kept_expensive: frozenset[Var]


_FACTS: weakref.WeakKeyDictionary[Jaxpr, Facts] = weakref.WeakKeyDictionary()


def facts(jaxpr: Jaxpr | ClosedJaxpr) -> Facts:
    """The :class:`Facts` of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``), walked once and
    kept while it lives.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.jaxpr_facts import facts
        >>> j = jax.make_jaxpr(lambda w, x: jax.lax.reduce_precision(x @ w, 8, 23) @ w)(
        ...     jnp.ones((4, 4)), jnp.ones((2, 4)))
        >>> got = facts(j)
        >>> got is facts(j.jaxpr), got.whole_reads[j.jaxpr.invars[0]]   # both matmuls
        (True, [0, 2])
        >>> got.alias == {j.jaxpr.eqns[1].outvars[0]: j.jaxpr.eqns[0].outvars[0]}
        True
    """
    opened = _open(jaxpr)
    got = _FACTS.get(opened)
    if got is None:
        got = _FACTS[opened] = _walk(opened)
    return got


def _alias_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The body whose aliases pass through ``eqn`` (a call's, a scan's), with its arity."""
    if eqn.primitive.name in ("while", "cond"):
        return None
    sub = next((eqn.params[k] for k in CALL_PARAMS if eqn.params.get(k) is not None), None)
    if sub is None or len(_open(sub).invars) != len(eqn.invars):
        return None
    return _open(sub)


def _nested(eqn: JaxprEqn) -> list[Jaxpr]:
    """Every jaxpr ``eqn`` holds: a loop's body, a cond's branches, a call's body."""
    p = eqn.params
    subs = (
        p.get("jaxpr"),
        p.get("body_jaxpr"),
        *(p.get("branches") or ()),
        *(p.get(k) for k in CALL_PARAMS[1:]),
    )
    out = [getattr(sub, "jaxpr", sub) for sub in subs]
    return [sub for sub in out if sub is not None and hasattr(sub, "eqns")]


def is_expensive(eqn: JaxprEqn) -> bool:
    """An expensive elementwise op (:data:`meshplan._search.predict.primitives.EXPENSIVE`);
    a division by a constant is a multiplication by its reciprocal after XLA's simplifier."""
    if eqn.primitive.name not in EXPENSIVE:
        return False
    return not (eqn.primitive.name == "div" and isinstance(eqn.invars[1], Literal))


class _Walk:
    """The state of one walk of a jaxpr (:func:`_walk`)."""

    def __init__(self) -> None:
        self.alias: dict[Var, Var] = {}
        self.producer: dict[Var, JaxprEqn] = {}
        self.defined: dict[Var, int] = {}
        self.readers: dict[Var, list[int]] = {}
        self.last_use: dict[Var, int] = {}
        self.last_read: dict[Var, int] = {}
        self.consumers: dict[Var, list[str]] = {}
        self.whole_reads: dict[Var, list[int]] = {}
        self.read_whole: set[Var] = set()
        self.sources: dict[Var, frozenset[Var]] = {}
        self.direct: dict[Var, frozenset[Var]] = {}
        self.split_at: list[int] = []  # the equations that end a fusion
        self.expensive: list[tuple[int, Var]] = []
        self.kept: set[Var] = set()

    def resolved(self, v: Var) -> Var:
        return self.alias.get(v, v)

    def of(self, v: Atom) -> frozenset[Var]:
        """The values ``v`` is recomputed from (``sources``)."""
        if isinstance(v, Literal):
            return frozenset()
        return self.sources.get(v, frozenset({self.resolved(v)}))

    def direct_of(self, v: Atom) -> frozenset[Var]:
        return frozenset() if isinstance(v, Literal) else frozenset({self.resolved(v)})

    def reads(self, i: int, eqn: JaxprEqn, alias: bool, fused: bool) -> None:
        """The reads of equation ``i``: readers, last uses, consumers, whole reads."""
        prim = eqn.primitive.name
        body = None if fused or alias else call_body(eqn)
        whole = None if body is None else facts(body).whole_inputs
        for k, u in enumerate(eqn.invars):
            if isinstance(u, Literal):
                continue
            self.readers.setdefault(u, []).append(i)
            r = self.resolved(u)
            self.last_read[r] = i
            if alias:
                continue
            self.last_use[r] = i
            self.consumers.setdefault(r, []).append(prim)
            if fused:
                continue
            self.read_whole.add(u)
            if whole is not None and k not in whole:
                continue
            got = self.whole_reads.setdefault(r, [])
            if not got or got[-1] != i:
                got.append(i)

    def recomputed(self, eqn: JaxprEqn, fused: bool, body: Jaxpr | None) -> None:
        """The values ``eqn`` makes that cheap ops compute (``sources``)."""
        if fused:
            made = frozenset().union(*map(self.of, eqn.invars))
            direct = frozenset().union(*map(self.direct_of, eqn.invars))
            self.sources.update((o, made) for o in eqn.outvars)
            self.direct.update((o, direct) for o in eqn.outvars)
            return
        if body is None:
            return
        inner, position = facts(body).sources, {v: i for i, v in enumerate(body.invars)}
        for o, v in zip(eqn.outvars, body.outvars, strict=True):
            got: frozenset[Var] | None = frozenset() if isinstance(v, Literal) else inner.get(v)
            if got is None and v in position:
                got = frozenset({v})  # the call gives back one of its inputs
            if got is not None and all(x in position for x in got):
                outer = [eqn.invars[position[x]] for x in got]
                self.sources[o] = frozenset().union(*map(self.of, outer))
                self.direct[o] = frozenset().union(*map(self.direct_of, outer))

    def aliased(self, eqn: JaxprEqn) -> None:
        """The outputs of a call (a scan) that give back one of its inputs (``alias``)."""
        sub = _alias_body(eqn)
        if sub is None:
            return
        inner = facts(sub).alias
        position = {v: i for i, v in enumerate(sub.invars)}
        nc, ncarry = eqn.params.get("num_consts", 0), eqn.params.get("num_carry", 0)
        for j, (outer, v) in enumerate(zip(eqn.outvars, sub.outvars, strict=True)):
            i = position.get(inner.get(v, v)) if not isinstance(v, Literal) else None
            x = None if i is None else eqn.invars[i]
            if i is None or not isinstance(x, Var):
                continue
            if eqn.primitive.name == "scan" and not (
                i == nc + j if j < ncarry else i >= nc + ncarry
            ):
                continue  # a scan gives back a carry as it came, or a slice of its xs
            self.alias[outer] = self.alias.get(x, x)

    def eqn(self, i: int, eqn: JaxprEqn) -> Jaxpr | None:
        """Record equation ``i``; its call body."""
        alias = is_alias(eqn)
        fused = eqn.primitive.name in FUSES_OPERANDS or alias
        body = None if alias else call_body(eqn)
        self.reads(i, eqn, alias, fused)
        for o in eqn.outvars:
            self.producer[o], self.defined[o] = eqn, i
        x = eqn.invars[0] if alias else None
        if isinstance(x, Var):  # a constraint's (never a literal's: :func:`is_alias`)
            self.alias[eqn.outvars[0]] = self.alias.get(x, x)
        else:
            self.aliased(eqn)
        self.recomputed(eqn, fused, None if fused else body)
        if not fused and (body is None or facts(body).splits):
            self.split_at.append(i)
        if is_expensive(eqn):
            self.expensive.append((i, eqn.outvars[0]))
        for sub in _nested(eqn):
            self.kept |= facts(sub).kept_expensive
        return body


def _walk(jaxpr: Jaxpr) -> Facts:
    """The one walk of ``jaxpr`` (:class:`Facts`)."""
    w = _Walk()
    bodies = tuple(w.eqn(i, eqn) for i, eqn in enumerate(jaxpr.eqns))
    n = len(jaxpr.eqns)
    for v in jaxpr.outvars:
        if not isinstance(v, Literal):
            r = w.resolved(v)
            w.last_use[r] = n
            w.consumers.setdefault(r, []).append("return")
    ends = [0] * (n + 1)  # ends[k]: the equations before k that end a fusion
    for i in w.split_at:
        ends[i + 1] += 1
    for k in range(n):
        ends[k + 1] += ends[k]
    for i, v in w.expensive:  # read after an op that ends a fusion: written to memory
        end = w.last_read.get(v, -1)
        if end > i + 1 and ends[end] - ends[i + 1] > 0:
            w.kept.add(v)
    return Facts(
        alias=w.alias,
        bodies=bodies,
        producer=w.producer,
        defined=w.defined,
        readers=w.readers,
        last_use=w.last_use,
        last_read=w.last_read,
        consumers=w.consumers,
        whole_reads=w.whole_reads,
        whole_inputs=frozenset(k for k, v in enumerate(jaxpr.invars) if v in w.read_whole),
        sources=w.sources,
        direct_sources=w.direct,
        splits=bool(w.split_at),
        kept_expensive=frozenset(w.kept),
    )
