"""What the user asked ``meshplan train`` for, checked before any work starts.

This is where the command line wires its recipe, the example byte-level
Transformer trained on a byte corpus (:mod:`meshplan.examples.data`), into the
model-agnostic :class:`~meshplan.train.trainer.Trainer`: the model, its loss,
the batches and the settings are passed in as arguments. The Transformer is
the Flax Linen one (:mod:`meshplan.examples.transformer`, ``--model
transformer``) or the Flax NNX one (:mod:`meshplan.examples.transformer_nnx`,
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
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshplan._checkpoint.checkpointer import Checkpointer
from meshplan._checkpoint.folder import latest_step, read_metadata
from meshplan._checkpoint.integrity import check_step, intact_step
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._checkpoint.restore import compatibility_problems
from meshplan._checkpoint.tree import flatten_state
from meshplan._errors import (
    CheckpointError,
    MeshError,
    MeshplanError,
    Problem,
    error_for,
    problem_message,
)
from meshplan._spmd.mesh_info import mesh_info
from meshplan._spmd.rules import logical_axis_rules, rules_problems
from meshplan._spmd.validate import check_leaf, validate
from meshplan.cli.devices import DeviceChoice, choose_devices, count_from_xla_flags
from meshplan.cli.train_flags import CODE_ADVICE, setting_fix, setting_flag
from meshplan.cli.train_memory import memory_problem
from meshplan.examples.context import context_shards
from meshplan.examples.data import BATCH_NAMES, ByteCorpus, DataError, shard_batch
from meshplan.examples.models import EXAMPLE_MODELS, example
from meshplan.examples.transformer import (
    CONFIG_SETTINGS,
    TransformerConfig,
    config_from_name,
    train_flops,
)
from meshplan.layouts import CONTEXT_EXPERT_LAYOUTS, LAYOUT_AXES, get_layout
from meshplan.train.flops import MeshPeak, mesh_peak
from meshplan.train.mesh import MESH_AXES, make_mesh, parse_mesh_shape
from meshplan.train.settings import TrainSettings, make_optimizer
from meshplan.train.state import abstract_train_state
from meshplan.train.trainer import Checkpoints, Measures, Placement, Trainer

__all__ = [
    "MODELS",
    "ByteBatches",
    "DamagedStep",
    "PreparedRun",
    "TrainRequest",
    "model_of",
    "prepare",
    "prepare_run",
]

MODELS = {name: m.api for name, m in EXAMPLE_MODELS.items() if m.sequence}
"""The models ``meshplan train --model`` trains, and the Flax API each is written in."""

DEFAULT_MODEL = "transformer"
"""The model of a new run, and of a checkpoint that does not say (written before ``--model``)."""


def model_of(metadata: CheckpointMetadata) -> str:
    """The ``--model`` a checkpoint of ``meshplan train`` holds (``transformer`` if it does not say).

    Example:
        >>> from meshplan import CheckpointMetadata
        >>> from meshplan.cli.train_request import model_of
        >>> nnx = CheckpointMetadata(0, {}, extra={"train": {"model": "transformer-nnx"}})
        >>> model_of(CheckpointMetadata(0, {}, extra={"train": {}})), model_of(nnx)
        ('transformer', 'transformer-nnx')
    """
    return str((metadata.extra.get("train") or {}).get("model") or DEFAULT_MODEL)


class DamagedStep(NamedTuple):
    """A step found damaged when its arrays were read, and the problem the restore raised."""

    step: int
    problem: Problem


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


@dataclasses.dataclass(frozen=True)
class PreparedRun:
    """A checked request: the :class:`Trainer`, and what the command says about the run.

    Attributes:
        trainer: The trainer, built once with everything it needs.
        corpus: The byte corpus its batches come from (the header names it).
        config: The model's config.
        model: ``--model`` (:data:`MODELS`).
        peak: The devices' peak for MFU (:func:`meshplan.train.flops.mesh_peak`);
            ``None`` when the request names no devices.
    """

    trainer: Trainer
    corpus: ByteCorpus
    config: TransformerConfig
    model: str
    peak: MeshPeak | None


def prepare(request: TrainRequest) -> Trainer:
    """The :class:`Trainer` of :func:`prepare_run` (every problem raised first).

    Example:
        >>> from meshplan.cli.train_request import TrainRequest, prepare
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
    placed with :func:`meshplan.examples.data.shard_batch`.

    Attributes:
        corpus: The :class:`~meshplan.examples.data.ByteCorpus`.
        settings: Its ``seed``, ``batch`` and ``seq_len`` shape the batches.
        mesh: The mesh the batches are placed on.
        rules: The rules that place ``('batch', 'length')``.
    """

    corpus: ByteCorpus
    settings: TrainSettings
    mesh: Mesh
    rules: Any

    def __call__(self, split: str, index: int) -> Any:
        s = self.settings
        tokens = self.corpus.batch_at(split, index, s.seed, s.batch, s.seq_len)
        return shard_batch(tokens, self.mesh, self.rules)


class _Problems:
    """Collects (error class, problem) pairs and raises them together."""

    def __init__(self) -> None:
        self.items: list[tuple[type[MeshplanError], Problem]] = []

    def add(self, cls: type[MeshplanError], problem: str, fix: str, code: str = "train") -> None:
        self.items.append((cls, Problem("error", "", problem, fix, code)))

    def add_error(self, error: MeshplanError, where: str = "") -> None:
        """The error's problems, with flag-level advice for the codes the command line knows.

        ``where``: the flag the problems come from (``--rules r.json``), put before each.
        """
        found = error.problems or [Problem("error", "", str(error), "", "error")]
        for p in found:
            message = f"{p.path}: {p.message}" if p.path and p.path not in p.message else p.message
            if where and not message.startswith(where):
                message = f"{where}: {message}"
            fix = CODE_ADVICE.get(p.code, p.fix)
            self.items.append((type(error), Problem("error", "", message, fix, p.code)))

    def raise_if_any(self, header: str) -> None:
        if not self.items:
            return
        found = [p for _, p in self.items]
        fixes = list(dict.fromkeys(p.fix for p in found if p.fix))
        raise self.items[0][0](
            problem_message(header, [p.message for p in found], "\n".join(fixes)), found
        )


def _example_tokens(config: TransformerConfig, settings: TrainSettings) -> Any:
    """The tokens the model is initialised with: ``seq_len`` of them, at most ``max_len``.

    Parameter shapes do not depend on the length; staying within ``max_len``
    lets the state be traced, to check it, even when ``--seq`` is too long.
    """
    return jax.ShapeDtypeStruct((1, min(settings.seq_len, config.max_len)), jnp.int32)


def _load_corpus(data: str | None, problems: _Problems) -> ByteCorpus | None:
    try:
        return ByteCorpus.from_stdlib() if data is None else ByteCorpus.from_path(data)
    except MeshplanError as e:
        problems.add_error(e)
    except (ValueError, OSError) as e:  # the file system's words: the message is all there is
        problems.add(DataError, f"cannot read --data {data!r}: {type(e).__name__}: {e}", "")
    return None


def _resolve_config(request: TrainRequest, stored: CheckpointMetadata | None) -> TransformerConfig:
    if request.config is not None or stored is None or stored.config is None:
        return config_from_name(request.config or "tiny", **request.overrides)
    return dataclasses.replace(TransformerConfig.from_dict(stored.config), **request.overrides)


@dataclasses.dataclass
class _Resume:
    """Where a run resumes from: the metadata, the damaged steps skipped, and what to say."""

    stored: CheckpointMetadata | None = None
    damaged: list[int] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)


def _check_checkpoint_dir(
    request: TrainRequest, problems: _Problems
) -> tuple[Path | None, _Resume]:
    """The checkpoint folder, and the step to resume from when resuming.

    Without ``resume_step``: the newest intact step (a cheap check of each newer
    one, no array read); the damaged ones skipped are named in the notes.
    """
    resume = request.resume or request.resume_step is not None
    found = _Resume()
    if request.ckpt_dir is not None and not request.ckpt_dir.strip():
        problems.add(
            CheckpointError,
            f"--ckpt-dir {request.ckpt_dir!r} is empty: the run would save nothing",
            "Pass a folder, e.g. --ckpt-dir runs/first, or leave --ckpt-dir out to train "
            "without checkpoints.",
            "ckpt-empty-path",
        )
        return None, found
    if request.ckpt_dir is not None and "://" in request.ckpt_dir:
        scheme = request.ckpt_dir.split("://", 1)[0]
        problems.add(
            CheckpointError,
            f"--ckpt-dir {request.ckpt_dir!r} is a {scheme}:// URL: meshplan train saves into "
            f"a folder of this machine (its lock file, the moved-aside branches and the checks "
            f"before training are local files), and would make a local folder named "
            f"'{scheme}:' instead",
            f"Train into a local folder (or a mounted bucket, e.g. gcsfuse) and copy it to "
            f"{scheme}:// afterwards; meshplan.restore and meshplan.Checkpointer take "
            f"{scheme}:// paths from Python.",
            "ckpt-url",
        )
        return None, found
    ckpt_dir = Path(request.ckpt_dir).absolute() if request.ckpt_dir else None
    if resume and ckpt_dir is None:
        problems.add(
            MeshplanError,
            f"{'--resume-step' if request.resume_step is not None else '--resume'} needs the "
            f"checkpoint folder to resume from",
            "Pass --ckpt-dir DIR with --resume.",
        )
    elif resume and ckpt_dir is not None:  # (not None: the case above)
        try:
            if request.resume_step is not None:
                found.stored = read_metadata(ckpt_dir, request.resume_step)
                problem = check_step(ckpt_dir, found.stored.step)
                if problem is not None:
                    raise CheckpointError(problem.message, [problem])
                return ckpt_dir, found
            known = [d.step for d in request.damaged]
            intact = intact_step(ckpt_dir, before=min(known) if known else None)
            skipped = [*(d.problem for d in request.damaged), *intact.skipped]
            if intact.step is None:
                problems.add(
                    CheckpointError,
                    f"no step of {str(ckpt_dir)!r} can be read: "
                    + "; ".join(p.message for p in skipped),
                    "Train into a new --ckpt-dir (or without --resume into this one after "
                    "removing its steps).",
                    "ckpt-damaged",
                )
                return ckpt_dir, found
            found.stored = read_metadata(ckpt_dir, intact.step)
            found.damaged = [*known, *intact.skipped_steps]
            for p in skipped:
                found.notes.append(f"Skipping damaged step: {p.message}")
            if skipped:
                found.notes.append(
                    f"Resuming from step {intact.step}, the newest step that can be read."
                )
        except MeshplanError as e:
            problems.add_error(e)
    elif ckpt_dir is not None and (last := latest_step(ckpt_dir)) is not None:
        problems.add(
            CheckpointError,
            f"--ckpt-dir {str(ckpt_dir)!r} already holds checkpoints (latest step {last})",
            "Pass --resume to continue that run, or a new --ckpt-dir to start another.",
        )
    return ckpt_dir, found


def _resolve_settings(
    request: TrainRequest, stored: CheckpointMetadata | None, problems: _Problems
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
    request: TrainRequest, stored: CheckpointMetadata | None, problems: _Problems
) -> str | None:
    """The ``--model`` of this run: the request's, else the checkpoint's, else ``transformer``."""
    saved = model_of(stored) if stored is not None else None
    kind = request.model or saved or DEFAULT_MODEL
    if kind in MODELS:
        return kind
    choices = ", ".join(MODELS)
    if request.model is None:
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
            f"Pass --model {' or --model '.join(MODELS)}.",
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


def _check_config(
    request: TrainRequest,
    stored: CheckpointMetadata | None,
    settings: TrainSettings,
    problems: _Problems,
) -> Any:
    try:
        config = _resolve_config(request, stored)
    except (ValueError, TypeError) as e:
        problems.add(
            MeshplanError,
            f"model config: {e}",
            "Use --size tiny|small|base with valid size flags.",
        )
        return None
    if settings.seq_len > config.max_len:
        problems.add(
            MeshplanError,
            f"--seq {settings.seq_len} exceeds the model's max_len={config.max_len}",
            f"Use --seq {config.max_len} or less, or a larger --max-len.",
        )
    return config


def _check_batch(
    request: TrainRequest, settings: TrainSettings, mesh: Mesh, rules: Any, problems: _Problems
) -> int:
    """A batch of tokens, ``[batch, seq_len + 1]``, splits over the mesh axes the rules give.

    The validator checks the batch as one more array; this turns what it finds into flag advice.
    Returns the number of devices 'batch' is split over.
    """
    valid, index_map, _ = rules_problems(rules)
    with jax.set_mesh(mesh), logical_axis_rules(valid):
        context = context_shards()
    if context > 1 and settings.seq_len % (2 * context):
        problems.add(
            MeshplanError,
            f"--seq {settings.seq_len} cannot be striped over the {context} context shards that "
            f"--rules {request.rules} split 'length' into (load balancing cuts a sequence into "
            f"{2 * context} equal chunks)",
            f"Use a --seq that is a multiple of {2 * context}.",
            "seq-not-striped",
        )
    shape = (settings.batch, settings.seq_len + 1)
    leaf = check_leaf("logical", BATCH_NAMES, shape, valid, index_map, mesh_info(mesh))
    # The activations' 'length' (context parallelism): its mesh axes must exist (the stripes
    # are checked above).
    activations = check_leaf(
        "logical", ("batch", "length"), (settings.batch, settings.seq_len), valid, index_map,
        mesh_info(mesh),
    )  # fmt: skip
    shards = 1
    for d in [*leaf.dims, *(d for d in activations.dims[1:] if d.missing_axes)]:
        if d.index == 0 and not d.missing_axes:
            shards = max(int(d.shards), 1)
        if d.missing_axes:
            problems.add(
                MeshError,
                f"--rules {request.rules} shard {d.name!r} over mesh axis "
                f"{', '.join(map(repr, d.missing_axes))}, which the {request.mesh} mesh "
                f"{tuple(mesh.axis_names)} does not have",
                f"Map {d.name!r} to the mesh's axes {tuple(mesh.axis_names)}, e.g. "
                f"({d.name!r}, {mesh.axis_names[0]!r}).",
                "unknown-axis",
            )
        elif not d.divides:
            where = (
                f"the {d.shards} devices that --rules {request.rules} shard {d.name!r} over (mesh "
                f"axes {d.mesh_axes} of the {request.mesh} mesh)"
            )
            if d.index == 0:
                problems.add(
                    MeshplanError,
                    f"--batch {settings.batch} does not split over {where}",
                    f"Use a --batch that is a multiple of {d.shards} (e.g. {d.padded_size}), or "
                    f"a mesh and rules that split 'batch' over fewer devices.",
                    "indivisible",
                )
            else:
                problems.add(
                    MeshplanError,
                    f"--seq {settings.seq_len} gives token windows of {d.size} (the model reads "
                    f"{settings.seq_len} bytes and predicts the next), which do not split over "
                    f"{where}",
                    "Leave 'length' unsharded: ('length', None) in the rules.",
                    "indivisible",
                )
    accum = settings.grad_accum
    if accum > 1 and not settings.batch % accum and (settings.batch // accum) % shards:
        problems.add(
            MeshplanError,
            f"--grad-accum {accum} cuts --batch {settings.batch} into microbatches of "
            f"{settings.batch // accum}, which do not split over the {shards} devices that "
            f"--rules {request.rules} shard 'batch' over",
            f"Use a --batch that is a multiple of {accum * shards} (--grad-accum x {shards}), "
            f"or fewer microbatches.",
            "indivisible",
        )
    return shards


def _check_corpus(corpus: Any, settings: TrainSettings, problems: _Problems) -> None:
    """Both splits hold at least one window of ``seq_len + 1`` bytes."""
    for split in ("train", "valid"):
        try:
            corpus.check_window(split, settings.seq_len)
        except DataError as e:
            problems.add_error(e)


_SHOWN = 6
"""Parameters the layout cannot split shown in full; the rest are listed by path."""


def _check_state(
    request: TrainRequest,
    config: Any,
    abstract: Any,
    stored: CheckpointMetadata | None,
    mesh: Mesh | None,
    rules: Any,
    problems: _Problems,
    kind: str = DEFAULT_MODEL,
) -> None:
    """The checkpoint fits the model's shapes; the layout can split every parameter."""
    if stored is not None:
        mismatch = compatibility_problems(stored, abstract)
        if mismatch:
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
                f"{mismatch[0]}",
                f"Resume with the checkpoint's {what}: leave out {flags} and the model size "
                "flags (or repeat the ones it was trained with), or train into a new --ckpt-dir.",
            )
    if mesh is not None and rules is not None:
        uneven = [
            p
            for key, (value, box) in flatten_state(abstract.params).items()
            if box is not None
            for p in validate(f"params/{key}", tuple(value.shape), box.names, mesh, rules)
            if p.code == "indivisible"
        ]
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


def _parse_train_mesh(text: str, axes: str | None = None) -> dict[str, int]:
    """``--mesh`` (and ``--axes``) as ``{axis: size}``: ``('data', 'model')`` without ``--axes``."""
    parts = str(text).lower().replace("×", "x").split("x")
    readable = all(p.strip().isdigit() and int(p) > 0 for p in parts)
    if axes is None and len(parts) > len(MESH_AXES) and readable:
        names = ",".join(("data", "fsdp", "tensor", "model", "expert")[: len(parts)])
        raise error_for(
            MeshError, "mesh-axes", "--mesh",
            f"--mesh {text} has {len(parts)} axes, but the default axis names {MESH_AXES} "
            f"are two",
            f"Pass --mesh DxM (e.g. 2x4), or name every axis: --mesh {text} --axes {names} (the "
            f"axes your --rules map to).",
        )  # fmt: skip
    if axes is not None and readable:
        names_given = [a.strip() for a in axes.split(",") if a.strip()]
        if len(names_given) != len(parts) or len(set(names_given)) != len(names_given):
            raise error_for(
                MeshError, "mesh-axes", "--axes",
                f"--axes {axes} gives {len(names_given)} distinct names for the {len(parts)} "
                f"axes of --mesh {text}",
                "Give one distinct name per mesh axis, in order, e.g. --mesh 2x2x2 --axes "
                "data,fsdp,tensor.",
            )  # fmt: skip
    try:
        return parse_mesh_shape(text, axes)
    except MeshError as e:
        raise error_for(
            MeshError, "mesh-text", "--mesh",
            f"Cannot read --mesh {text!r}: expected positive sizes separated by 'x'",
            "Write it like 2x4, 4x2 or 8 (8x1), or 2x2x2 with --axes data,fsdp,tensor.",
        ) from e  # fmt: skip


def _check_metrics_file(path: str | None, problems: _Problems) -> None:
    """``--metrics`` names a file that can be appended to (its folder exists), checked without
    creating it."""
    if path is None:
        return
    p = Path(path)
    fix = "Pass --metrics a file path whose folder exists, e.g. --metrics run/metrics.jsonl."
    if p.is_dir():
        problems.add(MeshplanError, f"--metrics {path!r} is a folder, not a file", fix)
    elif p.exists() and not p.is_file() and not p.is_char_device():
        kind = "a FIFO (named pipe)" if p.is_fifo() else "a socket or special file"
        problems.add(
            MeshplanError,
            f"--metrics {path!r} is {kind}, not a regular file: writing to it blocks until "
            f"something reads it, so the run would stop without a word",
            fix,
        )
    elif p.exists():
        if not os.access(p, os.W_OK):
            problems.add(MeshplanError, f"--metrics {path!r} cannot be written by this user", fix)
    elif not p.absolute().parent.is_dir():
        problems.add(
            MeshplanError, f"--metrics {path!r}: its folder {str(p.absolute().parent)!r} does not "
            "exist", fix,
        )  # fmt: skip
    elif not os.access(p.absolute().parent, os.W_OK):
        problems.add(
            MeshplanError,
            f"--metrics {path!r}: its folder {str(p.absolute().parent)!r} cannot be written",
            fix,
        )


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
        >>> from meshplan.cli.train_request import TrainRequest, prepare_run
        >>> try:
        ...     prepare_run(TrainRequest(rules="nope", mesh="3x3"))
        ... except meshplan.MeshplanError as e:
        ...     print(str(e).splitlines()[0])
        meshplan train cannot start:
    """
    problems = _Problems()
    rules = mesh = None
    try:
        rules = get_layout(request.rules)
    except MeshplanError as e:
        problems.add_error(e, f"--rules {request.rules}")
    try:
        axes = request.axes
        if axes is None and request.rules in CONTEXT_EXPERT_LAYOUTS:
            axes = ",".join(LAYOUT_AXES[request.rules])  # ('data', 'context'), ('data', 'expert')
        shape = _parse_train_mesh(request.mesh, axes)
        choice = request.devices
        if choice is not None:  # refused with the numbers and the fix in flag terms
            choose_devices(
                [] if choice.emulated else choice.devices,
                choice.devices if choice.emulated else [],
                needed=math.prod(shape.values()),
                mesh=request.mesh,
                xla_flags_count=count_from_xla_flags(),
            )
        mesh = make_mesh(shape, None if choice is None else choice.devices)
    except MeshplanError as e:
        problems.add_error(e)
    ckpt_dir, resume = _check_checkpoint_dir(request, problems)
    stored = resume.stored
    settings = _resolve_settings(request, stored, problems)
    _check_metrics_file(request.metrics, problems)
    config = _check_config(request, stored, settings, problems)
    kind = _resolve_model(request, stored, problems)
    batch_shards = None
    if mesh is not None and rules is not None and not settings.problems():
        batch_shards = _check_batch(request, settings, mesh, rules, problems)
    data = request.data
    if data is not None:
        data = str(Path(data).absolute())
    elif stored is not None:
        data = (stored.extra.get("train") or {}).get("data")
    corpus = _load_corpus(data, problems)
    if corpus is not None and not settings.problems():
        _check_corpus(corpus, settings, problems)
    tx = abstract = built = None
    if config is not None and kind is not None and not settings.problems():
        tokens = _example_tokens(config, settings)
        built = dataclasses.replace(example(kind, config).model, example_input=tokens)
        tx = make_optimizer(settings)
        abstract = abstract_train_state(built.model, tx, settings, tokens)
        _check_state(request, config, abstract, stored, mesh, rules, problems, kind)
    if not problems.items and batch_shards is not None:
        assert mesh is not None and config is not None and built is not None
        oom = memory_problem(built, abstract, settings, mesh, rules, batch_shards, config.remat)
        if oom is not None:
            problems.items.append((MeshplanError, oom))
    if not problems.items and ckpt_dir is not None:
        try:  # before any work, and only then: it creates the folder
            Checkpointer.check_writable(ckpt_dir)
        except MeshplanError as e:
            problems.add_error(e)

    problems.raise_if_any("meshplan train cannot start:")
    assert mesh is not None and built is not None and config is not None and corpus is not None
    assert kind is not None
    note = _model_note(kind, stored)
    peak = None
    if request.devices is not None:  # MFU against the devices the mesh uses, in its dtype
        devices = request.devices
        peak = mesh_peak(devices.platform, devices.kind, mesh.devices.size, config.dtype)
    trainer = Trainer(
        built,
        ByteBatches(corpus, settings, mesh, rules),
        settings,
        Placement(mesh, rules, str(request.rules)),
        Checkpoints(
            ckpt_dir,
            stored,
            tuple(resume.damaged),
            config=config.to_dict(),
            record={"data": data, "model": kind},
        ),
        Measures(
            train_flops(config, settings.batch, settings.seq_len),
            None if peak is None else peak.flops,
            request.sync_every_step,
        ),
        tx=tx,
        abstract=abstract,
        notes=[*resume.notes, *([] if note is None else [note])],
    )
    return PreparedRun(trainer, corpus, config, kind, peak)
