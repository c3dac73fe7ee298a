"""Processes meeting at the coordinator before JAX starts (``meshplan.cli.train.rendezvous.meet``).

Each process runs in a thread of this test over loopback: no JAX, so each case
takes about its timeout. The same with real ``meshplan train`` processes, and
JAX's own start, is in ``tests/train/test_multiprocess.py``.
"""

from __future__ import annotations

import threading
import time

import pytest

from meshplan.cli.app import build_parser
from meshplan.cli.train import processes as train_processes
from meshplan.cli.train import rendezvous
from meshplan.cli.train.launch import free_port
from meshplan.cli.train.rendezvous import meet
from meshplan.train import distributed
from meshplan.train.distributed import DistributedError, ProcessGroup


@pytest.fixture(autouse=True)
def _report_soon(monkeypatch):
    monkeypatch.setattr(rendezvous, "_FIRST_REPORT", 0.2)
    monkeypatch.setattr(rendezvous, "_REPORT_EVERY", 0.5)


class Process(threading.Thread):
    """``meet`` in a thread: what it said, and the error it raised (``None`` if it met all)."""

    def __init__(self, coordinator: str, num: int, pid: int, timeout: float) -> None:
        super().__init__(daemon=True)
        self.group = ProcessGroup(coordinator, num, pid)
        self.timeout, self.lines = timeout, []
        self.error: DistributedError | None = None
        self.seconds = 0.0

    def run(self) -> None:
        start = time.monotonic()
        try:
            meet(self.group, self.timeout, self.lines.append)
        except DistributedError as e:
            self.error = e
        self.seconds = time.monotonic() - start

    def code(self) -> str | None:
        return None if self.error is None else self.error.problems[0].code


def _start(*processes: Process) -> list[Process]:
    for p in processes:
        p.start()
        time.sleep(0.05)
    for p in processes:
        p.join(30)
        assert not p.is_alive()
    return list(processes)


@pytest.fixture
def coordinator() -> str:
    return f"127.0.0.1:{free_port()}"


def test_everyone_meets_and_goes(coordinator):
    # Process 0 comes last: the others wait for it, then all go at once.
    one, two = Process(coordinator, 3, 1, 10), Process(coordinator, 3, 2, 10)
    one.start(), two.start()
    time.sleep(0.5)
    zero = Process(coordinator, 3, 0, 10)
    _start(zero)
    one.join(10), two.join(10)
    assert [p.error for p in (zero, one, two)] == [None, None, None]
    assert zero.seconds < 3
    assert any(f"waiting for the coordinator {coordinator}" in line for line in one.lines)


def test_process_0_alone_names_who_never_joined(coordinator):
    (zero,) = _start(Process(coordinator, 3, 0, 1.5))
    assert zero.code() == "peers-missing" and 1.4 < zero.seconds < 4
    assert f"waiting for 2 of 3 processes (coordinator {coordinator})" in zero.lines[0]
    assert "processes 1, 2 have not joined" in zero.lines[0]
    message = str(zero.error)
    assert message.startswith(
        f"Processes 1, 2 of 3 never joined the run at the coordinator {coordinator} within 1.5 s"
    )
    for hint in ("--num-processes 3", "firewall", "--init-timeout", "--process-id (0..2)"):
        assert hint in message


def test_a_process_without_its_coordinator_says_so(coordinator):
    (one,) = _start(Process(coordinator, 2, 1, 1.5))
    assert one.code() == "coordinator-unreachable" and one.seconds < 5
    assert one.lines[0].startswith(f"waiting for the coordinator {coordinator} (")
    message = str(one.error)
    assert f"Process 1 of 2 could not meet process 0 at the coordinator {coordinator}" in message
    assert "connection refused" in message and "Start process 0 (--process-id 0)" in message


@pytest.mark.slow
def test_every_process_that_came_names_the_one_missing(coordinator):
    zero, two = _start(Process(coordinator, 3, 0, 2), Process(coordinator, 3, 2, 2))
    for p in (zero, two):
        assert p.code() == "peers-missing", p.error
        assert str(p.error).startswith("Process 1 of 3 never joined the run at the coordinator")
        assert f"(there: processes 0, 2; this is process {p.group.process_id})" in str(p.error)
    assert any("waiting for 1 of 3 processes" in line for line in two.lines)


@pytest.mark.slow
def test_a_process_with_another_count_is_turned_away(coordinator):
    zero = Process(coordinator, 2, 0, 2)
    zero.start()
    time.sleep(0.2)
    (stray,) = _start(Process(coordinator, 3, 1, 5))
    zero.join(10)
    assert stray.code() == "process-refused" and stray.seconds < 2
    assert "it has --num-processes 3, process 0 has 2" in str(stray.error)
    assert zero.code() == "peers-missing"
    assert "turned away process 1 (from 127.0.0.1): it has --num-processes 3" in str(zero.error)


@pytest.mark.slow
def test_a_second_process_with_the_same_id_is_turned_away(coordinator):
    zero, first = Process(coordinator, 3, 0, 3), Process(coordinator, 3, 1, 3)
    zero.start()
    time.sleep(0.3)  # process 0 listens: the first process 1 gets in at once
    first.start()
    time.sleep(1.0)
    (second,) = _start(Process(coordinator, 3, 1, 5))
    zero.join(10), first.join(10)
    assert second.code() == "process-refused"
    assert "process 1 had joined already" in str(second.error)
    assert "Process 2 of 3 never joined" in str(zero.error)


def test_process_0_cannot_listen_on_a_busy_port():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (zero,) = _start(Process(f"127.0.0.1:{port}", 2, 0, 5))
    assert zero.code() == "coordinator-port-busy" and zero.seconds < 1
    assert f"Process 0 cannot listen on port {port}" in str(zero.error)


def test_something_else_on_the_port_is_not_taken_for_process_0():
    import socket

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]

        def answer() -> None:
            while True:
                try:
                    conn, _ = other.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        (one,) = _start(Process(f"127.0.0.1:{port}", 2, 1, 1.5))
    assert one.code() == "coordinator-unreachable"
    assert "something else answered there, not meshplan's process 0" in str(one.error)


def test_one_process_meets_no_one():
    start = time.monotonic()
    meet(ProcessGroup("127.0.0.1:1", 1, 0), 1)
    assert time.monotonic() - start < 0.1


def test_join_refuses_a_timeout_that_is_not_positive():
    for bad in (0, -5, float("nan")):
        with pytest.raises(
            DistributedError, match=r"timeout_seconds=\.\.\.\) must be a positive"
        ) as e:
            distributed.join(ProcessGroup("127.0.0.1:1", 2, 0), bad)
        assert e.value.problems[0].code == "bad-init-timeout"
        assert "--" not in str(e.value)  # the library names no flags


def test_the_command_line_refuses_an_init_timeout_that_is_not_positive():
    argv = ["train", "--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0"]
    for bad in ("0", "-5", "nan"):
        args = build_parser().parse_args([*argv, "--init-timeout", bad])
        with pytest.raises(DistributedError, match="--init-timeout must be a positive") as e:
            train_processes.join_if_asked(args)
        assert e.value.problems[0].code == "bad-init-timeout"
