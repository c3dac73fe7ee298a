"""Where ``meshplan train`` resumes from: the checkpoint folder checked, the newest intact step.

Steps found damaged are carried as :class:`DamagedStep` records (a step number and its
problem); the numbers come from the records and from
:attr:`~meshplan._checkpoint.integrity.IntactStep.skipped_steps`, never from a problem's text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple, Protocol

from meshplan._checkpoint.folder import latest_step, read_metadata
from meshplan._checkpoint.integrity import check_step, intact_step
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import CheckpointError, MeshplanError, Problem
from meshplan.cli.train.findings import Findings

__all__ = ["CheckpointRequest", "DamagedStep", "Resume", "check_checkpoint_dir"]


class DamagedStep(NamedTuple):
    """A step found damaged when its arrays were read, and the problem the restore raised."""

    step: int
    problem: Problem


class CheckpointRequest(Protocol):
    """What :func:`check_checkpoint_dir` reads of a request (a :class:`TrainRequest`)."""

    @property
    def ckpt_dir(self) -> str | None: ...
    @property
    def resume(self) -> bool: ...
    @property
    def resume_step(self) -> int | None: ...
    @property
    def damaged(self) -> Sequence[DamagedStep]: ...


@dataclasses.dataclass
class Resume:
    """Where a run resumes from: the metadata, the damaged steps skipped, and what to say."""

    stored: CheckpointMetadata | None = None
    damaged: list[int] = dataclasses.field(default_factory=list)
    why: dict[int, str] = dataclasses.field(default_factory=dict)
    """Why each of ``damaged`` cannot be read (written beside it when it is moved aside)."""
    notes: list[str] = dataclasses.field(default_factory=list)


def check_checkpoint_dir(
    request: CheckpointRequest, problems: Findings
) -> tuple[Path | None, Resume]:
    """The checkpoint folder, and the step to resume from when resuming.

    Without ``resume_step``: the newest intact step (a cheap check of each newer
    one, no array read); the damaged ones skipped are named in the notes.
    """
    resume = request.resume or request.resume_step is not None
    found = Resume()
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
            "resume-without-ckpt-dir",
            "--resume",
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
                    f"no step of {str(ckpt_dir)!r} can be read (nothing in it was moved or "
                    f"deleted): " + "; ".join(p.message for p in skipped),
                    "Train into a new --ckpt-dir; the steps stay as they are, for you to "
                    "inspect (meshplan.restore names what is damaged in each).",
                    "ckpt-damaged",
                )
                return ckpt_dir, found
            found.stored = read_metadata(ckpt_dir, intact.step)
            found.damaged = [*known, *intact.skipped_steps]
            found.why = {
                step: problem.message for step, problem in zip(found.damaged, skipped, strict=True)
            }
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
            "ckpt-not-empty",
            "--ckpt-dir",
        )
    return ckpt_dir, found
