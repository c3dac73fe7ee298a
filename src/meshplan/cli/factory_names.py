"""``--names FILE``: a factory's model named by path, and models given as JAX functions.

A model written without meshplan (Hugging Face's Flax models, Equinox, plain JAX)
carries no logical names. ``meshplan plan|search|train --model pkg.module:factory
--names FILE`` names it with :func:`meshplan.name_by_path`, the path rules read by
:func:`meshplan.layouts.get_names`. The patterns match the paths ``meshplan plan``
prints for the state: a parameter at ``params/transformer/h/0/mlp/c_fc/kernel``
is named when its parameters are created (inside ``init``), so the optimizer's
copies of it (Adam's ``mu`` and ``nu``) carry the same names, as they do for a model
that boxes its own parameters. A factory's ``(abstract_state, step_fn, example_batch)``
is named as a whole, and the step is given the state unboxed.

A model may also be a pair of JAX functions ``(init(key) -> params, apply(params,
inputs) -> outputs)``, as Haiku and ``jax.example_libraries.stax`` write them: how
Hugging Face's ``model(ids, params=params)``, an Equinox module split by
``eqx.partition`` and a plain-JAX function come in
(:mod:`meshplan.examples.third_party`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

from meshplan._spmd.boxes import unbox
from meshplan._spmd.by_path import PathRules, UnnamedLeavesWarning, name_by_path
from meshplan._spmd.explicit import explicit_mesh_error, is_sharding_type_error
from meshplan._types import InitFn, LossFn, PyTree, StepFn

__all__ = ["Namer", "functional_model", "is_functional"]


class Namer:
    """Names trees with ``path_rules``; what the first naming warned of is kept in ``notes``.

    The warning (arrays no pattern matches, patterns that match nothing) is said once, by
    the command, not each time ``init`` is traced.

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan.cli.factory_names import Namer
        >>> namer = Namer([(r"params/w", ("embed", "mlp"))])
        >>> named = namer.params({"w": jnp.zeros((2, 4)), "b": jnp.zeros(4)})
        >>> named["w"].names, namer.notes
        (('embed', 'mlp'), ['name_by_path: 1 array that no pattern matches stays unnamed (replicated): params/b. ...'])
    """

    def __init__(self, path_rules: PathRules) -> None:
        self.path_rules = path_rules
        self.notes: list[str] = []
        self._warned = False

    def tree(self, tree: PyTree) -> PyTree:
        """``tree`` named, its paths as they are."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UnnamedLeavesWarning)
            named = name_by_path(tree, self.path_rules)
        if not self._warned:
            self._warned = True
            self.notes.extend(
                str(w.message) for w in caught if issubclass(w.category, UnnamedLeavesWarning)
            )
        return named

    def params(self, params: PyTree) -> PyTree:
        """A model's parameters named at the paths they have in its state: ``params/...``."""
        return self.tree({"params": params})["params"]

    def init(self, init_params: InitFn) -> InitFn:
        """``init_params(key)`` whose parameters come out named."""

        def named_init(key: PyTree) -> PyTree:
            return self.params(init_params(key))

        return named_init

    def step(self, step_fn: StepFn) -> StepFn:
        """``step_fn`` given the named state unboxed, as the factory wrote it for."""

        def named_step(state: PyTree, batch: PyTree) -> PyTree:
            return step_fn(unbox(state), batch)

        return named_step


def is_functional(model: object) -> bool:
    """Whether ``model`` is a pair of JAX functions ``(init, apply)``.

    Example:
        >>> from meshplan.cli.factory_names import is_functional
        >>> is_functional((lambda key: {}, lambda params, x: x)), is_functional(print)
        (True, False)
    """
    return (
        isinstance(model, tuple | list)
        and len(model) == 2
        and callable(model[0])
        and callable(model[1])
    )


def functional_model(
    init: InitFn,
    apply: Callable[[PyTree, PyTree], PyTree],
    loss: LossFn,
    inputs: Callable[[PyTree], PyTree],
) -> tuple[InitFn, LossFn]:
    """``(init_params, loss(params, batch))`` of a model given as ``(init, apply)``.

    ``apply`` is given the parameters unboxed (its code knows no boxes), ``loss`` its
    outputs and the batch; ``inputs(batch)`` is what ``apply`` is called on. Parameters
    that are not a mapping (an Equinox module's arrays, ``eqx.filter(model,
    eqx.is_array)``) are kept under their type's name (``params/MLP/layers/0/weight``):
    Flax's ``TrainState`` asks its parameters for keys. Traced
    on a mesh with Explicit axes, an ``apply`` that JAX refuses there (Hugging Face's
    embedding lookups) raises a :class:`~meshplan.MeshError` (``'explicit-mesh'``)
    that names it and says to use Auto axes (:mod:`meshplan._spmd.explicit`).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from meshplan.cli.factory_names import functional_model
        >>> init = lambda key: {"w": jax.random.normal(key, (4, 2))}
        >>> apply = lambda params, x: x @ params["w"]
        >>> init_params, loss = functional_model(init, apply, lambda y, b: jnp.sum(y), lambda b: b)
        >>> float(loss(init_params(jax.random.key(0)), jnp.zeros((3, 4))))
        0.0
    """

    call = f"the model's apply ({getattr(apply, '__qualname__', type(apply).__name__)})"
    wrapped: list[str] = []  # the key a module's arrays are kept under, once init has run

    def model_init(key: PyTree) -> PyTree:
        params = init(key)
        if isinstance(params, Mapping):
            return params
        # Flax's TrainState asks its params for keys: a module (Equinox's) goes in a dict
        wrapped[:] = [type(params).__name__]
        return {wrapped[0]: params}

    def model_loss(params: PyTree, batch: PyTree) -> PyTree:
        raw = unbox(params)
        try:
            outputs = apply(raw[wrapped[0]] if wrapped else raw, inputs(batch))
        except Exception as e:  # JAX's ShardingTypeError is private: matched by name
            if is_sharding_type_error(e):
                raise explicit_mesh_error(e, call) from e
            raise
        return loss(outputs, batch)

    return model_init, model_loss
