"""Models nobody here wrote (Hugging Face Flax GPT-2 and Llama, Equinox, plain JAX), named by
path, planned clean, their named steps traced; Hugging Face's forward pass on an Explicit mesh
refused with the fix. GPT-2's training and resuming onto another mesh is docs/any_model.md's."""

from __future__ import annotations

import jax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshplan
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


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_attention_is_found_with_its_head_dimension(loaded, name):
    """Their hand-written attention's matmuls are the trace's score dots, each of the model's
    head dimension (64 / 4 heads), which a TPU's attention efficiency scales with."""
    from meshplan._search.predict import attention

    model = loaded[name]
    work = meshplan.trace_workload(model.step_fn, model.abstract_state, model.example_batch)
    assert len(work.score_dots) >= 4  # q·kᵀ, p·v and their gradients
    assert {attention.head_dim(d) for d in work.score_dots} == {64 / 4}


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


# GPT-2 trained by `meshplan train --names`, then resumed onto a 4x2 mesh without it and
# restored: docs/any_model.md's blocks, run by tests/test_docs.py (slow).


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    ["dp", "fsdp"],
)
def test_gpt2_memory_and_collective_kinds_are_predicted_as_xla_compiles(loaded, layout):
    """Hugging Face's GPT-2 (its ``wte`` lookup and tied head) through ``predict`` against
    ``measure_step`` on 8 CPU devices, as the XLA suite checks its models: the arguments
    exactly, the temporaries within 20%, the collective kinds equal. Under FSDP the stream
    stays in the table's split through every layer (``attn_output + residual``), and the
    projections' all-reduced outputs are kept whole for the backward pass (0.59 before
    both were priced, 1.02 now)."""
    from meshplan._search.measure.hlo import measure_step
    from meshplan._search.predict.cost import predict
    from xla_suite import AS_ON_ACCELERATORS, CPU_LIKE, LAYOUTS

    model = loaded["gpt2"]
    state, step, batch = model.abstract_state, model.step_fn, model.example_batch
    work = meshplan.trace_workload(step, state, batch, read_constraints=True)
    mesh, rules = LAYOUTS[layout]
    cost = predict(work, mesh, rules, CPU_LIKE)
    xla = measure_step(step, state, batch, mesh, rules, True, AS_ON_ACCELERATORS)
    assert cost.state_bytes + cost.batch_bytes == xla["xla_argument_bytes"]
    assert {k for k, v in cost.comm_bytes.items() if v} == set(xla["collectives"])
    predicted = cost.activation_bytes + cost.temporary_bytes
    assert abs(predicted - xla["xla_temp_bytes"]) <= 0.2 * xla["xla_temp_bytes"]


def test_gpt2_data_parallel_gradients_pay_about_one_latency_per_array_xla_combines(loaded):
    """XLA:CPU reduces Hugging Face GPT-2's data parallel gradients in one all-reduce of
    29 operands; the planner prices a latency for 27 of them (the matmuls' weights, the
    norms' scales and biases; the embedding tables' scatter-added gradients are not
    counted)."""
    import dataclasses

    from meshplan._search.measure.hlo import compile_candidate
    from meshplan._search.predict.cost import predict
    from meshplan._search.predict.profiles import BACKENDS, get_profile

    model = loaded["gpt2"]
    state, step, batch = model.abstract_state, model.step_fn, model.example_batch
    mesh, rules = {"data": 8}, (("batch", "data"),)
    compiled, _, _ = compile_candidate(step, state, batch, mesh, rules)
    reduces = [ln for ln in compiled.as_text().splitlines() if " all-reduce(" in ln]
    assert len(reduces) == 1
    operands = reduces[0].split(" all-reduce(")[0].count("f32[")
    work = meshplan.trace_workload(step, state, batch, read_constraints=True)
    cpu = dataclasses.replace(
        get_profile("h100"), **BACKENDS["cpu"], regather=False, overlap=0.0, hop_latency_s=0.0
    )
    once = predict(work, mesh, rules, cpu)
    each = predict(work, mesh, rules, dataclasses.replace(cpu, array_latency_s=1e-3))
    priced = round((each.comm_s - once.comm_s) / 1e-3) + 1
    assert each.collectives == 1
    assert abs(priced - operands) <= 0.1 * operands, (priced, operands)


@pytest.mark.slow
def test_a_bert_classifiers_fsdp_memory_counts_the_whole_batch_its_class_token_head_keeps():
    """Hugging Face's BERT for sequence classification (its pooler reads the class token),
    named by ``infer_names``, under FSDP: XLA runs both passes on the whole batch split by
    ``embed`` (8.5 MB of temporaries against 3.2 under data parallelism). The planner keeps
    the lookup's split whole through the layers for such a head: 0.74 of XLA's (0.33 when
    the layers' values were sliced back to the batch). The collective kinds are XLA's: the
    pooler's backward output stays in the split (an all-to-all was predicted before)."""
    import jax.numpy as jnp
    import optax
    import transformers as tf
    from flax.training import train_state

    from meshplan._search.predict.infer import name_unnamed
    from xla_suite import against_xla

    cfg = tf.BertConfig(
        vocab_size=1024,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        max_position_embeddings=64,
        num_labels=4,
    )
    model = tf.FlaxBertForSequenceClassification(cfg, seed=0, _do_init=False)
    params = jax.eval_shape(lambda k: model.init_weights(k, (1, 32)), jax.random.key(0))
    tx = optax.adamw(1e-4)
    state = jax.eval_shape(
        lambda p: train_state.TrainState.create(apply_fn=model.__call__, params=p, tx=tx), params
    )

    def loss(p, b):
        logits = model(b["input_ids"], params=p).logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["labels"]).mean()

    def step(s, b):
        return s.apply_gradients(grads=jax.grad(loss)(s.params, b))

    sds = jax.ShapeDtypeStruct
    batch = {"input_ids": sds((16, 32), jnp.int32), "labels": sds((16,), jnp.int32)}
    _, named, named_step, work = name_unnamed(step, state, batch)
    ratio, predicted, compiled = against_xla(work, named_step, named, batch, "fsdp")
    assert 0.7 <= ratio <= 1.2, ratio
    assert predicted == compiled


def test_gpt2s_layernorms_each_hold_two_broadcasts_in_xla_cpus_default_schedule(loaded):
    """Hugging Face's GPT-2 computes Flax's ``LayerNorm``: its ``rsqrt`` times its scale, an
    outer product. The planner finds two held broadcasts for each of its 5 norms; with them
    (the ``cpu`` backend's ``holds_broadcasts``) its data parallel temporaries are 1.00 of
    those of the program ``jax.jit`` runs on CPU (XLA's default schedule, donated), 0.93
    without."""
    import dataclasses

    from meshplan._search.measure.hlo import compile_candidate
    from meshplan._search.predict.cost import predict
    from xla_suite import CPU_LIKE, LAYOUTS

    model = loaded["gpt2"]
    state, step, batch = model.abstract_state, model.step_fn, model.example_batch
    work = meshplan.trace_workload(step, state, batch, read_constraints=True)
    assert sum(work.held_broadcasts.values()) == 2 * 5
    mesh, rules = LAYOUTS["dp"]
    compiled, _, _ = compile_candidate(step, state, batch, mesh, rules, donate=True)
    xla = compiled.memory_analysis().temp_size_in_bytes
    cost = predict(work, mesh, rules, dataclasses.replace(CPU_LIKE, holds_broadcasts=True))
    assert abs(cost.activation_bytes + cost.temporary_bytes - xla) <= 0.2 * xla
