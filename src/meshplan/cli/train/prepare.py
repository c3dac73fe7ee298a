"""The one prepare step of ``meshplan train``: a request checked, then a :class:`Trainer` built.

:func:`prepare_run` checks everything a user can get wrong (the layout, the mesh, the
batch, the model against the layout, the data, the checkpoint folder and its shapes,
the memory of a step) and reports every problem at once, one bullet each, the fixes
at the end. It is one skeleton for every :class:`~meshplan.cli.train.source.ModelSource`
(:func:`source_for`): the built-in Transformer and a ``--model pkg.module:factory``
go through the same steps, the same checks and the same memory advice. When resuming,
what the request leaves out comes from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from meshplan._checkpoint.checkpointer import Checkpointer
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import MeshplanError
from meshplan.cli.factory import Trainable, is_factory
from meshplan.cli.train.builtin_source import BuiltInSource
from meshplan.cli.train.factory_source import FactorySource
from meshplan.cli.train.findings import Findings
from meshplan.cli.train.flags import setting_fix, setting_flag
from meshplan.cli.train.memory_advice import memory_problem
from meshplan.cli.train.preflight import FlagsRead, placement_problems, read_flags
from meshplan.cli.train.request import TrainRequest
from meshplan.cli.train.source import Found, ModelSource
from meshplan.models.data import ByteCorpus
from meshplan.train.build import build_parts
from meshplan.train.flops import MeshPeak
from meshplan.train.parts import Checkpoints, Measures, Placement
from meshplan.train.settings import TrainSettings
from meshplan.train.state import PlanSummary
from meshplan.train.trainer import Trainer

__all__ = ["PreparedRun", "prepare", "prepare_run", "resolve_settings", "source_for"]


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A checked request: the :class:`Trainer`, and the source the command describes.

    Attributes:
        trainer: The trainer, built once with everything it needs.
        source: Where its model and batches come from (the header, the units).
        peak: The devices' peak for MFU, or why there is none.
        plan: What a device holds of the state under ``--rules`` (the header's plan per
            device): the library's summary, taken with its build
            (:attr:`~meshplan.train.build.BuiltParts.plan`).
    """

    trainer: Trainer
    source: ModelSource
    peak: MeshPeak
    plan: PlanSummary

    @property
    def corpus(self) -> ByteCorpus | None:
        """The byte corpus of the built-in Transformer's batches (``None`` for a factory)."""
        return self.source.corpus if isinstance(self.source, BuiltInSource) else None

    @property
    def trainable(self) -> Trainable | None:
        """A factory's model and batches (``None`` for the built-in Transformer)."""
        return self.source.trainable if isinstance(self.source, FactorySource) else None


def source_for(request: TrainRequest, flags: FlagsRead | None) -> ModelSource:
    """The model source of ``--model`` (else the checkpoint's): a factory's (with the
    ``--names`` file of the ``flags`` read), or the built-in Transformer (which also words a
    name nobody knows).

    Example:
        >>> from meshplan.cli.train.prepare import source_for
        >>> from meshplan.cli.train.request import TrainRequest
        >>> type(source_for(TrainRequest(model="pkg.mod:make"), None)).__name__
        'FactorySource'
    """
    if request.model is not None and is_factory(request.model):
        return FactorySource(request.model, None if flags is None else flags.names)
    # Also what words a name nobody knows, and a factory's checkpoint resumed without --model.
    return BuiltInSource()


def resolve_settings(
    request: TrainRequest,
    stored: CheckpointMetadata | None,
    found: Findings,
    given: dict[str, Any] | None = None,
    preset: dict[str, Any] | None = None,
) -> TrainSettings:
    """The defaults, overridden by the preset's (``--size base``), by the checkpoint's
    settings, then by the ones given (the request's, as its source reads them).

    Example:
        >>> from meshplan.cli.train.findings import Findings
        >>> from meshplan.cli.train.prepare import resolve_settings
        >>> from meshplan.cli.train.request import TrainRequest
        >>> resolve_settings(TrainRequest(settings={"steps": 5}), None, Findings()).steps
        5
    """
    given = dict(request.settings) if given is None else given
    stored_train = (stored.extra.get("train") or {}) if stored else {}
    settings = TrainSettings.from_dict(
        {**TrainSettings().to_dict(), **(preset or {}), **stored_train, **given}
    )
    for name, why in settings.problems():
        where = "the checkpoint's " if name not in request.settings else ""
        flag = setting_flag(name)
        found.add(MeshplanError, f"{where}{flag} {why}", setting_fix(name), "setting-invalid", flag)
    if stored is not None and settings.steps < stored.step:
        found.add(
            MeshplanError,
            f"--steps {settings.steps} is before the checkpoint's step {stored.step}",
            f"Pass --steps greater than {stored.step} to train further.",
            "steps-before-checkpoint",
            "--steps",
        )
    return settings


def prepare(request: TrainRequest) -> Trainer:
    """The :class:`Trainer` of :func:`prepare_run` (every problem raised first).

    Example:
        >>> from meshplan.cli.train import TrainRequest, prepare
        >>> trainer = prepare(TrainRequest(mesh="2x4", config="tiny", settings={"steps": 1}))
        >>> trainer.settings.steps, dict(trainer.mesh.shape)
        (1, {'data': 2, 'model': 4})
    """
    return prepare_run(request).trainer


def prepare_run(request: TrainRequest) -> PreparedRun:
    """Checks everything in ``request`` and returns a :class:`PreparedRun`: a :class:`Trainer`
    ready to run, and the source the command describes.

    Every problem found is reported together, before any array is created: an unknown
    layout, a mesh larger than the devices, a batch (or token length) the mesh does not
    divide, model dimensions the layout cannot split, a ``--data`` path with no text or a
    split shorter than one sequence, a checkpoint folder that is empty or not a meshplan
    checkpoint, a model whose shapes differ from the checkpoint's, a factory's batches and
    loss; then, when nothing else is wrong, a step that does not fit in a device.

    Raises:
        MeshplanError: (the class of the first problem) one bullet per problem, then the fixes.

    Example:
        >>> import meshplan
        >>> from meshplan.cli.train import TrainRequest, prepare_run
        >>> try:
        ...     prepare_run(TrainRequest(rules="nope", mesh="3x3"))
        ... except meshplan.MeshplanError as e:
        ...     print(str(e).splitlines()[0])
        meshplan train cannot start:
    """
    # 1. The flags alone, the checkpoint and the layout: what a resume leaves out comes from it.
    flags = read_flags(request)
    stored, resume = flags.resume.stored, flags.resume
    # 2. Every setting decided, in one place: the source's reading of the flags, else the
    # checkpoint's, else the preset's and the defaults; the model they name; then what needs
    # nothing built, checked against the mesh's sizes and the rules.
    source = source_for(request, flags)
    found = Found()
    given = source.given(request, stored, found)
    settings = resolve_settings(request, stored, found.settings, given, source.preset(request))
    model = source.model(request, stored, settings, found)
    source.check(request, flags, settings, found)
    # 3. The library builds its objects and checks them, in one call; the memory of a step
    # too, when nothing is wrong so far (it traces the step).
    sound = not found.ordered(flags).items
    memory = source.memory_batch(settings) if sound and model is not None else None
    devices = None if request.devices is None else request.devices.devices
    layout = None if flags.rules is None else flags.rules.pairs
    example = source.example_batch(settings)
    parts = build_parts(settings, flags.shape, devices, layout, model, stored, example, memory)
    # 4. What it found, in flags: every problem, or the step that does not fit.
    placement_problems(request.rules, flags, parts, flags.layout)
    source.built(request, parts, stored, settings, found)
    mesh, rules, abstract = parts.mesh, parts.rules, parts.abstract
    problems = found.ordered(flags, mesh_made=mesh is not None)
    if not problems.items and parts.memory is not None and mesh is not None and rules is not None:
        words = source.memory_words(settings)
        oom = memory_problem(parts.memory, settings, flags.batch_shards, words)
        problems.items.append((MeshplanError, oom))  # the one problem: nothing else is wrong
    raise_if_any(problems, flags.ckpt_dir)
    assert mesh is not None and rules is not None and model is not None
    assert parts.plan is not None  # taken when nothing is wrong
    plan = parts.plan.copy()
    plan["layout"] = str(request.rules)
    peak = source.peak(request, settings, mesh)
    trainer = Trainer(
        model,
        source.batches(settings, mesh, rules),
        settings,
        Placement(mesh, rules, str(request.rules)),
        Checkpoints(
            flags.ckpt_dir,
            stored,
            tuple(resume.damaged),
            resume.why,
            config=source.config(),
            record=source.record(),
        ),
        Measures(source.flops(settings), peak.flops, request.sync_every_step),
        tx=parts.tx,
        abstract=abstract,
        shardings=parts.shardings,
        notes=source.notes(request, parts, resume.notes),
    )
    return PreparedRun(trainer, source, peak, plan)


def raise_if_any(problems: Findings, ckpt_dir: Path | None) -> None:
    """Raises every problem found; with none, checks that ``ckpt_dir`` can be written
    (only then: it creates the folder), and raises if not."""
    if not problems.items and ckpt_dir is not None:
        try:
            Checkpointer.check_writable(ckpt_dir)
        except MeshplanError as e:
            problems.add_error(e)
    problems.raise_if_any("meshplan train cannot start:")
