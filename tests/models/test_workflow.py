"""The guide's workflow (SYSTEM.md steps 1-9) end to end on a 2x4 mesh of 8 CPU devices:
loop and scan, device-axis and logical annotations, Auto and Explicit meshes."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan.models import mlp

pytestmark = pytest.mark.slow  # each test here takes seconds: processes or long compiles

BATCH, LAYERS = 8, 4
DEPTH = 256  # the guide's 1024 only where the exact shape matters (test_init_at_guide_depth)
RULES = mlp.LOGICAL_RULES

# Devices (j, j + 4) form the j-th column of the 2x4 mesh: they hold the same block.
GUIDE_GROUPS = {frozenset({0, 4}), frozenset({1, 5}), frozenset({2, 6}), frozenset({3, 7})}


def _mesh(kind: str, shape=(2, 4)) -> Mesh:
    if kind == "explicit":
        mesh = jax.make_mesh(shape, ("data", "model"))
        assert set(mesh.axis_types) == {AxisType.Explicit}
        return mesh
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
    assert set(mesh.axis_types) == {AxisType.Auto}
    return mesh


def _model(logical: bool, use_scan: bool, depth: int = DEPTH):
    return (mlp.LogicalMLP if logical else mlp.MLP)(LAYERS, depth, use_scan)


def _layer_key(logical: bool, use_scan: bool) -> str:
    return ("Scan" if use_scan else "") + ("Logical" if logical else "") + "DotReluDot_0"


def _state_sharding(abstract: Any, mesh: Mesh, logical: bool) -> Any:
    if logical:
        return meshplan.logical_to_mesh_sharding(meshplan.get_partition_spec(abstract), mesh, RULES)
    return meshplan.get_sharding(abstract, mesh)


def _flat(tree: Any) -> list[tuple[str, Any]]:
    leaves = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, NamedSharding)
    )[0]
    return [(jax.tree_util.keystr(p), x) for p, x in leaves]


def _leading(use_scan: bool) -> tuple[None, ...]:
    return (None,) if use_scan else ()


def _expected_kernel_specs(use_scan: bool) -> tuple[P, P]:
    lead = _leading(use_scan)
    return P(*lead, None, "model"), P(*lead, "model", None)


def _expected_names(logical: bool, use_scan: bool) -> tuple[tuple, tuple]:
    if logical:
        lead = ("layer",) if use_scan else ()
        return (*lead, "embed", "hidden"), (*lead, "hidden", "embed")
    lead = _leading(use_scan)
    return (*lead, None, "model"), (*lead, "model", None)


def _holders(array: jax.Array, dim: int) -> dict[tuple[int, int], frozenset[int]]:
    """For each block ``(start, stop)`` of dimension ``dim``: the ids of the devices holding it."""
    groups: dict[tuple[int, int], set[int]] = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        block = index[dim].indices(array.shape[dim])[:2]
        groups.setdefault(block, set()).add(device.id)
    return {k: frozenset(v) for k, v in groups.items()}


def _check_guide_placement(array: jax.Array, dim: int, mesh: Mesh) -> None:
    """Split into 4 blocks along ``dim`` over ``model``; block j on the mesh's column j."""
    holders = _holders(array, dim)
    size = array.shape[dim] // 4
    assert sorted(holders) == [(j * size, (j + 1) * size) for j in range(4)]
    columns = [frozenset(d.id for d in mesh.devices[:, j]) for j in range(4)]
    assert [holders[(j * size, (j + 1) * size)] for j in range(4)] == columns
    assert set(holders.values()) == GUIDE_GROUPS
    # The two holders of a block hold the same data.
    shards = {s.device.id: np.asarray(s.data) for s in array.addressable_shards}
    for group in GUIDE_GROUPS:
        a, b = sorted(group)
        np.testing.assert_array_equal(shards[a], shards[b])
        assert shards[a].shape[dim] == size


@dataclasses.dataclass
class Run:
    """Steps 3-7 of the workflow for one configuration, computed once per module."""

    mesh_kind: str
    logical: bool
    use_scan: bool
    mesh: Mesh
    model: Any
    x: jax.Array
    x_sharding: NamedSharding
    abstract: Any
    state_sharding: Any
    state: train_state.TrainState
    new_state: train_state.TrainState
    train_step: Any
    y: jax.Array

    @property
    def layer(self) -> str:
        return _layer_key(self.logical, self.use_scan)


CONFIGS = [
    (mesh_kind, logical, use_scan)
    for mesh_kind in ("auto", "explicit")
    for logical in (False, True)
    for use_scan in (False, True)
]


def _config_id(config) -> str:
    mesh_kind, logical, use_scan = config
    return f"{mesh_kind}-{'logical' if logical else 'device_axes'}-{'scan' if use_scan else 'loop'}"


@pytest.fixture(scope="module", params=CONFIGS, ids=_config_id)
def run(request) -> Run:
    mesh_kind, logical, use_scan = request.param
    mesh = _mesh(mesh_kind)
    model = _model(logical, use_scan)
    optimizer = optax.adam(learning_rate=0.001)
    x_sharding = NamedSharding(mesh, P("data", None))
    rules = RULES if logical else ()
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        x = jax.device_put(jax.random.normal(jax.random.key(1), (BATCH, DEPTH)), x_sharding)
        init = functools.partial(mlp.init_fn, model=model, optimizer=optimizer)
        abstract = jax.eval_shape(init, jax.random.key(0), x)
        state_sharding = _state_sharding(abstract, mesh, logical)
        jit_init = jax.jit(
            mlp.init_fn,
            static_argnums=(2, 3),
            in_shardings=(NamedSharding(mesh, P()), x_sharding),
            out_shardings=state_sharding,
        )
        state = jit_init(jax.random.key(0), x, model, optimizer)
        train_step = mlp.make_train_step(model, state_sharding, x_sharding)
        new_state = jax.block_until_ready(train_step(state, x))
        y = jax.jit(lambda params, x: model.apply({"params": params}, x))(new_state.params, x)
    return Run(
        mesh_kind,
        logical,
        use_scan,
        mesh,
        model,
        x,
        x_sharding,
        abstract,
        state_sharding,
        state,
        new_state,
        train_step,
        y,
    )


# --------------------------------------------------------------------------
# Steps 1-4: the model, and the state sharding from the abstract state
# --------------------------------------------------------------------------


def test_abstract_state_is_shape_only(run):
    leaves = jax.tree_util.tree_leaves(run.abstract)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    kernel = run.abstract.params[run.layer]["Dense_0"]["kernel"]
    assert isinstance(
        kernel, meshplan.LogicallyPartitioned if run.logical else meshplan.Partitioned
    )
    assert kernel.value.shape == ((LAYERS, DEPTH, DEPTH) if run.use_scan else (DEPTH, DEPTH))


def test_state_sharding_is_the_guides(run):
    ss = run.state_sharding
    kernel, w2 = _expected_kernel_specs(run.use_scan)
    layers = (
        [run.layer]
        if run.use_scan
        else [f"{_layer_key(run.logical, False)[:-1]}{i}" for i in range(LAYERS)]
    )
    adam = ss.opt_state[0]
    for layer in layers:
        for tree in (ss.params, adam.mu, adam.nu):
            assert tree[layer]["Dense_0"]["kernel"].spec == kernel
            assert tree[layer]["W2"].spec == w2
    assert ss.step.spec == P()
    assert adam.count.spec == P()
    assert all(s.mesh == run.mesh for _, s in _flat(ss))


# --------------------------------------------------------------------------
# Step 5: the sharded init
# --------------------------------------------------------------------------


def _check_carries(state: Any, state_sharding: Any) -> None:
    """Every array of ``state`` has exactly the sharding of ``state_sharding`` at its place."""
    arrays = jax.tree_util.tree_flatten_with_path(state)[0]
    shardings = _flat(state_sharding)
    assert len(arrays) == len(shardings) > 0
    for (path, array), (where, expected) in zip(arrays, shardings, strict=True):
        assert jax.tree_util.keystr(path).removesuffix(".value") == where
        assert isinstance(array, jax.Array)
        assert array.sharding == expected, where


def test_init_state_carries_the_state_sharding(run):
    _check_carries(run.state, run.state_sharding)


def test_init_params_are_boxes_with_names(run):
    layer = run.state.params[run.layer]
    names1, names2 = _expected_names(run.logical, run.use_scan)
    box_type = meshplan.LogicallyPartitioned if run.logical else meshplan.Partitioned
    shape = (LAYERS, DEPTH, DEPTH) if run.use_scan else (DEPTH, DEPTH)
    for box, names in ((layer["Dense_0"]["kernel"], names1), (layer["W2"], names2)):
        assert type(box) is box_type
        assert isinstance(box.value, jax.Array)
        assert box.value.shape == shape
        assert box.value.dtype == jnp.float32
        assert box.names == names
    mu = run.state.opt_state[0].mu[run.layer]["W2"]
    assert type(mu) is box_type and mu.names == names2


def test_init_places_w1_by_columns_and_w2_by_rows(run):
    layer = run.state.params[run.layer]
    last = 2 if run.use_scan else 1
    _check_guide_placement(layer["Dense_0"]["kernel"].value, last, run.mesh)
    _check_guide_placement(layer["W2"].value, last - 1, run.mesh)


@pytest.mark.parametrize("use_scan", [False, True], ids=["loop", "scan"])
def test_init_at_guide_depth(use_scan):
    depth = 1024
    mesh = _mesh("auto")
    model = _model(False, use_scan, depth)
    optimizer = optax.adam(learning_rate=0.001)
    x_sharding = NamedSharding(mesh, P("data", None))
    with jax.set_mesh(mesh):
        x = jax.device_put(jnp.ones((BATCH, depth)), x_sharding)
        abstract = jax.eval_shape(
            functools.partial(mlp.init_fn, model=model, optimizer=optimizer), jax.random.key(0), x
        )
        state_sharding = meshplan.get_sharding(abstract, mesh)
        params_sharding = state_sharding.params
        init_params = jax.jit(
            lambda k, x: model.init(k, x)["params"],
            in_shardings=(NamedSharding(mesh, P()), x_sharding),
            out_shardings=params_sharding,
        )
        params = init_params(jax.random.key(0), x)
    layer = params["ScanDotReluDot_0" if use_scan else "DotReluDot_3"]
    w1, w2 = layer["Dense_0"]["kernel"], layer["W2"]
    shape = (LAYERS, depth, depth) if use_scan else (depth, depth)
    assert isinstance(w1, meshplan.Partitioned) and isinstance(w1.value, jax.Array)
    assert w1.value.shape == w2.value.shape == shape
    assert w1.names == ((None,) if use_scan else ()) + (None, "model")
    assert w2.names == ((None,) if use_scan else ()) + ("model", None)
    last = 2 if use_scan else 1
    _check_guide_placement(w1.value, last, mesh)
    _check_guide_placement(w2.value, last - 1, mesh)
    assert _holders(w1.value, last)[(0, 256)] == frozenset({0, 4})


# --------------------------------------------------------------------------
# Step 6: unbox / replace_boxed, tree_map over boxed trees
# --------------------------------------------------------------------------


def test_unbox_replace_boxed_all_zero_copy(run):
    params = run.state.params
    zeros = jax.tree_util.tree_map(jnp.zeros_like, meshplan.unbox(params))
    assert not any(
        isinstance(x, meshplan.Partitioned)
        for x in jax.tree_util.tree_leaves(
            zeros, is_leaf=lambda x: isinstance(x, meshplan.Partitioned)
        )
    )
    new = meshplan.replace_boxed(params, zeros)
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(params)
    assert meshplan.get_partition_spec(new) == meshplan.get_partition_spec(params)
    for leaf in jax.tree_util.tree_leaves(new):
        assert not np.any(np.asarray(leaf))
    assert any(np.any(np.asarray(leaf)) for leaf in jax.tree_util.tree_leaves(params))


def test_unbox_under_the_mesh_applies_each_box_sharding(run):
    with jax.set_mesh(run.mesh), meshplan.logical_axis_rules(RULES if run.logical else ()):
        raw = meshplan.unbox(run.state.params)
    kernel, w2 = _expected_kernel_specs(run.use_scan)
    assert raw[run.layer]["Dense_0"]["kernel"].sharding.spec == kernel
    assert raw[run.layer]["W2"].sharding.spec == w2


def test_tree_map_keeps_boxes(run):
    doubled = jax.tree_util.tree_map(lambda v: v * 2, run.state.params)
    box = doubled[run.layer]["W2"]
    assert type(box) is type(run.state.params[run.layer]["W2"])
    assert box.names == run.state.params[run.layer]["W2"].names
    np.testing.assert_allclose(box.value, run.state.params[run.layer]["W2"].value * 2)


# --------------------------------------------------------------------------
# Step 7: train and inference steps
# --------------------------------------------------------------------------


def test_train_step_keeps_shardings_and_changes_values(run):
    old, new = run.state, run.new_state
    assert int(new.step) == 1 and int(new.opt_state[0].count) == 1
    assert jax.tree_util.tree_structure(new) == jax.tree_util.tree_structure(old)
    _check_carries(new, run.state_sharding)
    for a, b in zip(
        jax.tree_util.tree_leaves(old.params), jax.tree_util.tree_leaves(new.params), strict=True
    ):
        assert a.shape == b.shape
        assert not np.allclose(np.asarray(a), np.asarray(b))
    assert type(new.params[run.layer]["W2"]) is type(old.params[run.layer]["W2"])
    assert new.params[run.layer]["W2"].names == old.params[run.layer]["W2"].names


def test_inference_output_is_float32_sharded_by_batch(run):
    assert run.y.dtype == jnp.float32
    assert run.y.shape == (BATCH, DEPTH)
    assert tuple(run.y.sharding.spec) in {("data",), ("data", None)}
    infer = mlp.make_infer_step(
        run.model, run.state_sharding.params, run.x_sharding, run.x_sharding
    )
    with jax.set_mesh(run.mesh), meshplan.logical_axis_rules(RULES if run.logical else ()):
        y = infer(run.new_state.params, run.x)
    assert y.dtype == jnp.float32 and y.shape == (BATCH, DEPTH)
    assert y.sharding.spec == P("data", None)
    np.testing.assert_allclose(np.asarray(y), np.asarray(run.y), rtol=1e-5, atol=1e-5)


def test_train_step_under_legacy_mesh_context():
    mesh = _mesh("auto")
    model = _model(False, False, 64)
    optimizer = optax.adam(learning_rate=0.001)
    x_sharding = NamedSharding(mesh, P("data", None))
    x = jax.device_put(jnp.ones((BATCH, 64)), x_sharding)
    init = functools.partial(mlp.init_fn, model=model, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with mesh:
            abstract = jax.eval_shape(init, jax.random.key(0), x)
            state_sharding = meshplan.get_sharding(abstract, mesh)
            state = jax.jit(init, out_shardings=state_sharding)(jax.random.key(0), x)
            new = mlp.make_train_step(model, state_sharding, x_sharding)(state, x)
            jaxpr = jax.make_jaxpr(lambda p, x: model.apply({"params": p}, x))(state.params, x)
    assert int(new.step) == 1
    assert new.params["DotReluDot_0"]["W2"].value.sharding.spec == P("model", None)
    assert "sharding_constraint" in {e.primitive.name for e in jaxpr.eqns}


# --------------------------------------------------------------------------
# Step 8: the logical variant gives the device-axis shardings
# --------------------------------------------------------------------------


@pytest.mark.parametrize("use_scan", [False, True], ids=["loop", "scan"])
def test_logical_variant_shows_logical_specs_and_mesh_shardings(use_scan):
    mesh = _mesh("auto")
    x = jax.ShapeDtypeStruct((BATCH, DEPTH), jnp.float32)
    optimizer = optax.adam(learning_rate=0.001)

    def abstract(logical):
        init = functools.partial(mlp.init_fn, model=_model(logical, use_scan), optimizer=optimizer)
        return jax.eval_shape(init, jax.random.key(0), x)

    logical_state, device_state = abstract(True), abstract(False)
    specs = meshplan.get_partition_spec(logical_state)
    layer = _layer_key(True, use_scan)
    lead = ("layer",) if use_scan else ()
    assert specs.params[layer]["Dense_0"]["kernel"] == P(*lead, "embed", "hidden")
    assert specs.params[layer]["W2"] == P(*lead, "hidden", "embed")
    shardings = meshplan.logical_to_mesh_sharding(specs, mesh, RULES)
    kernel, w2 = _expected_kernel_specs(use_scan)
    assert shardings.params[layer]["Dense_0"]["kernel"].spec == kernel
    assert shardings.params[layer]["W2"].spec == w2
    device = meshplan.get_sharding(device_state, mesh)
    assert [s for _, s in _flat(shardings)] == [s for _, s in _flat(device)]


def test_run_arrays_have_the_other_variants_shardings(run):
    """The logical run's arrays carry the device-axis plan, and the device-axis run's the logical."""
    x = jax.ShapeDtypeStruct((BATCH, DEPTH), jnp.float32)
    other = not run.logical
    init = functools.partial(
        mlp.init_fn, model=_model(other, run.use_scan), optimizer=optax.adam(1e-3)
    )
    plan = _state_sharding(jax.eval_shape(init, jax.random.key(0), x), run.mesh, other)
    assert [a.sharding for a in jax.tree_util.tree_leaves(run.new_state)] == [
        s for _, s in _flat(plan)
    ]


# --------------------------------------------------------------------------
# Step 9: checkpoint from the 2x4 mesh, restore onto a 4x2 mesh
# --------------------------------------------------------------------------


def test_checkpoint_restores_onto_another_mesh_and_back_into_boxes(run, tmp_path):
    params = run.new_state.params
    raw = meshplan.unbox(params)  # no mesh active: the raw arrays as they are
    path = tmp_path / "params"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, raw)
        checkpointer.wait_until_finished()

        mesh42 = _mesh(run.mesh_kind, (4, 2))
        target_sharding = _state_sharding(run.abstract, mesh42, run.logical).params
        target = jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), raw, target_sharding
        )
        with jax.set_mesh(mesh42):
            restored = checkpointer.restore(path, target)

    saved_leaves, restored_leaves = (
        jax.tree_util.tree_leaves(raw),
        jax.tree_util.tree_leaves(restored),
    )
    target_leaves = [s for _, s in _flat(target_sharding)]
    assert len(saved_leaves) == len(restored_leaves) == len(target_leaves) > 0
    for saved, new, sharding in zip(saved_leaves, restored_leaves, target_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(saved))
        assert new.sharding == sharding
        assert new.sharding.mesh.shape == {"data": 4, "model": 2}
        assert new.sharding.devices_indices_map(new.shape) != saved.sharding.devices_indices_map(
            saved.shape
        )

    boxed = meshplan.replace_boxed(params, restored)
    assert meshplan.get_partition_spec(boxed) == meshplan.get_partition_spec(params)
    w1 = boxed[run.layer]["Dense_0"]["kernel"]
    assert type(w1) is type(params[run.layer]["Dense_0"]["kernel"])
    assert w1.value.sharding.mesh.shape == {"data": 4, "model": 2}
    last = 2 if run.use_scan else 1
    assert len(_holders(w1.value, last)) == 2  # now split in two over the 4x2 mesh's 'model'
