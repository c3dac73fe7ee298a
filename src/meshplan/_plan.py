"""Sharding plans: where each array of a tree goes on a mesh, why, and what it costs.

:func:`explain` walks a tree the way :func:`meshplan.get_sharding` does and
records, for every array leaf, the rule that placed each dimension (and the
rules that named it but were skipped), the resulting mesh spec, the shard each
device holds and the bytes that costs. A :class:`Plan` prints as a table,
serialises to a stable JSON schema (``docs/plan.md``) and draws itself as a
PNG; :func:`meshplan.check` turns it into a list of problems.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from meshplan._boxes import LogicallyPartitioned, is_box
from meshplan._errors import MeshError, RulesError
from meshplan._rules import (
    UNASSIGNED,
    UNCONSTRAINED,
    SkippedRule,
    get_logical_axis_rules,
    normalize_rules,
    resolve_with_trace,
)

__all__ = ["DimPlan", "LeafPlan", "MeshInfo", "Plan", "Totals", "explain"]

SCHEMA = "meshplan.plan/1"
"""Identifies the layout of :meth:`Plan.to_dict`; bumped on any incompatible change."""

GROUPS = ("params", "optimizer", "other")
"""Groups that totals are split by (see :func:`explain` for how leaves are classified)."""


# --------------------------------------------------------------------------
# The mesh, reduced to what a plan needs
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """The shape of a mesh: axis names, their sizes, and the device ids in mesh order.

    Attributes:
        axis_names: The mesh axis names, major to minor.
        axis_sizes: The size of each axis.
        device_ids: Device ids in row-major mesh order (``0..n-1`` for an
            ``AbstractMesh`` or a plain mapping of axis sizes).
    """

    axis_names: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    device_ids: tuple[int, ...]

    @property
    def shape(self) -> dict[str, int]:
        """``{axis_name: size}``, like ``Mesh.shape``."""
        return dict(zip(self.axis_names, self.axis_sizes, strict=True))

    @property
    def size(self) -> int:
        """The number of devices."""
        return math.prod(self.axis_sizes)

    def describe(self) -> str:
        """``'data=2 × model=4 (8 devices)'``."""
        axes = " × ".join(f"{n}={s}" for n, s in self.shape.items()) or "no axes"
        return f"{axes} ({self.size} device{'s' if self.size != 1 else ''})"


def mesh_info(mesh: Any) -> MeshInfo:
    """Reads axis names, sizes and device ids from a ``Mesh``, ``AbstractMesh`` or mapping.

    Example:
        >>> from meshplan._plan import mesh_info
        >>> mesh_info({"data": 2, "model": 4}).describe()
        'data=2 × model=4 (8 devices)'
    """
    if isinstance(mesh, MeshInfo):
        return mesh
    if isinstance(mesh, Mapping):
        names, sizes = tuple(mesh), tuple(mesh.values())
        ids = None
    elif hasattr(mesh, "axis_names") and hasattr(mesh, "shape"):
        names = tuple(mesh.axis_names)
        shape = mesh.shape
        sizes = tuple(shape[n] for n in names) if isinstance(shape, Mapping) else tuple(shape)
        try:
            ids = tuple(int(d.id) for d in np.asarray(mesh.devices).flat)
        except (AttributeError, ValueError, TypeError):  # AbstractMesh has no devices
            ids = None
    else:
        raise MeshError(
            f"A plan needs a mesh (jax.sharding.Mesh, AbstractMesh, or a mapping of axis "
            f"sizes such as {{'data': 2, 'model': 4}}), got {type(mesh).__name__}: {mesh!r}.\n"
            f"Build one with jax.make_mesh((2, 4), ('data', 'model'))."
        )
    bad = [
        (n, s)
        for n, s in zip(names, sizes, strict=True)
        if not isinstance(n, str) or not _is_pos(s)
    ]
    if bad or len(set(names)) != len(names):
        raise MeshError(
            f"A mesh needs distinct string axis names with positive integer sizes, got "
            f"{dict(zip(names, sizes, strict=True))!r}.\nName each axis once, e.g. "
            f"{{'data': 2, 'model': 4}}."
        )
    sizes = tuple(int(s) for s in sizes)
    if ids is None or len(ids) != math.prod(sizes):
        ids = tuple(range(math.prod(sizes)))
    return MeshInfo(names, sizes, ids)


def _is_pos(s: Any) -> bool:
    return isinstance(s, int | np.integer) and not isinstance(s, bool) and s > 0


# --------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------


def _fmt_rule(index: int, rule: Any) -> str:
    name, axes = rule
    axes_txt = "UNCONSTRAINED" if axes is UNCONSTRAINED else repr(axes)
    return f"rule {index} ({name!r}, {axes_txt})"


def _fmt_axes(axes: tuple[str, ...]) -> str:
    return "×".join(repr(a) for a in axes)


_SKIP_TEXT = {
    "mesh axis taken": "mesh axis already used by dim",
    "tuple partly taken": "tuple partly taken: used by dim",
    "dimension already assigned": "dimension already placed",
}


@dataclasses.dataclass(frozen=True)
class DimPlan:
    """How one dimension of one array is laid out, and why.

    Attributes:
        index: The dimension's position.
        size: Its size (``None`` for a spec without a shape).
        name: Its name on the box: a logical name, mesh axes, or ``None``.
        mesh_axes: The mesh axes it is split over (``()``: not split).
        shards: Into how many pieces it is split (product of those axes' sizes).
        shard_size: The size of the largest piece (``ceil(size / shards)``).
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

    index: int
    size: int | None
    name: Any
    mesh_axes: tuple[str, ...]
    shards: int
    shard_size: int | None
    status: str
    rule_index: int | None = None
    rule: tuple[str, Any] | None = None
    skipped: tuple[SkippedRule, ...] = ()
    missing_axes: tuple[str, ...] = ()
    duplicate_axes: tuple[str, ...] = ()
    axis_sizes: tuple[int, ...] = ()

    @property
    def divides(self) -> bool:
        """Whether the size divides evenly by the number of shards."""
        return self.size is None or self.size % self.shards == 0

    @property
    def padded_size(self) -> int | None:
        """The nearest size at or above ``size`` that divides by ``shards``."""
        return None if self.size is None else -(-self.size // self.shards) * self.shards

    @property
    def why(self) -> str:
        """One line: which rule placed this dimension, which were skipped and why.

        Empty for an unnamed dimension with nothing to say.
        """
        parts = [
            f"{_fmt_rule(s.rule_index, s.rule)} skipped "
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
            placed = _fmt_rule(self.rule_index, self.rule)
            if not self.mesh_axes:
                parts.append(f"{placed}: kept whole")
            else:
                parts.append(f"{placed}: {self._split_text()}")
        elif self.status == "mesh":
            parts.append(f"mesh axes {_fmt_axes(self.mesh_axes)}: {self._split_text()}")
        elif self.status == "no-rule":
            lead = "no rule placed" if self.skipped else "no rule for"
            parts.append(f"{lead} {self.name!r}: replicated")
        elif self.status == "unconstrained":
            parts.append("unconstrained: the compiler chooses (counted as replicated)")
        if self.missing_axes:
            parts.append(f"mesh has no axis {_fmt_axes(self.missing_axes)}")
        if self.duplicate_axes:
            parts.append(f"mesh axis {_fmt_axes(self.duplicate_axes)} already used by another dim")
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
            return f"mesh axis {_fmt_axes(tuple(ones))} has size 1, so not split"
        return f"split {self.shards} ways"

    def to_dict(self) -> dict[str, Any]:
        """The ``dims[i]`` entry of the JSON schema."""
        return {
            "name": _json_entry(self.name),
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
class _Layout:
    """Everything about a leaf that depends only on (kind, names, shape, dtype, rules)."""

    kind: str
    names: tuple[Any, ...] | None
    shape: tuple[int, ...] | None
    dtype: str
    itemsize: int
    dims: tuple[DimPlan, ...]
    spec: PartitionSpec
    shard_shape: tuple[int, ...] | None
    bytes: int
    bytes_per_device: int
    replication: int
    device_bytes: np.ndarray | None  # per device, only when shards are uneven
    issues: tuple[tuple[str, str, str], ...]  # (code, message, fix) about this leaf alone


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

    def __init__(self, path: str, group: str, layout: _Layout) -> None:
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

    def to_dict(self) -> dict[str, Any]:
        """The ``leaves[i]`` entry of the JSON schema."""
        lay = self._layout
        return {
            "path": self.path,
            "group": self.group,
            "kind": lay.kind,
            "shape": None if lay.shape is None else list(lay.shape),
            "dtype": lay.dtype,
            "names": None if lay.names is None else [_json_entry(n) for n in lay.names],
            "spec": [_json_entry(e) for e in lay.spec],
            "shard_shape": None if lay.shard_shape is None else list(lay.shard_shape),
            "bytes": lay.bytes,
            "bytes_per_device": lay.bytes_per_device,
            "replication": lay.replication,
            "uneven": self.uneven,
            "dims": [d.to_dict() for d in lay.dims],
        }

    def __repr__(self) -> str:
        return (
            f"LeafPlan({self.path!r}, shape={self.shape}, spec={self.spec}, "
            f"bytes_per_device={self.bytes_per_device})"
        )


def _json_entry(entry: Any) -> Any:
    if entry is UNCONSTRAINED:
        return "UNCONSTRAINED"
    if isinstance(entry, tuple):
        return list(entry)
    return entry


@dataclasses.dataclass(frozen=True)
class Totals:
    """Bytes of a group of leaves, in all and per device.

    Attributes:
        leaves: How many array leaves.
        bytes: Bytes of all the arrays (one copy of each).
        device_bytes: Bytes each device holds, in mesh order.
        max_device_bytes: Bytes on the fullest device.
        ideal_bytes: ``bytes / number of devices``, rounded up: the fullest
            device's bytes under a perfect split with no replication.
    """

    leaves: int
    bytes: int
    device_bytes: tuple[int, ...]
    max_device_bytes: int
    ideal_bytes: int

    @property
    def efficiency(self) -> float:
        """``ideal_bytes / max_device_bytes``: 1.0 when nothing is replicated or uneven."""
        return 1.0 if self.max_device_bytes == 0 else self.ideal_bytes / self.max_device_bytes

    def to_dict(self) -> dict[str, Any]:
        """The ``totals[group]`` entry of the JSON schema."""
        return {
            "leaves": self.leaves,
            "bytes": self.bytes,
            "max_device_bytes": self.max_device_bytes,
            "ideal_bytes": self.ideal_bytes,
            "device_bytes": list(self.device_bytes),
        }


# --------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------


class Plan:
    """Where every array leaf of a tree goes on a mesh, and what it costs per device.

    Made by :func:`explain`. ``print(plan)`` shows a table (long trees are
    summarised by their largest leaves; ``plan.table(full=True)`` has every
    row), ``plan[path]`` is one :class:`LeafPlan`, ``plan.to_json()`` the
    documented JSON, ``plan.save_png(path)`` a picture, and ``plan.problems``
    what :func:`meshplan.check` reports.

    Attributes:
        mesh: The mesh's :class:`MeshInfo`.
        rules: The rules the plan used (``None`` when there were none).
        leaves: One :class:`LeafPlan` per array leaf, in tree order.
        totals: :class:`Totals` for ``'all'`` and for each group in ``GROUPS``.
        skipped_leaves: How many leaves were not arrays (``apply_fn``, ``tx``...).
    """

    def __init__(
        self,
        mesh: MeshInfo,
        rules: tuple[tuple[str, Any], ...] | None,
        leaves: list[LeafPlan],
        skipped_leaves: int,
        rule_problems: list[tuple[str, str, str]],
        rule_index_map: tuple[int, ...],
    ) -> None:
        self.mesh = mesh
        self.rules = rules
        self.leaves = tuple(leaves)
        self.skipped_leaves = skipped_leaves
        self._rule_problems = rule_problems
        self._rule_index_map = rule_index_map
        self._by_path: dict[str, LeafPlan] | None = None
        self._problems: list[Any] | None = None
        self.totals = self._totals()

    # -- totals ---------------------------------------------------------------

    def _totals(self) -> dict[str, Totals]:
        n = self.mesh.size
        acc = {g: [0, 0, 0, np.zeros(n, dtype=np.int64)] for g in GROUPS}  # leaves, bytes, even
        for leaf in self.leaves:
            a = acc[leaf.group]
            lay = leaf._layout
            a[0] += 1
            a[1] += lay.bytes
            if lay.device_bytes is None:
                a[2] += lay.bytes_per_device
            else:
                a[3] += lay.device_bytes
        groups = {g: (c, b, uneven + even) for g, (c, b, even, uneven) in acc.items()}
        everything = (
            sum(c for c, _, _ in groups.values()),
            sum(b for _, b, _ in groups.values()),
            sum(d for _, _, d in groups.values()),
        )
        return {
            "all": _make_totals(*everything, n),
            **{g: _make_totals(*groups[g], n) for g in GROUPS},
        }

    # -- access ---------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.leaves)

    def __iter__(self) -> Iterator[LeafPlan]:
        return iter(self.leaves)

    def __getitem__(self, path: str) -> LeafPlan:
        if self._by_path is None:
            self._by_path = {leaf.path: leaf for leaf in self.leaves}
        try:
            return self._by_path[path]
        except KeyError:
            import difflib

            close = difflib.get_close_matches(path, self._by_path, n=3)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise KeyError(f"No array leaf at {path!r} in this plan.{hint}") from None

    @property
    def problems(self) -> list[Any]:
        """What :func:`meshplan.check` reports for this plan (default threshold)."""
        if self._problems is None:
            from meshplan._check import find_problems

            self._problems = find_problems(self)
        return self._problems

    # -- rendering ------------------------------------------------------------

    def table(self, full: bool = False, max_rows: int = 24) -> Any:
        """A ``rich`` renderable: the per-leaf table, totals and problems.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> from meshplan._render import to_text
            >>> tree = {f"w{i}": meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((8, 4 * (i + 1)), jnp.float32), ("model", None))
            ...     for i in range(30)}
            >>> text = to_text(meshplan.explain(tree, {"model": 4}).table(max_rows=2))
            >>> "w29" in text, "w0 " in text, "… and 28 smaller leaves" in text
            (True, False, True)

        Args:
            full: Show every leaf. Otherwise a tree of more than ``max_rows``
                leaves shows its ``max_rows`` largest (per device), in tree order.
            max_rows: Rows to show when not ``full``.
        """
        from meshplan._render import plan_renderable

        return plan_renderable(self, full=full, max_rows=max_rows)

    def __rich__(self) -> Any:
        return self.table()

    def __str__(self) -> str:
        from meshplan._render import to_text

        return to_text(self.table())

    def __repr__(self) -> str:
        t = self.totals["all"]
        return (
            f"<Plan of {t.leaves} lea{'f' if t.leaves == 1 else 'ves'} on {self.mesh.describe()}: {_human(t.bytes)} in all, "
            f"{_human(t.max_device_bytes)} on the fullest device>"
        )

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain data, in the stable schema ``meshplan.plan/1`` (docs/plan.md).

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
            ...                                   ("model", None))}
            >>> data = meshplan.explain(tree, {"model": 4}).to_dict()
            >>> data["schema"], data["leaves"][0]["spec"], data["totals"]["all"]["device_bytes"]
            ('meshplan.plan/1', ['model', None], [32, 32, 32, 32])
        """
        return {
            "schema": SCHEMA,
            "mesh": {
                "axis_names": list(self.mesh.axis_names),
                "shape": self.mesh.shape,
                "devices": self.mesh.size,
                "device_ids": list(self.mesh.device_ids),
            },
            "rules": None
            if self.rules is None
            else [[name, _json_entry(axes)] for name, axes in self.rules],
            "leaves": [leaf.to_dict() for leaf in self.leaves],
            "skipped_leaves": self.skipped_leaves,
            "totals": {g: t.to_dict() for g, t in self.totals.items()},
        }

    def to_json(self, indent: int | None = 2) -> str:
        """:meth:`to_dict` as a JSON string.

        Example:
            >>> import json, meshplan
            >>> json.loads(meshplan.explain({}, {"data": 2}).to_json())["mesh"]["shape"]
            {'data': 2}
        """
        return json.dumps(self.to_dict(), indent=indent)

    def save_png(self, path: Any, *, top: int = 6, title: str | None = None) -> None:
        """Draws the plan: the mesh with each device's memory, and the ``top`` largest
        parameters as tiles coloured by the devices that hold them.

        Headless (matplotlib's Agg canvas); needs no display.

        Example:
            >>> import os, tempfile, jax, jax.numpy as jnp, meshplan
            >>> tree = {"params": {"w": meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((64, 32), jnp.float32), (None, "model"))}}
            >>> path = os.path.join(tempfile.mkdtemp(), "plan.png")
            >>> meshplan.explain(tree, {"data": 2, "model": 4}).save_png(path)
            >>> open(path, "rb").read(4)
            b'\x89PNG'
        """
        from meshplan._render import save_png

        save_png(self, path, top=top, title=title)


def _make_totals(count: int, nbytes: int, device_bytes: np.ndarray, n: int) -> Totals:
    dev = tuple(int(b) for b in device_bytes)
    return Totals(count, int(nbytes), dev, max(dev, default=0), -(-int(nbytes) // n))


def _human(n: float) -> str:
    """Bytes for people: ``'4.00 MiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


# --------------------------------------------------------------------------
# Building layouts
# --------------------------------------------------------------------------


def _axes_of(entry: Any) -> tuple[str, ...]:
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple):
        return entry
    return ()


def _itemsize(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if size is None:
        try:
            size = np.dtype(dtype).itemsize
        except TypeError:
            size = 0
    return int(size)


def _build_layout(
    kind: str,
    names: tuple[Any, ...] | None,
    shape: tuple[int, ...] | None,
    dtype: Any,
    rules: tuple[tuple[str, Any], ...],
    index_map: tuple[int, ...],
    mesh: MeshInfo,
) -> _Layout:
    issues: list[tuple[str, str, str]] = []
    sizes = mesh.shape
    ndim = len(shape) if shape is not None else len(names or ())
    work_names: tuple[Any, ...] = (None,) * ndim if names is None else tuple(names)
    if shape is not None and names is not None and len(names) != ndim:
        issues.append(
            (
                "rank",
                f"{len(names)} axis names {tuple(names)!r} for an array of rank {ndim} "
                f"(shape {tuple(shape)})",
                f"Give exactly one name (or None) per dimension: {ndim} names.",
            )
        )
        work_names = (work_names + (None,) * ndim)[:ndim]

    trace = None
    if kind == "logical":
        try:
            trace = resolve_with_trace(work_names, rules)
        except (ValueError, TypeError) as e:
            head, _, fix = str(e).partition("\n")
            issues.append(
                ("names", head.rstrip("."), fix or "Give one axis name (or None) per dimension.")
            )
            work_names = (None,) * ndim
            trace = resolve_with_trace(work_names, ())

    dims: list[DimPlan] = []
    entries: list[Any] = []
    used: dict[str, int] = {}
    for i, name in enumerate(work_names):
        size = None if shape is None else int(shape[i])
        rule_index = rule = None
        skipped: tuple[SkippedRule, ...] = ()
        if kind == "unboxed":
            entry, status = None, "unboxed"
        elif trace is not None:
            res = trace[i]
            entry = None if res.mesh_axes is UNASSIGNED else res.mesh_axes
            skipped = tuple(
                SkippedRule(index_map[s.rule_index], s.rule, s.reason, s.taken_by)
                for s in res.skipped
            )
            if name is None:
                status = "unnamed"
            elif name is UNCONSTRAINED or entry is UNCONSTRAINED:
                status = "unconstrained"
            elif res.mesh_axes is UNASSIGNED:
                status = "no-rule"
            else:
                status = "rule"
                rule_index = index_map[res.rule_index] if res.rule_index is not None else None
                rule = rules[res.rule_index] if res.rule_index is not None else None
        else:
            entry = name
            status = (
                "unnamed" if name is None else "unconstrained" if name is UNCONSTRAINED else "mesh"
            )
        entries.append(entry)
        axes = _axes_of(entry)
        missing = tuple(a for a in axes if a not in sizes)
        dup = tuple(a for a in axes if a in used)
        for a in dup:
            issues.append(
                (
                    "duplicate-axis",
                    f"mesh axis {a!r} is used by dims {used[a]} and {i}",
                    "Use each mesh axis for at most one dimension of an array.",
                )
            )
        for a in axes:
            used.setdefault(a, i)
        if missing and kind == "mesh":
            import difflib

            guess = [m for a in missing for m in difflib.get_close_matches(a, sizes, n=1)]
            hint = f"Did you mean {guess[0]!r}? " if guess else ""
            issues.append(
                (
                    "unknown-axis",
                    f"dim {i} names mesh axis {_fmt_axes(missing)}, which the mesh "
                    f"{mesh.shape} does not have",
                    f"{hint}Use the mesh's axis names {mesh.axis_names!r}.",
                )
            )
        axis_sizes = tuple(sizes.get(a, 0) for a in axes)
        shards = math.prod(sizes[a] for a in axes if a in sizes and a not in dup)
        shard_size = None if size is None else -(-size // shards)
        dims.append(
            DimPlan(
                i, size, name, axes, shards, shard_size, status, rule_index, rule,
                skipped, missing, dup, axis_sizes,
            )
        )  # fmt: skip

    for d in dims:
        if not d.divides:
            named = kind == "logical" and isinstance(d.name, str)
            where = f"dim {d.index}" + (f" ({d.name!r})" if named else "")
            issues.append(
                (
                    "indivisible",
                    f"{where} of size {d.size} does not divide by {d.shards} "
                    f"({_axes_with_sizes(d)})",
                    f"Pad dim {d.index} to {d.padded_size} (the nearest multiple of {d.shards}), "
                    f"or map it to mesh axes whose size divides {d.size}.",
                )
            )

    spec = PartitionSpec(*entries)
    itemsize = _itemsize(dtype)
    total_shards = math.prod(d.shards for d in dims)
    replication = max(mesh.size // total_shards, 1)
    if shape is None:
        shard_shape, nbytes, per_device, device_bytes = None, 0, 0, None
    else:
        shard_shape = tuple(d.shard_size or 0 for d in dims)
        nbytes = math.prod(shape) * itemsize
        per_device = math.prod(shard_shape) * itemsize
        device_bytes = None
        if not all(d.divides for d in dims):
            device_bytes = _uneven_device_bytes(dims, mesh, itemsize)
            per_device = int(device_bytes.max(initial=0))
    return _Layout(
        kind=kind,
        names=None if names is None else tuple(names),
        shape=None if shape is None else tuple(int(s) for s in shape),
        dtype=str(dtype),
        itemsize=itemsize,
        dims=tuple(dims),
        spec=spec,
        shard_shape=shard_shape,
        bytes=nbytes,
        bytes_per_device=per_device,
        replication=replication,
        device_bytes=device_bytes,
        issues=tuple(issues),
    )


def _axes_with_sizes(d: DimPlan) -> str:
    """``"mesh axis 'model' of size 4"`` or ``"mesh axes 'data'×'model' of sizes 2×4"``."""
    pairs = [(a, s) for a, s in zip(d.mesh_axes, d.axis_sizes, strict=True) if s]
    if len(pairs) == 1:
        return f"mesh axis {pairs[0][0]!r} of size {pairs[0][1]}"
    return (
        f"mesh axes {'×'.join(repr(a) for a, _ in pairs)} of sizes "
        f"{'×'.join(str(s) for _, s in pairs)}"
    )


def _shard_index(dim: DimPlan, mesh: MeshInfo) -> np.ndarray:
    """For every device (flat, mesh order), the index of its piece along ``dim``."""
    grid = np.indices(mesh.axis_sizes).reshape(len(mesh.axis_sizes), -1)
    index = np.zeros(mesh.size, dtype=np.int64)
    seen: set[str] = set()
    for a in dim.mesh_axes:
        if a in mesh.axis_names and a not in seen:
            seen.add(a)
            k = mesh.axis_names.index(a)
            index = index * mesh.axis_sizes[k] + grid[k]
    return index


def _uneven_device_bytes(dims: list[DimPlan], mesh: MeshInfo, itemsize: int) -> np.ndarray:
    """Exact bytes on each device when some pieces are shorter than others."""
    out = np.full(mesh.size, itemsize, dtype=np.int64)
    for d in dims:
        assert d.size is not None and d.shard_size is not None
        start = _shard_index(d, mesh) * d.shard_size
        out *= np.clip(d.size - start, 0, d.shard_size)
    return out


def shard_holders(leaf: LeafPlan, mesh: MeshInfo) -> dict[tuple[int, ...], list[int]]:
    """For each piece of ``leaf`` (by its index along every dimension), the devices holding it.

    Device ids are ``mesh.device_ids``. Used to draw the plan.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._plan import shard_holders
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
        ...                                   (None, "model"))}
        >>> plan = meshplan.explain(tree, {"data": 2, "model": 2})
        >>> shard_holders(plan["w"], plan.mesh)
        {(0, 0): [0, 2], (0, 1): [1, 3]}
    """
    idx = np.stack([_shard_index(d, mesh) for d in leaf.dims], axis=1) if leaf.dims else None
    holders: dict[tuple[int, ...], list[int]] = {}
    for k, dev in enumerate(mesh.device_ids):
        key = () if idx is None else tuple(int(i) for i in idx[k])
        holders.setdefault(key, []).append(dev)
    return holders


# --------------------------------------------------------------------------
# The walk
# --------------------------------------------------------------------------


def _lenient_rules(
    rules: Any,
) -> tuple[tuple[tuple[str, Any], ...], tuple[int, ...], list[tuple[str, str, str]]]:
    """Valid rules, their indices in the given sequence, and one problem per invalid rule."""
    try:
        normal = normalize_rules(rules)
        return normal, tuple(range(len(normal))), []
    except RulesError as e:
        whole = str(e)
    if not isinstance(rules, tuple | list) or any(
        line.startswith("Logical axis rules look like") for line in whole.splitlines()
    ):
        head, _, fix = whole.partition("\n")
        return (
            (),
            (),
            [("rules", head.rstrip("."), fix or "Give rules as a sequence of (name, axes) pairs.")],
        )
    valid, index, problems = [], [], []
    for i, rule in enumerate(rules):
        try:
            (one,) = normalize_rules((rule,))
        except RulesError as e:
            lines = str(e).splitlines()
            msg = next((ln.strip(" *") for ln in lines if ln.strip().startswith("*")), lines[0])
            msg = msg.removeprefix("rule 0: ")
            problems.append(
                (
                    f"rules[{i}]",
                    msg,
                    "Each rule is a (logical_name, mesh_axes) pair, e.g. ('hidden', 'model').",
                )
            )
            continue
        valid.append(one)
        index.append(i)
    return tuple(valid), tuple(index), problems


def _key_str(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        value = getattr(key, attr, None)
        if value is not None:
            return str(value)
    return str(key)


_GROUP_OF_PART = {"opt_state": "optimizer", "params": "params"}


def _unwrap(box: Any) -> tuple[str, Any, Any, Any]:
    """``(kind, names, value, own_rules)`` of a box, however nested."""
    value = getattr(box, "value", None)
    while is_box(value):
        value = getattr(value, "value", None)
    names = getattr(box, "names", None)
    if names is None:
        return "unboxed", None, value, None
    if isinstance(names, PartitionSpec):
        names = tuple(names)
    elif not isinstance(names, tuple):
        names = tuple(names) if isinstance(names, list) else names
    logical = isinstance(box, LogicallyPartitioned) or type(box).__name__ == "LogicallyPartitioned"
    return ("logical" if logical else "mesh"), names, value, getattr(box, "rules", None)


def explain(tree: Any, mesh: Any, rules: Any = None) -> Plan:
    """Explains where every array leaf of ``tree`` goes on ``mesh``, why, and what it costs.

    ``tree`` is anything :func:`meshplan.get_partition_spec` accepts: boxed
    parameters, an abstract ``TrainState`` from ``jax.eval_shape``, Optax
    state. Logical boxes are mapped through their own rules, else ``rules``,
    else the active rules; mesh-axis boxes use their names as the spec;
    unboxed arrays are replicated (as :func:`meshplan.get_sharding` does).
    Non-array leaves are skipped. Leaves are grouped by path: under
    ``opt_state`` as ``'optimizer'``, else under ``params`` (or boxed) as
    ``'params'``, else ``'other'``.

    ``explain`` never raises on a bad tree: problems are recorded for
    :func:`meshplan.check` (and shown when the plan is printed).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(
        ...     jax.ShapeDtypeStruct((1024, 512), jnp.float32), ("embed", "hidden"))}}
        >>> plan = meshplan.explain(tree, mesh, (("hidden", "model"),))
        >>> leaf = plan["params/w"]
        >>> leaf.spec, leaf.shard_shape, leaf.bytes_per_device, leaf.replication
        (P(None, 'model'), (1024, 128), 524288, 2)
        >>> print(leaf.why)
        dim 0 'embed': no rule for 'embed': replicated
        dim 1 'hidden': rule 0 ('hidden', 'model'): split 4 ways
        >>> plan.totals["all"].max_device_bytes, plan.totals["all"].ideal_bytes
        (524288, 262144)

    Args:
        tree: A pytree of boxes, arrays or ``jax.ShapeDtypeStruct``s.
        mesh: A ``jax.sharding.Mesh``, an ``AbstractMesh``, or a mapping of
            axis sizes such as ``{"data": 2, "model": 4}``.
        rules: Logical axis rules; ``None`` uses the active ones.

    Returns:
        A :class:`Plan`.

    Raises:
        MeshError: ``mesh`` is not a mesh.
    """
    info = mesh_info(mesh)
    if rules is None:
        rules = get_logical_axis_rules()
    rules, index_map, rule_problems = _lenient_rules(rules)
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)

    cache: dict[Any, _Layout] = {}
    key_text: dict[Any, str] = {}
    leaves: list[LeafPlan] = []
    skipped = 0
    for keypath, leaf in flat:
        if is_box(leaf):
            kind, names, value, own_rules = _unwrap(leaf)
        else:
            kind, names, value, own_rules = "unboxed", None, leaf, None
        shape = getattr(value, "shape", None)
        if shape is None:
            skipped += 1
            continue
        dtype = getattr(value, "dtype", None)
        if not isinstance(shape, tuple):
            shape = tuple(shape)
        key = (kind, names, shape, dtype, own_rules)
        try:
            layout = cache.get(key)
        except TypeError:  # unhashable names
            key, layout = None, None
        if layout is None:
            if own_rules is not None and kind == "logical":
                r, m, _ = _lenient_rules(own_rules)
            else:
                r, m = rules, index_map
            layout = _build_layout(kind, names, shape, dtype, r, m, info)
            if key is not None:
                cache[key] = layout
        parts = []
        group = None
        for k in keypath:
            try:
                text = key_text[k]
            except KeyError:
                text = key_text[k] = _key_str(k)
            except TypeError:
                text = _key_str(k)
            parts.append(text)
            if group is None:
                group = _GROUP_OF_PART.get(text)
        if group is None:
            group = "params" if kind != "unboxed" else "other"
        leaves.append(LeafPlan("/".join(parts), group, layout))

    return Plan(
        info,
        rules if rules or rule_problems else None,
        leaves,
        skipped,
        rule_problems,
        index_map,
    )


def explain_specs(tree: Any, mesh: Any, rules: Any = None) -> Plan:
    """A plan for a tree of *logical* ``PartitionSpec``s (no shapes: no bytes, no divisibility).

    Used by ``logical_to_mesh_sharding(..., strict=True)``.
    """
    info = mesh_info(mesh)
    if rules is None:
        rules = get_logical_axis_rules()
    rules, index_map, rule_problems = _lenient_rules(rules)
    flat, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    leaves = []
    cache: dict[Any, _Layout] = {}
    for keypath, spec in flat:
        if not isinstance(spec, PartitionSpec):
            continue
        names = tuple(spec)
        layout = cache.get(names)
        if layout is None:
            layout = cache[names] = _build_layout(
                "logical", names, None, None, rules, index_map, info
            )
        path = "/".join(_key_str(k) for k in keypath)
        leaves.append(LeafPlan(path, "other", layout))
    return Plan(info, rules, leaves, 0, rule_problems, index_map)
