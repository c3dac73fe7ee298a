"""Decoding with a key/value cache: the Transformer's forward pass one new token at a time.

The cache-free way to generate (``meshplan sample`` before this module) runs
the whole window through the model for every new byte. With a cache, each
layer's keys and values of the bytes already read are kept, and a step
computes only the new byte's query, key and value, attending to the cache.

The cache is one array per kind, ``key`` and ``value``, of shape ``[layer,
batch, length, heads, kv]`` with the logical names :data:`CACHE_NAMES`, so
the rules that place the model's activations place it too (``batch`` over the
data axes, ``heads`` over the tensor axis, ``length`` over ``context``); it
is constrained to those names when created and after every update.

The math is the model's (:mod:`meshplan.models.transformer`): the same
parameters (a Linen ``params`` tree, unboxed, or the NNX model's state as a
pure dict: the paths are the same), norms, rotary or learned positions and
causal mask; positions past the filled part of the cache are masked exactly
as the cache-free path masks its padding. Greedy decoding therefore gives the
same bytes, for a dense model (a mixture of experts routes each sequence as a
group, with capacity per group: decoding a byte alone routes it alone).

Example:
    >>> import jax, jax.numpy as jnp, meshplan
    >>> from meshplan.models.transformer import Transformer, config_from_name
    >>> from meshplan.models.decode import greedy_cached
    >>> config = config_from_name("tiny", num_layers=1, embed_dim=32, mlp_dim=64, max_len=32)
    >>> model = Transformer(config)
    >>> params = meshplan.unbox(model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    >>> len(greedy_cached(config, params, b"def ", 10))
    10
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import meshplan
from meshplan._types import PyTree
from meshplan.models.transformer import TransformerConfig, _rotary, moe_forward

__all__ = ["CACHE_NAMES", "decode_window", "forward_cached", "greedy_cached", "init_cache"]

CACHE_NAMES = ("layer", "batch", "length", "heads", "kv")
"""The logical names of the key and value caches, ``[layer, batch, length, heads, kv]``."""

Array = jax.Array


def choose_byte(logits: jax.Array, temperature: float, key: jax.Array) -> tuple[int, jax.Array]:
    """The next byte from ``logits``: the most likely at temperature 0, else sampled; the next key.

    The cached and cache-free decoders (``meshplan sample``) choose alike.
    """
    if temperature == 0:
        return int(jnp.argmax(logits)), key
    key, sub = jax.random.split(key)
    return int(jax.random.categorical(sub, logits / temperature)), key


def init_cache(config: TransformerConfig, batch: int, length: int) -> dict[str, Array]:
    """Empty ``key`` and ``value`` caches for ``batch`` sequences of up to ``length`` tokens.

    Example:
        >>> from meshplan.models.transformer import config_from_name
        >>> from meshplan.models.decode import init_cache
        >>> init_cache(config_from_name("tiny"), 1, 64)["key"].shape
        (2, 1, 64, 4, 32)
    """
    shape = (config.num_layers, batch, length, config.num_heads, config.head_dim)
    zeros = jnp.zeros(shape, config.compute_dtype)
    return {
        "key": meshplan.with_logical_constraint(zeros, CACHE_NAMES),
        "value": meshplan.with_logical_constraint(zeros, CACHE_NAMES),
    }


def _layer_norm(x: Array, p: dict[str, Array], epsilon: float = 1e-6) -> Array:
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + epsilon) * p["scale"] + p["bias"]
    return y.astype(x.dtype)


def _layer(params: PyTree, config: TransformerConfig, i: int) -> PyTree:
    layer: dict[str, object]
    if config.scan_layers:
        layer = jax.tree.map(lambda x: x[i], params["layers"])
    else:
        layer = params[f"layers_{i}"]
    return layer


def forward_cached(
    params: PyTree,
    config: TransformerConfig,
    tokens: Array,
    cache: dict[str, Array],
    start: Array | int,
) -> tuple[Array, dict[str, Array]]:
    """Logits of ``tokens[batch, t]`` at positions ``start ... start + t - 1``, and the cache.

    The tokens' keys and values are written into the cache at those positions;
    each attends to the cache up to its own position.
    """
    cfg, dtype = config, config.compute_dtype
    length = tokens.shape[1]
    positions = start + jnp.arange(length)
    x = jax.nn.one_hot(tokens, cfg.vocab_size, dtype=dtype) @ params["embed"].astype(dtype)
    if cfg.positions == "learned":
        x = x + jnp.take(params["pos_embed"], positions, axis=0)[None].astype(dtype)
    key_positions = jnp.arange(cache["key"].shape[2])
    mask = key_positions[None, :] <= positions[:, None]
    keys, values = cache["key"], cache["value"]
    for i in range(cfg.num_layers):
        p = _layer(params, cfg, i)
        attn = p["attention"]
        h = _layer_norm(x, p["attention_norm"])
        q, k, v = (
            jnp.einsum("ble,ehd->blhd", h, attn[name].astype(dtype))
            for name in ("query", "key", "value")
        )
        if cfg.positions == "rope":
            q, k = _rotary(q, positions), _rotary(k, positions)
        keys = jax.lax.dynamic_update_slice(keys, k[None].astype(keys.dtype), (i, 0, start, 0, 0))
        values = jax.lax.dynamic_update_slice(
            values, v[None].astype(values.dtype), (i, 0, start, 0, 0)
        )
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys[i], preferred_element_type=jnp.float32)
        scores = scores / np.sqrt(cfg.head_dim).astype(np.float32)
        scores = jnp.where(mask[None, None], scores, np.finfo(np.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, values[i])
        x = x + jnp.einsum("bqhd,hde->bqe", y, attn["out"].astype(dtype))
        h = _layer_norm(x, p["mlp_norm"])
        mlp = p["mlp"]
        if cfg.num_experts:
            y, _ = moe_forward(h, mlp["router"], mlp["wi"], mlp["wo"], cfg)
        else:
            y = jax.nn.gelu(h @ mlp["wi"].astype(dtype)) @ mlp["wo"].astype(dtype)
        x = x + y
    x = _layer_norm(x, params["final_norm"])
    logits = jnp.einsum(
        "ble,ev->blv", x, params["head"].astype(dtype), preferred_element_type=jnp.float32
    )
    cache = {
        "key": meshplan.with_logical_constraint(keys, CACHE_NAMES),
        "value": meshplan.with_logical_constraint(values, CACHE_NAMES),
    }
    return logits.astype(jnp.float32), cache


def decode_window(config: TransformerConfig, window: int | None = None) -> int:
    """The positions a cache holds: ``window`` (the training ``--seq``), at most ``max_len``.

    Example:
        >>> from meshplan.models.transformer import config_from_name
        >>> from meshplan.models.decode import decode_window
        >>> decode_window(config_from_name("tiny"), 128), decode_window(config_from_name("tiny"))
        (128, 256)
    """
    return min(window or config.max_len, config.max_len)


def greedy_cached(
    config: TransformerConfig,
    params: dict[str, object],
    prompt: bytes,
    length: int,
    window: int | None = None,
    temperature: float = 0.0,
    seed: int = 0,
    times: list[float] | None = None,
) -> bytes:
    """Continues ``prompt`` by ``length`` bytes, decoding with a key/value cache.

    ``times``, when given, receives the seconds each byte took (the first ones
    compile).

    The prompt is read in one pass (its keys and values fill the cache), then
    each new byte is one step of a single token. The cache holds ``window``
    positions (:func:`decode_window`); once the text is longer, every step
    reads the last ``window`` bytes again, as the cache-free path does, so the
    bytes are the same (greedy, ``temperature=0``; sampled with the same keys
    otherwise).
    """
    window = decode_window(config, window)
    tokens = list(prompt) or [ord("\n")]

    @jax.jit
    def prefill(params: PyTree, tokens: Array, cache: PyTree) -> PyTree:
        logits, cache = forward_cached(params, config, tokens, cache, 0)
        return logits[0, -1], cache

    @jax.jit
    def step(params: PyTree, token: Array, cache: PyTree, start: Array) -> PyTree:
        logits, cache = forward_cached(params, config, token, cache, start)
        return logits[0, -1], cache

    key = jax.random.key(seed)
    out = bytearray()
    cache: dict[str, Array] | None = None
    logits = None
    for _ in range(length):
        began = time.perf_counter()
        if len(tokens) > window or cache is None:
            context = tokens[-window:]
            fresh = init_cache(config, 1, window)
            logits, cache = prefill(params, jnp.asarray([context], jnp.int32), fresh)
            filled = len(context)
        assert logits is not None
        byte, key = choose_byte(logits, temperature, key)
        tokens.append(byte)
        out.append(byte)
        if len(tokens) <= window:
            token = np.array([[byte]], np.int32)
            logits, cache = step(params, token, cache, np.int32(filled))
            filled += 1
        if times is not None:
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - began)
    return bytes(out)
