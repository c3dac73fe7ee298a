"""The records of a plan: how one dimension is laid out and why, and the plan of one leaf.

Leaves with the same kind, names, shape, dtype and rules share one
:class:`LeafLayout`; a :class:`LeafPlan` adds the leaf's path and group.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt
from jax.sharding import PartitionSpec

from meshplan._errors import Problem
from meshplan._spmd.rules import UNCONSTRAINED, AxisNames, NamesKind
from meshplan._spmd.validate import DimCheck
from meshplan._text import axes_text, rule_text

__all__ = ["DimPlan", "LeafLayout", "LeafPlan", "json_entry"]

_SKIP_TEXT = {
    "mesh axis taken": "mesh axis already used by dim",
    "tuple partly taken": "tuple partly taken: used by dim",
    "dimension already assigned": "dimension already placed",
}


def json_entry(entry: object) -> object:
    """A name or spec entry as JSON: ``'UNCONSTRAINED'``, a list for a tuple, else itself.

    Example:
        >>> from meshplan._plan.records import json_entry
        >>> from jax.sharding import PartitionSpec
        >>> json_entry(("data", "model")), json_entry(PartitionSpec.UNCONSTRAINED), json_entry(None)
        (['data', 'model'], 'UNCONSTRAINED', None)
    """
    if entry is UNCONSTRAINED:
        return "UNCONSTRAINED"
    if isinstance(entry, tuple):
        return list(entry)
    return entry


@dataclasses.dataclass(frozen=True)
class DimPlan(DimCheck):
    """How one dimension of one array is laid out, and why.

    The validator's :class:`~meshplan._spmd.validate.DimCheck` (what was placed
    where, and what is wrong), plus what a plan shows: the shard size and ``why``.

    Attributes:
        index: The dimension's position.
        size: Its size (``None`` for a spec without a shape).
        name: Its name on the box: a logical name, mesh axes, or ``None``.
        entry: Its ``PartitionSpec`` entry.
        mesh_axes: The mesh axes it is split over (``()``: not split).
        shards: Into how many pieces it is split (product of those axes' sizes).
        status: ``'rule'`` (placed by a rule), ``'mesh'`` (named with mesh
            axes directly), ``'no-rule'`` (a logical name no rule placed:
            replicated), ``'unnamed'`` (``None``), ``'unconstrained'`` or
            ``'unboxed'`` (a leaf without a box: replicated).
        rule_index: Index of the rule that placed it, if any.
        rule: That rule, ``(logical_name, mesh_axes)``.
        skipped: Rules that named it but were skipped, with the reason
            (``'mesh axis taken'``, ``'tuple partly taken'``,
            ``'dimension already assigned'``) and the dimensions in the way.
        missing_axes: Mesh axes it names that the mesh does not have.
        duplicate_axes: Mesh axes it names that an earlier dimension already uses
            (an error: they do not split it).
        axis_sizes: Size of each axis in ``mesh_axes`` (0 when missing).
    """

    @classmethod
    def of(cls, dim: DimCheck) -> DimPlan:
        """The plan's record of one dimension the validator checked."""
        return cls(**{f.name: getattr(dim, f.name) for f in dataclasses.fields(dim)})

    @property
    def shard_size(self) -> int | None:
        """The size of the largest piece (``ceil(size / shards)``)."""
        return None if self.size is None else -(-self.size // self.shards)

    @property
    def why(self) -> str:
        """One line: which rule placed this dimension, which were skipped and why.

        Empty for an unnamed dimension with nothing to say.
        """
        parts = [
            f"{rule_text(s.rule_index, s.rule)} skipped "
            f"({_SKIP_TEXT.get(s.reason, s.reason)}"
            + (
                f" {', '.join(map(str, s.taken_by))}"
                if s.reason != "dimension already assigned"
                else ""
            )
            + ")"
            for s in self.skipped
        ]
        if self.status == "rule":
            assert self.rule_index is not None and self.rule is not None
            placed = rule_text(self.rule_index, self.rule)
            if not self.mesh_axes:
                parts.append(f"{placed}: kept whole")
            else:
                parts.append(f"{placed}: {self._split_text()}")
        elif self.status == "mesh":
            parts.append(f"mesh axes {axes_text(self.mesh_axes)}: {self._split_text()}")
        elif self.status == "no-rule":
            lead = "no rule placed" if self.skipped else "no rule for"
            parts.append(f"{lead} {self.name!r}: replicated")
        elif self.status == "unconstrained":
            parts.append("unconstrained: the compiler chooses (counted as replicated)")
        if self.missing_axes:
            parts.append(f"mesh has no axis {axes_text(self.missing_axes)}")
        if self.duplicate_axes:
            parts.append(f"mesh axis {axes_text(self.duplicate_axes)} already used by another dim")
        if not self.divides:
            parts.append(
                f"size {self.size} does not divide by {self.shards} "
                f"(uneven shards of {self.shard_size}; pad to {self.padded_size})"
            )
        return "; ".join(parts)

    def _split_text(self) -> str:
        if (self.missing_axes or self.duplicate_axes) and self.shards == 1:
            return "not split"
        if self.shards == 1:
            ones = [a for a, s in zip(self.mesh_axes, self.axis_sizes, strict=True) if s == 1]
            return f"mesh axis {axes_text(tuple(ones))} has size 1, so not split"
        return f"split {self.shards} ways"

    def to_dict(self) -> dict[str, object]:
        """The ``leaves[i].dims[j]`` entry of the JSON schema (``docs/plan.md``)."""
        return {
            "name": json_entry(self.name),
            "size": self.size,
            "mesh_axes": list(self.mesh_axes),
            "shards": self.shards,
            "shard_size": self.shard_size,
            "status": self.status,
            "rule": self.rule_index,
            "missing_axes": list(self.missing_axes),
            "duplicate_axes": list(self.duplicate_axes),
            "skipped": [
                {"rule": s.rule_index, "reason": s.reason, "taken_by": list(s.taken_by)}
                for s in self.skipped
            ],
            "why": self.why,
        }


@dataclasses.dataclass(frozen=True, eq=False)
class LeafLayout:
    """Everything about a leaf that depends only on (kind, names, shape, dtype, rules)."""

    kind: NamesKind
    names: AxisNames | None
    shape: tuple[int, ...] | None
    dtype: str
    itemsize: int
    dims: tuple[DimPlan, ...]
    spec: PartitionSpec
    shard_shape: tuple[int, ...] | None
    bytes: int
    bytes_per_device: int
    replication: int
    device_bytes: npt.NDArray[np.int64] | None  # per device, only when shards are uneven
    issues: tuple[Problem, ...]  # the validator's problems of this leaf alone (no path)


class LeafPlan:
    """The plan of one array leaf.

    Attributes:
        path: ``'params/DotReluDot_0/Dense_0/kernel'``-style path in the tree.
        group: ``'params'``, ``'optimizer'`` or ``'other'``.
        kind: ``'logical'`` (logical names mapped by rules), ``'mesh'`` (mesh
            axis names), or ``'unboxed'`` (no box: replicated).
        shape, dtype: The array's.
        names: The names on its box (``None`` when unboxed).
        dims: One :class:`DimPlan` per dimension.
        spec: The resulting mesh ``PartitionSpec``.
        shard_shape: The shape of the (largest) piece each device holds.
        bytes: Bytes of the whole array.
        bytes_per_device: Bytes of the piece each device holds.
        replication: How many devices hold each piece.
        uneven: Whether some dimension does not divide by its shards.
    """

    __slots__ = ("_layout", "group", "path")

    def __init__(self, path: str, group: str, layout: LeafLayout) -> None:
        self.path = path
        self.group = group
        self._layout = layout

    kind = property(lambda self: self._layout.kind)
    shape = property(lambda self: self._layout.shape)
    dtype = property(lambda self: self._layout.dtype)
    names = property(lambda self: self._layout.names)
    dims = property(lambda self: self._layout.dims)
    spec = property(lambda self: self._layout.spec)
    shard_shape = property(lambda self: self._layout.shard_shape)
    bytes = property(lambda self: self._layout.bytes)
    bytes_per_device = property(lambda self: self._layout.bytes_per_device)
    replication = property(lambda self: self._layout.replication)

    @property
    def uneven(self) -> bool:
        return self._layout.device_bytes is not None or not all(d.divides for d in self.dims)

    @property
    def why(self) -> str:
        """Per-dimension explanations, for the dimensions with something to say."""
        lines = []
        for d in self.dims:
            text = d.why
            if text:
                label = f" {d.name!r}" if isinstance(d.name, str) else ""
                lines.append(f"dim {d.index}{label}: {text}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        """The ``leaves[i]`` entry of the JSON schema (``docs/plan.md``)."""
        return {
            "path": self.path,
            "group": self.group,
            "kind": self.kind,
            "shape": None if self.shape is None else list(self.shape),
            "dtype": self.dtype,
            "names": None if self.names is None else [json_entry(n) for n in self.names],
            "spec": [json_entry(e) for e in self.spec],
            "shard_shape": None if self.shard_shape is None else list(self.shard_shape),
            "bytes": self.bytes,
            "bytes_per_device": self.bytes_per_device,
            "replication": self.replication,
            "uneven": self.uneven,
            "dims": [d.to_dict() for d in self.dims],
        }

    def __repr__(self) -> str:
        return (
            f"LeafPlan({self.path!r}, shape={self.shape}, spec={self.spec}, "
            f"bytes_per_device={self.bytes_per_device})"
        )
