"""A run's parts built from its decided settings, and what is wrong with them, all at once.

:func:`build_parts` is the one call ``meshplan train`` makes to the library before the
:class:`~meshplan.train.trainer.Trainer`: given the settings (decided already: the
user's, the checkpoint's or the defaults), the mesh's axis sizes, the layout and the
model, it builds the mesh, the rules, the optimizer and the abstract state, and checks
them against each other, against the checkpoint being resumed and, when asked, against
what a device holds (:mod:`meshplan.train.memory`). Nothing is raised:
every error and every problem is a record in the :class:`BuiltParts` it returns, with
its code, so that the caller reports them together, in its own words (the command
line's are flags).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import optax
from jax.sharding import Mesh

from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._checkpoint.restore import mismatch_problems
from meshplan._checkpoint.tree import flatten_state
from meshplan._errors import MeshplanError, Problem
from meshplan._spmd.rules import LogicalRules
from meshplan._spmd.tree_check import no_names_in_tree
from meshplan._spmd.validate import validate
from meshplan._types import PyTree
from meshplan.layouts import get_layout
from meshplan.train.device_mesh import make_mesh
from meshplan.train.memory import MemoryShortfall, memory_shortfall
from meshplan.train.model import TrainModel
from meshplan.train.settings import TrainSettings, make_optimizer
from meshplan.train.state import PlanSummary, abstract_train_state, plan_summary, state_shardings

__all__ = ["BuiltParts", "build_parts"]


@dataclasses.dataclass
class BuiltParts:
    """What :func:`build_parts` built, each ``None`` when it could not be, and why.

    Attributes:
        settings_ok: The settings pass :meth:`TrainSettings.problems` (else no state is
            built: its shapes come from them).
        mesh: The mesh, or ``None`` (no shape given, or :attr:`mesh_error`).
        rules: The layout's rules, or ``None`` (:attr:`rules_error`).
        tx: The optimizer of the settings (``None`` without a model or sane settings).
        abstract: The abstract ``TrainState`` (``jax.eval_shape``), or ``None``.
        mesh_error: Why the mesh could not be made (:func:`make_mesh`'s error).
        rules_error: Why the layout could not be had (:func:`get_layout`'s error).
        state_error: What creating the abstract state raised (a model of the user's own
            may raise anything).
        mismatch: The arrays of the checkpoint that do not fit the state, one problem each
            (:func:`~meshplan._checkpoint.restore.mismatch_problems`: code
            ``'checkpoint-mismatch'``, by path).
        uneven: The parameters the layout cannot split evenly on the mesh: the
            validator's problems of code ``'indivisible'``, by path (``params/...``).
        batch: The arrays of the example batch whose first dimension, ``'batch'``, the
            layout cannot split: the validator's errors, by path (``batch[0]``).
        unnamed: The ``'no-names'`` problem when no array of the state carries a logical
            name under the rules (every array would be replicated), else ``None``
            (:func:`~meshplan._spmd.tree_check.no_names_in_tree`).
        memory: How a step of the memory batch does not fit in a device
            (:func:`~meshplan.train.memory.memory_shortfall`), or ``None``: it fits, was
            not asked for, or something else is wrong (then it is not traced).
        shardings: The abstract state's ``NamedSharding``\\ s under the layout
            (:func:`~meshplan.train.state.state_shardings`), when nothing is wrong, else
            ``None``: the :class:`~meshplan.train.trainer.Trainer` takes them.
        plan: What a device holds of the state under the layout (parameter count, bytes
            per device and in all: :func:`~meshplan.train.state.plan_summary`, from
            :func:`meshplan.explain`), or ``None``: something is wrong.
    """

    settings_ok: bool
    mesh: Mesh | None = None
    rules: LogicalRules | None = None
    tx: optax.GradientTransformation | None = None
    abstract: PyTree = None
    mesh_error: MeshplanError | None = None
    rules_error: MeshplanError | None = None
    state_error: Exception | None = None
    mismatch: list[Problem] = dataclasses.field(default_factory=list)
    uneven: list[Problem] = dataclasses.field(default_factory=list)
    batch: list[Problem] = dataclasses.field(default_factory=list)
    unnamed: Problem | None = None
    memory: MemoryShortfall | None = None
    shardings: PyTree = None
    plan: PlanSummary | None = None


def build_parts(
    settings: TrainSettings,
    shape: Mapping[str, int] | None,
    devices: Sequence[object] | None,
    layout: str | LogicalRules | None,
    model: TrainModel | None,
    stored: CheckpointMetadata | None = None,
    example_batch: PyTree = None,
    memory_batch: PyTree = None,
) -> BuiltParts:
    """The mesh, rules, optimizer and abstract state of a run, checked, every problem kept.

    Args:
        settings: The run's settings, decided.
        shape: ``{axis: size}`` of the mesh (``None``: no mesh, its problem is known).
        devices: The devices to build it on (``None``: JAX's default devices).
        layout: A built-in layout's name or a rules file (:func:`get_layout`), or the
            rules it gave the caller already (``None``: none, its problem is known).
        model: The model to build the state of (``None``: none, its problem is known).
        stored: The metadata of the checkpoint being resumed, whose arrays the state
            must fit.
        example_batch: A batch whose every array's first dimension is ``'batch'``,
            checked against the mesh and rules (``None``: not checked here).
        memory_batch: What a device holds of a step's batch at a time (one microbatch;
            ``ShapeDtypeStruct``\\ s will do): the step of it is traced and its memory
            predicted against a device's, once nothing else is wrong (``None``: not
            checked; it takes a trace, so a caller with problems of its own leaves it out).

    Example:
        >>> from meshplan.train.build import build_parts
        >>> from meshplan.train.settings import TrainSettings
        >>> parts = build_parts(TrainSettings(batch=0), {"data": 1}, None, "nope", None)
        >>> parts.settings_ok, dict(parts.mesh.shape), parts.rules_error.problems[0].code
        (False, {'data': 1}, 'unknown-layout')
    """
    parts = BuiltParts(settings_ok=not settings.problems())
    if shape is not None:
        try:
            parts.mesh = make_mesh(shape, devices)
        except MeshplanError as e:
            parts.mesh_error = e
    if model is not None and parts.settings_ok:
        parts.tx = make_optimizer(settings)
        try:
            parts.abstract = abstract_train_state(
                model.model, parts.tx, settings, model.example_input
            )
        except Exception as e:  # a model of the user's own may raise anything
            parts.state_error = e
    if parts.abstract is not None and stored is not None:
        parts.mismatch = mismatch_problems(stored, parts.abstract)
    if isinstance(layout, str):
        try:
            parts.rules = get_layout(layout)
        except MeshplanError as e:
            parts.rules_error = e
    else:
        parts.rules = layout
    mesh, rules = parts.mesh, parts.rules
    if mesh is None or rules is None:
        return parts
    if parts.abstract is not None:
        parts.uneven = [
            p
            for key, (value, box) in flatten_state(parts.abstract.params).items()
            if box is not None
            for p in validate(f"params/{key}", tuple(value.shape), box.names, mesh, rules)
            if p.code == "indivisible"
        ]
        parts.unnamed = no_names_in_tree(parts.abstract, rules)
    if example_batch is not None:
        for path, leaf in jax.tree_util.tree_leaves_with_path(example_batch):
            where = f"batch{jax.tree_util.keystr(path)}"
            names = ("batch",) + (None,) * (len(leaf.shape) - 1)
            parts.batch += [
                p
                for p in validate(where, tuple(leaf.shape), names, mesh, rules)
                if p.severity == "error"
            ]
    sound = not (parts.state_error or parts.mismatch or parts.uneven or parts.batch)
    if memory_batch is not None and model is not None and parts.abstract is not None and sound:
        parts.memory = memory_shortfall(model, parts.abstract, memory_batch, mesh, rules)
    if parts.abstract is not None and sound:  # the layout applied to the state, once
        parts.shardings = state_shardings(parts.abstract, mesh, rules)
        name = layout if isinstance(layout, str) else ""
        parts.plan = plan_summary(parts.abstract, parts.shardings, mesh, rules, name)
    return parts
