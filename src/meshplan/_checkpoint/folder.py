"""A checkpoint folder as Orbax's ``CheckpointManager`` sees it: its steps and its metadata.

A meshplan checkpoint folder is an Orbax ``CheckpointManager`` folder with one
step per save, each holding two items: ``state`` (the raw arrays) and
``meshplan`` (the JSON of :class:`~meshplan._checkpoint.metadata.CheckpointMetadata`).

Steps are found and read through Orbax's API only (``CheckpointManager.all_steps``,
``restore(step, args=Composite(...))``), never by scanning folder names or
opening files by path. So a step counts once Orbax has finalized it (a local
save is renamed from ``<step>.orbax-checkpoint-tmp-...``; a save to cloud
storage gets its commit marker), and any path Orbax can write (a local folder,
``gs://...``) can be read back.
"""

from __future__ import annotations

import operator
import os
from typing import Any

from etils import epath

from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import ArgumentError, CheckpointError, error_for

__all__ = [
    "ITEM_NAMES",
    "META_ITEM",
    "STATE_ITEM",
    "checkpoint_path",
    "complete_steps",
    "damaged_fix",
    "incomplete_steps",
    "latest_step",
    "metadata_of",
    "open_manager",
    "read_metadata",
    "remove_incomplete_steps",
    "step_number",
]

STATE_ITEM = "state"
"""The item of a step that holds the arrays."""

META_ITEM = "meshplan"
"""The item of a step that holds meshplan's JSON metadata."""

ITEM_NAMES = (STATE_ITEM, META_ITEM)
"""The items of every meshplan step, as ``CheckpointManager(item_names=...)`` takes them."""


def checkpoint_path(path: str | os.PathLike[str]) -> epath.Path:
    """``path`` as an ``epath.Path``: absolute when local, unchanged when a URL (``gs://...``).

    Example:
        >>> from meshplan._checkpoint.folder import checkpoint_path
        >>> str(checkpoint_path("gs://bucket/run")), checkpoint_path("run").is_absolute()
        ('gs://bucket/run', True)
    """
    p = epath.Path(path)
    return p if p.is_absolute() else p.absolute()


def open_manager(path: str | os.PathLike[str], *, all_processes: bool = False) -> Any:
    """A read-only ``ocp.CheckpointManager`` over ``path`` (use it as a context manager).

    It writes nothing, not even Orbax's root metadata (it is not opened with
    ``read_only=True`` only because Orbax then logs a warning at each opening;
    nothing here saves or deletes). With ``all_processes=False``
    it involves this process only (no barrier), so one process may call it alone;
    with ``True`` every process of the run must open it and restore together, as
    when arrays are read into shardings that span processes.

    Example:
        >>> from meshplan._checkpoint.folder import open_manager
        >>> with open_manager("/nonexistent/run") as manager:
        ...     print(manager.all_steps(), manager.latest_step())
        [] None
    """
    import jax
    import orbax.checkpoint as ocp

    if all_processes:
        processes = ocp.options.MultiprocessingOptions()
    else:
        me = jax.process_index()
        processes = ocp.options.MultiprocessingOptions(primary_host=me, active_processes={me})
    options = ocp.CheckpointManagerOptions(
        create=False,
        save_root_metadata=False,
        cleanup_tmp_directories=False,
        lightweight_initialize=True,  # steps only: no metrics or timestamps read
        multiprocessing_options=processes,
    )
    return ocp.CheckpointManager(checkpoint_path(path), options=options, item_names=ITEM_NAMES)


def complete_steps(path: str | os.PathLike[str]) -> list[int]:
    """The steps Orbax finalized in ``path``, oldest first (``[]`` when there is no folder).

    Example:
        >>> import tempfile, jax.numpy as jnp, meshplan
        >>> from meshplan._checkpoint.folder import complete_steps
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
        ...         _ = ckpt.save(4, {"w": jnp.ones(2)})
        ...     print(complete_steps(folder))
        [4]
    """
    with open_manager(path) as manager:
        return sorted(manager.all_steps())


def incomplete_steps(path: str | os.PathLike[str]) -> list[str]:
    """Names of the steps Orbax began but did not finalize (a save killed midway).

    Orbax decides: on a local disk, a ``<step>.orbax-checkpoint-tmp-...`` folder;
    on cloud storage, a step without its commit marker.

    Example:
        >>> import tempfile, os
        >>> from meshplan._checkpoint.folder import incomplete_steps
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     os.mkdir(os.path.join(folder, "4.orbax-checkpoint-tmp-1700000000"))
        ...     print(incomplete_steps(folder))
        ['4.orbax-checkpoint-tmp-1700000000']
    """
    import orbax.checkpoint as ocp

    p = checkpoint_path(path)
    if not p.is_dir():
        return []
    return sorted(t.get().name for t in ocp.path.step.all_temporary_paths(p))


def remove_incomplete_steps(path: str | os.PathLike[str]) -> list[str]:
    """Deletes what saves killed midway left in ``path``; returns the names removed.

    Orbax's own clean-up (``cleanup_tmp_directories``) runs in the background and
    may not be done when a manager is closed; this one is done on return.

    Example:
        >>> import tempfile, os
        >>> from meshplan._checkpoint.folder import remove_incomplete_steps
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     os.mkdir(os.path.join(folder, "4.orbax-checkpoint-tmp"))
        ...     print(remove_incomplete_steps(folder), os.listdir(folder))
        ['4.orbax-checkpoint-tmp'] []
    """
    p = checkpoint_path(path)
    names = incomplete_steps(p)
    for name in names:
        (p / name).rmtree(missing_ok=True)
    return names


_FIX_PATH = "Pass the path of a folder that a meshplan.Checkpointer saved into"


def _check_folder(path: epath.Path, manager: Any) -> list[int]:
    """The complete steps of ``path``; a :class:`CheckpointError` saying why there are none."""
    if not path.exists():
        raise error_for(
            CheckpointError,
            "ckpt-missing",
            str(path),
            f"No checkpoint folder at {str(path)!r}: it does not exist",
            "Check the path, or save a checkpoint there first: "
            "meshplan.Checkpointer(path).save(step, state).",
        )
    if not path.is_dir():
        raise error_for(
            CheckpointError,
            "ckpt-not-a-folder",
            str(path),
            f"{str(path)!r} is a file, not a checkpoint folder",
            f"{_FIX_PATH}.",
        )
    steps = sorted(manager.all_steps())
    if steps:
        return steps
    entries = sorted(c.name for c in path.iterdir())
    incomplete = incomplete_steps(path)
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
    raise error_for(
        CheckpointError,
        "ckpt-incomplete" if incomplete else "ckpt-no-steps",
        str(path),
        f"{str(path)!r} is not a meshplan checkpoint: {problem}",
        f"{_FIX_PATH}, or save into a new folder to start afresh.",
    )


def step_number(step: Any) -> int | None:
    """``step`` as an ``int`` (``None`` stays ``None``): ints, NumPy ints and digit strings.

    Raises:
        ArgumentError: (code ``'ckpt-bad-step'``) for anything else.

    Example:
        >>> from meshplan._checkpoint.folder import step_number
        >>> step_number("20"), step_number(20), step_number(None)
        (20, 20, None)
    """
    if step is None:
        return None
    if isinstance(step, str):
        text = step.strip()
        if text.isascii() and text.isdigit():  # "²".isdigit() too, and int("²") fails
            return int(text)
    elif not isinstance(step, bool):
        try:
            number = operator.index(step)
        except TypeError:
            pass
        else:
            if number >= 0:
                return number
    raise error_for(
        ArgumentError,
        "ckpt-bad-step",
        "step",
        f"step must be a whole number of 0 or more (or None for the latest), got {step!r} "
        f"({type(step).__name__})",
        "Pass step=20, for example: a step number as saved (digits 0-9 in a string).",
    )


def _step_to_read(path: epath.Path, steps: list[int], step: object) -> int:
    step = step_number(step)
    if step is None:
        return steps[-1]
    if step in steps:
        return int(step)
    midway = [n for n in incomplete_steps(path) if n.split(".", 1)[0] == str(step)]
    why = f" (its save stopped midway: {midway[0]!r})" if midway else ""
    raise error_for(
        CheckpointError,
        "ckpt-no-such-step",
        str(path),
        f"{str(path)!r} has no complete checkpoint at {step=}{why}; it has steps {steps}",
        "Pass one of those steps, or step=None for the latest.",
    )


def damaged_fix(steps: list[int], step: int) -> str:
    """The fix of a damaged ``step``: the earlier steps to restore instead (API-level).

    Example:
        >>> from meshplan._checkpoint.folder import damaged_fix
        >>> print(damaged_fix([10, 15, 20], 20))
        Restore an earlier step (step=15; steps before it: [10, 15]), or restore(path, fallback=True) for the newest intact one.
    """
    earlier = [s for s in steps if s < step]
    if not earlier:
        return (
            "No earlier step is left: save into a new folder to start afresh (or delete this "
            "step's folder)."
        )
    return (
        f"Restore an earlier step (step={earlier[-1]}; steps before it: {earlier}), or "
        f"restore(path, fallback=True) for the newest intact one."
    )


def _steps_with_metadata(path: epath.Path, steps: list[int]) -> list[int]:
    """Those of ``steps`` whose folder has a ``meshplan`` item (looked up on disk, cheaply)."""
    import orbax.checkpoint as ocp

    found = []
    for step in steps:
        try:
            directory = ocp.path.step.find_step_path(
                path, ocp.path.step.standard_name_format(), step=int(step)
            )
        except ValueError:
            continue
        if (directory / META_ITEM).is_dir():
            found.append(step)
    return found


def metadata_of(
    manager: Any, path: str | os.PathLike[str], step: int | str | None = None
) -> CheckpointMetadata:
    """:func:`read_metadata` through an open manager (see :func:`open_manager`)."""
    import orbax.checkpoint as ocp

    p = checkpoint_path(path)
    steps = _check_folder(p, manager)
    step = _step_to_read(p, steps, step)
    where = f"{str(p)!r} (step {step})"
    try:
        restored = manager.restore(
            step, args=ocp.args.Composite(**{META_ITEM: ocp.args.JsonRestore()})
        )
        data = restored[META_ITEM]
    except KeyError as e:
        others = _steps_with_metadata(p, [s for s in steps if s != step])
        if others:  # a meshplan folder: this step lost its item, like one that lost its arrays
            raise error_for(
                CheckpointError,
                "ckpt-damaged",
                where,
                f"{where} has no '{META_ITEM}' metadata item (removed or never written; the "
                f"folder's other steps have one, e.g. step {others[-1]})",
                damaged_fix(steps, step),
            ) from e
        raise error_for(
            CheckpointError,
            "ckpt-not-meshplan",
            where,
            f"{where} is not a meshplan checkpoint: it has no '{META_ITEM}' metadata item "
            f"({e.args[0] if e.args else e})",
            f"{_FIX_PATH}; restore a plain Orbax checkpoint with orbax.checkpoint and a "
            f"target tree.",
        ) from e
    except Exception as e:  # Orbax raises OSError, ValueError or a bare Exception
        raise error_for(
            CheckpointError,
            "ckpt-damaged",
            where,
            f"{where}: cannot read its '{META_ITEM}' metadata item ({type(e).__name__}: {e})",
            damaged_fix(steps, step),
        ) from e
    try:
        metadata = CheckpointMetadata.from_json(data, where)
    except CheckpointError as e:
        if not e.problems or e.problems[0].code != "ckpt-damaged":
            raise
        raise error_for(
            CheckpointError,
            "ckpt-damaged",
            where,
            e.problems[0].message,
            damaged_fix(steps, step),
        ) from e
    if metadata.step != step:
        raise error_for(
            CheckpointError,
            "ckpt-damaged",
            where,
            f"{where}: its metadata says step {metadata.step}, but it is the folder of step "
            f"{step} (moved or edited by hand)",
            damaged_fix(steps, step),
        )
    return metadata


def latest_step(path: str | os.PathLike[str]) -> int | None:
    """The latest step Orbax finalized in ``path``, or ``None`` when there is none (or no folder).

    Example:
        >>> from meshplan._checkpoint.folder import latest_step
        >>> latest_step("/nonexistent/run") is None
        True
    """
    with open_manager(path) as manager:
        step: int | None = manager.latest_step()  # Orbax has no type information
        return step


def read_metadata(
    path: str | os.PathLike[str], step: int | str | None = None
) -> CheckpointMetadata:
    """The :class:`CheckpointMetadata` of ``step`` (default: the latest complete one).

    Reads only the small JSON item, no arrays: use it to check a checkpoint
    against a model config before any work starts. This process reads it alone
    (no barrier with the other processes of a run).

    Raises:
        CheckpointError: ``path`` is missing, empty, holds no complete step, is
            not a meshplan checkpoint, lacks ``step``, or the step's metadata is
            damaged (code ``'ckpt-damaged'``, naming the step and the earlier ones).
        ArgumentError: ``step`` is not a whole number (``"20"`` is taken as 20).

    Example:
        >>> import meshplan
        >>> from meshplan._checkpoint.folder import read_metadata
        >>> try:
        ...     read_metadata("/nonexistent/run")
        ... except meshplan.CheckpointError as e:
        ...     print(str(e).splitlines()[0])
        No checkpoint folder at '/nonexistent/run': it does not exist.
    """
    with open_manager(path) as manager:
        return metadata_of(manager, path, step)
