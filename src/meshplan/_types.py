"""The names of what flows through meshplan: trees of arrays, and the functions over them.

JAX's trees have no static type (any nesting of tuples, lists, dicts and registered
nodes, with arrays, ``jax.ShapeDtypeStruct``\\ s or boxes at the leaves), so
:data:`PyTree` is ``Any`` under a name that says what flows, as optax's ``base.py``
names its ``Params`` and ``Updates``. The step-function aliases say what a step takes
and gives: a training state and a batch, both trees.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from meshplan._types import PyTree, StepFn
    >>> def step(state: PyTree, batch: PyTree) -> PyTree:
    ...     return jax.tree.map(lambda w: w - 0.1 * batch.mean(), state)
    >>> run: StepFn = step
    >>> run({"w": jnp.ones(2)}, jnp.ones(4))["w"].tolist()
    [0.8999999761581421, 0.8999999761581421]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

__all__ = ["Batch", "Batches", "InitFn", "Leaf", "LossFn", "PyTree", "StepFn"]

PyTree: TypeAlias = Any
"""A JAX pytree: nested containers with arrays (or abstract arrays, or boxes) at the leaves."""

Leaf: TypeAlias = Any
"""One leaf of a tree as meshplan meets it: an array, a ``jax.ShapeDtypeStruct``, a box
(:class:`meshplan.Partitioned`) or a Flax NNX variable."""

Batch: TypeAlias = PyTree
"""One batch of a step: an array, or a tree of them (inputs and targets)."""

StepFn: TypeAlias = Callable[[PyTree, Batch], PyTree]
"""A step: ``step(state, batch)`` gives the new state (or the new state and metrics)."""

LossFn: TypeAlias = Callable[[PyTree, Batch], Any]
"""A loss: ``loss(params, batch)`` gives a scalar (or a scalar and auxiliary outputs)."""

InitFn: TypeAlias = Callable[[PyTree], PyTree]
"""An initializer: ``init(key)`` gives the parameters (or the state)."""

Batches: TypeAlias = Callable[[str, int], Batch]
"""A model's batches: ``batches(split, index)`` gives one batch of ``split`` (``'train'`` or ``'eval'``)."""
