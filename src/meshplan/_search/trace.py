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

The result, a :class:`Workload`, is what :mod:`meshplan._search.cost` prices
under any mesh and rules: every ``dot_general`` (operand names and shapes,
FLOPs) and the bytes every other op writes, grouped by their names so a
candidate is priced in a few hundred operations, whatever the model's depth.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend.core import Literal

from meshplan._spmd.leaves import array_leaves

__all__ = ["Dot", "Workload", "trace_workload"]

Names = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class Dot:
    """One ``dot_general`` signature: operand names and shapes, its dimension numbers.

    ``count``: how many times a step runs it (scan trips included); ``itemsize``:
    bytes per element of its output.
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

    @property
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

    ``dots``: ``{Dot: count}``; ``traffic``: ``{(names, shape): bytes written per
    step}`` of every other op; ``state``: ``[(names, shape, itemsize)]`` of the
    state's arrays (``None`` names: unboxed); ``batch_names``: the names given to
    the batch's arrays; ``names``: every logical name seen, in order of first
    appearance (state first).
    """

    dots: dict[Dot, int]
    traffic: dict[tuple[Names, tuple[int, ...]], int]
    state: list[tuple[Names | None, tuple[int, ...], int]]
    names: tuple[str, ...]
    batch: int | None = None
    param_names: tuple[str, ...] = ()

    @property
    def flops(self) -> int:
        """Global matmul FLOPs of one step."""
        return sum(d.flops * n for d, n in self.dots.items())


_READ_AS_LOGICAL = (("meshplan.search: names are logical", None),)


def _itemsize(aval: Any) -> int:
    try:
        return int(np.dtype(aval.dtype).itemsize)
    except TypeError:  # extended dtypes (PRNG keys)
        return 4


def _merge(a: Any, b: Any) -> Any:
    return a if a is not None else b


def _elementwise(out_shape: tuple[int, ...], ins: Sequence[tuple[Names, tuple[int, ...]]]) -> Names:
    names: list[Any] = [None] * len(out_shape)
    for n, shape in ins:
        if len(shape) != len(out_shape):
            continue
        for i, (name, size) in enumerate(zip(n, shape, strict=True)):
            if size == out_shape[i] and names[i] is None:
                names[i] = name
    return tuple(names)


def _reshape(names: Names, old: tuple[int, ...], new: tuple[int, ...]) -> Names:
    """Names of the dimensions a reshape leaves whole (same size, same prefix product)."""
    out: list[Any] = [None] * len(new)
    prefix_old = {math.prod(old[:i]): i for i in range(len(old))}
    for j in range(len(new)):
        i = prefix_old.get(math.prod(new[:j]))
        if i is not None and old[i] == new[j]:
            out[j] = names[i]
    return tuple(out)


_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


class _Walker:
    def __init__(self) -> None:
        self.dots: dict[Dot, int] = {}
        self.traffic: dict[tuple[Names, tuple[int, ...]], int] = {}
        self.seen: dict[str, None] = {}

    def note(self, names: Names) -> None:
        for n in names:
            if isinstance(n, str):
                self.seen.setdefault(n)

    def walk(self, jaxpr: Any, in_names: Sequence[Names], times: int) -> list[Names]:
        env: dict[Any, Names] = {}

        def read(v: Any) -> Names:
            if isinstance(v, Literal):
                return (None,) * np.ndim(v.val)
            return env.get(v, (None,) * len(getattr(v.aval, "shape", ())))

        for v, n in zip(jaxpr.invars, in_names, strict=True):
            env[v] = n
        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            outs = self.eqn(eqn, ins, times)
            for v, n in zip(eqn.outvars, outs, strict=True):
                env[v] = n
                self.note(n)
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, eqn: Any, ins: list[Names], times: int) -> list[Names]:
        prim, p = eqn.primitive.name, eqn.params
        shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.invars]
        out_shapes = [tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars]
        if prim == "dot_general":
            (lc, rc), (lb, rb) = p["dimension_numbers"]
            lhs, rhs = ins
            dot = Dot(lhs, rhs, shapes[0], shapes[1], (tuple(lc), tuple(rc)),
                      (tuple(lb), tuple(rb)), _itemsize(eqn.outvars[0].aval),
                      _itemsize(eqn.invars[0].aval), _itemsize(eqn.invars[1].aval))  # fmt: skip
            self.dots[dot] = self.dots.get(dot, 0) + times
            out = [_merge(lhs[i], rhs[j]) for i, j in zip(lb, rb, strict=True)]
            out += [lhs[i] for i in range(len(lhs)) if i not in lc and i not in lb]
            out += [rhs[i] for i in range(len(rhs)) if i not in rc and i not in rb]
            return [tuple(out)]
        if prim == "scan":
            body, length = p["jaxpr"], int(p["length"])
            nc, ncarry = p["num_consts"], p["num_carry"]
            body_in = [*ins[: nc + ncarry], *(n[1:] for n in ins[nc + ncarry :])]
            body_in[nc : nc + ncarry] = _carry_fixpoint(body.jaxpr, body_in, nc, ncarry)
            body_out = self.walk(body.jaxpr, body_in, times * length)
            lead = next((n[0] for n in ins[nc + ncarry :] if n and n[0] is not None), None)
            return [*body_out[:ncarry], *((lead, *n) for n in body_out[ncarry:])]
        if prim == "while":
            body = p["body_jaxpr"].jaxpr
            nc = p["body_nconsts"]
            carry = ins[p["cond_nconsts"] + nc :]
            consts = ins[p["cond_nconsts"] : p["cond_nconsts"] + nc]
            carry = _carry_fixpoint(body, [*consts, *carry], nc, len(carry))
            return self.walk(body, [*consts, *carry], times)
        if prim == "cond":
            branch = p["branches"][-1].jaxpr
            return self.walk(branch, ins[1:], times)
        for key in _CALL_PARAMS:
            sub = p.get(key)
            if sub is not None:
                sub = getattr(sub, "jaxpr", sub)
                if len(sub.invars) == len(ins):
                    return self.walk(sub, ins, times)
        outs = self.other(prim, p, ins, shapes, out_shapes)
        for n, shape, v in zip(outs, out_shapes, eqn.outvars, strict=True):
            size = math.prod(shape) * _itemsize(v.aval)
            if size:
                cell = (n, shape)
                self.traffic[cell] = self.traffic.get(cell, 0) + size * times
        return outs

    @staticmethod
    def other(
        prim: str,
        p: Any,
        ins: list[Names],
        shapes: list[tuple[int, ...]],
        out_shapes: list[tuple[int, ...]],
    ) -> list[Names]:
        if prim == "transpose" and ins:
            return [tuple(ins[0][i] for i in p["permutation"])]
        if prim == "broadcast_in_dim" and ins:
            out: list[Any] = [None] * len(out_shapes[0])
            for i, d in enumerate(p["broadcast_dimensions"]):
                if shapes[0][i] == out_shapes[0][d]:
                    out[d] = ins[0][i]
            return [tuple(out)]
        if prim == "reshape" and ins:
            return [_reshape(ins[0], shapes[0], out_shapes[0])]
        if prim == "squeeze" and ins:
            dims = set(p["dimensions"])
            return [tuple(n for i, n in enumerate(ins[0]) if i not in dims)]
        if prim.startswith(("reduce_", "argmax", "argmin")) and "axes" in p and ins:
            axes = set(p["axes"])
            return [tuple(n for i, n in enumerate(ins[0]) if i not in axes)] * len(out_shapes)
        pairs = list(zip(ins, shapes, strict=True))
        return [_elementwise(shape, pairs) for shape in out_shapes]


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


def _batch_names(leaf: Any) -> Names:
    ndim = len(getattr(leaf, "shape", ()))
    return ("batch", *(None,) * (ndim - 1)) if ndim else ()


def trace_workload(
    step_fn: Callable[..., Any],
    abstract_state: Any,
    example_batch: Any,
    rules: Any = None,
    batch_names: Callable[[Any], Names] | None = None,
) -> Workload:
    """Traces ``step_fn(abstract_state, example_batch)`` once and reads its work by logical names.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.trace import trace_workload
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
    closed = jax.make_jaxpr(step_fn)(abstract_state, example_batch)
    in_names = [*state_names, *(tuple(name_of(b)) for b in flat_batch)]
    walker = _Walker()
    for n in in_names:
        walker.note(n)
    jaxpr = closed.jaxpr
    if len(jaxpr.invars) != len(in_names):  # leaves JAX did not make inputs: names unknown
        in_names = [(None,) * len(v.aval.shape) for v in jaxpr.invars]
    walker.walk(jaxpr, in_names, 1)
    batch = int(flat_batch[0].shape[0]) if flat_batch and flat_batch[0].shape else None
    params = tuple(dict.fromkeys(n for names, _, _ in state if names for n in names if n))
    return Workload(walker.dots, walker.traffic, state, tuple(walker.seen), batch, params)
