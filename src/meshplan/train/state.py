"""The sharded ``TrainState``: its abstract shape, its shardings, and what a device holds.

The recipe is the guide's, for any Flax model: ``jax.eval_shape`` of the init
function gives the abstract ``TrainState`` (boxes holding
``ShapeDtypeStruct``\\ s); :func:`meshplan.logical_to_mesh_sharding` of its
logical specs gives the state's shardings under the chosen layout; and
``jax.jit(init, out_shardings=...)`` creates every array where it belongs.

The model is a Flax Linen module, or any ``init_params(key) -> params``
callable: e.g. the ``init`` of a functional Flax NNX model, whose ``params``
is an ``nnx.State`` (its variables carry their logical names).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax.training import train_state
from jax.sharding import Mesh

from meshplan._spmd.rules import LogicalRules
from meshplan._spmd.shardings import get_partition_spec, logical_to_mesh_sharding
from meshplan._types import PyTree
from meshplan.train.settings import TrainSettings

__all__ = [
    "PlanSummary",
    "abstract_train_state",
    "init_fn",
    "per_device_bytes",
    "plan_summary",
    "sequence_input",
    "state_shardings",
]


def sequence_input(settings: TrainSettings) -> jax.ShapeDtypeStruct:
    """The default example input of a model: one sequence of ``seq_len`` int32 tokens.

    Example:
        >>> from meshplan.train.settings import TrainSettings
        >>> from meshplan.train.state import sequence_input
        >>> sequence_input(TrainSettings(seq_len=16))
        ShapeDtypeStruct(shape=(1, 16), dtype=int32)
    """
    return jax.ShapeDtypeStruct((1, settings.seq_len), jnp.int32)


def init_fn(
    model: object, tx: optax.GradientTransformation, example_input: object
) -> Callable[[jax.Array], train_state.TrainState]:
    """``init(key) -> TrainState`` of ``model`` with optimizer ``tx`` (to trace or jit).

    ``model`` is a Flax Linen module, whose parameters are ``model.init(key,
    x)["params"]`` for zeros ``x`` of the shapes and dtypes of ``example_input``
    (arrays or ``ShapeDtypeStruct``\\ s, any tree of them); or an
    ``init_params(key) -> params`` callable (e.g. ``FunctionalTransformer(config).init``
    of Flax NNX), called with the key alone (``example_input`` is not used, and
    the state's ``apply_fn`` is ``None``).

    Example:
        >>> import jax, jax.numpy as jnp, optax, meshplan
        >>> from meshplan.train.state import init_fn
        >>> def init_params(key):
        ...     w = jax.random.normal(key, (4, 2))
        ...     return {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
        >>> state = jax.eval_shape(init_fn(init_params, optax.adam(1e-3), None),
        ...                        jax.random.key(0))
        >>> state.params["w"].names, state.apply_fn is None
        (('embed', 'mlp'), True)
    """
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(
                f"model must be a Flax Linen module or an init_params(key) -> params "
                f"callable, got {type(model).__name__}.\nPass a linen.Module, or a function "
                f"of a PRNG key that returns the parameters (e.g. an NNX model's init)."
            )
        init_params = model

        def init_from_params(key: jax.Array) -> train_state.TrainState:
            created: train_state.TrainState = train_state.TrainState.create(
                apply_fn=None, params=init_params(key), tx=tx
            )
            return created

        return init_from_params

    def init(key: jax.Array) -> train_state.TrainState:
        x = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), example_input)
        params = model.init(key, x)["params"]
        state: train_state.TrainState = train_state.TrainState.create(
            apply_fn=model.apply, params=params, tx=tx
        )
        return state

    return init


def abstract_train_state(
    model: object,
    tx: optax.GradientTransformation,
    settings: TrainSettings,
    example_input: object = None,
) -> train_state.TrainState:
    """The ``TrainState`` as ``jax.eval_shape`` sees it: boxes of ``ShapeDtypeStruct``\\ s.

    ``model`` as in :func:`init_fn` (a Linen module, or ``init_params(key)``,
    traced with the key alone). ``example_input`` defaults to
    :func:`sequence_input`; the key is ``settings.seed``.
    """
    if example_input is None:
        example_input = sequence_input(settings)
    init = init_fn(model, tx, example_input)
    abstract: train_state.TrainState = jax.eval_shape(init, jax.random.key(settings.seed))
    return abstract


def state_shardings(abstract: PyTree, mesh: Mesh, rules: LogicalRules) -> PyTree:
    """The ``NamedSharding`` of every array of ``abstract`` under ``rules`` on ``mesh``."""
    return logical_to_mesh_sharding(get_partition_spec(abstract), mesh, rules)


def per_device_bytes(abstract: PyTree, shardings: PyTree) -> int:
    """The largest number of bytes any one device holds of ``abstract`` with ``shardings``."""
    totals: dict[object, int] = {}
    for value, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        nbytes = math.prod(sharding.shard_shape(value.shape)) * np.dtype(value.dtype).itemsize
        for device in sharding.device_set:
            totals[device] = totals.get(device, 0) + nbytes
    return max(totals.values(), default=0)


def _total_bytes(tree: PyTree) -> int:
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


class PlanSummary(TypedDict):
    """What :func:`plan_summary` returns (sizes in bytes)."""

    mesh: dict[str, int]
    layout: str
    parameters: int
    params_total: int
    state_total: int
    params_per_device: int
    state_per_device: int
    source: str


def plan_summary(
    abstract: PyTree, shardings: PyTree, mesh: Mesh, rules: LogicalRules, layout: str = ""
) -> PlanSummary:
    """Parameter count and per-device bytes of the parameters and of the whole state.

    From :func:`meshplan.explain`; should it fail, from the shard sizes (of
    ``shardings``, or of :func:`state_shardings` when ``None``), with its error in
    ``source``.
    """
    from meshplan._plan.explain import explain

    params = abstract.params
    parameters = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    params_total = _total_bytes(params)
    state_total = _total_bytes(abstract)
    try:
        totals = explain(abstract, mesh, rules).totals
        params_per_device = int(totals["params"].max_device_bytes)
        state_per_device = int(totals["all"].max_device_bytes)
        source = "meshplan.explain"
    except Exception as e:  # the summary is informative only: never stop a run for it
        if shardings is None:
            shardings = state_shardings(abstract, mesh, rules)
        params_per_device = per_device_bytes(params, shardings.params)
        state_per_device = per_device_bytes(abstract, shardings)
        source = f"shard sizes (meshplan.explain failed: {type(e).__name__}: {e})"
    return PlanSummary(
        mesh=dict(mesh.shape),
        layout=layout,
        parameters=parameters,
        params_total=params_total,
        state_total=state_total,
        params_per_device=params_per_device,
        state_per_device=state_per_device,
        source=source,
    )
