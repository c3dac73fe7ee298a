"""Golden snapshots of sharding plans, for regression tests.

A snapshot is the part of a :class:`meshplan.Plan` that a layout change
moves: per leaf its shape, dtype, names, mesh spec, shard shape, bytes per
device and replication, plus the totals. It is stored as JSON with one leaf
per line, so ``git diff`` of a snapshot reads like the change itself.

Typical use, in a test::

    def test_transformer_plan_is_stable():
        plan = meshplan.explain(abstract_state, mesh, rules)
        meshplan.testing.assert_plan_matches(plan, "tests/plan/snapshots/transformer.json")

Run the tests with ``MESHPLAN_UPDATE_SNAPSHOTS=1`` (or pass ``update=True``)
to write or rewrite the snapshots after an intended change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from meshplan._plan.plan import Plan
from meshplan._text import count_text, human_bytes

__all__ = ["UPDATE_ENV", "assert_plan_matches", "diff_snapshots", "snapshot"]

UPDATE_ENV = "MESHPLAN_UPDATE_SNAPSHOTS"
"""Environment variable: when ``1``/``true``/``yes``, snapshots are rewritten instead of compared."""

SNAPSHOT_SCHEMA = "meshplan.snapshot/1"
_LEAF_FIELDS = (
    "shape",
    "dtype",
    "names",
    "spec",
    "shard_shape",
    "bytes_per_device",
    "replication",
)
_MAX_LINES = 40


def snapshot(plan: Plan) -> dict[str, object]:
    """The snapshot of ``plan``: plain JSON-able data.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan, meshplan.testing
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
        ...                                   ("model", None))}
        >>> snap = meshplan.testing.snapshot(meshplan.explain(tree, {"model": 4}))
        >>> snap["leaves"]["w"]["spec"], snap["leaves"]["w"]["bytes_per_device"]
        (['model', None], 32)
    """
    data = plan.to_dict()
    return {
        "schema": SNAPSHOT_SCHEMA,
        "mesh": data["mesh"]["shape"],
        "rules": data["rules"],
        "leaves": {leaf["path"]: {k: leaf[k] for k in _LEAF_FIELDS} for leaf in data["leaves"]},
        "totals": {
            group: {"bytes": t["bytes"], "max_device_bytes": t["max_device_bytes"]}
            for group, t in data["totals"].items()
        },
    }


def _dumps(snap: dict[str, Any]) -> str:
    """JSON with one leaf per line (stable, diff-friendly)."""
    rules = snap["rules"]
    rules_text = "null" if rules is None else _block("[", map(_one_line, rules), "]")
    lines = [
        "{",
        f'  "schema": {_one_line(snap["schema"])},',
        f'  "mesh": {_one_line(snap["mesh"])},',
        f'  "rules": {rules_text},',
        f'  "leaves": {_block("{", _members(snap["leaves"]), "}")},',
        f'  "totals": {_block("{", _members(snap["totals"]), "}")}',
        "}",
    ]
    return "\n".join(lines) + "\n"


def _one_line(value: object) -> str:
    return json.dumps(value, separators=(", ", ": "))


def _members(mapping: dict[str, object]) -> list[str]:
    return [f"{_one_line(key)}: {_one_line(value)}" for key, value in mapping.items()]


def _block(opening: str, entries: Iterable[str], closing: str) -> str:
    """A JSON list or object inside the snapshot's top level: one entry per line."""
    body = ",\n".join(f"    {entry}" for entry in entries)
    return f"{opening}\n{body}\n  {closing}" if body else f"{opening}\n  {closing}"


def _spec(entries: Any) -> str:
    if entries is None:
        return "None"

    def entry(e: object) -> str:
        if isinstance(e, list):
            return "(" + ", ".join(repr(a) for a in e) + ("," if len(e) == 1 else "") + ")"
        return repr(e)

    return "P(" + ", ".join(entry(e) for e in entries) + ")"


def _fmt_field(field: str, value: Any) -> str:
    if field == "spec":
        return _spec(value)
    if field == "bytes_per_device":
        return human_bytes(value)
    if isinstance(value, list):
        return "(" + ", ".join(str(v) for v in value) + ")"
    return str(value)


def diff_snapshots(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What changed from snapshot ``old`` to ``new``, one line per change, readable.

    Example:
        >>> from meshplan.testing import diff_snapshots
        >>> old = {"mesh": {"model": 4}, "rules": None, "totals": {}, "leaves": {
        ...     "w": {"spec": [None, "model"], "bytes_per_device": 1024}}}
        >>> new = {"mesh": {"model": 4}, "rules": None, "totals": {}, "leaves": {
        ...     "w": {"spec": ["model", None], "bytes_per_device": 1024}}}
        >>> diff_snapshots(old, new)
        ["w: spec P(None, 'model') -> P('model', None)"]
    """
    lines: list[str] = []
    if old.get("mesh") != new.get("mesh"):
        lines.append(f"mesh: {old.get('mesh')} -> {new.get('mesh')}")
    if old.get("rules") != new.get("rules"):
        lines.append(f"rules: {old.get('rules')} -> {new.get('rules')}")
    old_leaves, new_leaves = old.get("leaves", {}), new.get("leaves", {})
    for path, leaf in old_leaves.items():
        if path not in new_leaves:
            lines.append(f"{path}: removed (was {_spec(leaf.get('spec'))})")
    for path, leaf in new_leaves.items():
        before = old_leaves.get(path)
        if before is None:
            lines.append(f"{path}: added ({_spec(leaf.get('spec'))}, shape {leaf.get('shape')})")
            continue
        changes = [
            f"{field.replace('_', ' ')} {_fmt_field(field, before.get(field))} -> "
            f"{_fmt_field(field, leaf.get(field))}"
            for field in _LEAF_FIELDS
            if before.get(field) != leaf.get(field)
        ]
        if changes:
            lines.append(f"{path}: {'; '.join(changes)}")
    for group, totals in new.get("totals", {}).items():
        before = old.get("totals", {}).get(group, {})
        for field, label in (("max_device_bytes", "fullest device"), ("bytes", "in all")):
            if before.get(field) != totals.get(field) and before.get(field) is not None:
                lines.append(
                    f"totals[{group}]: {label} {human_bytes(before[field])} -> {human_bytes(totals[field])}"
                )
    return lines


def _update_requested(update: bool | None) -> bool:
    if update is not None:
        return update
    return os.environ.get(UPDATE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def assert_plan_matches(
    plan: Plan, path: str | os.PathLike[str], *, update: bool | None = None
) -> None:
    """Asserts that ``plan`` matches the JSON snapshot at ``path``.

    On a difference it fails with one line per change: which parameter moved
    from which spec to which, and how the bytes per device changed. With
    ``update=True``, or the environment variable ``MESHPLAN_UPDATE_SNAPSHOTS=1``,
    it writes the snapshot instead (creating the folder).

    Example:
        >>> import tempfile, os, jax, jax.numpy as jnp, meshplan
        >>> from meshplan.testing import assert_plan_matches
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8, 4), jnp.float32),
        ...                                   ("model", None))}
        >>> path = os.path.join(tempfile.mkdtemp(), "w.json")
        >>> assert_plan_matches(meshplan.explain(tree, {"model": 4}), path, update=True)
        >>> assert_plan_matches(meshplan.explain(tree, {"model": 4}), path)
        >>> assert_plan_matches(meshplan.explain(tree, {"model": 2}), path)
        Traceback (most recent call last):
        ...
        AssertionError: The sharding plan differs from the snapshot ...:
          * mesh: {'model': 4} -> {'model': 2}
          * w: shard shape (2, 4) -> (4, 4); bytes per device 32 B -> 64 B
        ...

    Args:
        plan: The plan to compare.
        path: The snapshot file (JSON).
        update: Write the snapshot instead of comparing; ``None`` reads
            ``MESHPLAN_UPDATE_SNAPSHOTS``.

    Raises:
        AssertionError: the plan differs, or there is no snapshot yet.
    """
    path = Path(path)
    new = snapshot(plan)
    if _update_requested(update):
        text = _dumps(new)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        return
    if not path.exists():
        raise AssertionError(
            f"There is no plan snapshot at {str(path)!r} yet.\n"
            f"Run the test once with {UPDATE_ENV}=1 to write it, and commit it."
        )
    old = json.loads(path.read_text(encoding="utf-8"))
    lines = diff_snapshots(old, new)
    if not lines:
        return
    shown = lines[:_MAX_LINES]
    if len(lines) > _MAX_LINES:
        shown.append(f"... and {len(lines) - _MAX_LINES} more changes")
    body = "\n".join(f"  * {line}" for line in shown)
    raise AssertionError(
        f"The sharding plan differs from the snapshot {str(path)!r} "
        f"({count_text(len(lines), 'change')}):\n{body}\n"
        f"If the change is intended, rerun with {UPDATE_ENV}=1 to rewrite the snapshot."
    )
