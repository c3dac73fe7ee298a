"""The guide's workflow as functions: sharded init, train step, inference, logical
variant, ``unbox``/``replace_boxed`` and a checkpoint restored onto another mesh.

``meshplan demo`` prints what these return; the tests assert on the same values.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

import meshplan
from meshplan._types import Leaf, PyTree
from meshplan.models.mlp import (
    LOGICAL_RULES,
    MLP,
    LogicalMLP,
    init_fn,
    make_infer_step,
    make_train_step,
)

__all__ = [
    "Variant",
    "VariantResult",
    "make_mesh",
    "restore_on_mesh",
    "run_variant",
    "save_state",
    "state_arrays",
]


def make_mesh(shape: tuple[int, ...] = (2, 4), explicit: bool = False) -> Mesh:
    """A ``('data', 'model')`` mesh of ``shape``, with Auto (the guide's) or Explicit axes.

    Example:
        >>> from meshplan.models.workflow import make_mesh
        >>> dict(make_mesh((2, 4)).shape)
        {'data': 2, 'model': 4}
    """
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, ("data", "model"), axis_types=(kind,) * len(shape))


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way of writing the guide's model."""

    use_scan: bool
    logical: bool
    num_layers: int = 4
    depth: int = 1024
    batch: int = 8

    @property
    def label(self) -> str:
        return (
            f"{'logical' if self.logical else 'device-axis'}, {'scan' if self.use_scan else 'loop'}"
        )

    def model(self) -> Any:
        cls = LogicalMLP if self.logical else MLP
        return cls(self.num_layers, self.depth, self.use_scan)

    def rules(self) -> tuple[tuple[str, Any], ...]:
        return LOGICAL_RULES if self.logical else ()

    def layer_name(self) -> str:
        base = "LogicalDotReluDot" if self.logical else "DotReluDot"
        return f"Scan{base}_0" if self.use_scan else f"{base}_0"


@dataclasses.dataclass
class VariantResult:
    """What one variant of the workflow produced."""

    variant: Variant
    abstract_state: PyTree
    state_sharding: PyTree
    state: PyTree
    trained: PyTree
    step_ms: list[float]
    output: jax.Array

    @property
    def layer(self) -> Any:
        return self.state.params[self.variant.layer_name()]


def run_variant(variant: Variant, mesh: Mesh, *, steps: int = 3) -> VariantResult:
    """Runs the guide's workflow for ``variant`` on ``mesh``.

    The state sharding comes from ``jax.eval_shape`` of ``init_fn``: with
    :func:`meshplan.get_sharding` for mesh-axis names, with
    :func:`meshplan.logical_to_mesh_sharding` for logical ones.

    Example:
        >>> from meshplan.models.workflow import Variant, make_mesh, run_variant
        >>> result = run_variant(Variant(use_scan=True, logical=True, num_layers=2, depth=64),
        ...                      make_mesh((2, 4)), steps=1)
        >>> result.layer["W2"].names, result.layer["W2"].value.sharding.spec
        (('layer', 'hidden', 'embed'), P(None, 'model', None))
        >>> result.output.shape, result.output.sharding.spec
        ((8, 64), P('data', None))
    """
    model = variant.model()
    optimizer = optax.adam(learning_rate=1e-3)
    x_sharding = NamedSharding(mesh, PartitionSpec("data", None))
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(variant.rules()):
        x = jax.device_put(jnp.ones((variant.batch, variant.depth)), x_sharding)
        key = jax.random.key(0)
        abstract = jax.eval_shape(
            functools.partial(init_fn, model=model, optimizer=optimizer), key, x
        )
        if variant.logical:
            logical_spec = meshplan.get_partition_spec(abstract)
            state_sharding = meshplan.logical_to_mesh_sharding(logical_spec, mesh, variant.rules())
        else:
            state_sharding = meshplan.get_sharding(abstract, mesh)
        jit_init = jax.jit(
            init_fn,
            static_argnums=(2, 3),
            in_shardings=(NamedSharding(mesh, PartitionSpec()), x_sharding),
            out_shardings=state_sharding,
        )
        state = jit_init(key, x, model, optimizer)
        train_step = make_train_step(model, state_sharding, x_sharding)
        trained = jax.block_until_ready(train_step(state, x))  # compiles
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            trained = jax.block_until_ready(train_step(trained, x))
            times.append((time.perf_counter() - start) * 1e3)
        infer = make_infer_step(model, state_sharding.params, x_sharding, x_sharding)
        output = jax.block_until_ready(infer(trained.params, x))
    return VariantResult(variant, abstract, state_sharding, state, trained, times, output)


def median_ms(result: VariantResult) -> float:
    """Median step time of a variant, in milliseconds (see :func:`run_variant`)."""
    return statistics.median(result.step_ms)


def state_arrays(state: PyTree) -> dict[str, object]:
    """The raw arrays of a ``TrainState``: what a checkpoint stores.

    Example:
        >>> import jax.numpy as jnp, optax, meshplan
        >>> from flax.training import train_state
        >>> from meshplan.models.workflow import state_arrays
        >>> params = {"w": meshplan.Partitioned(jnp.ones((2, 2)), (None, "model"))}
        >>> state = train_state.TrainState.create(apply_fn=None, params=params,
        ...                                       tx=optax.sgd(0.1))
        >>> type(state_arrays(state)["params"]["w"]).__name__
        'ArrayImpl'
    """
    return {
        "params": meshplan.unbox(state.params),
        "opt_state": meshplan.unbox(state.opt_state),
        "step": state.step,
    }


def save_state(state: PyTree, directory: Path) -> Path:
    """Saves the unboxed arrays of ``state`` with Orbax; returns the checkpoint path."""
    import orbax.checkpoint as ocp

    path = Path(directory).absolute() / "state"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state_arrays(state))
        checkpointer.wait_until_finished()
    return path


def restore_on_mesh(path: Path, abstract_state: PyTree, target_sharding: PyTree) -> PyTree:
    """Restores arrays saved by :func:`save_state` with the shardings of ``target_sharding``.

    ``target_sharding`` is a sharding tree for ``abstract_state`` on any mesh;
    it need not match the one used to save.
    """
    import orbax.checkpoint as ocp

    def target(abstract: PyTree, sharding: object) -> PyTree:
        return jax.ShapeDtypeStruct(abstract.shape, abstract.dtype, sharding=sharding)

    abstract_arrays = state_arrays(abstract_state)
    shardings = {
        "params": meshplan.unbox(target_sharding.params),
        "opt_state": meshplan.unbox(target_sharding.opt_state),
        "step": target_sharding.step,
    }
    targets = jax.tree.map(target, abstract_arrays, shardings)
    with ocp.StandardCheckpointer() as checkpointer:
        return checkpointer.restore(Path(path), targets)


def trees_equal(a: object, b: Leaf) -> bool:
    """Whether two trees of arrays hold bit-identical values.

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan.models.workflow import trees_equal
        >>> trees_equal({"a": jnp.ones(3)}, {"a": jnp.ones(3)}), trees_equal([1.0], [2.0])
        (True, False)
    """
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(leaves_a) == len(leaves_b) and all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(leaves_a, leaves_b, strict=True)
    )
