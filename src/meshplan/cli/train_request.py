"""What the user asked ``meshplan train`` for, checked before any work starts.

This is where the command line wires its recipe, the example byte-level
Transformer (:mod:`meshplan.examples.transformer`) trained on a byte corpus
(:mod:`meshplan.examples.data`), into the model-agnostic
:class:`~meshplan.train.trainer.Trainer`: the model, its loss, the batches and
the settings are passed in as arguments.

:func:`prepare` checks everything a user can get wrong (the layout, the mesh,
the batch, the model's dimensions against the layout, the data path, the
checkpoint folder and its shapes) and reports every problem at once, one
bullet each, the fixes at the end. When resuming, what the request leaves out
comes from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshplan._checkpoint.folder import latest_step, read_metadata
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._checkpoint.restore import compatibility_problems
from meshplan._checkpoint.tree import flatten_state
from meshplan._errors import CheckpointError, MeshError, MeshplanError, Problem, problem_message
from meshplan._spmd.mesh_info import mesh_info
from meshplan._spmd.rules import rules_problems
from meshplan._spmd.validate import check_leaf, validate
from meshplan.examples.data import BATCH_NAMES, ByteCorpus, DataError, shard_batch
from meshplan.examples.transformer import Transformer, TransformerConfig, config_from_name, loss_fn
from meshplan.layouts import get_layout
from meshplan.train.mesh import make_mesh, parse_mesh
from meshplan.train.settings import TrainSettings, make_optimizer
from meshplan.train.state import abstract_train_state
from meshplan.train.trainer import Trainer

__all__ = ["ByteBatches", "TrainRequest", "prepare"]


@dataclasses.dataclass
class TrainRequest:
    """What the user asked for; ``None`` means "the stored value when resuming, else the default".

    Attributes:
        mesh: ``"2x4"``-style sizes of ``('data', 'model')``.
        rules: A built-in layout name (:mod:`meshplan.layouts`) or a rules file.
        config: A preset name (``tiny``, ``small``); ``None`` resumes with the
            stored config, or uses ``tiny``.
        overrides: Model config fields to replace (``{"num_layers": 4}``).
        data: A folder or file of text; ``None`` uses the Python standard library.
        ckpt_dir: Where to save checkpoints (``None``: no checkpoints).
        resume: Continue from the latest complete checkpoint in ``ckpt_dir``.
        settings: :class:`TrainSettings` fields the user gave.
    """

    mesh: str = "2x4"
    rules: str = "fsdp_tp"
    config: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: str | None = None
    ckpt_dir: str | None = None
    resume: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


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


_FLAG_ADVICE = {
    "ckpt-missing": "Check --ckpt-dir, or start without --resume to train into it.",
    "ckpt-not-a-folder": "Pass a folder as --ckpt-dir.",
    "ckpt-no-steps": "Pass the --ckpt-dir of an earlier run, or start without --resume.",
    "ckpt-incomplete": "Its first save never finished: start again without --resume.",
    "ckpt-not-meshplan": "Pass the --ckpt-dir of a meshplan train run.",
    "ckpt-no-such-step": "Resume from the latest step: leave the step out.",
    "ckpt-damaged": (
        "Remove the damaged step's folder from --ckpt-dir to resume from the one before, "
        "or train into a new --ckpt-dir."
    ),
    "ckpt-newer-format": "Upgrade meshplan to resume this run.",
}
"""Flag-level advice for the library's problem codes (its own fixes name API calls)."""


class _Problems:
    """Collects (error class, problem) pairs and raises them together."""

    def __init__(self) -> None:
        self.items: list[tuple[type[MeshplanError], Problem]] = []

    def add(self, cls: type[MeshplanError], problem: str, fix: str, code: str = "train") -> None:
        self.items.append((cls, Problem("error", "", problem, fix, code)))

    def add_error(self, error: MeshplanError) -> None:
        """The error's problems, with flag-level advice for the codes the command line knows."""
        found = error.problems or [Problem("error", "", str(error), "", "error")]
        for p in found:
            message = f"{p.path}: {p.message}" if p.path and p.path not in p.message else p.message
            fix = _FLAG_ADVICE.get(p.code, p.fix)
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


def _check_checkpoint_dir(
    request: TrainRequest, problems: _Problems
) -> tuple[Path | None, CheckpointMetadata | None]:
    """The checkpoint folder, and its latest metadata when resuming."""
    ckpt_dir = Path(request.ckpt_dir).absolute() if request.ckpt_dir else None
    if request.resume and ckpt_dir is None:
        problems.add(
            MeshplanError,
            "--resume needs the checkpoint folder to resume from",
            "Pass --ckpt-dir DIR with --resume.",
        )
    elif request.resume and ckpt_dir is not None:  # (not None: the case above)
        try:
            return ckpt_dir, read_metadata(ckpt_dir)
        except MeshplanError as e:
            problems.add_error(e)
    elif ckpt_dir is not None and (last := latest_step(ckpt_dir)) is not None:
        problems.add(
            CheckpointError,
            f"--ckpt-dir {str(ckpt_dir)!r} already holds checkpoints (latest step {last})",
            "Pass --resume to continue that run, or a new --ckpt-dir to start another.",
        )
    return ckpt_dir, None


def _resolve_settings(
    request: TrainRequest, stored: CheckpointMetadata | None, problems: _Problems
) -> TrainSettings:
    """The defaults, overridden by the checkpoint's settings, overridden by the request's."""
    stored_train = (stored.extra.get("train") or {}) if stored else {}
    settings = TrainSettings.from_dict(
        {**TrainSettings().to_dict(), **stored_train, **request.settings}
    )
    for name in ("steps", "batch", "seq_len", "eval_batches"):
        if getattr(settings, name) < 1:
            problems.add(
                MeshplanError,
                f"{name} must be positive, got {getattr(settings, name)}",
                "Pass positive --steps, --batch, --seq and --eval-batches.",
            )
    for name, flag in (("eval_every", "--eval-every"), ("ckpt_every", "--ckpt-every"),
                       ("warmup", "--warmup")):  # fmt: skip
        if getattr(settings, name) < 0:
            problems.add(
                MeshplanError,
                f"{flag} must be 0 or more, got {getattr(settings, name)}",
                f"Pass {flag} 0 (only at the end) or a positive number of steps.",
            )
    if stored is not None and settings.steps < stored.step:
        problems.add(
            MeshplanError,
            f"--steps {settings.steps} is before the checkpoint's step {stored.step}",
            f"Pass --steps greater than {stored.step} to train further.",
        )
    return settings


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
            MeshplanError, f"model config: {e}", "Use --config tiny|small with valid size flags."
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
) -> None:
    """A batch of tokens, ``[batch, seq_len + 1]``, splits over the mesh axes the rules give.

    The validator checks the batch as one more array; this turns what it finds into flag advice.
    """
    valid, index_map, _ = rules_problems(rules)
    shape = (settings.batch, settings.seq_len + 1)
    leaf = check_leaf("logical", BATCH_NAMES, shape, valid, index_map, mesh_info(mesh))
    for d in leaf.dims:
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
) -> None:
    """The checkpoint fits the model's shapes; the layout can split every parameter."""
    if stored is not None:
        mismatch = compatibility_problems(stored, abstract)
        if mismatch:
            saved = stored.config or {}
            fields = [
                f"{name}: the checkpoint has {saved[name]!r}, this run asks for {value!r}"
                for name, value in config.to_dict().items()
                if name in saved and saved[name] != value
            ]
            for line in fields:
                problems.add(CheckpointError, f"model config {line}", "")
            problems.add(
                CheckpointError,
                f"so {len(mismatch)} of the checkpoint's {len(stored.arrays)} arrays (step "
                f"{stored.step}) do not fit the model, e.g. {mismatch[0]}",
                "Resume with the checkpoint's config: leave out --config and the model size "
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


def prepare(request: TrainRequest) -> Trainer:
    """Checks everything in ``request`` and returns a :class:`Trainer` ready to run.

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
        >>> from meshplan.cli.train_request import TrainRequest, prepare
        >>> try:
        ...     prepare(TrainRequest(rules="nope", mesh="3x3"))
        ... except meshplan.MeshplanError as e:
        ...     print(str(e).splitlines()[0])
        meshplan train cannot start:
    """
    problems = _Problems()
    rules = mesh = None
    try:
        rules = get_layout(request.rules)
    except MeshplanError as e:
        problems.add_error(e)
    try:
        mesh = make_mesh(parse_mesh(request.mesh))
    except MeshplanError as e:
        problems.add_error(e)
    ckpt_dir, stored = _check_checkpoint_dir(request, problems)
    settings = _resolve_settings(request, stored, problems)
    config = _check_config(request, stored, settings, problems)
    if mesh is not None and rules is not None:
        _check_batch(request, settings, mesh, rules, problems)
    data = request.data
    if data is not None:
        data = str(Path(data).absolute())
    elif stored is not None:
        data = (stored.extra.get("train") or {}).get("data")
    corpus = _load_corpus(data, problems)
    if corpus is not None:
        _check_corpus(corpus, settings, problems)
    model = tx = abstract = example_input = None
    if config is not None:
        model, tx = Transformer(config), make_optimizer(settings)
        example_input = _example_tokens(config, settings)
        abstract = abstract_train_state(model, tx, settings, example_input)
        _check_state(request, config, abstract, stored, mesh, rules, problems)

    problems.raise_if_any("meshplan train cannot start:")
    assert mesh is not None and model is not None and config is not None and corpus is not None
    return Trainer(
        model=model,
        loss=functools.partial(loss_fn, model=model),
        batches=ByteBatches(corpus, settings, mesh, rules),
        settings=settings,
        mesh=mesh,
        rules=rules,
        example_input=example_input,
        tx=tx,
        abstract=abstract,
        config=config.to_dict(),
        record={"data": data},
        ckpt_dir=ckpt_dir,
        resume_from=stored,
        layout_name=str(request.rules),
    )
