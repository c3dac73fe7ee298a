"""``meshplan train``: the command, and the request it checks before any work starts.

The command line's front door for training: :mod:`meshplan.cli.app` runs ``HELP``,
``add_arguments`` and ``run``; Python callers build a :class:`TrainRequest` and
:func:`prepare` a trainer from it (:func:`prepare_run`: with the source the command
describes). Every model source (:class:`ModelSource`) goes through the same
:func:`prepare_run`. :func:`checked_request` reads a parsed command line as ``run`` does.
"""

from meshplan.cli.train.command import HELP, add_arguments, checked_request, run
from meshplan.cli.train.prepare import PreparedRun, prepare, prepare_run
from meshplan.cli.train.request import TrainRequest
from meshplan.cli.train.source import ModelSource

__all__ = [
    "HELP",
    "ModelSource",
    "PreparedRun",
    "TrainRequest",
    "add_arguments",
    "checked_request",
    "prepare",
    "prepare_run",
    "run",
]
