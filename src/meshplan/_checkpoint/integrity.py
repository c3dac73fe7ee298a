"""Whether a step can be read, cheaply: the newest intact step of a folder, and why others are not.

:func:`check_step` looks at one complete step (as Orbax lists them) without
reading its arrays:

* its ``meshplan`` metadata item parses (:func:`~meshplan._checkpoint.folder.metadata_of`);
* its ``state`` item exists, and Orbax's tree metadata (``_METADATA``) parses;
* in the OCDBT database Orbax writes the arrays into (its default), every saved
  array has its zarr metadata key, and the *last byte* of every stored chunk
  can be read: a data file that was truncated or deleted fails there. All
  these one-byte reads are issued at once.

So the cost is one listing of the database's b-tree and one one-byte read per
stored chunk (about the number of arrays times the shards each process wrote),
whatever the checkpoint's size. Bytes changed in place (same length) are not
detected here (no array is read): :func:`~meshplan._checkpoint.restore.restore`
verifies every array's checksum, stored at save
(:mod:`meshplan._checkpoint.checksum`), once it has read the arrays, raises
``'ckpt-damaged'`` naming the arrays, and ``restore(..., fallback=True)`` then
falls back; ``meshplan train --resume`` skips such a step like a truncated one.
"""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from etils import epath

from meshplan._checkpoint.folder import (
    META_ITEM,
    STATE_ITEM,
    checkpoint_path,
    complete_steps,
    damaged_fix,
    metadata_of,
    open_manager,
)
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import CheckpointError, Problem

__all__ = ["IntactStep", "check_step", "damaged", "intact_step", "step_directory"]

_ZARR_METADATA = (".zarray", ".zattrs", "zarr.json", ".zgroup")


def step_directory(path: str | os.PathLike[str], step: int) -> epath.Path:
    """The folder of complete ``step`` under ``path``, as Orbax names it."""
    import orbax.checkpoint as ocp

    p = checkpoint_path(path)
    return ocp.path.step.find_step_path(p, ocp.path.step.standard_name_format(), step=int(step))


def damaged(where: str, message: str, fix: str) -> Problem:
    """The :class:`Problem` of a damaged step (code ``'ckpt-damaged'``)."""
    return Problem("error", where, message, fix, "ckpt-damaged")


def _kvstore_url(directory: epath.Path) -> str:
    text = str(directory).rstrip("/") + "/"
    return text if "://" in text else "file://" + text


def _array_problems(state_dir: epath.Path, metadata: CheckpointMetadata) -> list[str]:
    """What is wrong with the arrays of an OCDBT ``state`` item (``[]``: all readable)."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": _kvstore_url(state_dir)}).result()
    keys = [k.decode("utf-8", "replace") for k in kv.list().result()]
    present = {k.split("/", 1)[0] for k in keys if k.rsplit("/", 1)[-1] in _ZARR_METADATA}
    problems = [
        f"array {key!r} is missing from '{STATE_ITEM}' (no stored '{key.replace('/', '.')}')"
        for key in metadata.arrays
        if key.replace("/", ".") not in present
    ]
    chunks = [k for k in keys if k.rsplit("/", 1)[-1] not in _ZARR_METADATA]
    reads = [(k, kv.read(k, byte_range=slice(-1, None))) for k in chunks]
    for key, future in reads:
        name = key.split("/", 1)[0].replace(".", "/")
        try:
            result = future.result()
        except Exception as e:  # TensorStore raises ValueError; any failure means damage
            problems.append(f"array {name!r} cannot be read (chunk {key!r}: {e})")
            continue
        if result.state != "value":
            problems.append(f"array {name!r} cannot be read (chunk {key!r} is {result.state})")
    return problems


def check_step(path: str | os.PathLike[str], step: int, manager: Any = None) -> Problem | None:
    """Why complete ``step`` of ``path`` cannot be read (a ``'ckpt-damaged'`` Problem), or ``None``.

    Reads the metadata and one byte per stored chunk, not the arrays (see the
    module's docstring). Other checkpoint errors (not a meshplan checkpoint, a
    newer format, no such step) are raised, not returned.

    Example:
        >>> import os, tempfile, jax.numpy as jnp, meshplan
        >>> from meshplan._checkpoint.integrity import check_step
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
        ...         _ = ckpt.save(1, {"w": jnp.ones(1000)})
        ...     print(check_step(folder, 1))
        ...     os.remove(os.path.join(folder, "1", "meshplan", "metadata"))
        ...     print(check_step(folder, 1).code)
        None
        ckpt-damaged
    """
    p = checkpoint_path(path)
    if manager is None:
        with open_manager(p) as opened:
            return check_step(p, step, opened)
    steps = sorted(manager.all_steps())
    where = f"{str(p)!r} (step {step})"
    fix = damaged_fix(steps, int(step))
    try:
        metadata = metadata_of(manager, p, step)
    except CheckpointError as e:
        codes = {q.code for q in e.problems}
        if "ckpt-damaged" not in codes:
            raise
        return damaged(where, e.problems[0].message, fix)
    try:
        directory = step_directory(p, step)
    except ValueError as e:  # removed meanwhile
        return damaged(where, f"{where}: its folder is gone ({e})", fix)
    state_dir = directory / STATE_ITEM
    if not state_dir.is_dir():
        return damaged(
            where, f"{where} has its '{META_ITEM}' metadata but no '{STATE_ITEM}' item", fix
        )
    tree_metadata = state_dir / "_METADATA"
    if tree_metadata.exists():
        try:
            json.loads(tree_metadata.read_text())
        except (OSError, ValueError) as e:
            return damaged(
                where,
                f"{where}: Orbax's tree metadata {str(tree_metadata)!r} is damaged ({e})",
                fix,
            )
    if (state_dir / "manifest.ocdbt").exists():
        try:
            problems = _array_problems(state_dir, metadata)
        except Exception as e:  # the database itself (manifest, b-tree) is unreadable
            problems = [f"its array database in {str(state_dir)!r} cannot be read ({e})"]
        if problems:
            shown = "; ".join(problems[:3]) + (
                f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
            )
            return damaged(where, f"{where}: {shown}", fix)
    return None


class IntactStep(NamedTuple):
    """What :func:`intact_step` found.

    Attributes:
        step: The newest step that can be read, or ``None`` when none can.
        skipped: One ``'ckpt-damaged'`` :class:`Problem` per newer step that
            cannot be read (newest first): its ``path`` names the folder and step,
            its ``message`` what is damaged, its ``fix`` what to do.
        skipped_steps: The step numbers of ``skipped``, in the same order: read
            from here, never parsed back out of a problem's text.
    """

    step: int | None
    skipped: list[Problem]
    skipped_steps: list[int]


def intact_step(path: str | os.PathLike[str], before: int | None = None) -> IntactStep:
    """The newest step of ``path`` (older than ``before``, if given) that can be read.

    Checks steps newest first with :func:`check_step` (metadata and one byte per
    stored chunk: no array is read), so a run can fall back to the newest intact
    step and say which newer ones it skipped and why.

    Raises:
        CheckpointError: the folder is missing or holds no complete step
            (codes as :func:`~meshplan._checkpoint.folder.read_metadata`'s), or is not
            a meshplan checkpoint.

    Example:
        >>> import os, tempfile, jax.numpy as jnp, meshplan
        >>> from meshplan._checkpoint.integrity import intact_step
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
        ...         for step in (1, 2):
        ...             _ = ckpt.save(step, {"w": jnp.ones(1000)})
        ...     os.remove(os.path.join(folder, "2", "meshplan", "metadata"))
        ...     found = intact_step(folder)
        ...     print(found.step, found.skipped_steps)
        1 [2]
    """
    p = checkpoint_path(path)
    if not complete_steps(p):
        with open_manager(p) as manager:
            metadata_of(manager, p)  # raises the folder's error (missing, empty, ...)
    skipped: list[Problem] = []
    skipped_steps: list[int] = []
    with open_manager(p) as manager:
        steps = sorted(manager.all_steps())
        for step in reversed(steps):
            if before is not None and step >= before:
                continue
            problem = check_step(p, step, manager)
            if problem is None:
                return IntactStep(step, skipped, skipped_steps)
            skipped.append(problem)
            skipped_steps.append(int(step))
    return IntactStep(None, skipped, skipped_steps)
