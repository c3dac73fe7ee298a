"""The NNX Transformer: the Linen model's parameters, names and outputs; every layout; training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.core.meta import AxisMetadata
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan import layouts
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from meshplan.models.transformer_nnx import FunctionalTransformer
from meshplan.models.workflow import make_mesh

SMALL = {"num_layers": 2, "embed_dim": 32, "mlp_dim": 64, "max_len": 32}
CONFIGS = {
    "scan-rope": config_from_name("tiny", **SMALL),
    "loop-learned": config_from_name("tiny", scan_layers=False, positions="learned", **SMALL),
}


def flat(tree):
    """``{path: leaf}`` with Linen's ``params/`` dropped and NNX variables as leaves."""
    is_leaf = lambda x: isinstance(x, AxisMetadata | nnx.Variable)  # noqa: E731
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]:
        key = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        out[key.removeprefix("params/")] = leaf
    return out


def linen_abstract(config):
    model = Transformer(config)
    return jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    config = CONFIGS[request.param]
    return config, linen_abstract(config), FunctionalTransformer(config).abstract_state()


@pytest.mark.slow
def test_same_parameters_shapes_and_names_as_linen(pair):
    _, linen, state = pair
    # no rules in effect: both give their logical names as specs
    linen_specs = flat(meshplan.get_partition_spec(linen))
    nnx_specs = {k: v.get_value() for k, v in flat(meshplan.get_partition_spec(state)).items()}
    assert nnx_specs == linen_specs
    linen_leaves, nnx_leaves = flat(linen), flat(state)
    assert sorted(linen_leaves) == sorted(nnx_leaves)
    for path, box in linen_leaves.items():
        var = nnx_leaves[path]
        assert var.get_value().shape == box.value.shape, path
        assert var.get_value().dtype == box.value.dtype == jnp.float32, path
        assert tuple(var.out_sharding) == tuple(box.names), path


@pytest.mark.parametrize("layout", sorted(layouts.LAYOUTS))
def test_same_specs_and_plan_as_linen_under_every_layout(pair, layout):
    _, linen, state = pair
    rules = layouts.LAYOUTS[layout]
    mesh = {"data": 2, "model": 4}
    with meshplan.logical_axis_rules(rules):
        # Linen's specs are logical (the boxes' names); NNX's are resolved, as in Flax NNX
        linen_specs = flat(meshplan.logical_to_mesh(meshplan.get_partition_spec(linen), rules))
        nnx_specs = {k: v.get_value() for k, v in flat(meshplan.get_partition_spec(state)).items()}
    assert nnx_specs == linen_specs
    plan = meshplan.explain(state, mesh, rules)
    linen_plan = meshplan.explain({"params": linen}, mesh, rules)
    for leaf in plan.leaves:
        assert leaf.shard_shape == linen_plan["params/" + leaf.path].shard_shape, leaf.path
    problems = meshplan.check(state, mesh, rules)
    assert not [p for p in problems if p.severity == "error"], problems
    linen_problems = meshplan.check({"params": linen}, mesh, rules)
    # the same problems as Linen's, and NNX's own warning where Flax would place a variable
    # otherwise: only under the guide's rules, which leave the Transformer's names unmapped
    # (Flax keeps an unmapped name as a mesh axis)
    flax = [p for p in problems if p.code == "flax-placement"]
    assert bool(flax) == (layout == "guide"), flax
    assert all(p.severity == "warning" for p in flax)
    ours = sorted(p.code for p in problems if p.code != "flax-placement")
    assert ours == sorted(p.code for p in linen_problems)


def test_scan_adds_the_layer_name():
    state = FunctionalTransformer(CONFIGS["scan-rope"]).abstract_state()
    query = state["layers"]["attention"]["query"]
    assert query.out_sharding == ("layer", "embed", "heads", "kv")
    assert query.get_value().shape == (2, 32, 4, 8)
    with meshplan.logical_axis_rules((("layer", "data"), *layouts.tensor_parallel)):
        assert meshplan.get_partition_spec(query).get_value() == P("data", None, "model", None)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.slow
def test_same_logits_as_linen_with_the_same_values(name):
    """Linen's parameter values put into the NNX state give Linen's logits."""
    config = CONFIGS[name]
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    linen_params = meshplan.unbox(Transformer(config).init(jax.random.key(0), tokens)["params"])
    model = FunctionalTransformer(config)
    state = model.init(jax.random.key(0))
    values = flat(linen_params)
    for path, var in flat(state).items():
        var.set_value(values[path])
    expected = jax.jit(Transformer(config).apply)({"params": linen_params}, tokens)
    np.testing.assert_allclose(jax.jit(model.apply)(state, tokens), expected, rtol=1e-5, atol=1e-5)
    batch = jnp.concatenate([tokens, tokens[:, :1]], axis=1)
    linen_loss = jax.jit(lambda p, b: loss_fn(p, b, Transformer(config)))(linen_params, batch)
    np.testing.assert_allclose(jax.jit(model.loss)(state, batch), linen_loss, rtol=1e-5)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
@pytest.mark.slow
def test_jitted_training_on_a_2x4_mesh(explicit):
    config = config_from_name("tiny", num_layers=2, embed_dim=32, mlp_dim=64, max_len=32)
    model = FunctionalTransformer(config)
    mesh = make_mesh((2, 4), explicit=explicit)
    rules = layouts.fsdp_tp
    tx = optax.adam(1e-2)
    batch_sharding = NamedSharding(mesh, P("data", None))
    batch = jax.device_put(
        jax.random.randint(jax.random.key(1), (8, 17), 0, config.vocab_size, jnp.int32),
        batch_sharding,
    )
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        shardings = meshplan.get_sharding(model.abstract_state(), mesh, strict=True)
        state = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0))
        opt_shardings = meshplan.get_sharding(jax.eval_shape(tx.init, state), mesh, strict=True)
        opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(state)

        def step(state, opt_state, batch):
            loss, grads = jax.value_and_grad(model.loss)(state, batch)
            updates, opt_state = tx.update(grads, opt_state, state)
            return optax.apply_updates(state, updates), opt_state, loss

        step = jax.jit(
            step,
            in_shardings=(shardings, opt_shardings, batch_sharding),
            out_shardings=(shardings, opt_shardings, NamedSharding(mesh, P())),
        )
        losses = []
        for _ in range(4):
            state, opt_state, loss = step(state, opt_state, batch)
            losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.5, losses
    assert 4.0 < losses[0] < 7.0  # about log(256) at the start
    wi = state["layers"]["mlp"]["wi"]
    assert wi.out_sharding == ("layer", "embed", "mlp")  # names kept through the step
    assert wi.get_value().sharding.is_equivalent_to(
        NamedSharding(mesh, P(None, "data", "model")), ndim=3
    )
    mu = opt_state[0].mu["layers"]["mlp"]["wi"].get_value()
    assert mu.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "data", "model")), ndim=3)


# -- meshplan train --model transformer-nnx -----------------------------------------------------


@pytest.mark.parametrize("layout", sorted(layouts.LAYOUTS))
@pytest.mark.slow
def test_meshplan_train_under_every_layout(layout):
    """Two steps of ``meshplan train --model transformer-nnx --rules LAYOUT`` on 2x4: the state
    is placed as meshplan.explain plans it, and the loss is finite, near log(256)."""
    from meshplan._checkpoint.tree import flatten_state
    from meshplan.cli.train import TrainRequest, prepare

    request = TrainRequest(
        mesh="2x4",
        rules=layout,
        model="transformer-nnx",
        overrides={"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "max_len": 64},
        settings={"steps": 2, "batch": 8, "seq_len": 16, "eval_every": 0, "eval_batches": 1},
    )
    trainer = prepare(request)
    assert isinstance(trainer.abstract.params, nnx.State)
    result = trainer.run()
    assert sorted(result.losses) == [1, 2]
    assert all(4.0 < loss < 7.0 for loss in result.losses.values()), result.losses
    plan = meshplan.explain(trainer.abstract, trainer.mesh, layouts.get_layout(layout))
    arrays = flatten_state(trainer.state)
    assert len(arrays) == len(plan.leaves)
    for path in ("params/layers/mlp/wi", "params/embed", "opt_state/1/0/mu/layers/attention/out"):
        value, _ = arrays[path]
        assert value.sharding.is_equivalent_to(
            NamedSharding(trainer.mesh, plan[path].spec), value.ndim
        ), (layout, path, value.sharding.spec, plan[path].spec)
