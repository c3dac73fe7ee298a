"""Joining a run of several JAX processes: one per host, or several on one machine.

Every process of a multi-process run calls :func:`join` with the same
coordinator address and process count and its own process id, before JAX's
backend starts. After it, ``jax.devices()`` lists the devices of every process
(ordered by process), a mesh is built over all of them, and each process feeds
only the rows of a batch its own devices hold
(``jax.make_array_from_process_local_data``).

On CPUs the processes talk through Gloo over TCP, so several processes on one
machine (``meshplan train --processes N``) talk over the loopback interface
exactly as hosts do over the network.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from meshplan._errors import MeshplanError, problem_message

__all__ = ["DistributedError", "ProcessGroup", "join", "parse_coordinator", "process_group"]


class DistributedError(MeshplanError, ValueError):
    """Multi-process flags that do not fit together, or a coordinator that cannot be reached."""


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


def parse_coordinator(text: str) -> tuple[str, int]:
    """``"10.0.0.1:1234"`` -> ``("10.0.0.1", 1234)``.

    Example:
        >>> from meshplan.train.distributed import parse_coordinator
        >>> parse_coordinator("127.0.0.1:4321"), parse_coordinator("[::1]:80")
        (('127.0.0.1', 4321), ('[::1]', 80))

    Raises:
        DistributedError: ``text`` is not ``HOST:PORT`` with a port in 1..65535.
    """
    host, _, port = str(text).rpartition(":")
    if host and port.isdigit() and 0 < int(port) < 65536:
        return host, int(port)
    raise DistributedError(
        f"Cannot read the coordinator address {text!r}: expected HOST:PORT.\n"
        f"Give process 0's host and a free port, e.g. --coordinator 10.0.0.1:9876."
    )


def process_group(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> ProcessGroup | None:
    """The :class:`ProcessGroup` the three flags describe; ``None`` when none is given.

    Example:
        >>> from meshplan.train.distributed import process_group
        >>> process_group("127.0.0.1:4321", 2, 1)
        ProcessGroup(coordinator='127.0.0.1:4321', num_processes=2, process_id=1)
        >>> process_group(None, None, None) is None
        True

    Raises:
        DistributedError: some but not all are given, or they do not fit together
            (every problem at once).
    """
    given = {
        "--coordinator": coordinator,
        "--num-processes": num_processes,
        "--process-id": process_id,
    }
    if all(v is None for v in given.values()):
        return None
    problems = [f"{flag} is missing" for flag, v in given.items() if v is None]
    if coordinator is not None:
        try:
            parse_coordinator(coordinator)
        except DistributedError as e:
            problems.append(str(e).splitlines()[0])
    if num_processes is not None and num_processes < 1:
        problems.append(f"--num-processes must be at least 1, got {num_processes}")
    if (
        num_processes is not None
        and process_id is not None
        and not 0 <= process_id < max(num_processes, 1)
    ):
        problems.append(
            f"--process-id {process_id} is not in 0..{num_processes - 1} "
            f"(--num-processes {num_processes})"
        )
    if problems:
        raise DistributedError(
            problem_message(
                "The multi-process flags do not fit together:",
                problems,
                "On each of N hosts run the same command with --coordinator HOST:PORT "
                "(process 0's host) --num-processes N --process-id I (I = 0..N-1).",
            )
        )
    # A missing flag is one of the problems above: all three are given here.
    assert coordinator is not None and num_processes is not None and process_id is not None
    return ProcessGroup(str(coordinator), int(num_processes), int(process_id))


def _quiet_native_stdout() -> None:
    """Sends what native code writes to file descriptor 1 to /dev/null; Python keeps stdout.

    Gloo prints a ``[Gloo] Rank i is connected to n peer ranks`` line per
    communicator to the C++ standard output, which would land between the
    lines of the progress bar.
    """
    sys.stdout.flush()
    kept = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdout = os.fdopen(
        kept, "w", buffering=1, encoding=sys.stdout.encoding, errors=sys.stdout.errors
    )


def join(group: ProcessGroup, timeout_seconds: int = 120) -> None:
    """Joins the run: Gloo collectives on CPUs, then ``jax.distributed.initialize``.

    Call it before anything starts JAX's backend (after setting ``XLA_FLAGS``).

    Raises:
        DistributedError: the coordinator was not reached within
            ``timeout_seconds`` (or JAX's backend had already started).
    """
    import jax

    if group.num_processes > 1:
        _quiet_native_stdout()
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    try:
        jax.distributed.initialize(
            coordinator_address=group.coordinator,
            num_processes=group.num_processes,
            process_id=group.process_id,
            initialization_timeout=timeout_seconds,
        )
    except (RuntimeError, ValueError) as e:  # JaxRuntimeError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DistributedError(
            f"Process {group.process_id} of {group.num_processes} could not join the run "
            f"through the coordinator {group.coordinator}: {first}\n"
            f"Start every process within {timeout_seconds} s of each other with the same "
            f"--coordinator and --num-processes, and a --coordinator port that process 0 can "
            f"listen on and the others reach."
        ) from e
