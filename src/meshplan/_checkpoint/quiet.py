"""Orbax's noise kept out of a meshplan process: its error logs, its leftovers, its waiting threads.

A failed save or restore makes Orbax (and TensorStore under it) print screens of
traceback that say nothing the :class:`~meshplan.CheckpointError` raised instead
does not. Everything meshplan does about it is here, installed once and chained to
what was there before:

* one ``sys.unraisablehook`` (:func:`install_hook`) with two filters, each turned
  on by the first event that needs it: TensorStore callbacks into Orbax's closed
  event loop after a failed save or read (:func:`quiet_late_callbacks`, from the first
  Checkpointer opened or the first restore), and the read coroutines of a failed restore
  (:func:`drop_orbax_leftovers`);
* a filter on asyncio's log for tasks of Orbax's whose exception nobody awaited
  (:data:`ORPHANED_TASKS`, with the first filter above);
* a filter on absl's log for Orbax's error logs while a Checkpointer is open
  (:func:`quiet_orbax_logs`);
* :func:`unblock_orbax_threads`: Orbax's threads that wait for a signal from a
  failed one, woken. This uses Orbax's private API
  (``orbax.checkpoint._src.futures.future._SignalingThread`` and ``set_signals``;
  the one other use is ``writer``'s array-metadata store);
  where a later Orbax lacks either, it does nothing, and those threads end when
  their own timeout (minutes) runs out, keeping the process alive until then.

Each filter drops only what came from Orbax's own code (a path with ``/orbax/`` in it).
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import threading
from typing import Any

__all__ = [
    "ORPHANED_TASKS",
    "drop_orbax_leftovers",
    "install_hook",
    "quiet_late_callbacks",
    "quiet_orbax_logs",
    "unblock_orbax_threads",
]

_ORBAX_DIR = f"{os.sep}orbax{os.sep}"


# -- the one unraisable hook ----------------------------------------------------

_FILTERS: set[str] = set()
"""The filters turned on: ``'closed-loop'``, ``'orbax-coroutines'``."""

_INSTALLED = False
_previous: Any = None


def _is_orbax_coroutine(unraisable: Any) -> bool:
    code = getattr(getattr(unraisable, "object", None), "cr_code", None)
    return code is not None and _ORBAX_DIR in code.co_filename


def _is_closed_loop(unraisable: Any) -> bool:
    value = getattr(unraisable, "exc_value", None)
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def _hook(unraisable: Any) -> None:
    if "closed-loop" in _FILTERS and _is_closed_loop(unraisable):
        return
    if "orbax-coroutines" in _FILTERS and _is_orbax_coroutine(unraisable):
        return
    _previous(unraisable)


def install_hook() -> None:
    """Installs meshplan's one ``sys.unraisablehook`` (once), chained to the previous one."""
    global _INSTALLED, _previous
    if _INSTALLED:
        return
    _INSTALLED = True
    _previous = sys.unraisablehook
    sys.unraisablehook = _hook


# -- after a failed save --------------------------------------------------------


_NEVER_RETRIEVED = (
    " exception was never retrieved",
    "unhandled exception during asyncio.run() shutdown",
)
"""What asyncio's log says on the first line of its message for a future's lost exception
(``f"{type(future).__name__} exception was never retrieved"``: a ``Task``, a plain
``Future``, the ``_GatheringFuture`` of an ``asyncio.gather``), and for one of the tasks
``asyncio.run`` cancels as it ends: the writes still in flight when the save's first
write failed (a full disk: a ``FileNotFoundError`` from ``write_fragment`` once the step's
folder was removed)."""


class _OrphanedOrbaxTasks(logging.Filter):
    """asyncio's "Task (Future, _GatheringFuture) exception was never retrieved" for Orbax's
    writes, and its "unhandled exception during asyncio.run() shutdown": left out.

    The writes still in flight when a save fails end with an exception nobody awaits; when
    collected, asyncio logs each with a screen of TensorStore traceback (at exit, or in the
    middle of the next message), sometimes before the failure reaches the Checkpointer.
    The failure itself is reported once, as a CheckpointError from save, wait or close
    (Orbax's manager raises it there); these add nothing. Only tasks whose exception passed
    through Orbax's code are left out, and only in a process that opened a Checkpointer.

    The tasks are often collected as the interpreter exits, once this module's globals
    may already be ``None``: what the filter reads is kept on the filter itself.
    """

    def __init__(self) -> None:
        super().__init__()
        self._said = _NEVER_RETRIEVED
        self._orbax_dir = _ORBAX_DIR

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            first = str(record.msg).partition("\n")[0]
            if not any(said in first for said in self._said):
                return True
            exc = record.exc_info[1] if record.exc_info else None
            tb = exc.__traceback__ if exc is not None else None
            while tb is not None:
                if self._orbax_dir in tb.tb_frame.f_code.co_filename:
                    return False
                tb = tb.tb_next
        except Exception:  # never let a log filter raise (this may run during shutdown)
            return True
        return True


ORPHANED_TASKS = _OrphanedOrbaxTasks()


def quiet_late_callbacks() -> None:
    """Leaves out TensorStore callbacks into Orbax's closed event loop (after a failed save).

    The writes still in flight when a save fails finish after Orbax closed its
    asyncio loop; their callbacks then raise ``RuntimeError('Event loop is
    closed')``, which Python prints as a bare traceback. Nothing is lost: the save
    failed and said so. Called when a Checkpointer opens (the callbacks may come
    before Orbax reports the failure); with it, :data:`ORPHANED_TASKS` on asyncio's log.
    """
    if "closed-loop" in _FILTERS:
        return
    _FILTERS.add("closed-loop")
    logging.getLogger("asyncio").addFilter(ORPHANED_TASKS)
    install_hook()


def unblock_orbax_threads(timeout: float = 5.0) -> None:
    """Lets Orbax threads that wait for a signal from a failed one end (they would wait minutes).

    After a failed save, Orbax's background threads that wait for another
    thread's signal (e.g. "the step folder exists") wait for their whole
    timeout (5 minutes) and keep the interpreter alive. Each is cancelled and
    its awaited signals are set, so it wakes, sees the cancellation and returns.
    Orbax's private API (see the module); without it, nothing is done.
    """
    try:
        from orbax.checkpoint._src.futures import future
    except ImportError:  # pragma: no cover - Orbax moved it
        return
    thread_type = getattr(future, "_SignalingThread", None)
    set_signals = getattr(future, "set_signals", None)
    if not isinstance(thread_type, type) or set_signals is None:  # pragma: no cover
        return
    waiting: list[Any] = [
        t for t in threading.enumerate() if isinstance(t, thread_type) and t.is_alive()
    ]
    for thread in waiting:
        try:
            thread.cancel()
            set_signals(thread._receive_signals, operation_id=thread._operation_id)
        except Exception:
            pass
    for thread in waiting:
        threading.Thread.join(thread, timeout=timeout)


# -- while a Checkpointer is open -----------------------------------------------


class _OrbaxErrorLogs(logging.Filter):
    """Leaves out Orbax's error logs (with tracebacks) while a Checkpointer is open.

    Also its warning at every save without ``metrics`` (they are optional here).

    A failed save logs the same traceback from each of Orbax's threads (hundreds of
    lines); the :class:`CheckpointError` raised instead names the folder, the cause
    and the fix, and keeps Orbax's exception as its ``__cause__``.
    """

    open_count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if self.open_count <= 0 or _ORBAX_DIR not in record.pathname:
            return True
        if record.levelno >= logging.ERROR:
            return False
        # Logged at every save without metrics: they are optional here.
        return not str(record.msg).startswith("Requested `tracked_metric`")


_ORBAX_LOGS = _OrbaxErrorLogs()
_ORBAX_LOGS_LOCK = threading.Lock()


def quiet_orbax_logs(delta: int) -> None:
    """One more (``+1``) or one fewer (``-1``) Checkpointer open: the absl filter is on while any is."""
    with _ORBAX_LOGS_LOCK:
        if _ORBAX_LOGS.open_count == 0 and delta > 0:
            logging.getLogger("absl").addFilter(_ORBAX_LOGS)
        _ORBAX_LOGS.open_count += delta
        if _ORBAX_LOGS.open_count <= 0:
            _ORBAX_LOGS.open_count = 0
            logging.getLogger("absl").removeFilter(_ORBAX_LOGS)


# -- after a failed restore -----------------------------------------------------


def drop_orbax_leftovers() -> None:
    """Collects the read coroutines a failed Orbax restore leaves, without their tracebacks.

    Each failed array read leaves a coroutine whose exception Python prints as
    "Exception ignored in: <coroutine ...>" (a screen of TensorStore spec) when it
    is collected; the :class:`CheckpointError` raised instead says what is damaged.
    Some are still referenced when this runs and are collected later (at exit), so
    the filter stays on from the first failed restore; it drops only Orbax's coroutines.
    """
    _FILTERS.add("orbax-coroutines")
    install_hook()
    gc.collect()
