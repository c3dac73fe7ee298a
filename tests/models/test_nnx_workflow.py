"""Flax's NNX guide "Scale up on multiple devices" with meshplan, with the guide's own asserts.

The steps are :mod:`meshplan.models.workflow_nnx`; ``meshplan demo --nnx`` runs the same.
"""

from __future__ import annotations

import itertools
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from child_env import fresh_env
from meshplan.models import workflow_nnx as wf

DEPTH = 64  # the guide's 1024, smaller: the same shardings, faster


@pytest.fixture(scope="module")
def auto_mesh():
    return wf.make_mesh((2, 4))


@pytest.fixture(scope="module")
def explicit_mesh():
    return wf.make_mesh((2, 4), explicit=True)


def specs(tree):
    """``{path: PartitionSpec}`` of a state of specs (meshplan's or Flax's)."""
    return {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(tree)}


def equivalent(array, mesh, spec):
    return array.sharding.is_equivalent_to(NamedSharding(mesh, spec), ndim=array.ndim)


@pytest.fixture(scope="module")
def trained(auto_mesh):
    return wf.train(lambda r: wf.MultiDotReluDot(DEPTH, 2, rngs=r), auto_mesh, depth=DEPTH)


# -- Shard a single-array model ------------------------------------------------------------


def test_a_sharded_variable(auto_mesh):
    w = wf.sharded_variable(auto_mesh)
    assert w.sharding.spec == P(None, "model")  # already sharded!
    # no rules in effect: the names are mesh axes, for meshplan as for Flax
    assert meshplan.get_partition_spec(w).get_value() == P(None, "model")
    plan = meshplan.explain(nnx.state(nnx.Dict(w=w)), auto_mesh)
    assert plan["w"].shard_shape == (4, 2)


def test_a_sharded_linear(auto_mesh):
    linear, y = wf.sharded_linear(auto_mesh)
    assert linear.kernel.sharding.spec == P(None, "model")  # already sharded!
    assert y.sharding.spec == P("data", "model")  # ('data', None) @ (None, 'model')
    ours = specs(meshplan.get_partition_spec(nnx.state(linear)))
    assert ours == specs(nnx.get_partition_spec(nnx.state(linear))) == {"kernel": P(None, "model")}


# -- Shard a wholesome model: nnx.vmap layers, jax.lax.scan, nnx.Optimizer -----------------


@pytest.mark.slow
def test_train_step_with_nnx_optimizer(trained, auto_mesh):
    losses = trained.losses
    assert len(losses) == 5
    assert all(b < a for a, b in itertools.pairwise(losses))  # (over-)fitting
    assert int(trained.optimizer.step[...]) == 5  # the optimizer's state came back from jit
    model = trained.model
    assert equivalent(model.layers.dot1.kernel.get_value(), auto_mesh, P(None, None, "model"))
    assert equivalent(model.layers.w2.get_value(), auto_mesh, P(None, "model", None))
    # Adam's moments are placed as their parameters
    mu = trained.optimizer.opt_state[0].mu
    assert equivalent(mu.layers.w2.get_value(), auto_mesh, P(None, "model", None))


@pytest.mark.slow
def test_meshplan_reads_the_guide_model_as_flax_does(trained, auto_mesh):
    state = nnx.state(trained.model)
    ours = specs(meshplan.get_partition_spec(state))
    assert ours == specs(nnx.get_partition_spec(state))
    assert ours == {
        "layers/dot1/kernel": P(None, None, "model"),
        "layers/w2": P(None, "model", None),
    }
    # the optimizer's state too: the plan counts parameters and Adam's moments
    plan = meshplan.explain(nnx.state(trained.optimizer), auto_mesh)
    mu = plan["opt_state/0/mu/layers/w2"]
    assert mu.spec == P(None, "model", None) and mu.shard_shape == (2, DEPTH // 4, DEPTH)
    assert not [p for p in meshplan.check(state, auto_mesh) if p.severity == "error"]


# -- Load a sharded model from a checkpoint ------------------------------------------------


def test_orbax_checkpoint_restored_onto_another_mesh(trained, tmp_path):
    path = wf.save_state(nnx.state(trained.model), tmp_path)
    other = wf.make_mesh((4, 2))
    restored = wf.restore_onto(path, lambda: wf.MultiDotReluDot(DEPTH, 2, rngs=nnx.Rngs(0)), other)
    kernel = restored.layers.dot1.kernel
    assert kernel.shape == (2, DEPTH, DEPTH)
    assert kernel.sharding.mesh.shape == other.shape
    assert equivalent(kernel.get_value(), other, P(None, None, "model"))
    assert wf.trees_equal(nnx.state(restored), nnx.state(trained.model))


def test_logical_checkpoint_restored_with_other_rules(auto_mesh, tmp_path):
    def make():
        return wf.LogicalMultiDotReluDot(DEPTH, 2, rngs=nnx.Rngs(0))

    model, _ = wf.run_logical(auto_mesh, DEPTH)
    path = wf.save_state(nnx.state(model), tmp_path)
    other = wf.make_mesh((4, 2))
    restored = wf.restore_onto(path, make, other, wf.OTHER_RULES)
    # ('embed', 'hidden') under OTHER_RULES: embed -> model, hidden -> data
    assert equivalent(restored.layers.dot1.kernel.get_value(), other, P(None, "model", "data"))
    assert equivalent(restored.layers.w2.get_value(), other, P(None, "data", "model"))
    assert restored.layers.dot1.kernel.out_sharding == (None, "embed", "hidden")
    assert wf.trees_equal(nnx.state(restored), nnx.state(model))


@pytest.mark.slow
def test_meshplan_checkpoint_restores_an_nnx_state_onto_another_mesh(auto_mesh, tmp_path):
    def make():
        return wf.LogicalMultiDotReluDot(DEPTH, 2, rngs=nnx.Rngs(0))

    model, _ = wf.run_logical(auto_mesh, DEPTH)
    other = wf.make_mesh((4, 2))
    restored = wf.restore_with_meshplan(model, tmp_path, make, other, wf.OTHER_RULES)
    assert restored.layers.dot1.kernel.sharding.spec == P(None, "model", "data")
    assert restored.layers.w2.sharding.spec == P(None, "data", "model")
    assert restored.layers.w2.out_sharding == (None, "hidden", "embed")
    assert wf.trees_equal(nnx.state(restored), nnx.state(model))
    metadata = meshplan.restore(tmp_path).metadata
    assert metadata.arrays["layers/w2"].names == (None, "hidden", "embed")


# -- Logical axis annotation, with meshplan's rules ----------------------------------------


def test_logical_variant_with_meshplan_rules(auto_mesh):
    logical_model, logical_output = wf.run_logical(auto_mesh, DEPTH)
    # the guide's asserts
    assert logical_model.layers.dot1.kernel.sharding.is_equivalent_to(
        NamedSharding(auto_mesh, P(None, None, "model")), ndim=3
    )
    assert logical_model.layers.w2.sharding.is_equivalent_to(
        NamedSharding(auto_mesh, P(None, "model", None)), ndim=3
    )
    assert logical_output.sharding.is_equivalent_to(
        NamedSharding(auto_mesh, P("data", None)), ndim=2
    )
    # the names stay logical; Flax, given meshplan's placement, agrees with meshplan
    state = nnx.state(logical_model)
    assert logical_model.layers.w2.out_sharding == (None, "hidden", "embed")
    with meshplan.logical_axis_rules(wf.GUIDE_RULES):
        ours = specs(meshplan.get_partition_spec(state))
        plan = meshplan.explain(state, auto_mesh)
    assert ours == specs(nnx.get_partition_spec(state))
    assert plan["layers/w2"].names == (None, "hidden", "embed")
    assert plan["layers/w2"].spec == P(None, "model", None)


def test_the_activation_constraint_is_in_logical_names(auto_mesh):
    """The guide writes ``P('data', None)`` ("logical aliasing doesn't work on lower-level JAX
    calls"); meshplan's ``with_logical_constraint(y, ('batch', 'hidden'))`` resolves by the rules."""
    model, output = wf.run_logical(auto_mesh, DEPTH)
    with jax.set_mesh(auto_mesh), meshplan.logical_axis_rules(wf.GUIDE_RULES):
        jaxpr = str(jax.make_jaxpr(lambda m, x: m(x))(model, output))
    assert "sharding_constraint" in jaxpr
    assert "spec=P('data', 'model')" in jaxpr  # ('batch', 'hidden') under the guide's rules
    other = (("batch", "data"), ("hidden", None), ("embed", None))
    with jax.set_mesh(auto_mesh), meshplan.logical_axis_rules(other):
        jaxpr = str(jax.make_jaxpr(lambda m, x: m(x))(model, output))
    assert "spec=P('data', 'model')" not in jaxpr
    assert "spec=P('data', None)" in jaxpr


# -- Explicit sharding ----------------------------------------------------------------------


@pytest.mark.slow
def test_explicit_variant_as_the_guide_writes_it(explicit_mesh):
    model, x, y, abs_model = wf.run_explicit(explicit_mesh, DEPTH)
    assert model.layers.dot1.kernel.sharding.spec == P(None, None, "model")
    assert model.layers.w2.sharding.spec == P(None, "model", None)
    assert x.sharding.is_equivalent_to(y.sharding, ndim=2)
    assert abs_model.layers.dot1.kernel.sharding.spec == P(None, None, "model")
    assert abs_model.layers.w2.sharding.spec == P(None, "model", None)


def test_logical_variant_on_an_explicit_mesh(auto_mesh, explicit_mesh):
    model, output = wf.run_logical(explicit_mesh, DEPTH)
    _, auto_output = wf.run_logical(auto_mesh, DEPTH)
    assert output.sharding.spec == P("data", None)
    # on an Explicit mesh the specs are exact (no trailing None dropped)
    assert model.layers.dot1.kernel.sharding.spec == P(None, None, "model")
    assert model.layers.w2.sharding.spec == P(None, "model", None)
    assert auto_output.sharding.is_equivalent_to(output.sharding, ndim=2)
    assert np.allclose(np.asarray(output), np.asarray(auto_output), atol=1e-5)


# -- meshplan demo --nnx ----------------------------------------------------------------------


@pytest.mark.slow
def test_demo_nnx_runs_every_step_of_the_guide():
    env = fresh_env()
    command = ["demo", "--nnx", "--depth", "128", "--layers", "2", "--steps", "3"]
    out = subprocess.run(
        [sys.executable, "-m", "meshplan.cli", *command],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert "FAIL" not in text
    for step in ("single-array", "nnx.Optimizer", "restore onto 4x2", "Logical axes", "Explicit"):
        assert step in text
    assert text.count("ok  ") == 12
    assert "optimizer step 3" in text
    assert "Done in" in text
