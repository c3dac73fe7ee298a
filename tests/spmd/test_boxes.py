"""Metadata boxes: pytree behaviour, the AxisMetadata protocol, unboxing on meshes, and the
tree helpers ``unbox``/``replace_boxed``."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan


def _box(names=(None, "model"), shape=(4, 8), cls=meshplan.Partitioned, **kw):
    return cls(jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape), names, **kw)


# --------------------------------------------------------------------------
# Pytree behaviour
# --------------------------------------------------------------------------

BOX_CLASSES = [meshplan.Partitioned, meshplan.LogicallyPartitioned]


@pytest.mark.parametrize("cls", BOX_CLASSES, ids=lambda c: c.__name__)
def test_box_value_is_the_only_pytree_child(cls):
    box = _box(cls=cls)
    leaves, treedef = jax.tree_util.tree_flatten(box)
    assert len(leaves) == 1
    assert leaves[0] is box.value
    rebuilt = jax.tree_util.tree_unflatten(treedef, [jnp.zeros((4, 8))])
    assert type(rebuilt) is cls
    assert rebuilt.names == (None, "model")


def test_box_names_mesh_and_rules_are_static_metadata(auto_mesh):
    box = meshplan.LogicallyPartitioned(
        jnp.ones((4, 8)), ("embed", "hidden"), mesh=auto_mesh, rules=(("hidden", "model"),)
    )
    _, treedef = jax.tree_util.tree_flatten(box)
    other = meshplan.LogicallyPartitioned(
        jnp.ones((4, 8)), ("embed", "mlp"), mesh=auto_mesh, rules=(("hidden", "model"),)
    )
    assert treedef != jax.tree_util.tree_structure(other)
    assert treedef == jax.tree_util.tree_structure(box.replace_boxed(jnp.zeros((4, 8))))


@pytest.mark.parametrize("cls", BOX_CLASSES, ids=lambda c: c.__name__)
def test_tree_map_keeps_boxes_and_names(cls):
    tree = {
        "w": _box(
            ("embed", "hidden") if cls is meshplan.LogicallyPartitioned else (None, "model"),
            cls=cls,
        ),
        "b": jnp.ones(3),
    }
    doubled = jax.tree_util.tree_map(lambda v: v * 2, tree)
    assert type(doubled["w"]) is cls
    assert doubled["w"].names == tree["w"].names
    np.testing.assert_array_equal(doubled["w"].value, tree["w"].value * 2)
    np.testing.assert_array_equal(doubled["b"], 2 * jnp.ones(3))


def test_tree_leaves_of_boxed_tree_are_the_raw_values():
    tree = {"a": _box(), "b": [_box(("data", None), (2, 6)), 3.0]}
    leaves = jax.tree_util.tree_leaves(tree)
    assert [getattr(x, "shape", None) for x in leaves] == [(4, 8), (2, 6), None]


def test_jit_passes_boxes_through():
    traces = []

    @jax.jit
    def double(tree):
        traces.append(1)
        return jax.tree_util.tree_map(lambda v: v * 2, tree)

    box = _box()
    out = double(box)
    assert isinstance(out, meshplan.Partitioned)
    assert out.names == (None, "model")
    np.testing.assert_array_equal(out.value, box.value * 2)
    double(box.replace_boxed(jnp.ones((4, 8))))
    assert len(traces) == 1  # same names: no retrace
    double(meshplan.Partitioned(jnp.ones((4, 8)), ("model", None)))
    assert len(traces) == 2  # names are static: a new trace


def test_box_equality_compares_names_and_values():
    assert _box() == _box()
    assert _box() != _box(("model", None))
    assert _box() != _box().replace_boxed(jnp.zeros((4, 8)))
    assert _box(("embed", None), cls=meshplan.LogicallyPartitioned) != _box(("embed", None))


# --------------------------------------------------------------------------
# add_axis / remove_axis
# --------------------------------------------------------------------------


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("partition_name", ["layer", None])
def test_add_axis_inserts_partition_name_like_flax(index, partition_name):
    params = {meshplan.PARTITION_NAME: partition_name}
    ours = _box().add_axis(index, params)
    theirs = nn.Partitioned(jnp.ones((4, 8)), (None, "model")).add_axis(index, params)
    assert ours.names == theirs.names
    assert ours.names[index] == partition_name
    assert len(ours.names) == 3


@pytest.mark.parametrize("index", [0, 1, 2])
@pytest.mark.parametrize("cls", BOX_CLASSES, ids=lambda c: c.__name__)
def test_remove_axis_is_exact_inverse_of_add_axis(index, cls):
    params = {meshplan.PARTITION_NAME: "layer"}
    box = _box(("embed", "hidden"), cls=cls)
    added = box.add_axis(index, params)
    assert type(added) is cls
    assert added.remove_axis(index, params) == box
    assert added.remove_axis(index, params).names == ("embed", "hidden")


def test_add_axis_pads_with_none_beyond_the_names_like_flax():
    params = {meshplan.PARTITION_NAME: "layer"}
    ours = meshplan.Partitioned(jnp.ones(4), ("data",)).add_axis(3, params)
    theirs = nn.Partitioned(jnp.ones(4), ("data",)).add_axis(3, params)
    assert ours.names == theirs.names == ("data", None, None, "layer")
    assert ours.remove_axis(3, params).names == ("data", None, None)


def test_add_axis_keeps_mesh_and_rules(auto_mesh):
    box = meshplan.LogicallyPartitioned(
        jnp.ones((4, 8)), ("embed", "hidden"), mesh=auto_mesh, rules=(("hidden", "model"),)
    )
    added = box.add_axis(0, {meshplan.PARTITION_NAME: "layer"})
    assert added.mesh is auto_mesh
    assert added.rules == (("hidden", "model"),)


@pytest.mark.parametrize("method", ["add_axis", "remove_axis"])
@pytest.mark.parametrize("cls", BOX_CLASSES, ids=lambda c: c.__name__)
def test_missing_partition_name_raises_naming_the_box_and_partition_name(method, cls):
    box = _box(("embed", "hidden"), cls=cls)
    with pytest.raises(meshplan.PartitioningUnspecifiedError, match="PARTITION_NAME") as info:
        getattr(box, method)(0, {"other": 1})
    message = str(info.value)
    assert f"{cls.__name__}(names=('embed', 'hidden'), shape=(4, 8))" in message
    assert "metadata_params" in message
    assert isinstance(info.value, ValueError)
    assert [(p.code, p.path) for p in info.value.problems] == [
        ("partition-name-missing", "metadata_params")
    ]


def test_remove_axis_of_a_different_name_raises():
    added = _box().add_axis(0, {meshplan.PARTITION_NAME: "layer"})
    with pytest.raises(
        meshplan.LogicalNamesError, match=r"(?s)axis 0 named 'stage'.*holds 'layer'"
    ):
        added.remove_axis(0, {meshplan.PARTITION_NAME: "stage"})


# --------------------------------------------------------------------------
# Specs and shardings of one box
# --------------------------------------------------------------------------


def test_box_partition_spec_and_sharding(auto_mesh, explicit_mesh):
    box = _box(("data", "model"))
    assert box.get_partition_spec() == P("data", "model")
    for mesh in (auto_mesh, explicit_mesh):
        sharding = box.get_sharding(mesh)
        assert isinstance(sharding, NamedSharding)
        assert sharding.spec == P("data", "model")
        assert sharding.mesh == mesh


def test_logical_box_spec_is_logical_and_sharding_goes_through_rules(auto_mesh):
    box = _box(("embed", "hidden"), cls=meshplan.LogicallyPartitioned)
    assert box.get_partition_spec() == P("embed", "hidden")
    with meshplan.logical_axis_rules((("hidden", "model"),)):
        assert box.get_sharding(auto_mesh).spec == P(None, "model")
    own = _box(("embed", "hidden"), cls=meshplan.LogicallyPartitioned, rules=(("embed", "data"),))
    assert own.get_sharding(auto_mesh).spec == P("data", None)


def test_logical_box_get_sharding_without_rules_says_what_to_call(auto_mesh):
    box = _box(("embed", "hidden"), cls=meshplan.LogicallyPartitioned)
    with pytest.raises(meshplan.LogicalNamesError, match="logical_to_mesh_sharding") as info:
        box.get_sharding(auto_mesh)
    assert "logical_axis_rules" in str(info.value)


def test_more_names_than_dimensions_raise_naming_names_and_shape(auto_mesh):
    names, shape = ("data", None, None), (4, 8)
    box = meshplan.Partitioned(jnp.ones(shape), names)
    pattern = (
        r"(?s)3 axis names.*rank 2 \(shape \(4, 8\)\).*at most one name \(or None\) per dimension"
    )
    with pytest.raises(meshplan.LogicalNamesError, match=pattern) as info:
        box.get_sharding(auto_mesh)
    assert repr(tuple(names)) in str(info.value)
    assert [p.code for p in info.value.problems] == ["rank"]
    with jax.set_mesh(auto_mesh), pytest.raises(meshplan.LogicalNamesError, match=pattern):
        box.unbox()


@pytest.mark.parametrize(
    ("names", "shape", "spec"),
    [
        (("data",), (4, 8), P("data")),
        ((None, "model"), (2, 4, 8), P(None, "model")),
        (("data", "model"), jax.ShapeDtypeStruct((4, 8, 2), jnp.float32), P("data", "model")),
    ],
    ids=["rank2_names1", "rank3_names2", "abstract_rank3_names2"],
)
def test_fewer_names_than_dimensions_leave_the_trailing_ones_unsharded_like_flax(
    names, shape, spec, auto_mesh
):
    value = jnp.ones(shape) if isinstance(shape, tuple) else shape
    box = meshplan.Partitioned(value, names)
    flax_box = nn.Partitioned(value, names)
    assert box.get_sharding(auto_mesh).spec == spec == flax_box.get_sharding(auto_mesh).spec
    if isinstance(shape, tuple):
        with jax.set_mesh(auto_mesh):
            assert box.unbox().sharding.spec == spec


def test_dense_general_kernel_named_for_its_first_two_dimensions_unboxes(auto_mesh):
    """An (embed, heads, head_dim) kernel annotated ('embed', 'kv'), as real models do."""
    rules = (("embed", "data"), ("kv", "model"))
    box = meshplan.LogicallyPartitioned(jnp.ones((4, 8, 16)), ("embed", "kv"), rules=rules)
    with jax.set_mesh(auto_mesh):
        assert box.unbox().sharding.spec == P("data", "model")
    problems = meshplan.check({"w": box}, auto_mesh, rules)
    assert [(p.severity, p.code) for p in problems if p.path == "w"] == [("info", "padded-names")]
    assert not [p for p in problems if p.severity == "error"]


# --------------------------------------------------------------------------
# Unboxing
# --------------------------------------------------------------------------


@pytest.mark.parametrize("cls", BOX_CLASSES, ids=lambda c: c.__name__)
def test_unbox_without_mesh_returns_the_value(cls):
    box = _box(
        ("data", "model"),
        cls=cls,
        **({"rules": (("data", "data"),)} if cls is meshplan.LogicallyPartitioned else {}),
    )
    assert meshplan.active_mesh() is None
    assert box.unbox() is box.value
    assert box.unbox(apply_constraint=False) is box.value


def _check_sharded(value, mesh, spec):
    assert isinstance(value, jax.Array)
    assert isinstance(value.sharding, NamedSharding)
    assert value.sharding.spec == spec
    assert tuple(value.sharding.mesh.axis_names) == tuple(mesh.axis_names)
    assert value.sharding.mesh.devices.tolist() == mesh.devices.tolist()


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_unbox_under_set_mesh_applies_the_box_sharding(mesh_kind, auto_mesh, explicit_mesh):
    mesh = auto_mesh if mesh_kind == "auto" else explicit_mesh
    box = _box((None, "model"))
    with jax.set_mesh(mesh):
        eager = box.unbox()
        jitted = jax.jit(lambda b: b.unbox() + 1)(box)
    _check_sharded(eager, mesh, P(None, "model"))
    _check_sharded(jitted, mesh, P(None, "model"))
    np.testing.assert_array_equal(eager, box.value)
    np.testing.assert_array_equal(jitted, box.value + 1)


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_logical_unbox_under_set_mesh_applies_rules(mesh_kind, auto_mesh, explicit_mesh):
    mesh = auto_mesh if mesh_kind == "auto" else explicit_mesh
    box = _box(("embed", "hidden"), cls=meshplan.LogicallyPartitioned)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules((("embed", "data"), ("hidden", "model"))):
        _check_sharded(box.unbox(), mesh, P("data", "model"))
        _check_sharded(jax.jit(lambda b: b.unbox() * 2)(box), mesh, P("data", "model"))
    own = _box(("embed", "hidden"), cls=meshplan.LogicallyPartitioned, rules=(("hidden", "model"),))
    with jax.set_mesh(mesh):
        _check_sharded(own.unbox(), mesh, P(None, "model"))


def test_unbox_under_legacy_mesh_context_applies_the_box_sharding(auto_mesh):
    box = _box(("data", "model"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with auto_mesh:
            assert meshplan.active_mesh() is not None
            eager = box.unbox()
            jitted = jax.jit(lambda b: b.unbox() * 3)(box)
    _check_sharded(eager, auto_mesh, P("data", "model"))
    _check_sharded(jitted, auto_mesh, P("data", "model"))
    np.testing.assert_array_equal(jitted, box.value * 3)


@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_unbox_uses_the_box_own_mesh_without_a_context(mesh_kind, auto_mesh, explicit_mesh):
    mesh = auto_mesh if mesh_kind == "auto" else explicit_mesh
    box = _box(("data", None), mesh=mesh)
    _check_sharded(box.unbox(), mesh, P("data", None))


def test_unbox_with_apply_constraint_false_skips_the_constraint(auto_mesh):
    box = _box(("data", "model"))
    with jax.set_mesh(auto_mesh):
        assert box.unbox(apply_constraint=False) is box.value


# --------------------------------------------------------------------------
# Construction errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("cls", BOX_CLASSES, ids=lambda c: c.__name__)
def test_names_none_is_rejected_with_the_replicated_alternative(cls):
    with pytest.raises(
        meshplan.LogicalNamesError, match=r"(?s)names=None.*\(None,\) \* value\.ndim"
    ):
        cls(jnp.ones((2, 2)), None)


@pytest.mark.parametrize("cls", BOX_CLASSES, ids=lambda c: c.__name__)
def test_bare_string_names_are_rejected(cls):
    with pytest.raises(meshplan.LogicalNamesError, match=r"(?s)bare string 'model'.*\('model',\)"):
        cls(jnp.ones(2), "model")


def test_non_name_entries_are_rejected():
    with pytest.raises(meshplan.LogicalNamesError, match=r"entries that are not axis names: \[3\]"):
        meshplan.Partitioned(jnp.ones((2, 2)), (None, 3))


def test_list_names_become_a_tuple():
    box = meshplan.Partitioned(jnp.ones((2, 2)), [None, "model"])
    assert box.names == (None, "model")


@pytest.mark.parametrize(
    "wrap",
    [meshplan.with_partitioning, meshplan.with_logical_partitioning],
    ids=lambda f: f.__name__,
)
def test_swapped_initializer_arguments_are_rejected(wrap):
    init = nn.initializers.xavier_normal()
    with pytest.raises(
        TypeError,
        match=rf"(?s){wrap.__name__}\(fn, names\) got the arguments swapped.*{wrap.__name__}\(initializer, names\)",
    ) as info:
        wrap((None, "model"), init)
    assert [(p.code, p.path) for p in info.value.problems] == [("swapped-arguments", "fn")]


@pytest.mark.parametrize(
    "wrap",
    [meshplan.with_partitioning, meshplan.with_logical_partitioning],
    ids=lambda f: f.__name__,
)
def test_initializer_wrapper_rejects_bad_names_early(wrap):
    init = nn.initializers.xavier_normal()
    with pytest.raises(meshplan.LogicalNamesError, match="names=None") as info:
        wrap(init, None)
    assert info.value.problems[0].code == "names-none"
    with pytest.raises(meshplan.LogicalNamesError, match="bare string"):
        wrap(init, "model")
    with pytest.raises(TypeError, match="needs an initializer function") as info:
        wrap(42, (None,))
    assert info.value.problems[0].code == "not-an-initializer"


def test_with_partitioning_boxes_the_initializer_result(auto_mesh):
    init = meshplan.with_partitioning(nn.initializers.ones, (None, "model"), mesh=auto_mesh)
    box = init(jax.random.key(0), (2, 4))
    assert type(box) is meshplan.Partitioned
    assert box.names == (None, "model")
    assert box.mesh is auto_mesh
    np.testing.assert_array_equal(box.value, np.ones((2, 4)))


def test_with_logical_partitioning_boxes_with_rules():
    init = meshplan.with_logical_partitioning(
        nn.initializers.zeros, ("embed", "hidden"), rules=[["hidden", "model"]]
    )
    box = init(jax.random.key(0), (2, 4))
    assert type(box) is meshplan.LogicallyPartitioned
    assert box.names == ("embed", "hidden")
    assert box.rules == (("hidden", "model"),)


def test_with_logical_partitioning_rejects_bad_rules_early():
    with pytest.raises(meshplan.RulesError, match="got a dict"):
        meshplan.with_logical_partitioning(
            nn.initializers.zeros, ("embed",), rules={"embed": "data"}
        )


# --------------------------------------------------------------------------
# unbox / replace_boxed over trees
# --------------------------------------------------------------------------


def _params():
    return {
        "Dense_0": {"kernel": _box((None, "model"))},
        "W2": _box(("model", None), (8, 4)),
        "logical": _box(("embed", "hidden"), cls=meshplan.LogicallyPartitioned),
        "bias": jnp.ones(4),
    }


def test_unbox_strips_every_box():
    raw = meshplan.unbox(_params())
    assert not any(
        isinstance(x, nn.meta.AxisMetadata)
        for x in jax.tree_util.tree_leaves(raw, is_leaf=meshplan._spmd.boxes.is_box)
    )
    assert jax.tree_util.tree_structure(raw) == jax.tree_util.tree_structure(
        {"Dense_0": {"kernel": 0}, "W2": 0, "logical": 0, "bias": 0}
    )
    np.testing.assert_array_equal(raw["W2"], _params()["W2"].value)


def test_unbox_strips_nested_boxes_and_flax_boxes():
    inner = meshplan.Partitioned(jnp.ones((2, 2)), ("data", None))
    tree = {
        "nested": meshplan.Partitioned(inner, (None, "model")),
        "flax": nn.Partitioned(jnp.ones(3), (None,)),
    }
    raw = meshplan.unbox(tree)
    assert isinstance(raw["nested"], jax.Array)
    assert isinstance(raw["flax"], jax.Array)
    np.testing.assert_array_equal(raw["nested"], np.ones((2, 2)))
    np.testing.assert_array_equal(raw["flax"], np.ones(3))


def test_replace_boxed_all_zero_copy_keeps_names():
    params = _params()
    zeros = jax.tree_util.tree_map(jnp.zeros_like, meshplan.unbox(params))
    new = meshplan.replace_boxed(params, zeros)
    assert meshplan.get_partition_spec(new) == meshplan.get_partition_spec(params)
    assert type(new["logical"]) is meshplan.LogicallyPartitioned
    assert new["Dense_0"]["kernel"].names == (None, "model")
    assert new["W2"].names == ("model", None)
    for leaf in jax.tree_util.tree_leaves(new):
        assert float(jnp.abs(leaf).sum()) == 0.0
    # The original is untouched.
    assert float(params["W2"].value.sum()) > 0


def test_replace_boxed_with_boxed_updates_raises_naming_the_path():
    params = _params()
    with pytest.raises(
        meshplan.LogicalNamesError,
        match=r"(?s)W2: the update is itself a box.*meshplan\.unbox\(updates\)",
    ):
        meshplan.replace_boxed(params, params)


def test_replace_boxed_rank_mismatch_raises_naming_the_path():
    params = _params()
    updates = meshplan.unbox(params)
    updates["Dense_0"]["kernel"] = jnp.zeros((4, 8, 1))
    updates["W2"] = jnp.zeros(8)
    with pytest.raises(meshplan.LogicalNamesError) as info:
        meshplan.replace_boxed(params, updates)
    message = str(info.value)
    assert (
        "Dense_0/kernel: a value of shape (4, 8, 1) (rank 3) cannot go into a box named (None, 'model') (rank 2)"
        in message
    )
    assert "W2: a value of shape (8,) (rank 1)" in message
    assert "structure and ranks of meshplan.unbox(tree)" in message


def test_replace_boxed_structure_mismatch_raises():
    # JAX's structure error, which names the keys that differ (not a meshplan error).
    with pytest.raises(ValueError, match=r"(?s)key path.*Dense_0.*bias.*logical"):
        meshplan.replace_boxed(_params(), {"W2": jnp.zeros((8, 4))})


def test_comparing_boxes_of_traced_values_raises_a_clear_error():
    box = meshplan.Partitioned(jnp.ones((2, 2)), (None, None))

    def compare(value):
        return box == box.replace_boxed(value)

    with pytest.raises(TypeError, match=r"jnp\.array_equal"):
        jax.jit(compare)(jnp.ones((2, 2)))


def test_replace_boxed_errors_are_records_with_codes():
    tree = {"w": meshplan.Partitioned(jnp.ones((2, 2)), (None, "model")), "b": jnp.ones(2)}
    updates = {"w": meshplan.Partitioned(jnp.zeros((2, 2)), (None, "model")), "b": jnp.ones(2)}
    with pytest.raises(meshplan.LogicalNamesError) as info:
        meshplan.replace_boxed(tree, updates)
    assert [(p.code, p.path) for p in info.value.problems] == [("update-is-a-box", "w")]
    with pytest.raises(meshplan.LogicalNamesError) as info:
        meshplan.replace_boxed(tree, {"w": jnp.zeros(4), "b": jnp.ones(2)})
    [problem] = info.value.problems
    assert (problem.code, problem.path) == ("update-rank", "w")
    assert "  * w: a value of shape (4,) (rank 1) cannot go into a box" in str(info.value)
    assert str(info.value).splitlines()[-1] == problem.fix
