"""The Transformer as a pipeline on 8 emulated devices: 20 steps with the losses of the same
model without one (Linen and NNX, GPipe and circular, with FSDP, tensor parallelism and
remat), the plan of each stage, and refusals of what cannot run."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from collectives import counting_batches, train_losses
from meshplan import layouts
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from meshplan.models.transformer_nnx import FunctionalTransformer
from meshplan.train.device_mesh import make_mesh

SMALL = {"num_heads": 4, "embed_dim": 32, "mlp_dim": 64, "max_len": 64}
DATA = counting_batches(20)


def _linen(cfg):
    model = Transformer(cfg)

    def init(key):
        return model.init(key, jnp.zeros((1, 32), jnp.int32))["params"]

    return init, functools.partial(loss_fn, model=model)


def _nnx(cfg):
    model = FunctionalTransformer(cfg)
    return model.init, model.loss


def _losses(build, cfg, shape, rules, steps=20):
    init, loss = build(cfg)
    return train_losses(init, loss, DATA[:steps], make_mesh(shape), rules, lr=1e-2)


def _one_device(shape):
    return dict.fromkeys(shape, 1)  # 'stage' on an axis of size 1: no pipeline


# Each front end, schedule and pipelined layout once, remat with and without a policy.
CASES = {
    # name: (front end, config, mesh, layout)
    "linen-circular-pp_fsdp-remat": (
        _linen,
        dict(num_layers=8, microbatches=4, pipeline_repeats=2, remat=True),
        {"pipeline": 4, "data": 2},
        "pp_fsdp",
    ),
    "nnx-gpipe-pp_tp-dots": (
        _nnx,
        dict(num_layers=4, microbatches=2, remat=True, remat_policy="dots_saveable"),
        {"pipeline": 2, "data": 2, "model": 2},
        "pp_tp",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_twenty_pipelined_steps_have_the_losses_of_the_same_model_without_a_pipeline(case):
    build, fields, shape, layout = CASES[case]
    cfg = config_from_name("tiny", **SMALL, **fields)
    rules = layouts.get_layout(layout)
    plain = _losses(build, cfg, _one_device(shape), rules)
    piped = _losses(build, cfg, shape, rules)
    assert plain[-1] < plain[0] - 0.5  # it learns
    np.testing.assert_allclose(piped, plain, rtol=0, atol=1e-5)


def test_the_pipelined_step_runs_the_pipeline():
    """Not the plain scan in disguise: the compiled step permutes activations between stages."""
    cfg = config_from_name("tiny", **SMALL, num_layers=4, microbatches=4)
    init, loss = _linen(cfg)
    mesh = make_mesh({"pipeline": 4, "data": 2})
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(layouts.pipeline):
        boxed = jax.eval_shape(init, jax.random.key(0))
        params = jax.eval_shape(lambda k: meshplan.unbox(init(k)), jax.random.key(0))
        forward = jax.jit(loss, in_shardings=(meshplan.get_sharding(boxed, mesh), None))
        hlo = forward.lower(params, DATA[0]).compile().as_text()
    assert "collective-permute" in hlo


def test_the_plan_shows_each_stage_holding_its_layers():
    cfg = config_from_name("tiny", **SMALL, num_layers=8)
    init, _ = _linen(cfg)
    abstract = jax.eval_shape(init, jax.random.key(0))
    plan = meshplan.explain({"params": abstract}, {"pipeline": 4, "data": 2}, layouts.pp_fsdp)
    wi = plan["params/layers/mlp/wi"]
    assert wi.names == ("layer", "embed", "mlp")
    assert wi.spec == jax.sharding.PartitionSpec("pipeline", "data", None)
    assert wi.shard_shape == (2, 16, 64)  # 2 of the 8 layers per stage, embed over data


def test_a_model_that_cannot_run_as_this_pipeline_is_refused_with_every_problem():
    cfg = config_from_name("tiny", **SMALL, num_layers=6, microbatches=2, num_experts=4)
    init, loss = _linen(cfg)
    mesh = make_mesh({"pipeline": 4, "data": 2})
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(layouts.pipeline):
        params = jax.eval_shape(init, jax.random.key(0))
        with pytest.raises(meshplan.MeshError, match="Cannot run a pipeline of 4 stages") as e:
            jax.eval_shape(loss, params, DATA[0][:5])
    codes = [p.code for p in e.value.problems]
    assert codes == ["pipeline-layers", "pipeline-microbatches", "pipeline-batch", "pipeline-moe"]


def test_the_plan_table_has_a_row_per_stage_and_no_warning_for_the_stage_rule():
    from meshplan._plan.render.table import to_text

    cfg = config_from_name("tiny", **SMALL, num_layers=4)
    init, _ = _linen(cfg)
    abstract = jax.eval_shape(init, jax.random.key(0))
    plan = meshplan.explain({"params": abstract}, {"pipeline": 2, "data": 4}, layouts.pipeline)
    blocks = sum(np.prod(leaf.shape) for leaf in plan.leaves if "/layers/" in leaf.path)
    rest = sum(np.prod(leaf.shape) for leaf in plan.leaves) - blocks
    assert [s.parameters for s in plan.stages] == [blocks // 2 + rest] * 2
    assert "stage   parameters" in to_text(plan.table())
    assert not [p for p in plan.problems if p.severity != "info"]
