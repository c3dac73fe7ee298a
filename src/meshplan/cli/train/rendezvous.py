"""Meeting at the coordinator before JAX starts: who has joined a run, said while waiting.

Every process of a multi-process ``meshplan train`` run checks in here before
``jax.distributed.initialize`` (:func:`meet`): while some are missing, process 0
says every few seconds which ones it is waiting for, the others that they are
waiting for the coordinator; if they have not all met within the timeout, every
process raises a :class:`~meshplan.train.distributed.DistributedError` that names
who never joined and what to check (in flags: this is the command line's).
Left to itself, JAX would wait in silence and then abort the process from C++.

Also the command line's other plumbing of a worker process: the flags that name
a process group (:func:`process_group`), and native standard output sent to
``/dev/null`` (:func:`quiet_native_stdout`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import select
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from meshplan._errors import MeshplanError, error_for, problem_message
from meshplan.train.distributed import DistributedError, ProcessGroup

__all__ = ["meet", "parse_coordinator", "process_group", "quiet_native_stdout"]


def parse_coordinator(text: str) -> tuple[str, int]:
    """``"10.0.0.1:1234"`` -> ``("10.0.0.1", 1234)``.

    Example:
        >>> from meshplan.cli.train.rendezvous import parse_coordinator
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
        >>> from meshplan.cli.train.rendezvous import process_group
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


def quiet_native_stdout() -> None:
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


# ---------------------------------------------------------------------------
# Meeting at the coordinator: every process checks in before JAX starts
# ---------------------------------------------------------------------------
#
# JAX's own registration (``jax.distributed.initialize``) says nothing while it
# waits, cannot tell who is missing, and when its deadline passes its C++ client
# aborts the process (exit 134). So the processes first meet through a small
# exchange of JSON lines on the coordinator's port, which process 0 then hands to
# JAX's coordination service:
#
#   process i > 0 -> 0: {"meshplan": 1, "process_id": i, "num_processes": M}
#   0 -> process i:     {"waiting": [ids still missing]}  (whenever that changes)
#                       {"go": true}                      (all M have checked in)
#                       {"refused": "why"}                (a wrong id or process count)
#                       {"missing": [...], "waited": s}   (process 0 gave up)
#
# A process that has checked in closes its connection after "go", before process 0
# closes its side, so the port is left with no connection of process 0's in
# TIME_WAIT when JAX's service binds it.

_PROTOCOL = 1
_FIRST_REPORT, _REPORT_EVERY = 2.0, 5.0  # seconds before the first "waiting" line, between lines
_HELLO_SECONDS = 5.0  # a connection that sends no check-in within this is dropped
_GRACE_SECONDS = 1.5  # a process that has checked in waits this long past its deadline

Report = Callable[[str], None]


def _processes(ids: Sequence[int]) -> str:
    """``[1]`` -> ``'process 1'``; ``[1, 3]`` -> ``'processes 1, 3'``."""
    return ("process " if len(ids) == 1 else "processes ") + ", ".join(map(str, ids))


def _seconds(value: float) -> str:
    return f"{value:g} s"


def _what_to_check(group: ProcessGroup, timeout: float) -> str:
    host, port = parse_coordinator(group.coordinator)
    return (
        f"Check that every host runs the same meshplan train command with --coordinator "
        f"{group.coordinator} --num-processes {group.num_processes} and its own --process-id "
        f"(0..{group.num_processes - 1}); that {host} is process 0's host as the others reach it "
        f"(not a loopback address across hosts) and no firewall blocks TCP port {port}; that "
        f"--num-processes counts every process; or wait longer with --init-timeout SECONDS "
        f"(now {_seconds(timeout)})."
    )


def _never_joined(
    group: ProcessGroup,
    missing: Sequence[int],
    timeout: float,
    notes: Sequence[str] = (),
    left: Sequence[int] = (),
) -> MeshplanError:
    """The error of a process that gave up waiting for ``missing`` (``left``: joined, then left)."""
    never = [i for i in missing if i not in left]
    gone = [i for i in missing if i in left]
    there = [i for i in range(group.num_processes) if i not in missing]
    at = f"the run at the coordinator {group.coordinator}"
    if never:
        message = (
            f"{_processes(never).capitalize()} of {group.num_processes} never joined {at} "
            f"within {_seconds(timeout)}"
        )
    else:
        message = (
            f"Not every process of {group.num_processes} met at {at} within {_seconds(timeout)}"
        )
    message += f" (there: {_processes(there)}; this is process {group.process_id})"
    if gone:
        message += f"; {_processes(gone)} joined, then left (gave up waiting, or ended)"
    if notes:
        message += "; " + "; ".join(notes)
    return error_for(
        DistributedError,
        "peers-missing",
        "--coordinator",
        message,
        _what_to_check(group, timeout),
    )


def _unreachable(group: ProcessGroup, timeout: float, why: str) -> MeshplanError:
    return error_for(
        DistributedError,
        "coordinator-unreachable",
        "--coordinator",
        f"Process {group.process_id} of {group.num_processes} could not meet process 0 at the "
        f"coordinator {group.coordinator} within {_seconds(timeout)} ({why}); process 0 never "
        f"joined",
        "Start process 0 (--process-id 0) on the coordinator's host with the same --coordinator "
        "and --num-processes. " + _what_to_check(group, timeout),
    )


def _refused(group: ProcessGroup, why: str) -> MeshplanError:
    return error_for(
        DistributedError,
        "process-refused",
        "--coordinator",
        f"Process 0 at the coordinator {group.coordinator} turned this process away: {why}",
        f"Give every process the same --num-processes and its own --process-id in "
        f"0..{group.num_processes - 1}, each id once.",
    )


def _send(sock: socket.socket, message: dict[str, Any]) -> bool:
    """Sends one JSON line; ``False`` if the other end has gone."""
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError:
        return False
    return True


class _Lines:
    """The JSON lines arriving on a socket, read without blocking past a deadline."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buffer, self.closed = sock, b"", False

    def feed(self) -> None:
        """Reads what is there (call when the socket is readable)."""
        try:
            data = self.sock.recv(65536)
        except (TimeoutError, BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        self.closed = not data
        self.buffer += data

    def next(self) -> dict[str, Any] | None:
        """The next whole line as a dict; ``None`` if none yet. Raises ValueError on garbage."""
        line, newline, rest = self.buffer.partition(b"\n")
        if not newline:
            if len(self.buffer) > 65536:
                raise ValueError("no line")
            return None
        self.buffer = rest
        message = json.loads(line)
        if not isinstance(message, dict):
            raise ValueError("not an object")
        return message


class _Ticker:
    """Says a line after ``_FIRST_REPORT`` seconds, then every ``_REPORT_EVERY`` seconds."""

    def __init__(self, report: Report) -> None:
        self.report, self.next = report, time.monotonic() + _FIRST_REPORT

    def __call__(self, line: str) -> None:
        if time.monotonic() >= self.next:
            self.report(line)
            self.next = time.monotonic() + _REPORT_EVERY


def _listen(group: ProcessGroup) -> socket.socket:
    """Process 0's listening socket on the coordinator's port, on every address as JAX's."""
    _, port = parse_coordinator(group.coordinator)
    errors = []
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:
            errors.append(e)
            continue
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind((address, port))
            sock.listen(64)
        except OSError as e:
            sock.close()
            errors.append(e)
            if e.errno == errno.EADDRINUSE:
                break
            continue
        sock.setblocking(False)
        return sock
    why = errors[-1].strerror if errors and errors[-1].strerror else str(errors[-1])
    raise error_for(
        DistributedError,
        "coordinator-port-busy",
        "--coordinator",
        f"Process 0 cannot listen on port {port}, the port of --coordinator "
        f"{group.coordinator}: {why}",
        "Pick a free port on process 0's host (the same --coordinator on every process), or end "
        "what holds this one (a run still going there?).",
    )


def _host(group: ProcessGroup, timeout: float, report: Report) -> None:
    """Process 0: waits until every other process has checked in, then lets them all go."""
    deadline = time.monotonic() + timeout
    listener = _listen(group)
    everyone = range(1, group.num_processes)
    joined: dict[int, socket.socket] = {}
    pending: dict[socket.socket, tuple[_Lines, float, str]] = {}
    notes: list[str] = []
    left: set[int] = set()  # joined, then closed the connection
    tick = _Ticker(report)
    missing = list(everyone)

    def refuse(sock: socket.socket, why: str) -> None:
        notes.append(f"turned away {why}")
        _send(sock, {"refused": why})
        sock.close()

    try:
        changed = False
        while True:
            missing = [i for i in everyone if i not in joined]
            if changed:
                for sock in list(joined.values()):
                    _send(sock, {"waiting": missing})
                changed = False
            if not missing:
                break
            if time.monotonic() >= deadline:
                for sock in joined.values():
                    _send(sock, {"missing": missing, "waited": timeout})
                raise _never_joined(group, missing, timeout, notes, sorted(left))
            line = (
                f"waiting for {len(missing)} of {group.num_processes} processes "
                f"(coordinator {group.coordinator}): {_processes(missing)} "
                f"{'has' if len(missing) == 1 else 'have'} not joined"
            )
            tick("; ".join([line, *notes]))
            watched = [listener, *pending, *joined.values()]
            readable, _, _ = select.select(watched, [], [], 0.25)
            for sock in readable:
                if sock is listener:
                    with contextlib.suppress(BlockingIOError, InterruptedError):
                        conn, address = listener.accept()
                        conn.settimeout(2.0)
                        pending[conn] = (_Lines(conn), time.monotonic(), _host_of(address))
                elif sock in pending:
                    lines, _, address = pending[sock]
                    lines.feed()
                    try:
                        hello = lines.next()
                    except ValueError:
                        hello, lines.closed = None, True  # not one of ours: drop it
                    if hello is not None:
                        del pending[sock]
                        changed |= _check_in(group, hello, sock, address, joined, refuse)
                        left -= set(joined)
                    elif lines.closed:
                        del pending[sock]
                        sock.close()
                else:  # a process that had checked in: it has gone (or talks out of turn)
                    gone = next(i for i, s in joined.items() if s is sock)
                    lines = _Lines(sock)
                    lines.feed()
                    if lines.closed:
                        left.add(gone)
                        del joined[gone]
                        sock.close()
                        changed = True
            for sock, (_, since, _) in list(pending.items()):
                if time.monotonic() - since > _HELLO_SECONDS:
                    del pending[sock]
                    sock.close()
        for sock in joined.values():
            _send(sock, {"go": True})
        _wait_for_hangups(list(joined.values()), seconds=5.0)
    finally:
        for sock in [*joined.values(), *pending]:
            sock.close()
        listener.close()


def _host_of(address: Any) -> str:
    """The peer's IP address, IPv4 ones as such (not ``::ffff:10.0.0.2``)."""
    host = str(address[0])
    return host.removeprefix("::ffff:") if "." in host else host


def _check_in(
    group: ProcessGroup,
    hello: dict[str, Any],
    sock: socket.socket,
    address: str,
    joined: dict[int, socket.socket],
    refuse: Callable[[socket.socket, str], None],
) -> bool:
    """Takes in the process that sent ``hello``; ``True`` if it joined."""
    pid, count = hello.get("process_id"), hello.get("num_processes")
    if hello.get("meshplan") != _PROTOCOL or not isinstance(pid, int):
        sock.close()  # not a meshplan process of this version
        return False
    if count != group.num_processes:
        refuse(
            sock,
            f"process {pid} (from {address}): it has --num-processes {count}, "
            f"process 0 has {group.num_processes}",
        )
    elif not 0 < pid < group.num_processes:
        refuse(
            sock,
            f"a process from {address}: its --process-id {pid} is not one of "
            f"1..{group.num_processes - 1} (0 is process 0's own)",
        )
    elif pid in joined:
        refuse(sock, f"a second process {pid} (from {address}): process {pid} had joined already")
    else:
        joined[pid] = sock
        return True
    return False


def _wait_for_hangups(socks: list[socket.socket], seconds: float) -> None:
    """Waits until each socket's other end has closed (or ``seconds`` have passed)."""
    deadline = time.monotonic() + seconds
    while socks and time.monotonic() < deadline:
        readable, _, _ = select.select(socks, [], [], max(deadline - time.monotonic(), 0))
        for sock in readable:
            lines = _Lines(sock)
            lines.feed()
            if lines.closed:
                socks.remove(sock)


def _visit(group: ProcessGroup, timeout: float, report: Report) -> None:
    """Process ``i > 0``: checks in with process 0 and waits until it says go."""
    host, port = parse_coordinator(group.coordinator)
    host = host.strip("[]")
    deadline = time.monotonic() + timeout
    tick = _Ticker(report)
    why = "nothing answered"
    missing: list[int] | None = None  # what process 0 last said, once reached
    hello = {"meshplan": _PROTOCOL, "process_id": group.process_id}
    hello["num_processes"] = group.num_processes
    while time.monotonic() < deadline:
        left = deadline - time.monotonic()
        try:
            sock = socket.create_connection((host, port), timeout=min(2.0, max(left, 0.05)))
        except OSError as e:
            why = _connect_failure(e)
            tick(f"waiting for the coordinator {group.coordinator} ({why})")
            time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
            continue
        with sock:
            sock.settimeout(0.25)
            if not _send(sock, hello):
                continue
            lines = _Lines(sock)
            # Once in, wait a moment past the deadline for process 0's word on who is missing.
            while time.monotonic() < deadline + _GRACE_SECONDS and not lines.closed:
                if missing is None:
                    tick(f"waiting for the coordinator {group.coordinator} (connected)")
                else:
                    tick(
                        f"waiting for {len(missing)} of {group.num_processes} processes "
                        f"(coordinator {group.coordinator}): {_processes(missing)} "
                        f"{'has' if len(missing) == 1 else 'have'} not joined"
                    )
                lines.feed()
                try:
                    messages = _from_process_0(lines)
                except (ValueError, TypeError, KeyError):
                    why = "something else answered there, not meshplan's process 0"
                    missing = None
                    break
                for kind, value in messages:
                    if kind == "go":
                        return  # our side closes first (see above)
                    if kind == "refused":
                        raise _refused(group, str(value))
                    if kind == "missing":
                        ids, waited = value
                        raise _never_joined(group, ids, waited)
                    missing = list(value)
            else:
                if lines.closed:
                    why = "process 0 closed the connection"
                    missing = None
        time.sleep(min(0.5, max(deadline - time.monotonic(), 0)))
    if missing is not None:
        raise _never_joined(group, [*missing], timeout)
    raise _unreachable(group, timeout, why)


def _from_process_0(lines: _Lines) -> list[tuple[str, Any]]:
    """The whole messages received so far, checked: ``(kind, value)`` pairs.

    Raises:
        ValueError, TypeError, KeyError: what arrived is not what process 0 sends.
    """
    out: list[tuple[str, Any]] = []
    while (message := lines.next()) is not None:
        if message.get("go") is True:
            out.append(("go", None))
        elif "refused" in message:
            out.append(("refused", str(message["refused"])))
        elif "missing" in message:
            ids = [int(i) for i in message["missing"]]
            out.append(("missing", (ids, float(message["waited"]))))
        else:
            out.append(("waiting", [int(i) for i in message["waiting"]]))
    return out


def _connect_failure(error: OSError) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused: nothing listens there yet"
    if isinstance(error, TimeoutError):
        return "no answer: a firewall, or a host that is down"
    if isinstance(error, socket.gaierror):
        return f"unknown host: {error.strerror or error}"
    return error.strerror or str(error)


def meet(group: ProcessGroup, timeout_seconds: float, report: Report | None = None) -> None:
    """Waits until all ``group.num_processes`` processes have met at the coordinator.

    Process 0 listens on the coordinator's port; every other process connects
    to it and checks in. Both say who they are waiting for every few seconds
    (to ``report``, default standard error). JAX is not involved: call it
    before ``jax.distributed.initialize``, which then finds everyone there.

    Raises:
        DistributedError: not everyone met within ``timeout_seconds``, with
            ``problems[0].code`` ``'peers-missing'`` (naming who never joined),
            ``'coordinator-unreachable'`` (process 0 never answered),
            ``'process-refused'`` (a wrong process id or count) or
            ``'coordinator-port-busy'`` (process 0 cannot listen).

    Example:
        >>> from meshplan.cli.train.rendezvous import meet
        >>> from meshplan.train.distributed import ProcessGroup
        >>> meet(ProcessGroup("127.0.0.1:9876", 1, 0), timeout_seconds=5)  # no one to wait for
    """
    say = report or _say_on_stderr
    if group.num_processes < 2:
        return
    if group.process_id == 0:
        _host(group, timeout_seconds, say)
    else:
        _visit(group, timeout_seconds, say)


def _say_on_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
