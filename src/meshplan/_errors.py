"""Every exception meshplan raises, in one place.

All of them derive from :class:`MeshplanError`, and those about bad input also
derive from :class:`ValueError` (or :class:`TypeError`), so code written for
Flax's own errors keeps catching them.

Messages follow one form: what is wrong (with the parameter path, the names,
sizes and rules involved), one bullet per problem, then how to fix it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, TypeAlias

import flax.errors

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "LogicalNamesError",
    "MeshError",
    "MeshplanError",
    "Note",
    "PartitioningUnspecifiedError",
    "Problem",
    "RulesError",
    "Severity",
    "ShardingValidationError",
    "UnmatchedLogicalAxisError",
]


Severity: TypeAlias = Literal["error", "warning", "info"]
"""How bad a :class:`Problem` is (its ``severity``)."""


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem with a sharding plan.

    Attributes:
        severity: ``'error'`` (``jax.jit`` would fail, or the plan is not
            what was written), ``'warning'`` (valid, but probably not meant:
            memory spent on replication, rules that do nothing) or ``'info'``
            (worth knowing, e.g. fewer names than dimensions: the rest unsharded).
        path: Where: a leaf path (``'params/Dense_0/kernel'``), ``'rules[2]'``,
            ``'rules'`` or ``'mesh/data'``.
        message: What is wrong, with the names, sizes and axes involved.
        fix: How to fix it.
        code: A stable identifier of the kind of problem (see ``docs/plan.md``).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((6,), jnp.float32), ("x",))}
        >>> problem = meshplan.explain(tree, {"x": 4}).problems[0]
        >>> problem.severity, problem.path, problem.code
        ('error', 'w', 'indivisible')
        >>> print(problem)
        error: w: dim 0 of size 6 does not divide by 4 (mesh axis 'x' of size 4). Pad dim 0
        to 8 (the nearest multiple of 4), or map it to mesh axes whose size divides 6.
    """

    severity: Severity
    path: str
    message: str
    fix: str
    code: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.message}. {self.fix}"

    def to_dict(self) -> dict[str, str]:
        """``{'severity', 'code', 'path', 'message', 'fix'}``.

        Example:
            >>> import meshplan
            >>> problem = meshplan.Problem(
            ...     "warning", "mesh/data", "mesh axis 'data' shards no array",
            ...     "Map a logical name to 'data'.", "idle-axis")
            >>> problem.to_dict()
            {'severity': 'warning', 'code': 'idle-axis', 'path': 'mesh/data',
             'message': "mesh axis 'data' shards no array", 'fix': "Map a logical name to 'data'."}
        """
        return {
            "severity": self.severity,
            "code": self.code,
            "path": self.path,
            "message": self.message,
            "fix": self.fix,
        }


class Note(str):
    """A sentence for the user (e.g. one of :attr:`Trainer.notes`), with a code and its fields.

    It is the sentence itself (a ``str``): ``template`` with each ``{slot}`` replaced
    by ``words[slot]``, meshplan's words. A caller, e.g. the command line, words it
    in its own terms from ``code``, ``fields`` and ``template``.

    * ``'valid-setting-changed'``: fields ``step`` (the checkpoint's) and
      ``changes`` (:func:`valid_changes`); slot ``{changed}``.
    * ``'steps-set-aside'``: fields ``steps``, ``folder``, ``step`` and ``moved_to``;
      slot ``{resume}``.
    * ``'damaged-step-moved'``: fields ``step``, ``folder``, ``moved_to`` and ``why``.

    Example:
        >>> from meshplan._errors import Note
        >>> note = Note("Hello {who}.", "greeting", {"to": "you"}, {"who": "you"})
        >>> note, note.code, note.fields, note.template
        ('Hello you.', 'greeting', {'to': 'you'}, 'Hello {who}.')
    """

    code: str
    fields: dict[str, Any]
    template: str

    def __new__(
        cls,
        template: str,
        code: str,
        fields: Mapping[str, object] | None = None,
        words: Mapping[str, str] | None = None,
    ) -> Note:
        text = template
        for slot, word in (words or {}).items():
            text = text.replace("{" + slot + "}", word)
        note = super().__new__(cls, text)
        note.code, note.fields, note.template = code, dict(fields or {}), template
        return note


class MeshplanError(Exception):
    """Base class of every error meshplan raises.

    Attributes:
        problems: The structured :class:`Problem` records behind the message, when the
            error was built from them (callers read these, never the message's text).
    """

    def __init__(self, message: str = "", problems: Iterable[Problem] = ()) -> None:
        super().__init__(message)
        self.problems: list[Problem] = list(problems)


class ArgumentError(MeshplanError, TypeError):
    """An argument of the wrong kind, e.g. ``with_partitioning(names, fn)`` with the two swapped."""


class RulesError(MeshplanError, ValueError):
    """Logical axis rules that are not an ordered sequence of ``(name, mesh_axes)`` pairs."""


class LogicalNamesError(MeshplanError, ValueError):
    """Axis names that cannot describe the array: duplicated, wrong type or wrong rank."""


class MeshError(MeshplanError, ValueError):
    """No mesh where one is needed, a mesh axis the mesh lacks, or mixed axis types."""


class UnmatchedLogicalAxisError(MeshplanError, ValueError):
    """A logical name matched no rule under ``RulesFallback.RAISE_ERROR``."""


class PartitioningUnspecifiedError(
    MeshplanError, ValueError, flax.errors.PartitioningUnspecifiedError
):
    """``nn.scan``/``nn.vmap`` added an axis to a box without naming it.

    A subclass of Flax's own ``flax.errors.PartitioningUnspecifiedError``, so code
    that catches Flax's error catches meshplan's too.
    """

    def __init__(self, message: str = "", problems: Iterable[Problem] = ()) -> None:
        MeshplanError.__init__(self, message, problems)


class ShardingValidationError(MeshplanError, ValueError):
    """``check(..., strict=True)`` found errors in a sharding plan; lists them all.

    ``error.problems`` holds every :class:`Problem` found, warnings included.
    """


class CheckpointError(MeshplanError, ValueError):
    """A checkpoint that is missing, incomplete, or does not fit the requested model."""


def bullets(lines: Iterable[str]) -> str:
    """Formats one problem per line, as JAX's ``shard_map`` errors do."""
    return "\n".join(f"  * {line}" for line in lines)


def problem_message(header: str, problems: Iterable[str], fix: str) -> str:
    """``header``, one bullet per problem, then the fix on its own line."""
    return f"{header}\n{bullets(problems)}\n{fix}"


def error_from_problems(
    error: type[MeshplanError], header: str, problems: Sequence[Problem]
) -> MeshplanError:
    """One error listing ``problems`` (one bullet per path), their fixes at the end.

    Example:
        >>> import meshplan
        >>> from meshplan._errors import error_from_problems
        >>> p = meshplan.Problem("error", "w", "mesh axis 'x' is missing", "Add it.", "unknown-axis")
        >>> e = error_from_problems(meshplan.MeshError, "Cannot shard:", [p])
        >>> print(e)
        Cannot shard:
          * w: mesh axis 'x' is missing
        Add it.
        >>> e.problems[0].code
        'unknown-axis'
    """
    fixes = list(dict.fromkeys(p.fix for p in problems if p.fix))
    fix = fixes[0] if len(fixes) == 1 else "To fix:\n" + "\n".join(f"  - {f}" for f in fixes)
    lines = [f"{p.path}: {p.message}" if p.path else p.message for p in problems]
    return error(problem_message(header, lines, fix), problems)


def error_for(
    error: type[MeshplanError], code: str, path: str, message: str, fix: str
) -> MeshplanError:
    """An error about one thing: ``message.`` then ``fix`` on its own line, with its :class:`Problem`.

    Callers (the command line) read ``error.problems[0].code`` to give their own advice.

    Example:
        >>> import meshplan
        >>> from meshplan._errors import error_for
        >>> e = error_for(meshplan.CheckpointError, "ckpt-missing", "/tmp/run",
        ...               "No checkpoint folder at '/tmp/run'", "Save one there first.")
        >>> print(e)
        No checkpoint folder at '/tmp/run'.
        Save one there first.
        >>> e.problems[0].code
        'ckpt-missing'
    """
    return error(f"{message}.\n{fix}", [Problem("error", path, message, fix, code)])
