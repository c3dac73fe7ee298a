"""The train steps of the built-in models, for ``meshplan plan --profile`` and ``meshplan search``."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["step_and_batch"]


def step_and_batch(args: argparse.Namespace) -> tuple[Any, Any]:
    """The train step ``step(state, batch)`` of a built-in ``--model`` (the state's Adam),
    and an abstract batch of ``args.batch`` (x ``args.seq`` + 1 tokens for the Transformers).

    Example:
        >>> import argparse
        >>> from meshplan.cli.steps import step_and_batch
        >>> _, batch = step_and_batch(argparse.Namespace(model="transformer", size="tiny", batch=4, seq=16))
        >>> batch.shape
        (4, 17)
    """
    import jax
    import jax.numpy as jnp

    if args.model == "transformer":
        from meshplan.examples.transformer import Transformer, config_from_name, loss_fn

        model = Transformer(config_from_name(args.size))

        def step(state: Any, tokens: jax.Array) -> Any:
            return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

        return step, jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)

    if args.model == "transformer-nnx":
        from meshplan.examples.transformer import config_from_name
        from meshplan.examples.transformer_nnx import FunctionalTransformer

        functional = FunctionalTransformer(config_from_name(args.size))

        def nnx_step(state: Any, tokens: jax.Array) -> Any:
            return state.apply_gradients(grads=jax.grad(functional.loss)(state.params, tokens))

        return nnx_step, jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)

    def mlp_step(state: Any, x: jax.Array) -> Any:
        grads = jax.grad(lambda p: state.apply_fn({"params": p}, x).sum())(state.params)
        return state.apply_gradients(grads=grads)

    return mlp_step, jax.ShapeDtypeStruct((args.batch, args.depth), jnp.float32)
