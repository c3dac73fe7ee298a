"""A suite of small Flax models written for checking the planner against XLA, not tuned against.

Each is plain Flax Linen as its author would write it, with logical names where a meshplan
user puts them (on the parameters, from the Transformer vocabulary: ``batch``, ``embed``,
``heads``, ``kv``, ``mlp``, ``vocab``, ``layer``) and nothing of meshplan inside: a ViT, a
Conv + GroupNorm CNN, an encoder-decoder, a ``top_k`` mixture of experts, a decoder with
``jnp.take`` embeddings, ``jax.nn.dot_product_attention`` and optax's integer-label loss, a
scanned rematerialised stack and a tanh-GELU MLP with LayerNorm biases. Each case names the
kinds of miss of issue 34 it covers (:data:`MISSES`) and the layouts it is checked under.

Shared by ``tests/search/test_xla_suite.py`` (the planner's memory and collective kinds
against ``compiled.memory_analysis()`` and the compiled HLO on 8 CPU devices, under
:data:`AS_ON_ACCELERATORS` and :data:`CPU_LIKE`, also used by ``tests/search/test_memory.py``)
and ``benchmarks/bench_xla_suite.py`` (the analytic top-1 against the built-in layouts, at
``scale``: the models widened and deepened to steps of tens of milliseconds).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import meshplan
from meshplan._search.predict.profiles import get_profile
from meshplan._search.predict.step import linen_step

# The step is compiled as accelerators run it: its state donated (as meshplan's trainer runs
# it: the new state takes the old one's buffers, so no intermediate sits in an output buffer
# that memory_analysis() would not count), and scheduled for memory, as XLA schedules for a
# device's memory limit on TPU and GPU (on CPU its default scheduler favours concurrency and
# keeps every unrolled layer's buffers alive at once).
AS_ON_ACCELERATORS = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}

# XLA on CPU has no fused attention kernel (the scores are materialised), and no memory
# limit to rematerialise cheap values against (every residual autodiff saves is kept); its
# all-reduce combiner merges an unrolled layer's rematerialised partial-sum all-reduce with
# the forward's own, so that recomputation runs in the forward; it does not reduce-scatter
# (an FSDP gradient's partial sums are all-reduced whole, then sliced), and it combines
# every gradient's all-reduce into one (one all-reduce in the compiled 16-layer step, 66 MiB):
# all of them held unreduced until it runs, its result a buffer beside them. A weight FSDP
# gathers for the forward pass is not gathered again for the backward: the forward's gather
# is kept until the backward reads it (an MLP-Mixer's, one f32[128,256] gather per block).
CPU_LIKE = dataclasses.replace(
    get_profile("h100"),
    fused_attention=False,
    rematerialize=False,
    combines_remat_collectives=True,
    reduce_scatter=False,
    combine_bytes=1 << 30,
    late_gradients=True,
    regather=False,
)

LAYOUTS: dict[str, tuple[dict[str, int], tuple[tuple[str, Any], ...]]] = {
    "dp": ({"data": 8}, (("batch", "data"),)),
    "fsdp": ({"fsdp": 8}, (("batch", "fsdp"), ("embed", "fsdp"))),
    "tp": (
        {"data": 2, "tensor": 4},
        (
            ("batch", "data"),
            ("heads", "tensor"),
            ("kv_heads", "tensor"),
            ("mlp", "tensor"),
            ("vocab", "tensor"),
        ),
    ),
}
"""Mesh and rules by layout: data parallel, FSDP over 8, tensor parallel 2 x 4."""

MISSES = {
    "elementwise": "elementwise intermediates XLA keeps (tanh-GELU, GroupNorm's reshapes)",
    "combined-grads": "gradients held for XLA:CPU's one combined all-reduce",
    "fsdp-kept": "FSDP weights gathered in the forward kept for the backward",
    "embed-all-to-all": "all-to-alls of an embedding lookup whose table is split on embed",
    "pool-reshard": "a mean-pool's backward resharding to the batch",
    "router-gather": "all-gathers of the router probabilities before top_k",
    "loss-end": "the integer-label loss end",
}
"""The kinds of miss of issue 34, by key (each covered by some case of :data:`SUITE`)."""


def _init(names: tuple[str | None, ...], init: Any = None) -> Any:
    return meshplan.with_logical_partitioning(init or nn.initializers.lecun_normal(), names)


def _norm(names: tuple[str | None, ...]) -> dict[str, Any]:
    """A norm's scale and bias, named."""
    return {
        "scale_init": _init(names, nn.initializers.ones),
        "bias_init": _init(names, nn.initializers.zeros),
    }


class Attention(nn.Module):
    """Multi-head attention written out: ``DenseGeneral`` projections, an einsum softmax."""

    heads: int
    head_dim: int
    causal: bool = False

    @nn.compact
    def __call__(self, x: Any, context: Any = None) -> Any:
        context = x if context is None else context
        h, d = self.heads, self.head_dim

        def proj(name: str) -> nn.DenseGeneral:
            return nn.DenseGeneral(
                (h, d),
                kernel_init=_init(("embed", "heads", "kv")),
                bias_init=_init(("heads", "kv"), nn.initializers.zeros),
                name=name,
            )

        q, k, v = proj("query")(x), proj("key")(context), proj("value")(context)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        if self.causal:
            mask = jnp.tril(jnp.ones((x.shape[1], context.shape[1]), bool))
            scores = jnp.where(mask, scores, -1e9)
        out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores), v)
        return nn.DenseGeneral(
            x.shape[-1],
            axis=(-2, -1),
            kernel_init=_init(("heads", "kv", "embed")),
            bias_init=_init(("embed",), nn.initializers.zeros),
            name="out",
        )(out)


class Mlp(nn.Module):
    """Dense, tanh-approximated GELU, Dense; biases on both."""

    hidden: int

    @nn.compact
    def __call__(self, x: Any) -> Any:
        h = nn.Dense(
            self.hidden,
            kernel_init=_init(("embed", "mlp")),
            bias_init=_init(("mlp",), nn.initializers.zeros),
        )(x)
        h = nn.gelu(h, approximate=True)
        return nn.Dense(
            x.shape[-1],
            kernel_init=_init(("mlp", "embed")),
            bias_init=_init(("embed",), nn.initializers.zeros),
        )(h)


class EncoderBlock(nn.Module):
    """Pre-norm self-attention and MLP (LayerNorm with scale and bias)."""

    heads: int
    mlp: int
    causal: bool = False

    @nn.compact
    def __call__(self, x: Any) -> Any:
        d = x.shape[-1]
        x = x + Attention(self.heads, d // self.heads, self.causal)(
            nn.LayerNorm(**_norm(("embed",)))(x)
        )
        return x + Mlp(self.mlp)(nn.LayerNorm(**_norm(("embed",)))(x))


class ViT(nn.Module):
    """Patches by a strided convolution, a learned position embedding, encoder blocks,
    a mean-pool over patches and a linear head."""

    embed: int = 64
    heads: int = 4
    mlp: int = 128
    layers: int = 2
    patch: int = 4
    classes: int = 16

    @nn.compact
    def __call__(self, images: Any) -> Any:
        p = self.patch
        x = nn.Conv(
            self.embed,
            (p, p),
            strides=(p, p),
            padding="VALID",
            kernel_init=_init((None, None, None, "embed")),
        )(images)
        b, hh, ww, d = x.shape
        x = x.reshape(b, hh * ww, d)
        x = x + self.param(
            "pos", _init((None, "embed"), nn.initializers.normal(0.02)), (hh * ww, d)
        )
        for _ in range(self.layers):
            x = EncoderBlock(self.heads, self.mlp)(x)
        x = nn.LayerNorm(**_norm(("embed",)))(x).mean(axis=1)
        return nn.Dense(self.classes, kernel_init=_init(("embed", None)))(x)


class CNN(nn.Module):
    """Conv, GroupNorm, ReLU stages (the last two strided), a mean-pool and a linear head."""

    features: tuple[int, ...] = (32, 32, 64)
    groups: int = 8
    classes: int = 16

    @nn.compact
    def __call__(self, images: Any) -> Any:
        x, channels = images, None  # the input's channels: RGB, unnamed
        for i, f in enumerate(self.features):
            out = "mlp" if channels == "embed" else "embed"  # alternating, as in an MLP
            x = nn.Conv(
                f,
                (3, 3),
                strides=(1, 1) if i == 0 else (2, 2),
                use_bias=False,
                kernel_init=_init((None, None, channels, out)),
            )(x)
            x = nn.relu(nn.GroupNorm(self.groups, **_norm((out,)))(x))
            channels = out
        x = x.mean(axis=(1, 2))
        return nn.Dense(self.classes, kernel_init=_init((channels, None)))(x)


class EncoderDecoder(nn.Module):
    """A shared embedding, an encoder, a decoder with causal self-attention and
    cross-attention to the encoder's output, an untied output projection."""

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    mlp: int = 128
    layers: int = 1

    @nn.compact
    def __call__(self, batch: dict[str, Any]) -> Any:
        emb = nn.Embed(
            self.vocab,
            self.embed,
            embedding_init=_init(("vocab", "embed"), nn.initializers.normal(0.02)),
        )
        memory = emb(batch["source"])
        for _ in range(self.layers):
            memory = EncoderBlock(self.heads, self.mlp)(memory)
        memory = nn.LayerNorm(**_norm(("embed",)))(memory)
        x = emb(batch["target"])
        for _ in range(self.layers):
            x = x + Attention(self.heads, self.embed // self.heads, causal=True)(
                nn.LayerNorm(**_norm(("embed",)))(x)
            )
            x = x + Attention(self.heads, self.embed // self.heads)(
                nn.LayerNorm(**_norm(("embed",)))(x), memory
            )
            x = x + Mlp(self.mlp)(nn.LayerNorm(**_norm(("embed",)))(x))
        x = nn.LayerNorm(**_norm(("embed",)))(x)
        return nn.Dense(self.vocab, use_bias=False, kernel_init=_init(("embed", "vocab")))(x)


class TopKMoE(nn.Module):
    """A mixture of experts with a softmax router and ``lax.top_k`` routing: every expert
    runs densely on every token, its output weighted by the renormalised top-k gates."""

    experts: int = 4
    k: int = 2
    mlp: int = 128

    @nn.compact
    def __call__(self, x: Any) -> Any:
        d, e = x.shape[-1], self.experts
        probs = jax.nn.softmax(
            nn.Dense(e, use_bias=False, kernel_init=_init(("embed", None)), name="router")(x)
        )
        gate, index = jax.lax.top_k(probs, self.k)
        gate = gate / gate.sum(-1, keepdims=True)
        combine = jnp.einsum("...k,...ke->...e", gate, jax.nn.one_hot(index, e, dtype=x.dtype))
        w_in = self.param("w_in", _init(("expert", "embed", "mlp")), (e, d, self.mlp))
        w_out = self.param("w_out", _init(("expert", "mlp", "embed")), (e, self.mlp, d))
        h = nn.gelu(jnp.einsum("bsd,edm->bsem", x, w_in), approximate=False)
        return jnp.einsum("bsem,emd,bse->bsd", h, w_out, combine)


class MoEModel(nn.Module):
    """Embedding, blocks of self-attention and a top-k MoE, an output projection."""

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    layers: int = 1
    experts: int = 4
    mlp: int = 128

    @nn.compact
    def __call__(self, tokens: Any) -> Any:
        x = nn.Embed(
            self.vocab,
            self.embed,
            embedding_init=_init(("vocab", "embed"), nn.initializers.normal(0.02)),
        )(tokens)
        for _ in range(self.layers):
            x = x + Attention(self.heads, self.embed // self.heads, causal=True)(
                nn.LayerNorm(**_norm(("embed",)))(x)
            )
            x = x + TopKMoE(self.experts, mlp=self.mlp)(nn.LayerNorm(**_norm(("embed",)))(x))
        return nn.Dense(self.vocab, use_bias=False, kernel_init=_init(("embed", "vocab")))(x)


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        scale = self.param("scale", _init(("embed",), nn.initializers.ones), x.shape[-1:])
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


class DecoderBlock(nn.Module):
    """RMS norm, q/k/v as ``DenseGeneral`` into ``jax.nn.dot_product_attention``
    (``is_causal=True``), a SiLU-gated MLP."""

    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x: Any) -> Any:
        d = x.shape[-1]
        hd = d // self.heads

        def proj(name: str) -> nn.DenseGeneral:
            return nn.DenseGeneral(
                (self.heads, hd),
                use_bias=False,
                name=name,
                kernel_init=_init(("embed", "heads", "kv")),
            )

        h = RMSNorm()(x)
        att = jax.nn.dot_product_attention(proj("q")(h), proj("k")(h), proj("v")(h), is_causal=True)
        x = x + nn.DenseGeneral(
            d, axis=(-2, -1), use_bias=False, kernel_init=_init(("heads", "kv", "embed"))
        )(att)
        h = RMSNorm()(x)
        gate = nn.Dense(self.mlp, use_bias=False, kernel_init=_init(("embed", "mlp")))(h)
        up = nn.Dense(self.mlp, use_bias=False, kernel_init=_init(("embed", "mlp")))(h)
        return x + nn.Dense(d, use_bias=False, kernel_init=_init(("mlp", "embed")))(
            jax.nn.silu(gate) * up
        )


class TakeDecoder(nn.Module):
    """A decoder whose embedding is a table read with ``jnp.take`` (and its transpose the
    output projection)."""

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    mlp: int = 128
    layers: int = 2

    @nn.compact
    def __call__(self, tokens: Any) -> Any:
        table = self.param(
            "embedding",
            _init(("vocab", "embed"), nn.initializers.normal(0.02)),
            (self.vocab, self.embed),
        )
        x = jnp.take(table, tokens, axis=0)
        for _ in range(self.layers):
            x = DecoderBlock(self.heads, self.mlp)(x)
        return RMSNorm()(x) @ table.T


class _ScanBlock(nn.Module):
    heads: int
    mlp: int

    @nn.compact
    def __call__(self, x: Any, _: Any) -> tuple[Any, None]:
        return EncoderBlock(self.heads, self.mlp, causal=True)(x), None


class ScannedStack(nn.Module):
    """An embedding, ``nn.scan(nn.remat(Block))`` over the layers (the stacked parameters'
    leading dimension named ``layer``), an output projection."""

    vocab: int = 256
    embed: int = 64
    heads: int = 4
    mlp: int = 128
    layers: int = 4

    @nn.compact
    def __call__(self, tokens: Any) -> Any:
        x = nn.Embed(
            self.vocab,
            self.embed,
            embedding_init=_init(("vocab", "embed"), nn.initializers.normal(0.02)),
        )(tokens)
        stack = nn.scan(
            nn.remat(_ScanBlock),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=self.layers,
            metadata_params={nn.PARTITION_NAME: "layer"},
        )
        x, _ = stack(self.heads, self.mlp)(x, None)
        x = nn.LayerNorm(**_norm(("embed",)))(x)
        return nn.Dense(self.vocab, use_bias=False, kernel_init=_init(("embed", "vocab")))(x)


class GeluMlp(nn.Module):
    """Dense layers with biases, each followed by a LayerNorm (scale and bias) and a
    tanh-approximated GELU; a linear head."""

    embed: int = 64
    mlp: int = 256
    layers: int = 2
    classes: int = 16

    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = nn.Dense(
            self.embed,
            kernel_init=_init((None, "embed")),
            bias_init=_init(("embed",), nn.initializers.zeros),
        )(x)
        for _ in range(self.layers):
            h = nn.Dense(
                self.mlp,
                kernel_init=_init(("embed", "mlp")),
                bias_init=_init(("mlp",), nn.initializers.zeros),
            )(x)
            h = nn.gelu(nn.LayerNorm(**_norm(("mlp",)))(h), approximate=True)
            x = x + nn.Dense(
                self.embed,
                kernel_init=_init(("mlp", "embed")),
                bias_init=_init(("embed",), nn.initializers.zeros),
            )(h)
        x = nn.LayerNorm(**_norm(("embed",)))(x)
        return nn.Dense(self.classes, kernel_init=_init(("embed", None)))(x)


def _classify(logits: Any, batch: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


def _next_token(logits: Any, tokens: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


def _take_along(logits: Any, tokens: Any) -> Any:
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def _one_hot(logits: Any, batch: Any) -> Any:
    target = jax.nn.one_hot(batch["target"][:, 1:], logits.shape[-1])
    return optax.softmax_cross_entropy(logits[:, :-1], target).mean()


def _regress(out: Any, batch: Any) -> Any:
    return jnp.mean(jnp.square(out - jax.nn.one_hot(batch[1], out.shape[-1])))


@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the suite: its step at ``scale`` (``build(scale)``: ``(abstract state,
    step, example batch)``), the kinds of miss it covers (keys of :data:`MISSES`) and the
    layouts (keys of :data:`LAYOUTS`) it is checked under."""

    build: Callable[[int], tuple[Any, Callable[[Any, Any], Any], Any]]
    misses: tuple[str, ...]
    layouts: tuple[str, ...]


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def _i32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _vit(scale: int) -> Any:
    model = ViT(embed=64 * scale, heads=4, mlp=128 * scale, layers=2 * scale)
    return linen_step(model, (_f32(16 * scale, 32, 32, 3), _i32(16 * scale)), _classify)


def _cnn(scale: int) -> Any:
    model = CNN(features=tuple(f * scale for f in (32, 32, 64)))
    return linen_step(model, (_f32(16 * scale, 16, 16, 3), _i32(16 * scale)), _classify)


def _encdec(scale: int) -> Any:
    model = EncoderDecoder(embed=64 * scale, mlp=128 * scale, layers=scale)
    batch = {"source": _i32(16 * scale, 32), "target": _i32(16 * scale, 32)}
    return linen_step(model, batch, _one_hot)


def _moe(scale: int) -> Any:
    model = MoEModel(embed=64 * scale, mlp=128 * scale, layers=scale)
    return linen_step(model, _i32(16 * scale, 32), _next_token)


def _decoder(scale: int) -> Any:
    model = TakeDecoder(embed=64 * scale, mlp=128 * scale, layers=2 * scale)
    return linen_step(model, _i32(16 * scale, 32), _next_token)


def _scanned(scale: int) -> Any:
    model = ScannedStack(embed=64 * scale, mlp=128 * scale, layers=4 * scale)
    return linen_step(model, _i32(16 * scale, 32), _take_along)


def _gelu_mlp(scale: int) -> Any:
    model = GeluMlp(embed=64 * scale, mlp=256 * scale, layers=2 * scale)
    return linen_step(model, (_f32(64 * scale, 32), _i32(64 * scale)), _regress)


SUITE: dict[str, Case] = {
    "vit": Case(_vit, ("pool-reshard", "elementwise", "combined-grads"), ("dp", "fsdp")),
    "cnn": Case(_cnn, ("elementwise", "pool-reshard", "combined-grads"), ("dp", "fsdp")),
    "encdec": Case(_encdec, ("fsdp-kept", "combined-grads"), ("fsdp", "tp")),
    "moe": Case(_moe, ("router-gather", "loss-end"), ("dp", "fsdp")),
    "decoder": Case(_decoder, ("embed-all-to-all", "loss-end", "fsdp-kept"), ("fsdp", "tp")),
    "scanned": Case(_scanned, ("fsdp-kept", "combined-grads"), ("dp", "fsdp")),
    "gelu_mlp": Case(_gelu_mlp, ("elementwise", "combined-grads"), ("dp", "fsdp")),
}
"""The suite's models by name."""


def against_xla(
    work: Any, step: Any, state: Any, batch: Any, layout: str
) -> tuple[float, set[str], set[str]]:
    """The planner's temporaries per device (``work`` priced with :data:`CPU_LIKE`) over
    XLA's (``memory_analysis()`` of ``step`` compiled :data:`AS_ON_ACCELERATORS`) under
    ``layout``, and the collective kinds it predicts and the compiled HLO's."""
    from meshplan._search.measure.hlo import measure_step
    from meshplan._search.predict.cost import predict

    mesh, rules = LAYOUTS[layout]
    cost = predict(work, mesh, rules, CPU_LIKE)
    xla = measure_step(step, state, batch, mesh, rules, True, AS_ON_ACCELERATORS)
    ratio = (cost.activation_bytes + cost.temporary_bytes) / xla["xla_temp_bytes"]
    return ratio, {k for k, v in cost.comm_bytes.items() if v}, set(xla["collectives"])


@functools.cache
def suite_step(name: str, scale: int = 1) -> tuple[Any, Callable[[Any, Any], Any], Any]:
    """``(abstract state, step, example batch)`` of the suite's model ``name`` at ``scale``
    (1: the test's sizes; the benchmark's larger)."""
    return SUITE[name].build(scale)
