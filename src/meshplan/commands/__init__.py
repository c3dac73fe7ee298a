"""Subcommands of the ``meshplan`` command line (see :mod:`meshplan.cli`)."""
