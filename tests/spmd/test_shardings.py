"""``get_partition_spec`` / ``get_sharding`` / ``logical_to_mesh_sharding`` over the guide's
whole abstract ``TrainState``, with Flax's own utilities as the oracle."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan.models import mlp

BATCH, LAYERS, DEPTH = 8, 4, 1024
RULES = mlp.LOGICAL_RULES


# --------------------------------------------------------------------------
# The oracle: the guide's model annotated with Flax's own boxes
# --------------------------------------------------------------------------


# The class names match meshplan.models.mlp's, so the parameter paths match too.
class DotReluDot(nn.Module):
    depth: int
    logical: bool = False
    dense_init: Callable[..., Any] = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x):
        wrap = nn.with_logical_partitioning if self.logical else nn.with_partitioning
        names1 = ("embed", "hidden") if self.logical else (None, "model")
        names2 = ("hidden", "embed") if self.logical else ("model", None)
        y = nn.Dense(self.depth, kernel_init=wrap(self.dense_init, names1), use_bias=False)(x)
        y = jax.nn.relu(y)
        w2 = self.param("W2", wrap(self.dense_init, names2), (self.depth, x.shape[-1]))
        return jnp.dot(y, w2), None


class LogicalDotReluDot(DotReluDot):
    logical: bool = True


class FlaxMLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool
    logical: bool = False

    @nn.compact
    def __call__(self, x):
        layer = LogicalDotReluDot if self.logical else DotReluDot
        if self.use_scan:
            x, _ = nn.scan(
                layer,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={nn.PARTITION_NAME: "layer" if self.logical else None},
            )(self.depth)(x)
        else:
            for _ in range(self.num_layers):
                x, _ = layer(self.depth)(x)
        return x


def _model(impl: str, use_scan: bool, logical: bool) -> nn.Module:
    if impl == "flax":
        return FlaxMLP(LAYERS, DEPTH, use_scan, logical)
    cls = mlp.LogicalMLP if logical else mlp.MLP
    return cls(LAYERS, DEPTH, use_scan)


@functools.cache
def _abstract_state(impl: str, use_scan: bool, logical: bool):
    model = _model(impl, use_scan, logical)
    init = functools.partial(mlp.init_fn, model=model, optimizer=optax.adam(1e-3))
    return jax.eval_shape(
        init, jax.random.key(0), jax.ShapeDtypeStruct((BATCH, DEPTH), jnp.float32)
    )


def _is_spec_leaf(x):
    return x is None or isinstance(x, P | NamedSharding)


def _flat(tree):
    """``[(keystr, leaf)]``, keeping ``None`` leaves: comparable across box types."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec_leaf)[0]
    return [(jax.tree_util.keystr(path), leaf) for path, leaf in leaves]


@pytest.fixture
def mesh(auto_mesh):
    return auto_mesh


SCAN = pytest.mark.parametrize("use_scan", [False, True], ids=["loop", "scan"])


# --------------------------------------------------------------------------
# Parity with Flax on the whole TrainState
# --------------------------------------------------------------------------


@SCAN
def test_abstract_states_have_the_same_leaves(use_scan):
    ours = _abstract_state("meshplan", use_scan, False)
    theirs = _abstract_state("flax", use_scan, False)
    ours_leaves = jax.tree_util.tree_flatten_with_path(ours)[0]
    theirs_leaves = jax.tree_util.tree_flatten_with_path(theirs)[0]
    assert len(ours_leaves) == len(theirs_leaves) > 0
    for (p1, a), (p2, b) in zip(ours_leaves, theirs_leaves, strict=True):
        assert jax.tree_util.keystr(p1) == jax.tree_util.keystr(p2)
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        assert isinstance(a, jax.ShapeDtypeStruct)


@SCAN
@pytest.mark.parametrize("logical", [False, True], ids=["device_axes", "logical"])
def test_get_partition_spec_matches_flax_on_train_state(use_scan, logical):
    ours = meshplan.get_partition_spec(_abstract_state("meshplan", use_scan, logical))
    theirs = nn.get_partition_spec(_abstract_state("flax", use_scan, logical))
    assert _flat(ours) == _flat(theirs)
    # params, Adam's mu and nu: two kernels per layer (stacked by scan); plus step and count.
    assert len(_flat(ours)) == 3 * 2 * (1 if use_scan else LAYERS) + 2


@SCAN
@pytest.mark.parametrize("mesh_kind", ["auto", "explicit"])
def test_get_sharding_matches_flax_on_train_state(use_scan, mesh_kind, mesh, explicit_mesh):
    m = mesh if mesh_kind == "auto" else explicit_mesh
    ours = meshplan.get_sharding(_abstract_state("meshplan", use_scan, False), m)
    theirs = nn.get_sharding(_abstract_state("flax", use_scan, False), m)
    flat = _flat(ours)
    assert flat == _flat(theirs)
    assert all(isinstance(s, NamedSharding) and s.mesh == m for _, s in flat)


@SCAN
def test_logical_to_mesh_sharding_matches_flax_on_train_state(use_scan, mesh):
    ours_specs = meshplan.get_partition_spec(_abstract_state("meshplan", use_scan, True))
    theirs_specs = nn.get_partition_spec(_abstract_state("flax", use_scan, True))
    ours = meshplan.logical_to_mesh_sharding(ours_specs, mesh, RULES)
    theirs = nn.logical_to_mesh_sharding(theirs_specs, mesh, RULES)
    assert _flat(ours) == _flat(theirs)
    assert _flat(meshplan.logical_to_mesh(ours_specs, RULES)) == _flat(
        nn.logical_to_mesh(theirs_specs, RULES)
    )
    with meshplan.logical_axis_rules(RULES), nn.logical_axis_rules(RULES):
        assert _flat(meshplan.logical_to_mesh_sharding(ours_specs, mesh)) == _flat(
            nn.logical_to_mesh_sharding(theirs_specs, mesh)
        )


@SCAN
def test_logical_shardings_equal_device_axis_shardings(use_scan, mesh):
    logical = meshplan.logical_to_mesh_sharding(
        meshplan.get_partition_spec(_abstract_state("meshplan", use_scan, True)), mesh, RULES
    )
    device = meshplan.get_sharding(_abstract_state("meshplan", use_scan, False), mesh)
    assert [s for _, s in _flat(logical)] == [s for _, s in _flat(device)]


@SCAN
def test_train_state_specs_are_the_guides(use_scan):
    state = _abstract_state("meshplan", use_scan, False)
    specs = meshplan.get_partition_spec(state)
    layer = specs.params["ScanDotReluDot_0" if use_scan else "DotReluDot_0"]
    lead = (None,) if use_scan else ()
    assert layer["Dense_0"]["kernel"] == P(*lead, None, "model")
    assert layer["W2"] == P(*lead, "model", None)
    adam = specs.opt_state[0]
    assert adam.count == P()
    assert specs.step == P()
    assert meshplan.get_partition_spec(state.params) == adam.mu == adam.nu
    assert specs.apply_fn is state.apply_fn  # static field of TrainState, not a leaf


def test_logical_train_state_specs_are_logical():
    specs = meshplan.get_partition_spec(_abstract_state("meshplan", True, True))
    layer = specs.params["ScanLogicalDotReluDot_0"]
    assert layer["Dense_0"]["kernel"] == P("layer", "embed", "hidden")
    assert layer["W2"] == P("layer", "hidden", "embed")


# --------------------------------------------------------------------------
# Leaves
# --------------------------------------------------------------------------


def test_shape_dtype_struct_and_array_leaves_are_replicated(mesh):
    tree = {
        "abstract": jax.ShapeDtypeStruct((4, 8), jnp.float32),
        "array": jnp.ones(3),
        "numpy": np.ones((2, 2)),
        "scalar": np.float32(1.0),
    }
    specs = meshplan.get_partition_spec(tree)
    assert specs == {k: P() for k in tree}
    assert specs == nn.get_partition_spec(tree)
    shardings = meshplan.get_sharding(tree, mesh)
    assert shardings == {k: NamedSharding(mesh, P()) for k in tree}
    assert shardings == nn.get_sharding(tree, mesh)


def test_non_array_leaves_give_none(mesh):
    tree = {
        "fn": jnp.sum,
        "name": "adam",
        "count": 3,
        "lr": 0.1,
        "w": meshplan.Partitioned(jnp.ones(2), ("data",)),
    }
    expected_specs = {"fn": None, "name": None, "count": None, "lr": None, "w": P("data")}
    assert meshplan.get_partition_spec(tree) == expected_specs
    assert meshplan.get_partition_spec(tree) == nn.get_partition_spec(tree)
    shardings = meshplan.get_sharding(tree, mesh)
    assert {k: v for k, v in shardings.items() if k != "w"} == dict.fromkeys(
        ("fn", "name", "count", "lr")
    )
    assert shardings["w"] == NamedSharding(mesh, P("data"))


def test_get_sharding_of_partitioned_with_abstract_values(mesh):
    box = meshplan.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.bfloat16), ("data", "model"))
    assert meshplan.get_sharding({"w": box}, mesh) == {"w": NamedSharding(mesh, P("data", "model"))}


def test_logical_to_mesh_keeps_none_and_maps_specs():
    tree = {"a": P("batch", "hidden"), "b": None, "c": P()}
    assert meshplan.logical_to_mesh(tree, RULES) == {"a": P("data", "model"), "b": None, "c": P()}
    assert meshplan.logical_to_mesh(tree, RULES) == nn.logical_to_mesh(tree, RULES)


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


def test_unknown_mesh_axis_error_names_the_path_and_mesh_axes(mesh):
    tree = {
        "params": {
            "good": meshplan.Partitioned(
                jax.ShapeDtypeStruct((4, 8), jnp.float32), (None, "model")
            ),
            "bad": meshplan.Partitioned(
                jax.ShapeDtypeStruct((4, 8), jnp.float32), ("tensor", None)
            ),
        },
        "other": [meshplan.Partitioned(jnp.ones(4), ("expert",))],
    }
    with pytest.raises(meshplan.MeshError) as info:
        meshplan.get_sharding(tree, mesh)
    message = str(info.value)
    assert "2 leaves cannot be partitioned" in message
    assert "* params/bad: dim 0 names mesh axis 'tensor', which" in message
    assert "* other/0: dim 0 names mesh axis 'expert', which" in message
    assert "params/good" not in message
    assert [(p.path, p.code) for p in info.value.problems] == [
        ("other/0", "unknown-axis"),
        ("params/bad", "unknown-axis"),
    ]
    assert "('data', 'model')" in message
    assert isinstance(info.value, ValueError)


def test_logical_to_mesh_sharding_unknown_mesh_axis_names_the_path(mesh):
    specs = {"layers": {"kernel": P("embed", "hidden")}}
    with pytest.raises(
        meshplan.MeshError,
        match=r"(?s)layers/kernel: .*mesh axis 'tensor', which.*\('data', 'model'\)",
    ):
        meshplan.logical_to_mesh_sharding(specs, mesh, (("hidden", "tensor"),))


def test_rank_mismatch_in_tree_names_the_path(mesh):
    tree = {
        "w": meshplan.Partitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32), (None, "model", None))
    }
    with pytest.raises(meshplan.LogicalNamesError, match=r"(?s)\* w: .*rank 2"):
        meshplan.get_sharding(tree, mesh)


@SCAN
def test_get_sharding_on_logical_boxes_uses_active_rules(use_scan, mesh):
    state = _abstract_state("meshplan", use_scan, True)
    expected = meshplan.logical_to_mesh_sharding(meshplan.get_partition_spec(state), mesh, RULES)
    with meshplan.logical_axis_rules(RULES):
        got = meshplan.get_sharding(state, mesh)
    assert _flat(got) == _flat(expected)


def test_get_sharding_on_logical_boxes_without_rules_says_to_call_logical_to_mesh_sharding(mesh):
    state = _abstract_state("meshplan", False, True)
    with pytest.raises(meshplan.LogicalNamesError, match="logical_to_mesh_sharding") as info:
        meshplan.get_sharding(state, mesh)
    message = str(info.value)
    assert "params/LogicalDotReluDot_0/Dense_0/kernel: " in message
    assert "whose names are logical" in message
    # Flax itself cannot do this either: it builds NamedSharding(mesh, logical names).
    with pytest.raises(ValueError):
        nn.get_sharding(_abstract_state("flax", False, True), mesh)


def test_get_sharding_with_mesh_none_uses_the_active_mesh(mesh):
    tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32), (None, "model"))}
    with jax.set_mesh(mesh):
        got = meshplan.get_sharding(tree, None)
        specs = meshplan.logical_to_mesh_sharding({"w": P("embed")}, None, (("embed", "data"),))
    assert got["w"].spec == P(None, "model") and got["w"].mesh.shape == mesh.shape
    assert specs["w"].spec == P("data")


def test_get_sharding_with_mesh_none_and_no_active_mesh_says_how_to_give_one():
    tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((4, 8), jnp.float32), (None, "model"))}
    with pytest.raises(meshplan.MeshError, match=r"(?s)mesh=None and no mesh is active.*set_mesh"):
        meshplan.get_sharding(tree, None)
