"""The ``meshplan`` command line: one subcommand per module of :mod:`meshplan.cli`.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their command runs, so
``meshplan --help`` stays fast, and nothing touches JAX's backend before
:func:`meshplan.cli.devices.use_cpu_devices` has set the device count.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Protocol, cast

COMMANDS = {
    "demo": "meshplan.cli.demo",
    "plan": "meshplan.cli.plan",
    "search": "meshplan.cli.search",
    "train": "meshplan.cli.train",
    "sample": "meshplan.cli.sample",
}


class Command(Protocol):
    """What each subcommand module defines (see the module docstring)."""

    HELP: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


def _available() -> dict[str, Command]:
    modules: dict[str, Command] = {}
    for name, module_name in COMMANDS.items():
        try:
            # import_module is typed as returning a bare ModuleType; every module of
            # COMMANDS defines HELP, add_arguments and run, as the module docstring says.
            modules[name] = cast(Command, importlib.import_module(module_name))
        except ModuleNotFoundError as e:
            if e.name != module_name:
                raise
    return modules


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every available subcommand."""
    parser = argparse.ArgumentParser(
        prog="meshplan", description="Lay Flax models out on device meshes.", allow_abbrev=False
    )
    from meshplan._version import __version__

    parser.add_argument("--version", action="version", version=f"meshplan {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in _available().items():
        # No abbreviations: `--step 15` must not be read as `--steps 15`.
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False)
        module.add_arguments(p)
        p.set_defaults(_run=module.run, _parser=p)
    return parser


def _unknown(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``unrecognized arguments: ...``, with the nearest option of the command for each.

    Example:
        >>> import argparse
        >>> from meshplan.cli.app import _unknown
        >>> p = argparse.ArgumentParser(prog="meshplan train")
        >>> _ = p.add_argument("--resume-step"); _ = p.add_argument("--steps")
        >>> _unknown(p, ["--step", "15"])
        'unrecognized arguments: --step 15 (did you mean --steps or --resume-step?)'
    """
    import difflib

    options = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if name.startswith("--"):
            core = name.lstrip("-")
            starts = [o for o in options if o.startswith(name) and o != name]  # --steps
            parts = sorted(  # --resume-step for --step: one of its words, shortest first
                (o for o in options if core in o.lstrip("-").split("-")), key=len
            )
            fuzzy = difflib.get_close_matches(name, options, n=3, cutoff=0.6)
            close = list(dict.fromkeys(starts + parts + fuzzy))[:2]
            if close:
                hints.append(f"did you mean {' or '.join(close)}?")
    hint = f" ({'; '.join(dict.fromkeys(hints))})" if hints else ""
    return f"unrecognized arguments: {' '.join(extras)}{hint}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshplan`` console script.

    Options are never abbreviated (``--step`` is not ``--steps``). A meshplan
    error that a command does not report itself is printed as ``error: ...``
    (exit status 2), never as a traceback.
    """
    closed = _closed_stream()
    if closed is not None:
        return closed
    for stream in (sys.stdout, sys.stderr):  # text the terminal cannot show: replaced, not fatal
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None and getattr(stream, "errors", "strict") == "strict":
            reconfigure(errors="replace")
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, extras = parser.parse_known_args(given)
    if args.command is None:  # a bare `meshplan`: what it can do, not an error
        parser.print_help()
        return 0
    args._argv = given  # a command may repeat the user's flags in the fix it suggests
    if extras:  # the command's own usage and a hint, not the top-level usage
        args._parser.error(_unknown(args._parser, extras))
    from meshplan._errors import MeshplanError  # after parsing: `--help` stays fast
    from meshplan.cli.output import print_error

    try:
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a full disk under a redirected stdout shows here, not at exit
        return code
    except MeshplanError as e:
        print_error(e)
        return 2
    except OSError as e:
        if not _is_stdout_error(e):
            raise
        return _stdout_failed(e)


def _closed_stream() -> int | None:
    """Exit status 2, with a message where one can be shown, when stdout or stderr is closed.

    ``meshplan plan >&-`` starts Python with ``sys.stdout`` set to ``None``.
    """
    if sys.stdout is not None and sys.stderr is not None:
        return None
    which = "standard output" if sys.stdout is None else "standard error"
    message = (
        f"error: meshplan: {which} is closed (e.g. run with '>&-'), so nothing could be "
        f"printed.\nRun it with {which} open, or send it to a file or to /dev/null "
        f"(> /dev/null).\n"
    )
    for stream in (sys.stderr, sys.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.write(message)
                stream.flush()
    return 2


def _is_stdout_error(e: OSError) -> bool:
    """Whether ``e`` came from writing standard output: a full disk, with no file name.

    The commands turn their own files' failures (checkpoints, ``--metrics``, ``--png``)
    into meshplan errors; what is left with no file name is a stream they print to.
    """
    return e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EFBIG) and not e.filename


def _stdout_failed(e: OSError) -> int:
    """Exit status 1 after standard output could not be written (a full disk): said on stderr."""
    with contextlib.suppress(OSError):  # what is still buffered goes nowhere, quietly at exit
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    name = errno.errorcode.get(e.errno or 0, "")
    with contextlib.suppress(OSError):
        sys.stderr.write(
            f"error: meshplan: writing its output failed: {os.strerror(e.errno or 0)} ({name}); "
            f"what was printed is incomplete.\nFree space on the disk that standard output "
            f"goes to, or send it elsewhere (> /other/disk/file).\n"
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
