"""The guide's model: a stack of ``DotReluDot`` layers, annotated with mesh axes or
logical axes, stacked by a for-loop or by ``nn.scan``.

This is the model of "Scale up Flax Modules on multiple devices", written with
``meshplan.`` where the guide writes ``nn.``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec

import meshplan
from meshplan._types import PyTree

__all__ = [
    "LOGICAL_RULES",
    "MLP",
    "DotReluDot",
    "LogicalDotReluDot",
    "LogicalMLP",
    "init_fn",
    "make_infer_step",
    "make_train_step",
]

LOGICAL_RULES = (("batch", "data"), ("hidden", "model"))
"""The guide's rules: batch over ``data``, the hidden dimension over ``model``."""


def _constrain(x: jax.Array, spec: PartitionSpec) -> jax.Array:
    """The guide's ``with_sharding_constraint`` on the active mesh (Auto or Explicit)."""
    return meshplan.with_logical_constraint(x, tuple(spec), rules=_IDENTITY_RULES)


_IDENTITY_RULES = (("data", "data"), ("model", "model"))
"""Mesh axis names used as their own logical names: device-axis constraints."""


class DotReluDot(nn.Module):
    """``relu(x @ W1) @ W2`` with ``W1`` split by columns and ``W2`` by rows over ``model``."""

    depth: int
    dense_init: Callable[..., object] = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        y = nn.Dense(
            self.depth,
            kernel_init=meshplan.with_partitioning(self.dense_init, (None, "model")),
            use_bias=False,
        )(x)
        y = jax.nn.relu(y)
        y = _constrain(y, PartitionSpec("data", "model"))
        w2 = self.param(
            "W2",
            meshplan.with_partitioning(self.dense_init, ("model", None)),
            (self.depth, x.shape[-1]),
            # flax's default, spelled out: without it flax's stubs type the value as the box
            unbox=True,
        )
        out = meshplan.explicit_out_sharding(("data", None), _IDENTITY_RULES)
        z = jnp.dot(y, w2, out_sharding=out)
        z = _constrain(z, PartitionSpec("data", None))
        return z, None


class MLP(nn.Module):
    """``num_layers`` ``DotReluDot`` layers, by a for-loop or by ``nn.scan``."""

    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.use_scan:
            x, _ = nn.scan(
                DotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={meshplan.PARTITION_NAME: None},
            )(self.depth)(x)
        else:
            for _ in range(self.num_layers):
                x, _ = DotReluDot(self.depth)(x)
        return x


class LogicalDotReluDot(nn.Module):
    """``DotReluDot`` with logical names: ``('embed', 'hidden')`` and ``('hidden', 'embed')``."""

    depth: int
    dense_init: Callable[..., object] = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        y = nn.Dense(
            self.depth,
            kernel_init=meshplan.with_logical_partitioning(self.dense_init, ("embed", "hidden")),
            use_bias=False,
        )(x)
        y = jax.nn.relu(y)
        y = meshplan.with_logical_constraint(y, ("batch", "hidden"))
        w2 = self.param(
            "W2",
            meshplan.with_logical_partitioning(self.dense_init, ("hidden", "embed")),
            (self.depth, x.shape[-1]),
            unbox=True,  # (see DotReluDot)
        )
        z = jnp.dot(y, w2, out_sharding=meshplan.explicit_out_sharding(("batch", "embed")))
        z = meshplan.with_logical_constraint(z, ("batch", "embed"))
        return z, None


class LogicalMLP(nn.Module):
    """``LogicalDotReluDot`` layers; the scanned axis is named ``'layer'``."""

    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.use_scan:
            x, _ = nn.scan(
                LogicalDotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={meshplan.PARTITION_NAME: "layer"},
            )(self.depth)(x)
        else:
            for _ in range(self.num_layers):
                x, _ = LogicalDotReluDot(self.depth)(x)
        return x


def init_fn(
    key: jax.Array, x: jax.Array, model: nn.Module, optimizer: optax.GradientTransformation
) -> train_state.TrainState:
    """The guide's ``init_fn``: a ``TrainState`` whose params are boxed.

    Example:
        >>> import functools, jax, jax.numpy as jnp, optax
        >>> from meshplan.models.mlp import MLP, init_fn
        >>> model = MLP(num_layers=1, depth=16, use_scan=False)
        >>> x = jax.ShapeDtypeStruct((8, 16), jnp.float32)
        >>> state = jax.eval_shape(functools.partial(init_fn, model=model,
        ...                        optimizer=optax.adam(1e-3)), jax.random.key(0), x)
        >>> state.params["DotReluDot_0"]["W2"].names
        ('model', None)
    """
    variables = model.init(key, x)
    state: train_state.TrainState = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optimizer
    )
    return state


def _apply(model: nn.Module, params: PyTree, x: jax.Array) -> jax.Array:
    """``model.apply({"params": params}, x)``: the models of this module return one array."""
    # flax types apply's result as "output, or (output, variables) when mutable": not mutable here.
    return cast(jax.Array, model.apply({"params": params}, x))


def make_train_step(
    model: nn.Module, state_sharding: object, x_sharding: NamedSharding
) -> Callable[[train_state.TrainState, jax.Array], train_state.TrainState]:
    """The guide's jitted train step: ``loss = model.apply(...).sum()``, then Adam."""

    @functools.partial(
        jax.jit, in_shardings=(state_sharding, x_sharding), out_shardings=state_sharding
    )
    def train_step(state: train_state.TrainState, x: jax.Array) -> train_state.TrainState:
        def loss(params: PyTree) -> jax.Array:
            return _apply(model, params, x).sum()

        new_state: train_state.TrainState = state.apply_gradients(
            grads=jax.grad(loss)(state.params)
        )
        return new_state

    return train_step


def make_infer_step(
    model: nn.Module,
    params_sharding: object,
    x_sharding: NamedSharding,
    out_sharding: NamedSharding,
) -> Callable[[PyTree, jax.Array], jax.Array]:
    """The guide's jitted inference step."""

    @functools.partial(
        jax.jit, in_shardings=(params_sharding, x_sharding), out_shardings=out_sharding
    )
    def infer_step(params: PyTree, x: jax.Array) -> jax.Array:
        return _apply(model, params, x)

    return infer_step
