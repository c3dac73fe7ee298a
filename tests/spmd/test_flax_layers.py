"""Flax's own layers with one logical name per kernel dimension, on Auto and Explicit meshes.

``nn.DenseGeneral`` (and so ``nn.MultiHeadDotProductAttention``) initialises a flat 2-D
kernel, unboxes it, reshapes it to its 3-D shape and puts it back into the box: the box
holds 3 names for a 2-D value for a moment. ``nn.Dense`` under FSDP rules on an Explicit
mesh contracts two operands split over ``data``; ``model.init`` with a batch of one
constrains a dimension of size 1 over ``data``. Each of these works, and is placed by
its names.
"""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshplan

INIT = nn.initializers.lecun_normal()
ZEROS = nn.initializers.zeros_init()
ONES = nn.initializers.ones_init()
RULES = (
    ("batch", "data"),
    ("length", None),
    ("embed", None),
    ("heads", "model"),
    ("kv", None),
    ("mlp", "model"),
    ("vocab", "model"),
)


def logical(init, *names):
    return meshplan.with_logical_partitioning(init, names)


def mesh_of(kind: str):
    axis_type = AxisType.Explicit if kind == "explicit" else AxisType.Auto
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type,) * 2)


class Layers(nn.Module):
    """Embed -> LayerNorm -> attention -> DenseGeneral(axis=(-2, -1)) -> logits."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 16, embedding_init=logical(INIT, "vocab", "embed"))(tokens)
        x = nn.LayerNorm(scale_init=logical(ONES, "embed"), bias_init=logical(ZEROS, "embed"))(x)
        x = meshplan.with_logical_constraint(x, ("batch", "length", "embed"))
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=4,
            qkv_features=32,
            kernel_init=logical(INIT, "embed", "heads", "kv"),
            bias_init=logical(ZEROS, "heads", "kv"),
            out_kernel_init=logical(INIT, "heads", "kv", "embed"),
            out_bias_init=logical(ZEROS, "embed"),
            # On an Explicit mesh the output projection contracts 'heads', split over 'model'
            # in both operands: say how its output is sharded (None on an Auto mesh).
            out_dot_general_cls=lambda: meshplan.logical_dot_general(("batch", "length", "embed")),
        )(x)
        h = nn.DenseGeneral((4, 8), kernel_init=logical(INIT, "embed", "heads", "kv"))(x)
        y = nn.DenseGeneral(
            16,
            axis=(-2, -1),
            kernel_init=logical(INIT, "heads", "kv", "embed"),
            dot_general=meshplan.logical_dot_general(("batch", "length", "embed")),
        )(h)
        return y


EXPECTED = {
    "params/Embed_0/embedding": P("model", None),
    "params/LayerNorm_0/scale": P(None),
    "params/MultiHeadDotProductAttention_0/query/kernel": P(None, "model", None),
    "params/MultiHeadDotProductAttention_0/query/bias": P("model", None),
    "params/MultiHeadDotProductAttention_0/out/kernel": P("model", None, None),
    "params/MultiHeadDotProductAttention_0/out/bias": P(None),
    "params/DenseGeneral_0/kernel": P(None, "model", None),
    "params/DenseGeneral_0/bias": P(),
    "params/DenseGeneral_1/kernel": P("model", None, None),
}


def _by_path(tree):
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, P))[0]
    return {meshplan._text.path_text(k): v for k, v in flat}


# On an Explicit mesh, nn.Embed's lookup (jnp.take) from a table split along 'vocab' has no
# out_sharding to give, and JAX refuses it (docs/guide.md): there the table is split along
# nothing but what the lookup can keep.
EXPLICIT_RULES = tuple((name, None) if name == "vocab" else (name, axes) for name, axes in RULES)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
@pytest.mark.slow
def test_flax_layers_with_logical_names_are_placed_by_their_names(kind):
    mesh = mesh_of(kind)
    rules = EXPLICIT_RULES if kind == "explicit" else RULES
    tokens = jnp.zeros((8, 12), jnp.int32)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        abstract = jax.eval_shape(Layers().init, jax.random.key(0), tokens)
        shardings = meshplan.get_sharding(abstract, mesh)
        params = jax.jit(Layers().init, out_shardings=shardings)(jax.random.key(0), tokens)
        out = jax.jit(Layers().apply)(params, tokens)
        meshplan.check(abstract, mesh, rules, strict=True)
    specs = _by_path(meshplan.get_partition_spec(abstract))
    assert specs["params/DenseGeneral_0/kernel"] == P("embed", "heads", "kv")
    placed = {
        meshplan._text.path_text(k): v.sharding.spec
        for k, v in jax.tree_util.tree_flatten_with_path(meshplan.unbox(params))[0]
    }
    expected = dict(EXPECTED)
    if kind == "explicit":
        expected["params/Embed_0/embedding"] = P(None, None)
    for path, spec in expected.items():
        assert placed[path] == spec, path
    assert placed["params/DenseGeneral_0/kernel"] == P(None, "model", None)
    assert out.shape == (8, 12, 16)


@pytest.mark.parametrize("kind", ["auto", "explicit", "legacy"])
@pytest.mark.slow
def test_dense_general_matches_plain_flax_values(kind):
    """The same kernel values as without boxes: the reshape is Flax's, not ours; under
    jax.set_mesh and under a legacy `with mesh:` alike."""
    tokens = jnp.ones((4, 16))
    plain = nn.DenseGeneral((4, 8), kernel_init=INIT).init(jax.random.key(1), tokens)
    boxed_model = nn.DenseGeneral((4, 8), kernel_init=logical(INIT, "embed", "heads", "kv"))
    mesh = mesh_of("auto" if kind == "legacy" else kind)
    context = mesh if kind == "legacy" else jax.set_mesh(mesh)
    with warnings.catch_warnings():  # JAX deprecates `with mesh:`; Flax users still write it
        warnings.simplefilter("ignore", DeprecationWarning)
        with context, meshplan.logical_axis_rules(RULES):
            boxed = boxed_model.init(jax.random.key(1), tokens)
    kernel = boxed["params"]["kernel"]
    assert kernel.names == ("embed", "heads", "kv")
    np.testing.assert_array_equal(np.asarray(kernel.value), plain["params"]["kernel"])
    with meshplan.logical_axis_rules(RULES):
        assert kernel.get_sharding(mesh).spec == P(None, "model", None)


class TooManyNames(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("w", logical(INIT, "embed", "heads", "kv"), (x.shape[-1], 8))
        return x @ w


class Outer(nn.Module):
    @nn.compact
    def __call__(self, x):
        return TooManyNames(name="attn")(x)


@pytest.mark.parametrize("kind", ["none", "auto", "explicit"])
@pytest.mark.slow
def test_a_box_whose_names_never_fit_its_parameter_names_the_path(kind):
    x = jnp.ones((2, 16))
    with pytest.raises(meshplan.LogicalNamesError, match=r"params/attn/w: .*3 axis names") as e:
        if kind == "none":
            Outer().init(jax.random.key(0), x)
        else:
            with jax.set_mesh(mesh_of(kind)), meshplan.logical_axis_rules(RULES):
                Outer().init(jax.random.key(0), x)
    assert [p.path for p in e.value.problems] == ["params/attn/w"]
    assert "2 names" in str(e.value)


class Mlp(nn.Module):
    """Column- then row-parallel under tensor parallelism: the row-parallel contraction
    (over 'mlp', split in both operands) needs its output sharding on an Explicit mesh."""

    row_dot_general: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(32, kernel_init=logical(INIT, "embed", "mlp"))(x)
        out = meshplan.logical_dot_general(("batch", "embed")) if self.row_dot_general else None
        return nn.Dense(16, kernel_init=logical(INIT, "mlp", "embed"), dot_general=out)(x)


@pytest.mark.parametrize(
    ("layout", "row_dot_general"),
    [("fsdp", False), ("data_parallel", False), ("fsdp_tp", True), ("tensor_parallel", True)],
)
@pytest.mark.slow
def test_dense_trains_on_an_explicit_mesh_under_every_layout(layout, row_dot_general):
    """FSDP: each kernel is stored split over the batch's axes and gathered where it is used,
    so plain nn.Dense runs unchanged; tensor parallelism's row-parallel layer says its output."""
    rules = getattr(meshplan.layouts, layout)
    mesh = mesh_of("explicit")
    x = jnp.ones((8, 16))
    model = Mlp(row_dot_general)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        x = jax.device_put(x, meshplan.logical_to_mesh_sharding(P("batch", None), mesh, rules))
        abstract = jax.eval_shape(model.init, jax.random.key(0), x)
        shardings = meshplan.get_sharding(abstract, mesh)
        params = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), x)
        grads = jax.jit(jax.grad(lambda p, x: model.apply(p, x).sum()))(params, x)
    stored = shardings["params"]["Dense_0"]["kernel"].spec
    assert params["params"]["Dense_0"]["kernel"].value.sharding.spec == stored
    # The gradient comes back in the parameter's own (FSDP-split) sharding.
    assert grads["params"]["Dense_0"]["kernel"].value.sharding.spec == stored
    host = jax.tree.map(np.asarray, params)  # the same values, on no mesh
    reference = jax.grad(lambda p, x: model.apply(p, x).sum())(host, np.ones((8, 16)))
    np.testing.assert_allclose(
        np.asarray(grads["params"]["Dense_0"]["kernel"].value),
        np.asarray(reference["params"]["Dense_0"]["kernel"].value),
        rtol=1e-5,
    )


@pytest.mark.slow
def test_init_with_a_batch_of_one_on_an_explicit_mesh_warns_and_works():
    class Constrained(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = meshplan.with_logical_constraint(x, ("batch", "embed"))
            return nn.Dense(16, kernel_init=logical(INIT, "embed", "mlp"))(x)

    fsdp = meshplan.layouts.fsdp
    with (
        jax.set_mesh(mesh_of("explicit")),
        meshplan.logical_axis_rules(fsdp),
        pytest.warns(meshplan.UnevenShardWarning, match=r"dimension 0 \(size 1\)"),
    ):
        params = Constrained().init(jax.random.key(0), jnp.zeros((1, 16)))
    assert params["params"]["Dense_0"]["kernel"].value.shape == (16, 16)


def test_embed_lookup_from_a_vocab_split_table_on_an_explicit_mesh_is_refused_by_jax():
    """The documented limit: nn.Embed cannot say how its lookup is sharded (docs/guide.md)."""
    embed = nn.Embed(64, 16, embedding_init=logical(INIT, "vocab", "embed"))
    tokens = jnp.zeros((8, 12), jnp.int32)
    # JAX's ShardingTypeError (no public name): "Use `.at[...].get(out_sharding=)`".
    with (
        jax.set_mesh(mesh_of("explicit")),
        meshplan.logical_axis_rules(RULES),
        pytest.raises(Exception, match=r"get\(out_sharding=\)"),
    ):
        embed.init(jax.random.key(0), tokens)
