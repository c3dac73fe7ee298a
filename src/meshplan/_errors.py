"""Every exception meshplan raises, in one place.

All of them derive from :class:`MeshplanError`, and those about bad input also
derive from :class:`ValueError` (or :class:`TypeError`), so code written for
Flax's own errors keeps catching them.

Messages follow one form: what is wrong (with the parameter path, the names,
sizes and rules involved), one bullet per problem, then how to fix it.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "ArgumentError",
    "CheckpointError",
    "LogicalNamesError",
    "MeshError",
    "MeshplanError",
    "PartitioningUnspecifiedError",
    "RulesError",
    "ShardingValidationError",
    "UnmatchedLogicalAxisError",
]


class MeshplanError(Exception):
    """Base class of every error meshplan raises."""


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


class PartitioningUnspecifiedError(MeshplanError, ValueError):
    """``nn.scan``/``nn.vmap`` added an axis to a box without naming it."""


class ShardingValidationError(MeshplanError, ValueError):
    """``check(..., strict=True)`` found errors in a sharding plan; lists them all."""


class CheckpointError(MeshplanError, ValueError):
    """A checkpoint that is missing, incomplete, or does not fit the requested model."""


def bullets(lines: Iterable[str]) -> str:
    """Formats one problem per line, as JAX's ``shard_map`` errors do."""
    return "\n".join(f"  * {line}" for line in lines)


def problem_message(header: str, problems: Iterable[str], fix: str) -> str:
    """``header``, one bullet per problem, then the fix on its own line."""
    return f"{header}\n{bullets(problems)}\n{fix}"
