"""``--model pkg.module:factory``: a user's model for ``meshplan plan``, ``search`` and ``train``.

The factory is a function of no arguments, imported from a module on
``sys.path`` or in the current folder, that returns one of:

* ``(model, example_batch, loss, batches)``: the form every command takes, and
  the one ``meshplan train`` needs (it reads the data from ``batches``):

  - ``model``: a Flax Linen module, or for Flax NNX a function
    ``make(rngs) -> nnx.Module`` (called with ``nnx.Rngs(key)``; the module's
    state must be ``nnx.Param``\\ s), or a pair of JAX functions ``(init(key) ->
    params, apply(params, inputs) -> outputs)`` (Hugging Face's Flax models,
    Equinox, plain JAX: :mod:`meshplan.cli.factory_names`);
  - ``example_batch``: a batch (arrays or ``jax.ShapeDtypeStruct``\\ s, first
    dimension ``'batch'``); a tuple ``(inputs, targets, ...)`` gives the model its
    first item and the loss all of it;
  - ``loss(outputs, batch) -> scalar``;
  - ``batches``: ``batches(split, index) -> batch`` (``split`` is ``"train"`` or
    ``"valid"``; numpy or JAX arrays of the whole global batch, the same in every
    process), or an iterable of batches (its first ``--eval-batches`` are held
    out for validation).

* ``(abstract_state, step_fn, example_batch)``: the state (``jax.eval_shape`` of
  its init, arrays carrying logical names: Linen boxes or NNX variables),
  ``step_fn(state, batch)`` (one train step, not jitted) and a batch
  (arrays or ``jax.ShapeDtypeStruct``\\ s, first dimension ``'batch'``);
* ``(module, example_batch)`` or ``(module, example_batch, loss)``: a Flax Linen
  module, its inputs, and ``loss(outputs, batch)`` (default: the mean of the
  squared outputs); the step is Adam on that loss
  (:func:`meshplan._search.predict.step.linen_step`). A tuple batch
  ``(images, labels)`` gives the module its first item and the loss all of it.
  Flax NNX models use the first form: ``nnx.eval_shape`` of the model's
  construction (or ``nnx.state`` of an abstract model) and a step function.

A factory that cannot be imported, is missing, fails, or returns something
else is refused with an :class:`~meshplan.ArgumentError` that says which, and
how to write it.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import TYPE_CHECKING

from meshplan._errors import ArgumentError, LogicalNamesError
from meshplan._spmd.by_path import PathRules
from meshplan._types import Batches, LossFn, PyTree, StepFn
from meshplan.cli.factory_names import Namer, functional_model, is_functional
from meshplan.models.registry import EXAMPLE_MODELS

if TYPE_CHECKING:
    from meshplan.train.model import TrainModel

__all__ = [
    "BUILT_IN_MODELS",
    "FactoryModel",
    "IterableBatches",
    "Trainable",
    "is_factory",
    "load_factory",
]

BUILT_IN_MODELS = tuple(EXAMPLE_MODELS)
"""The models ``--model`` knows by name."""

_PROTOCOL = (
    "A --model factory is a function of no arguments returning (model, example_batch, loss, "
    "batches), with model a Flax Linen module, for Flax NNX make(rngs) -> nnx.Module, or a "
    "pair of JAX functions (init(key) -> params, apply(params, inputs) -> outputs), and "
    "batches(split, index) -> batch or an iterable of batches (what meshplan train needs); "
    "plan and search also take (abstract_state, step_fn, example_batch), (linen_module, "
    "example_batch) or (linen_module, example_batch, loss). A tuple batch (inputs, targets) "
    "gives the model its inputs and loss(outputs, batch) all of it."
)


@dataclasses.dataclass
class FactoryModel:
    """What a factory gave, as a step: ``what`` describes it (for headers)."""

    what: str
    abstract_state: PyTree
    step_fn: StepFn
    example_batch: PyTree
    kind: str  # 'step', 'linen', 'nnx' or 'jax'
    trainable: Trainable | None = None
    """The model as ``meshplan train`` trains it: given by the four-value form only."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What naming it by ``--names`` warned of (arrays no pattern matches), for the command."""


@dataclasses.dataclass(frozen=True)
class Trainable:
    """A factory's model as ``meshplan train`` trains it.

    Attributes:
        model: The :class:`~meshplan.train.model.TrainModel`: a Linen module, or an
            NNX model's ``init_params(key)``, and ``loss(params, batch)``.
        batches: ``batches(split, index) -> batch`` of host arrays (the global batch).
        example_batch: Shapes and dtypes of one batch.
        api: ``"Flax Linen"`` or ``"Flax NNX"``.
        name: The model's class name.
    """

    model: TrainModel
    batches: Batches
    example_batch: PyTree
    api: str
    name: str


def is_factory(spec: str) -> bool:
    """``True`` for ``pkg.module:factory``, ``False`` for a built-in model's name.

    Example:
        >>> from meshplan.cli.factory import is_factory
        >>> is_factory("mymodels:tiny"), is_factory("mlp")
        (True, False)
    """
    return ":" in spec


def model_problem(spec: str) -> str | None:
    """What is wrong with ``--model spec`` before anything is imported, or ``None``.

    Example:
        >>> from meshplan.cli.factory import model_problem
        >>> print(model_problem("gpt"))
        --model 'gpt' is neither a built-in model (mlp, transformer, transformer-nnx) nor a factory written pkg.module:function.
        Pass --model mlp, transformer or transformer-nnx, or --model mymodels:make_model for a function make_model in mymodels.py.
    """
    if spec in BUILT_IN_MODELS:
        return None
    module, _, attr = spec.partition(":")
    if is_factory(spec) and module.strip() and attr.strip() and ":" not in attr:
        return None
    return (
        f"--model {spec!r} is neither a built-in model ({', '.join(BUILT_IN_MODELS)}) nor a "
        f"factory written pkg.module:function.\nPass --model mlp, transformer or "
        f"transformer-nnx, or --model mymodels:make_model for a function make_model in "
        f"mymodels.py."
    )


def _import(module_name: str, spec: str) -> ModuleType:
    here = os.getcwd()
    if here not in sys.path and "" not in sys.path:
        sys.path.insert(0, here)  # the current folder, as `python -m` has it
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise ArgumentError(
                f"--model {spec}: no module named {missing!r} (looked in the current folder "
                f"{here} and on sys.path).\nPut {module_name.replace('.', '/')}.py in the "
                f"current folder, or add its folder to PYTHONPATH."
            ) from None
        raise ArgumentError(
            f"--model {spec}: importing {module_name!r} failed: it imports {missing!r}, which "
            f"is not installed.\nInstall {missing.split('.')[0]!r}, or remove that import."
        ) from None
    except Exception as e:  # the user's module raised while importing
        raise ArgumentError(
            f"--model {spec}: importing {module_name!r} raised {type(e).__name__}: {e}\n"
            f"Fix the module so that `import {module_name}` works."
        ) from None


def load_factory(spec: str, names: PathRules | None = None) -> FactoryModel:
    """Imports ``pkg.module:function``, calls it, and reads what it returned.

    ``names``: path rules (``--names FILE``, :mod:`meshplan.cli.factory_names`) that name
    the model's arrays, at the paths its state has (``params/...``).

    Example:
        >>> from meshplan.cli.factory import load_factory
        >>> load_factory("json:dumps")
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: --model json:dumps: calling json.dumps() raised TypeError: ...

    Raises:
        ArgumentError: the module is not found (or fails to import), has no such
            attribute, it is not callable, calling it fails, or it returns
            something other than the protocol's tuples.
    """
    problem = model_problem(spec)
    if problem is not None:
        raise ArgumentError(problem)
    module_name, _, attr = (s.strip() for s in spec.partition(":"))
    module = _import(module_name, spec)
    where = getattr(module, "__file__", None) or module_name
    if where.startswith(os.getcwd() + os.sep):
        where = os.path.relpath(where)  # in the current folder: its name is enough
    if not hasattr(module, attr):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        listed = ", ".join(public[:12]) + (", ..." if len(public) > 12 else "")
        raise ArgumentError(
            f"--model {spec}: module {module_name!r} has no attribute {attr!r}"
            f"{f'; its functions: {listed}' if listed else ''} (in {where}).\nPass --model "
            f"{module_name}:NAME with NAME a function of that module."
        )
    factory = getattr(module, attr)
    if not callable(factory):
        raise ArgumentError(
            f"--model {spec}: {module_name}.{attr} is not a function but an object of type "
            f"{type(factory).__name__}.\n{_PROTOCOL}"
        )
    try:
        returned = factory()
    except Exception as e:
        raise ArgumentError(
            f"--model {spec}: calling {module_name}.{attr}() raised {type(e).__name__}: {e}\n"
            f"{_PROTOCOL}"
        ) from None
    return _read(spec, returned, None if names is None else Namer(names))


def _read(spec: str, returned: object, namer: Namer | None = None) -> FactoryModel:
    import flax.linen as nn
    import jax

    got = f"an object of type {type(returned).__name__}"
    if isinstance(returned, tuple | list):
        got = f"a {type(returned).__name__} of {len(returned)}: ({', '.join(type(v).__name__ for v in returned)})"
        first = returned[0] if returned else None
        if len(returned) == 4 and (
            isinstance(first, nn.Module) or callable(first) or is_functional(first)
        ):
            model, batch, loss, batches = returned
            return _read_trainable(spec, model, batch, loss, batches, namer)
        if returned and isinstance(returned[0], nn.Module) and len(returned) in (2, 3):
            module, batch = returned[0], returned[1]
            loss = returned[2] if len(returned) == 3 else None
            if loss is not None:
                _check_loss(spec, loss)
            _check_batch(spec, batch)
            if namer is not None:  # the form train takes, with no batches: named at init
                mean_square = loss or (lambda y, _: jax.numpy.mean(jax.numpy.square(y)))
                return _read_trainable(spec, module, batch, mean_square, None, namer=namer)
            from meshplan._search.predict.step import linen_step

            try:
                state, step, batch = linen_step(module, batch, loss)
            except Exception as e:
                raise ArgumentError(
                    f"--model {spec}: initialising the {type(module).__name__} on the example "
                    f"batch raised {type(e).__name__}: {e}\nReturn the inputs its __call__ "
                    f"takes as the second value."
                ) from None
            name = f"{spec}: {type(module).__name__} (Flax Linen)"
            return FactoryModel(name, state, step, batch, "linen")
        if len(returned) == 3 and callable(returned[1]) and not isinstance(returned[0], nn.Module):
            state, step, batch = returned
            if not jax.tree.leaves(state):
                raise ArgumentError(
                    f"--model {spec}: the abstract state (first value) holds no arrays.\n"
                    f"Return jax.eval_shape of the model's init, with logical names."
                )
            _check_batch(spec, batch)
            if namer is not None:
                state, step = namer.tree(state), namer.step(step)
            what = f"{spec} (step function)"
            return FactoryModel(
                what, state, step, batch, "step", None, namer.notes if namer else []
            )
    raise ArgumentError(f"--model {spec}: the factory returned {got}.\n{_PROTOCOL}")


def _check_loss(spec: str, loss: object) -> None:
    if not callable(loss):
        raise ArgumentError(
            f"--model {spec}: the loss (third value) is a {type(loss).__name__}, not a "
            f"function loss(outputs, batch).\n{_PROTOCOL}"
        )


def _check_batch(spec: str, batch: PyTree) -> None:
    import jax

    leaves = jax.tree.leaves(batch)
    if not leaves or not all(getattr(x, "shape", ()) for x in leaves):
        raise ArgumentError(
            f"--model {spec}: the example batch holds no arrays with a batch dimension "
            f"(got {type(batch).__name__}).\nReturn arrays or jax.ShapeDtypeStructs whose first "
            f"dimension is the batch, e.g. jax.ShapeDtypeStruct((32, 64), jnp.float32)."
        )


def _inputs(batch: PyTree) -> PyTree:
    """What the model is called on: a tuple batch's first item, else the batch."""
    return batch[0] if isinstance(batch, tuple | list) else batch


def _read_trainable(
    spec: str,
    model: PyTree,  # a Linen module, an NNX make(rngs), or (init, apply)
    batch: PyTree,
    loss: LossFn,
    batches: PyTree,  # batches(split, index), or an iterable of batches
    namer: Namer | None = None,
) -> FactoryModel:
    """The four-value form ``(model, example_batch, loss, batches)``: every command's.

    ``batches=None``: a Linen module's ``(module, example_batch[, loss])`` named by
    ``--names`` (for plan and search: no :class:`Trainable`).
    """
    import flax.linen as nn
    import jax

    from meshplan.train.model import TrainModel

    _check_loss(spec, loss)
    _check_batch(spec, batch)
    example = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    source = None if batches is None else _batch_source(spec, batches)
    if isinstance(model, nn.Module):
        module = model

        def linen_loss(params: PyTree, b: PyTree) -> PyTree:
            return loss(module.apply({"params": params}, _inputs(b)), b)

        train = TrainModel(module, linen_loss, _inputs(example))
        if namer is not None:
            x = _inputs(example)
            train = TrainModel(
                namer.init(lambda key: module.init(key, _zeros(x))["params"]), linen_loss
            )
        api, name = "Flax Linen", type(module).__name__
    elif is_functional(model):
        init, functional_loss = functional_model(model[0], model[1], loss, _inputs)
        train = TrainModel(init if namer is None else namer.init(init), functional_loss)
        api, name = "JAX functions", getattr(model[0], "__qualname__", "init").split(".")[0]
    else:
        train, name = _nnx_model(spec, model, loss)
        if namer is not None:
            train = TrainModel(namer.init(train.model), train.loss)
        api = "Flax NNX"
    try:
        abstract = train.abstract_state()
    except LogicalNamesError:
        raise  # --names that do not fit the arrays: the error names each path
    except Exception as e:
        raise ArgumentError(
            f"--model {spec}: initialising the {name} on the example batch raised "
            f"{type(e).__name__}: {e}\nReturn the inputs the model takes as the second value "
            f"(or a tuple batch whose first item they are)."
        ) from None
    trainable = None if source is None else Trainable(train, source, example, api, name)
    kind = {"Flax NNX": "nnx", "Flax Linen": "linen"}.get(api, "jax")
    notes = [] if namer is None else namer.notes
    what = f"{spec}: {name} ({api})"
    return FactoryModel(what, abstract, train.step, example, kind, trainable, notes)


def _zeros(example: PyTree) -> PyTree:
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), example)


def _nnx_model(spec: str, make: Callable[..., object], loss: LossFn) -> tuple[TrainModel, str]:
    """A Flax NNX ``make(rngs) -> nnx.Module`` as a functional model: ``init(key)``, a loss of its state."""
    import jax
    from flax import nnx

    from meshplan.train.model import TrainModel

    def create(key: PyTree) -> PyTree:
        # The names are logical: meshplan's rules place the state (with out_shardings),
        # not Flax's eager sharding, which would read them as mesh axes.
        with nnx.use_eager_sharding(False):  # type: ignore[no-untyped-call]
            return make(nnx.Rngs(key))

    try:
        abstract_model = nnx.eval_shape(lambda: create(0))
    except Exception as e:
        raise ArgumentError(
            f"--model {spec}: calling the model function (first value) as make(nnx.Rngs(0)) "
            f"raised {type(e).__name__}: {e}\nReturn a Flax Linen module, or for Flax NNX a "
            f"function make(rngs) -> nnx.Module."
        ) from None
    if not isinstance(abstract_model, nnx.Module):
        raise ArgumentError(
            f"--model {spec}: the model function (first value) returned a "
            f"{type(abstract_model).__name__}, not an nnx.Module.\n{_PROTOCOL}"
        )
    name = type(abstract_model).__name__
    graphdef, _params, rest = nnx.split(abstract_model, nnx.Param, ...)  # type: ignore[misc]
    others = [
        "/".join(str(getattr(key, "key", key)) for key in path)
        for path, _ in jax.tree_util.tree_leaves_with_path(
            rest, is_leaf=lambda x: isinstance(x, nnx.Variable)
        )
    ]
    if others:
        shown = ", ".join(others[:4]) + (f" and {len(others) - 4} more" if len(others) > 4 else "")
        raise ArgumentError(
            f"--model {spec}: the {name}'s state holds variables that are not nnx.Param: "
            f"{shown}.\nmeshplan train trains NNX models whose state is parameters only: "
            f"keep other state (RNG streams, batch statistics) out of the module."
        )

    def init_params(key: jax.Array) -> PyTree:
        return nnx.state(create(key))

    def nnx_loss(state: PyTree, b: PyTree) -> PyTree:
        return loss(nnx.merge(graphdef, state)(_inputs(b)), b)

    return TrainModel(init_params, nnx_loss), name


class IterableBatches:
    """``batches(split, index)`` over an iterable: its first ``eval_batches`` held out for
    validation, then one batch per step, in order (a resumed run skips the steps done)."""

    def __init__(self, spec: str, iterable: Iterable[PyTree]) -> None:
        self.spec = spec
        self._it = iter(iterable)
        self._valid: list[PyTree] | None = None
        self._next = 0  # the train index the next batch drawn is
        self._last: PyTree = None

    def hold_out(self, count: int) -> None:
        """Draws validation batches up to ``count``, before any train batch is drawn."""
        if self._valid is None:
            self._valid = []
        while len(self._valid) < count and self._next == 0:
            self._valid.append(self._draw("valid", len(self._valid)))

    def _draw(self, split: str, index: int) -> PyTree:
        try:
            return next(self._it)
        except StopIteration:
            raise ArgumentError(
                f"--model {self.spec}: the batches ran out at {split} batch {index}.\nReturn "
                f"an iterable that does not end (e.g. itertools.cycle), or a function "
                f"batches(split, index)."
            ) from None

    def __call__(self, split: str, index: int) -> PyTree:
        if split == "valid":
            self.hold_out(index + 1)
            if not self._valid:
                raise ArgumentError(
                    f"--model {self.spec}: no validation batch was held out of the iterable "
                    f"before training began.\nReturn a function batches(split, index)."
                )
            return self._valid[index % len(self._valid)]
        if index == self._next - 1:
            return self._last
        if index < self._next - 1:
            raise ArgumentError(
                f"--model {self.spec}: train batch {index} was asked for after batch "
                f"{self._next - 1}, and an iterable cannot go back.\nReturn a function "
                f"batches(split, index) instead."
            )
        while self._next <= index:
            self._last = self._draw("train", self._next)
            self._next += 1
        return self._last


def _batch_source(spec: str, batches: PyTree) -> Batches:
    """``batches(split, index)``: the factory's function, or one over its iterable."""
    if callable(batches):
        source: Batches = batches
        return source
    try:
        iter(batches)
    except TypeError:
        raise ArgumentError(
            f"--model {spec}: the batches (fourth value) are a {type(batches).__name__}, "
            f"neither a function batches(split, index) nor an iterable of batches.\n{_PROTOCOL}"
        ) from None
    return IterableBatches(spec, batches)
