"""What the user asked ``meshplan train`` for, checked before any work starts.

This is where the command line wires its recipe, the example byte-level
Transformer trained on a byte corpus (:mod:`meshplan.models.data`), into the
model-agnostic :class:`~meshplan.train.trainer.Trainer`: the model, its loss,
the batches and the settings are passed in as arguments. The Transformer is
the Flax Linen one (:mod:`meshplan.models.transformer`, ``--model
transformer``) or the Flax NNX one (:mod:`meshplan.models.transformer_nnx`,
``--model transformer-nnx``): the same parameter paths, shapes and logical
names, so their checkpoints are interchangeable. Every checkpoint records which
(``extra["train"]["model"]``; a checkpoint without it holds ``transformer``).

:func:`prepare` checks everything a user can get wrong (the layout, the mesh,
the batch, the model's dimensions against the layout, the data path, the
checkpoint folder and its shapes) and reports every problem at once, one
bullet each, the fixes at the end. When resuming, what the request leaves out
comes from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshplan._checkpoint.checkpointer import Checkpointer
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import CheckpointError, MeshError, MeshplanError, Problem
from meshplan._spmd.rules import LogicalRules, Rules
from meshplan.cli.devices import (
    DeviceChoice,
    choose_devices,
    count_from_xla_flags,
    mesh_flag_advice,
)
from meshplan.cli.factory import Trainable, is_factory
from meshplan.cli.train.checks import (
    Problems,
    check_batch,
    check_corpus,
    check_metrics_file,
    check_pipeline,
    load_corpus,
    parse_train_mesh,
)
from meshplan.cli.train.flags import setting_fix, setting_flag
from meshplan.cli.train.memory_advice import memory_problem
from meshplan.cli.train.resume import DamagedStep, Resume, check_checkpoint_dir
from meshplan.cli.trained_models import DEFAULT_MODEL, MODELS, model_of
from meshplan.layouts import CONTEXT_EXPERT_LAYOUTS, LAYOUT_AXES, get_layout
from meshplan.models.data import ByteCorpus, shard_batch
from meshplan.models.registry import example
from meshplan.models.transformer import (
    CONFIG_SETTINGS,
    TransformerConfig,
    config_from_name,
    train_flops,
)
from meshplan.train.build import BuiltParts, build_parts
from meshplan.train.flops import MeshPeak, mesh_peak
from meshplan.train.model import TrainModel
from meshplan.train.parts import Checkpoints, Measures, Placement
from meshplan.train.settings import TrainSettings
from meshplan.train.trainer import Trainer

_Problems = Problems  # (its older name)

__all__ = [
    "ByteBatches",
    "DamagedStep",
    "FlagsRead",
    "PreparedRun",
    "TrainRequest",
    "placement_problems",
    "prepare",
    "prepare_run",
    "read_flags",
]


@dataclasses.dataclass
class TrainRequest:
    """What the user asked for; ``None`` means "the stored value when resuming, else the default".

    Attributes:
        mesh: ``"2x4"``-style mesh axis sizes (``"2x2x2"`` with ``axes``).
        axes: ``"data,fsdp,tensor"``: the mesh axis names, one per size; ``None``:
            the axes the built-in layout is written for (``('data', 'model')``;
            ``('data', 'context')`` for ``context_parallel`` and ``fsdp_cp``,
            ``('data', 'expert')`` for ``expert_parallel`` and ``fsdp_ep``).
        rules: A built-in layout name (:mod:`meshplan.layouts`) or a rules file.
        config: A preset name (``tiny``, ``small``); ``None`` resumes with the
            stored config, or uses ``tiny``.
        overrides: Model config fields to replace (``{"num_layers": 4}``).
        data: A folder or file of text; ``None`` uses the Python standard library.
        ckpt_dir: Where to save checkpoints (``None``: no checkpoints).
        resume: Continue from the newest intact checkpoint in ``ckpt_dir``
            (newer damaged ones are named and skipped).
        resume_step: Continue from this step of ``ckpt_dir`` (implies ``resume``).
        metrics: The file each loss is appended to (``--metrics``), checked here.
        settings: :class:`TrainSettings` fields the user gave.
        model: ``transformer`` (Flax Linen) or ``transformer-nnx`` (Flax NNX);
            ``None`` resumes with the checkpoint's, or uses ``transformer``.
        devices: The devices to build the mesh on
            (:func:`meshplan.cli.devices.found_devices`); ``None``: JAX's default devices.
        sync_every_step: Read every step's loss at once (``--sync-every-step``, for
            measuring what overlapping the host and the device gains).
        damaged: Steps already found damaged when their arrays were read (a
            checksum mismatch, which the cheap check cannot see), each with its
            ``'ckpt-damaged'`` problem: ``resume`` takes the newest intact step before them.
        names: ``--names FILE``: path rules naming a factory's arrays (``None``: the
            checkpoint's, when resuming one trained with them).
    """

    mesh: str = "2x4"
    rules: str = "fsdp_tp"
    axes: str | None = None
    config: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: str | None = None
    ckpt_dir: str | None = None
    resume: bool = False
    resume_step: int | None = None
    metrics: str | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: str | None = None
    devices: DeviceChoice | None = None
    sync_every_step: bool = False
    damaged: tuple[DamagedStep, ...] = ()
    names: str | None = None


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A checked request: the :class:`Trainer`, and what the command says about the run.

    Attributes:
        trainer: The trainer, built once with everything it needs.
        corpus: The byte corpus its batches come from (the header names it);
            ``None`` for a ``--model pkg.module:factory`` (its own batches).
        config: The model's config (``None`` for a factory's model).
        model: ``--model`` (:data:`MODELS`, or ``pkg.module:factory``).
        trainable: A factory's model (``None`` for the built-in Transformer).
        peak: The devices' peak for MFU (:func:`meshplan.train.flops.mesh_peak`);
            ``None`` when the request names no devices.
    """

    trainer: Trainer
    corpus: ByteCorpus | None
    config: TransformerConfig | None
    model: str
    peak: MeshPeak | None
    trainable: Trainable | None = None


def prepare(request: TrainRequest) -> Trainer:
    """The :class:`Trainer` of :func:`prepare_run` (every problem raised first).

    Example:
        >>> from meshplan.cli.train.request import TrainRequest, prepare
        >>> trainer = prepare(TrainRequest(mesh="2x4", config="tiny", settings={"steps": 1}))
        >>> trainer.settings.steps, dict(trainer.mesh.shape)
        (1, {'data': 2, 'model': 4})
    """
    return prepare_run(request).trainer


@dataclasses.dataclass(frozen=True)
class ByteBatches:
    """The batches of ``meshplan train``: windows of a byte corpus, placed on the mesh.

    A :data:`meshplan.train.trainer.Batches`: ``batches(split, index)`` is
    ``corpus.batch_at(split, index, seed, batch, seq_len)`` (a function of
    ``(seed, split, index)`` alone, so a resumed run sees the same batches),
    placed with :func:`meshplan.models.data.shard_batch`.

    Attributes:
        corpus: The :class:`~meshplan.models.data.ByteCorpus`.
        settings: Its ``seed``, ``batch`` and ``seq_len`` shape the batches.
        mesh: The mesh the batches are placed on.
        rules: The rules that place ``('batch', 'length')``.
    """

    corpus: ByteCorpus
    settings: TrainSettings
    mesh: Mesh
    rules: LogicalRules

    def __call__(self, split: str, index: int) -> Any:
        s = self.settings
        tokens = self.corpus.batch_at(split, index, s.seed, s.batch, s.seq_len)
        return shard_batch(tokens, self.mesh, self.rules)


PIPELINE_FIELDS = ("microbatches", "pipeline_repeats")
"""The config fields a pipeline reads (``--microbatches``, ``--pipeline-repeats``)."""


def _resolve_config(request: TrainRequest, stored: CheckpointMetadata | None) -> TransformerConfig:
    if request.config is not None or stored is None or stored.config is None:
        return config_from_name(request.config or "tiny", **request.overrides)
    return dataclasses.replace(TransformerConfig.from_dict(stored.config), **request.overrides)


def resolve_settings(
    request: TrainRequest, stored: CheckpointMetadata | None, problems: Problems
) -> TrainSettings:
    """The defaults, overridden by the preset's (``--size base``), by the checkpoint's
    settings, then by the request's."""
    stored_train = (stored.extra.get("train") or {}) if stored else {}
    preset = CONFIG_SETTINGS.get(request.config or "", {})
    settings = TrainSettings.from_dict(
        {**TrainSettings().to_dict(), **preset, **stored_train, **request.settings}
    )
    for name, why in settings.problems():
        where = "the checkpoint's " if name not in request.settings else ""
        problems.add(
            MeshplanError,
            f"{where}{setting_flag(name)} {why}",
            setting_fix(name),
        )
    if stored is not None and settings.steps < stored.step:
        problems.add(
            MeshplanError,
            f"--steps {settings.steps} is before the checkpoint's step {stored.step}",
            f"Pass --steps greater than {stored.step} to train further.",
        )
    return settings


def _resolve_model(
    request: TrainRequest, stored: CheckpointMetadata | None, problems: Problems
) -> str | None:
    """The ``--model`` of this run: the request's, else the checkpoint's, else ``transformer``."""
    saved = model_of(stored) if stored is not None else None
    kind = request.model or saved or DEFAULT_MODEL
    if kind in MODELS:
        return kind
    choices = ", ".join(MODELS)
    if request.model is None and is_factory(kind):
        problems.add(
            CheckpointError,
            f"the checkpoint holds a model of your own, --model {kind}",
            f"Pass --model {kind} to resume it (the factory is imported again).",
        )
    elif request.model is None:
        problems.add(
            CheckpointError,
            f"the checkpoint holds --model {kind!r}, which this meshplan does not know (it "
            f"trains {choices})",
            "Upgrade meshplan to resume this run, or pass --model to say which model it holds.",
        )
    else:
        problems.add(
            MeshplanError,
            f"unknown --model {kind!r}",
            f"Pass --model {' or --model '.join(MODELS)}, or a model of your own: --model "
            f"pkg.module:factory (docs/training.md, 'Your own model').",
        )
    return None


def _model_note(kind: str, stored: CheckpointMetadata | None) -> str | None:
    """What to say when a run resumes a checkpoint of the other model (their layouts match)."""
    if stored is None or model_of(stored) == kind:
        return None
    saved = model_of(stored)
    return (
        f"The checkpoint (step {stored.step}) holds --model {saved} ({MODELS.get(saved, '?')}); "
        f"this run continues it as --model {kind} ({MODELS[kind]}): the two have the same "
        f"parameter paths, shapes and logical names, and its checkpoints record {kind}."
    )


def _build_model(
    request: TrainRequest,
    stored: CheckpointMetadata | None,
    settings: TrainSettings,
    kind: str | None,
    problems: Problems,
) -> tuple[TransformerConfig | None, TrainModel | None]:
    """The model's config (the request's, else the checkpoint's, else ``tiny``), checked
    against ``--seq``, and the model ``--model`` names built from it (``None`` without a kind).

    Its example input is ``seq_len`` tokens, at most ``max_len``: parameter shapes do not
    depend on the length, and staying within ``max_len`` lets the state be traced, to
    check it, even when ``--seq`` is too long.
    """
    try:
        config = _resolve_config(request, stored)
    except (ValueError, TypeError) as e:
        problems.add(
            MeshplanError,
            f"model config: {e}",
            "Use --size tiny|small|base with valid size flags.",
        )
        return None, None
    if settings.seq_len > config.max_len:
        problems.add(
            MeshplanError,
            f"--seq {settings.seq_len} exceeds the model's max_len={config.max_len}",
            f"Use --seq {config.max_len} or less, or a larger --max-len.",
        )
    if kind is None:
        return config, None
    tokens = jax.ShapeDtypeStruct((1, min(settings.seq_len, config.max_len)), jnp.int32)
    return config, dataclasses.replace(example(kind, config).model, example_input=tokens)


def _dense_expert_note(
    request: TrainRequest, config: TransformerConfig, rules: LogicalRules
) -> list[str]:
    """A note when the layout places experts but the model has none (a dense run)."""
    if config.num_experts or not any(name == "expert" and axes for name, axes in rules):
        return []
    return [
        f"--rules {request.rules} places experts (the 'expert' name), but this model has none "
        f"(--experts 0): it trains the dense MLP, and the expert axis only splits what its "
        f"other rules give it. Pass --experts E for a mixture of experts."
    ]


_SHOWN = 6
"""Parameters the layout cannot split shown in full; the rest are listed by path."""


def _check_state(
    request: TrainRequest,
    config: TransformerConfig,
    parts: BuiltParts,
    stored: CheckpointMetadata | None,
    problems: Problems,
    kind: str = DEFAULT_MODEL,
) -> None:
    """The checkpoint fits the model's shapes; the layout can split every parameter."""
    mismatch = parts.mismatch
    if stored is not None and mismatch:
        held = model_of(stored)
        if held != kind:
            problems.add(
                CheckpointError,
                f"the checkpoint holds --model {held} ({MODELS.get(held, '?')}), this run "
                f"asks for --model {kind} ({MODELS[kind]})",
                "",
            )
        saved = stored.config or {}
        fields = [
            f"{name}: the checkpoint has {saved[name]!r}, this run asks for {value!r}"
            for name, value in config.to_dict().items()
            if name in saved and saved[name] != value
        ]
        for line in fields:
            problems.add(CheckpointError, f"model config {line}", "")
        what = "model and config" if held != kind else "config"
        flags = "--model, --size" if held != kind else "--size"
        problems.add(
            CheckpointError,
            f"so {len(mismatch)} arrays differ between the checkpoint (step {stored.step}, "
            f"{len(stored.arrays)} arrays) and this model: they do not fit the model, e.g. "
            f"{mismatch[0].path}: {mismatch[0].message}",
            f"Resume with the checkpoint's {what}: leave out {flags} and the model size "
            "flags (or repeat the ones it was trained with), or train into a new --ckpt-dir.",
        )
    uneven_problems(request, parts.uneven, problems)


def uneven_problems(request: TrainRequest, uneven: list[Problem], problems: Problems) -> None:
    """The parameters the layout cannot split evenly on the mesh
    (:attr:`~meshplan.train.build.BuiltParts.uneven`), in flags."""
    fix = (
        "Pick a layout that leaves that dimension whole (e.g. data_parallel), a mesh "
        "whose axes divide it, or model sizes that are multiples of the mesh axes."
    )
    where = f"--rules {request.rules} on the {request.mesh} mesh"
    for p in uneven[:_SHOWN]:
        problems.add(MeshError, f"{where}: {p.path}: {p.message}", fix, p.code)
    if len(uneven) > _SHOWN:
        rest = ", ".join(dict.fromkeys(p.path for p in uneven[_SHOWN:]))
        problems.add(
            MeshError,
            f"and {len(uneven) - _SHOWN} more parameters with a dimension that does not "
            f"split: {rest}",
            fix,
            "indivisible",
        )


def raise_if_any(problems: Problems, ckpt_dir: Path | None) -> None:
    """Raises every problem found; with none, checks that ``ckpt_dir`` can be written
    (only then: it creates the folder), and raises if not."""
    if not problems.items and ckpt_dir is not None:
        try:
            Checkpointer.check_writable(ckpt_dir)
        except MeshplanError as e:
            problems.add_error(e)
    problems.raise_if_any("meshplan train cannot start:")


@dataclasses.dataclass
class FlagsRead:
    """What the flags and the checkpoint say, read before the library builds anything.

    Attributes:
        shape: ``--mesh`` (and ``--axes``) as ``{axis: size}``, ``None`` when unreadable
            or larger than the devices.
        needed: The devices the mesh asks for, once read.
        ckpt_dir: The checkpoint folder (``None``: none).
        resume: The step to resume from, read from the checkpoint folder.
        rules: The rules of ``--rules`` (a built-in layout or a rules file), validated,
            with their positions; ``None`` when they cannot be had.
        mesh: The problems of ``--mesh``, ``--axes`` and ``--devices``.
        ckpt: The problems of ``--ckpt-dir`` and ``--resume``.
        metrics: The problems of ``--metrics``.
        layout: The problems of ``--rules``.
    """

    shape: dict[str, int] | None
    needed: int | None
    ckpt_dir: Path | None
    resume: Resume
    rules: Rules | None
    mesh: Problems
    ckpt: Problems
    metrics: Problems
    layout: Problems


def read_flags(request: TrainRequest) -> FlagsRead:
    """The flags that need nothing built: ``--metrics``; ``--mesh`` and ``--axes``
    against the devices; ``--ckpt-dir`` and the checkpoint's step to resume from; then
    ``--rules``, the layout's rules (a rules file is read here)."""
    metrics, mesh, ckpt, layout = Problems(), Problems(), Problems(), Problems()
    check_metrics_file(request.metrics, metrics)
    shape = needed = None
    try:
        axes = request.axes
        if axes is None and request.rules in CONTEXT_EXPERT_LAYOUTS:
            axes = ",".join(LAYOUT_AXES[request.rules])  # ('data', 'context'), ('data', 'expert')
        shape = parse_train_mesh(request.mesh, axes)
        needed = math.prod(shape.values())
        choice = request.devices
        if choice is not None:  # refused with the numbers and the fix in flag terms
            choose_devices(
                [] if choice.emulated else choice.devices,
                choice.devices if choice.emulated else [],
                needed=needed,
                mesh=request.mesh,
                xla_flags_count=count_from_xla_flags(),
            )
    except MeshplanError as e:
        shape = None
        mesh.add_error(mesh_flag_advice(e, needed))
    ckpt_dir, resume = check_checkpoint_dir(request, ckpt)
    rules = None
    try:
        rules = Rules.of(get_layout(request.rules))  # get_layout validates; Rules.of indexes
    except MeshplanError as e:
        layout.add_error(e, f"--rules {request.rules}")
    return FlagsRead(shape, needed, ckpt_dir, resume, rules, mesh, ckpt, metrics, layout)


def placement_problems(
    layout: str, flags: FlagsRead, parts: BuiltParts, problems: Problems
) -> None:
    """Why the mesh (of ``flags.shape``) or the rules (``layout``) could not be had, in
    flags: the mesh's problem added to ``flags.mesh``, the rules' to ``problems``."""
    if parts.mesh_error is not None:
        flags.mesh.add_error(mesh_flag_advice(parts.mesh_error, flags.needed))
    if parts.rules_error is not None:
        problems.add_error(parts.rules_error, f"--rules {layout}")


def prepare_run(request: TrainRequest) -> PreparedRun:
    """Checks everything in ``request`` and returns a :class:`PreparedRun`: a :class:`Trainer`
    ready to run, and what the command shows about it.

    Every problem found is reported together, before any array is created:
    an unknown layout, a mesh larger than the devices, a batch (or token
    length) the mesh does not divide, model dimensions the layout cannot split,
    a ``--data`` path with no text or a split shorter than one sequence, a checkpoint folder that is empty or not a meshplan
    checkpoint, and a model config whose shapes differ from the checkpoint's.

    When resuming, settings and the model config the request leaves out
    (``None``) come from the checkpoint.

    Raises:
        MeshplanError: (the class of the first problem) one bullet per
            problem, then the fixes.

    Example:
        >>> import meshplan
        >>> from meshplan.cli.train.request import TrainRequest, prepare_run
        >>> try:
        ...     prepare_run(TrainRequest(rules="nope", mesh="3x3"))
        ... except meshplan.MeshplanError as e:
        ...     print(str(e).splitlines()[0])
        meshplan train cannot start:
    """
    # 1. The flags alone, the checkpoint and the layout: what a resume leaves out comes from it.
    flags = read_flags(request)
    ckpt_dir, resume, stored = flags.ckpt_dir, flags.resume, flags.resume.stored
    # 2. Every setting decided: the flags', else the checkpoint's, else the defaults; the
    # corpus and the model they name. Then, when the settings are sane, checked against what
    # needs nothing built: the mesh's sizes and the rules (the batch), the corpus.
    found = {p: Problems() for p in ("settings", "config", "model", "batch", "data")}
    kind = _resolve_model(request, stored, found["model"])
    note = None if kind is None else _model_note(kind, stored)
    settings = resolve_settings(request, stored, found["settings"])
    data = request.data
    if data is not None:
        data = str(Path(data).absolute())
    elif stored is not None:
        data = (stored.extra.get("train") or {}).get("data")
    corpus = load_corpus(data, found["data"])
    config, model = _build_model(request, stored, settings, kind, found["config"])
    settings_ok = not settings.problems()
    batch_shards = None
    if flags.shape is not None and flags.rules is not None and settings_ok:
        batch_shards = check_batch(
            str(request.rules), request.mesh, settings, flags.shape, flags.rules, found["batch"]
        )
        if config is not None:
            given = any(request.overrides.get(f) is not None for f in PIPELINE_FIELDS)
            check_pipeline(str(request.rules), request.mesh, config, settings, flags.shape,
                           flags.rules, given, batch_shards, found["batch"])  # fmt: skip
    if corpus is not None and settings_ok:
        check_corpus(corpus, settings, found["data"])
    # 3. The library builds its objects from them and checks them, in one call; the memory
    # of a step too, when nothing is wrong so far (it traces the step).
    so_far = Problems.joined(flags.layout, flags.mesh, flags.ckpt, flags.metrics, *found.values())
    memory_batch = None
    if not so_far.items and batch_shards is not None:
        micro = max(settings.batch // settings.grad_accum, 1)  # a device holds one at a time
        memory_batch = jax.ShapeDtypeStruct((micro, settings.seq_len + 1), jnp.int32)
    on = None if request.devices is None else request.devices.devices
    layout = None if flags.rules is None else flags.rules.pairs
    parts = build_parts(settings, flags.shape, on, layout, model, stored, None, memory_batch)
    if parts.state_error is not None:
        raise parts.state_error
    # 4. What it found, in flags.
    placement_problems(request.rules, flags, parts, flags.layout)
    mesh, rules, abstract = parts.mesh, parts.rules, parts.abstract
    state = Problems()
    if config is not None and abstract is not None:
        _check_state(request, config, parts, stored, state, kind or DEFAULT_MODEL)
    batch = found["batch"] if mesh is not None else Problems()  # said once the mesh is made
    # In the order a user reads them: the placement, the checkpoint, the settings, ...
    problems = Problems.joined(
        flags.layout, flags.mesh, flags.ckpt, found["settings"], flags.metrics,
        found["config"], found["model"], batch, found["data"], state,
    )  # fmt: skip
    if not problems.items and parts.memory is not None:
        assert batch_shards is not None and config is not None
        oom = memory_problem(parts.memory, settings, batch_shards, config.remat)
        problems.items.append((MeshplanError, oom))
    raise_if_any(problems, ckpt_dir)
    assert mesh is not None and model is not None and config is not None and corpus is not None
    assert kind is not None and rules is not None
    tx = parts.tx
    flops = train_flops(config, settings.batch, settings.seq_len)  # what a step computes
    peak = None
    if request.devices is not None:  # MFU against the devices the mesh uses, in its dtype
        devices = request.devices
        peak = mesh_peak(devices.platform, devices.kind, mesh.devices.size, config.dtype)
    trainer = Trainer(
        model,
        ByteBatches(corpus, settings, mesh, rules),
        settings,
        Placement(mesh, rules, str(request.rules)),
        Checkpoints(
            ckpt_dir,
            stored,
            tuple(resume.damaged),
            resume.why,
            config=config.to_dict(),
            record={"data": data, "model": kind},
        ),
        Measures(
            flops,
            None if peak is None else peak.flops,
            request.sync_every_step,
        ),
        tx=tx,
        abstract=abstract,
        notes=[
            *resume.notes,
            *([] if note is None else [note]),
            *_dense_expert_note(request, config, rules),
        ],
    )
    return PreparedRun(trainer, corpus, config, kind, peak)
