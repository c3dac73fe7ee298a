"""Saving meshplan checkpoints with Orbax's ``CheckpointManager``, asynchronously.

A meshplan checkpoint is an Orbax ``CheckpointManager`` folder. Each step folder
holds two items:

* ``state``: the raw (unboxed) arrays, as a nested dict keyed by their paths in
  the saved tree (``params/Embed_0/embedding``, ``opt_state/1/0/mu/...``);
* ``meshplan``: JSON metadata beside them: the step, the model config, the
  shape, dtype and logical axis names of every array (keyed by path), the rules
  and the mesh shape the run used, and the meshplan version.

The parts, one concern each:

* :mod:`meshplan._checkpoint.tree`: arrays by their path in a tree;
* :mod:`meshplan._checkpoint.metadata`: the JSON beside the arrays;
* :mod:`meshplan._checkpoint.folder`: the steps and metadata of a folder, through
  Orbax's ``CheckpointManager``;
* :mod:`meshplan._checkpoint.restore`: :func:`~meshplan.restore` onto any mesh;
* this module: :class:`Checkpointer`, the saving side.

Orbax writes each step into ``<step>.orbax-checkpoint-tmp-...`` and renames it
when complete (on cloud storage: writes a commit marker), so a run killed in the
middle of a save leaves the previous steps intact; only steps Orbax finalized
are ever listed or restored.

What a :class:`Checkpointer` guarantees:

* **Keep policy.** The latest ``max_to_keep`` steps are kept, and also the step
  with the best ``keep_best`` metric (default: the lowest ``valid_loss`` passed
  to ``save(..., metrics=...)``), whatever ``max_to_keep`` says: Orbax's own
  ``preservation_policy`` (``LatestN`` or ``BestN``) decides; the metrics are
  Orbax's ``metrics`` item of each step, so a reopened folder knows them.
* **Only finite states.** ``save`` refuses a state with a NaN or an infinity
  in any floating array (code ``'ckpt-not-finite'``), with one jitted reduction
  (see :mod:`meshplan._checkpoint.finite` for the cost).
* **Failing I/O ends promptly.** A write that fails (permissions, a full disk,
  the folder removed) raises one :class:`CheckpointError` (code
  ``'ckpt-write-failed'``) from the ``save``, ``wait`` or ``close`` that
  notices it, and no Orbax thread is left waiting. Step folders are created in
  the calling thread, so a folder that cannot be written fails in ``save``.
  Orbax's own error logs are left out while a Checkpointer is open: the error
  carries the cause (``__cause__``); :mod:`meshplan._checkpoint.quiet` holds
  all of that quieting.
* **One writer per folder.** Process 0 holds ``<folder>/meshplan.lock`` (see
  :mod:`meshplan._checkpoint.lock`) from ``__init__`` to ``close`` (or exit).
* **Threads take turns.** ``save``, ``wait``, ``delete``, ``all_steps`` and
  ``close`` of one Checkpointer hold one lock, so saves from several threads
  run one after the other (each waits for the previous write): every save that
  returned ``True`` is on disk after ``close``, and a failure names its own step.
* **Checksums.** Every array's checksum is stored in the ``meshplan`` item and
  :func:`~meshplan.restore` verifies it (see :mod:`meshplan._checkpoint.checksum`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import re
import threading
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import jax
from etils import epath
from jax.sharding import Mesh

from meshplan._checkpoint.branch import Branched, damaged_note, set_aside_note
from meshplan._checkpoint.checksum import array_checksums
from meshplan._checkpoint.finite import nonfinite_paths
from meshplan._checkpoint.folder import (
    META_ITEM,
    STATE_ITEM,
    checkpoint_path,
    complete_steps,
    remove_incomplete_steps,
    step_number,
)
from meshplan._checkpoint.lock import FolderLock
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._checkpoint.quiet import (
    quiet_late_callbacks,
    quiet_orbax_logs,
    unblock_orbax_threads,
)
from meshplan._checkpoint.tree import flatten_state, nest
from meshplan._checkpoint.writer import item_handlers, state_save_args
from meshplan._errors import ArgumentError, CheckpointError, Note, error_for
from meshplan._spmd.rules import LogicalRules
from meshplan._text import paths_text
from meshplan._types import PyTree

__all__ = ["WHY_NAME", "Checkpointer"]

WHY_NAME = "why.txt"
"""The file :meth:`Checkpointer.set_aside` writes beside the steps it moved: why they were."""


# -- failing I/O ----------------------------------------------------------------

_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")
_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\]")


def _errno_of(e: BaseException) -> int | None:
    """The ``errno`` behind ``e``: an ``OSError``'s, or the one TensorStore writes in its text."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e.errno
        for pattern in (_OS_ERROR_CODE, _ERRNO_TEXT):
            match = pattern.search(str(e))
            if match:
                return int(match.group(1))
        e = e.__cause__ or e.__context__  # type: ignore[assignment]
    return None


def _cause_text(e: BaseException) -> str:
    code = _errno_of(e)
    if code is not None:
        name = errno.errorcode.get(code, str(code))
        return f"{os.strerror(code)} ({name})"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _write_fix(code: int | None) -> str:
    if code == errno.ENOSPC or code == errno.EDQUOT:
        return "Free space on that disk, or save into a folder on another disk."
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return "Make the folder writable by this user, or save into another folder."
    if code == errno.ENOENT:
        return "The folder (or part of it) was removed while saving: save into a new folder."
    return "Check the disk and the folder, or save into another folder."


def _save_step(step: object) -> int:
    """``step`` as the number of a step to save: a whole number of 0 or more."""
    try:
        number = step_number(step)
    except ArgumentError:
        number = None
    if number is None or number < 0:
        raise error_for(
            ArgumentError,
            "ckpt-bad-step",
            "step",
            f"Checkpointer.save: step must be a whole number of 0 or more, got {step!r}",
            "Pass the training step, e.g. save(20, state); a negative or missing step "
            "cannot be restored.",
        )
    return number


def _metric_key(name: str, mode: str) -> object:
    """Orbax's ``get_metric_fn``: the metric, with a missing or non-finite one ranked worst."""
    worst = math.inf if mode == "min" else -math.inf

    def key(metrics: PyTree) -> float:
        raw = metrics.get(name) if isinstance(metrics, Mapping) else None
        try:
            value = float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return worst
        return value if math.isfinite(value) else worst

    return key


GROUP_KEY = "best_group"
"""The key of a step's Orbax ``metrics`` that holds its ``best_group`` (see :meth:`Checkpointer.save`)."""


@dataclasses.dataclass
class _BestPerGroup:
    """Orbax preservation policy: the best step of each ``best_group`` (one group without one).

    Metrics measured under different settings (another validation length or batch)
    are not comparable: each group keeps its own best step.
    """

    get_metric_fn: Any
    mode: str

    def should_preserve(self, checkpoints: Any, *, context: object) -> list[bool]:
        best: dict[object, tuple[float, int]] = {}
        for i, checkpoint in enumerate(checkpoints):
            metrics = checkpoint.metrics
            if not isinstance(metrics, Mapping):
                continue
            value = float(self.get_metric_fn(metrics))
            if not math.isfinite(value):
                continue
            score = value if self.mode == "min" else -value
            group = metrics.get(GROUP_KEY)
            if group not in best or score <= best[group][0]:  # ties: the newer step
                best[group] = (score, i)
        kept = {i for _, i in best.values()}
        return [i in kept for i in range(len(checkpoints))]


class Checkpointer:
    """Saves meshplan checkpoints with Orbax's ``CheckpointManager`` (asynchronously).

    Each :meth:`save` returns once the arrays are copied off the devices and
    writes them in the background; the next save (or :meth:`wait`,
    :meth:`close`) waits for the previous one. The last ``max_to_keep``
    complete steps are kept, and the step with the best ``keep_best`` metric
    (see :meth:`save`'s ``metrics``) is never deleted. Leftovers of a save that
    was killed midway are removed when the folder is opened.

    Opening checks the folder can be written (:meth:`check_writable`) and, on
    process 0, takes its lock (one writer per folder; see :attr:`note`).

    Args:
        directory: The checkpoint folder (created if missing): a local path or
            any path Orbax writes (``gs://...``).
        max_to_keep: How many of the latest complete steps to keep (``None``: all).
        async_save: Write in a background thread (``False``: each save blocks).
        keep_best: The metric (a key of :meth:`save`'s ``metrics``) whose best
            step is always kept; ``None`` keeps only the latest steps.
        best_mode: ``"min"`` (lower is better, as a loss) or ``"max"``.

    Raises:
        CheckpointError: ``'ckpt-not-a-folder'`` (a file), ``'ckpt-not-writable'``
            (the folder or a file in it cannot be created), ``'ckpt-locked'``
            (another live process writes into it); ``'ckpt-closed'`` from
            :meth:`save`, :meth:`delete` or :meth:`set_aside` after :meth:`close`.
        ArgumentError: ``'ckpt-empty-path'`` (``directory`` is ``""``), or
            ``'ckpt-bad-keep'``.

    Example:
        >>> import tempfile, jax.numpy as jnp, meshplan
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     ckpt = meshplan.Checkpointer(folder, max_to_keep=2)
        ...     for step, loss in ((1, 3.0), (2, 2.5), (3, 2.9), (4, 2.8)):
        ...         _ = ckpt.save(step, {"step": jnp.int32(step)}, metrics={"valid_loss": loss})
        ...     ckpt.wait()  # the last save is now complete on disk
        ...     print(ckpt.all_steps(), ckpt.latest_step(), ckpt.best())
        ...     ckpt.close()  # or use the Checkpointer as a context manager
        [2, 3, 4] 4 (2, 2.5)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        keep_best: str | None = "valid_loss",
        best_mode: str = "min",
    ) -> None:
        import orbax.checkpoint as ocp
        from orbax.checkpoint import checkpoint_managers as policies

        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise error_for(
                ArgumentError,
                "ckpt-bad-keep",
                "max_to_keep",
                f"max_to_keep must be a whole number >= 1 or None, got {max_to_keep!r}",
                "Pass max_to_keep=3, for example (None keeps every step).",
            )
        if best_mode not in ("min", "max"):
            raise error_for(
                ArgumentError,
                "ckpt-bad-keep",
                "best_mode",
                f"best_mode must be 'min' or 'max', got {best_mode!r}",
                "Pass best_mode='min' for a loss (lower is better).",
            )
        if not str(directory).strip():
            raise error_for(
                ArgumentError,
                "ckpt-empty-path",
                "directory",
                f"Checkpointer(directory={str(directory)!r}): the path is empty (it would "
                f"save into the current folder, {os.getcwd()!r})",
                "Pass a folder, e.g. Checkpointer('runs/first'); pass '.' to mean the current "
                "folder.",
            )
        self.directory = checkpoint_path(directory)
        self.keep_best = keep_best
        self.best_mode = best_mode
        self.note: str | None = None
        """A sentence the caller should show, or ``None``: e.g. that a stale lock was taken over."""
        self._lock: FolderLock | None = None
        self._saving: int | None = None
        self._failure: CheckpointError | None = None
        self._failure_raised = False
        self._closed = False
        self._metrics: dict[int, float | None] = {}
        self._groups: dict[int, str | None] = {}
        # Saves, waits and deletes from several threads take turns (Orbax's manager is
        # not thread-safe: concurrent saves cancelled each other and lost steps).
        self._turn = threading.RLock()
        self.check_writable(self.directory)
        if jax.process_index() == 0:
            if "://" not in str(self.directory):
                self._lock = FolderLock.acquire(self.directory)
                self.note = self._lock.note
                weakref.finalize(self, self._lock.release)
            # Orbax's own clean-up (cleanup_tmp_directories) runs in the background and
            # may not be done when the manager is closed; this one is done on return.
            # The other processes wait for it in the manager's create barrier.
            remove_incomplete_steps(self.directory)
        latest = policies.LatestN(n=max_to_keep)
        best_fn = None if keep_best is None else _metric_key(keep_best, best_mode)
        preservation = (
            latest
            if best_fn is None
            else policies.AnyPreservationPolicy(
                [
                    latest,
                    _BestPerGroup(best_fn, best_mode),
                ]
            )
        )
        options = ocp.CheckpointManagerOptions(
            create=True,
            enable_async_checkpointing=async_save,
            preservation_policy=preservation,
            best_fn=best_fn,
            best_mode=best_mode,
            # Step folders are made in the calling thread: a folder that cannot be
            # written fails in save(), not in a thread that others wait on.
            async_options=ocp.options.AsyncOptions(create_directories_asynchronously=False),
        )
        quiet_orbax_logs(+1)
        quiet_late_callbacks()
        try:
            self._manager = ocp.CheckpointManager(
                self.directory, options=options, item_handlers=item_handlers()
            )
        except BaseException as e:
            quiet_orbax_logs(-1)
            if self._lock is not None:
                self._lock.release()
            if isinstance(e, OSError):
                raise self._not_writable(e) from e
            raise

    # -- checks ----------------------------------------------------------------

    @staticmethod
    def check_writable(directory: str | os.PathLike[str]) -> None:
        """Creates ``directory`` (and its parents) and a probe file in it, then removes the probe.

        Call it before any work to fail early; :class:`Checkpointer` calls it
        when opening. Runs as the calling user (``root`` writes anywhere).

        Raises:
            CheckpointError: ``'ckpt-not-a-folder'`` when ``directory`` (or a
                parent) is a file, ``'ckpt-not-writable'`` when it cannot be
                created or written, naming the cause.

        Example:
            >>> import os, tempfile, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     meshplan.Checkpointer.check_writable(os.path.join(folder, "new", "run"))
            ...     print(os.listdir(os.path.join(folder, "new", "run")))
            ...     open(os.path.join(folder, "file"), "w").close()
            ...     try:
            ...         meshplan.Checkpointer.check_writable(os.path.join(folder, "file"))
            ...     except meshplan.CheckpointError as e:
            ...         print(e.problems[0].code)
            []
            ckpt-not-a-folder
        """
        p = checkpoint_path(directory)
        if p.exists() and not p.is_dir():
            raise error_for(
                CheckpointError,
                "ckpt-not-a-folder",
                str(p),
                f"Cannot save checkpoints into {str(p)!r}: it is a file",
                "Pass a folder path (it is created if missing).",
            )
        try:
            p.mkdir(parents=True, exist_ok=True)
            probe = p / f".meshplan-probe-{os.getpid()}-{jax.process_index()}"
            probe.write_text("probe")
            probe.unlink()
        except (FileExistsError, NotADirectoryError) as e:
            raise error_for(
                CheckpointError,
                "ckpt-not-a-folder",
                str(p),
                f"Cannot save checkpoints into {str(p)!r}: a part of that path is a file "
                f"({_cause_text(e)})",
                "Pass a folder path whose parents are folders.",
            ) from e
        except OSError as e:
            raise Checkpointer._not_writable_error(p, e) from e

    @staticmethod
    def _not_writable_error(p: object, e: BaseException) -> CheckpointError:
        return error_for(  # type: ignore[return-value]
            CheckpointError,
            "ckpt-not-writable",
            str(p),
            f"Cannot write checkpoints into {str(p)!r}: {_cause_text(e)}",
            _write_fix(_errno_of(e)),
        )

    def _not_writable(self, e: BaseException) -> CheckpointError:
        return self._not_writable_error(self.directory, e)

    def _write_failed(self, e: BaseException, step: int | None) -> CheckpointError:
        """Records a failed write (once) and lets Orbax's waiting threads end."""
        quiet_late_callbacks()
        unblock_orbax_threads()
        if self._failure is None:
            try:
                kept = complete_steps(self.directory)
            except Exception:
                kept = []
            kept = [s for s in kept if s != step]
            what = f"step {step}" if step is not None else "a checkpoint"
            last = (
                f"The last complete step, {kept[-1]}, is kept"
                if kept
                else "No complete step is left there"
            )
            failure = error_for(
                CheckpointError,
                "ckpt-write-failed",
                str(self.directory),
                f"Saving {what} into {str(self.directory)!r} failed: {_cause_text(e)}. {last}",
                _write_fix(_errno_of(e)),
            )
            failure.__cause__ = e
            self._failure = failure  # type: ignore[assignment]
            if jax.process_index() == 0:
                # Free what the failed save wrote (a full disk); reopening would too.
                with contextlib.suppress(Exception):
                    remove_incomplete_steps(self.directory)
        assert self._failure is not None
        return self._failure

    def _raise_failure(self) -> None:
        if self._failure is not None:
            self._failure_raised = True
            raise self._failure

    def _check_open(self, call: str) -> None:
        """Raises ``'ckpt-closed'`` once :meth:`close` has run (its lock and Orbax are gone)."""
        if self._closed:
            raise error_for(
                CheckpointError,
                "ckpt-closed",
                str(self.directory),
                f"Checkpointer.{call}: this Checkpointer of {str(self.directory)!r} is closed "
                f"(close() ran: its lock is released and nothing more is written)",
                f"Open a new one to write again: meshplan.Checkpointer({str(self.directory)!r}), "
                f"or call close() (or leave its with-block) after the last save.",
            )

    def _check_still_ours(self, step: int) -> None:
        """The folder is still there and still locked by this Checkpointer."""
        if not self.directory.is_dir():
            self._failure_raised = True
            raise self._write_failed(
                FileNotFoundError(errno.ENOENT, "the folder was removed", str(self.directory)),
                step,
            )
        if self._lock is not None and not self._lock.held():
            self._lock.release()
            self._lock = FolderLock.acquire(self.directory)  # 'ckpt-locked' if taken

    # -- saving ----------------------------------------------------------------

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        rules: LogicalRules | None = None,
        mesh: Mesh | None = None,
        config: Mapping[str, object] | None = None,
        extra: Mapping[str, object] | None = None,
        metrics: Mapping[str, float] | None = None,
        check_finite: bool = True,
        best_group: str | None = None,
    ) -> bool:
        """Starts saving ``state`` (boxed or raw arrays) as ``step``; ``False`` if it exists.

        A step that exists is not saved again: ``False``, with a ``UserWarning``
        saying so (delete it first to replace it). Several threads may call it:
        their saves take turns.

        Args:
            step: The step number (the folder name): a whole number of 0 or more.
            state: PyTree pytree of arrays; boxes record their axis names.
            rules: The rules of the run (default: the active ones).
            mesh: The run's mesh (default: the mesh of the first sharded array).
            config: The model config as a JSON-serialisable dict.
            extra: More JSON-serialisable data to store (e.g. training settings).
            metrics: Numbers measured at this step, e.g. ``{"valid_loss": 2.5}``;
                stored as Orbax's ``metrics`` item. The step with the best
                ``keep_best`` metric is never deleted.
            check_finite: Refuse a state with a NaN or an infinity in a floating
                array (one jitted reduction over the state, see
                :mod:`meshplan._checkpoint.finite`).
            best_group: Which metrics this step's may be compared with, e.g. its
                validation setting: the best step of each group is kept (and
                :meth:`best` takes a group). ``None``: the group of steps without one.

        Raises:
            ArgumentError: ``'ckpt-bad-step'``: ``step`` is negative or not a whole number.
            CheckpointError: ``'ckpt-not-finite'`` (nothing is written; names the
                step and the first arrays or metrics), ``'ckpt-write-failed'``
                (this or the previous save could not be written), ``'ckpt-locked'``
                (another process took the folder's lock).

        Example:
            >>> import tempfile, warnings, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         print(ckpt.save(5, {"w": jnp.ones(2)}, config={"layers": 2}))
            ...         with warnings.catch_warnings(record=True) as caught:
            ...             print(ckpt.save(5, {"w": jnp.zeros(2)}))  # step 5 exists: a warning
            ...         print(str(caught[0].message).split(";")[0])
            ...         try:
            ...             ckpt.save(6, {"w": jnp.array([1.0, jnp.nan])})
            ...         except meshplan.CheckpointError as e:
            ...             print(e.problems[0].code, e.problems[0].path)
            True
            False
            Checkpointer.save: step 5 already exists in '...'
            ckpt-not-finite w
        """
        step = _save_step(step)
        with self._turn:
            self._check_open(f"save(step={step}, ...)")
            return self._save(
                step, state, rules, mesh, config, extra, metrics, check_finite, best_group
            )

    def _save(
        self,
        step: int,
        state: PyTree,
        rules: LogicalRules | None,
        mesh: Mesh | None,
        config: Mapping[str, object] | None,
        extra: Mapping[str, object] | None,
        metrics: Mapping[str, float] | None,
        check_finite: bool,
        best_group: str | None = None,
    ) -> bool:
        import orbax.checkpoint as ocp

        self._raise_failure()
        if step in self._manager.all_steps():  # finalized, or being written
            warnings.warn(
                f"Checkpointer.save: step {step} already exists in {str(self.directory)!r}; "
                f"it was not saved again (save returns False). Delete it first "
                f"(ckpt.delete({step})) to replace it, or save another step.",
                UserWarning,
                stacklevel=3,
            )
            return False
        flat = flatten_state(state, rules)
        metric_values = self._checked_metrics(step, metrics)
        if check_finite:
            bad = nonfinite_paths(flat)
            if bad:
                self._refuse_nonfinite(step, bad)
        metadata = CheckpointMetadata.from_flat(
            step,
            flat,
            rules=rules,
            mesh=mesh,
            config=config,
            extra=extra,
            checksums=array_checksums(flat),
        )
        raw = nest({key: value for key, (value, _) in flat.items()})
        self._check_still_ours(step)
        # Orbax waits for the previous save first; a failure there is that step's.
        self._wait_previous()
        try:
            saved = bool(
                self._manager.save(
                    step,
                    args=ocp.args.Composite(
                        **{
                            STATE_ITEM: state_save_args(raw),
                            META_ITEM: ocp.args.JsonSave(metadata.to_json()),
                        }
                    ),
                    metrics=None
                    if metric_values is None
                    else {**metric_values, **({GROUP_KEY: best_group} if best_group else {})},
                    force=True,
                )
            )
        except Exception as e:  # its step folder could not be made, or Orbax failed
            self._failure_raised = True
            raise self._write_failed(e, step) from e
        if saved:
            self._saving = step
            if self.keep_best is not None and metric_values is not None:
                self._metrics[step] = metric_values.get(self.keep_best)
                self._groups[step] = best_group
        return saved

    def _checked_metrics(
        self, step: int, metrics: Mapping[str, float] | None
    ) -> dict[str, float] | None:
        if metrics is None:
            return None
        out: dict[str, float] = {}
        for name, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError) as e:
                raise error_for(
                    ArgumentError,
                    "ckpt-bad-metric",
                    f"metrics/{name}",
                    f"save(step={step}, metrics=...): {name!r} must be a number, got {value!r}",
                    "Pass plain numbers, e.g. metrics={'valid_loss': 2.5}.",
                ) from e
            if not math.isfinite(number):
                raise error_for(
                    CheckpointError,
                    "ckpt-not-finite",
                    f"metrics/{name}",
                    f"Refusing to save step {step}: its metric {name!r} is {number}",
                    "The run diverged: restore the last good step and lower the learning rate; "
                    "nothing was written.",
                )
            out[str(name)] = number
        return out

    def _refuse_nonfinite(self, step: int, bad: list[str]) -> None:
        try:
            good = complete_steps(self.directory)
        except Exception:
            good = []
        last = (
            f"restore the last good step (meshplan.restore(path, step={good[-1]}))"
            if good
            else "start again"
        )
        raise error_for(
            CheckpointError,
            "ckpt-not-finite",
            bad[0],
            f"Refusing to save step {step}: NaN or infinite values in {len(bad)} "
            f"array{'s' if len(bad) != 1 else ''}: {paths_text(bad)}",
            f"The run diverged: {last} with a lower learning rate; nothing was written.",
        )

    # -- steps -----------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """The complete steps on disk, oldest first (a save still running is not among them).

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         print(ckpt.all_steps())
            ...         for step in (20, 10):
            ...             _ = ckpt.save(step, {"w": jnp.ones(2)})
            ...         print(ckpt.all_steps())
            []
            [10, 20]
        """
        # The manager lists a step from the moment its save starts; leave that one out
        # until Orbax has finalized it (and a failed one for good).
        with self._turn:
            in_progress = self._manager.is_saving_in_progress()
            steps = sorted(self._manager.all_steps())
            if (in_progress or self._failure is not None) and self._saving in steps:
                steps.remove(self._saving)
            return steps

    def latest_step(self) -> int | None:
        """The latest complete step on disk, or ``None``.

        Example:
            >>> import tempfile, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder) as ckpt:
            ...         print(ckpt.latest_step())  # an empty folder
            None
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def _metric_of(self, step: int) -> float | None:
        if step not in self._metrics:
            value = None
            try:
                metrics = self._manager.metrics(step)
            except Exception:
                metrics = None
            group = None
            if isinstance(metrics, Mapping) and self.keep_best is not None:
                try:
                    value = float(metrics.get(self.keep_best))  # type: ignore[arg-type]
                except (TypeError, ValueError):
                    value = None
                raw = metrics.get(GROUP_KEY)
                group = None if raw is None else str(raw)
            self._metrics[step] = value
            self._groups[step] = group
        return self._metrics[step]

    def best(self, group: str | None = None) -> tuple[int, float] | None:
        """``(step, metric)`` of the complete step with the best ``keep_best`` metric, or ``None``.

        Only steps on disk count (the policy never deletes this one), so a
        summary can name it. ``None`` when no complete step has that metric.
        ``group``: among the steps saved with that ``best_group`` only (``None``: all).

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, max_to_keep=1, async_save=False) as ckpt:
            ...         for step, loss in ((10, 2.0), (20, 1.5), (30, 9.0), (40, 8.0)):
            ...             _ = ckpt.save(step, {"w": jnp.ones(2)}, metrics={"valid_loss": loss})
            ...         print(ckpt.all_steps(), ckpt.best(), ckpt.best_step())
            [20, 40] (20, 1.5) 20
        """
        if self.keep_best is None:
            return None
        scored = [
            (step, value)
            for step in self.all_steps()
            if (value := self._metric_of(step)) is not None
            and math.isfinite(value)
            and (group is None or self._groups.get(step) == group)
        ]
        if not scored:
            return None
        sign = 1.0 if self.best_mode == "min" else -1.0
        return min(scored, key=lambda item: (sign * item[1], -item[0]))

    def best_step(self) -> int | None:
        """The step of :meth:`best`, or ``None``.

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         _ = ckpt.save(1, {"w": jnp.ones(2)}, metrics={"valid_loss": 3.0})
            ...         _ = ckpt.save(2, {"w": jnp.ones(2)}, metrics={"valid_loss": 2.5})
            ...         print(ckpt.best_step())
            2
        """
        found = self.best()
        return None if found is None else found[0]

    def delete(self, step: int) -> None:
        """Deletes the complete ``step`` (e.g. to save a step again from an earlier one).

        Waits for the save in progress first. Deleting a step that is not there is an error.

        Raises:
            CheckpointError: ``'ckpt-no-such-step'``: ``step`` is not a complete step here.

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         for step in (1, 2):
            ...             _ = ckpt.save(step, {"w": jnp.ones(2)})
            ...         ckpt.delete(2)
            ...         print(ckpt.all_steps())
            [1]
        """
        with self._turn:
            self._check_open(f"delete({step})")
            self._complete_steps([step], "delete", "Pass one of those steps.")
            self._manager.delete(step)

    def _complete_steps(self, steps: list[int], what: str, fix: str) -> list[int]:
        """Waits for the save in progress; the complete steps, or an error naming one of
        ``steps`` that is not among them (code ``'ckpt-no-such-step'``)."""
        self.wait()
        have = self.all_steps()
        missing = [s for s in steps if s not in have]
        if missing:
            raise error_for(
                CheckpointError,
                "ckpt-no-such-step",
                str(self.directory),
                f"{str(self.directory)!r} has no complete step {missing[0]} to {what}; it has "
                f"{have}",
                fix,
            )
        return have

    def set_aside(self, steps: list[int], name: str, why: str | None = None) -> epath.Path:
        """Moves complete ``steps`` into the sub-folder ``name`` (created; never deleted).

        For a run that continues from an earlier step: the later steps of the old
        branch, or a step that failed verification, stay on disk, out of the way
        (Orbax lists only the steps at the top of the folder, so nothing restores
        or resumes them by accident; ``meshplan.restore(<that folder>)`` still
        reads them). If ``name`` exists, ``.2``, ``.3``... is added. ``why``, when
        given, is written beside them into ``why.txt``. Waits for the save in
        progress first; process 0 moves them and every process then re-reads the
        folder (every process of a run calls it together).

        Returns:
            The folder the steps were moved into.

        Raises:
            CheckpointError: ``'ckpt-no-such-step'``: a step is not a complete step here.

        Example:
            >>> import os, tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         for step in (1, 2, 3):
            ...             _ = ckpt.save(step, {"w": jnp.ones(2)})
            ...         aside = ckpt.set_aside([2, 3], "old-branch-after-step-1")
            ...         print(ckpt.all_steps(), sorted(os.listdir(aside)))
            [1] ['2', '3']
        """
        from meshplan._checkpoint.integrity import step_directory

        with self._turn:
            self._check_open("set_aside(...)")
            self._complete_steps(steps, "set aside", "Pass some of those steps.")
            target = self.directory / name
            n = 1
            while target.exists():
                n += 1
                target = self.directory / f"{name}.{n}"
            if jax.process_index() == 0:
                target.mkdir(parents=True)
                if why is not None:
                    (target / WHY_NAME).write_text(why.rstrip("\n") + "\n")
                for step in steps:
                    source = step_directory(self.directory, step)
                    source.rename(target / source.name)
            if jax.process_count() > 1:
                from jax.experimental import multihost_utils

                multihost_utils.sync_global_devices(f"meshplan-set-aside-{name}")
            self._manager.reload()
            for step in steps:
                self._metrics.pop(step, None)
                self._groups.pop(step, None)
            return target

    def branch_from(
        self, step: int, damaged: Mapping[int, str], folder: str | None = None
    ) -> Branched:
        """Moves every step after ``step`` aside (never deletes one), so that ``step`` is the
        latest: a run continues from it.

        The ``damaged`` ones (``{step: why}``) each go into ``damaged-step-<N>`` with the
        reason in ``why.txt``; the intact ones, the later steps of the branch the run
        leaves, into ``old-branch-after-step-<step>`` (:meth:`set_aside`).

        Args:
            step: The step the run continues from.
            damaged: The later steps known to be damaged, with why.
            folder: How the notes name this folder (default: its path).

        Returns:
            A :class:`~meshplan._checkpoint.branch.Branched`: one note per move, and where
            the intact steps went.

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         for step in (1, 2, 3):
            ...             _ = ckpt.save(step, {"w": jnp.ones(2)})
            ...         moved = ckpt.branch_from(1, {3: "its bytes changed"}, folder="run")
            ...         steps = ckpt.all_steps()
            >>> steps, [note.code for note in moved.notes], moved.set_aside[0]
            ([1], ['damaged-step-moved', 'steps-set-aside'], [2])
        """
        where = str(self.directory) if folder is None else folder
        after = [s for s in self.all_steps() if s > step]
        notes: list[Note] = []
        for bad in (s for s in after if s in damaged):
            moved = self.set_aside([bad], f"damaged-step-{bad}", damaged[bad])
            notes.append(damaged_note(bad, where, str(moved), damaged[bad]))
        later = [s for s in after if s not in damaged]
        if not later:
            return Branched(notes, None)
        aside = self.set_aside(
            later,
            f"old-branch-after-step-{step}",
            f"Steps {', '.join(map(str, later))} came after step {step}, which a run "
            f"resumed from: the branch it left.",
        )
        notes.append(set_aside_note(later, where, step, str(aside)))
        return Branched(notes, (later, str(aside)))

    # -- waiting and closing ---------------------------------------------------

    def wait(self) -> None:
        """Blocks until the save in progress (if any) is complete on disk.

        Raises:
            CheckpointError: ``'ckpt-write-failed'``: that save failed (raised once).

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder) as ckpt:
            ...         _ = ckpt.save(1, {"w": jnp.ones(2)})  # returns while writing
            ...         ckpt.wait()
            ...         print(ckpt.latest_step())
            1
        """
        with self._turn:
            self._raise_failure()
            self._wait_previous()

    def _wait_previous(self) -> None:
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            self._failure_raised = True
            raise self._write_failed(e, self._saving) from e

    def close(self) -> None:
        """Waits for the save in progress, releases Orbax's resources and the folder's lock.

        Leaving a ``with Checkpointer(...)`` block calls it. Idempotent.

        Raises:
            CheckpointError: ``'ckpt-write-failed'`` when the last save failed and
                no earlier call raised that already. The lock is released and
                no Orbax thread is left running either way.

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     ckpt = meshplan.Checkpointer(folder)
            ...     _ = ckpt.save(1, {"w": jnp.ones(2)})
            ...     ckpt.close()
            ...     print(meshplan.restore(folder).metadata.step)
            1
        """
        with self._turn:
            self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        error: BaseException | None = None
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            error = self._write_failed(e, self._saving)
        try:
            self._manager.close()
        except Exception as e:
            if error is None and self._failure is None:
                error = self._write_failed(e, self._saving)
        finally:
            if self._failure is not None:
                unblock_orbax_threads()
            quiet_orbax_logs(-1)
            if self._lock is not None:
                self._lock.release()
        if self._failure is not None and not self._failure_raised:
            self._failure_raised = True
            raise self._failure

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
