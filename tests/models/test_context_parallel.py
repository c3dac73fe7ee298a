"""Context parallelism on 8 emulated devices: the load-balanced order, exact losses, the
all-gather of keys and values over ``context``, and activation memory that falls as 1/N."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from collectives import axis_groups, collective_groups, counting_batches, train_losses
from meshplan import layouts
from meshplan.models.context import context_shards, load_balanced_order
from meshplan.models.transformer import Transformer, causal_mask, config_from_name, loss_fn
from meshplan.train.device_mesh import make_mesh

CONFIG = config_from_name("tiny", num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=64)


def causal_work(order: np.ndarray, shards: int) -> list[int]:
    """Query-key pairs each shard's queries attend to under the causal mask."""
    mask = causal_mask(order)
    return [int(rows.sum()) for rows in np.split(mask, shards)]


@pytest.mark.parametrize("shards", [2, 4, 8])
def test_load_balanced_order_gives_every_shard_the_same_causal_work(shards):
    length = 16 * shards
    striped = causal_work(load_balanced_order(length, shards), shards)
    contiguous = causal_work(np.arange(length), shards)
    assert len(set(striped)) == 1
    assert max(contiguous) / min(contiguous) > 2 * shards - 2  # what striping avoids
    assert sorted(load_balanced_order(length, shards)) == list(range(length))


def test_load_balanced_order_refuses_a_length_it_cannot_cut():
    with pytest.raises(ValueError, match="multiple of 8"):
        load_balanced_order(20, 4)


@pytest.mark.slow
def test_a_permuted_sequence_with_its_positions_gives_the_permuted_logits():
    for positions in ("rope", "learned"):
        model = Transformer(
            config_from_name("tiny", num_layers=1, embed_dim=32, positions=positions)
        )
        x = np.random.default_rng(0).integers(0, 256, (2, 32), dtype=np.int32)
        params = model.init(jax.random.key(0), x)["params"]
        order = load_balanced_order(32, 4)
        plain = model.apply({"params": params}, x)
        permuted = model.apply({"params": params}, x[:, order], positions=order)
        np.testing.assert_allclose(np.asarray(plain)[:, order], permuted, atol=2e-5)


def test_context_shards_follow_the_rules_and_mesh():
    mesh = make_mesh({"data": 2, "context": 4})
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(layouts.fsdp_cp):
        assert context_shards() == 4
    with jax.set_mesh(make_mesh((2, 4))), meshplan.logical_axis_rules(layouts.fsdp_tp):
        assert context_shards() == 1


@pytest.mark.parametrize("layout", ["context_parallel", "fsdp_cp"])
@pytest.mark.slow
def test_twenty_steps_match_data_parallel(layout):
    model = Transformer(CONFIG)
    loss = functools.partial(loss_fn, model=model)

    def init(key):
        return model.init(key, jnp.zeros((1, 32), jnp.int32))["params"]

    data = counting_batches(20)
    dp = train_losses(init, loss, data, make_mesh((8, 1)), layouts.data_parallel, lr=1e-2)
    mesh = make_mesh({"data": 2, "context": 4})
    cp = train_losses(init, loss, data, mesh, layouts.get_layout(layout), lr=1e-2)
    assert dp[-1] < dp[0] - 0.5  # it trains
    np.testing.assert_allclose(cp, dp, rtol=0, atol=2e-5)


def compiled_step(length: int, mesh, rules, *, layers: int = 1):
    cfg = config_from_name("tiny", num_layers=layers, embed_dim=32, mlp_dim=64, max_len=length)
    model = Transformer(cfg)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        abstract = jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
        )
        shardings = meshplan.get_sharding(abstract, mesh, strict=True)
        batch = jax.ShapeDtypeStruct((mesh.shape["data"], length + 1), jnp.int32)
        step = jax.jit(
            jax.value_and_grad(functools.partial(loss_fn, model=model)),
            in_shardings=(shardings, NamedSharding(mesh, P("data"))),
        )
        return step.lower(abstract, batch).compile()


@pytest.mark.slow
def test_keys_and_values_are_all_gathered_over_the_context_axis():
    mesh = make_mesh({"data": 2, "context": 4})
    hlo = compiled_step(64, mesh, layouts.context_parallel).as_text()
    context = axis_groups(mesh, "context")
    gathers = collective_groups(hlo, "all-gather")
    assert any(set(groups) == context for groups in gathers), gathers


@pytest.mark.slow
def test_activation_memory_per_device_falls_as_one_over_the_context_shards():
    """XLA's own count of a step's temporary buffers (compiled.memory_analysis()), one
    sequence of 2048 bytes on 1, 2 and 4 context shards."""
    temp = {}
    for shards in (1, 2, 4):
        mesh = make_mesh({"data": 1, "context": shards})
        compiled = compiled_step(2048, mesh, layouts.context_parallel)
        temp[shards] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[2] / temp[1] == pytest.approx(1 / 2, rel=0.1), temp
    assert temp[4] / temp[1] == pytest.approx(1 / 4, rel=0.15), temp
