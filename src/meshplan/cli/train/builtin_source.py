"""The built-in model source of ``meshplan train``: the byte-level Transformer on a byte corpus.

The Transformer is the Flax Linen one (:mod:`meshplan.models.transformer`, ``--model
transformer``) or the Flax NNX one (:mod:`meshplan.models.transformer_nnx`, ``--model
transformer-nnx``): the same parameter paths, shapes and logical names, so their
checkpoints are interchangeable. Every checkpoint records which
(``extra["train"]["model"]``; a checkpoint without it holds ``transformer``). Its
batches are windows of a byte corpus (:mod:`meshplan.models.data`); its size comes
from ``--size`` and the size flags, else the checkpoint's config, else ``tiny``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import CheckpointError, MeshplanError
from meshplan._spmd.rules import LogicalRules
from meshplan._types import PyTree
from meshplan.cli.factory import is_factory
from meshplan.cli.train.display import header
from meshplan.cli.train.findings import Findings
from meshplan.cli.train.memory_advice import BatchWords
from meshplan.cli.train.preflight import fit_problems, load_corpus
from meshplan.cli.train.source import Found, uneven_problems
from meshplan.cli.trained_models import DEFAULT_MODEL, MODELS, model_of
from meshplan.models.batch_fit import BatchFit, batch_fit
from meshplan.models.data import ByteCorpus, shard_batch
from meshplan.models.registry import example
from meshplan.models.transformer import (
    CONFIG_SETTINGS,
    TransformerConfig,
    config_from_name,
    train_flops,
)
from meshplan.train.flops import MeshPeak, mesh_peak
from meshplan.train.model import TrainModel
from meshplan.train.settings import TrainSettings

if TYPE_CHECKING:
    from rich.console import Console

    from meshplan.cli.devices import DeviceChoice
    from meshplan.cli.train.preflight import FlagsRead
    from meshplan.cli.train.request import TrainRequest
    from meshplan.train.build import BuiltParts
    from meshplan.train.state import PlanSummary
    from meshplan.train.trainer import Trainer

__all__ = ["PIPELINE_FIELDS", "BuiltInSource", "ByteBatches"]

PIPELINE_FIELDS = ("microbatches", "pipeline_repeats")
"""The config fields a pipeline reads (``--microbatches``, ``--pipeline-repeats``)."""


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

    def __call__(self, split: str, index: int) -> jax.Array:
        s = self.settings
        tokens = self.corpus.batch_at(split, index, s.seed, s.batch, s.seq_len)
        return shard_batch(tokens, self.mesh, self.rules)


@dataclasses.dataclass
class BuiltInSource:
    """The byte-level Transformer (``--model transformer`` or ``transformer-nnx``) on a byte
    corpus: a :class:`~meshplan.cli.train.source.ModelSource`.

    Attributes:
        kind: ``--model`` decided (``None`` until :meth:`given`, or when unknown).
        corpus: The byte corpus the batches come from (``None``: unreadable).
        data: ``--data`` as an absolute path, else the checkpoint's (``None``: the stdlib).
        transformer: The model's config, decided (``None``: refused).
        model_note: What to say when the run continues a checkpoint of the other API.
        fit: What the library found of the batch and the pipeline on the mesh
            (:func:`~meshplan.models.batch_fit.batch_fit`, in :meth:`check`), worded in
            flags with what the build found (:meth:`built`); ``None``: not checked (no
            mesh or rules, or settings refused).
        pipeline_given: ``--microbatches`` or ``--pipeline-repeats`` was passed.
    """

    spec: str = DEFAULT_MODEL
    units: tuple[str, str] = ("tokens/s", " nats/byte")
    kind: str | None = None
    corpus: ByteCorpus | None = None
    data: str | None = None
    transformer: TransformerConfig | None = None
    model_note: str | None = None
    fit: BatchFit | None = None
    pipeline_given: bool = False

    def given(
        self, request: TrainRequest, stored: CheckpointMetadata | None, found: Found
    ) -> dict[str, Any]:
        """``--model`` (the request's, else the checkpoint's, else ``transformer``) and the
        settings the flags give."""
        saved = model_of(stored) if stored is not None else None
        kind = request.model or saved or DEFAULT_MODEL
        self.spec = kind
        if kind in MODELS:
            self.kind = kind
            self.model_note = _model_note(kind, stored)
        else:
            _unknown_model(request, kind, found)
        return dict(request.settings)

    def preset(self, request: TrainRequest) -> dict[str, Any]:
        return dict(CONFIG_SETTINGS.get(request.config or "", {}))

    def model(
        self,
        request: TrainRequest,
        stored: CheckpointMetadata | None,
        settings: TrainSettings,
        found: Found,
    ) -> TrainModel | None:
        """The config (the request's, else the checkpoint's, else ``tiny``), checked against
        ``--seq``, and the model ``--model`` names built from it; the corpus it reads.

        Its example input is ``seq_len`` tokens, at most ``max_len``: parameter shapes do not
        depend on the length, and staying within ``max_len`` lets the state be traced, to
        check it, even when ``--seq`` is too long.
        """
        data = request.data
        if data is not None:
            data = str(Path(data).absolute())
        elif stored is not None:
            data = (stored.extra.get("train") or {}).get("data")
        self.data = data
        self.corpus = load_corpus(data, settings, found.data)  # and a window of each split
        try:
            config = _resolve_config(request, stored)
        except (ValueError, TypeError) as e:
            found.config.add(
                MeshplanError,
                f"model config: {e}",
                "Use --size tiny|small|base with valid size flags.",
                "model-config",
                "--size",
            )
            return None
        self.transformer = config
        if settings.seq_len > config.max_len:
            found.config.add(
                MeshplanError,
                f"--seq {settings.seq_len} exceeds the model's max_len={config.max_len}",
                f"Use --seq {config.max_len} or less, or a larger --max-len.",
                "seq-too-long",
                "--seq",
            )
        if self.kind is None:
            return None
        tokens = jax.ShapeDtypeStruct((1, min(settings.seq_len, config.max_len)), jnp.int32)
        return dataclasses.replace(example(self.kind, config).model, example_input=tokens)

    def check(
        self, request: TrainRequest, flags: FlagsRead, settings: TrainSettings, found: Found
    ) -> None:
        """The library's check of the batch of tokens against the mesh's sizes and the rules,
        and of the pipeline the rules make (:attr:`fit`: said in flags with the build's
        findings, :meth:`built`)."""
        given = any(request.overrides.get(f) is not None for f in PIPELINE_FIELDS)
        self.pipeline_given = given
        if flags.shape is not None and flags.rules is not None and not settings.problems():
            self.fit = batch_fit(
                self.transformer, settings, flags.shape, flags.rules, flags.stage_axes
            )

    def example_batch(self, settings: TrainSettings) -> PyTree | None:
        return None  # checked before the build, against the mesh's sizes (batch_fit, in check)

    def memory_batch(self, settings: TrainSettings) -> PyTree | None:
        """One microbatch of tokens; ``None`` when the batch does not fit the mesh (:attr:`fit`:
        nothing to trace)."""
        if not self._batch_fits():
            return None
        micro = max(settings.batch // settings.grad_accum, 1)  # a device holds one at a time
        return jax.ShapeDtypeStruct((micro, settings.seq_len + 1), jnp.int32)

    def memory_words(self, settings: TrainSettings) -> BatchWords:
        remat = self.transformer is not None and self.transformer.remat
        return BatchWords(
            f"--batch {settings.batch}",
            f"sequences of {settings.seq_len} bytes",
            "Use --batch {largest} or less",
            f"a shorter --seq{'' if remat else ', --remat'}",
        )

    def built(
        self,
        request: TrainRequest,
        parts: BuiltParts,
        stored: CheckpointMetadata | None,
        settings: TrainSettings,
        found: Found,
    ) -> None:
        """The batch and the pipeline fit the mesh (:attr:`fit`, found before the build); the
        checkpoint fits the model's shapes; the layout can split every parameter."""
        if self.fit is not None:
            fit_problems(
                str(request.rules),
                request.mesh,
                settings,
                self.transformer,
                self.fit,
                self.pipeline_given,
                found.batch,
            )
        if parts.state_error is not None:
            raise parts.state_error  # the built-in model does not fail to initialise
        config = self.transformer
        if config is None or parts.abstract is None:
            return
        kind = self.kind or DEFAULT_MODEL
        if stored is not None and parts.mismatch:
            _mismatch_problems(config, kind, parts, stored, found.state)
        uneven_problems(request, parts.uneven, found.state)

    def _batch_fits(self) -> bool:
        """The batch and the pipeline fit the mesh (or were not checked)."""
        fit = self.fit
        if fit is None:
            return True
        unused = self.pipeline_given and fit.stage_axes[1] <= 1 and self.transformer is not None
        return fit.fits and not unused

    def batches(self, settings: TrainSettings, mesh: Mesh, rules: LogicalRules) -> ByteBatches:
        assert self.corpus is not None  # else refused
        return ByteBatches(self.corpus, settings, mesh, rules)

    def flops(self, settings: TrainSettings) -> float | None:
        assert self.transformer is not None  # else refused
        return train_flops(self.transformer, settings.batch, settings.seq_len)

    def peak(self, request: TrainRequest, settings: TrainSettings, mesh: Mesh) -> MeshPeak:
        """MFU against the devices the mesh uses, in the model's dtype."""
        assert self.transformer is not None  # else refused
        devices = request.devices
        if devices is None:
            return MeshPeak(None, None, "the request names no devices")
        return mesh_peak(devices.platform, devices.kind, mesh.devices.size, self.transformer.dtype)

    def config(self) -> dict[str, Any] | None:
        return None if self.transformer is None else self.transformer.to_dict()

    def record(self) -> dict[str, Any]:
        return {"data": self.data, "model": self.kind}

    def notes(self, request: TrainRequest, parts: BuiltParts, resumed: list[str]) -> list[str]:
        """The resume's notes, the other API's checkpoint, and a dense model on an expert layout."""
        assert self.transformer is not None and parts.rules is not None  # else refused
        rules = parts.rules
        note = [] if self.model_note is None else [self.model_note]
        return [*resumed, *note, *_dense_expert_note(request, self.transformer, rules)]

    def header(
        self,
        console: Console,
        trainer: Trainer,
        plan: PlanSummary,
        devices: DeviceChoice,
        peak: MeshPeak,
    ) -> None:
        assert self.transformer is not None and self.corpus is not None  # else refused
        header(console, trainer, plan, self.transformer, self.spec, self.corpus, devices, peak)


def _resolve_config(request: TrainRequest, stored: CheckpointMetadata | None) -> TransformerConfig:
    if request.config is not None or stored is None or stored.config is None:
        return config_from_name(request.config or "tiny", **request.overrides)
    return dataclasses.replace(TransformerConfig.from_dict(stored.config), **request.overrides)


def _unknown_model(request: TrainRequest, kind: str, found: Found) -> None:
    """A ``--model`` (or a checkpoint's) that is neither built in nor resumable here."""
    choices = ", ".join(MODELS)
    if request.model is None and is_factory(kind):
        found.model.add(
            CheckpointError,
            f"the checkpoint holds a model of your own, --model {kind}",
            f"Pass --model {kind} to resume it (the factory is imported again).",
            "ckpt-own-model",
            "--model",
        )
    elif request.model is None:
        found.model.add(
            CheckpointError,
            f"the checkpoint holds --model {kind!r}, which this meshplan does not know (it "
            f"trains {choices})",
            "Upgrade meshplan to resume this run, or pass --model to say which model it holds.",
            "ckpt-unknown-model",
            "--model",
        )
    else:
        found.model.add(
            MeshplanError,
            f"unknown --model {kind!r}",
            f"Pass --model {' or --model '.join(MODELS)}, or a model of your own: --model "
            f"pkg.module:factory (docs/training.md, 'Your own model').",
            "unknown-model",
            "--model",
        )


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


def _mismatch_problems(
    config: TransformerConfig,
    kind: str,
    parts: BuiltParts,
    stored: CheckpointMetadata,
    found: Findings,
) -> None:
    """The checkpoint's arrays that do not fit the model: the model and config fields that
    differ, then how many arrays, in flags."""
    mismatch = parts.mismatch
    held = model_of(stored)
    if held != kind:
        found.add(
            CheckpointError,
            f"the checkpoint holds --model {held} ({MODELS.get(held, '?')}), this run "
            f"asks for --model {kind} ({MODELS[kind]})",
            "",
            "ckpt-other-model",
            "--model",
        )
    saved = stored.config or {}
    for name, value in config.to_dict().items():
        if name in saved and saved[name] != value:
            found.add(
                CheckpointError,
                f"model config {name}: the checkpoint has {saved[name]!r}, this run asks for "
                f"{value!r}",
                "",
                "ckpt-config-differs",
                "--size",
            )
    what = "model and config" if held != kind else "config"
    flags = "--model, --size" if held != kind else "--size"
    found.add(
        CheckpointError,
        f"so {len(mismatch)} arrays differ between the checkpoint (step {stored.step}, "
        f"{len(stored.arrays)} arrays) and this model: they do not fit the model, e.g. "
        f"{mismatch[0].path}: {mismatch[0].message}",
        f"Resume with the checkpoint's {what}: leave out {flags} and the model size "
        "flags (or repeat the ones it was trained with), or train into a new --ckpt-dir.",
        "checkpoint-mismatch",
        "--ckpt-dir",
    )


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
