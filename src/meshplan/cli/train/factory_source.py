"""``meshplan train --model pkg.module:factory``: a user's own model, trained on its own batches.

The factory's four-value form (:mod:`meshplan.cli.factory`) gives the model, an
example batch, the loss and the batches; the run is checked like the built-in
Transformer's (rules, mesh, checkpoint folder, settings, the layout against every
parameter and batch array), then trained by the same :class:`Trainer`, with the
same checkpoints. A resumed run imports the factory again and checks that the
checkpoint's arrays fit its state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from meshplan._errors import ArgumentError, CheckpointError, MeshplanError
from meshplan._spmd.by_path import PathRules
from meshplan._spmd.rules import LogicalRules, logical_to_mesh_axes
from meshplan._spmd.tree_check import no_names_in_tree
from meshplan.cli.factory import IterableBatches, Trainable, load_factory
from meshplan.cli.names_file import no_names_text, notes_text, read_names
from meshplan.cli.train.checks import Problems
from meshplan.cli.train.factory_checks import factory_problems
from meshplan.cli.train.flags import MODEL_FLAGS
from meshplan.cli.train.flags import flag as model_flag
from meshplan.cli.train.request import (
    PreparedRun,
    TrainRequest,
    placement_problems,
    raise_if_any,
    read_flags,
    resolve_settings,
    uneven_problems,
)
from meshplan.cli.trained_models import model_of
from meshplan.train.build import build_parts
from meshplan.train.parts import Checkpoints, Measures, Placement
from meshplan.train.trainer import Trainer

__all__ = ["batch_placer", "place_batch", "prepare_factory_run"]


def place_batch(batch: Any, mesh: Mesh, rules: LogicalRules) -> Any:
    """A global host batch on ``mesh``: every array's first dimension is ``'batch'``.

    Every process passes the same global batch; each device gets its slice.

    Example:
        >>> import jax, numpy as np
        >>> from meshplan.cli.train.factory_source import place_batch
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> images, labels = place_batch((np.zeros((8, 3, 3)), np.zeros(8, np.int32)), mesh,
        ...                              (("batch", "data"),))
        >>> images.sharding.spec, labels.sharding.spec
        (P('data', None, None), P('data',))
    """

    return batch_placer(mesh, rules)(batch)


def batch_placer(mesh: Mesh, rules: LogicalRules) -> Callable[[Any], Any]:
    """:func:`place_batch` for every step's batch: each rank's sharding is resolved once."""
    shardings: dict[int, NamedSharding] = {}

    def put(x: Any) -> jax.Array:
        x = np.asarray(x)
        if x.ndim not in shardings:
            spec = logical_to_mesh_axes(("batch",) + (None,) * (x.ndim - 1), rules)
            shardings[x.ndim] = NamedSharding(mesh, spec)
        sharding = shardings[x.ndim]
        if sharding.is_fully_addressable:  # one process: the batched host-to-devices copy
            put: jax.Array = jax.device_put(x, sharding)
            return put
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def place(batch: Any) -> Any:
        return jax.tree.map(put, batch)

    return place


def prepare_factory_run(request: TrainRequest) -> PreparedRun:
    """Checks a ``--model pkg.module:factory`` request and returns its ``PreparedRun``.

    Every problem is reported together, before any array is created, as for the
    built-in Transformer (:func:`meshplan.cli.train.request.prepare_run`).

    Raises:
        MeshplanError: one bullet per problem, then the fixes.
    """
    flags = read_flags(request)  # the flags alone, the checkpoint and the layout
    ckpt_dir, resume, stored = flags.ckpt_dir, flags.resume, flags.resume.stored
    problems = Problems()
    spec = str(request.model)
    if stored is not None and model_of(stored) != spec:
        problems.add(
            CheckpointError,
            f"the checkpoint holds --model {model_of(stored)}, this run asks for --model {spec}",
            f"Resume with --model {model_of(stored)}, or train into a new --ckpt-dir.",
        )
    dests = {field: dest for dest, field in MODEL_FLAGS.items()}
    for flag in (["--size"] if request.config else []) + [
        model_flag(dests.get(name, name)) for name in request.overrides
    ]:
        problems.add(
            ArgumentError,
            f"{flag} sets the built-in Transformer, not --model {spec}",
            f"Leave out {flag}: the factory builds the model.",
        )
    if request.data is not None:
        problems.add(
            ArgumentError,
            f"--data reads text for the built-in Transformer; --model {spec} brings its "
            f"own batches",
            "Leave out --data: the factory's fourth value gives the batches.",
        )
    trainable: Trainable | None = None
    names_file, names = request.names, None
    stored_names = None if stored is None else (stored.extra.get("train") or {}).get("names")
    notes: list[str] = []
    try:
        if names_file is not None:
            names = read_names(names_file, spec)
        elif stored_names:  # trained with --names: the checkpoint keeps the rules
            names = tuple((p, None if n is None else tuple(n)) for p, n in stored_names)
        loaded = load_factory(spec, names)
        trainable = loaded.trainable
        notes = notes_text(loaded.notes)
        if trainable is None:
            problems.add(
                ArgumentError,
                f"--model {spec} gives no batches to train on (its factory returns the form "
                f"plan and search take)",
                "Return (model, example_batch, loss, batches) from the factory: batches is "
                "batches(split, index) -> batch, or an iterable of batches.",
            )
    except MeshplanError as e:
        problems.add_error(e)
    given: dict[str, Any] = dict(request.settings)
    if "seq_len" in given:  # the Transformer's sequence: a factory's batches give the shapes
        problems.add(
            ArgumentError,
            f"--seq sets the built-in Transformer's sequence, not --model {spec}",
            "Leave out --seq: the factory's batches give the shapes.",
        )
    if trainable is not None:
        rows = jax.tree.leaves(trainable.example_batch)[0].shape[0]
        if "batch" in given and given["batch"] != rows:
            problems.add(
                ArgumentError,
                f"--batch {given['batch']}, but the batches of --model {spec} hold {rows}",
                f"Leave out --batch (it is {rows}), or change the factory's batches.",
            )
        given = {**given, "batch": rows, "seq_len": 1}
    settings = resolve_settings(dataclasses.replace(request, settings=given), stored, problems)
    # The library builds the mesh, the rules and the state, and checks them, in one call.
    parts = build_parts(
        settings,
        flags.shape,
        None if request.devices is None else request.devices.devices,
        None if flags.rules is None else flags.rules.pairs,
        None if trainable is None else trainable.model,
        stored,
        None if trainable is None else trainable.example_batch,
    )
    placement_problems(request.rules, flags, parts, flags.layout)
    built = Problems()
    if trainable is not None and parts.state_error is not None:
        raised = parts.state_error
        built.add(
            ArgumentError,
            f"--model {spec}: creating the {trainable.name}'s state with the optimizer "
            f"(--lr {settings.lr:g}) raised {type(raised).__name__}: {raised}",
            "Check that the factory's model initialises on its example batch (the first "
            "item of a tuple batch) and that its parameters are arrays.",
        )
    if stored is not None and parts.mismatch:
        mismatch = parts.mismatch
        built.add(
            CheckpointError,
            f"{len(mismatch)} arrays differ between the checkpoint (step {stored.step}) "
            f"and the model --model {spec} builds now, e.g. {mismatch[0].path}: "
            f"{mismatch[0].message}",
            "Resume with the factory the checkpoint was trained with, or train into a new "
            "--ckpt-dir.",
        )
    uneven_problems(request, parts.uneven, built)
    if trainable is not None and parts.abstract is not None:
        factory_problems(spec, trainable, parts.abstract.params, settings.eval_batches, built)
    for p in parts.batch:
        built.add(MeshplanError, f"{p.path}: {p.message}", p.fix, p.code)
    # In the order a user reads them: the placement, the checkpoint, the model, ...
    problems = Problems.joined(flags.layout, flags.mesh, flags.ckpt, problems, flags.metrics, built)
    raise_if_any(problems, ckpt_dir)
    mesh, rules, abstract = parts.mesh, parts.rules, parts.abstract
    assert trainable is not None and mesh is not None and abstract is not None
    assert rules is not None
    unnamed = no_names_in_tree(abstract, rules)
    if unnamed is not None:  # said first: the run trains every array replicated
        notes.insert(0, no_names_text([unnamed], spec, str(request.rules)) or "")
    source = trainable.batches
    if isinstance(source, IterableBatches):
        source.hold_out(settings.eval_batches)  # the first batches are the validation set

    place = batch_placer(mesh, rules)

    def batches(split: str, index: int) -> Any:
        return place(source(split, index))

    trainer = Trainer(
        trainable.model,
        batches,
        settings,
        Placement(mesh, rules, str(request.rules)),
        Checkpoints(
            ckpt_dir, stored, tuple(resume.damaged), resume.why, record=_record(spec, names)
        ),
        Measures(None, None, request.sync_every_step),
        tx=parts.tx,
        abstract=abstract,
        notes=[*notes, *resume.notes],
    )
    return PreparedRun(trainer, None, None, spec, None, trainable)


def _record(spec: str, names: PathRules | None) -> dict[str, Any]:
    """What the checkpoints record of the model: the factory, and the path rules that named it
    (a resumed run without ``--names`` names it the same way)."""
    if names is None:
        return {"model": spec}
    pairs = [[p, None if n is None else list(n)] for p, n in names]
    return {"model": spec, "names": pairs}
