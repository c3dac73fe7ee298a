"""meshplan's boxes inside Flax Linen: ``nn.scan``/``nn.vmap`` with ``metadata_params``,
``nn.Dense(kernel_init=...)``, ``model.apply`` and ``TrainState.apply_gradients``."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan

INIT = nn.initializers.lecun_normal()


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


class Block(nn.Module):
    """A dense layer annotated with meshplan (or, for the oracle, with Flax)."""

    features: int = 8
    logical: bool = False
    use_flax: bool = False

    @nn.compact
    def __call__(self, x, _=None):
        if self.use_flax:
            wrap = nn.with_logical_partitioning if self.logical else nn.with_partitioning
        else:
            wrap = (
                meshplan.with_logical_partitioning if self.logical else meshplan.with_partitioning
            )
        names = ("embed", "mlp") if self.logical else (None, "model")
        kernel = self.param("kernel", wrap(INIT, names), (x.shape[-1], self.features))
        assert isinstance(
            kernel, jax.Array | jax.core.Tracer
        )  # param() hands the module the raw value
        return jnp.tanh(x @ kernel), None


def _scanned(axis: int, metadata_params: dict[str, Any], **block_kwargs) -> nn.Module:
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            x, _ = nn.scan(
                Block,
                length=3,
                variable_axes={"params": axis},
                split_rngs={"params": True},
                metadata_params=metadata_params,
            )(**block_kwargs)(x, None)
            return x

    return Stack()


def _vmapped(axis: int, metadata_params: dict[str, Any], **block_kwargs) -> nn.Module:
    class Ensemble(nn.Module):
        @nn.compact
        def __call__(self, x):
            y, _ = nn.vmap(
                Block,
                in_axes=0,
                out_axes=0,
                variable_axes={"params": axis},
                split_rngs={"params": True},
                metadata_params=metadata_params,
            )(**block_kwargs)(x, None)
            return y

    return Ensemble()


def _abstract_init(model: nn.Module, x: jax.Array) -> Any:
    """``model.init`` by shape only: the boxes and their names, without running the init."""
    return jax.eval_shape(model.init, jax.random.key(0), x)


def _kernel(variables: Any, name: str) -> Any:
    return variables["params"][name]["kernel"]


# --------------------------------------------------------------------------
# nn.scan
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("axis", "partition_name", "expected_names", "expected_shape"),
    [
        (0, "layer", ("layer", None, "model"), (3, 8, 8)),
        (0, None, (None, None, "model"), (3, 8, 8)),
        (1, "layer", (None, "layer", "model"), (8, 3, 8)),
        (2, "stage", (None, "model", "stage"), (8, 8, 3)),
    ],
    ids=["axis0_layer", "axis0_none", "axis1_layer", "axis2_stage"],
)
def test_scan_adds_the_partition_name_at_the_axis(
    axis, partition_name, expected_names, expected_shape
):
    params = {meshplan.PARTITION_NAME: partition_name}
    x = jnp.ones((2, 8))
    variables = _abstract_init(_scanned(axis, params), x)
    box = _kernel(variables, "ScanBlock_0")
    assert type(box) is meshplan.Partitioned
    assert box.names == expected_names
    assert box.value.shape == expected_shape
    oracle = _kernel(_abstract_init(_scanned(axis, params, use_flax=True), x), "ScanBlock_0")
    assert oracle.names == box.names


def test_scan_adds_the_partition_name_to_logical_boxes():
    variables = _abstract_init(
        _scanned(0, {meshplan.PARTITION_NAME: "layer"}, logical=True), jnp.ones((2, 8))
    )
    box = _kernel(variables, "ScanBlock_0")
    assert type(box) is meshplan.LogicallyPartitioned
    assert box.names == ("layer", "embed", "mlp")
    assert meshplan.logical_to_mesh_axes(box.names, (("layer", None), ("mlp", "model"))) == P(
        None, None, "model"
    )


@pytest.mark.slow
def test_scan_apply_removes_the_axis_again():
    # apply() runs remove_axis on every box entering the body: it must be add_axis's inverse.
    model = _scanned(0, {meshplan.PARTITION_NAME: "layer"})
    x = jnp.linspace(-1, 1, 16).reshape(2, 8)
    variables = model.init(jax.random.key(0), x)
    y = model.apply(variables, x)
    y_unboxed = model.apply(meshplan.unbox(variables), x)
    assert y.shape == (2, 8)
    np.testing.assert_allclose(y, y_unboxed, rtol=1e-6)


@pytest.mark.parametrize("transform", [_scanned, _vmapped], ids=["scan", "vmap"])
def test_transform_without_partition_name_raises(transform):
    model = transform(0, {})
    with pytest.raises(
        meshplan.PartitioningUnspecifiedError,
        match=r"(?s)nn\.scan/nn\.vmap.*meshplan\.PARTITION_NAME",
    ) as info:
        _abstract_init(model, jnp.ones((3, 2, 8)) if transform is _vmapped else jnp.ones((2, 8)))
    message = str(info.value)
    assert "Partitioned(names=(None, 'model')" in message
    assert "metadata_params={}" in message


# --------------------------------------------------------------------------
# nn.vmap
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("axis", "expected_names", "expected_shape"),
    [(0, ("ensemble", None, "model"), (3, 8, 8)), (1, (None, "ensemble", "model"), (8, 3, 8))],
    ids=["axis0", "axis1"],
)
def test_vmap_adds_the_partition_name_at_the_axis(axis, expected_names, expected_shape):
    params = {meshplan.PARTITION_NAME: "ensemble"}
    x = jnp.ones((3, 2, 8))
    model = _vmapped(axis, params)
    variables = model.init(jax.random.key(0), x)
    box = _kernel(variables, "VmapBlock_0")
    assert type(box) is meshplan.Partitioned
    assert box.names == expected_names
    assert box.value.shape == expected_shape
    oracle = _kernel(_abstract_init(_vmapped(axis, params, use_flax=True), x), "VmapBlock_0")
    assert oracle.names == box.names
    assert model.apply(variables, x).shape == (3, 2, 8)


def test_vmap_logical_boxes_gain_the_axis():
    variables = _abstract_init(
        _vmapped(0, {meshplan.PARTITION_NAME: "expert"}, logical=True), jnp.ones((3, 2, 8))
    )
    box = _kernel(variables, "VmapBlock_0")
    assert type(box) is meshplan.LogicallyPartitioned
    assert box.names == ("expert", "embed", "mlp")


# --------------------------------------------------------------------------
# nn.Dense and model.apply
# --------------------------------------------------------------------------


def test_dense_kernel_init_with_partitioning():
    dense = nn.Dense(
        16,
        kernel_init=meshplan.with_partitioning(INIT, (None, "model")),
        bias_init=meshplan.with_partitioning(nn.initializers.zeros, ("model",)),
    )
    variables = dense.init(jax.random.key(0), jnp.ones((4, 8)))
    kernel, bias = variables["params"]["kernel"], variables["params"]["bias"]
    assert type(kernel) is meshplan.Partitioned and kernel.names == (None, "model")
    assert kernel.value.shape == (8, 16)
    assert type(bias) is meshplan.Partitioned and bias.names == ("model",)
    assert meshplan.get_partition_spec(variables) == {
        "params": {"kernel": P(None, "model"), "bias": P("model")}
    }


def test_dense_kernel_init_with_logical_partitioning(mesh):
    dense = nn.Dense(16, kernel_init=meshplan.with_logical_partitioning(INIT, ("embed", "mlp")))
    abstract = jax.eval_shape(dense.init, jax.random.key(0), jnp.ones((4, 8)))
    specs = meshplan.get_partition_spec(abstract)
    assert specs["params"]["kernel"] == P("embed", "mlp")
    assert specs["params"]["bias"] == P()
    shardings = meshplan.logical_to_mesh_sharding(specs, mesh, (("mlp", "model"),))
    assert shardings["params"]["kernel"] == NamedSharding(mesh, P(None, "model"))


def test_model_apply_with_boxed_params_equals_unboxed(mesh):
    dense = nn.Dense(16, kernel_init=meshplan.with_partitioning(INIT, (None, "model")))
    x = jnp.linspace(0, 1, 32).reshape(4, 8)
    variables = dense.init(jax.random.key(0), x)
    expected = x @ variables["params"]["kernel"].value + variables["params"]["bias"]
    np.testing.assert_allclose(dense.apply(variables, x), expected, rtol=1e-6)
    np.testing.assert_allclose(dense.apply(meshplan.unbox(variables), x), expected, rtol=1e-6)
    with jax.set_mesh(mesh):
        y = jax.jit(dense.apply)(variables, x)
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_flax_and_meshplan_tree_utilities_read_each_others_boxes():
    ours = {"w": meshplan.Partitioned(jnp.ones((2, 4)), (None, "model"))}
    theirs = {"w": nn.Partitioned(jnp.ones((2, 4)), (None, "model"))}
    assert (
        nn.get_partition_spec(ours)
        == meshplan.get_partition_spec(theirs)
        == {"w": P(None, "model")}
    )
    assert isinstance(nn.meta.unbox(ours)["w"], jax.Array)
    new = nn.meta.replace_boxed(ours, {"w": jnp.zeros((2, 4))})
    assert type(new["w"]) is meshplan.Partitioned and new["w"].names == (None, "model")


# --------------------------------------------------------------------------
# TrainState
# --------------------------------------------------------------------------


def _state() -> train_state.TrainState:
    model = nn.Dense(8, kernel_init=meshplan.with_partitioning(INIT, (None, "model")))
    variables = model.init(jax.random.key(0), jnp.ones((4, 8)))
    return train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.adam(0.1)
    )


def _loss(params: Any, apply_fn: Any) -> jax.Array:
    return jnp.sum(apply_fn({"params": params}, jnp.ones((4, 8))) ** 2)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.slow
def test_boxes_survive_apply_gradients(jit):
    state = _state()
    grads = jax.grad(_loss)(state.params, state.apply_fn)
    assert type(grads["kernel"]) is meshplan.Partitioned and grads["kernel"].names == (
        None,
        "model",
    )
    mu = state.opt_state[0].mu["kernel"]
    assert type(mu) is meshplan.Partitioned and mu.names == (None, "model")

    def step(state, grads):
        return state.apply_gradients(grads=grads)

    new = (jax.jit(step) if jit else step)(state, grads)
    kernel = new.params["kernel"]
    assert type(kernel) is meshplan.Partitioned
    assert kernel.names == (None, "model")
    assert not np.allclose(kernel.value, state.params["kernel"].value)
    assert int(new.step) == 1
    assert new.opt_state[0].mu["kernel"].names == (None, "model")


def test_train_step_on_the_mesh_keeps_shardings(mesh):
    state = _state()
    with jax.set_mesh(mesh):
        sharding = meshplan.get_sharding(state, mesh)
        state = jax.device_put(state, sharding)

        def step(state):
            return state.apply_gradients(grads=jax.grad(_loss)(state.params, state.apply_fn))

        new = jax.jit(step, in_shardings=(sharding,), out_shardings=sharding)(state)
        free = jax.jit(step)(state)  # no out_shardings: the kernel keeps its box sharding anyway
    assert new.params["kernel"].value.sharding.spec == P(None, "model")
    assert new.opt_state[0].nu["kernel"].value.sharding.spec == P(None, "model")
    assert new.params["bias"].sharding.spec == P()
    assert free.params["kernel"].value.sharding.spec == P(None, "model")
    assert int(new.step) == int(free.step) == 1


def test_flax_core_meta_partition_axis_unspecified_catches_meshplans_error():
    """Flax's tests/core/core_meta_test.py::test_partition_axis_unspecified, meshplan swapped in.

    Code that catches Flax's ``errors.PartitioningUnspecifiedError`` keeps working, because
    meshplan's error subclasses it.
    """
    from flax import errors
    from flax.core import init, lift
    from flax.core import nn as core_nn

    raised = []

    def f(scope, xs):
        def g(scope, x):
            kernel_init = meshplan.with_partitioning(
                core_nn.initializers.ones_init(), ("in", "out")
            )
            scope.param("kernel", kernel_init, (3, 2))
            return x

        with pytest.raises(errors.PartitioningUnspecifiedError) as info:
            lift.vmap(
                g,
                in_axes=0,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={},
            )(scope, xs)
        raised.append(info.value)

    init(f)(jax.random.PRNGKey(0), jnp.zeros((8, 3)))
    (error,) = raised
    assert isinstance(error, meshplan.PartitioningUnspecifiedError)
    assert isinstance(error, meshplan.MeshplanError) and isinstance(error, ValueError)
    assert "metadata_params={meshplan.PARTITION_NAME: 'layer'}" in str(error)
