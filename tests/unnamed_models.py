"""Training steps of models written without meshplan, and the names a person writes for them.

``(abstract_state, step_fn, tokens)`` of Hugging Face's ``FlaxGPT2LMHeadModel`` and
``FlaxLlamaForCausalLM`` (from a config, abstract weights: nothing downloaded or
initialised), and of meshplan's own Transformer and Llama examples; the Hugging Face
models' path rules as a person writes them by hand, once. Shared by
``tests/search/test_infer_search.py`` and ``benchmarks/bench_infer.py``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

GPT2_NAMES = (
    (r".*/wte/embedding", ("vocab", "embed")),
    (r".*/wpe/embedding", (None, "embed")),
    (r".*/attn/c_attn/kernel", ("heads", "embed")),  # Conv1D kernels are [out, in]
    (r".*/attn/c_attn/bias", ("heads",)),
    (r".*/attn/c_proj/kernel", ("embed", "heads")),
    (r".*/mlp/c_fc/kernel", ("mlp", "embed")),
    (r".*/mlp/c_fc/bias", ("mlp",)),
    (r".*/mlp/c_proj/kernel", ("embed", "mlp")),
    (r".*/(ln_1|ln_2|ln_f)/(scale|bias)|.*/c_proj/bias", ("embed",)),
    (r".*", None),
)
"""GPT-2's names by path, as a person writes them (``None``: the step and Adam's count)."""

LLAMA_NAMES = (
    (r".*/embed_tokens/embedding", ("vocab", "embed")),
    (r".*/(q_proj|k_proj|v_proj)/kernel", ("embed", "heads")),
    (r".*/o_proj/kernel", ("heads", "embed")),
    (r".*/(gate_proj|up_proj)/kernel", ("embed", "mlp")),
    (r".*/down_proj/kernel", ("mlp", "embed")),
    (r".*/lm_head/kernel", ("embed", "vocab")),
    (r".*/(input_layernorm|post_attention_layernorm|norm)/weight", ("embed",)),
    (r".*", None),
)
"""Hugging Face Llama's names by path, as a person writes them."""


def _loss(logits: Any, tokens: Any) -> Any:
    logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
    target = jax.nn.one_hot(tokens[:, 1:], logits.shape[-1], dtype=logp.dtype)
    return -jnp.mean(jnp.sum(logp * target, axis=-1))


def hf_step(model: Any, batch: int, seq: int) -> tuple[Any, Any, Any]:
    """A Hugging Face Flax causal LM's train step (AdamW), its abstract state and tokens."""
    params = jax.eval_shape(lambda key: model.init_weights(key, (1, seq)), jax.random.key(0))

    def init(p: Any) -> Any:
        return train_state.TrainState.create(
            apply_fn=model.__call__, params=p, tx=optax.adamw(1e-4)
        )

    def step(state: Any, tokens: Any) -> Any:
        def loss(p: Any) -> Any:
            return _loss(model(tokens, params=p).logits, tokens)

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    return jax.eval_shape(init, params), step, jax.ShapeDtypeStruct((batch, seq), jnp.int32)


def gpt2(
    embed: int = 256,
    heads: int = 4,
    layers: int = 2,
    vocab: int = 1024,
    batch: int = 16,
    seq: int = 128,
) -> tuple[Any, Any, Any]:
    """``FlaxGPT2LMHeadModel`` from a config."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(n_embd=embed, n_head=heads, n_layer=layers, vocab_size=vocab, n_positions=seq)
    return hf_step(FlaxGPT2LMHeadModel(cfg, seed=0, _do_init=False), batch, seq)


def hf_llama(
    embed: int = 256,
    heads: int = 4,
    mlp: int = 512,
    layers: int = 2,
    vocab: int = 1024,
    batch: int = 16,
    seq: int = 128,
    kv_heads: int | None = None,
) -> tuple[Any, Any, Any]:
    """``FlaxLlamaForCausalLM`` from a config (``kv_heads``: grouped-query attention's key and
    value heads; as many as ``heads`` if not given)."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=embed,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads or heads,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        vocab_size=vocab,
        max_position_embeddings=seq,
    )
    return hf_step(FlaxLlamaForCausalLM(cfg, seed=0, _do_init=False), batch, seq)


def transformer(size: str = "tiny", batch: int = 16, seq: int = 128, **overrides: Any) -> Any:
    """meshplan's Transformer example (named), its Adam train step and tokens."""
    from meshplan.models.transformer import Transformer, config_from_name, loss_fn
    from meshplan.train.settings import TrainSettings
    from meshplan.train.state import abstract_train_state

    model = Transformer(config_from_name(size, **overrides))
    state = abstract_train_state(model, optax.adam(1e-3), TrainSettings(batch=batch, seq_len=seq))

    def step(state: Any, tokens: Any) -> Any:
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    return state, step, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)


def llama(batch: int = 16, seq: int = 128, **config: Any) -> Any:
    """meshplan's Llama example (named), its AdamW train step and tokens."""
    from meshplan.models.llama import LlamaConfig, llama_step

    return llama_step(LlamaConfig(**config), batch, seq)
