"""Gradient accumulation and rematerialisation policies, on 8 emulated devices: the same
updates as without, with less activation memory (XLA's memory analysis of the compiled step)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from collectives import counting_batches
from meshplan import layouts
from meshplan.models.data import shard_batch
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from meshplan.train.device_mesh import make_mesh
from meshplan.train.settings import TrainSettings
from meshplan.train.trainer import Trainer

CONFIG = config_from_name("tiny", num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=64)


def trainer(grad_accum: int, *, seq_len: int = 32, steps: int = 6, batch: int = 32) -> Trainer:
    mesh = make_mesh((8, 1))
    rules = layouts.fsdp
    settings = TrainSettings(
        steps=steps,
        batch=batch,
        seq_len=seq_len,
        eval_every=0,
        eval_batches=1,
        ckpt_every=0,
        warmup=1,
        lr=1e-2,
        grad_accum=grad_accum,
    )
    data = counting_batches(steps + 1, batch=batch, length=seq_len)
    model = Transformer(CONFIG)
    return Trainer(
        model=model,
        loss=functools.partial(loss_fn, model=model),
        batches=lambda split, i: shard_batch(data[i % len(data)], mesh, rules),
        settings=settings,
        mesh=mesh,
        rules=rules,
    )


@pytest.mark.slow
def test_grad_accum_gives_the_updates_of_the_whole_batch():
    whole = trainer(1).run().losses
    accumulated = trainer(4).run().losses
    assert whole[6] < whole[1] - 0.3
    np.testing.assert_allclose(list(accumulated.values()), list(whole.values()), atol=2e-5)


@pytest.mark.slow
def test_grad_accum_holds_the_activations_of_one_microbatch():
    temp = {}
    for accum in (1, 4):
        t = trainer(accum, seq_len=64, batch=64)
        t.start()
        batch = t.batches("train", 0)
        t._compile(batch)
        with t.active():
            step = t._train_step.lower(t.state, batch).compile()  # type: ignore[union-attr]
        temp[accum] = step.memory_analysis().temp_size_in_bytes
    assert temp[4] < 0.45 * temp[1], temp


def remat_step(config, length: int = 512):
    model = Transformer(config)
    mesh = make_mesh((8, 1))
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(layouts.data_parallel):
        abstract = jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
        )
        shardings = meshplan.get_sharding(abstract, mesh, strict=True)
        step = jax.jit(
            jax.value_and_grad(functools.partial(loss_fn, model=model)),
            in_shardings=(shardings, NamedSharding(mesh, P(("data", "model")))),
        )
        batch = jax.ShapeDtypeStruct((8, length + 1), jnp.int32)
        return step.lower(abstract, batch).compile()


@pytest.mark.slow
def test_remat_policies_order_the_memory_and_keep_the_gradients():
    temp, values = {}, {}
    tokens = jnp.asarray(counting_batches(1, batch=8, length=512)[0])
    for name, overrides in {
        "none": {"remat": False},
        "full": {"remat": True},
        "dots-saveable": {"remat": True, "remat_policy": "dots_saveable"},
    }.items():
        config = config_from_name(
            "tiny", num_layers=4, embed_dim=32, mlp_dim=64, max_len=512, **overrides
        )
        compiled = remat_step(config)
        temp[name] = compiled.memory_analysis().temp_size_in_bytes
        model = Transformer(config)
        params = jax.jit(model.init)(jax.random.key(0), tokens[:, :-1])["params"]
        values[name] = compiled(params, tokens)  # the program measured above, run
    assert temp["full"] < temp["dots-saveable"] < temp["none"], temp
    for name in ("full", "dots-saveable"):
        np.testing.assert_allclose(values[name][0], values["none"][0], rtol=1e-6)
        grads, reference = jax.tree.leaves(values[name][1]), jax.tree.leaves(values["none"][1])
        for a, b in zip(grads, reference, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-6)


def test_remat_policy_must_be_known():
    with pytest.raises(ValueError, match="remat_policy must be one of full, dots_saveable"):
        config_from_name("tiny", remat=True, remat_policy="everything")
