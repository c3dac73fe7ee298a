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

A mixture-of-experts model (``num_experts > 0``) adds ``expert``,
``expert_batch`` and ``capacity`` (:mod:`meshplan.models.moe`).

Context parallelism: a rule for ``length`` (``('length', 'context')``) splits
every activation along the sequence. Attention stays exact: queries keep their
piece of the sequence and keys and values are gathered whole over that axis
(one all-gather per layer; see :class:`Attention` for why not ring attention),
and :func:`loss_fn` feeds the sequence in load-balanced order
(:mod:`meshplan.models.context`) so that the causal mask leaves every shard
the same work.

Parameters sharded over the mesh axes that also split the batch (FSDP) are
gathered over those axes just before use (:func:`gathered`): the forward pass
all-gathers them and the backward pass reduce-scatters their gradients.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from meshplan.models.transformer import Transformer, config_from_name
    >>> config = config_from_name("tiny", num_layers=1, embed_dim=32, mlp_dim=64)
    >>> model = Transformer(config)
    >>> tokens = jnp.zeros((2, 16), jnp.int32)
    >>> params = model.init(jax.random.key(0), tokens)["params"]
    >>> model.apply({"params": params}, tokens).shape
    (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jax.typing import DTypeLike

import meshplan
from meshplan._spmd.place import apply_spec  # not public: constrain on Auto, reshard on Explicit
from meshplan._types import PyTree
from meshplan.models.context import context_shards, load_balanced_order
from meshplan.models.moe import expert_capacity, route
from meshplan.models.pipeline import pipeline_schedule, pipelined_blocks

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

REMAT_POLICIES = ("full", "dots_saveable")
"""What a rematerialised block may keep (:attr:`TransformerConfig.remat_policy`)."""

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
        remat_policy: What a rematerialised block keeps (with ``remat``):
            ``"full"`` keeps only its input; ``"dots_saveable"`` keeps the
            results of its matrix products too (``jax.checkpoint_policies.dots_saveable``)
            and recomputes the rest (norms, softmax, activations).
        num_experts: Experts of a mixture-of-experts feed-forward block in each
            layer (:class:`MoeMlp`); 0 (the default): the dense :class:`Mlp`.
        top_k: Experts each token is routed to (with ``num_experts``).
        capacity_factor: Slots of an expert per sequence, as a multiple of its
            fair share ``top_k * length / num_experts``; choices beyond them are dropped.
        aux_loss_coef: Weight of the load-balancing loss (the mean over layers) in :func:`loss_fn`.
        microbatches: Microbatches of a pipeline (:mod:`meshplan.models.pipeline`): used
            when the active rules map ``'stage'`` to mesh axes of more than one device.
        pipeline_repeats: Layer groups each pipeline stage holds (1: GPipe; more: the
            circular schedule).
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
    remat_policy: str = "full"
    num_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_loss_coef: float = 0.01
    microbatches: int = 1
    pipeline_repeats: int = 1

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
        counts = ("vocab_size", "num_layers", "num_heads", "embed_dim", "mlp_dim", "max_len")
        for field in (*counts, "microbatches", "pipeline_repeats"):
            if getattr(self, field) < 1:
                problems.append(f"{field} must be positive, got {getattr(self, field)}")
        if self.remat_policy not in REMAT_POLICIES:
            problems.append(
                f"remat_policy must be one of {', '.join(REMAT_POLICIES)}, got {self.remat_policy!r}"
            )
        if self.num_experts < 0:
            problems.append(f"num_experts must be 0 (dense) or more, got {self.num_experts}")
        elif self.num_experts and not 1 <= self.top_k <= self.num_experts:
            problems.append(
                f"top_k must be between 1 and num_experts={self.num_experts}, got {self.top_k}"
            )
        if not 0 < self.capacity_factor < math.inf:
            problems.append(
                f"capacity_factor must be a finite number above 0, got {self.capacity_factor}"
            )
        elif self.num_experts and self.capacity_factor > self.num_experts:
            problems.append(
                f"capacity_factor must be at most num_experts={self.num_experts}, got "
                f"{self.capacity_factor:g} (from {self.num_experts / self.top_k:g}, that is "
                f"num_experts / top_k, up, every choice of every token already has a slot)"
            )
        if not self.aux_loss_coef >= 0:
            problems.append(f"aux_loss_coef must be 0 or more, got {self.aux_loss_coef}")
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

    def to_dict(self) -> dict[str, object]:
        """The config as a JSON-able dict (for checkpoints).

        Example:
            >>> from meshplan.models.transformer import TransformerConfig
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

CONFIG_SETTINGS: dict[str, dict[str, object]] = {
    "base": {"batch": 32, "seq_len": 1024, "lr": 6e-4, "warmup": 100},
}
"""Training settings a preset brings along (``meshplan train --size base``), unless given."""


def config_from_name(name: str, **overrides: Any) -> TransformerConfig:
    """A preset from :data:`CONFIGS`, with fields replaced by ``overrides``.

    Example:
        >>> from meshplan.models.transformer import config_from_name
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


def _axes(entry: object) -> tuple[str, ...]:
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple):
        return entry
    return ()


def gathered(weight: Array, names: tuple[str | None, ...], keep: tuple[str, ...] = ()) -> Array:
    """``weight`` as the computation uses it: gathered over the mesh axes that split activations.

    With rules that shard a parameter over the same mesh axes as the batch
    (FSDP), or as the sequence (``length``, context parallelism), each device
    holds a slice of the parameter but needs all of it to process its own
    tokens. This constrains the parameter to its spec with those mesh axes
    removed: an all-gather in the forward pass, a reduce-scatter of its
    gradient in the backward pass. Dimensions named in ``keep`` keep their
    axes (an MoE block's ``'expert'`` dimension: each device runs its own
    experts). Without a mesh, rules, or such axes it returns ``weight`` unchanged.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan.models.transformer import gathered
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
    split = meshplan.logical_to_mesh_axes(("batch", "length"), rules)
    batch_axes = set(_axes(split[0])) | set(_axes(split[1]))
    spec = meshplan.logical_to_mesh_axes(names, rules)
    drop = [
        name not in keep and bool(batch_axes & set(_axes(e)))
        for name, e in zip(names, spec, strict=False)
    ]
    if not any(drop):
        return weight
    kept = []
    for entry, dropped in zip(spec, drop, strict=False):
        left = tuple(a for a in _axes(entry) if not dropped or a not in batch_axes)
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


_HOST_MASK_LIMIT = 1 << 26
"""The largest causal mask (elements) built on the host with NumPy: 64 MiB of bools."""


def causal_mask(positions: object) -> Any:
    """``mask[q, k]``: query ``q`` may attend to key ``k`` (position ``k <= q``), in any order.

    Example:
        >>> import numpy as np
        >>> from meshplan.models.transformer import causal_mask
        >>> causal_mask(np.array([0, 3, 1, 2])).astype(int).tolist()
        [[1, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0], [1, 0, 1, 1]]
    """
    # A host mask is a constant of the compiled step; one too big for the host (a million
    # positions: 931 GiB) is left to JAX, which traces it without building it, so that
    # the memory check can refuse the step instead of NumPy's allocation failing.
    small = isinstance(positions, np.ndarray) and positions.size**2 <= _HOST_MASK_LIMIT
    xp = np if small else jnp
    return xp.asarray(positions)[:, None] >= xp.asarray(positions)[None, :]


def attend(q: Array, k: Array, v: Array, positions: object, dtype: DTypeLike) -> Array:
    """Exact causal attention of ``q[batch, length, heads, kv]`` over all of ``k`` and ``v``.

    Queries keep their piece of the sequence; keys and values are constrained
    whole along it (``(batch, None, heads, kv)``), so when a rule splits
    ``length`` over a ``context`` mesh axis XLA all-gathers them over that
    axis, once per layer, and each device computes the scores of its own
    queries against every key: exact, and memory ``~1/N`` for everything but
    the gathered keys and values. Ring attention (collective permutes of key
    and value blocks, overlapped with compute) would avoid holding all of them
    at once, but it needs a hand-written ``shard_map`` loop with an online
    softmax; the all-gather is what MaxText does by default, is exact by
    construction, and any rules place it.
    """
    kv_names = ("batch", None, "heads", "kv")
    k, v = _constrain(k, kv_names), _constrain(v, kv_names)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / np.sqrt(q.shape[-1]).astype(np.float32)
    scores = _constrain(scores, ("batch", "heads", "length", None))
    scores = jnp.where(causal_mask(positions)[None, None], scores, np.finfo(np.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    y = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    return _constrain(y, ("batch", "length", "heads", "kv"))


class Attention(nn.Module):
    """Causal multi-head self-attention; projections named ``('embed', 'heads', 'kv')``.

    ``positions`` (``int[length]``) are the positions of the tokens, in the
    order they come (:func:`attend` explains the context-parallel case).
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, positions: Any = None) -> Array:
        cfg = self.config
        dtype = cfg.compute_dtype
        e, h, d = cfg.embed_dim, cfg.num_heads, cfg.head_dim
        in_names = ("embed", "heads", "kv")
        in_init = meshplan.with_logical_partitioning(_dense_init((0,), (1, 2)), in_names)
        heads_names = ("batch", "length", "heads", "kv")
        positions = np.arange(x.shape[1]) if positions is None else positions

        def project(name: str) -> Array:
            w = gathered(self.param(name, in_init, (e, h, d), unbox=True), in_names).astype(dtype)
            y = jnp.einsum("ble,ehd->blhd", x, w, out_sharding=_out(heads_names))
            return _constrain(y, heads_names)

        q, k, v = project("query"), project("key"), project("value")
        if cfg.positions == "rope":
            q, k = _rotary(q, positions), _rotary(k, positions)
        y = attend(q, k, v, positions, dtype)

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


ROUTER_NAMES = ("embed", "expert")
EXPERT_WI_NAMES = ("expert", "embed", "mlp")
EXPERT_WO_NAMES = ("expert", "mlp", "embed")


def moe_forward(
    x: Array, router: Array, wi: Array, wo: Array, cfg: TransformerConfig
) -> tuple[Array, dict[str, Array]]:
    """The mixture-of-experts feed-forward of ``x[batch, length, embed]``, and its statistics.

    Route (:func:`meshplan.models.moe.route`), dispatch each token to its
    experts' slots (an all-to-all over the ``expert`` mesh axis when rules
    shard experts), run every expert's ``gelu(x @ wi) @ wo`` on its slots, and
    combine the outputs weighted by the gates (the all-to-all back). Returns
    the output and ``{"aux_loss", "dropped", "routed"}`` (float32 scalars).
    Shared by the Linen and the NNX models.
    """
    dtype = cfg.compute_dtype
    capacity = expert_capacity(
        x.shape[1],
        num_experts=cfg.num_experts,
        top_k=cfg.top_k,
        capacity_factor=cfg.capacity_factor,
    )
    logits = jnp.einsum(
        "blm,me->ble",
        x.astype(jnp.float32),
        gathered(router, ROUTER_NAMES),
        out_sharding=_out(("batch", "length", "expert")),
    )
    probs = jax.nn.softmax(_constrain(logits, ("batch", "length", "expert")), axis=-1)
    routing = route(probs, top_k=cfg.top_k, capacity=capacity)
    slot_names = ("batch", "length", "expert", "capacity")
    dispatch = _constrain(routing.dispatch.astype(dtype), slot_names)
    combine = _constrain(routing.combine.astype(dtype), slot_names)
    token_names = ("expert", "expert_batch", "capacity", "embed")
    tokens = jnp.einsum("blec,blm->ebcm", dispatch, x, out_sharding=_out(token_names))
    tokens = _constrain(tokens, token_names)
    wi = gathered(wi, EXPERT_WI_NAMES, keep=("expert",)).astype(dtype)
    hidden_names = ("expert", "expert_batch", "capacity", "mlp")
    hidden = jnp.einsum("ebcm,emh->ebch", tokens, wi, out_sharding=_out(hidden_names))
    hidden = _constrain(jax.nn.gelu(hidden), hidden_names)
    wo = gathered(wo, EXPERT_WO_NAMES, keep=("expert",)).astype(dtype)
    out = jnp.einsum("ebch,ehm->ebcm", hidden, wo, out_sharding=_out(token_names))
    out = _constrain(out, token_names)
    embed_names = ("batch", "length", "embed")
    y = jnp.einsum("blec,ebcm->blm", combine, out, out_sharding=_out(embed_names))
    stats = {"aux_loss": routing.aux_loss, "dropped": routing.dropped, "routed": routing.routed}
    return _constrain(y, embed_names), stats


class MoeMlp(nn.Module):
    """A mixture-of-experts feed-forward block: ``num_experts`` MLPs and a top-k router.

    Parameters ``router`` ``('embed', 'expert')``, ``wi`` ``('expert', 'embed',
    'mlp')`` and ``wo`` ``('expert', 'mlp', 'embed')``; the computation is
    :func:`moe_forward`. Returns ``(y, stats)``.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array) -> tuple[Array, dict[str, Array]]:
        cfg = self.config
        n, e, m = cfg.num_experts, cfg.embed_dim, cfg.mlp_dim
        router = self.param(
            "router",
            meshplan.with_logical_partitioning(_dense_init((0,), (1,)), ROUTER_NAMES),
            (e, n),
            unbox=True,
        )
        wi = self.param(
            "wi",
            meshplan.with_logical_partitioning(_dense_init((1,), (2,)), EXPERT_WI_NAMES),
            (n, e, m),
            unbox=True,
        )
        wo = self.param(
            "wo",
            meshplan.with_logical_partitioning(_dense_init((1,), (2,)), EXPERT_WO_NAMES),
            (n, m, e),
            unbox=True,
        )
        return moe_forward(x, router, wi, wo, cfg)


class Block(nn.Module):
    """A pre-norm Transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Its signature ``(carry, positions) -> (carry, stats)`` is the one ``nn.scan``
    wants (``positions`` broadcast to every layer); ``stats`` is ``None`` for
    the dense MLP and the :class:`MoeMlp` statistics otherwise.
    """

    config: TransformerConfig

    @nn.compact
    def __call__(self, x: Array, positions: object = None) -> tuple[Array, PyTree]:
        names = ("batch", "length", "embed")
        attention = Attention(self.config, name="attention")
        x = x + attention(LayerNorm(name="attention_norm")(x), positions)
        x = _constrain(x, names)
        normed = LayerNorm(name="mlp_norm")(x)
        stats = None
        if self.config.num_experts:
            y, stats = MoeMlp(self.config, name="mlp")(normed)
        else:
            y = Mlp(self.config, name="mlp")(normed)
        return _constrain(x + y, names), stats


def _apply_block(cfg: TransformerConfig, params: PyTree, x: Array, positions: object) -> Array:
    """One dense :class:`Block` with ``params`` (one layer's), as a pure function."""
    out: tuple[Array, PyTree] = Block(cfg, parent=None).apply({"params": params}, x, positions)
    return out[0]


def pipeline_layer(
    cfg: TransformerConfig,
    apply_block: Callable[[TransformerConfig, PyTree, Array, object], Array],
    positions: object,
) -> Callable[[PyTree, Array], Array]:
    """``layer(params, x) -> x``: one block for the pipeline, rematerialised as ``cfg`` says."""

    def layer(params: PyTree, x: Array) -> Array:
        return apply_block(cfg, params, x, positions)

    return jax.checkpoint(layer, policy=remat_policy(cfg)) if cfg.remat else layer


def remat_policy(cfg: TransformerConfig) -> Any:
    """The ``jax.checkpoint`` policy of :attr:`TransformerConfig.remat_policy` (``None``: full)."""
    return jax.checkpoint_policies.dots_saveable if cfg.remat_policy == "dots_saveable" else None


def _layer_stats(stats: PyTree) -> dict[str, Array] | None:
    """Per-layer MoE statistics (stacked by scan, or a list) -> aux loss mean, counts summed."""
    if stats is None or (isinstance(stats, list) and not stats):
        return None
    if isinstance(stats, list):
        stats = jax.tree.map(lambda *xs: jnp.stack(xs), *stats)
    return {
        "aux_loss": jnp.mean(stats["aux_loss"]),
        "dropped": jnp.sum(stats["dropped"]),
        "routed": jnp.sum(stats["routed"]),
    }


def check_length(cfg: TransformerConfig, tokens: Array) -> None:
    """Raises when ``tokens`` has more positions than the model's ``max_len``.

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan.models.transformer import check_length, config_from_name
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
    def __call__(self, tokens: Array, positions: Any = None, return_stats: bool = False) -> PyTree:
        """``logits``, or ``(logits, stats)`` with ``return_stats`` (``None`` for a dense model).

        ``positions`` (``int[length]``, default ``arange(length)``): the position
        of each token, for a sequence fed in another order (context parallelism).
        """
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
            pos = gathered(pos, pos_names)
            picked = pos[:length] if positions is None else jnp.take(pos, positions, axis=0)
            x = x + picked[None].astype(dtype)
        x = _constrain(x, embed_names)
        if positions is None:
            positions = np.arange(length)

        block: Any = Block
        if cfg.remat:
            block = nn.remat(Block, prevent_cse=not cfg.scan_layers, policy=remat_policy(cfg))
        stats: PyTree = None
        schedule = None if self.is_initializing() else pipeline_schedule(cfg, tokens.shape[0])
        if schedule is not None:
            layers = meshplan.unbox(self.variables["params"]["layers"])
            x = pipelined_blocks(schedule, pipeline_layer(cfg, _apply_block, positions), layers, x)
        elif cfg.scan_layers:
            x, stats = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                in_axes=nn.broadcast,
                length=cfg.num_layers,
                metadata_params={meshplan.PARTITION_NAME: "layer"},
            )(cfg, name="layers")(x, positions)
        else:
            stats = []
            for i in range(cfg.num_layers):
                x, layer_stats = block(cfg, name=f"layers_{i}")(x, positions)
                if layer_stats is not None:
                    stats.append(layer_stats)

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
        logits = _constrain(logits.astype(jnp.float32), logits_names)
        return (logits, _layer_stats(stats)) if return_stats else logits


def loss_and_stats(
    params: PyTree, batch_tokens: Array, model: Any
) -> tuple[Array, dict[str, Array]]:
    """:func:`loss_fn` and what it measured: ``{"ce"}``, and for MoE ``aux_loss``, ``dropped``, ``routed``.

    The sequence goes in load-balanced order (:func:`meshplan.models.context.load_balanced_order`)
    when the active rules split ``length``; inputs, targets and positions are
    permuted alike, so the loss is the same as in order. ``model`` is anything
    with Linen's ``apply({"params": params}, tokens, positions=..., return_stats=True)``.
    """
    inputs, targets = batch_tokens[:, :-1], batch_tokens[:, 1:]
    shards = context_shards()
    positions = None
    if shards > 1:
        positions = load_balanced_order(inputs.shape[1], shards)
        inputs, targets = inputs[:, positions], targets[:, positions]
    logits, stats = model.apply({"params": params}, inputs, positions=positions, return_stats=True)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    one_hot = jax.nn.one_hot(targets, logits.shape[-1], dtype=log_probs.dtype)
    ce = -jnp.mean(jnp.sum(log_probs * one_hot, axis=-1))
    if stats is None:
        return ce, {"ce": ce}
    loss = ce + model.config.aux_loss_coef * stats["aux_loss"]
    return loss, {"ce": ce, **stats}


def loss_fn(params: PyTree, batch_tokens: Array, model: Transformer) -> Array:
    """Mean cross-entropy of next-byte prediction, in nats per byte (plus, for MoE, the aux loss).

    ``batch_tokens`` is ``int32[batch, length + 1]``: the model reads
    ``[:, :-1]`` and predicts ``[:, 1:]``. The log-probabilities are picked by
    a one-hot product, which works whatever the sharding of the vocabulary.
    A mixture-of-experts model adds ``aux_loss_coef`` times its load-balancing
    loss; under rules that split ``length`` the sequence is fed in
    load-balanced order (:func:`loss_and_stats`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan.models.transformer import Transformer, config_from_name, loss_fn
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
    return loss_and_stats(params, batch_tokens, model)[0]


def parameter_count(config: TransformerConfig) -> int:
    """The number of parameters of :class:`Transformer` with ``config``, from its shapes.

    Example:
        >>> from meshplan.models.transformer import CONFIGS, parameter_count
        >>> parameter_count(CONFIGS["tiny"]), parameter_count(CONFIGS["base"])
        (460032, 126396416)
    """
    return _parameters(config, active=False)


def _parameters(config: TransformerConfig, *, active: bool) -> int:
    """All parameters, or (``active``) those one token uses: ``top_k`` of the experts."""
    e, m, v, n = config.embed_dim, config.mlp_dim, config.vocab_size, config.num_experts
    mlp = 2 * e * m
    if n:
        mlp = (config.top_k if active else n) * 2 * e * m + e * n  # experts, router
    block = 4 * e * e + mlp + 4 * e  # query, key, value, out; the MLP or experts; two norms
    positions = config.max_len * e if config.positions == "learned" else 0
    return config.num_layers * block + 2 * v * e + 2 * e + positions


def train_flops(config: TransformerConfig, batch: int, seq_len: int) -> int:
    """Model FLOPs of one training step (forward and backward) on ``batch`` x ``seq_len`` tokens.

    ``6 * N * tokens + 12 * L * T * E * tokens``: ``N`` the parameters a token
    uses (:func:`parameter_count`; of a mixture of experts, ``top_k`` experts), each used in one multiply-add per token forward
    and two backward; and attention's two ``T x T`` products (scores and the
    weighted sum) per layer, ``4 * T * E`` FLOPs a token forward, twice that
    backward (``L`` layers, ``T = seq_len``, ``E = embed_dim``). The full ``T x
    T`` products are counted, as the model computes them (then masks). As usual
    for MFU: no remat recomputation, no norms, softmax or optimizer.

    Example:
        >>> from meshplan.models.transformer import CONFIGS, train_flops
        >>> f"{train_flops(CONFIGS['base'], 32, 1024):.3e}"
        '2.897e+13'
    """
    tokens = batch * seq_len
    attention = 12 * config.num_layers * seq_len * config.embed_dim
    return 6 * _parameters(config, active=True) * tokens + attention * tokens
