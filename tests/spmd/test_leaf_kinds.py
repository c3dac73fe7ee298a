"""A new kind of metadata, taught once (``register_leaf_kind``), is read by every walk.

``Tagged`` stands for a front end meshplan does not know: a value with logical names,
neither a Linen box nor a Flax NNX variable. One ``LeafKind`` registered in
``meshplan._spmd.leaves`` is all it gets; the plan, the check, the four sharding
functions, the strict checks and checkpoints (save, restore, ``Restored.into``) follow.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._spmd.leaves import LeafKind, LeafNames, leaf_kind, register_leaf_kind
from meshplan._spmd.rules import get_logical_axis_rules, logical_to_mesh_axes

RULES = (("embed", "data"), ("mlp", "model"))


@dataclasses.dataclass(frozen=True)
class Tagged:
    """A value and one logical name per dimension; a spec tree keeps it around its spec."""

    value: Any
    names: tuple[Any, ...]


def _mesh_spec(tag: Tagged, rules: Any) -> P:
    return logical_to_mesh_axes(P(*tag.names), get_logical_axis_rules() if rules is None else rules)


TAGGED = LeafKind(
    name="tagged",
    matches=lambda x: isinstance(x, Tagged),
    read=lambda tag, rules: LeafNames("logical", tag.names, tag.value, None),
    spec=lambda tag, cache: dataclasses.replace(tag, value=_mesh_spec(tag, None)),
    sharding=lambda tag, mesh, named, cache: dataclasses.replace(
        tag, value=named(_mesh_spec(tag, None))
    ),
    with_value=lambda tag, value: dataclasses.replace(tag, value=value),
    resolve=_mesh_spec,
    put=lambda tag, out: dataclasses.replace(tag, value=out),
    logical=lambda tag, rules: (P(*tag.names), getattr(tag.value, "shape", None), None),
)


@pytest.fixture(autouse=True)
def _tagged_kind():
    unregister = register_leaf_kind(TAGGED)
    yield
    unregister()


def _tree(rows: int = 8) -> dict[str, Any]:
    return {"w": Tagged(jax.ShapeDtypeStruct((rows, 4), jnp.float32), ("embed", "mlp"))}


def test_get_partition_spec_resolves_the_new_kind_through_the_active_rules():
    with meshplan.logical_axis_rules(RULES):
        specs = meshplan.get_partition_spec(_tree())
    assert specs == {"w": Tagged(P("data", "model"), ("embed", "mlp"))}


def test_get_sharding_gives_the_new_kind_a_named_sharding(explicit_mesh):
    with meshplan.logical_axis_rules(RULES):
        out = meshplan.get_sharding(_tree(), explicit_mesh, strict=True)
    assert out["w"].value.spec == P("data", "model")
    assert out["w"].value.mesh == explicit_mesh


def test_plan_and_check_read_the_new_kinds_names(explicit_mesh):
    plan = meshplan.explain(_tree(), explicit_mesh, RULES)
    assert plan["w"].spec == P("data", "model")
    [problem] = meshplan.check(_tree(rows=3), explicit_mesh, RULES)
    assert (problem.code, problem.path) == ("indivisible", "w")


def test_strict_shardings_raise_the_new_kinds_errors(explicit_mesh):
    with (
        meshplan.logical_axis_rules(RULES),
        pytest.raises(meshplan.ShardingValidationError, match=r"w: dim 0 \('embed'\) of size 3"),
    ):
        meshplan.get_sharding(_tree(rows=3), explicit_mesh, strict=True)


def test_logical_spec_trees_hold_the_new_kind(explicit_mesh):
    tree = {"w": Tagged(P("embed", "mlp"), ("embed", "mlp"))}
    assert meshplan.logical_to_mesh(tree, RULES)["w"].value == P("data", "model")
    out = meshplan.logical_to_mesh_sharding(tree, explicit_mesh, RULES, strict=True)
    assert out["w"].value.spec == P("data", "model")
    with pytest.raises(meshplan.ShardingValidationError, match=r"'dta'"):
        meshplan.logical_to_mesh_sharding(tree, explicit_mesh, (("mlp", "dta"),), strict=True)


def test_checkpoints_save_restore_and_refill_the_new_kind(tmp_path, explicit_mesh):
    state = {"w": Tagged(jnp.arange(32.0).reshape(8, 4), ("embed", "mlp"))}
    with meshplan.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, rules=RULES)
    restored = meshplan.restore(tmp_path, explicit_mesh)
    box = restored.state["w"]
    assert box.names == ("embed", "mlp")
    assert box.value.sharding.spec == P("data", "model")
    refilled = restored.into(_tree())
    assert isinstance(refilled["w"], Tagged) and refilled["w"].names == ("embed", "mlp")
    np.testing.assert_array_equal(refilled["w"].value, np.arange(32.0).reshape(8, 4))


def test_an_unregistered_kind_is_a_plain_leaf_again():
    @dataclasses.dataclass(frozen=True)
    class Other:
        value: Any
        names: tuple[Any, ...]

    other = dataclasses.replace(TAGGED, name="other", matches=lambda x: isinstance(x, Other))
    unregister = register_leaf_kind(other)
    with meshplan.logical_axis_rules(RULES):
        assert meshplan.get_partition_spec({"x": Other(jnp.ones(2), ("embed",))})["x"].value == P(
            "data"
        )
    unregister()
    assert leaf_kind(Other(jnp.ones(2), ("embed",))) is None
    assert meshplan.get_partition_spec({"x": Other(jnp.ones(2), ("embed",))}) == {"x": None}
