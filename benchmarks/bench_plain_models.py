"""Models written with no meshplan in mind, priced against XLA: plain JAX, Equinox, unnamed Flax.

Eight small models as people write them, with no logical names (named by
:func:`meshplan.infer_names`' machinery, as a new user's are): a plain-JAX MLP (params as
dicts), Equinox's ``eqx.nn.MLP`` (``jax.vmap`` of ``weight @ x``), a small Equinox
transformer (``eqx.nn.MultiheadAttention``, called per sequence under ``jax.vmap``),
Flax's own MNIST example's CNN, a Flax LSTM then GRU over an embedding lookup
(``nn.RNN``), an MLP-Mixer, a small U-Net (max-pool, ``ConvTranspose``,
``jax.image.resize``, skip concatenations), and a decoder with grouped key-value heads,
rotary embeddings, a causal mask and dropout. Each with AdamW (the plain MLP with SGD,
Equinox's MLP with Adam) and optax's integer-label loss. Under data parallel, FSDP and
tensor parallel 2 x 4 (``tests/xla_suite.py``'s layouts), and under the search's analytic
top-1, the planner's temporaries per device are compared with
``compiled.memory_analysis()`` on 8 emulated CPU devices, and its collective kinds with the
compiled HLO's, as ``benchmarks/bench_hf_models.py`` does.

    .venv/bin/python benchmarks/bench_plain_models.py
    .venv/bin/python benchmarks/bench_plain_models.py --models mlp lstm
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import meshplan
from bench_hf_models import _against_xla, _xent, print_table, top1_against_xla
from meshplan._search.predict.infer import name_unnamed
from xla_suite import LAYOUTS

B, S, D, CLASSES = 16, 32, 128, 16
SDS = jax.ShapeDtypeStruct
Built = tuple[Any, Callable[[Any, Any], Any], Any]


def _flax(
    model: nn.Module, inputs: tuple[Any, ...], labels: Any, rngs: tuple[str, ...] = ()
) -> Built:
    """``model``'s abstract AdamW state, its train step (a dropout key split per step where
    ``rngs`` names one), and the batch ``{"x": inputs, "y": labels}``."""
    tx = optax.adamw(1e-3)
    zeros = [jnp.zeros(x.shape, x.dtype) for x in inputs]
    keys = lambda k: {"params": k, **{r: k for r in rngs}}  # noqa: E731
    params = jax.eval_shape(lambda k: model.init(keys(k), *zeros)["params"], jax.random.key(0))
    state = {"params": params, "opt": jax.eval_shape(tx.init, params)}
    if rngs:
        state["rng"] = SDS((2,), jnp.uint32)

    def step(s: Any, b: Any) -> Any:
        extra, new = {}, {}
        if rngs:
            new["rng"], sub = jax.random.split(s["rng"])
            extra = {"rngs": {r: sub for r in rngs}}
        loss = lambda p: _xent(model.apply({"params": p}, *b["x"], **extra), b["y"])  # noqa: E731
        updates, opt = tx.update(jax.grad(loss)(s["params"]), s["opt"], s["params"])
        return {"params": optax.apply_updates(s["params"], updates), "opt": opt, **new}

    return state, step, {"x": inputs, "y": labels}


def _equinox_transformer() -> Built:
    """Equinox: an embedding, two pre-norm blocks (``eqx.nn.MultiheadAttention``, an
    ``eqx.nn.MLP``), a head; the model called per sequence under ``jax.vmap``, AdamW."""
    import equinox as eqx

    class Block(eqx.Module):
        attn: eqx.nn.MultiheadAttention
        ln1: eqx.nn.LayerNorm
        ln2: eqx.nn.LayerNorm
        mlp: eqx.nn.MLP

        def __init__(self, key: Any) -> None:
            k1, k2 = jax.random.split(key)
            self.attn = eqx.nn.MultiheadAttention(4, D, key=k1)
            self.ln1, self.ln2 = eqx.nn.LayerNorm(D), eqx.nn.LayerNorm(D)
            self.mlp = eqx.nn.MLP(D, D, 2 * D, 1, key=k2)

        def __call__(self, x: Any) -> Any:
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h)
            return x + jax.vmap(self.mlp)(jax.vmap(self.ln2)(x))

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list[Block]
        head: eqx.nn.Linear

        def __init__(self, key: Any) -> None:
            keys = jax.random.split(key, 4)
            self.embed = eqx.nn.Embedding(1000, D, key=keys[0])
            self.blocks = [Block(k) for k in keys[1:3]]
            self.head = eqx.nn.Linear(D, 1000, key=keys[3])

        def __call__(self, ids: Any) -> Any:
            x = jax.vmap(self.embed)(ids)
            for block in self.blocks:
                x = block(x)
            return jax.vmap(self.head)(x)

    abstract = eqx.filter_eval_shape(Model, jax.random.key(0))
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tx = optax.adamw(1e-3)

    def step(s: Any, b: Any) -> Any:
        logits = lambda p: jax.vmap(eqx.combine(p, static))(b[:, :-1])  # noqa: E731
        grads = jax.grad(lambda p: _xent(logits(p), b[:, 1:]))(s["p"])
        updates, opt = tx.update(grads, s["opt"], s["p"])
        return {"p": optax.apply_updates(s["p"], updates), "opt": opt}

    state = {"p": params, "opt": jax.eval_shape(tx.init, params)}
    return state, step, SDS((B, S + 1), jnp.int32)


def _mlp() -> Built:
    """Plain JAX: a list of ``{"w", "b"}`` dicts, ReLU, SGD."""
    sizes = (256, 512, 512, CLASSES)
    params = [
        {"w": SDS((a, b), jnp.float32), "b": SDS((b,), jnp.float32)}
        for a, b in itertools.pairwise(sizes)
    ]

    def forward(ps: Any, x: Any) -> Any:
        for i, p in enumerate(ps):
            x = x @ p["w"] + p["b"]
            x = jax.nn.relu(x) if i < len(ps) - 1 else x
        return x

    def step(ps: Any, b: Any) -> Any:
        grads = jax.grad(lambda q: _xent(forward(q, b["x"]), b["y"]))(ps)
        return jax.tree.map(lambda a, g: a - 1e-3 * g, ps, grads)

    return params, step, {"x": SDS((64, 256), jnp.float32), "y": SDS((64,), jnp.int32)}


def _equinox() -> Built:
    """Equinox's MLP, vmapped over the batch, with Adam."""
    import equinox as eqx

    abstract = eqx.filter_eval_shape(
        lambda k: eqx.nn.MLP(256, CLASSES, 512, 3, key=k), jax.random.key(0)
    )
    params, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    tx = optax.adam(1e-3)

    def step(s: Any, b: Any) -> Any:
        loss = lambda p: _xent(jax.vmap(eqx.combine(p, static))(b["x"]), b["y"])  # noqa: E731
        updates, opt = tx.update(jax.grad(loss)(s["p"]), s["opt"], s["p"])
        return {"p": optax.apply_updates(s["p"], updates), "opt": opt}

    state = {"p": params, "opt": jax.eval_shape(tx.init, params)}
    return state, step, {"x": SDS((64, 256), jnp.float32), "y": SDS((64,), jnp.int32)}


class _MnistCnn(nn.Module):
    """Flax's own MNIST example's CNN (``examples/mnist/train.py``), as written there."""

    @nn.compact
    def __call__(self, x: Any) -> Any:
        x = nn.Conv(features=32, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = nn.Conv(features=64, kernel_size=(3, 3))(x)
        x = nn.relu(x)
        x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
        x = x.reshape((x.shape[0], -1))  # flatten
        x = nn.Dense(features=256)(x)
        x = nn.relu(x)
        return nn.Dense(features=CLASSES)(x)


class _Recurrent(nn.Module):
    @nn.compact
    def __call__(self, ids: Any) -> Any:
        x = nn.Embed(1000, D)(ids)
        x = nn.RNN(nn.OptimizedLSTMCell(D))(x)
        x = nn.RNN(nn.GRUCell(D))(x)
        return nn.Dense(CLASSES)(x.mean(1))


class _MixerBlock(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        y = nn.LayerNorm()(x).swapaxes(1, 2)
        y = nn.Dense(x.shape[1])(nn.gelu(nn.Dense(64)(y)))
        x = x + y.swapaxes(1, 2)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(256)(nn.LayerNorm()(x))))


class _Mixer(nn.Module):
    @nn.compact
    def __call__(self, images: Any) -> Any:
        x = nn.Conv(D, (4, 4), strides=(4, 4))(images)
        x = x.reshape(x.shape[0], -1, D)
        for _ in range(2):
            x = _MixerBlock()(x)
        return nn.Dense(CLASSES)(nn.LayerNorm()(x).mean(1))


class _UNet(nn.Module):
    @nn.compact
    def __call__(self, images: Any) -> Any:
        a = nn.relu(nn.Conv(16, (3, 3))(images))
        b = nn.relu(nn.Conv(32, (3, 3))(nn.max_pool(a, (2, 2), (2, 2))))
        x = jnp.concatenate([a, nn.ConvTranspose(16, (2, 2), strides=(2, 2))(b)], -1)
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        up = jax.image.resize(b, (b.shape[0], 32, 32, b.shape[-1]), "bilinear")
        return nn.Conv(4, (1, 1))(jnp.concatenate([x, up], -1))


def _rope(x: Any) -> Any:
    half = x.shape[-1] // 2
    t = jnp.arange(x.shape[1])[:, None] / (10000 ** (jnp.arange(half) / half))
    cos, sin = jnp.cos(t)[None, :, None], jnp.sin(t)[None, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


class _GqaBlock(nn.Module):
    @nn.compact
    def __call__(self, x: Any) -> Any:
        h = nn.RMSNorm()(x)
        q = _rope(nn.DenseGeneral((8, 16), use_bias=False)(h))
        k = _rope(nn.DenseGeneral((2, 16), use_bias=False)(h))
        v = nn.DenseGeneral((2, 16), use_bias=False)(h)
        k, v = jnp.repeat(k, 4, axis=2), jnp.repeat(v, 4, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / 4.0
        causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        p = nn.Dropout(0.1, deterministic=False)(jax.nn.softmax(jnp.where(causal, scores, -1e9)))
        o = jnp.einsum("bhqk,bkhd->bqhd", p, v)
        x = x + nn.DenseGeneral(D, axis=(-2, -1), use_bias=False)(o)
        h = nn.RMSNorm()(x)
        gated = nn.silu(nn.Dense(256, use_bias=False)(h)) * nn.Dense(256, use_bias=False)(h)
        return x + nn.Dense(D, use_bias=False)(gated)


class _Gqa(nn.Module):
    @nn.compact
    def __call__(self, ids: Any) -> Any:
        embed = nn.Embed(1000, D)
        x = embed(ids)
        for _ in range(2):
            x = _GqaBlock()(x)
        return embed.attend(nn.RMSNorm()(x))


MODELS: dict[str, Callable[[], Built]] = {
    "mlp": _mlp,
    "equinox": _equinox,
    "equinox-transformer": _equinox_transformer,
    "mnist": lambda: _flax(
        _MnistCnn(), (SDS((32, 28, 28, 1), jnp.float32),), SDS((32,), jnp.int32)
    ),
    "lstm": lambda: _flax(_Recurrent(), (SDS((B, S), jnp.int32),), SDS((B,), jnp.int32)),
    "mixer": lambda: _flax(_Mixer(), (SDS((B, 32, 32, 3), jnp.float32),), SDS((B,), jnp.int32)),
    "unet": lambda: _flax(
        _UNet(), (SDS((B, 32, 32, 3), jnp.float32),), SDS((B, 32, 32), jnp.int32)
    ),
    "gqa": lambda: _flax(
        _Gqa(), (SDS((B, S), jnp.int32),), SDS((B, S), jnp.int32), rngs=("dropout",)
    ),
}
"""Each model's ``(abstract state, train step, batch)``."""


def _row(name: str) -> str:
    state, step, batch = MODELS[name]()
    result = meshplan.search_rules(8, state, step, batch, profile="cpu", compile_top=0)
    unpriced = ", ".join(result.best.cost.unpriced) or "none"
    _, named, named_step, work = name_unnamed(step, state, batch)
    cells = []
    for layout in LAYOUTS:
        try:
            cells.append(_against_xla(named_step, named, batch, work, layout))
        except ValueError as e:  # a name split over more devices than its size divides by
            cells.append(f"n/a ({str(e)[:60]})")
    cells.append(top1_against_xla(result, named_step, named, batch, work))
    return " | ".join([name, unpriced, *cells])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    print_table("model | unpriced", parser.parse_args().models, _row)


if __name__ == "__main__":
    main()
