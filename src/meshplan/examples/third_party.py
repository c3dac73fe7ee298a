"""Models nobody here wrote, as ``--model`` factories: Hugging Face Flax GPT-2 and Llama,
an Equinox MLP, and a plain-JAX MLP, each with the path rules that name it.

None of them carries a logical name. Each factory returns ``((init, apply),
example_batch, loss, batches)``: the model as a pair of JAX functions
(:mod:`meshplan.cli.factory_names`), so that ``meshplan plan|search|train --model
meshplan.examples.third_party:gpt2 --names FILE`` plans and trains it. The
``*_NAMES`` constants are those files' contents: ``(pattern, names)`` pairs over
the paths ``meshplan plan`` prints (``params/transformer/h/0/mlp/c_fc/kernel``), in
the vocabulary of the built-in layouts (``embed``, ``mlp``, ``heads``, ``kv``,
``vocab``), so ``--rules fsdp_tp`` and the others place them.

The Hugging Face models are tiny configs with random weights (``_do_init=False``:
the weights are created by ``init``, nothing is downloaded) on byte-level text
(:class:`meshplan.models.data.ByteCorpus`, the Python standard library);
``transformers`` and ``equinox`` are imported when a factory is called, so the
library does not depend on them.

Example:
    >>> from meshplan.examples.third_party import jax_mlp
    >>> (init, apply), (images, labels), loss, batches = jax_mlp()
    >>> import jax
    >>> apply(init(jax.random.key(0)), images).shape
    (16, 4)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshplan._types import PyTree
from meshplan.examples.own_model import CLASSES, HIDDEN, SIDE, cross_entropy, make_batch

__all__ = [
    "EQUINOX_NAMES",
    "GPT2_NAMES",
    "JAX_NAMES",
    "LLAMA_NAMES",
    "equinox_mlp",
    "gpt2",
    "jax_mlp",
    "llama",
]

Names = tuple[tuple[str, tuple[str | None, ...] | None], ...]
Factory = tuple[tuple[Callable[..., Any], Callable[..., Any]], Any, Callable[..., Any], Any]

BATCH, SEQ, VOCAB = 8, 32, 256
"""The language models' batch: 8 windows of 32 bytes (a byte is a token: 256 of them)."""

GPT2_NAMES: Names = (
    # Hugging Face's GPT-2 keeps its kernels (out, in), as the original Conv1D did.
    (r"params/transformer/wte/embedding", ("vocab", "embed")),
    (r"params/transformer/wpe/embedding", (None, "embed")),
    (r".*/attn/c_attn/kernel", ("heads", "embed")),  # q, k and v fused: 3 x heads x head_dim
    (r".*/attn/c_attn/bias", ("heads",)),
    (r".*/attn/c_proj/kernel", ("embed", "heads")),
    (r".*/mlp/c_fc/kernel", ("mlp", "embed")),
    (r".*/mlp/c_fc/bias", ("mlp",)),
    (r".*/mlp/c_proj/kernel", ("embed", "mlp")),
    (r".*/(c_proj/bias|ln_\d/bias|ln_\d/scale|ln_f/bias|ln_f/scale)", ("embed",)),
)
"""Path rules of :func:`gpt2`: every parameter named."""

LLAMA_NAMES: Names = (
    (r"params/model/embed_tokens/embedding", ("vocab", "embed")),
    (r".*/self_attn/q_proj/kernel", ("embed", "heads")),
    (r".*/self_attn/(k_proj|v_proj)/kernel", ("embed", "kv")),
    (r".*/self_attn/o_proj/kernel", ("heads", "embed")),
    (r".*/mlp/(gate_proj|up_proj)/kernel", ("embed", "mlp")),
    (r".*/mlp/down_proj/kernel", ("mlp", "embed")),
    (r".*norm/weight", ("embed",)),
    (r"params/lm_head/kernel", ("embed", "vocab")),
)
"""Path rules of :func:`llama`: every parameter named."""

EQUINOX_NAMES: Names = (
    # Equinox keeps a Linear's weight (out, in); the module's arrays sit under its name.
    (r"params/MLP/layers/0/weight", ("mlp", "embed")),
    (r"params/MLP/layers/0/bias", ("mlp",)),
    (r"params/MLP/layers/1/weight", ("vocab", "mlp")),
    (r"params/MLP/layers/1/bias", (None,)),
)
"""Path rules of :func:`equinox_mlp`: the hidden layer's dimension is ``mlp``."""

JAX_NAMES: Names = (
    (r"params/w1", ("embed", "mlp")),
    (r"params/b1", ("mlp",)),
    (r"params/w2", ("mlp", "vocab")),
    (r"params/b2", (None,)),
)
"""Path rules of :func:`jax_mlp`."""


# -- the classifiers' data: own_model's 4x4 "images" in 4 classes ---------------------


def _image_batches(split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
    return make_batch(1 if split == "train" else 2, index)


def _flat(images: jax.Array) -> jax.Array:
    return images.reshape((images.shape[0], -1))


def jax_mlp() -> Factory:
    """A plain-JAX MLP classifier: ``init`` makes a dict of arrays, ``apply`` is a function."""

    def init(key: jax.Array) -> dict[str, jax.Array]:
        k1, k2 = jax.random.split(key)
        return {
            "w1": jax.random.normal(k1, (SIDE * SIDE, HIDDEN)) / SIDE,
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
            "b2": jnp.zeros(CLASSES),
        }

    def apply(params: dict[str, jax.Array], images: jax.Array) -> jax.Array:
        hidden = jax.nn.relu(_flat(images) @ params["w1"] + params["b1"])
        return hidden @ params["w2"] + params["b2"]

    return (init, apply), _image_batches("train", 0), cross_entropy, _image_batches


def equinox_mlp() -> Factory:
    """An Equinox ``eqx.nn.MLP`` classifier, split by ``eqx.partition`` into arrays and the rest."""
    import equinox as eqx

    def make(key: jax.Array) -> object:
        return eqx.nn.MLP(SIDE * SIDE, CLASSES, HIDDEN, depth=1, key=key)

    _, static = eqx.partition(eqx.filter_eval_shape(make, jax.random.key(0)), eqx.is_array)

    def init(key: jax.Array) -> object:
        return eqx.filter(make(key), eqx.is_array)

    def apply(params: PyTree, images: jax.Array) -> jax.Array:
        model = eqx.combine(params, static)
        return jnp.asarray(jax.vmap(model)(_flat(images)))

    return (init, apply), _image_batches("train", 0), cross_entropy, _image_batches


# -- the language models: Hugging Face's Flax models on byte-level text -------------------


@functools.cache
def _corpus() -> Any:
    from meshplan.models.data import ByteCorpus

    return ByteCorpus.from_stdlib(max_bytes=400_000)


def _text_batches(split: str, index: int) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)``: windows of the corpus, the targets one byte on."""
    tokens = _corpus().batch_at(split, index, seed=0, batch=BATCH, seq_len=SEQ)
    return tokens[:, :-1], tokens[:, 1:]


def _next_token_loss(logits: jax.Array, batch: tuple[object, object]) -> jax.Array:
    _, targets = batch
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets))


def _example_text() -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    return tokens, tokens


def _hf_factory(model: Any) -> Factory:
    """``(init, apply)`` of a Hugging Face Flax model built with ``_do_init=False``."""

    def init(key: jax.Array) -> object:
        return model.init_weights(key, (1, SEQ))

    def apply(params: PyTree, ids: jax.Array) -> jax.Array:
        return jnp.asarray(model(ids, params=params).logits)

    init.__qualname__ = f"{type(model).__name__}.init_weights"
    apply.__qualname__ = f"{type(model).__name__}.__call__"
    return (init, apply), _example_text(), _next_token_loss, _text_batches


def gpt2() -> Factory:
    """Hugging Face's ``FlaxGPT2LMHeadModel``: 2 layers, width 64, 4 heads, bytes as tokens."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, n_inner=256
    )
    return _hf_factory(FlaxGPT2LMHeadModel(config, _do_init=False))


def llama() -> Factory:
    """Hugging Face's ``FlaxLlamaForCausalLM``: 2 layers, width 64, 4 heads (2 for keys and
    values), bytes as tokens."""
    from transformers import FlaxLlamaForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    return _hf_factory(FlaxLlamaForCausalLM(config, _do_init=False))
