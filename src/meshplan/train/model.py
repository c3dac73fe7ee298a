"""A model as training sees it: what to initialise, the loss, and one plain train step.

:class:`TrainModel` is the one record that the commands (``plan``, ``search``,
``train``) and a user's ``--model pkg.module:factory`` hand around: a Flax Linen
module (or an ``init_params(key)`` callable, e.g. a functional Flax NNX model's
``init``), its ``loss(params, batch)``, and the example input ``init`` is traced
with. The abstract state and an un-jitted step follow from it, so a planner and a
trainer read the same model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax.training import train_state

from meshplan._types import LossFn, PyTree
from meshplan.train.state import init_fn

__all__ = ["TrainModel"]


@dataclasses.dataclass(frozen=True)
class TrainModel:
    """A model, its loss and its example input: everything model-specific a train step needs.

    Attributes:
        model: A Flax Linen module (parameters ``model.init(key, x)["params"]`` for
            ``x`` like ``example_input``), or an ``init_params(key) -> params`` callable
            (:func:`meshplan.train.state.init_fn`).
        loss: ``loss(params, batch) -> scalar``; with ``has_aux``, ``(scalar, metrics)``
            (``metrics``: a dict of float32 scalars).
        example_input: Shapes and dtypes of what ``model.init`` takes (unused by an
            ``init_params`` callable).
        has_aux: ``loss`` returns ``(loss, metrics)``.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, optax
        >>> from meshplan.train.model import TrainModel
        >>> model = nn.Dense(3)
        >>> def loss(params, x):
        ...     return jnp.mean(model.apply({"params": params}, x) ** 2)
        >>> m = TrainModel(model, loss, jax.ShapeDtypeStruct((2, 4), jnp.float32))
        >>> state = m.abstract_state(optax.sgd(0.1))
        >>> after = jax.eval_shape(m.step, state, jnp.ones((2, 4)))
        >>> state.params["kernel"].shape, after.params["kernel"].shape
        ((4, 3), (4, 3))
    """

    model: Any  # a Flax Linen module or an init function: meshplan.train.state.init_fn
    loss: LossFn
    example_input: PyTree = None
    has_aux: bool = False

    def init(self, tx: optax.GradientTransformation) -> Callable[[jax.Array], PyTree]:
        """``init(key) -> TrainState`` with optimizer ``tx`` (:func:`~meshplan.train.state.init_fn`)."""
        return init_fn(self.model, tx, self.example_input)

    def abstract_state(
        self, tx: optax.GradientTransformation | None = None, seed: int = 0
    ) -> train_state.TrainState:
        """``jax.eval_shape`` of :meth:`init` (``tx`` default: Adam at 1e-3)."""
        tx = optax.adam(1e-3) if tx is None else tx
        state: train_state.TrainState = jax.eval_shape(self.init(tx), jax.random.key(seed))
        return state

    def objective(self, params: PyTree, batch: PyTree) -> PyTree:
        """The scalar loss (the first value of ``loss`` when it has metrics)."""
        out = self.loss(params, batch)
        return out[0] if self.has_aux else out

    def step(self, state: train_state.TrainState, batch: PyTree) -> train_state.TrainState:
        """One plain train step (not jitted): the gradient of :meth:`objective`, applied."""
        grads = jax.grad(self.objective)(state.params, batch)
        new: train_state.TrainState = state.apply_gradients(grads=grads)
        return new
