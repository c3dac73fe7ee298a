"""The ``meshplan`` command line: :func:`main` parses the arguments and runs one command."""

from meshplan.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
