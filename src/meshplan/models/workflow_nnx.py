"""Flax's NNX guide "Scale up on multiple devices", with meshplan, one function per step.

The guide's steps: a sharded variable and a sharded ``nnx.Linear``; the
``DotReluDot`` stack built by ``nnx.vmap`` and run by ``jax.lax.scan``; a train
step with ``nnx.Optimizer``; an Orbax checkpoint restored onto another mesh;
the logical-axis model (here with meshplan's rules, and its activation
constraint in logical names, which Flax cannot write); the Explicit-axis model.
``meshplan demo --nnx`` prints what these return; ``tests/examples/test_nnx_workflow.py``
asserts the guide's own asserts on them.

Where meshplan changes the guide's code:

* the logical model creates its variables with :func:`meshplan.with_nnx_partitioning`
  and :func:`meshplan.nnx_sharding` (Flax's eager sharding then places them by
  meshplan's rules), and constrains its activation with
  :func:`meshplan.with_logical_constraint`;
* a checkpoint is restored through the abstract path: ``nnx.eval_shape``, then
  :func:`meshplan.get_sharding` of the abstract state on the target mesh, under
  any rules;
* the train step returns the optimizer as well as the model: the guide's
  ``jax.jit`` step returns only the model, so the optimizer's step count and
  Adam moments outside the step never change (each step is Adam's first).

The guide's own models are kept as the guide writes them, except that
``out_sharding=`` replaces the deprecated ``sharding=`` and ``rngs.split(n)``
the deprecated ``rngs.fork(split=n)``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._spmd.rules import LogicalRules
from meshplan.models.workflow import make_mesh, trees_equal

__all__ = [
    "GUIDE_RULES",
    "OTHER_RULES",
    "DotReluDot",
    "ExplicitDotReluDot",
    "ExplicitMultiDotReluDot",
    "LogicalDotReluDot",
    "LogicalMultiDotReluDot",
    "MultiDotReluDot",
    "TrainRun",
    "abstract_model",
    "make_mesh",
    "restore_onto",
    "restore_with_meshplan",
    "run_explicit",
    "run_logical",
    "save_state",
    "sharded_linear",
    "sharded_variable",
    "train",
    "train_step",
    "trees_equal",
]

GUIDE_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None))
"""The guide's ``sharding_rules``: the batch over ``data``, the hidden width over ``model``."""

OTHER_RULES = (("batch", "data"), ("hidden", "data"), ("embed", "model"))
"""Another layout, to restore a checkpoint with: the hidden width over ``data``, ``embed`` over ``model``."""


# -- Shard a single-array model ------------------------------------------------------------


def sharded_variable(mesh: Mesh, seed: int = 0) -> nnx.Param[jax.Array]:
    """The guide's first step: a ``(4, 8)`` ``nnx.Param`` sharded at creation over ``model``.

    Under ``jax.set_mesh`` Flax's eager sharding places it; with no rules in
    effect its ``out_sharding`` names are mesh axes, for meshplan as for Flax.

    Example:
        >>> import meshplan
        >>> from meshplan.models.workflow_nnx import make_mesh, sharded_variable
        >>> w = sharded_variable(make_mesh((2, 4)))
        >>> w.sharding.spec, meshplan.get_partition_spec(w).get_value()
        (P(None, 'model'), P(None, 'model'))
    """
    rngs = nnx.Rngs(seed)
    with jax.set_mesh(mesh):
        return nnx.Param(rngs.lecun_normal()((4, 8)), out_sharding=(None, "model"))


def sharded_linear(mesh: Mesh, seed: int = 0) -> tuple[nnx.Linear, jax.Array]:
    """The guide's ``nnx.Linear(4, 8)`` with a kernel over ``model``, and its output on ``x``.

    Created inside ``jax.jit`` (``nnx.with_partitioning`` on the initializer),
    then run on ``x`` of shape ``(16, 4)`` sharded over ``data``: the output is
    ``('data', 'model')``.

    Example:
        >>> from meshplan.models.workflow_nnx import make_mesh, sharded_linear
        >>> linear, y = sharded_linear(make_mesh((2, 4)))
        >>> linear.kernel.sharding.spec, y.sharding.spec
        (P(None, 'model'), P('data', 'model'))
    """

    @jax.jit
    def init_sharded_linear(key: jax.Array) -> nnx.Linear:
        init_fn = nnx.nn.linear.default_kernel_init
        return nnx.Linear(
            4,
            8,
            use_bias=False,
            rngs=nnx.Rngs(key),
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
        )

    rngs = nnx.Rngs(seed)
    with jax.set_mesh(mesh):
        linear = init_sharded_linear(rngs())
        x = jax.device_put(jnp.ones((16, 4)), P("data", None))
        y = jax.jit(lambda m, x: m(x))(linear, x)
    return linear, y


# -- The guide's models ------------------------------------------------------------------


class DotReluDot(nnx.Module):
    """The guide's layer: ``relu(x @ W1) @ W2``, ``W1`` over ``model`` by columns, ``W2`` by rows."""

    def __init__(self, depth: int, rngs: nnx.Rngs) -> None:
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=nnx.with_partitioning(init_fn, (None, "model")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=("model", None))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.dot1(x))
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        return jnp.dot(y, self.w2[...])


class MultiDotReluDot(nnx.Module):
    """``num_layers`` :class:`DotReluDot` s made by ``nnx.vmap`` (the added axis replicated)."""

    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs) -> None:
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r: nnx.Rngs) -> DotReluDot:
            return DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.split(num_layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


class LogicalDotReluDot(nnx.Module):
    """The guide's logical layer, placed by meshplan's rules.

    ``W1`` is ``('embed', 'hidden')``, ``W2`` is ``('hidden', 'embed')``, and the
    activation is constrained to ``('batch', 'hidden')``: logical names, where
    the guide has to write mesh axes (``P('data', None)``).
    """

    def __init__(self, depth: int, rngs: nnx.Rngs) -> None:
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=meshplan.with_nnx_partitioning(init_fn, ("embed", "hidden")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(
            init_fn(rngs.params(), (depth, depth)), **meshplan.nnx_sharding(("hidden", "embed"))
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.dot1(x))
        y = meshplan.with_logical_constraint(y, ("batch", "hidden"))
        # On an Explicit mesh the contraction over the sharded 'hidden' needs its output
        # sharding; on an Auto mesh explicit_out_sharding gives None and the compiler chooses.
        out = meshplan.explicit_out_sharding(("batch", "embed"))
        return jnp.dot(y, self.w2[...], out_sharding=out)


class LogicalMultiDotReluDot(nnx.Module):
    """``num_layers`` :class:`LogicalDotReluDot` s made by ``nnx.vmap``, run by ``jax.lax.scan``."""

    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs) -> None:
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: None})
        def create_sublayers(r: nnx.Rngs) -> LogicalDotReluDot:
            return LogicalDotReluDot(depth, r)

        self.layers = create_sublayers(rngs.split(num_layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


class ExplicitDotReluDot(nnx.Module):
    """The guide's Explicit-axis layer: shardings in the arrays' types, no metadata."""

    def __init__(self, depth: int, rngs: nnx.Rngs) -> None:
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=functools.partial(init_fn, out_sharding=P(None, "model")),
            use_bias=False,
            rngs=rngs,
        )
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth), out_sharding=P("model", None)))
        self.b2 = nnx.Param(jnp.zeros((depth,), out_sharding=P(None)))

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.dot1(x))
        z = jnp.dot(y, self.w2[...], out_sharding=P("data", None))
        return z + self.b2[...]


class ExplicitMultiDotReluDot(nnx.Module):
    """``num_layers`` :class:`ExplicitDotReluDot` s made by ``jax.vmap(spmd_axis_name=None)``."""

    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs) -> None:
        @functools.partial(jax.vmap, spmd_axis_name=None)
        def create_sublayers(r: nnx.Rngs) -> ExplicitDotReluDot:
            return ExplicitDotReluDot(depth, r)

        self.layers = create_sublayers(rngs.split(num_layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


# -- Training ------------------------------------------------------------------------------


@jax.jit
def train_step(
    model: nnx.Module, optimizer: nnx.Optimizer[object], x: jax.Array, y: jax.Array
) -> tuple[nnx.Module, nnx.Optimizer[object], jax.Array]:
    """The guide's jitted step (mean squared error, ``optimizer.update``), returning the optimizer too."""

    def loss_fn(model: nnx.Module) -> jax.Array:
        y_pred = model(x)
        return jnp.mean((y_pred - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return model, optimizer, loss


@dataclasses.dataclass
class TrainRun:
    """What :func:`train` made: the trained model, its optimizer and the loss of each step."""

    model: object
    optimizer: nnx.Optimizer[Any]
    losses: list[float]
    x: jax.Array


def train(
    make_model: Callable[[nnx.Rngs], nnx.Module],
    mesh: Mesh,
    *,
    depth: int,
    steps: int = 5,
    batch: int = 8,
    rules: LogicalRules = (),
) -> TrainRun:
    """The guide's training loop: ``steps`` Adam steps fitting random labels, on ``mesh``.

    ``make_model(rngs)`` builds the model under ``jax.set_mesh(mesh)`` and
    ``meshplan.logical_axis_rules(rules)`` (Flax's eager sharding places it);
    inputs and labels are ``(batch, depth)`` over ``data``.

    Example:
        >>> from flax import nnx
        >>> from meshplan.models.workflow_nnx import MultiDotReluDot, make_mesh, train
        >>> run = train(lambda r: MultiDotReluDot(64, 2, rngs=r), make_mesh((2, 4)), depth=64)
        >>> run.losses[-1] < run.losses[0], int(run.optimizer.step[...])
        (True, 5)
    """
    rngs = nnx.Rngs(0)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        x = jax.device_put(rngs.normal((batch, depth)), P("data", None))
        label = jax.device_put(rngs.normal((batch, depth)), P("data", None))
        model = make_model(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
        losses = []
        for _ in range(steps):
            model, optimizer, loss = train_step(model, optimizer, x, label)
            losses.append(float(loss))
    return TrainRun(model, optimizer, losses, x)


# -- Checkpoints -------------------------------------------------------------------------


def abstract_model(
    make_model: Callable[[], nnx.Module],
) -> tuple[nnx.GraphDef[Any], nnx.State[object, object]]:
    """``nnx.split`` of ``nnx.eval_shape(make_model)``: shapes and names, no arrays, no mesh.

    Flax's eager sharding is off while tracing, so no mesh and no rules are
    needed: meshplan places the abstract state afterwards, on any mesh.
    """
    with nnx.use_eager_sharding(False):  # type: ignore[no-untyped-call]
        model = nnx.eval_shape(make_model)
    graphdef, state = nnx.split(model)
    return graphdef, state


def save_state(state: nnx.State[object, object], directory: Path) -> Path:
    """Saves an ``nnx.State`` with Orbax's ``StandardCheckpointer``, as the guide does."""
    import orbax.checkpoint as ocp

    path = Path(directory).absolute() / "checkpoint_name"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, state)
        checkpointer.wait_until_finished()
    return path


def restore_onto(
    path: Path, make_model: Callable[[], nnx.Module], mesh: Mesh, rules: LogicalRules = ()
) -> Any:
    """The model saved at ``path``, read straight onto ``mesh`` and placed by ``rules``.

    The target shardings are :func:`meshplan.get_sharding` of the abstract state
    (see :func:`abstract_model`) on ``mesh`` under ``rules``: the mesh and the
    layout need not be those of the save.
    """
    import orbax.checkpoint as ocp

    graphdef, abstract = abstract_model(make_model)
    with meshplan.logical_axis_rules(rules):
        shardings = meshplan.get_sharding(abstract, mesh, strict=True)

    def target(value: jax.ShapeDtypeStruct, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)

    targets = jax.tree.map(target, abstract, shardings)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(Path(path), target=targets)
    return nnx.merge(graphdef, restored)


def restore_with_meshplan(
    model: nnx.Module,
    directory: Path,
    make_model: Callable[[], nnx.Module],
    mesh: Mesh,
    rules: LogicalRules,
    *,
    saved_rules: LogicalRules = GUIDE_RULES,
) -> Any:
    """``model`` saved by :class:`meshplan.Checkpointer`, restored onto ``mesh`` under ``rules``.

    The checkpoint stores each variable's logical names, so
    :func:`meshplan.restore` places the arrays on any mesh with any rules
    without the model; :meth:`meshplan.Restored.into` then puts them into the
    abstract model's variables (see :func:`abstract_model`).
    """
    with meshplan.Checkpointer(directory) as checkpointer:
        checkpointer.save(1, nnx.state(model), rules=saved_rules)
    restored = meshplan.restore(directory, mesh, rules)
    graphdef, abstract = abstract_model(make_model)
    return nnx.merge(graphdef, restored.into(abstract))


# -- Logical axes and Explicit axes -------------------------------------------------------


def run_logical(
    mesh: Mesh,
    depth: int,
    *,
    num_layers: int = 2,
    batch: int = 8,
    rules: LogicalRules = GUIDE_RULES,
) -> tuple[LogicalMultiDotReluDot, jax.Array]:
    """The guide's logical-axis section: create the model under ``rules`` and run it once.

    Example:
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> from meshplan.models.workflow_nnx import make_mesh, run_logical
        >>> mesh = make_mesh((2, 4))
        >>> model, output = run_logical(mesh, 64)
        >>> model.layers.dot1.kernel.out_sharding
        (None, 'embed', 'hidden')
        >>> output.sharding.is_equivalent_to(NamedSharding(mesh, P('data', None)), ndim=2)
        True
    """
    rngs = nnx.Rngs(1)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        x = jax.device_put(rngs.normal((batch, depth)), P("data", None))
        model = LogicalMultiDotReluDot(depth, num_layers, rngs=nnx.Rngs(0))
        output = jax.jit(lambda m, x: m(x))(model, x)
    return model, output


def run_explicit(
    mesh: Mesh, depth: int, *, num_layers: int = 2, batch: int = 8
) -> tuple[ExplicitMultiDotReluDot, jax.Array, jax.Array, Any]:
    """The guide's Explicit-axis section on ``mesh`` (Explicit axes).

    Returns the model, its input ``x`` and output ``y``, and ``jax.eval_shape`` of
    the model (whose arrays carry their shardings in their types).
    """
    rngs = nnx.Rngs(0)
    with jax.set_mesh(mesh):
        model = ExplicitMultiDotReluDot(depth, num_layers, rngs=nnx.Rngs(0))
        x = jax.device_put(rngs.normal((batch, depth)), NamedSharding(mesh, P("data", None)))
        y = model(x)
        abstract = jax.eval_shape(lambda: ExplicitMultiDotReluDot(depth, num_layers, nnx.Rngs(0)))
    return model, x, y, abstract
