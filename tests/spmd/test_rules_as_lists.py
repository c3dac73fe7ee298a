"""Rules written as lists (from YAML, JSON or ml_collections) work at every entry point.

``[["mlp", "tensor"], ["embed", ["fsdp", "data"]]]`` means exactly what the tuple form means:
each entry point below gives the same result for the list form as for the tuple form.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import meshplan

TUPLES = (("mlp", "tensor"), ("embed", ("fsdp", "data")), ("batch", None))
LISTS = [["mlp", "tensor"], ["embed", ["fsdp", "data"]], ["batch", None]]
SHAPE = (8, 16)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 2, 2), ("fsdp", "data", "tensor"))


def _box(rules=None):
    return meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct(SHAPE, jnp.float32), ("embed", "mlp"), rules=rules
    )


def _specs_of(tree):
    return jax.tree.map(lambda s: s.spec, tree, is_leaf=lambda x: hasattr(x, "spec"))


def _constrained(mesh, rules):
    with jax.set_mesh(mesh):
        return jax.jit(lambda x: meshplan.with_logical_constraint(x, ("embed", "mlp"), rules))(
            jnp.ones(SHAPE)
        ).sharding.spec


def _active(mesh, rules):
    with meshplan.logical_axis_rules(rules):
        return meshplan.get_sharding({"w": _box()}, mesh)["w"].spec


def _set_active(mesh, rules):
    meshplan.set_logical_axis_rules(rules)
    return meshplan.get_logical_axis_rules()


def _explicit_out(mesh, rules):
    with jax.set_mesh(mesh):
        return meshplan.explicit_out_sharding(("embed", "mlp"), rules)


def _restored(mesh, rules, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    state = {"w": meshplan.LogicallyPartitioned(jnp.ones(SHAPE), ("embed", "mlp"))}
    with meshplan.Checkpointer(folder) as ckpt:
        ckpt.save(0, state, rules=rules)
    return meshplan.restore(folder, mesh, rules).state["w"].value.sharding.spec


ENTRY_POINTS = {
    "logical_to_mesh_axes": lambda mesh, r, _: meshplan.logical_to_mesh_axes(("embed", "mlp"), r),
    "logical_to_mesh": lambda mesh, r, _: meshplan.logical_to_mesh({"w": P("embed", "mlp")}, r),
    "logical_to_mesh_sharding": lambda mesh, r, _: _specs_of(
        meshplan.logical_to_mesh_sharding({"w": P("embed", "mlp")}, mesh, r)
    ),
    "logical_to_mesh_sharding(strict=True)": lambda mesh, r, _: _specs_of(
        meshplan.logical_to_mesh_sharding({"w": P("embed", "mlp")}, mesh, r, strict=True)
    ),
    "logical_axis_rules + get_sharding": lambda mesh, r, _: _active(mesh, r),
    "set_logical_axis_rules": lambda mesh, r, _: _set_active(mesh, r),
    "LogicallyPartitioned(rules=)": lambda mesh, r, _: _box(r).get_sharding(mesh).spec,
    "with_logical_constraint": lambda mesh, r, _: _constrained(mesh, r),
    "explicit_out_sharding": lambda mesh, r, _: _explicit_out(mesh, r),
    "explain": lambda mesh, r, _: meshplan.explain({"w": _box()}, mesh, r)["w"].spec,
    "check": lambda mesh, r, _: [p.code for p in meshplan.check({"w": _box()}, mesh, r)],
    "Checkpointer.save + restore": _restored,
    "search_layouts": lambda mesh, r, _: str(
        meshplan.search_layouts(
            {"params": {"w": _box()}}, 8, {"mine": r}, axis_names=("fsdp", "data", "tensor")
        ).best
    ),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS), ids=list(ENTRY_POINTS))
@pytest.mark.slow
def test_rules_as_lists_mean_what_rules_as_tuples_mean(entry, mesh, tmp_path_factory):
    call = ENTRY_POINTS[entry]
    from_tuples = call(mesh, TUPLES, tmp_path_factory)
    from_lists = call(mesh, LISTS, tmp_path_factory)
    assert from_lists == from_tuples


def test_the_table_resolves_what_the_rules_say(mesh):
    assert meshplan.logical_to_mesh_axes(("embed", "mlp"), LISTS) == P(("fsdp", "data"), "tensor")
