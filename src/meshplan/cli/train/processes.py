"""``meshplan train`` over several processes: ``--processes N`` here, or one process per host.

``--processes N`` starts N workers of the same command on this machine, each
with ``--devices / N`` emulated CPU devices, joined through a coordinator on a
free loopback port (:mod:`meshplan.cli.train.launch`). On several hosts, the user runs
the same command on each with ``--coordinator HOST:PORT --num-processes N
--process-id I``, which is also what each launched worker is given.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, NoReturn

from rich.console import Console

from meshplan._errors import MeshplanError, error_for, problem_message
from meshplan.cli.output import print_error, say
from meshplan.cli.train.flags import MODEL_FLAGS, SETTINGS_FLAGS, flag
from meshplan.cli.train.launch import free_port, launch
from meshplan.cli.train.rendezvous import meet, process_group, quiet_native_stdout
from meshplan.train.distributed import (
    DEFAULT_INIT_TIMEOUT,
    DistributedError,
    ProcessGroup,
    StopVote,
    join,
)

__all__ = ["StopOnSigterm", "Terminated", "join_if_asked", "launch_workers", "worker_argv"]


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``meshplan train`` flags of ``args``, less the ones that pick processes and devices.

    Example:
        >>> from meshplan.cli import build_parser
        >>> from meshplan.cli.train.processes import worker_argv
        >>> args = build_parser().parse_args(["train", "--processes", "2", "--steps", "5",
        ...                                   "--no-scan", "--ckpt-dir", "/tmp/run",
        ...                                   "--model", "transformer-nnx"])
        >>> worker_argv(args)  # doctest: +NORMALIZE_WHITESPACE
        ['--mesh', '2x4', '--rules', 'fsdp_tp', '--ckpt-dir', '/tmp/run', '--model',
         'transformer-nnx', '--steps', '5', '--no-scan']
        >>> worker_argv(build_parser().parse_args(["train", "--mesh", "2x2x2", "--axes",
        ...                                        "data,fsdp,tensor", "--rules", "r.json"]))
        ['--mesh', '2x2x2', '--rules', 'r.json', '--axes', 'data,fsdp,tensor']
    """
    out = ["--mesh", str(args.mesh), "--rules", str(args.rules)]
    if getattr(args, "axes", None) is not None:
        out += ["--axes", str(args.axes)]
    for dest in (
        "data",
        "ckpt_dir",
        "metrics",
        "model",
        "config",
        "resume_step",
        *SETTINGS_FLAGS,
        *MODEL_FLAGS,
    ):
        value = getattr(args, dest, None)
        if value is not None:
            out += [flag(dest), str(value)]
    init_timeout = getattr(args, "init_timeout", None)
    if init_timeout is not None:
        out += ["--init-timeout", str(init_timeout)]
    if args.resume:
        out.append("--resume")
    if args.scan_layers is False:
        out.append("--no-scan")
    if args.remat:
        out += ["--remat", str(args.remat)]
    return out


def _ids(num_processes: int, process_id: int) -> list[str]:
    return ["--num-processes", str(num_processes), "--process-id", str(process_id)]


def _check_launch(args: argparse.Namespace) -> list[str]:
    problems = []
    if args.processes < 1:
        problems.append(f"--processes must be at least 1, got {args.processes}")
    elif args.devices % args.processes:
        problems.append(
            f"--devices {args.devices} does not split over --processes {args.processes}"
        )
    init_timeout = getattr(args, "init_timeout", None)
    if init_timeout is not None and not init_timeout > 0:  # also refuses NaN
        problems.append(f"--init-timeout must be a positive number of seconds, got {init_timeout}")
    given = [
        f for f in ("coordinator", "num_processes", "process_id") if getattr(args, f) is not None
    ]
    if given:
        problems.append(
            f"--processes starts the processes itself; {', '.join(map(flag, given))} "
            f"are for running one process per host"
        )
    return problems


def launch_workers(args: argparse.Namespace) -> int:
    """Runs ``args.processes`` workers on this machine; their exit status (see :func:`launch`)."""
    problems = _check_launch(args)
    if problems:
        print_error(
            DistributedError(
                problem_message(
                    "meshplan train cannot start:",
                    problems,
                    "Give --processes N with --devices a multiple of N (each process gets "
                    "--devices / N), and no --coordinator/--num-processes/--process-id.",
                )
            )
        )
        return 2
    n, local = args.processes, args.devices // args.processes
    coordinator = f"127.0.0.1:{free_port()}"
    base = [sys.executable, "-m", "meshplan.cli", "train", *worker_argv(args)]
    argvs = [
        [*base, "--devices", str(local), "--coordinator", coordinator, *_ids(n, i)]
        for i in range(n)
    ]
    say(
        Console(),
        f"meshplan train: {n} processes on this machine, {local} CPU devices each, "
        f"coordinator {coordinator}; showing process 0's output",
        soft_wrap=True,
    )
    return launch(argvs, local)


def _say_waiting(line: str) -> None:
    say(Console(stderr=True), line, soft_wrap=True)


INIT_FAILED_EXIT_CODE = 2
"""The exit status of a process that gives up joining (as for any refused input)."""

_INIT_FAILED_FIX = (
    "Start every process with the same --coordinator and --num-processes, and a "
    "--coordinator port that process 0 can listen on and the others reach."
)
"""Flag-level advice for the library's ``'init-failed'`` (its own fix names no flags)."""


def _give_up(error: MeshplanError) -> NoReturn:
    """Prints ``error`` and ends the process at once: JAX's threads must not keep it alive."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        print_error(error)
        sys.stderr.flush()
    os._exit(INIT_FAILED_EXIT_CODE)


def _stuck_after_meeting(group: ProcessGroup) -> Callable[[MeshplanError], None]:
    """What to do when JAX's start hangs once everyone met: say so, then end the process."""

    def give_up(error: MeshplanError) -> None:
        problem = error.problems[0]
        message = (
            f"All {group.num_processes} processes met at the coordinator {group.coordinator}, "
            f"but {problem.message}"
        )
        _give_up(error_for(DistributedError, problem.code, problem.path, message, problem.fix))

    return give_up


def join_if_asked(args: argparse.Namespace) -> ProcessGroup | None:
    """Joins the multi-process run the flags describe (before JAX starts); ``None`` if none.

    The processes first meet at the coordinator (:func:`~meshplan.cli.train.rendezvous.meet`):
    while some are missing, says who every few seconds on standard error; gives up
    after ``--init-timeout`` seconds (default
    :data:`~meshplan.train.distributed.DEFAULT_INIT_TIMEOUT`, as JAX). What native
    code prints to standard output (Gloo's lines) goes to ``/dev/null``; a JAX start
    that hangs after the meeting ends the process (exit status 2), saying why.

    Raises:
        DistributedError: the flags do not fit together, or the processes did
            not all meet at the coordinator in time (naming who never joined).
    """
    group = process_group(args.coordinator, args.num_processes, args.process_id)
    timeout = getattr(args, "init_timeout", None)
    if group is None:
        if timeout is not None:
            raise error_for(
                DistributedError,
                "init-timeout-alone",
                "--init-timeout",
                f"--init-timeout {timeout:g} is for a run of several processes, and this is one",
                "Give it with --coordinator/--num-processes/--process-id or --processes, "
                "or leave it out.",
            )
        return None
    if timeout is None:
        timeout = DEFAULT_INIT_TIMEOUT
    elif not timeout > 0:  # also refuses NaN
        raise error_for(
            DistributedError,
            "bad-init-timeout",
            "--init-timeout",
            f"--init-timeout must be a positive number of seconds, got {timeout}",
            f"Give --init-timeout SECONDS, e.g. {DEFAULT_INIT_TIMEOUT} (JAX's default).",
        )
    if group.num_processes > 1:
        quiet_native_stdout()
    meet(group, timeout, _say_waiting)
    try:
        join(group, timeout, on_stuck=_stuck_after_meeting(group))
    except DistributedError as e:
        problem = e.problems[0] if e.problems else None
        if problem is None or problem.code != "init-failed":
            raise
        raise error_for(
            DistributedError, problem.code, problem.path, problem.message, _INIT_FAILED_FIX
        ) from e
    return group


class Terminated(Exception):
    """SIGTERM or SIGINT arrived: the run stops at the end of the current step.

    Attributes:
        signum: The signal that stopped the run (the first one that arrived).
    """

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """What the process exits with, as the shell would for that signal (143, 130)."""
        return 128 + int(self.signum)


class StopOnSigterm(contextlib.AbstractContextManager["StopOnSigterm", None]):
    """While active, SIGTERM or SIGINT (Ctrl-C) asks the run to stop after the current step.

    The handler only records the request: nothing is raised inside whatever the
    main thread runs at that moment (a save, or a callback of JAX's, which would
    swallow it as "Exception ignored"); :meth:`check` raises :class:`Terminated`
    between steps. One process: a second signal raises at once (and, if that is
    swallowed, the next check raises). Several processes (``--processes N``, whose
    launcher forwards the signal, or one per host): a signal to any of them stops
    all of them after the same step (:class:`~meshplan.train.distributed.StopVote`),
    so that they finish the save in progress together and the folder's lock is
    released. Only in the main thread.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.enabled = threading.current_thread() is threading.main_thread()
        self.vote = StopVote()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def asked(self) -> bool:
        return self.vote.asked

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
        if self.vote.asked and self.vote.processes == 1:
            raise Terminated(self.signum)
        self.vote.ask()

    def check(self, step: int | None = None) -> None:
        """Raises :class:`Terminated` when the run stops now (after ``step``, when given)."""
        signum = signal.SIGTERM if self.signum is None else self.signum
        if step is None:
            if self.vote.processes == 1 and self.vote.asked:
                raise Terminated(signum)
            return
        if self.vote.after(step):
            raise Terminated(signum)

    def __enter__(self) -> StopOnSigterm:
        if self.enabled:
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            for sig, previous in self._previous.items():
                signal.signal(sig, previous)
