"""The Transformer example: shapes, logical names, scan/loop equivalence, both mesh kinds,
and that a few training steps lower the loss."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding

import meshplan
import meshplan.layouts
from meshplan.models.data import ByteCorpus, shard_batch
from meshplan.models.transformer import (
    AXIS_NAMES,
    CONFIGS,
    Transformer,
    TransformerConfig,
    config_from_name,
    loss_fn,
)

pytestmark = pytest.mark.slow  # each test here takes seconds: processes or long compiles

# Tiny shapes that every built-in layout can split on a 2x4 mesh.
CONFIG = TransformerConfig(num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=16)
BATCH, LENGTH = 8, 16
LAYOUT_NAMES = ["data_parallel", "fsdp", "tensor_parallel", "fsdp_tp"]


def auto_mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def explicit_mesh() -> Mesh:
    return jax.make_mesh((2, 4), ("data", "model"))


MESHES = {"auto": auto_mesh, "explicit": explicit_mesh}


def tokens(batch: int = BATCH, length: int = LENGTH, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (batch, length), dtype=np.int32)


def init_params(model: Transformer, mesh: Mesh, rules, x: np.ndarray):
    """Boxed params initialised directly into the layout's shardings."""

    def init():
        return model.init(jax.random.key(0), x)["params"]

    abstract = jax.eval_shape(init)
    shardings = meshplan.logical_to_mesh_sharding(
        meshplan.get_partition_spec(abstract), mesh, rules
    )
    return jax.jit(init, out_shardings=shardings)()


def unstack_layers(params: dict, num_layers: int) -> dict:
    """Scanned params (one ``layers`` tree with a leading axis) as ``layers_0``, ``layers_1``..."""
    params = dict(params)
    stacked = params.pop("layers")
    for i in range(num_layers):
        params[f"layers_{i}"] = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
    return params


@pytest.mark.parametrize("mesh_kind", sorted(MESHES))
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_forward_gives_float32_logits_sharded_by_the_layout(layout, mesh_kind):
    mesh, rules = MESHES[mesh_kind](), meshplan.layouts.get_layout(layout)
    model = Transformer(CONFIG)
    x = tokens()
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        params = init_params(model, mesh, rules, x)
        x_sharded = shard_batch(x, mesh, rules)
        logits = jax.jit(lambda p, t: model.apply({"params": p}, t))(params, x_sharded)
    assert logits.shape == (BATCH, LENGTH, 256)
    assert logits.dtype == jnp.float32
    expected = meshplan.logical_to_mesh_axes(("batch", "length", "vocab"), rules)
    assert logits.sharding.is_equivalent_to(NamedSharding(mesh, expected), 3)
    assert np.isfinite(np.asarray(logits)).all()


@pytest.mark.parametrize("scan_layers", [True, False])
def test_every_parameter_is_logically_partitioned_with_vocabulary_names(scan_layers):
    model = Transformer(dataclasses.replace(CONFIG, scan_layers=scan_layers))
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), tokens())["params"])
    leaves = jax.tree_util.tree_leaves_with_path(params, is_leaf=meshplan._spmd.boxes.is_box)
    assert len(leaves) > 10
    for path, box in leaves:
        where = jax.tree_util.keystr(path)
        assert isinstance(box, meshplan.LogicallyPartitioned), where
        assert len(box.names) == box.value.ndim, where
        assert set(box.names) <= set(AXIS_NAMES), where
        in_block = "layers" in where
        assert (box.names[0] == "layer") == (in_block and scan_layers), where


def test_norm_scales_are_named_embed():
    params = jax.eval_shape(lambda: Transformer(CONFIG).init(jax.random.key(0), tokens())["params"])
    assert params["final_norm"]["scale"].names == ("embed",)
    assert params["layers"]["mlp_norm"]["scale"].names == ("layer", "embed")


@pytest.mark.parametrize(
    "changes",
    [{}, {"remat": True}, {"positions": "learned"}],
    ids=["plain", "remat", "learned-positions"],
)
def test_scan_and_loop_give_the_same_logits_for_the_same_params(changes):
    scanned = Transformer(dataclasses.replace(CONFIG, scan_layers=True, **changes))
    looped = Transformer(dataclasses.replace(CONFIG, scan_layers=False, **changes))
    x = tokens()
    params = meshplan.unbox(jax.jit(scanned.init)(jax.random.key(1), x)["params"])
    loop_params = unstack_layers(params, CONFIG.num_layers)
    expected_keys = jax.tree_util.tree_structure(
        meshplan.unbox(jax.eval_shape(lambda: looped.init(jax.random.key(1), x)["params"]))
    )
    assert jax.tree_util.tree_structure(loop_params) == expected_keys
    a = jax.jit(scanned.apply)({"params": params}, x)
    b = jax.jit(looped.apply)({"params": loop_params}, x)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)


def test_logits_are_causal():
    model = Transformer(CONFIG)
    x = tokens()
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    y = x.copy()
    y[:, 10:] = (y[:, 10:] + 1) % 256  # change only the future of position 9
    apply = jax.jit(model.apply)
    a, b = apply({"params": params}, x), apply({"params": params}, y)
    np.testing.assert_allclose(np.asarray(a[:, :10]), np.asarray(b[:, :10]), atol=1e-5)
    assert not np.allclose(np.asarray(a[:, 10:]), np.asarray(b[:, 10:]))


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_explicit_mesh_gradients_keep_the_parameter_shardings(layout):
    mesh, rules = explicit_mesh(), meshplan.layouts.get_layout(layout)
    model = Transformer(CONFIG)
    x = tokens(length=LENGTH + 1)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        params = init_params(model, mesh, rules, x[:, :-1])
        loss, grads = jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)(
            params, shard_batch(x, mesh, rules), model
        )
    assert 5.0 < float(loss) < 6.2  # near log(256) = 5.55 at init
    for p, g in zip(jax.tree.leaves(params), jax.tree.leaves(grads), strict=True):
        assert g.sharding.is_equivalent_to(p.sharding, p.ndim)


def test_loss_starts_near_log_vocab_size():
    model = Transformer(CONFIG)
    x = tokens(length=LENGTH + 1)
    params = jax.jit(model.init)(jax.random.key(0), x[:, :-1])["params"]
    assert float(jax.jit(loss_fn, static_argnums=2)(params, x, model)) == pytest.approx(
        np.log(256), abs=0.2
    )


def test_a_few_training_steps_reduce_the_loss_on_python_source():
    config = dataclasses.replace(CONFIGS["tiny"], num_layers=1, embed_dim=64, mlp_dim=128)
    model = Transformer(config)
    corpus = ByteCorpus.from_stdlib(max_bytes=300_000)
    mesh, rules = auto_mesh(), meshplan.layouts.fsdp_tp
    tx = optax.adam(1e-2)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        params = init_params(model, mesh, rules, np.zeros((8, 32), np.int32))
        opt_state = tx.init(params)

        @jax.jit
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch, model)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        losses = []
        for i in range(25):
            batch = shard_batch(corpus.batch_at("train", i, 0, 16, 32), mesh, rules)
            params, opt_state, loss = step(params, opt_state, batch)
            losses.append(float(loss))
    assert losses[0] > 5.0
    assert np.mean(losses[-5:]) < losses[0] - 1.5


def test_config_round_trips_through_json():
    config = config_from_name("small", dtype=jnp.bfloat16, remat=True)
    data = json.loads(json.dumps(config.to_dict()))
    assert data["dtype"] == "bfloat16"
    assert TransformerConfig.from_dict(data) == config
    assert config.head_dim == 32


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: TransformerConfig(embed_dim=30, num_heads=4), "not a multiple of num_heads"),
        (lambda: TransformerConfig(positions="alibi"), "positions must be"),
        (lambda: TransformerConfig(embed_dim=12, num_heads=4), "even head_dim"),
        (lambda: config_from_name("huge"), "choose one of"),
        (lambda: config_from_name("tiny", depth=3), "Unknown config fields"),
        (lambda: TransformerConfig.from_dict({"width": 3}), "unknown fields"),
    ],
)
def test_bad_configs_say_what_is_wrong(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_sequence_longer_than_max_len_is_an_error():
    model = Transformer(CONFIG)
    with pytest.raises(
        ValueError,
        match=r"(?s)Sequence length 17 .*exceeds max_len=16.*Feed at most 16 tokens.*max_len >= 17",
    ):
        jax.eval_shape(lambda: model.init(jax.random.key(0), tokens(length=CONFIG.max_len + 1)))


def test_bfloat16_activations_still_give_float32_logits_and_params():
    model = Transformer(dataclasses.replace(CONFIG, dtype="bfloat16"))
    x = tokens()
    params = jax.jit(model.init)(jax.random.key(0), x)["params"]
    assert {a.dtype for a in jax.tree.leaves(meshplan.unbox(params))} == {jnp.dtype("float32")}
    logits = jax.jit(model.apply)({"params": params}, x)
    assert logits.dtype == jnp.float32 and np.isfinite(np.asarray(logits)).all()
