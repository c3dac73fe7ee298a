"""The ``meshplan`` command line: one subcommand per module of :mod:`meshplan.cli`.

Each subcommand module defines ``HELP`` (one line), ``add_arguments(parser)`` and
``run(args) -> int``. Modules are imported only when their command runs, so
``meshplan --help`` stays fast, and nothing touches JAX's backend before
:func:`meshplan.cli.devices.use_cpu_devices` has set the device count.
"""

from __future__ import annotations

import argparse
import importlib
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
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in _available().items():
        # No abbreviations: `--step 15` must not be read as `--steps 15`.
        p = sub.add_parser(name, help=module.HELP, description=module.HELP, allow_abbrev=False)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``meshplan`` console script.

    Options are never abbreviated (``--step`` is not ``--steps``). A meshplan
    error that a command does not report itself is printed as ``error: ...``
    (exit status 2), never as a traceback.
    """
    args = build_parser().parse_args(argv)
    from meshplan._errors import MeshplanError  # after parsing: `--help` stays fast
    from meshplan.cli.output import print_error

    try:
        return int(args._run(args) or 0)
    except MeshplanError as e:
        print_error(e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
