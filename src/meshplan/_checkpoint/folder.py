"""A checkpoint folder on disk: its complete steps, incomplete ones, and what is not one.

A meshplan checkpoint folder is an Orbax ``CheckpointManager`` folder with one
folder per step, each holding two items: ``state`` (the raw arrays) and
``meshplan`` (the JSON of :class:`~meshplan._checkpoint.metadata.CheckpointMetadata`).
Orbax writes each step into ``<step>.orbax-checkpoint-tmp`` and renames it when
complete, so a step folder named by its number alone is complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import CheckpointError

__all__ = [
    "META_ITEM",
    "STATE_ITEM",
    "TMP_SUFFIX",
    "complete_steps",
    "latest_step",
    "read_metadata",
    "remove_incomplete_steps",
]

STATE_ITEM = "state"
"""The item of a step folder that holds the arrays."""

META_ITEM = "meshplan"
"""The item of a step folder that holds meshplan's JSON metadata."""

TMP_SUFFIX = ".orbax-checkpoint-tmp"
"""What Orbax appends to a step folder it has not finished writing."""


def complete_steps(path: Path) -> list[int]:
    """Step folders Orbax finished writing (an incomplete one keeps its tmp suffix)."""
    steps = []
    for child in path.iterdir():
        if child.is_dir() and child.name.isdigit():
            steps.append(int(child.name))
    return sorted(steps)


def _incomplete_steps(path: Path) -> list[str]:
    return sorted(c.name for c in path.iterdir() if TMP_SUFFIX in c.name)


def remove_incomplete_steps(path: Path) -> list[str]:
    """Deletes what saves killed midway left in ``path``; returns the names removed.

    Example:
        >>> import tempfile
        >>> from pathlib import Path
        >>> from meshplan._checkpoint.folder import remove_incomplete_steps
        >>> with tempfile.TemporaryDirectory() as name:
        ...     folder = Path(name)
        ...     (folder / "4.orbax-checkpoint-tmp").mkdir()
        ...     print(remove_incomplete_steps(folder), list(folder.iterdir()))
        ['4.orbax-checkpoint-tmp'] []
    """
    names = _incomplete_steps(path) if path.is_dir() else []
    for name in names:
        shutil.rmtree(path / name, ignore_errors=True)
    return names


def _check_folder(path: Path) -> list[int]:
    """The complete steps of ``path``; a :class:`CheckpointError` when there are none."""
    if not path.exists():
        raise CheckpointError(
            f"No checkpoint folder at {str(path)!r}: it does not exist.\n"
            f"Check the path (--ckpt-dir), or train first: meshplan train --ckpt-dir {path}"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file, not a checkpoint folder.\n"
            f"Pass the folder that `meshplan train --ckpt-dir` wrote."
        )
    steps = complete_steps(path)
    if steps:
        return steps
    entries = sorted(c.name for c in path.iterdir())
    incomplete = _incomplete_steps(path)
    if incomplete:
        problem = (
            f"it holds only incomplete steps {incomplete} (the run stopped while saving "
            f"its first checkpoint)"
        )
    elif not entries:
        problem = "it is empty"
    else:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        problem = f"it holds no step folders, only: {shown}"
    raise CheckpointError(
        f"{str(path)!r} is not a meshplan checkpoint: {problem}.\n"
        f"Point at a folder written by `meshplan train --ckpt-dir`, or start a new run "
        f"without --resume."
    )


def latest_step(path: str | os.PathLike[str]) -> int | None:
    """The latest complete step in ``path``, or ``None`` when there is none (or no folder).

    Example:
        >>> from meshplan._checkpoint.folder import latest_step
        >>> latest_step("/nonexistent/run") is None
        True
    """
    p = Path(path)
    if not p.is_dir():
        return None
    steps = complete_steps(p)
    return steps[-1] if steps else None


def read_metadata(path: str | os.PathLike[str], step: int | None = None) -> CheckpointMetadata:
    """The :class:`CheckpointMetadata` of ``step`` (default: the latest complete one).

    Reads only the small JSON file, no arrays: use it to check a checkpoint
    against a model config before any work starts.

    Raises:
        CheckpointError: ``path`` is missing, empty, holds no complete step, is
            not a meshplan checkpoint, or lacks ``step``.

    Example:
        >>> import meshplan
        >>> from meshplan._checkpoint.folder import read_metadata
        >>> try:
        ...     read_metadata("/nonexistent/run")
        ... except meshplan.CheckpointError as e:
        ...     print(str(e).splitlines()[0])
        No checkpoint folder at '/nonexistent/run': it does not exist.
    """
    p = Path(path).absolute()
    steps = _check_folder(p)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(
            f"{str(p)!r} has no complete checkpoint at {step=}; it has steps {steps}.\n"
            f"Pass one of those steps, or step=None for the latest."
        )
    meta_file = p / str(step) / META_ITEM / "metadata"
    where = f"{str(p)!r} (step {step})"
    if not meta_file.is_file():
        raise CheckpointError(
            f"{where} is not a meshplan checkpoint: it has no '{META_ITEM}' metadata item "
            f"(looked for {str(meta_file)!r}).\nPoint at a folder written by `meshplan train` "
            f"or meshplan.Checkpointer; plain Orbax checkpoints need a target tree."
        )
    try:
        data = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{where}: cannot read its metadata {str(meta_file)!r}: {e}.\n"
            f"The file is damaged; restore an earlier step (step=...)."
        ) from e
    return CheckpointMetadata.from_json(data, where)
