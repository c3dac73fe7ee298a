"""One writer per checkpoint folder: a lock file naming the host, PID and start time.

A :class:`~meshplan._checkpoint.checkpointer.Checkpointer` that opens a folder
for writing (process 0 of a run only) creates ``<folder>/meshplan.lock``
atomically (``O_CREAT | O_EXCL``) and writes into it, as JSON, who holds it::

    {"host": "node-3", "pid": 4242, "started": "2025-01-01T12:00:00+00:00",
     "started_unix": 1735732800.0, "pid_start": 123456}

A second writer is refused with a :class:`CheckpointError` (code
``'ckpt-locked'``) naming that host, PID and start time. A lock whose process
is gone (same host, the PID is dead, or reused by another process since) is
stale: it is taken over, and :attr:`FolderLock.note` says so (the caller prints
it; a ``UserWarning`` is issued too). The lock is removed by :meth:`FolderLock.release`
and, for locks still held, at normal interpreter exit.

The lock file's name is not a step name, so Orbax never lists it as a step.
Only local folders are locked: on cloud storage (``gs://...``) there is no
atomic create, so no lock is taken there.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import json
import os
import socket
import threading
import time
import warnings
from typing import Any

from meshplan._errors import CheckpointError, error_for

__all__ = ["LOCK_NAME", "FolderLock", "StaleLockWarning", "read_lock"]

LOCK_NAME = "meshplan.lock"
"""The lock file's name inside a checkpoint folder."""

_held: dict[str, FolderLock] = {}  # lock path -> lock held by this process
_held_guard = threading.Lock()


def _pid_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (Linux), to detect a reused PID."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
        return int(text.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int, pid_start: int | None) -> bool:
    """Whether ``pid`` runs on this host (and is the same process, when its start is known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        pass
    except OSError:
        return False
    if pid_start is not None:
        now = _pid_start(pid)
        if now is not None and now != pid_start:
            return False  # the PID was reused by another process
    return True


def read_lock(directory: str | os.PathLike[str]) -> dict[str, object] | None:
    """Who holds ``directory``'s lock (the JSON of its lock file), or ``None`` if unlocked.

    Example:
        >>> import tempfile
        >>> from meshplan._checkpoint.lock import FolderLock, read_lock
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     print(read_lock(folder))
        ...     lock = FolderLock.acquire(folder)
        ...     print(sorted(read_lock(folder)))
        ...     lock.release()
        None
        ['host', 'pid', 'pid_start', 'started', 'started_unix']
    """
    path = os.path.join(os.fspath(directory), LOCK_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return {}  # being written, or damaged: held by someone unknown
    return data if isinstance(data, dict) else {}


def _holder_text(data: dict[str, object]) -> str:
    if not data:
        return "an unknown process (the lock file is empty or damaged)"
    return (
        f"PID {data.get('pid')} on host {data.get('host')!r}, started "
        f"{data.get('started', 'at an unknown time')}"
    )


class StaleLockWarning(UserWarning):
    """A stale lock of a checkpoint folder was taken over (its holder is no longer running).

    Its message is :attr:`FolderLock.note`: a caller that says the note itself (``meshplan
    train`` prints it with its notes) filters this class, and no other warning.
    """


class FolderLock:
    """The lock of one checkpoint folder, held by this process.

    Attributes:
        path: The lock file.
        note: ``None``, or a sentence saying a stale lock was taken over (whose, and why).
    """

    def __init__(self, path: str, data: dict[str, object], note: str | None) -> None:
        self.path = path
        self.data = data
        self.note = note

    @classmethod
    def acquire(cls, directory: str | os.PathLike[str]) -> FolderLock:
        """Takes ``directory``'s lock (the folder must exist).

        Raises:
            CheckpointError: ``'ckpt-locked'`` when a live process holds it;
                ``'ckpt-not-writable'`` when the lock file cannot be written.
        """
        folder = os.fspath(directory)
        path = os.path.join(folder, LOCK_NAME)
        note = None
        for _ in range(3):
            try:
                return cls._create(path, note)
            except FileExistsError:
                pass
            holder = read_lock(folder)
            if holder is None:
                continue  # released meanwhile: try again
            why = cls._stale(path, holder)
            if why is None:
                raise error_for(
                    CheckpointError,
                    "ckpt-locked",
                    folder,
                    f"{folder!r} is being written by another Checkpointer: {_holder_text(holder)} "
                    f"(lock file {path!r})",
                    "Wait for that run to finish or stop it, or save into another folder. If "
                    "that process is gone (e.g. on another host), delete the lock file.",
                )
            note = (
                f"Took over the stale lock of {folder!r}: it was held by "
                f"{_holder_text(holder)}, which {why}."
            )
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise error_for(
            CheckpointError,
            "ckpt-locked",
            folder,
            f"Could not take the lock of {folder!r}: other processes keep taking it",
            "Make sure only one run writes into that folder.",
        )

    @staticmethod
    def _stale(path: str, holder: dict[str, Any]) -> str | None:
        """Why the lock ``holder`` is stale, or ``None`` if it may still be held."""
        if not holder:
            # Written by a process between its create and its write, or damaged: stale
            # only once it has stayed so for a while.
            try:
                age = time.time() - os.stat(path).st_mtime
            except FileNotFoundError:
                return "released it"
            return "left it empty" if age > 10 else None
        if holder.get("host") != socket.gethostname():
            return None  # cannot tell from here
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return None
        if pid == os.getpid():
            with _held_guard:
                mine = _held.get(path)
            if mine is None:
                return "is this process, whose Checkpointer was not closed and is gone"
            return None
        if not _alive(pid, holder.get("pid_start")):
            return "is no longer running on this host"
        return None

    @classmethod
    def _create(cls, path: str, note: str | None) -> FolderLock:
        now = time.time()
        data = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.fromtimestamp(now, datetime.UTC)
            .astimezone()
            .isoformat(timespec="seconds"),
            "started_unix": now,
            "pid_start": _pid_start(os.getpid()),
        }
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            raise
        except OSError as e:
            raise error_for(
                CheckpointError,
                "ckpt-not-writable",
                os.path.dirname(path),
                f"Cannot create the lock file {path!r}: {e.strerror or e} "
                f"({errno.errorcode.get(e.errno or 0, e.errno)})",
                "Make the folder writable by this user, or save into another folder.",
            ) from e
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f)
        lock = cls(path, data, note)
        with _held_guard:
            _held[path] = lock
        if note:
            warnings.warn(note, StaleLockWarning, stacklevel=4)
        return lock

    def held(self) -> bool:
        """Whether the lock file still names this process (nobody removed or took it)."""
        holder = read_lock(os.path.dirname(self.path))
        return (
            holder is not None
            and bool(holder)
            and holder.get("pid") == self.data["pid"]
            and holder.get("started_unix") == self.data["started_unix"]
        )

    def release(self) -> None:
        """Removes the lock file if it is still this process's; idempotent."""
        with _held_guard:
            if _held.get(self.path) is not self:
                return
            del _held[self.path]
        # A folder made read-only or removed meanwhile keeps (or lost) its lock file:
        # a later run finds it stale.
        with contextlib.suppress(OSError):
            if self.held():
                os.unlink(self.path)


@atexit.register
def _release_all() -> None:
    """At interpreter exit: releases the locks this process still holds."""
    with _held_guard:
        locks = list(_held.values())
    for lock in locks:
        with contextlib.suppress(OSError):
            lock.release()
