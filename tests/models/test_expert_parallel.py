"""Expert parallelism on 8 emulated devices: routing with capacity, the all-to-alls over
``expert`` in the compiled step, losses equal to an unsharded run, and per-expert placement."""

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
from meshplan._search.measure.hlo import collective_bytes
from meshplan.models.moe import MOE_AXIS_NAMES, expert_capacity, route
from meshplan.models.transformer import (
    AXIS_NAMES,
    Transformer,
    config_from_name,
    loss_and_stats,
    loss_fn,
    parameter_count,
)
from meshplan.models.transformer_nnx import FunctionalTransformer
from meshplan.train.device_mesh import make_mesh

CONFIG = config_from_name(
    "tiny", num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=64, num_experts=4
)


def test_a_balanced_router_drops_nothing_at_capacity_factor_one_and_scores_one():
    # token t goes to experts t % 4 and (t + 1) % 4: every expert gets exactly its share
    length, experts = 8, 4
    logits = np.full((1, length, experts), -5.0)
    for t in range(length):
        logits[0, t, t % experts], logits[0, t, (t + 1) % experts] = 2.0, 1.0
    probs = jax.nn.softmax(jnp.asarray(logits))
    capacity = expert_capacity(length, num_experts=experts, top_k=2, capacity_factor=1.0)
    routing = route(probs, top_k=2, capacity=capacity)
    assert (capacity, float(routing.dropped), float(routing.routed)) == (4, 0.0, 16.0)
    assert float(routing.aux_loss) == pytest.approx(1.0, abs=1e-6)
    np.testing.assert_allclose(routing.combine.sum(axis=(2, 3)), 1.0, rtol=1e-6)


@pytest.mark.slow
def test_choices_beyond_capacity_are_dropped_and_counted():
    probs = jax.nn.softmax(jnp.tile(jnp.array([4.0, 0.0, 0.0, 0.0]), (2, 8, 1)))  # all to expert 0
    routing = route(probs, top_k=1, capacity=3)
    assert float(routing.dropped) == 2 * (8 - 3)
    assert routing.dispatch[:, :, 0].sum() == 2 * 3  # the first 3 tokens of each sequence
    assert float(routing.aux_loss) > 3.0  # unbalanced: up to num_experts


def test_expert_layouts_cover_the_vocabulary_and_place_experts_on_the_expert_axis():
    for name in ("expert_parallel", "fsdp_ep"):
        rules = layouts.get_layout(name)
        assert {n for n, _ in rules} == set(AXIS_NAMES) | set(MOE_AXIS_NAMES)
        assert rules[0][0] == "batch"
        # dispatched tokens: experts on 'expert', their batch on what is left of it
        spec = meshplan.logical_to_mesh_axes(("expert", "expert_batch", "capacity", "embed"), rules)
        assert spec == P("expert", "data", None, None)
        assert meshplan.logical_to_mesh_axes(("batch", "length", "embed"), rules)[0] == (
            "data",
            "expert",
        )


def test_the_dense_config_keeps_its_parameters():
    dense = config_from_name("tiny")
    assert parameter_count(dense) == 460_032
    moe = config_from_name("tiny", num_experts=4)
    e, m = moe.embed_dim, moe.mlp_dim
    assert parameter_count(moe) == parameter_count(dense) + moe.num_layers * (3 * 2 * e * m + e * 4)


def compiled(model, rules, mesh, length=32):
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        abstract = jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32))["params"]
        )
        shardings = meshplan.get_sharding(abstract, mesh, strict=True)
        step = jax.jit(
            jax.value_and_grad(functools.partial(loss_fn, model=model)),
            in_shardings=(shardings, NamedSharding(mesh, P(("data", "expert")))),
        )
        return step.lower(abstract, jax.ShapeDtypeStruct((8, length + 1), jnp.int32)).compile()


@pytest.mark.parametrize("layout", ["expert_parallel", "fsdp_ep"])
@pytest.mark.slow
def test_the_compiled_step_moves_tokens_by_all_to_alls_over_the_expert_axis(layout):
    mesh = make_mesh({"data": 2, "expert": 4})
    hlo = compiled(Transformer(CONFIG), layouts.get_layout(layout), mesh).as_text()
    groups = collective_groups(hlo, "all-to-all")
    # dispatch and combine, forward and backward: at least 4, every one within an expert group
    assert len(groups) >= 4, groups
    assert all(set(g) == axis_groups(mesh, "expert") for g in groups), groups
    assert collective_bytes(hlo)["all-to-all"] > 0


@pytest.mark.slow
def test_twenty_steps_under_expert_parallel_match_an_unsharded_run():
    model = Transformer(CONFIG)
    loss = functools.partial(loss_fn, model=model)

    def init(key):
        return model.init(key, jnp.zeros((1, 32), jnp.int32))["params"]

    data = counting_batches(20)
    # one device: nothing is sharded, whatever the rules say
    one = train_losses(
        init, loss, data, make_mesh({"data": 1, "expert": 1}), layouts.expert_parallel, lr=1e-2
    )
    mesh = make_mesh({"data": 2, "expert": 4})
    ep = train_losses(init, loss, data, mesh, layouts.expert_parallel, lr=1e-2)
    assert one[-1] < one[0] - 0.5
    np.testing.assert_allclose(ep, one, rtol=0, atol=5e-5)


@pytest.mark.slow
def test_twenty_nnx_steps_under_fsdp_ep_match_an_unsharded_run():
    model = FunctionalTransformer(CONFIG)
    data = counting_batches(20)
    one = train_losses(
        model.init, model.loss, data, make_mesh({"data": 1, "expert": 1}), layouts.fsdp_ep
    )
    mesh = make_mesh({"data": 2, "expert": 4})
    ep = train_losses(model.init, model.loss, data, mesh, layouts.fsdp_ep)
    np.testing.assert_allclose(ep, one, rtol=0, atol=5e-5)


def test_the_plan_shows_each_device_holding_its_own_expert(tmp_path):
    model = Transformer(CONFIG)
    abstract = jax.eval_shape(
        lambda: model.init(jax.random.key(0), jnp.zeros((1, 32), jnp.int32))["params"]
    )
    plan = meshplan.explain({"params": abstract}, {"data": 2, "expert": 4}, layouts.expert_parallel)
    wi = plan["params/layers/mlp/wi"]
    assert wi.spec == P(None, "expert", None, None)
    assert wi.shard_shape == (2, 1, 32, 64)  # one of the 4 experts per device
    assert plan["params/layers/mlp/router"].names == ("layer", "embed", "expert")
    plan.save_png(tmp_path / "experts.png")
    assert (tmp_path / "experts.png").stat().st_size > 10_000


@pytest.mark.slow
def test_stats_count_every_routed_choice():
    model = Transformer(CONFIG)
    tokens = jnp.asarray(counting_batches(1)[0])
    params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
    loss, stats = loss_and_stats(params, tokens, model)
    assert float(stats["routed"]) == CONFIG.num_layers * 8 * 32 * CONFIG.top_k
    assert 0 <= float(stats["dropped"]) < float(stats["routed"])
    assert float(loss) == pytest.approx(float(stats["ce"] + 0.01 * stats["aux_loss"]), rel=1e-6)
