"""Models nobody here wrote (Hugging Face Flax GPT-2 and Llama, Equinox, plain JAX), named by
path, planned, stepped, trained and resumed onto another mesh; Hugging Face's forward pass on
an Explicit mesh refused with the fix."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan.cli import main
from meshplan.cli.factory import load_factory
from meshplan.examples import third_party

pytest.importorskip("transformers")

FSDP_TP = meshplan.layouts.fsdp_tp
MESH = {"data": 2, "model": 4}
FACTORIES = {
    "gpt2": (third_party.GPT2_NAMES, 2 * 12 + 4, "FlaxGPT2LMHeadModel (JAX functions)"),
    "llama": (third_party.LLAMA_NAMES, 2 * 9 + 3, "FlaxLlamaForCausalLM (JAX functions)"),
    "equinox_mlp": (third_party.EQUINOX_NAMES, 4, "equinox_mlp (JAX functions)"),
    "jax_mlp": (third_party.JAX_NAMES, 4, "jax_mlp (JAX functions)"),
}


@pytest.fixture(scope="module")
def loaded():
    return {
        name: load_factory(f"meshplan.examples.third_party:{name}", names)
        for name, (names, _, _) in FACTORIES.items()
    }


@pytest.mark.parametrize("name", FACTORIES)
def test_every_parameter_is_named_and_the_plan_is_clean(loaded, name):
    _, count, what = FACTORIES[name]
    model = loaded[name]
    assert model.what.endswith(what) and model.notes == []  # every pattern used, every array named
    plan = meshplan.explain(model.abstract_state, MESH, FSDP_TP)
    params = [leaf for leaf in plan.leaves if leaf.path.startswith("params/")]
    assert len(params) == count and {leaf.kind for leaf in params} == {"logical"}
    assert [p for p in plan.problems if p.severity == "error"] == []
    assert "no-names" not in {p.code for p in plan.problems}
    # the optimizer's copies carry the names too: nothing large left replicated
    assert plan.totals["all"].max_device_bytes < plan.totals["all"].bytes / 4


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_the_named_step_traces_with_the_model_unchanged(loaded, name):
    model = loaded[name]
    after = jax.eval_shape(model.step_fn, model.abstract_state, model.example_batch)
    before = jax.tree.map(lambda x: (x.shape, x.dtype), meshplan.unbox(model.abstract_state))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), meshplan.unbox(after)) == before


def test_hugging_face_on_an_explicit_mesh_is_refused_naming_the_call_and_auto_axes(loaded):
    model = loaded["gpt2"]
    loss = model.trainable.model.loss
    params = meshplan.unbox(model.abstract_state).params
    batch = model.example_batch
    for kind in (AxisType.Explicit, AxisType.Auto):
        mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(kind,) * 2)
        sharding = jax.NamedSharding(mesh, P("data"))
        batch_here = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in batch)
        with jax.set_mesh(mesh):
            if kind == AxisType.Explicit:
                with pytest.raises(
                    meshplan.MeshError, match=r"FlaxGPT2LMHeadModel.__call__\)"
                ) as e:
                    jax.eval_shape(loss, params, batch_here)
                assert e.value.problems[0].code == "explicit-mesh"
                assert "Explicit axes ('data', 'model')" in str(e.value)
                assert "axis_types=(jax.sharding.AxisType.Auto,)" in str(e.value)
            else:  # the same call on Auto axes: it runs
                assert jax.eval_shape(loss, params, batch_here).shape == ()


@pytest.mark.slow
def test_gpt2_from_a_config_trained_and_resumed_on_another_mesh(tmp_path, capsys):
    names = tmp_path / "gpt2_names.json"
    names.write_text(json.dumps([[p, list(n)] for p, n in third_party.GPT2_NAMES]))
    folder, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    base = ["train", "--model", "meshplan.examples.third_party:gpt2", "--eval-every", "0",
            "--eval-batches", "1", "--ckpt-dir", str(folder), "--metrics", str(metrics)]  # fmt: skip
    assert main([*base, "--names", str(names), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "FlaxGPT2LMHeadModel (JAX functions)" in out and "layout fsdp_tp" in out
    assert main([*base, "--resume", "--mesh", "4x2", "--steps", "3"]) == 0
    captured = capsys.readouterr()
    assert "resuming from step 2" in captured.out and "carries a logical name" not in captured.err
    losses = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in losses if "loss" in r] == [1, 2, 3]
    assert all(np.isfinite(r["loss"]) for r in losses if "loss" in r)
    mesh = meshplan.train.device_mesh.make_mesh({"data": 4, "model": 2})
    state, metadata = meshplan.restore(folder, mesh, FSDP_TP)
    assert metadata.step == 3
    fc = state["params"]["transformer"]["h"]["1"]["mlp"]["c_fc"]["kernel"]
    assert fc.names == ("mlp", "embed") and fc.value.sharding.spec == P("model", "data")
    assert bool(jnp.isfinite(fc.value).all())
