"""Oracle: meshplan and ``flax.nnx.get_partition_spec`` on the same NNX state.

Where Flax NNX's dict semantics agree with Linen's (each logical name has one
rule, no mesh axis is in two rules, every name has a rule), both give the same
specs. Where they do not, the difference is asserted here and listed in
``docs/nnx.md``.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._spmd.nnx_check import nnx_problems

NAMES = ("batch", "length", "embed", "hidden", "heads", "kv", "mlp", "vocab", "layers")
AXES = ("data", "model", "fsdp", "expert", "stage")


def _entries(rng: random.Random, n: int) -> list:
    """``n`` rule values that share no mesh axis: single axes, tuples, None, UNCONSTRAINED."""
    axes = list(AXES)
    rng.shuffle(axes)
    out: list = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.15:
            out.append(None)
        elif kind < 0.2:
            out.append(P.UNCONSTRAINED)
        elif kind < 0.35 and len(axes) >= 2:
            out.append((axes.pop(), axes.pop()))
        elif axes:
            out.append(axes.pop())
        else:
            out.append(None)
    return out


def _agreeing_cases(count: int) -> list:
    rng = random.Random(20240917)
    cases = []
    while len(cases) < count:
        named = rng.sample(NAMES, rng.randint(1, 5))
        rules = tuple(zip(named, _entries(rng, len(named)), strict=True))
        rank = rng.randint(1, 4)
        pool = [*rng.sample(named, min(rank, len(named))), None, None]
        names = []
        for n in rng.sample(pool, rank) if rank <= len(pool) else pool[:rank]:
            names.append(n)
        cases.append((tuple(names), rules))
    return cases


HAND = [
    (("embed", "hidden"), (("embed", "data"), ("hidden", "model"))),  # the guide's FSDP + TP
    (("batch", "embed"), (("batch", "data"), ("hidden", "model"), ("embed", None))),
    (("hidden", "embed"), (("batch", "data"), ("hidden", "model"), ("embed", None))),
    (("layers", "embed", "hidden"), (("layers", None), ("embed", "data"), ("hidden", "model"))),
    (("vocab", "embed"), (("vocab", "model"), ("embed", "data"))),
    (("embed", "mlp"), (("embed", ("data", "fsdp")), ("mlp", "model"))),
    (("embed",), (("embed", P.UNCONSTRAINED),)),
    ((None, "hidden"), (("hidden", "model"),)),
    (("heads", None, "kv"), (("heads", "model"), ("kv", None))),
    (("batch", "length", "embed"), (("batch", "data"), ("length", None), ("embed", "model"))),
]
CASES = HAND + _agreeing_cases(40)


def _state(names: tuple, local_rules=None):
    metadata = {"out_sharding": names}
    if local_rules is not None:
        metadata["sharding_rules"] = local_rules
    shape = (*(8 for _ in names), 2)  # one more dim: trailing dims stay unsharded
    w = nnx.Param(jax.ShapeDtypeStruct(shape, jnp.float32), eager_sharding=False, **metadata)
    return nnx.state(nnx.Dict(w=w))


def _flax(state, rules=None):
    if rules is None:
        return nnx.get_partition_spec(state)["w"].get_value()
    with nnx.logical_axis_rules(rules):
        return nnx.get_partition_spec(state)["w"].get_value()


def _ours(state, rules=None):
    if rules is None:
        return meshplan.get_partition_spec(state)["w"].get_value()
    with meshplan.logical_axis_rules(rules):
        return meshplan.get_partition_spec(state)["w"].get_value()


def _placement_problems(state, rules):
    return [p for p in nnx_problems(state, rules) if p.code == "flax-placement"]


def test_there_are_at_least_40_distinct_cases():
    assert len({repr(c) for c in CASES}) >= 40


@pytest.mark.parametrize(("names", "rules"), CASES, ids=lambda c: repr(c))
def test_agrees_with_flax_nnx_under_context_rules(names, rules):
    state = _state(names)
    assert _ours(state, rules) == _flax(state, rules)
    assert _placement_problems(state, rules) == []  # check's hook finds nothing to report


@pytest.mark.parametrize(("names", "rules"), CASES[:20], ids=lambda c: repr(c))
def test_agrees_with_flax_nnx_under_variable_rules(names, rules):
    state = _state(names, local_rules=rules)
    assert _ours(state) == _flax(state)


@pytest.mark.parametrize(("names", "rules"), CASES[:10], ids=lambda c: repr(c))
def test_agrees_with_no_rules_names_as_mesh_axes(names, rules):
    state = _state(names)
    assert _ours(state) == _flax(state) == P(*names)


# Where they differ: (names, rules, what Flax NNX gives, what meshplan gives). docs/nnx.md lists these.
DIFFERENT = [
    (  # the example: the last rule for a name wins in Flax, and 'model' is used twice
        ("embed", "hidden"),
        (("embed", "data"), ("embed", "model"), ("hidden", "data"), ("hidden", "model")),
        P("model", "model"),
        P("data", "model"),
    ),
    (("embed",), (("embed", "data"), ("embed", "model")), P("model"), P("data")),
    (
        ("embed", "hidden"),
        (("embed", "model"), ("hidden", "model")),
        P("model", "model"),
        P("model", None),
    ),
    (("embed", "model"), (("embed", "data"),), P("data", "model"), P("data", None)),
    (
        ("embed", "batch"),
        (("batch", ("data", "model")), ("embed", "model")),
        P("model", ("data", "model")),
        P(None, ("data", "model")),
    ),
]


@pytest.mark.parametrize(("names", "rules", "flax", "ours"), DIFFERENT, ids=lambda c: repr(c))
def test_where_they_differ(names, rules, flax, ours):
    state = _state(names)
    assert _flax(state, rules) == flax
    assert _ours(state, rules) == ours
    [problem] = _placement_problems(state, rules)
    assert problem.code == "flax-placement" and problem.path == "w"
    assert repr(flax).replace("PartitionSpec", "P") in problem.message
    assert repr(ours).replace("PartitionSpec", "P") in problem.message
