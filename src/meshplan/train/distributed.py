"""Joining a run of several JAX processes: one per host, or several on one machine.

Every process of a multi-process run calls :func:`join` with the same
coordinator address and process count and its own process id, before JAX's
backend starts. After it, ``jax.devices()`` lists the devices of every process
(ordered by process), a mesh is built over all of them, and each process feeds
only the rows of a batch its own devices hold
(``jax.make_array_from_process_local_data``).

On CPUs the processes talk through Gloo over TCP, so several processes on one
machine talk over the loopback interface exactly as hosts do over the network.

What a process does around this is its launcher's: ``meshplan train`` first has
the processes meet at the coordinator (:mod:`meshplan.cli.train.rendezvous`, which says
who is missing while it waits), keeps native output off its progress bar, and
ends a process whose JAX start hangs (``on_stuck``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable
from typing import Any

from meshplan._errors import MeshplanError, error_for

__all__ = [
    "DEFAULT_INIT_TIMEOUT",
    "DistributedError",
    "ProcessGroup",
    "StopVote",
    "join",
]


class DistributedError(MeshplanError, ValueError):
    """Multi-process settings that do not fit together, or a coordinator that cannot be reached."""


@dataclasses.dataclass(frozen=True)
class ProcessGroup:
    """Where this process stands in a multi-process run.

    Attributes:
        coordinator: ``HOST:PORT`` of process 0's coordination service.
        num_processes: How many processes take part.
        process_id: This process's index, ``0 <= process_id < num_processes``.
    """

    coordinator: str
    num_processes: int
    process_id: int


DEFAULT_INIT_TIMEOUT = 300
"""Seconds processes wait for each other by default: ``jax.distributed.initialize``'s own default."""

_JAX_SLACK_SECONDS = 15  # JAX's own deadline is this much later than ours: we speak first


def _seconds(value: float) -> str:
    return f"{value:g} s"


def join(
    group: ProcessGroup,
    timeout_seconds: float = DEFAULT_INIT_TIMEOUT,
    *,
    on_stuck: Callable[[MeshplanError], None] | None = None,
) -> None:
    """Joins the run: Gloo collectives on CPUs, then ``jax.distributed.initialize``.

    Call it before anything starts JAX's backend (after setting ``XLA_FLAGS``),
    on every process, with the same ``group.coordinator`` and
    ``group.num_processes``. If JAX's own start hangs past ``timeout_seconds``,
    ``on_stuck`` is called with the error (code ``'init-stuck'``) from a watchdog
    thread, before JAX's C++ client aborts the process some seconds later: a
    launcher ends the process there, saying why. With no ``on_stuck``, nothing
    watches.

    Raises:
        DistributedError: ``timeout_seconds`` is not positive (``'bad-init-timeout'``),
            or JAX refused to start (``'init-failed'``; e.g. its backend had already
            started).

    Example:
        >>> import meshplan.train.distributed as distributed
        >>> try:
        ...     distributed.join(distributed.ProcessGroup("127.0.0.1:1", 2, 0), 0)
        ... except distributed.DistributedError as e:
        ...     print(e.problems[0].code)
        bad-init-timeout
    """
    if not timeout_seconds > 0:  # also refuses NaN
        raise error_for(
            DistributedError,
            "bad-init-timeout",
            "timeout_seconds",
            f"join(timeout_seconds=...) must be a positive number of seconds, got "
            f"{timeout_seconds}",
            f"Pass a positive number, e.g. {DEFAULT_INIT_TIMEOUT} (JAX's default).",
        )
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    done = threading.Event()
    if on_stuck is not None:
        stuck = error_for(
            DistributedError,
            "init-stuck",
            group.coordinator,
            f"jax.distributed.initialize did not finish within {_seconds(timeout_seconds)} "
            f"(this is process {group.process_id})",
            "Check that nothing else took the coordinator's port on process 0's host just "
            "now, and that no HTTP proxy variables (http_proxy, https_proxy) are set; then "
            "run again.",
        )
        report = on_stuck

        def watch() -> None:
            if not done.wait(timeout_seconds):
                report(stuck)

        threading.Thread(target=watch, name="meshplan-join-watchdog", daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=math.ceil(timeout_seconds) + _JAX_SLACK_SECONDS,
        )
    except (RuntimeError, ValueError) as e:  # JaxRuntimeError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise error_for(
            DistributedError,
            "init-failed",
            group.coordinator,
            f"Process {group.process_id} of {group.num_processes} could not join the run "
            f"through the coordinator {group.coordinator}: {first}",
            "Start every process with the same coordinator address and process count, and a "
            "coordinator port that process 0 can listen on and the others reach.",
        ) from e
    finally:
        done.set()


_STOP_KEY = "meshplan/stop-asked"
_STOP_AT = "meshplan/stop-after-step/"


def _client() -> Any:
    from jax._src.distributed import global_state

    return global_state.client


def _has_key(client: Any, key: str) -> bool:
    try:
        client.key_value_try_get(key)  # raises when it is not there
    except Exception:
        return False
    return True


class StopVote:
    """A stop that every process of a run agrees on, at the same step (SIGTERM to any of them).

    A run of several processes cannot stop one process at a time: the others would
    wait for it in their next collective. So a process asked to stop says so in
    the coordination service's key-value store (:meth:`ask`), and after each
    step (:meth:`after`) process 0 decides for everyone, from its own request
    and the others', and writes its decision under that step's key; every other
    process reads it there. All of them then stop after the same step, finish
    the save in progress together, and the lock is released.

    Cost: one small key-value write (process 0) or blocking read (the others)
    per step, over the coordinator's connection; the read returns as soon as
    process 0 has read that step's loss, which every process waits for anyway.
    With one process it is a flag.
    """

    def __init__(self, timeout_seconds: float = 3600.0) -> None:
        import jax

        self.processes = jax.process_count()
        self.me = jax.process_index()
        self.timeout_ms = int(timeout_seconds * 1000)
        self.asked = False
        self._said = False

    def ask(self) -> None:
        """This process was asked to stop (e.g. SIGTERM); safe to call from a signal handler."""
        self.asked = True

    def after(self, step: int) -> bool:
        """Whether every process stops after ``step`` (the same answer on each of them).

        Every process calls it once per step, in step order.
        """
        if self.processes == 1:
            return self.asked
        client = _client()
        if self.asked and not self._said:
            self._said = True
            with contextlib.suppress(Exception):  # another process said it first
                client.key_value_set(_STOP_KEY, str(self.me), allow_overwrite=True)
        key = f"{_STOP_AT}{step}"
        if self.me == 0:
            stop = self.asked or _has_key(client, _STOP_KEY)
        else:
            return bool(client.blocking_key_value_get(key, self.timeout_ms) == "1")
        client.key_value_set(key, "1" if stop else "0", allow_overwrite=True)
        with contextlib.suppress(Exception):  # read by everyone long ago
            client.key_value_delete(f"{_STOP_AT}{step - 100}")
        return stop
