"""A step to trace: a Flax Linen model's train step, and one microbatch of a batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax

from meshplan._errors import ArgumentError, error_for
from meshplan._types import LossFn, PyTree, StepFn

if TYPE_CHECKING:
    import flax.linen as nn
    import optax

__all__ = ["check_microbatches", "linen_step", "split_batch"]


def linen_step(
    model: nn.Module,
    example_inputs: object,
    loss: LossFn | None = None,
    optimizer: optax.GradientTransformation | None = None,
) -> tuple[PyTree, StepFn, PyTree]:
    """``(abstract_state, step_fn, example_batch)`` of a Flax Linen model's train step.

    The state is a ``flax.training.train_state.TrainState`` (``optimizer``, default
    Adam) from ``jax.eval_shape`` of ``model.init``; the step applies the gradient
    of ``loss(model.apply({'params': params}, inputs), batch)`` (default: the mean
    of the squared outputs). ``example_inputs`` is the batch (first dimension
    ``'batch'``): arrays or ``ShapeDtypeStruct``s. A tuple or list batch is
    ``(inputs, targets, ...)``: the model gets its first item, the loss all of it
    (``loss(outputs, (images, labels))``).
    """
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    tx = optimizer if optimizer is not None else optax.adam(1e-3)
    loss_fn = loss if loss is not None else (lambda y, _: jnp.mean(jnp.square(y)))

    def inputs(batch: PyTree) -> PyTree:
        return batch[0] if isinstance(batch, tuple | list) else batch

    def init(key: jax.Array, batch: PyTree) -> PyTree:
        params = model.init(key, inputs(batch))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    abstract = jax.eval_shape(init, jax.random.key(0), example_inputs)

    def step(state: PyTree, batch: PyTree) -> PyTree:
        def objective(params: PyTree) -> PyTree:
            return loss_fn(state.apply_fn({"params": params}, inputs(batch)), batch)

        return state.apply_gradients(grads=jax.grad(objective)(state.params))

    return abstract, step, example_inputs


def check_microbatches(microbatches: object) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise error_for(
            ArgumentError,
            "bad-microbatches",
            "microbatches",
            f"microbatches is {microbatches!r}: it must be a whole number of at least 1",
            "Pass microbatches=N, the number of microbatches whose gradients one step "
            "accumulates (1: none).",
        )


def split_batch(example_batch: PyTree, microbatches: int) -> PyTree:
    """One microbatch of ``example_batch``: every array's first dimension divided by
    ``microbatches`` (as abstract values: nothing is computed).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._search.predict.step import split_batch
        >>> split_batch({"tokens": jax.ShapeDtypeStruct((64, 128), jnp.int32)}, 4)["tokens"].shape
        (16, 128)
    """
    if microbatches == 1:
        return example_batch
    leaves, tree = jax.tree.flatten(example_batch)
    bad = [
        f"batch{jax.tree_util.keystr(path)} {tuple(getattr(x, 'shape', ()))}"
        for path, x in jax.tree_util.tree_flatten_with_path(example_batch)[0]
        if not getattr(x, "shape", ()) or x.shape[0] % microbatches
    ]
    if bad:
        raise error_for(
            ArgumentError,
            "bad-microbatches",
            "microbatches",
            f"{microbatches} microbatches (microbatches=) do not divide the first "
            f"dimension of the batch's arrays: {', '.join(bad)}",
            f"Pass a batch of a multiple of {microbatches} examples, or a number of microbatches "
            "that divides the batch size.",
        )
    micro = [
        jax.ShapeDtypeStruct((x.shape[0] // microbatches, *x.shape[1:]), x.dtype) for x in leaves
    ]
    return jax.tree.unflatten(tree, micro)
