"""Several worker processes on this machine, talking over loopback as hosts would.

:func:`launch` starts ``N`` copies of a command, each told its process id, the
process count and a coordinator address on a free loopback port, and each
given its share of the emulated CPU devices. Process 0 writes to this
process's standard output and error; the others' standard error goes to
temporary files, shown only when that worker fails.

SIGTERM or SIGINT (Ctrl-C) to the launcher is forwarded to every worker: they
stop together after the same step, finish the save in progress and release the
checkpoint folder's lock (see ``meshplan train``); the launcher waits for them
(up to :data:`_TERM_GRACE_SECONDS`, then kills what is left), says so, and exits
143 or 130, as one process does.

If a worker fails (a non-zero exit or a signal), the others would wait for it
forever in their next collective: the launcher stops them, names the worker
and how it ended, and returns non-zero. Workers are also killed by the kernel
if the launcher itself dies (``PR_SET_PDEATHSIG`` on Linux), so none is left
behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from rich.console import Console

from meshplan.cli.output import say as say_literally

__all__ = ["free_port", "launch", "worker_env"]

_GRACE_SECONDS = 3.0
"""How long the other workers get to end by themselves after one fails (e.g. bad input)."""


_TERM_GRACE_SECONDS = 300.0
"""How long workers get to finish the save in progress after a forwarded SIGTERM or SIGINT."""

_FORWARDED = (signal.SIGTERM, signal.SIGINT)
"""The signals the launcher forwards to its workers (then waits for them, as one process)."""


class _Terminated(Exception):
    """SIGTERM or SIGINT reached the launcher."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise _Terminated(signum)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (as of this call).

    Example:
        >>> from meshplan.cli.train.launch import free_port
        >>> 1024 <= free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker_env(local_devices: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker: ``base`` with ``local_devices`` emulated CPU devices.

    Any device count already in ``XLA_FLAGS`` is replaced: each worker has its share.

    Example:
        >>> from meshplan.cli.train.launch import worker_env
        >>> env = worker_env(4, {"XLA_FLAGS": "--xla_force_host_platform_device_count=8 --x=1"})
        >>> env["XLA_FLAGS"]
        '--x=1 --xla_force_host_platform_device_count=4'
    """
    env = dict(os.environ if base is None else base)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={local_devices}")
    env["XLA_FLAGS"] = " ".join(flags)
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    # No libc or no prctl: the worker runs without the parent-death signal.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(procs: Sequence[subprocess.Popen[bytes]], sig: int, wait: float) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(sig)
    deadline = time.monotonic() + wait
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))


def _stop_all(procs: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then SIGKILL for any still running 5 s later; waits for every one."""
    _stop(procs, signal.SIGTERM, 5.0)
    _stop(procs, signal.SIGKILL, 5.0)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])


def _say_on_stderr(message: str) -> None:
    say_literally(Console(stderr=True), message, soft_wrap=True)


def launch(
    argvs: Sequence[list[str]],
    local_devices: int,
    *,
    report: Callable[[str], None] | None = None,
) -> int:
    """Runs one worker per argv (worker ``i`` is process ``i``) until all have ended.

    Args:
        argvs: The command of each worker; each must already name its process
            id, the process count and the coordinator.
        local_devices: Emulated CPU devices of each worker.
        report: Where failure messages go (default: standard error).

    Returns:
        0 when every worker exits 0; the code the workers share when all fail
        alike (e.g. 2 for bad input, already explained by process 0); else the
        failed worker's code (1 if it was killed by a signal), after stopping
        the others and reporting which worker failed and how.
    """
    say = report or _say_on_stderr
    env = worker_env(local_devices)
    preexec = _die_with_parent if sys.platform.startswith("linux") else None
    procs: list[subprocess.Popen[bytes]] = []
    if threading.current_thread() is not threading.main_thread():
        return _launch(argvs, env, preexec, procs, say)
    previous = {sig: signal.signal(sig, _raise_terminated) for sig in _FORWARDED}
    try:
        return _launch(argvs, env, preexec, procs, say)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _launch(
    argvs: Sequence[list[str]],
    env: dict[str, str],
    preexec: Callable[[], None] | None,
    procs: list[subprocess.Popen[bytes]],
    say: Callable[[str], None],
) -> int:
    processes = len(argvs)
    with tempfile.TemporaryDirectory(prefix="meshplan-workers-") as logs:
        errs = [Path(logs) / f"process{i}.stderr" for i in range(processes)]
        try:
            for i in range(processes):
                if i == 0:
                    out, err = None, None  # process 0 speaks for the run
                else:
                    out, err = subprocess.DEVNULL, errs[i].open("wb")
                procs.append(
                    subprocess.Popen(
                        argvs[i],
                        stdout=out,
                        stderr=err,
                        stdin=subprocess.DEVNULL,
                        env=env,
                        preexec_fn=preexec,  # only sets the parent-death signal
                    )
                )
                if err is not None:
                    err.close()
            return _supervise(procs, errs, say)
        except _Terminated as e:
            for sig in _FORWARDED:  # a second one must not cut this short
                signal.signal(sig, signal.SIG_IGN)
            running = [i for i, p in enumerate(procs) if p.poll() is None]
            name = signal.Signals(e.signum).name
            say(
                f"meshplan: {name}: forwarded to the {len(running)} running worker"
                f"{'s' * (len(running) != 1)}; they stop after the same step and finish the "
                f"save in progress (waiting up to {_TERM_GRACE_SECONDS:g} s)."
            )
            # Ctrl-C at a terminal reached the workers too (one process group): a second
            # one is harmless, they stop after the same step either way.
            _stop(procs, e.signum, _TERM_GRACE_SECONDS)
            left = [i for i, p in enumerate(procs) if p.poll() is None]
            if left:
                say(
                    f"error: worker process{'es' * (len(left) > 1)} "
                    f"{', '.join(map(str, left))} did not stop within "
                    f"{_TERM_GRACE_SECONDS:g} s: killed. Continue with --resume (from the "
                    f"latest complete checkpoint)."
                )
            _stop_all(procs)
            return 128 + int(e.signum)
        finally:
            _stop_all(procs)


def _supervise(
    procs: Sequence[subprocess.Popen[bytes]], errs: Sequence[Path], say: Callable[[str], None]
) -> int:
    while True:
        codes = [p.poll() for p in procs]
        if all(c == 0 for c in codes):
            return 0
        failed = next((i for i, c in enumerate(codes) if c not in (None, 0)), None)
        if failed is None:
            time.sleep(0.1)
            continue
        deadline = time.monotonic() + _GRACE_SECONDS
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        codes = [p.poll() for p in procs]
        if len(set(codes)) == 1 and codes[0] is not None and codes[0] > 0:
            return int(codes[0])  # all failed alike: process 0 has said why
        exited = codes[failed]
        assert exited is not None  # process `failed` had exited, and poll() keeps its code
        code = int(exited)
        running = [i for i, c in enumerate(codes) if c is None]
        _stop_all(procs)
        lines = [
            f"error: worker process {failed} of {len(procs)} {_how_it_ended(code)}; "
            + (
                f"stopped the other{'s' if len(running) > 1 else ''} "
                f"(process{'es' if len(running) > 1 else ''} {', '.join(map(str, running))})."
                if running
                else "the others have ended too."
            )
        ]
        if failed != 0 and (tail := _tail(errs[failed])):
            lines.append(f"Last lines of process {failed}'s standard error:\n{tail}")
        lines.append(
            "The run stopped; with --ckpt-dir, continue it from the latest complete "
            "checkpoint with --resume (any number of processes)."
        )
        say("\n".join(lines))
        return code if code > 0 else 1
