"""Hugging Face Flax models meshplan was never tuned on: named, searched, and priced against XLA.

Each model is built from a tiny config (2 layers, hidden 128, vocab 1024, sequence 32,
batch 16; abstract weights, nothing downloaded) with an AdamW train step and its standard
loss (optax's integer-label cross-entropy; CLIP's contrastive loss). For each:
:func:`meshplan.infer_names` names it, :func:`meshplan.search_rules` searches it
(``profile='cpu'``, analytic), and under data parallel, FSDP and tensor parallel 2 x 4
(``tests/xla_suite.py``'s layouts), and under the search's top-1, the planner's temporaries
per device (CPU-like profile) are compared with ``compiled.memory_analysis()`` on 8 emulated
CPU devices, and its collective kinds with the compiled HLO's, as
``tests/search/test_xla_suite.py`` does.

    .venv/bin/python benchmarks/bench_hf_models.py                  # every model
    .venv/bin/python benchmarks/bench_hf_models.py --models bert t5 --names

``--time`` prices and times instead: at a larger size (batch 64, sequence 64, hidden 256,
8 heads, MLP 1024), each model's step under data parallelism and tensor parallelism on
2 x 4 and 4 x 2 meshes (the rules of ``tests/xla_suite.py``'s ``tp``), predicted with the
calibrated ``cpu`` profile and timed interleaved (``--rounds`` turns of 6 steps, the first
of a turn dropped; medians), with the two meshes' ratio predicted and measured (which of
the two a search would rank first, and by how much; docs/benchmarks.md, "Session 22"):

    .venv/bin/python benchmarks/bench_hf_models.py --time --models gpt-neo bert --rounds 3

``--time --collectives`` also traces each mesh's step (``jax.profiler``) and prints every
collective's measured milliseconds per device and step (the wait for the group's slowest
device included) beside the ``cpu`` profile's price, then each one's wait for its group's
last thread and the rest (``bench_xla_suite_profile.py``'s tables, ``--arrivals``'s too):

    .venv/bin/python benchmarks/bench_hf_models.py --time --collectives --models opt --rounds 3

``--schedules`` compares, at ``--time``'s sizes and data parallel, the ``cpu`` profile's
temporaries (activations and temporaries a device) with XLA's in the donated step under
its two schedules: the default one, which every ``jax.jit`` on CPU runs (and ``--time``
times), and the memory-optimised one the table above compiles (docs/benchmarks.md,
"Session 24"):

    .venv/bin/python benchmarks/bench_hf_models.py --schedules --models gpt-neo bert
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

import argparse
import statistics
import types
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
import transformers as tf
from flax.training import train_state

import meshplan
from meshplan._search.measure.hlo import measure_step
from meshplan._search.measure.timing import prepare_step
from meshplan._search.predict.cost import predict
from meshplan._search.predict.infer import name_unnamed
from meshplan._search.predict.profiles import get_profile
from xla_suite import AS_ON_ACCELERATORS, CPU_LIKE, LAYOUTS

B, S, V, D, H, F = 16, 32, 1024, 128, 4, 256
SDS = jax.ShapeDtypeStruct
Built = tuple[Any, Callable[[Any, Any], Any], Any]


def _xent(logits: Any, labels: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def _trained(model: Any, loss: Callable[[Any, Any], Any], batch: Any) -> Built:
    """The abstract AdamW state of ``model``, its train step on ``loss``, the batch."""
    params = jax.eval_shape(lambda k: model.init_weights(k, model.input_shape), jax.random.key(0))

    def init(p: Any) -> Any:
        return train_state.TrainState.create(
            apply_fn=model.__call__, params=p, tx=optax.adamw(1e-4)
        )

    def step(state: Any, b: Any) -> Any:
        return state.apply_gradients(grads=jax.grad(loss)(state.params, b))

    return jax.eval_shape(init, params), step, batch


def _masked_lm(cls: Any, cfg: Any) -> Built:
    m = cls(cfg, seed=0, _do_init=False)
    ids = SDS((B, S), jnp.int32)
    return _trained(
        m,
        lambda p, b: _xent(m(b["input_ids"], params=p).logits, b["labels"]),
        {"input_ids": ids, "labels": ids},
    )


def _classified(cls: Any, cfg: Any) -> Built:
    """A sequence classifier: its head reads the class token's position (BERT's pooler)."""
    m = cls(cfg, seed=0, _do_init=False)
    batch = {"input_ids": SDS((B, S), jnp.int32), "labels": SDS((B,), jnp.int32)}
    return _trained(m, lambda p, b: _xent(m(b["input_ids"], params=p).logits, b["labels"]), batch)


def _causal_lm(cls: Any, cfg: Any) -> Built:
    m = cls(cfg, seed=0, _do_init=False)
    return _trained(
        m, lambda p, t: _xent(m(t, params=p).logits[:, :-1], t[:, 1:]), SDS((B, S), jnp.int32)
    )


def _seq2seq(cls: Any, cfg: Any, inputs: Any = None) -> Built:
    m = cls(cfg, seed=0, _do_init=False)

    def loss(p: Any, b: Any) -> Any:
        out = m(b["inputs"], decoder_input_ids=b["decoder_input_ids"], params=p)
        return _xent(out.logits, b["labels"])

    ids = SDS((B, S), jnp.int32)
    batch = {"inputs": ids if inputs is None else inputs, "decoder_input_ids": ids, "labels": ids}
    return _trained(m, loss, batch)


def _images(cls: Any, cfg: Any) -> Built:
    m = cls(cfg, seed=0, _do_init=False)
    batch = {"pixels": SDS((B, 3, 32, 32), jnp.float32), "labels": SDS((B,), jnp.int32)}
    return _trained(m, lambda p, b: _xent(m(b["pixels"], params=p).logits, b["labels"]), batch)


def _t5_clip_shim() -> None:
    """transformers 4.49's Flax T5 calls ``jnp.clip(a_max=...)``, which JAX 0.10 removed."""
    import transformers.models.t5.modeling_flax_t5 as t5

    ns = types.SimpleNamespace(**{k: getattr(jnp, k) for k in dir(jnp) if not k.startswith("__")})
    ns.clip = lambda x, a_min=None, a_max=None, **k: jnp.clip(x, min=a_min, max=a_max, **k)
    t5.jnp = ns


def _t5() -> Built:
    _t5_clip_shim()
    cfg = tf.T5Config(vocab_size=V, d_model=D, d_kv=32, d_ff=F, num_layers=2, num_heads=H)
    return _seq2seq(tf.FlaxT5ForConditionalGeneration, cfg)


def _clip() -> Built:
    text = dict(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        intermediate_size=F,
        max_position_embeddings=S,
    )
    vision = dict(
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        intermediate_size=F,
        image_size=32,
        patch_size=4,
    )
    m = tf.FlaxCLIPModel(
        tf.CLIPConfig(text_config=text, vision_config=vision, projection_dim=64),
        seed=0,
        _do_init=False,
    )

    def loss(p: Any, b: Any) -> Any:
        out = m(b["input_ids"], b["pixels"], params=p)
        same = jnp.arange(out.logits_per_text.shape[0])
        return (_xent(out.logits_per_text, same) + _xent(out.logits_per_image, same)) / 2

    batch = {"input_ids": SDS((B, S), jnp.int32), "pixels": SDS((B, 3, 32, 32), jnp.float32)}
    return _trained(m, loss, batch)


def _resnet() -> Built:
    """BatchNorm's statistics are state the step updates, beside AdamW's."""
    cfg = tf.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=16
    )
    m = tf.FlaxResNetForImageClassification(cfg, seed=0, _do_init=False)
    variables = jax.eval_shape(lambda k: m.init_weights(k, (1, 32, 32, 3)), jax.random.key(0))
    tx = optax.adamw(1e-4)

    def step(s: Any, b: Any) -> Any:
        def loss(p: Any) -> Any:
            variables = {"params": p, "batch_stats": s["batch_stats"]}
            out, new = m(b["pixels"], params=variables, train=True)
            return _xent(out.logits, b["labels"]), new["batch_stats"]

        grads, stats = jax.grad(loss, has_aux=True)(s["params"])
        updates, opt = tx.update(grads, s["opt"], s["params"])
        return {
            "params": optax.apply_updates(s["params"], updates),
            "batch_stats": stats,
            "opt": opt,
        }

    state = {
        "params": variables["params"],
        "batch_stats": variables["batch_stats"],
        "opt": jax.eval_shape(tx.init, variables["params"]),
    }
    batch = {"pixels": SDS((B, 3, 32, 32), jnp.float32), "labels": SDS((B,), jnp.int32)}
    return state, step, batch


def _layers(**more: Any) -> dict[str, Any]:
    """A config's sizes, as most Hugging Face configs spell them."""
    return dict(vocab_size=V, hidden_size=D, num_attention_heads=H, intermediate_size=F) | more


def _encoder_decoder(**more: Any) -> dict[str, Any]:
    """An encoder-decoder config's sizes (BART's, Whisper's spelling)."""
    heads_and_mlp = dict(
        encoder_attention_heads=H,
        decoder_attention_heads=H,
        encoder_ffn_dim=F,
        decoder_ffn_dim=F,
    )
    return dict(vocab_size=V, d_model=D, encoder_layers=2, decoder_layers=2) | heads_and_mlp | more


MODELS: dict[str, Callable[[], Built]] = {
    "bert": lambda: _masked_lm(
        tf.FlaxBertForMaskedLM,
        tf.BertConfig(**_layers(num_hidden_layers=2, max_position_embeddings=64)),
    ),
    "bert-cls": lambda: _classified(
        tf.FlaxBertForSequenceClassification,
        tf.BertConfig(**_layers(num_hidden_layers=2, max_position_embeddings=64, num_labels=4)),
    ),
    "roberta": lambda: _masked_lm(
        tf.FlaxRobertaForMaskedLM,
        tf.RobertaConfig(**_layers(num_hidden_layers=2, max_position_embeddings=66)),
    ),
    "distilbert": lambda: _masked_lm(
        tf.FlaxDistilBertForMaskedLM,
        tf.DistilBertConfig(
            vocab_size=V, dim=D, n_layers=2, n_heads=H, hidden_dim=F, max_position_embeddings=64
        ),
    ),
    "t5": _t5,
    "bart": lambda: _seq2seq(
        tf.FlaxBartForConditionalGeneration,
        tf.BartConfig(**_encoder_decoder(max_position_embeddings=64)),
    ),
    "vit": lambda: _images(
        tf.FlaxViTForImageClassification,
        tf.ViTConfig(
            **_layers(num_hidden_layers=2, image_size=32, patch_size=4, num_labels=16),
        ),
    ),
    "clip": _clip,
    "gpt-neo": lambda: _causal_lm(
        tf.FlaxGPTNeoForCausalLM,
        tf.GPTNeoConfig(
            vocab_size=V,
            hidden_size=D,
            num_layers=2,
            num_heads=H,
            intermediate_size=F,
            max_position_embeddings=64,
            attention_types=[[["global", "local"], 1]],
            window_size=16,
        ),
    ),
    "opt": lambda: _causal_lm(
        tf.FlaxOPTForCausalLM,
        tf.OPTConfig(
            vocab_size=V,
            hidden_size=D,
            num_hidden_layers=2,
            num_attention_heads=H,
            ffn_dim=F,
            max_position_embeddings=64,
            word_embed_proj_dim=D,
        ),
    ),
    "bloom": lambda: _causal_lm(
        tf.FlaxBloomForCausalLM, tf.BloomConfig(vocab_size=V, hidden_size=D, n_layer=2, n_head=H)
    ),
    "mistral": lambda: _causal_lm(
        tf.FlaxMistralForCausalLM,
        tf.MistralConfig(
            **_layers(num_hidden_layers=2, num_key_value_heads=2, max_position_embeddings=64),
            sliding_window=16,
        ),
    ),
    "gemma": lambda: _causal_lm(
        tf.FlaxGemmaForCausalLM,
        tf.GemmaConfig(
            **_layers(num_hidden_layers=2, num_key_value_heads=1, head_dim=32),
            max_position_embeddings=64,
        ),
    ),
    "resnet": _resnet,
    "whisper": lambda: _seq2seq(
        tf.FlaxWhisperForConditionalGeneration,
        tf.WhisperConfig(
            **_encoder_decoder(num_mel_bins=16, max_source_positions=32, max_target_positions=64)
        ),
        SDS((B, 16, 64), jnp.float32),
    ),
}
"""Each model's ``(abstract state, train step, batch)``, built from a tiny config."""


def _against_xla(
    step: Any, named: Any, batch: Any, work: Any, layout: str | tuple[dict[str, int], Any]
) -> str:
    """``ratio (predicted/XLA MiB) kinds`` of one layout (a name in ``LAYOUTS``, or a mesh and
    its rules): the temporaries' ratio, the arguments' check (``args!`` where they differ)
    and the collective kinds'."""
    mesh, rules = LAYOUTS[layout] if isinstance(layout, str) else layout
    cost = predict(work, mesh, rules, CPU_LIKE)
    xla = measure_step(step, named, batch, mesh, rules, True, AS_ON_ACCELERATORS)
    predicted = cost.activation_bytes + cost.temporary_bytes
    temp = xla["xla_temp_bytes"]
    args = "" if cost.state_bytes + cost.batch_bytes == xla["xla_argument_bytes"] else " args!"
    kinds = {k for k, v in cost.comm_bytes.items() if v}
    same = (
        "="
        if kinds == set(xla["collectives"])
        else f" {sorted(kinds)} vs {sorted(xla['collectives'])}"
    )
    return f"{predicted / temp:.2f} ({predicted / 2**20:.2f}/{temp / 2**20:.2f}){args}{same}"


def top1_against_xla(result: Any, step: Any, named: Any, batch: Any, work: Any) -> str:
    """The search's analytic top-1 (its mesh and rules), then its cell as a layout's."""
    best = result.best
    cell = _against_xla(step, named, batch, work, (best.mesh, best.rules))
    return f"{best.mesh_text} {best.axes_text} {best.short_rules}: {cell}"


def _row(name: str, show_names: bool) -> str:
    state, step, batch = MODELS[name]()
    inferred = meshplan.infer_names(step, state, batch)
    if show_names:
        print(inferred.text(), "\n")
    result = meshplan.search_rules(8, state, step, batch, profile="cpu", compile_top=0)
    unpriced = ", ".join(result.best.cost.unpriced) or "none"
    _, named, named_step, work = name_unnamed(step, state, batch)
    found = sorted({c.name for c in inferred.classes} & {"vocab", "embed", "heads", "mlp"})
    cells = [_against_xla(named_step, named, batch, work, layout) for layout in LAYOUTS]
    top1 = top1_against_xla(result, named_step, named, batch, work)
    return " | ".join([name, ",".join(found), unpriced, *cells, top1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--names", action="store_true", help="print each model's inferred names")
    parser.add_argument("--time", action="store_true", help="predicted and measured steps")
    parser.add_argument("--rounds", type=int, default=7, help="--time's interleaved rounds")
    parser.add_argument("--collectives", action="store_true", help="--time: each one, traced")
    parser.add_argument(
        "--schedules", action="store_true", help="temporaries under XLA:CPU's two schedules"
    )
    args = parser.parse_args()
    if args.collectives and not args.time:
        parser.error("--collectives traces the steps --time runs: pass --time too.")
    if args.time:
        return time_meshes(args.models, args.rounds, args.collectives)
    if args.schedules:
        return schedules(args.models)
    print_table("model | names found | unpriced", args.models, lambda n: _row(n, args.names))


def time_meshes(names: list[str], rounds: int, collectives: bool = False) -> None:
    """Each model's step predicted (calibrated ``cpu`` profile) and timed (medians of
    ``rounds`` interleaved turns) under data parallelism and tensor parallelism on 2 x 4
    and 4 x 2, at larger sizes (steps of 0.1-0.7 s on 8 CPU devices); with
    ``collectives``, each mesh's collectives traced, measured against their prices."""
    global B, S, D, H, F  # the builders read the module's sizes when called
    B, S, D, H, F = 64, 64, 256, 8, 1024
    profile = get_profile("cpu", 8)
    _, tp = LAYOUTS["tp"]
    meshes = {"dp": LAYOUTS["dp"], "2x4": ({"data": 2, "tensor": 4}, tp)}
    meshes["4x2"] = ({"data": 4, "tensor": 2}, tp)
    print("model       " + "".join(f"{k:>5} predicted, measured ms " for k in meshes), end="")
    print("  2x4 / 4x2: predicted, measured")
    for name in names:
        state, step, batch = MODELS[name]()
        _, named, named_step, work = name_unnamed(step, state, batch)
        predicted = {k: predict(work, m, r, profile).step_s for k, (m, r) in meshes.items()}
        ready = {k: prepare_step(named_step, named, batch, m, r) for k, (m, r) in meshes.items()}
        walls: dict[str, list[float]] = {k: [] for k in meshes}
        for _ in range(rounds):  # interleaved: each round runs every mesh once
            for k, p in ready.items():
                walls[k] += [t.wall_s for t in p.run_timed(6)[1:]]
        measured = {k: statistics.median(v) for k, v in walls.items()}
        cells = "".join(f"{1e3 * predicted[k]:16.1f} {1e3 * measured[k]:11.1f}" for k in meshes)
        pair = predicted["2x4"] / predicted["4x2"], measured["2x4"] / measured["4x2"]
        print(f"{name:11}{cells}  {pair[0]:10.2f} {pair[1]:9.2f}", flush=True)
        for k, p in ready.items() if collectives else ():
            print(f"  {name} {k}:")
            _traced_collectives(p, profile)


def schedules(names: list[str]) -> None:
    """Each model's temporaries a device at ``--time``'s sizes, data parallel, donated
    (MiB): the ``cpu`` profile's, and XLA's under its default and memory-optimised
    schedules, with the profile's over each."""
    global B, S, D, H, F  # the builders read the module's sizes when called
    B, S, D, H, F = 64, 64, 256, 8, 1024
    profile = get_profile("cpu", 8)
    mesh, rules = LAYOUTS["dp"]
    print("model       planner  XLA default  XLA memory-optimised  (MiB; planner / XLA)")
    for name in names:
        state, step, batch = MODELS[name]()
        _, named, named_step, work = name_unnamed(step, state, batch)
        cost = predict(work, mesh, rules, profile)
        mine = (cost.activation_bytes + cost.temporary_bytes) / 2**20
        default, optimised = (
            measure_step(named_step, named, batch, mesh, rules, True, options)["xla_temp_bytes"]
            / 2**20
            for options in (None, AS_ON_ACCELERATORS)
        )
        print(
            f"{name:11}{mine:8.1f} {default:8.1f} ({mine / default:.2f})"
            f" {optimised:10.1f} ({mine / optimised:.2f})",
            flush=True,
        )


def _traced_collectives(prepared: Any, profile: Any, steps: int = 3) -> None:
    """``prepared``'s collectives, traced over ``steps`` steps, beside their prices."""
    import tempfile

    from bench_xla_suite_profile import _print_arrivals, _print_collectives, arrivals, op_times

    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
        prepared.run(steps)
        jax.profiler.stop_trace()
        times = op_times(trace_dir, steps)
        waited = arrivals(trace_dir)
    _print_collectives(times, prepared.compiled.as_text(), profile)
    _print_arrivals(waited)


def print_table(columns: str, names: list[str], row: Callable[[str], str]) -> None:
    """The table's header (``columns``, then the layouts) and each model's ``row``; a
    crash is a row of the table."""
    print(
        f"{columns} | "
        + " | ".join([*LAYOUTS, "search top-1"])
        + "  (predicted/XLA temporaries, MiB; '=': collective kinds match)"
    )
    for name in names:
        try:
            print(row(name), flush=True)
        except Exception as e:
            print(f"{name} | CRASH {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
