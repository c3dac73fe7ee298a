"""``meshplan train``: the command, and the request it checks before any work starts.

The command line's front door for training: :mod:`meshplan.cli.app` runs ``HELP``,
``add_arguments`` and ``run``; Python callers build a :class:`TrainRequest` and
:func:`prepare` a trainer from it.
"""

from meshplan.cli.train.command import HELP, add_arguments, run
from meshplan.cli.train.request import PreparedRun, TrainRequest, prepare, prepare_run

__all__ = ["HELP", "PreparedRun", "TrainRequest", "add_arguments", "prepare", "prepare_run", "run"]
