"""A Llama-style decoder (MaxText's default model) with logical names, for planning at scale.

Gated-SiLU MLP, RMSNorm, rotary-free attention through ``jax.nn.dot_product_attention``
(grouped-query when ``kv_heads < heads``), untied embedding and head, layers stacked by
``nn.scan`` (``scan=True``) or a for-loop, and rematerialised by ``nn.remat`` with a
policy (``remat``: ``'none'``, ``'full'``, ``'dots'``: every matmul saved, or
``'minimal'``: matmuls without batch dimensions saved, MaxText's ``minimal``; or
``'full_block'``, PyTorch's and Megatron-LM's whole-block recompute: ``'full'``, with the
MLP's down-projection run again in the backward pass too, which JAX's recompute leaves out
because the backward does not read its output).
``parallel=True`` computes attention and MLP from the same input (PaLM's block).

The logical names: ``batch``, ``length``, ``embed``, ``heads``, ``kv_heads``, ``kv``
(head dimension), ``mlp``, ``vocab``, and ``layer`` for the scanned stack; the
activations between layers are ``('batch', 'length', 'activation_embed')``, MaxText's
name, so that a layout may split them apart from the weights' ``embed``.
:func:`llama_step` gives what :func:`meshplan.search_rules` and the planner take:
``(abstract_state, step_fn, example_batch)``, with AdamW.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import meshplan
from meshplan._types import Leaf, PyTree, StepFn

__all__ = [
    "LLAMA_SIZES",
    "REMATS",
    "Llama",
    "LlamaConfig",
    "llama_size",
    "llama_step",
    "maxtext_config",
]

REMATS = ("none", "full", "dots", "minimal", "full_block")
"""``remat``: nothing recomputed; the whole layer (what its backward reads); all but the
matmuls; all but the matmuls without batch dimensions; the whole layer, its last projection
too (a framework that reruns the block's forward, as ``torch.utils.checkpoint`` does)."""


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """The decoder's sizes and how it is run (module docstring)."""

    embed: int = 256
    heads: int = 4
    kv_heads: int = 4
    head_dim: int = 64
    mlp: int = 512
    layers: int = 2
    vocab: int = 512
    gated: bool = True
    parallel: bool = False
    remat: str = "none"
    scan: bool = True
    dtype: str = "bfloat16"

    def params(self) -> int:
        """Parameter count.

        Example:
            >>> from meshplan.models.llama import maxtext_config
            >>> round(maxtext_config(16).params() / 1e9, 1)
            15.8
        """
        e, q, k, d = self.embed, self.heads, self.kv_heads, self.head_dim
        attn = e * d * (2 * q + 2 * k)
        mlp = (3 if self.gated else 2) * e * self.mlp
        return self.layers * (attn + mlp + 2 * e) + 2 * self.vocab * e + e


def maxtext_config(scale: int, **overrides: object) -> LlamaConfig:
    """MaxText's ``global_parameter_scale`` model (its ``base.yml`` scaled as its ``pyconfig``).

    Example:
        >>> from meshplan.models.llama import maxtext_config
        >>> c = maxtext_config(32)
        >>> c.embed, c.heads, c.mlp, c.layers
        (8192, 64, 28672, 32)
    """
    log2 = scale.bit_length() - 1
    base, rem = divmod(log2, 3)
    heads_scale = base + int(rem > 0)
    emb_scale = base + int(rem > 1)
    fields: dict[str, Any] = dict(
        embed=2048 * 2**emb_scale,
        heads=16 * 2**heads_scale,
        kv_heads=16 * 2**heads_scale,
        head_dim=128,
        mlp=7168 * 2**heads_scale,
        layers=16 * 2**base,
        vocab=32000,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


_L2 = dict(head_dim=128, vocab=32000)  # Llama 2: 32,000 tokens, heads of 128
_L3 = dict(head_dim=128, vocab=128256)  # Llama 3: 128,256 tokens
LLAMA_SIZES: dict[str, tuple[str, dict[str, int]]] = {
    # MaxText's configs/models/<name>.yml (base_emb_dim, base_num_query_heads,
    # base_num_kv_heads, base_mlp_dim, base_num_decoder_layers, head_dim, vocab_size), the
    # same as Meta's published Llama 2 and Llama 3 configurations.
    "llama2-1b": (
        "MaxText llama2-1b",
        dict(embed=2048, heads=16, kv_heads=16, mlp=6144, layers=16, **_L2),
    ),
    "llama2-7b": (
        "Llama 2 7B",
        dict(embed=4096, heads=32, kv_heads=32, mlp=11008, layers=32, **_L2),
    ),
    "llama2-13b": (
        "Llama 2 13B",
        dict(embed=5120, heads=40, kv_heads=40, mlp=13824, layers=40, **_L2),
    ),
    "llama2-70b": (
        "Llama 2 70B",
        dict(embed=8192, heads=64, kv_heads=8, mlp=28672, layers=80, **_L2),
    ),
    "llama3-8b": (
        "Llama 3 8B",
        dict(embed=4096, heads=32, kv_heads=8, mlp=14336, layers=32, **_L3),
    ),
    "llama3-70b": (
        "Llama 3 70B",
        dict(embed=8192, heads=64, kv_heads=8, mlp=28672, layers=80, **_L3),
    ),
    "llama3.1-405b": (
        "Llama 3.1 405B",
        dict(embed=16384, heads=128, kv_heads=8, mlp=53248, layers=126, **_L3),
    ),
    # MaxText's global_parameter_scale models (base.yml scaled: maxtext_config).
    **{
        f"maxtext-{n}b": (
            f"MaxText {n}B (global_parameter_scale={n})",
            dataclasses.asdict(maxtext_config(n)),
        )
        for n in (16, 32, 64, 128)
    },
}
"""Published decoder configurations by name: ``(description, LlamaConfig fields)``;
``1b``, ``7b``, ``8b``, ``13b``, ``70b``, ``405b`` are short for the Llama ones
(:func:`llama_size`)."""

_SHORT = {
    "1b": "llama2-1b",
    "7b": "llama2-7b",
    "8b": "llama3-8b",
    "13b": "llama2-13b",
    "70b": "llama2-70b",
    "405b": "llama3.1-405b",
}


def llama_size(name: str, **overrides: Any) -> tuple[str, LlamaConfig]:
    """``(name, config)`` of a published size (:data:`LLAMA_SIZES`, or its short name ``7b``).

    Raises:
        KeyError: an unknown size.

    Example:
        >>> from meshplan.models.llama import llama_size
        >>> name, cfg = llama_size("7b", remat="full")
        >>> name, round(cfg.params() / 1e9, 2), cfg.remat
        ('llama2-7b', 6.74, 'full')
        >>> round(llama_size("llama3-70b")[1].params() / 1e9, 1)
        70.6
    """
    full = _SHORT.get(name, name)
    fields = {**LLAMA_SIZES[full][1], **overrides}
    return full, LlamaConfig(**fields)


def _param(module: nn.Module, name: str, shape: tuple[int, ...], names: tuple[str, ...]) -> Any:
    init = meshplan.with_logical_partitioning(nn.initializers.normal(0.02), names)
    return module.param(name, init, shape, unbox=True)


def _c(x: Leaf, names: tuple[str | None, ...]) -> Leaf:
    return meshplan.with_logical_constraint(x, names)


class _Norm(nn.Module):
    @nn.compact
    def __call__(self, x: Leaf) -> Leaf:
        scale = self.param(
            "scale",
            meshplan.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            (x.shape[-1],),
            unbox=True,
        )
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (y * scale).astype(x.dtype)


class _Block(nn.Module):
    cfg: LlamaConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: object = None) -> tuple[jax.Array, None]:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        e, q, k, d = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim
        act = ("batch", "length", "activation_embed")
        h = _Norm(name="attn_norm")(x)
        wq = _param(self, "query", (e, q, d), ("embed", "heads", "kv")).astype(dt)
        wk = _param(self, "key", (e, k, d), ("embed", "kv_heads", "kv")).astype(dt)
        wv = _param(self, "value", (e, k, d), ("embed", "kv_heads", "kv")).astype(dt)
        wo = _param(self, "out", (q, d, e), ("heads", "kv", "embed")).astype(dt)
        qh = _c(jnp.einsum("ble,ehd->blhd", h, wq), ("batch", "length", "heads", "kv"))
        kh = _c(jnp.einsum("ble,ehd->blhd", h, wk), ("batch", "length", "kv_heads", "kv"))
        vh = _c(jnp.einsum("ble,ehd->blhd", h, wv), ("batch", "length", "kv_heads", "kv"))
        att = jax.nn.dot_product_attention(qh, kh, vh, is_causal=True)
        att = _c(att, ("batch", "length", "heads", "kv"))
        y = _c(jnp.einsum("blhd,hde->ble", att, wo), act)
        if not cfg.parallel:
            x = _c(x + y, act)
            h = _Norm(name="mlp_norm")(x)
        wi = _param(self, "wi", (e, cfg.mlp), ("embed", "mlp")).astype(dt)
        wout = _param(self, "wo", (cfg.mlp, e), ("mlp", "embed")).astype(dt)
        hid = _c(jnp.einsum("ble,em->blm", h, wi), ("batch", "length", "mlp"))
        if cfg.gated:
            wg = _param(self, "wg", (e, cfg.mlp), ("embed", "mlp")).astype(dt)
            gate = _c(jnp.einsum("ble,em->blm", h, wg), ("batch", "length", "mlp"))
            hid = jax.nn.silu(gate) * hid
        else:
            hid = jax.nn.gelu(hid)
        z = _c(jnp.einsum("blm,me->ble", hid, wout), act)
        if cfg.remat == "full_block":
            z = _read_in_backward(z)
        out = x + y + z if cfg.parallel else x + z
        return _c(out, act), None


_POLICIES = {
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


@jax.custom_vjp
def _read_in_backward(z: jax.Array) -> jax.Array:
    """``z``, whose backward reads it (adds ``z * 0``: no compiler drops a float times zero),
    so a rematerialised block recomputes it: a whole-block rerun, as PyTorch's checkpoint."""
    return z


def _read_fwd(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    return z, z


def _read_bwd(z: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    return (g + z * jnp.zeros((), z.dtype),)


_read_in_backward.defvjp(_read_fwd, _read_bwd)


class Llama(nn.Module):
    """``tokens[batch, length] -> logits[batch, length, vocab]`` (module docstring)."""

    cfg: LlamaConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg, dt = self.cfg, jnp.dtype(self.cfg.dtype)
        table = _param(self, "embed", (cfg.vocab, cfg.embed), ("vocab", "embed"))
        x = _c(jnp.take(table.astype(dt), tokens, axis=0), ("batch", "length", "activation_embed"))
        block: Any = _Block
        if cfg.remat != "none":
            policy = _POLICIES.get(cfg.remat)
            block = nn.remat(_Block, prevent_cse=not cfg.scan, policy=policy)
        if cfg.scan:
            x, _ = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.layers,
                metadata_params={meshplan.PARTITION_NAME: "layer"},
            )(cfg, name="layers")(x, None)
        else:
            for i in range(cfg.layers):
                x, _ = block(cfg, name=f"layers_{i}")(x, None)
        x = _Norm(name="final_norm")(x)
        head = _param(self, "head", (cfg.embed, cfg.vocab), ("embed", "vocab")).astype(dt)
        logits = jnp.einsum("ble,ev->blv", x, head, preferred_element_type=jnp.float32)
        out: jax.Array = _c(logits, ("batch", "length", "vocab"))
        return out


def _loss(logits: jax.Array, tokens: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    target = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=logp.dtype)
    return -jnp.mean(jnp.sum(logp * target, axis=-1))


def llama_step(cfg: LlamaConfig, batch: int, seq: int) -> tuple[PyTree, StepFn, PyTree]:
    """``(abstract_state, step_fn, example_batch)`` of a training step (AdamW, float32 state).

    Example:
        >>> from meshplan.models.llama import LlamaConfig, llama_step
        >>> state, step, tokens = llama_step(LlamaConfig(), batch=8, seq=64)
        >>> tokens.shape, state.params["layers"]["query"].names
        ((8, 64), ('layer', 'embed', 'heads', 'kv'))
    """
    import optax

    from meshplan._search.predict.step import linen_step

    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return linen_step(Llama(cfg), tokens, _loss, optax.adamw(1e-4))
