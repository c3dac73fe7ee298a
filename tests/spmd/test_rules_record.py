"""The ``Rules`` record (pairs and their positions) and the one resolver.

Rules stay what Flax takes, any sequence of ``(name, axes)`` pairs; a ``Rules`` is one more
such sequence, accepted wherever rules are.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import meshplan
import meshplan.layouts
from meshplan._search.predict.cost import _Specs
from meshplan._spmd.rules import Rules, check_rules, split_axes

PAIRS = (("batch", ("data", "fsdp")), ("embed", "fsdp"), ("mlp", "tensor"))
LISTS = [["batch", ["data", "fsdp"]], ["embed", "fsdp"], ["mlp", "tensor"]]


def test_a_rules_record_normalises_lists_and_keeps_each_pairs_position():
    rules = Rules.of(LISTS)
    assert rules.pairs == PAIRS and rules.positions == (0, 1, 2)
    assert list(rules) == list(PAIRS) and len(rules) == 3 and rules[1] == ("embed", "fsdp")
    valid, problems = check_rules([("embed", "fsdp"), ("bad", 3), ("mlp", "tensor")])
    assert valid.pairs == (("embed", "fsdp"), ("mlp", "tensor")) and valid.positions == (0, 2)
    assert [p.path for p in problems] == ["rules[1]"]
    with pytest.raises(meshplan.RulesError, match=r"rules\[1\]"):
        Rules.of([("embed", "fsdp"), ("bad", 3)])


@pytest.mark.parametrize("given", [PAIRS, LISTS, Rules.of(PAIRS)], ids=["tuples", "lists", "Rules"])
def test_user_facing_functions_take_plain_pairs_and_the_record_alike(given):
    names = ("batch", "embed", "mlp")
    # batch takes fsdp first: embed, in the same array, stays whole (the resolver's order)
    assert meshplan.logical_to_mesh_axes(names, given) == P(("data", "fsdp"), None, "tensor")
    with meshplan.logical_axis_rules(given):
        assert meshplan.get_logical_axis_rules() == PAIRS  # the active rules: plain pairs
    w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32), ("embed", "mlp"))
    plan = meshplan.explain({"w": w}, {"data": 1, "fsdp": 2, "tensor": 4}, given)
    assert plan["w"].spec == P("fsdp", "tensor")


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp", "tensor_parallel", "fsdp_ep"])
def test_the_search_cost_model_splits_arrays_as_the_resolver_does(layout):
    rules = meshplan.layouts.get_layout(layout)
    axes = meshplan.layouts.LAYOUT_AXES[layout]
    sizes = dict(zip(axes, (2, 4), strict=True))
    specs = _Specs(sizes, rules)
    for names in [("batch", "length", "embed"), ("embed", "mlp"), ("expert", "embed", "mlp")]:
        spec = meshplan.logical_to_mesh_axes(names, rules)
        want = tuple(
            tuple(a for a in ((e,) if isinstance(e, str) else e or ()) if sizes[a] > 1)
            for e in spec
        )
        assert specs(names, len(names)) == split_axes(names, rules, sizes) == want


def test_layout_descriptions_need_no_source_code(monkeypatch):
    def no_source(obj):
        raise OSError("no source (a frozen build)")

    monkeypatch.setattr(inspect, "getsource", no_source)
    assert "Pick it" in meshplan.layouts.describe_layout("fsdp")
    listed = dict(meshplan.layouts.list_layouts())
    assert all(listed.values()) and list(listed) == list(meshplan.layouts.ALL_LAYOUTS)


def test_one_registry_gives_every_layout_its_rules_and_axes():
    layouts = meshplan.layouts
    assert set(layouts.LAYOUT_AXES) == set(layouts.ALL_LAYOUTS)
    assert all(layouts.LAYOUT_AXES[n] == ("data", "model") for n in layouts.LAYOUTS)
    assert all(  # the others each add a context, an expert or a pipeline axis
        {"context", "expert", "pipeline"} & set(layouts.LAYOUT_AXES[n])
        for n in layouts.CONTEXT_EXPERT_LAYOUTS
    )
    assert layouts.ALL_LAYOUTS["fsdp_cp"] is layouts.fsdp_cp
