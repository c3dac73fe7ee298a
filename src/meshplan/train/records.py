"""What a training run reports: its notes, its steps, its result, and why it stopped.

:class:`Note` (a message with a code and fields, worded by the command line in
its flags; defined in :mod:`meshplan._errors`, beside :class:`~meshplan._errors.Problem`), the validation-setting checks a resume makes, :func:`sane_step` (which
saved step a diverged run can resume from), :class:`Diverged`, :class:`StepRecord`
and :class:`TrainResult`. The loop that makes them is :mod:`meshplan.train.trainer`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from meshplan._errors import MeshplanError, Note, Problem

__all__ = [
    "Diverged",
    "Note",
    "StepRecord",
    "TrainResult",
    "sane_step",
    "valid_changes",
    "valid_setting",
]

_VALID_FIELDS = ("seq_len", "batch", "eval_batches", "seed")
"""The settings validation batches depend on (with ``data``)."""


def valid_setting(settings: Mapping[str, object], data: object) -> str:
    """What a validation loss was measured on, as text: losses of two settings do not compare.

    Example:
        >>> from meshplan.train.records import valid_setting
        >>> valid_setting({"seq_len": 16, "batch": 8, "eval_batches": 2, "seed": 0}, None)
        'seq 16, batch 8, eval_batches 2, seed 0, data stdlib'
    """
    parts = [f"{name.removesuffix('_len')} {settings.get(name)}" for name in _VALID_FIELDS]
    return ", ".join([*parts, f"data {data or 'stdlib'}"])


def valid_changes(
    before: Mapping[str, object], now: Mapping[str, object], data: object
) -> dict[str, tuple[object, object]]:
    """The settings of validation that differ, ``name: (before, now)``; ``data`` last.

    Example:
        >>> from meshplan.train.records import valid_changes
        >>> valid_changes({"seq_len": 16, "batch": 8}, {"seq_len": 32, "batch": 8}, None)
        {'seq_len': (16, 32)}
    """
    out = {
        name: (before.get(name), now.get(name))
        for name in _VALID_FIELDS
        if before.get(name) != now.get(name)
    }
    if (before.get("data") or None) != (data or None):
        out["data"] = (before.get("data") or "stdlib", data or "stdlib")
    return out


def valid_changed_note(step: int, changes: dict[str, tuple[object, object]]) -> Note:
    """The note of a run that validates otherwise than the checkpoint's ``step``."""
    changed = "; ".join(f"{name} {now} instead of {was}" for name, (was, now) in changes.items())
    template = (
        f"This run validates otherwise than step {step} of the checkpoint "
        "({changed}): validation losses of the two are not comparable, so the best "
        "step is kept per validation setting; this run's best is chosen among its "
        "own validations, and the checkpoint's best stays kept."
    )
    fields = {"step": step, "changes": changes}
    return Note(template, "valid-setting-changed", fields, {"changed": changed})


def sane_step(
    saved: list[int],
    losses: Mapping[int, float],
    best: tuple[int, float] | None,
    start: int = 0,
) -> tuple[int | None, str]:
    """The step to resume a diverged run from, and why (``''``: the latest, nothing to say).

    A saved step's state is judged by the training loss it then gave (the loss of
    the next step, ``losses[s + 1]``, computed with it; the step's own loss when no
    later one was read): sane when at or below the running median of the losses up
    to there. So a state saved while the loss had started to climb (``3.4e13``) is
    passed over. The newest sane saved step is chosen; a saved step this run has no
    loss of (older than the run) counts as sane; when none is, the ``best`` step by
    validation loss.

    Example:
        >>> from meshplan.train.records import sane_step
        >>> losses = {1: 5.0, 2: 4.0, 3: 3.9, 4: 3.8, 5: 9.0, 6: 3.4e13}
        >>> sane_step([2, 4, 6], losses, None)
        (2, 'the last saved step whose state then gave a training loss at or below the running median (3.9 at step 3, median 4); passed over: step 6 (3.4e+13 at step 6), step 4 (9 at step 5)')
        >>> sane_step([2, 4], {1: 5.0, 2: 4.5, 3: 4.2, 4: 4.0}, None)
        (4, '')
    """
    skipped: list[str] = []
    passed = "; passed over: "
    for s in reversed(saved):
        measured = s + 1 if s + 1 in losses else s if s in losses else None
        if measured is None:  # from before this run: not seen climbing
            if not skipped:
                return s, ""
            why = "the step this run started from" if s == start else "saved before this run"
            return s, f"{why} (its loss was not seen climbing){passed}" + ", ".join(skipped)
        value = losses[measured]
        median = float(np.median([v for k, v in losses.items() if k <= measured]))
        if value <= median:
            if not skipped:
                return s, ""
            return s, (
                f"the last saved step whose state then gave a training loss at or below the "
                f"running median ({value:.4g} at step {measured}, median {median:.4g})"
                f"{passed}" + ", ".join(skipped)
            )
        skipped.append(f"step {s} ({value:.4g} at step {measured})")
    if best is not None:
        return best[0], f"the best by validation loss ({best[1]:.4g}){passed}" + ", ".join(skipped)
    return (saved[0] if saved else None), (
        f"the oldest step kept{passed}" + ", ".join(skipped) if saved else ""
    )


class Diverged(MeshplanError, FloatingPointError):
    """Training stopped: a step's loss or state is not finite (code ``'train-not-finite'``).

    Nothing of that step was saved. The message names the step, what was not
    finite, and the last good checkpoint; the attributes let a caller word its
    own advice.

    Attributes:
        step: The step whose loss or state is not finite.
        last_good: The latest complete checkpoint step, or ``None`` (none, or no folder).
        best: ``(step, valid_loss)`` of the best checkpoint kept, or ``None``.
        ckpt_dir: The checkpoint folder, or ``None``.
        resume_at: The step to resume from: the last complete step whose state gave a
            sane training loss (at or below the running median, see :func:`sane_step`),
            which is ``last_good`` unless the loss was already climbing when it was
            saved; else the best step. ``None`` when there is none.
        resume_why: Why that step (a phrase for the message).
        cause: ``'diverged'`` (the updates diverged: the learning rate), ``'data'``
            (the step's batch holds NaN or inf; code ``'train-not-finite-data'``) or
            ``'start'`` (not finite from the run's first step, before any update;
            code ``'train-not-finite-start'``); see :mod:`meshplan.train.diagnosis`.
        cause_detail: What was found, as a phrase (``''`` for a divergence).
    """

    def __init__(
        self,
        step: int,
        what: str,
        path: str,
        last_good: int | None,
        best: tuple[int, float] | None,
        ckpt_dir: Path | None,
        resume_at: int | None = None,
        resume_why: str = "",
        cause: str = "diverged",
        cause_detail: str = "",
    ) -> None:
        self.step, self.last_good, self.best, self.ckpt_dir = step, last_good, best, ckpt_dir
        self.resume_at = last_good if resume_at is None else resume_at
        self.resume_why = resume_why
        self.cause, self.cause_detail = cause, cause_detail
        if cause in ("data", "start"):
            message = (
                f"Training stopped at step {step}: {what}, and {cause_detail}, so step {step} "
                f"was not saved"
            )
            which = (
                "the validation batches (batches('valid', i))"
                if path == "valid_loss"
                else f"the batch of step {step} (batches('train', {step - 1}))"
            )
            fix = (
                f"Fix {which}: the learning rate is not the cause, and resuming from an "
                f"earlier step feeds the same batch again."
                if cause == "data"
                else "Check the model's initialisation and the loss on the example batch (a "
                "log or a division of 0, a mask that leaves nothing): the learning rate is "
                "not the cause."
            )
            super().__init__(
                f"{message}.\n{fix}",
                [Problem("error", path, message, fix, f"train-not-finite-{cause}")],
            )
            return
        if ckpt_dir is None:
            kept = "No checkpoint folder was given, so no step is saved"
            fix = "Lower the learning rate and train again."
        elif last_good is None:
            kept = f"{str(ckpt_dir)!r} holds no complete step"
            fix = "Lower the learning rate and train again."
        else:
            kept = f"The last good checkpoint is step {last_good} of {str(ckpt_dir)!r}"
            if best is not None and best[0] != last_good:
                kept += f" (the best, by validation loss {best[1]:.4g}, is step {best[0]})"
            if self.resume_why:
                kept += f". Resume from step {self.resume_at}: {self.resume_why}"
            fix = (
                f"Lower the learning rate and resume from step {self.resume_at} "
                f"(Trainer(resume_from=read_metadata(path, step={self.resume_at})))."
            )
        message = f"Training diverged at step {step}: {what}, so step {step} was not saved. {kept}"
        super().__init__(
            f"{message}.\n{fix}", [Problem("error", path, message, fix, "train-not-finite")]
        )


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """What :meth:`Trainer.run` reports of one training step (``on_step``).

    Attributes:
        step: The step number (1 for the first step run from 0).
        loss: Its training loss.
        step_time_s: Its wall time in seconds, from the end of the step before
            to its own end, or ``None`` for a step that compiled or followed an
            evaluation or a save (left out of the throughput).
        tokens_per_s: ``tokens_per_step / step_time_s``, or ``None``.
        mfu: Model FLOPs utilisation of the step, ``flops_per_step /
            step_time_s / peak_flops_per_s``, when the trainer knows both, else ``None``.
        metrics: What a loss with ``has_aux`` measured of the step (e.g. an MoE
            model's ``dropped`` and ``routed`` expert choices), averaged over its
            microbatches; ``None`` without.
    """

    step: int
    loss: float
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    metrics: dict[str, float] | None = None

    def to_dict(self) -> dict[str, object]:
        """A JSON-able dict (``--metrics`` writes one per step); ``metrics`` only when measured."""
        out = dataclasses.asdict(self)
        if out["metrics"] is None:
            del out["metrics"]
        return out


@dataclasses.dataclass
class TrainResult:
    """What :meth:`Trainer.run` did.

    Attributes:
        start_step: The step the run started from (0, or the checkpoint's).
        end_step: The step it reached.
        losses: Training loss after each step run, by step number.
        evals: Validation loss by step number (step 0: before training).
        best_valid: ``(step, loss)`` of the best validation loss, counting
            earlier stretches of a resumed run; ``None`` if none.
        tokens_per_second: Training throughput of the train steps (the first, which
            compiles, and the time spent evaluating and saving left out).
        seconds: Wall time of the loop.
        saved_steps: Steps saved as checkpoints during this run.
        step_times: Wall time of each timed step (:class:`StepRecord`), by step.
        step_time_s: The median of :attr:`step_times` (``0.0`` if none).
        mfu: Model FLOPs utilisation at the median step time, or ``None``
            (the trainer knows no FLOP count or no peak).
        metrics: :attr:`StepRecord.metrics` by step (a loss with ``has_aux``).
    """

    start_step: int
    end_step: int
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    evals: dict[int, float] = dataclasses.field(default_factory=dict)
    best_valid: tuple[int, float] | None = None
    tokens_per_second: float = 0.0
    seconds: float = 0.0
    saved_steps: list[int] = dataclasses.field(default_factory=list)
    step_times: dict[int, float] = dataclasses.field(default_factory=dict)
    step_time_s: float = 0.0
    mfu: float | None = None
    metrics: dict[int, dict[str, float]] = dataclasses.field(default_factory=dict)
