"""meshplan's API against Flax's, name by name: signatures, the tree utilities on edge-case
trees, box equality, hashing, pickling and copying, and Flax's own tree helpers on meshplan's
boxes."""

from __future__ import annotations

import copy
import inspect
import pickle

import flax.core.meta
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.linen import spmd
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._spmd.shardings import _map_collecting

RULES = (("batch", "data"), ("embed", "model"))

# Every name of the API table in SYSTEM.md, and where Flax keeps its own.
API = {
    "Partitioned": nn,
    "with_partitioning": nn,
    "get_partition_spec": nn,
    "get_sharding": nn,
    "LogicallyPartitioned": nn,
    "with_logical_partitioning": nn,
    "logical_axis_rules": nn,
    "set_logical_axis_rules": nn,
    "get_logical_axis_rules": nn,
    "logical_to_mesh_axes": nn,
    "logical_to_mesh": nn,
    "logical_to_mesh_sharding": nn,
    "with_logical_constraint": nn,
    "unbox": flax.core.meta,
    "replace_boxed": flax.core.meta,
}

# The only deliberate differences: keyword-only additions with a Flax-compatible default.
EXTRA_KEYWORDS = {"get_sharding": {"strict": False}, "logical_to_mesh_sharding": {"strict": False}}


def _parameters(fn):
    """``(name, kind, default)`` per parameter; annotations differ by design and are left out.

    An enum default is compared by its class name and value: meshplan has its own
    ``RulesFallback`` with the same members.
    """
    out = []
    for p in inspect.signature(fn).parameters.values():
        default = p.default
        if isinstance(default, meshplan.RulesFallback | spmd.RulesFallback):
            default = (type(default).__name__, default.value)
        out.append((p.name, p.kind, default))
    return out


@pytest.mark.parametrize("name", list(API))
def test_signature_matches_flax(name):
    ours = _parameters(getattr(meshplan, name))
    theirs = _parameters(getattr(API[name], name))
    extra = EXTRA_KEYWORDS.get(name, {})
    assert [p for p in ours if p[0] not in extra] == theirs
    for keyword, default in extra.items():
        assert (keyword, inspect.Parameter.KEYWORD_ONLY, default) in ours


def test_api_table_is_fully_exported():
    assert set(API) | {"RulesFallback", "PARTITION_NAME"} <= set(meshplan.__all__)


@pytest.mark.parametrize("cls", ["Partitioned", "LogicallyPartitioned"])
@pytest.mark.parametrize(
    "method",
    [
        "unbox",
        "replace_boxed",
        "add_axis",
        "remove_axis",
        "get_partition_spec",
        "get_sharding",
        "replace",
        "to_nnx_metadata",
        "from_nnx_metadata",
    ],
)
def test_box_methods_match_flax(cls, method):
    ours = getattr(getattr(meshplan, cls), method)
    theirs = getattr(getattr(nn, cls), method)
    assert _parameters(ours) == _parameters(theirs)


def test_rules_fallback_and_partition_name_match_flax():
    assert [(m.name, m.value) for m in meshplan.RulesFallback] == [
        (m.name, m.value) for m in spmd.RulesFallback
    ]
    assert meshplan.PARTITION_NAME == nn.PARTITION_NAME == "partition_name"


# --------------------------------------------------------------------------
# Tree utilities on edge-case trees
# --------------------------------------------------------------------------


@pytest.mark.slow
def test_one_spec_constrains_every_array_of_a_tree_like_flax(auto_mesh):
    tree = {"a": jnp.ones((8, 16)), "b": jnp.ones((8, 4)), "c": [jnp.ones((16, 8))]}

    def run(lib):
        with jax.set_mesh(auto_mesh):
            return jax.jit(lambda t: lib.with_logical_constraint(t, ("batch", "embed"), RULES))(
                tree
            )

    ours, theirs = run(meshplan), run(nn)
    specs = jax.tree.map(lambda x: x.sharding.spec, ours)
    assert specs == {"a": P("data", "model"), "b": P("data", "model"), "c": [P("data", "model")]}
    assert specs == jax.tree.map(lambda x: x.sharding.spec, theirs)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(tree), strict=True):
        np.testing.assert_array_equal(a, b)


def test_logical_to_mesh_keeps_none_leaves_like_flax(auto_mesh):
    tree = {"a": P("batch", "embed"), "b": None, "c": [None, P("embed")], "d": (P(),)}
    expected = {"a": P("data", "model"), "b": None, "c": [None, P("model")], "d": (P(),)}
    assert meshplan.logical_to_mesh(tree, RULES) == expected == nn.logical_to_mesh(tree, RULES)
    ours = meshplan.logical_to_mesh_sharding(tree, auto_mesh, RULES)
    assert ours == nn.logical_to_mesh_sharding(tree, auto_mesh, RULES)
    assert ours["b"] is None and ours["c"][0] is None
    assert ours["c"][1] == NamedSharding(auto_mesh, P("model"))


@pytest.mark.parametrize("fn", ["logical_to_mesh", "logical_to_mesh_sharding"])
def test_a_tree_of_boxes_instead_of_specs_is_an_error_naming_each_path(fn, auto_mesh):
    # logical_to_mesh_sharding used to hand such a tree back unchanged, boxes and all.
    tree = {
        "w": meshplan.LogicallyPartitioned(
            jax.ShapeDtypeStruct((8, 8), jnp.float32), ("embed", "hidden")
        ),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }
    args = (tree, auto_mesh, RULES) if fn == "logical_to_mesh_sharding" else (tree, RULES)
    with pytest.raises(meshplan.LogicalNamesError) as info:
        getattr(meshplan, fn)(*args)
    message = str(info.value)
    assert "2 leaves cannot be partitioned" in message
    assert "w/value: expected a logical PartitionSpec (or None)" in message
    assert "step: expected a logical PartitionSpec" in message
    assert "got ShapeDtypeStruct" in message
    assert message.splitlines()[-1].startswith("Pass meshplan.get_partition_spec(tree)")
    # The fix works.
    fixed = getattr(meshplan, fn)(meshplan.get_partition_spec(tree), *args[1:])
    spec = fixed["w"] if fn == "logical_to_mesh" else fixed["w"].spec
    assert spec == P("model", None)


def test_tuple_leaves_instead_of_partition_specs_are_an_error(auto_mesh):
    with pytest.raises(meshplan.LogicalNamesError, match=r"(?s)w/0: .*got str: 'embed'"):
        meshplan.logical_to_mesh_sharding({"w": ("embed", None)}, auto_mesh, RULES)


def test_an_error_that_no_single_leaf_explains_is_raised_unchanged():
    # _map_collecting re-walks leaf by leaf to name paths; when no leaf fails on its own,
    # the original error must surface, not an empty "0 leaves cannot be partitioned".
    calls = []

    def flaky(x):
        calls.append(x)
        if len(calls) == 1:
            raise meshplan.MeshError("the original problem")
        return x

    with pytest.raises(meshplan.MeshError, match=r"^the original problem$"):
        _map_collecting(flaky, {"a": 1, "b": 2}, lambda x: False)
    assert len(calls) == 3  # one failing walk, then one call per leaf


# --------------------------------------------------------------------------
# Equality and hashing
# --------------------------------------------------------------------------


def _abstract(cls, names=("embed", "hidden"), **kw):
    return cls(jax.ShapeDtypeStruct((4, 8), jnp.float32), names, **kw)


def test_logical_box_equality():
    a = meshplan.LogicallyPartitioned(jnp.ones((4, 8)), ("embed", "hidden"))
    assert a == meshplan.LogicallyPartitioned(jnp.ones((4, 8)), ("embed", "hidden"))
    assert a != meshplan.LogicallyPartitioned(jnp.zeros((4, 8)), ("embed", "hidden"))
    assert a != meshplan.LogicallyPartitioned(jnp.ones((4, 8)), ("embed", "mlp"))
    assert a != meshplan.Partitioned(jnp.ones((4, 8)), ("embed", "hidden"))
    # Flax cannot compare boxes of concrete arrays at all.
    with pytest.raises(ValueError, match="truth value"):
        _ = nn.LogicallyPartitioned(jnp.ones((4, 8)), ("a", "b")) == nn.LogicallyPartitioned(
            jnp.ones((4, 8)), ("a", "b")
        )


def test_logical_boxes_with_different_rules_differ():
    # A difference from Flax, whose boxes compare equal whatever their rules.
    own = _abstract(meshplan.LogicallyPartitioned, rules=(("embed", "data"),))
    other = _abstract(meshplan.LogicallyPartitioned, rules=(("embed", "model"),))
    assert own != other
    assert own == _abstract(meshplan.LogicallyPartitioned, rules=(("embed", "data"),))
    flax_own = _abstract(nn.LogicallyPartitioned, rules=(("embed", "data"),))
    assert flax_own == _abstract(nn.LogicallyPartitioned, rules=(("embed", "model"),))


@pytest.mark.parametrize("cls", ["Partitioned", "LogicallyPartitioned"])
def test_abstract_boxes_hash_consistently_with_equality_like_flax(cls):
    ours = getattr(meshplan, cls)
    a, b = _abstract(ours), _abstract(ours)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, _abstract(ours, names=("embed", "mlp"))}) == 2
    theirs = getattr(nn, cls)
    assert hash(_abstract(theirs)) == hash(_abstract(theirs))  # Flax hashes them too


@pytest.mark.parametrize("cls", ["Partitioned", "LogicallyPartitioned"])
def test_boxes_of_concrete_arrays_are_unhashable_like_flax(cls):
    for lib in (meshplan, nn):
        with pytest.raises(TypeError, match="unhashable"):
            hash(getattr(lib, cls)(jnp.ones((2, 2)), ("a", None)))


# --------------------------------------------------------------------------
# Pickling and copying
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "box",
    [
        meshplan.Partitioned(np.arange(4.0).reshape(2, 2), (None, "model")),
        meshplan.Partitioned(jnp.arange(4.0).reshape(2, 2), ("data", None)),
        meshplan.LogicallyPartitioned(
            jnp.arange(4.0).reshape(2, 2), ("embed", "hidden"), rules=(("embed", "data"),)
        ),
        meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((2, 2), jnp.bfloat16), ("a", "b")),
    ],
    ids=["numpy", "jax", "logical_with_rules", "abstract"],
)
@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
def test_boxes_round_trip_through_pickle_and_deepcopy(box, how):
    copied = pickle.loads(pickle.dumps(box)) if how == "pickle" else copy.deepcopy(box)
    assert copied is not box and type(copied) is type(box)
    assert copied == box
    assert (copied.names, copied.mesh) == (box.names, None)
    assert getattr(copied, "rules", None) == getattr(box, "rules", None)
    if hasattr(box.value, "dtype") and not isinstance(box.value, jax.ShapeDtypeStruct):
        np.testing.assert_array_equal(np.asarray(copied.value), np.asarray(box.value))
        assert copied.value.dtype == box.value.dtype


def test_box_with_a_concrete_mesh_pickles_as_flax_does(auto_mesh):
    # A concrete Mesh holds devices, which do not pickle: the same for both libraries.
    outcomes = []
    for lib in (meshplan, nn):
        try:
            pickle.dumps(lib.Partitioned(np.ones((2, 2)), ("data", None), mesh=auto_mesh))
            outcomes.append("ok")
        except TypeError as e:
            outcomes.append(str(e))
    assert outcomes[0] == outcomes[1]
    copied = copy.deepcopy(meshplan.Partitioned(np.ones((2, 2)), ("data", None), mesh=auto_mesh))
    assert copied.mesh == auto_mesh and copied.names == ("data", None)


# --------------------------------------------------------------------------
# Flax's tree helpers on meshplan's boxes, and the reverse
# --------------------------------------------------------------------------


def _tree():
    return {
        "w": meshplan.LogicallyPartitioned(jnp.arange(32.0).reshape(4, 8), ("embed", "hidden")),
        "p": meshplan.Partitioned(jnp.arange(8.0), ("model",)),
        "n": 3,
    }


def test_flax_unbox_strips_meshplan_boxes():
    raw = flax.core.meta.unbox(_tree())
    assert raw["n"] == 3
    np.testing.assert_array_equal(raw["w"], np.arange(32.0).reshape(4, 8))
    np.testing.assert_array_equal(raw["p"], np.arange(8.0))
    assert not any(isinstance(x, flax.core.meta.AxisMetadata) for x in raw.values())


def test_flax_unbox_under_a_mesh_applies_meshplan_constraints(auto_mesh):
    with jax.set_mesh(auto_mesh), meshplan.logical_axis_rules((("hidden", "model"),)):
        raw = flax.core.meta.unbox(_tree())
    assert raw["p"].sharding == NamedSharding(auto_mesh, P("model"))
    assert raw["w"].sharding == NamedSharding(auto_mesh, P(None, "model"))


def test_flax_replace_boxed_keeps_meshplan_boxes_and_names():
    tree = _tree()
    zeros = jax.tree.map(lambda x: x * 0, flax.core.meta.unbox(tree))
    new = nn.meta.replace_boxed(tree, zeros)
    assert type(new["w"]) is meshplan.LogicallyPartitioned and new["w"].names == ("embed", "hidden")
    assert type(new["p"]) is meshplan.Partitioned and new["p"].names == ("model",)
    assert float(new["w"].value.sum()) == float(new["p"].value.sum()) == 0.0
    assert new["n"] == 0
    assert meshplan.replace_boxed(tree, zeros) == new


def test_meshplan_tree_helpers_read_flax_boxes():
    theirs = {
        "w": nn.LogicallyPartitioned(jnp.ones((2, 2)), ("embed", "hidden")),
        "p": nn.Partitioned(jnp.ones(4), ("model",)),
    }
    assert meshplan.get_partition_spec(theirs) == {"w": P("embed", "hidden"), "p": P("model")}
    raw = meshplan.unbox(theirs)
    assert all(isinstance(x, jax.Array) for x in raw.values())
    new = meshplan.replace_boxed(theirs, jax.tree.map(jnp.zeros_like, raw))
    assert type(new["w"]) is nn.LogicallyPartitioned and new["w"].names == ("embed", "hidden")
    assert float(new["p"].value.sum()) == 0.0


def test_an_error_that_is_not_meshplans_passes_through_unwrapped():
    def broken(x):
        raise KeyError("not about partitioning")

    with pytest.raises(KeyError, match="not about partitioning"):
        _map_collecting(broken, {"a": 1}, lambda x: False)
