"""The byte-level Transformer of :mod:`meshplan.models.transformer`, in Flax NNX.

The same model as the Linen one: the same :class:`~meshplan.models.transformer.TransformerConfig`,
the same parameter paths, shapes and logical names (``embed``, ``vocab``,
``heads``, ``kv``, ``mlp``, ``layer``, ...), rotary or learned positions,
pre-norm blocks, the same activation constraints and the same loss. So a
layout (:mod:`meshplan.layouts`) places both alike.

What makes it a meshplan model in NNX:

* every parameter is an ``nnx.Param`` whose ``out_sharding`` holds logical
  names, and ``eager_sharding=False``: Flax never places it by itself (it would
  read the names as mesh axes, having no rules); meshplan places the state, by
  the rules in effect, through the abstract path (:class:`FunctionalTransformer`);
* with ``scan_layers`` the blocks are made by ``nnx.vmap`` with
  ``transform_metadata={nnx.PARTITION_NAME: 'layer'}`` (so every block
  parameter has a leading ``'layer'`` name) and run by ``jax.lax.scan``;
  otherwise they are ``layers_0``, ``layers_1``, ... as in Linen;
* the functional wrapper (:class:`FunctionalTransformer`) splits the module
  into a graph definition and an ``nnx.State``: ``init(key) -> state``,
  ``apply(state, tokens) -> logits`` and ``loss(state, batch) -> scalar`` are
  plain functions of arrays, for ``jax.jit`` and a functional trainer.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from meshplan.models.transformer import config_from_name
    >>> from meshplan.models.transformer_nnx import FunctionalTransformer
    >>> model = FunctionalTransformer(config_from_name("tiny", num_layers=1, embed_dim=32,
    ...                                                mlp_dim=64))
    >>> state = model.init(jax.random.key(0))
    >>> model.apply(state, jnp.zeros((2, 16), jnp.int32)).shape
    (2, 16, 256)
    >>> state["layers"]["mlp"]["wi"].out_sharding
    ('layer', 'embed', 'mlp')
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import meshplan
from meshplan._types import PyTree
from meshplan.models.pipeline import pipeline_schedule, pipelined_blocks
from meshplan.models.transformer import (
    EXPERT_WI_NAMES,
    EXPERT_WO_NAMES,
    ROUTER_NAMES,
    TransformerConfig,
    _dense_init,
    _layer_stats,
    _rotary,
    attend,
    check_length,
    gathered,
    loss_and_stats,
    moe_forward,
    pipeline_layer,
    remat_policy,
)

State: TypeAlias = nnx.State[Any, Any]
"""The model's NNX state: its variables by path."""

__all__ = [
    "Attention",
    "Block",
    "FunctionalTransformer",
    "LayerNorm",
    "Mlp",
    "MoeMlp",
    "Transformer",
]

Array = jax.Array
Names = tuple[str | None, ...]


def _param(
    rngs: nnx.Rngs, init: Callable[..., Array], shape: tuple[int, ...], names: Names
) -> nnx.Param[Array]:
    """A float32 parameter named ``names``, never placed by Flax (meshplan places the state)."""
    value = init(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _constrain(x: Array, names: Names) -> Array:
    return meshplan.with_logical_constraint(x, names)


def _out(names: Names) -> Any:
    return meshplan.explicit_out_sharding(names)


class LayerNorm(nnx.Module):
    """Layer normalisation whose scale and bias are named ``('embed',)``."""

    def __init__(self, features: int, rngs: nnx.Rngs, epsilon: float = 1e-6) -> None:
        self.epsilon = epsilon
        self.scale = _param(rngs, jax.nn.initializers.ones, (features,), ("embed",))
        self.bias = _param(rngs, jax.nn.initializers.zeros, (features,), ("embed",))

    def __call__(self, x: Array) -> Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.epsilon)
        y = y * gathered(self.scale[...], ("embed",)) + gathered(self.bias[...], ("embed",))
        return y.astype(x.dtype)


class Attention(nnx.Module):
    """Causal multi-head self-attention; projections named ``('embed', 'heads', 'kv')``."""

    IN_NAMES: Names = ("embed", "heads", "kv")
    OUT_NAMES: Names = ("heads", "kv", "embed")

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        e, h, d = config.embed_dim, config.num_heads, config.head_dim
        in_init = _dense_init((0,), (1, 2))
        self.query = _param(rngs, in_init, (e, h, d), self.IN_NAMES)
        self.key = _param(rngs, in_init, (e, h, d), self.IN_NAMES)
        self.value = _param(rngs, in_init, (e, h, d), self.IN_NAMES)
        self.out = _param(rngs, _dense_init((0, 1), (2,)), (h, d, e), self.OUT_NAMES)

    def __call__(self, x: Array, positions: Any = None) -> Array:
        cfg = self.config
        dtype = cfg.compute_dtype
        heads_names = ("batch", "length", "heads", "kv")
        positions = np.arange(x.shape[1]) if positions is None else positions

        def project(param: nnx.Param[Array]) -> Array:
            w = gathered(param[...], self.IN_NAMES).astype(dtype)
            y = jnp.einsum("ble,ehd->blhd", x, w, out_sharding=_out(heads_names))
            return _constrain(y, heads_names)

        q, k, v = project(self.query), project(self.key), project(self.value)
        if cfg.positions == "rope":
            q, k = _rotary(q, positions), _rotary(k, positions)
        y = attend(q, k, v, positions, dtype)

        w_out = gathered(self.out[...], self.OUT_NAMES).astype(dtype)
        embed_names = ("batch", "length", "embed")
        y = jnp.einsum("bqhd,hde->bqe", y, w_out, out_sharding=_out(embed_names))
        return _constrain(y, embed_names)


class Mlp(nnx.Module):
    """``gelu(x @ wi) @ wo`` with kernels named ``('embed', 'mlp')`` and ``('mlp', 'embed')``."""

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        init = _dense_init((0,), (1,))
        self.wi = _param(rngs, init, (config.embed_dim, config.mlp_dim), ("embed", "mlp"))
        self.wo = _param(rngs, init, (config.mlp_dim, config.embed_dim), ("mlp", "embed"))

    def __call__(self, x: Array) -> Array:
        dtype = self.config.compute_dtype
        hidden_names = ("batch", "length", "mlp")
        wi = gathered(self.wi[...], ("embed", "mlp")).astype(dtype)
        y = jnp.einsum("ble,em->blm", x, wi, out_sharding=_out(hidden_names))
        y = _constrain(jax.nn.gelu(y), hidden_names)
        embed_names = ("batch", "length", "embed")
        wo = gathered(self.wo[...], ("mlp", "embed")).astype(dtype)
        y = jnp.einsum("blm,me->ble", y, wo, out_sharding=_out(embed_names))
        return _constrain(y, embed_names)


class MoeMlp(nnx.Module):
    """A mixture-of-experts feed-forward block, as Linen's :class:`~meshplan.models.transformer.MoeMlp`.

    ``router`` ``('embed', 'expert')``, ``wi`` ``('expert', 'embed', 'mlp')``,
    ``wo`` ``('expert', 'mlp', 'embed')``; returns ``(y, stats)``
    (:func:`~meshplan.models.transformer.moe_forward`).
    """

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        n, e, m = config.num_experts, config.embed_dim, config.mlp_dim
        self.router = _param(rngs, _dense_init((0,), (1,)), (e, n), ROUTER_NAMES)
        self.wi = _param(rngs, _dense_init((1,), (2,)), (n, e, m), EXPERT_WI_NAMES)
        self.wo = _param(rngs, _dense_init((1,), (2,)), (n, m, e), EXPERT_WO_NAMES)

    def __call__(self, x: Array) -> tuple[Array, dict[str, Array]]:
        return moe_forward(x, self.router[...], self.wi[...], self.wo[...], self.config)


class Block(nnx.Module):
    """A pre-norm Transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``.

    Returns ``(x, stats)``: ``stats`` ``None`` for the dense MLP, the
    :class:`MoeMlp` statistics otherwise.
    """

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        self.attention_norm = LayerNorm(config.embed_dim, rngs)
        self.attention = Attention(config, rngs)
        self.mlp_norm = LayerNorm(config.embed_dim, rngs)
        self.mlp: Mlp | MoeMlp = MoeMlp(config, rngs) if config.num_experts else Mlp(config, rngs)

    def __call__(self, x: Array, positions: object = None) -> tuple[Array, PyTree]:
        names = ("batch", "length", "embed")
        x = _constrain(x + self.attention(self.attention_norm(x), positions), names)
        out = self.mlp(self.mlp_norm(x))
        y, stats = out if isinstance(out, tuple) else (out, None)
        return _constrain(x + y, names), stats


class Transformer(nnx.Module):
    """Decoder-only language model: ``tokens[batch, length] -> logits[batch, length, vocab]``.

    As :class:`meshplan.models.transformer.Transformer`: a one-hot product with
    the ``('vocab', 'embed')`` table, positions, ``num_layers`` :class:`Block` s,
    a final norm and an untied ``('embed', 'vocab')`` head giving float32 logits.
    Its parameters are created unplaced (see the module); create it under
    ``jax.set_mesh`` only through :class:`FunctionalTransformer` (or place
    ``nnx.state`` of it with :func:`meshplan.get_sharding`).
    """

    def __init__(self, config: TransformerConfig, rngs: nnx.Rngs) -> None:
        self.config = config
        cfg = config
        self.embed = _param(
            rngs,
            jax.nn.initializers.normal(1.0),
            (cfg.vocab_size, cfg.embed_dim),
            ("vocab", "embed"),
        )
        if cfg.positions == "learned":
            self.pos_embed = _param(
                rngs,
                jax.nn.initializers.normal(0.02),
                (cfg.max_len, cfg.embed_dim),
                ("length", "embed"),
            )
        if cfg.scan_layers:

            @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layer"})
            def make_blocks(r: nnx.Rngs) -> Block:
                return Block(cfg, r)

            self.layers = make_blocks(rngs.split(cfg.num_layers))
        else:
            for i in range(cfg.num_layers):
                setattr(self, f"layers_{i}", Block(cfg, rngs))
        self.final_norm = LayerNorm(cfg.embed_dim, rngs)
        # Small logits at init: the loss starts near log(vocab_size).
        self.head = _param(
            rngs,
            jax.nn.initializers.normal(0.02),
            (cfg.embed_dim, cfg.vocab_size),
            ("embed", "vocab"),
        )

    def __call__(self, tokens: Array, positions: Any = None, return_stats: bool = False) -> PyTree:
        """``logits``, or ``(logits, stats)`` with ``return_stats``, as the Linen model's."""
        cfg = self.config
        dtype = cfg.compute_dtype
        check_length(cfg, tokens)
        length = tokens.shape[1]
        tokens = _constrain(tokens, ("batch", "length"))
        embed_names = ("batch", "length", "embed")
        one_hot = jax.nn.one_hot(tokens, cfg.vocab_size, dtype=dtype)
        table = gathered(self.embed[...], ("vocab", "embed")).astype(dtype)
        x = jnp.einsum("blv,ve->ble", one_hot, table, out_sharding=_out(embed_names))
        if cfg.positions == "learned":
            pos = gathered(self.pos_embed[...], ("length", "embed"))
            picked = pos[:length] if positions is None else jnp.take(pos, positions, axis=0)
            x = x + picked[None].astype(dtype)
        x = _constrain(x, embed_names)
        order = np.arange(length) if positions is None else positions

        def run_block(x: Array, block: Block) -> tuple[Array, PyTree]:
            return block(x, order)

        run: Callable[[Array, Block], tuple[Array, PyTree]] = run_block
        if cfg.remat:
            run = jax.checkpoint(
                run_block, prevent_cse=not cfg.scan_layers, policy=remat_policy(cfg)
            )
        stats: PyTree = None
        schedule = pipeline_schedule(cfg, tokens.shape[0])
        if schedule is not None:  # the rules give 'stage' a mesh axis
            layer = pipeline_layer(cfg, _apply_block, order)
            x = pipelined_blocks(schedule, layer, self.layers, x)
        elif cfg.scan_layers:
            x, stats = jax.lax.scan(run, x, self.layers)
        else:
            stats = []
            for i in range(cfg.num_layers):
                x, layer_stats = run(x, getattr(self, f"layers_{i}"))
                if layer_stats is not None:
                    stats.append(layer_stats)

        x = self.final_norm(x)
        logits_names = ("batch", "length", "vocab")
        head = gathered(self.head[...], ("embed", "vocab")).astype(dtype)
        logits = jnp.einsum(
            "ble,ev->blv",
            x,
            head,
            preferred_element_type=jnp.float32,
            out_sharding=_out(logits_names),
        )
        logits = _constrain(logits.astype(jnp.float32), logits_names)
        return (logits, _layer_stats(stats)) if return_stats else logits


def _apply_block(cfg: TransformerConfig, block: Block, x: Array, positions: object) -> Array:
    """One dense :class:`Block` (its variables one layer's), for the pipeline."""
    out: tuple[Array, PyTree] = block(x, positions)
    return out[0]


def _create(config: TransformerConfig, key: jax.Array) -> Transformer:
    with nnx.use_eager_sharding(False):  # type: ignore[no-untyped-call]
        return Transformer(config, nnx.Rngs(key))


class _LinenApply:
    """What :func:`meshplan.models.transformer.loss_fn` calls: ``apply({"params": state}, tokens)``."""

    def __init__(self, model: FunctionalTransformer) -> None:
        self.model = model

    @property
    def config(self) -> TransformerConfig:
        return self.model.config

    def apply(self, variables: dict[str, Any], tokens: Array, **kwargs: Any) -> object:
        return self.model.module(variables["params"])(tokens, **kwargs)


class FunctionalTransformer:
    """The NNX :class:`Transformer` as functions of its state: ``init``, ``apply``, ``loss``.

    The state is ``nnx.State`` of the module's parameters: a pytree whose
    variables keep their logical names, so :func:`meshplan.get_partition_spec`,
    :func:`meshplan.get_sharding`, :func:`meshplan.explain` and optax read it
    as they read a Linen ``params`` tree.

    Args:
        config: The model's hyperparameters.

    Attributes:
        graphdef: The module's structure (``nnx.split``), the same for every state.

    Example:
        >>> import jax, meshplan
        >>> from meshplan import layouts
        >>> from meshplan.models.transformer import config_from_name
        >>> from meshplan.models.transformer_nnx import FunctionalTransformer
        >>> model = FunctionalTransformer(config_from_name("tiny"))
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> with meshplan.logical_axis_rules(layouts.fsdp_tp):
        ...     shardings = meshplan.get_sharding(model.abstract_state(), mesh, strict=True)
        ...     state = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0))
        >>> state["layers"]["mlp"]["wi"].get_value().sharding.spec
        P(None, 'data', 'model')
    """

    def __init__(self, config: TransformerConfig) -> None:
        self.config = config
        graphdef, _ = nnx.split(nnx.eval_shape(lambda: _create(config, jax.random.key(0))))
        self.graphdef = graphdef

    def init(self, key: jax.Array) -> State:
        """The parameters of a new model from ``key`` (jit it with ``out_shardings`` to place them)."""
        return nnx.state(_create(self.config, key))

    def abstract_state(self, key: jax.Array | None = None) -> State:
        """``jax.eval_shape`` of :meth:`init`: shapes, dtypes and names, no arrays."""
        key = jax.random.key(0) if key is None else key
        abstract: State = jax.eval_shape(self.init, key)
        return abstract

    def module(self, state: State) -> Transformer:
        """The :class:`Transformer` holding ``state``."""
        model: Transformer = nnx.merge(self.graphdef, state)
        return model

    def apply(self, state: State, tokens: Array) -> Array:
        """``logits[batch, length, vocab]`` (float32) of ``tokens[batch, length]``."""
        logits: Array = self.module(state)(tokens)
        return logits

    def loss(self, state: State, batch: Array) -> Array:
        """Mean next-byte cross-entropy of ``batch`` (``int32[batch, length + 1]``), in nats.

        The Linen model's :func:`~meshplan.models.transformer.loss_fn`, run on this model.
        """
        return self.loss_and_stats(state, batch)[0]

    def loss_and_stats(self, state: State, batch: Array) -> tuple[Array, dict[str, Array]]:
        """:meth:`loss` and what it measured (:func:`~meshplan.models.transformer.loss_and_stats`)."""
        return loss_and_stats(state, batch, _LinenApply(self))
