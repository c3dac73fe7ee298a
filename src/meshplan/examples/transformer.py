"""A decoder-only Transformer language model with logical axis names.

One readable file in the style of Flax's lm1b example: a frozen config, a few
Linen modules, a loss. What makes it a meshplan model:

* every parameter is created with :func:`meshplan.with_logical_partitioning`
  and names from one vocabulary (below), so a layout is a rule set
  (:mod:`meshplan.layouts`), never a model edit;
* the main activations carry :func:`meshplan.with_logical_constraint`;
* the blocks are stacked with ``nn.scan`` whose partition name is ``'layer'``
  (or by a Python for-loop, ``scan_layers=False``);
* it runs on ``Auto`` meshes (``jax.make_mesh(..., axis_types=(AxisType.Auto,) * n)``,
  as ``meshplan train`` builds) and on ``Explicit`` ones (``jax.make_mesh``'s
  default): contractions over a sharded dimension pass
  ``out_sharding=meshplan.explicit_out_sharding(...)``, which is ``None`` on an
  Auto mesh.

The logical axis vocabulary:

=========  ==========================================================
``batch``   examples in a batch (activations only)
``length``  positions in a sequence (activations; learned positions)
``embed``   the model width, ``embed_dim``
``heads``   attention heads
``kv``      the width of one head, ``head_dim``
``mlp``     the hidden width of the MLP, ``mlp_dim``
``vocab``   the byte vocabulary, ``vocab_size``
``layer``   the stacked-layers axis that ``nn.scan`` adds
=========  ==========================================================

Parameters sharded over the mesh axes that also split the batch (FSDP) are
gathered over those axes just before use (:func:`gathered`): the forward pass
all-gathers them and the backward pass reduce-scatters their gradients.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from meshplan.examples.transformer import Transformer, config_from_name
    >>> config = config_from_name("tiny", num_layers=1, embed_dim=32, mlp_dim=64)
    >>> model = Transformer(config)
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> model.apply({"params": params}, tokens).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

import meshplan
from meshplan._spmd.mesh import apply_spec  # not public: constrain on Auto, reshard on Explicit

__all__ = [
    "AXIS_NAMES",
    "CONFIGS",
    "CONFIG_SETTINGS",
    "Block",
    "LayerNorm",
    "Transformer",
    "TransformerConfig",
    "config_from_name",
    "gathered",
    "loss_fn",
    "parameter_count",
    "train_flops",
]

AXIS_NAMES = ("batch", "length", "embed", "heads", "kv", "mlp", "vocab", "layer")
"""Every logical axis name the model uses; each rule set in :mod:`meshplan.layouts` covers them."""

Array = jax.Array
Initializer = Callable[..., Array]


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyperparameters of :class:`Transformer` (there is no dropout).

    Attributes:
        vocab_size: Size of the token vocabulary (256: bytes).
        num_layers: Number of Transformer blocks.
        num_heads: Number of attention heads.
        embed_dim: Model width; a multiple of ``num_heads``.
        mlp_dim: Hidden width of each block's MLP.
        max_len: Longest sequence the model accepts (size of learned positions).
        dtype: Dtype of the activations, as a name (``"float32"``, ``"bfloat16"``);
            parameters and logits are always float32.
        positions: ``"rope"`` (rotary, no parameters) or ``"learned"``.
        scan_layers: Stack the blocks with ``nn.scan`` (one compiled block, a
            leading ``'layer'`` axis on every block parameter) instead of a
            Python for-loop (``layers_0``, ``layers_1``, ...).
        remat: Recompute each block's activations in the backward pass
            (``nn.remat``): less memory, about a third more compute.
    """

    vocab_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    embed_dim: int = 128
    mlp_dim: int = 512
    max_len: int = 256
    dtype: str = "float32"
    positions: str = "rope"
    scan_layers: bool = True
    remat: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)
        problems = []
        if self.embed_dim % self.num_heads:
            problems.append(
                f"embed_dim={self.embed_dim} is not a multiple of num_heads={self.num_heads}"
            )
        elif self.positions == "rope" and self.head_dim % 2:
            problems.append(f"rotary positions need an even head_dim, got {self.head_dim}")
        if self.positions not in ("rope", "learned"):
            problems.append(f"positions must be 'rope' or 'learned', got {self.positions!r}")
        for field in ("vocab_size", "num_layers", "num_heads", "embed_dim", "mlp_dim", "max_len"):
            if getattr(self, field) < 1:
                problems.append(f"{field} must be positive, got {getattr(self, field)}")
        if problems:
            raise ValueError("Invalid TransformerConfig: " + "; ".join(problems) + ".")

    @property
    def head_dim(self) -> int:
        """Width of one attention head: ``embed_dim // num_heads``."""
        return self.embed_dim // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        """:attr:`dtype` as a NumPy dtype."""
        return jnp.dtype(self.dtype)

    def to_dict(self) -> dict[str, Any]:
        """The config as a JSON-able dict (for checkpoints).

        Example:
            >>> from meshplan.examples.transformer import TransformerConfig
            >>> TransformerConfig.from_dict(TransformerConfig().to_dict()) == TransformerConfig()
            True
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """The config :meth:`to_dict` wrote; unknown keys are an error naming them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"TransformerConfig.from_dict got unknown fields {unknown}; "
                f"known fields are {sorted(known)}."
            )
        return cls(**data)


CONFIGS: dict[str, TransformerConfig] = {
    # 460,032 parameters: validation loss ~1.6 nats/byte after 300 steps of 32 x 128
    # bytes (a few minutes on 2 CPU cores with 8 emulated devices).
    "tiny": TransformerConfig(num_layers=2, num_heads=4, embed_dim=128, mlp_dim=512, max_len=256),
    # 4,856,320 parameters.
    "small": TransformerConfig(num_layers=6, num_heads=8, embed_dim=256, mlp_dim=1024, max_len=512),
    # 126,396,416 parameters, for one modern GPU (with --dtype bfloat16): batch 32 x 1024
    # bytes, 32,768 tokens and about 29 TFLOP a step (train_flops).
    "base": TransformerConfig(
        num_layers=10, num_heads=16, embed_dim=1024, mlp_dim=4096, max_len=1024
    ),
}
"""Preset configs by name."""

CONFIG_SETTINGS: dict[str, dict[str, Any]] = {
    "base": {"batch": 32, "seq_len": 1024, "lr": 6e-4, "warmup": 100},
}
"""Training settings a preset brings along (``meshplan train --size base``), unless given."""


def config_from_name(name: str, **overrides: Any) -> TransformerConfig:
    """A preset from :data:`CONFIGS`, with fields replaced by ``overrides``.

    Example:
        >>> from meshplan.examples.transformer import config_from_name
        >>> config_from_name("tiny", num_layers=4).num_layers
        4

    Raises:
        ValueError: ``name`` is not a preset, or an override is not a config field.
    """
    if name not in CONFIGS:
        raise ValueError(f"Unknown config {name!r}; choose one of {sorted(CONFIGS)}.")
    known = {f.name for f in dataclasses.fields(TransformerConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"Unknown config fields {unknown}; known fields are {sorted(known)}.")
    return dataclasses.replace(CONFIGS[name], **overrides)


# ---------------------------------------------------------------------------
# Sharding helpers
# ---------------------------------------------------------------------------


def _axes(entry: Any) -> tuple[str, ...]:
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple):
        return entry
    return ()


def gathered(weight: Array, names: tuple[str | None, ...]) -> Array:
    """``weight`` as the computation uses it: gathered over the mesh axes of ``'batch'``.

    With rules that shard a parameter over the same mesh axes as the batch
    (FSDP), each device holds a slice of the parameter but needs all of it to
    process its own examples. This constrains the parameter to its spec with
    the batch's mesh axes removed: an all-gather in the forward pass, a
    reduce-scatter of its gradient in the backward pass. Without a mesh, rules,
    or such axes it returns ``weight`` unchanged.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan.examples.transformer import gathered
        >>> rules = (("batch", "data"), ("embed", "data"), ("mlp", "model"))
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        ...     w = jax.jit(lambda w: gathered(w, ("embed", "mlp")))(jnp.ones((8, 16)))
        >>> w.sharding.spec
        P(None, 'model')
    """
    if meshplan.active_mesh() is None:
        return weight
    rules = meshplan.get_logical_axis_rules()
    if not rules:
        return weight
    batch_axes = set(_axes(meshplan.logical_to_mesh_axes(("batch",), rules)[0]))
    spec = meshplan.logical_to_mesh_axes(names, rules)
    if not any(batch_axes & set(_axes(e)) for e in spec):
        return weight
    kept = []
    for entry in spec:
        left = tuple(a for a in _axes(entry) if a not in batch_axes)
        kept.append(None if not left else left[0] if len(left) == 1 else left)
    return apply_spec(weight, PartitionSpec(*kept), what=f"a parameter named {names!r}")


def _constrain(x: Array, names: tuple[str | None, ...]) -> Array:
    return meshplan.with_logical_constraint(x, names)


def _out(names: tuple[str | None, ...]) -> PartitionSpec | None:
    return meshplan.explicit_out_sharding(names)


def _dense_init(in_axes: tuple[int, ...], out_axes: tuple[int, ...]) -> Initializer:
    """LeCun-normal over the contracted (input) axes of a multi-axis kernel."""
    return nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axes, out_axis=out_axes
    )


# ---------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------
# ``self.param(..., unbox=True)`` spells out flax's default: a boxed initializer's value
# comes back unboxed. Without it flax's type stubs type the value as the box.


class LayerNorm(nn.Module):
    """Layer normalisation whose scale and bias are named ``('embed',)``."""

    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x: Array) -> Array:
        features = x.shape[-1]
        scale = self.param(
            "scale",
            meshplan.with_logical_partitioning(nn.initializers.ones, ("embed",)),
            (features,),
            unbox=True,
        )
        bias = self.param(
            "bias",
            meshplan.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
            (features,),
            unbox=True,
        )
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * gathered(scale, ("embed",)) + gathered(bias, ("embed",))
        return y.astype(x.dtype)


def _rotary(x: Array, positions: Array) -> Array:
    """Rotary position embedding of ``x[batch, length, heads, kv]``."""
    half = x.shape[-1] // 2
    freqs = 1.0 / (10_000.0 ** (np.arange(half, dtype=np.float32) / half))
    angles = positions[:, None].astype(jnp.float32) * freqs[None, :]  # [length, half]
    sin = jnp.sin(angles)[None, :, None, :]
    cos = jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class Attention(nn.Module):
    """Causal multi-head self-attention; projections named ``('embed', 'heads', 'kv')``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        dtype = cfg.compute_dtype
        e, h, d = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        in_names = ("embed", "heads", "kv")
        in_init = meshplan.with_logical_partitioning(_dense_init((0,), (1, 2)), in_names)
        heads_names = ("batch", "length", "heads", "kv")

        def project(name: str) -> Array:
            w = gathered(self.param(name, in_init, (e, h, d), unbox=True), in_names).astype(dtype)
            y = jnp.einsum("ble,ehd->blhd", x, w, out_sharding=_out(heads_names))
            return _constrain(y, heads_names)

        q, k, v = project("query"), project("key"), project("value")
        if cfg.positions == "rope":
            positions = jnp.arange(x.shape[1])
            q, k = _rotary(q, positions), _rotary(k, positions)

        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores / np.sqrt(d).astype(np.float32)
        length = x.shape[1]
        causal = np.tril(np.ones((length, length), dtype=bool))
        scores = jnp.where(causal[None, None], scores, np.finfo(np.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
        y = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        y = _constrain(y, heads_names)

        out_names = ("heads", "kv", "embed")
        out_init = meshplan.with_logical_partitioning(_dense_init((0, 1), (2,)), out_names)
        w_out = self.param("out", out_init, (h, d, e), unbox=True)
        w_out = gathered(w_out, out_names).astype(dtype)
        embed_names = ("batch", "length", "embed")
        y = jnp.einsum("bqhd,hde->bqe", y, w_out, out_sharding=_out(embed_names))
        return _constrain(y, embed_names)


class Mlp(nn.Module):
    """``gelu(x @ wi) @ wo`` with kernels named ``('embed', 'mlp')`` and ``('mlp', 'embed')``."""

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        dtype = cfg.compute_dtype
        wi_names, wo_names = ("embed", "mlp"), ("mlp", "embed")
        wi = self.param(
            "wi",
            meshplan.with_logical_partitioning(_dense_init((0,), (1,)), wi_names),
            (cfg.embed_dim, cfg.mlp_dim),
            unbox=True,
        )
        wo = self.param(
            "wo",
            meshplan.with_logical_partitioning(_dense_init((0,), (1,)), wo_names),
            (cfg.mlp_dim, cfg.embed_dim),
            unbox=True,
        )
        hidden_names = ("batch", "length", "mlp")
        y = jnp.einsum(
            "ble,em->blm", x, gathered(wi, wi_names).astype(dtype), out_sharding=_out(hidden_names)
        )
        y = _constrain(jax.nn.gelu(y), hidden_names)
        embed_names = ("batch", "length", "embed")
        y = jnp.einsum(
            "blm,me->ble", y, gathered(wo, wo_names).astype(dtype), out_sharding=_out(embed_names)
        )
        return _constrain(y, embed_names)


class Block(nn.Module):
    """A pre-norm Transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Its signature ``(carry, _) -> (carry, None)`` is the one ``nn.scan`` wants.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, _: Any = None) -> tuple[Array, None]:
        names = ("batch", "length", "embed")
        x = x + Attention(self.config, name="attention")(LayerNorm(name="attention_norm")(x))
        x = _constrain(x, names)
        x = x + Mlp(self.config, name="mlp")(LayerNorm(name="mlp_norm")(x))
        return _constrain(x, names), None


def check_length(cfg: TransformerConfig, tokens: Array) -> None:
    """Raises when ``tokens`` has more positions than the model's ``max_len``.

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan.examples.transformer import check_length, config_from_name
        >>> check_length(config_from_name("tiny", max_len=4), jnp.zeros((1, 8), jnp.int32))
        Traceback (most recent call last):
        ...
        ValueError: Sequence length 8 (tokens of shape (1, 8)) exceeds max_len=4.
        Feed at most 4 tokens per row, or use a TransformerConfig with max_len >= 8.
    """
    length = tokens.shape[1]
    if length > cfg.max_len:
        raise ValueError(
            f"Sequence length {length} (tokens of shape {tuple(tokens.shape)}) exceeds "
            f"max_len={cfg.max_len}.\nFeed at most {cfg.max_len} tokens per row, or use a "
            f"TransformerConfig with max_len >= {length}."
        )


class Transformer(nn.Module):
    """Decoder-only language model: ``tokens[batch, length] -> logits[batch, length, vocab]``.

    Tokens are embedded (a one-hot product with the ``('vocab', 'embed')``
    table, which stays valid whatever the table's sharding), given positions,
    passed through ``num_layers`` :class:`Block` s, normalised and projected to
    float32 logits by an untied ``('embed', 'vocab')`` head.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, tokens: Array) -> Array:
        cfg = self.config
        dtype = cfg.compute_dtype
        check_length(cfg, tokens)
        length = tokens.shape[1]
        tokens = _constrain(tokens, ("batch", "length"))
        embed_names = ("batch", "length", "embed")

        table_names = ("vocab", "embed")
        table = self.param(
            "embed",
            meshplan.with_logical_partitioning(nn.initializers.normal(1.0), table_names),
            (cfg.vocab_size, cfg.embed_dim),
            unbox=True,
        )
        one_hot = jax.nn.one_hot(tokens, cfg.vocab_size, dtype=dtype)
        x = jnp.einsum(
            "blv,ve->ble",
            one_hot,
            gathered(table, table_names).astype(dtype),
            out_sharding=_out(embed_names),
        )
        if cfg.positions == "learned":
            pos_names = ("length", "embed")
            pos = self.param(
                "pos_embed",
                meshplan.with_logical_partitioning(nn.initializers.normal(0.02), pos_names),
                (cfg.max_len, cfg.embed_dim),
                unbox=True,
            )
            x = x + gathered(pos, pos_names)[None, :length].astype(dtype)
        x = _constrain(x, embed_names)

        block: Any = Block
        if cfg.remat:
            block = nn.remat(Block, prevent_cse=not cfg.scan_layers)
        if cfg.scan_layers:
            x, _ = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.num_layers,
                metadata_params={meshplan.PARTITION_NAME: "layer"},
            )(cfg, name="layers")(x, None)
        else:
            for i in range(cfg.num_layers):
                x, _ = block(cfg, name=f"layers_{i}")(x, None)

        x = LayerNorm(name="final_norm")(x)
        head_names = ("embed", "vocab")
        head = self.param(
            "head",
            # Small logits at init: the loss starts near log(vocab_size).
            meshplan.with_logical_partitioning(nn.initializers.normal(0.02), head_names),
            (cfg.embed_dim, cfg.vocab_size),
            unbox=True,
        )
        logits_names = ("batch", "length", "vocab")
        logits = jnp.einsum(
            "ble,ev->blv",
            x,
            gathered(head, head_names).astype(dtype),
            preferred_element_type=jnp.float32,
            out_sharding=_out(logits_names),
        )
        return _constrain(logits.astype(jnp.float32), logits_names)


def loss_fn(params: Any, batch_tokens: Array, model: Transformer) -> Array:
    """Mean cross-entropy of next-byte prediction, in nats per byte.

    ``batch_tokens`` is ``int32[batch, length + 1]``: the model reads
    ``[:, :-1]`` and predicts ``[:, 1:]``. The log-probabilities are picked by
    a one-hot product, which works whatever the sharding of the vocabulary.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan.examples.transformer import Transformer, config_from_name, loss_fn
        >>> model = Transformer(config_from_name("tiny", num_layers=1))
        >>> tokens = jnp.zeros((2, 9), jnp.int32)
        >>> params = model.init(jax.random.key(0), tokens[:, :-1])["params"]
        >>> 4.0 < float(loss_fn(params, tokens, model)) < 8.0
        True

    Args:
        params: The model's ``params`` collection (boxed or not).
        batch_tokens: Token ids, one more than the model's sequence length.
        model: The :class:`Transformer`.

    Returns:
        A float32 scalar.
    """
    inputs, targets = batch_tokens[:, :-1], batch_tokens[:, 1:]
    # flax types apply's result as "output, or (output, variables) when mutable": not mutable here.
    logits = cast(Array, model.apply({"params": params}, inputs))
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=log_probs.dtype)
    return -jnp.mean(jnp.sum(log_probs * one_hot, axis=-1))


def parameter_count(config: TransformerConfig) -> int:
    """The number of parameters of :class:`Transformer` with ``config``, from its shapes.

    Example:
        >>> from meshplan.examples.transformer import CONFIGS, parameter_count
        >>> parameter_count(CONFIGS["tiny"]), parameter_count(CONFIGS["base"])
        (460032, 126396416)
    """
    e, m, v = config.embed_dim, config.mlp_dim, config.vocab_size
    block = 4 * e * e + 2 * e * m + 4 * e  # query, key, value, out; wi, wo; two norms
    positions = config.max_len * e if config.positions == "learned" else 0
    return config.num_layers * block + 2 * v * e + 2 * e + positions


def train_flops(config: TransformerConfig, batch: int, seq_len: int) -> int:
    """Model FLOPs of one training step (forward and backward) on ``batch`` x ``seq_len`` tokens.

    ``6 * N * tokens + 12 * L * T * E * tokens``: ``N`` the parameters
    (:func:`parameter_count`), each used in one multiply-add per token forward
    and two backward; and attention's two ``T x T`` products (scores and the
    weighted sum) per layer, ``4 * T * E`` FLOPs a token forward, twice that
    backward (``L`` layers, ``T = seq_len``, ``E = embed_dim``). The full ``T x
    T`` products are counted, as the model computes them (then masks). As usual
    for MFU: no remat recomputation, no norms, softmax or optimizer.

    Example:
        >>> from meshplan.examples.transformer import CONFIGS, train_flops
        >>> f"{train_flops(CONFIGS['base'], 32, 1024):.3e}"
        '2.897e+13'
    """
    tokens = batch * seq_len
    attention = 12 * config.num_layers * seq_len * config.embed_dim
    return 6 * parameter_count(config) * tokens + attention * tokens
