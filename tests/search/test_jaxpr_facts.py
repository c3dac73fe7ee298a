"""The one walk of a jaxpr (``_search/predict/jaxpr_facts.py``) and the one classification of
primitives (``_search/predict/primitives.py``) that the trace and the memory model share."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import meshplan
from meshplan._search.predict import jaxpr_facts, primitives
from meshplan._search.predict.jaxpr_facts import facts
from meshplan._search.predict.trace import trace_workload


def test_every_primitive_has_one_kind_and_every_set_is_a_union_of_kinds():
    listed = [p for prims in primitives.KINDS.values() for p in prims]
    assert len(listed) == len(set(listed))  # no primitive in two kinds
    assert primitives.RECOMPUTED < primitives.FUSES_OPERANDS
    assert primitives.EXPENSIVE < primitives.ELEMENTWISE
    assert primitives.SAME_LAYOUT <= primitives.RECOMPUTED
    assert not primitives.UNDERSTOOD & primitives.ELEMENTWISE
    assert primitives.kind("tanh") == "costly" and primitives.kind("my_pallas_kernel") is None


def _walks(monkeypatch) -> list:
    """The jaxprs :mod:`jaxpr_facts` walks from now on, in order."""
    walked: list = []
    walk = jaxpr_facts._walk

    def counted(jaxpr):
        walked.append(jaxpr)
        return walk(jaxpr)

    monkeypatch.setattr(jaxpr_facts, "_walk", counted)
    return walked


def test_a_jaxpr_and_each_of_its_bodies_are_walked_once(monkeypatch):
    def step(w, x):
        layer = jax.checkpoint(lambda h, _: (jnp.tanh(h @ w), None))
        return jax.lax.scan(layer, x, None, length=3)[0].sum()

    j = jax.make_jaxpr(jax.grad(step))(jnp.ones((8, 8)), jnp.ones((4, 8)))
    walked = _walks(monkeypatch)
    top = facts(j)
    assert facts(j.jaxpr) is top and walked[0] is j.jaxpr
    bodies = len(walked)
    assert bodies > 2  # the scans' bodies and the remat's, each walked once, with the top
    for eqn in j.jaxpr.eqns:
        for sub in jaxpr_facts._nested(eqn):
            facts(sub)
    assert len(walked) == bodies  # read back, not walked again


def test_the_facts_follow_constraints_and_calls_and_tell_whole_reads_from_fused_ones():
    def f(w, x):
        y = jax.jit(lambda a: jax.lax.reduce_precision(a, 8, 23))(x @ w)  # the same buffer
        return jnp.exp(y) @ w, y.sum()

    j = jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((2, 4))).jaxpr
    got = facts(j)
    product, call = j.eqns[0].outvars[0], j.eqns[1]
    assert got.alias == {call.outvars[0]: product}  # through the call's no-op precision
    assert got.bodies[1] is jaxpr_facts.call_body(call)
    w = j.invars[0]
    assert got.whole_reads[w] == [0, 3]  # both matmuls read the weight whole
    assert product not in got.whole_reads  # the call passes it on, exp and sum fuse it
    assert got.consumers[product] == ["jit", "exp", "reduce_sum"]  # and the call's output
    assert got.kept_expensive == frozenset()  # exp read by the next matmul alone: fused


def test_trace_workload_walks_each_jaxpr_once(monkeypatch):
    w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("embed", "mlp"))

    def loss(s, x):
        body = lambda h, _: (jnp.tanh(h @ s["w"].value), None)  # noqa: E731
        return jax.lax.scan(body, x, None, length=3)[0].sum()

    step = jax.grad(loss)

    walked = _walks(monkeypatch)
    work = trace_workload(step, {"w": w}, jax.ShapeDtypeStruct((4, 8), jnp.float32))
    assert work.memory is not None and work.memory_kept is not None
    ids = [id(j) for j in walked]  # the step's and each body's, never twice
    assert len(ids) == len(set(ids)) and len(ids) >= 3  # the step, the scans' bodies
