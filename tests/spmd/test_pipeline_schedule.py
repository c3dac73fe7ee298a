"""Pipeline schedules on 8 emulated devices: the same values and gradients as a plain scan,
the bubble measured from the microbatches that moved, and activations moved between stages
by collective permutes along the ``pipeline`` axis only."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from meshplan import PipelineSchedule, pipeline_layers
from meshplan.train.device_mesh import make_mesh

RULES = (("batch", "data"), ("stage", "pipeline"), ("layer", "pipeline"), ("embed", None))


def _layer(w, x):
    return jnp.tanh(x @ w["w"] + w["b"])


def _plain(params, x):
    return jax.lax.scan(lambda h, w: (_layer(w, h), None), x, params)[0]


def _params(layers=8, width=16):
    k1, k2 = jax.random.split(jax.random.key(0))
    w = jax.random.normal(k1, (layers, width, width)) / np.sqrt(width)
    return {"w": w, "b": jax.random.normal(k2, (layers, width)) / 10}


def _piped(schedule, params, x, **kw):
    return pipeline_layers(_layer, params, x, schedule, ("batch", "embed"), **kw)


def _run(schedule, params, x, mesh, *, grads=False, hlo=False):
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(RULES):
        f = jax.jit(lambda p, x: _piped(schedule, p, x, with_activity=True))
        if hlo:
            return f.lower(params, x).compile().as_text()
        y, activity = f(params, x)
        if grads:
            loss = lambda p, x: _piped(schedule, p, x).sum()  # noqa: E731
            return y, jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x)
    return y, activity


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"pipeline": 4, "data": 2})


@pytest.mark.slow
@pytest.mark.parametrize("microbatches,repeats", [(4, 1), (8, 2)])
def test_a_pipeline_computes_the_plain_scan_and_its_gradients(mesh, microbatches, repeats):
    params, x = _params(), jax.random.normal(jax.random.key(1), (16, 16))
    y, grads = _run(PipelineSchedule(4, microbatches, repeats), params, x, mesh, grads=True)
    want = jax.grad(lambda p, x: _plain(p, x).sum(), argnums=(0, 1))(params, x)
    np.testing.assert_allclose(y, _plain(params, x), atol=1e-6)
    for got, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("stages,microbatches,repeats", [(4, 8, 1), (4, 4, 2), (2, 4, 3)])
def test_the_measured_bubble_is_the_schedules(stages, microbatches, repeats):
    """Each stage's held microbatch tag, moved with the activations, counted: busy M*v times."""
    mesh = make_mesh({"pipeline": stages, "data": 8 // stages})
    schedule = PipelineSchedule(stages, microbatches, repeats)
    params, x = _params(layers=stages * repeats), jnp.ones((2 * microbatches, 16))
    _, activity = _run(schedule, params, x, mesh)
    activity = np.asarray(activity)
    assert activity.shape == (schedule.iterations, stages)
    busy = activity >= 0
    assert (busy.sum(axis=0) == microbatches * repeats).all()  # every stage, every tag once
    for s in range(stages):
        assert sorted(activity[busy[:, s], s]) == list(range(microbatches * repeats))
    idle = 1 - busy.mean()
    assert idle == pytest.approx((stages - 1) / (microbatches * repeats + stages - 1))
    assert idle == pytest.approx(schedule.bubble)
    expected = [
        [
            -1
            if schedule.work(t, s) is None
            else schedule.work(t, s)[1] * microbatches + schedule.work(t, s)[0]
            for s in range(stages)
        ]
        for t in range(schedule.iterations)
    ]
    assert activity.tolist() == expected


def _permute_pairs(hlo):
    pairs = []
    for line in hlo.splitlines():
        if re.search(r"\scollective-permute(-start)?\(", line):
            text = re.search(r"source_target_pairs=\{([0-9,{}]*)\}", line).group(1)
            pairs += [tuple(map(int, p.split(","))) for p in re.findall(r"\{([0-9,]+)\}", text)]
    return pairs


def test_activations_move_to_the_next_stage_by_collective_permutes(mesh):
    params, x = _params(), jnp.ones((16, 16))
    hlo = _run(PipelineSchedule(4, 4), params, x, mesh, hlo=True)
    pairs = _permute_pairs(hlo)
    assert pairs, "no collective-permute in the compiled pipeline"
    ids = np.arange(8).reshape(4, 2)  # pipeline x data
    where = {int(ids[p, d]): (p, d) for p in range(4) for d in range(2)}
    for src, dst in pairs:  # along 'pipeline', within one 'data' column, one stage on
        (ps, ds), (pd, dd) = where[src], where[dst]
        assert ds == dd and pd == (ps + 1) % 4, (src, dst)
    assert "all-gather" not in hlo  # each stage's layers stay on it (GPipe)


def test_bad_schedules_are_refused_with_the_numbers_and_the_fix():
    problems = PipelineSchedule(4, 2, 3).problems(layers=8, batch=6)
    assert [p.code for p in problems] == ["pipeline-layers", "pipeline-microbatches"]
    assert "8 layers do not split into 4 stages x 3 repeats" in problems[0].message
    assert "multiple of 12" in problems[0].fix
    assert "2 microbatches are fewer than the 4 stages" in problems[1].message
    [batch] = PipelineSchedule(2, 4).problems(layers=4, batch=10)
    assert batch.code == "pipeline-batch" and "multiple of 4" in batch.fix
    assert PipelineSchedule(0, 4).problems(layers=4)[0].code == "pipeline-count"


def test_a_pipeline_on_explicit_mesh_axes_is_refused_with_the_fix():
    mesh = jax.make_mesh((4, 2), ("pipeline", "data"))  # Explicit axes: JAX's default
    params, x = _params(), jnp.ones((16, 16))
    refused = pytest.raises(meshplan.MeshError, match="stage axes must be Auto")
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(RULES), refused as e:
        _piped(PipelineSchedule(4, 4), params, x)
    assert e.value.problems[0].code == "pipeline-explicit"
    assert "AxisType.Auto" in e.value.problems[0].fix
