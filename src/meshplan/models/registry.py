"""The example models by name: one registry for ``plan``, ``search``, ``train`` and ``sample``.

Each entry of :data:`EXAMPLE_MODELS` says which Flax API the model is written
in, the layout the commands default to, and how to build it from its config:
an :class:`Example`, whose :class:`~meshplan.train.model.TrainModel` gives the
init, the loss and a plain step, and whose :meth:`Example.batch` the abstract
batch of a step. A command chooses a model by name here, and nowhere else.

The config is a :class:`~meshplan.models.transformer.TransformerConfig` for
the Transformers and an :class:`MLPConfig` for the guide's MLP.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshplan._types import Leaf, PyTree

if TYPE_CHECKING:
    import jax

    from meshplan.train.model import TrainModel

__all__ = ["EXAMPLE_MODELS", "Example", "ExampleModel", "MLPConfig", "example"]


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """The guide's MLP: ``num_layers`` layers of width ``depth``, stacked by ``nn.scan`` or not."""

    num_layers: int = 4
    depth: int = 1024
    scan: bool = False


@dataclasses.dataclass(frozen=True)
class Example:
    """One example model, built: the model to train or trace, and what it is called.

    Attributes:
        what: For headers, e.g. ``'Transformer (tiny, Flax NNX)'``.
        model: Its init, loss and plain step.
        batch_of: ``batch_of(batch, seq)``: the abstract batch of a step of ``batch``
            examples (``seq``: positions, for the sequence models).
    """

    what: str
    model: TrainModel
    batch_of: Callable[[int, int], jax.ShapeDtypeStruct]

    def batch(self, batch: int, seq: int = 128) -> jax.ShapeDtypeStruct:
        """The abstract batch of a step: ``batch`` examples (of ``seq`` positions)."""
        return self.batch_of(batch, seq)


@dataclasses.dataclass(frozen=True)
class ExampleModel:
    """A registry entry: the model's name, its Flax API, its default layout and its builder.

    Attributes:
        name: ``--model NAME``.
        api: ``'Flax Linen'`` or ``'Flax NNX'``.
        rules: The built-in layout the commands use when ``--rules`` is left out.
        build: ``build(config, size)`` -> :class:`Example` (``size``: the preset's name,
            for :attr:`Example.what`).
        sequence: A byte-level sequence model: ``meshplan train`` and ``sample`` run it.
    """

    name: str
    api: str
    rules: str
    build: Callable[[Any, str], Example]
    sequence: bool = True


def _tokens(batch: int, seq: int) -> jax.ShapeDtypeStruct:
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)  # reads seq, predicts the next


def _linen_transformer(config: Any, size: str) -> Example:
    import jax
    import jax.numpy as jnp

    from meshplan.models.transformer import Transformer, loss_and_stats, loss_fn
    from meshplan.train.model import TrainModel

    module = Transformer(config)
    moe = bool(config.num_experts)  # (loss, stats): the trainer reports dropped tokens
    loss = functools.partial(loss_and_stats if moe else loss_fn, model=module)
    # Parameter shapes do not depend on the length: a short one traces faster.
    tokens = jax.ShapeDtypeStruct((1, min(config.max_len, 8)), jnp.int32)
    return Example(f"Transformer ({size})", TrainModel(module, loss, tokens, moe), _tokens)


def _nnx_transformer(config: Any, size: str) -> Example:
    from meshplan.models.transformer_nnx import FunctionalTransformer
    from meshplan.train.model import TrainModel

    functional = FunctionalTransformer(config)
    moe = bool(config.num_experts)
    loss = functional.loss_and_stats if moe else functional.loss
    model = TrainModel(functional.init, loss, None, moe)
    return Example(f"Transformer ({size}, Flax NNX)", model, _tokens)


def _mlp(config: MLPConfig, size: str) -> Example:
    import jax
    import jax.numpy as jnp

    from meshplan.models.mlp import LogicalMLP
    from meshplan.train.model import TrainModel

    module = LogicalMLP(config.num_layers, config.depth, config.scan)

    def loss(params: PyTree, x: Leaf) -> PyTree:
        out: PyTree = module.apply({"params": params}, x)  # one array (not mutable)
        return out.sum()

    def batch_of(batch: int, seq: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((batch, config.depth), jnp.float32)

    how = "nn.scan" if config.scan else "for-loop"
    what = f"MLP ({config.num_layers} layers of {config.depth}, {how})"
    return Example(what, TrainModel(module, loss, batch_of(8, 0)), batch_of)


EXAMPLE_MODELS: dict[str, ExampleModel] = {
    "mlp": ExampleModel("mlp", "Flax Linen", "guide", _mlp, sequence=False),
    "transformer": ExampleModel("transformer", "Flax Linen", "fsdp_tp", _linen_transformer),
    "transformer-nnx": ExampleModel("transformer-nnx", "Flax NNX", "fsdp_tp", _nnx_transformer),
}
"""Every example model the commands know by name (``--model NAME``)."""


def example(name: str, config: object, size: str = "") -> Example:
    """The example model ``name`` of :data:`EXAMPLE_MODELS`, built from ``config``.

    Example:
        >>> from meshplan.models.registry import MLPConfig, example
        >>> mlp = example("mlp", MLPConfig(num_layers=2, depth=16))
        >>> mlp.what, mlp.batch(32).shape
        ('MLP (2 layers of 16, for-loop)', (32, 16))
        >>> state = mlp.model.abstract_state()
        >>> state.params["LogicalDotReluDot_0"]["W2"].names
        ('hidden', 'embed')

    Raises:
        ValueError: ``name`` is not one of :data:`EXAMPLE_MODELS`.
    """
    entry = EXAMPLE_MODELS.get(name)
    if entry is None:
        raise ValueError(f"unknown model {name!r}: expected one of {', '.join(EXAMPLE_MODELS)}")
    return entry.build(config, size)
