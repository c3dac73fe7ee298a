"""Checking a sharding plan: every problem at once, each with its path and its fix."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Sequence
from typing import Any

from meshplan._errors import ShardingValidationError, problem_message
from meshplan._plan import MeshInfo, Plan, _fmt_axes, _fmt_rule, _human, explain, explain_specs

__all__ = ["DEFAULT_REPLICATED_THRESHOLD", "Problem", "check"]

DEFAULT_REPLICATED_THRESHOLD = 1 << 20
"""Arrays of at least this many bytes that every device holds whole are reported (1 MiB)."""

_MAX_BULLETS = 40
_MAX_PATHS_NAMED = 3


@dataclasses.dataclass(frozen=True)
class Problem:
    """One problem with a sharding plan.

    Attributes:
        severity: ``'error'`` (``jax.jit`` would fail, or the plan is not
            what was written) or ``'warning'`` (valid, but probably not meant:
            memory spent on replication, rules that do nothing).
        path: Where: a leaf path (``'params/Dense_0/kernel'``), ``'rules[2]'``,
            ``'rules'`` or ``'mesh/data'``.
        message: What is wrong, with the names, sizes and axes involved.
        fix: How to fix it.
        code: A stable identifier of the kind of problem (see ``docs/plan.md``).
    """

    severity: str
    path: str
    message: str
    fix: str
    code: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}: {self.message}. {self.fix}"

    def to_dict(self) -> dict[str, str]:
        """``{'severity', 'code', 'path', 'message', 'fix'}``."""
        return {
            "severity": self.severity,
            "code": self.code,
            "path": self.path,
            "message": self.message,
            "fix": self.fix,
        }


def _paths_text(paths: Sequence[str]) -> str:
    shown = ", ".join(paths[:_MAX_PATHS_NAMED])
    more = len(paths) - _MAX_PATHS_NAMED
    return shown + (f" and {more} more" if more > 0 else "")


def _leaves_word(n: int) -> str:
    return f"{n} lea{'f' if n == 1 else 'ves'}"


def find_problems(
    plan: Plan, replicated_threshold_bytes: int = DEFAULT_REPLICATED_THRESHOLD
) -> list[Problem]:
    """Every problem of ``plan``: errors first, then warnings, each in tree/rule order.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._check import find_problems
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((6,), jnp.float32), ("x",))}
        >>> [p.code for p in find_problems(meshplan.explain(tree, {"x": 4}))]
        ['indivisible']
    """
    errors: list[Problem] = []
    warnings: list[Problem] = []
    mesh = plan.mesh

    for path, message, fix in plan._rule_problems:
        errors.append(Problem("error", path, message, fix, "bad-rule"))

    # Leaves that share a layout share their analysis.
    leaf_errors: list[Problem] = []
    groups: dict[int, tuple[Any, list[str]]] = {}
    for leaf in plan.leaves:
        entry = groups.get(id(leaf._layout))
        if entry is None:
            groups[id(leaf._layout)] = (leaf._layout, [leaf.path])
        else:
            entry[1].append(leaf.path)

    rules = plan.rules or ()
    index_map = plan._rule_index_map
    placed = dict.fromkeys(index_map, 0)
    skipped: dict[int, list[str]] = {}
    rule_paths: dict[int, list[str]] = {}
    unmatched: dict[str, list[str]] = {}
    used_axes: set[str] = set()
    logical_without_rules: list[str] = []
    for layout, paths in groups.values():
        for code, message, fix in layout.issues:
            for path in paths:
                leaf_errors.append(Problem("error", path, message, fix, code))
        only_unmatched = layout.kind == "logical" and all(
            d.status in ("no-rule", "unnamed") for d in layout.dims
        )
        if only_unmatched and not rules and any(d.status == "no-rule" for d in layout.dims):
            logical_without_rules.extend(paths)
            continue
        for d in layout.dims:
            used_axes.update(a for a in d.mesh_axes if mesh.shape.get(a, 1) > 1)
            if d.status == "rule" and d.rule_index in placed:
                placed[d.rule_index] += len(paths)
                rule_paths.setdefault(d.rule_index, []).extend(paths)
            for s in d.skipped:
                skipped.setdefault(s.rule_index, []).extend(paths)
            if d.status == "no-rule":
                unmatched.setdefault(d.name, []).extend(paths)
        if (
            layout.shape is not None
            and mesh.size > 1
            and layout.replication == mesh.size
            and layout.bytes >= replicated_threshold_bytes
        ):
            for path in paths:
                warnings.append(_replicated(path, layout, mesh))

    if leaf_errors:  # in tree order, like the table
        order = {leaf.path: i for i, leaf in enumerate(plan.leaves)}
        errors.extend(sorted(leaf_errors, key=lambda p: order[p.path]))

    if logical_without_rules:
        paths = logical_without_rules
        errors.append(
            Problem(
                "error",
                paths[0],
                f"{_leaves_word(len(paths))} ({_paths_text(paths)}) have logical axis names "
                f"but no rules are given or active, so every logical dimension is replicated",
                "Pass rules=..., or call inside `with meshplan.logical_axis_rules(rules):`.",
                "no-rules",
            )
        )

    for i, (name, axes) in zip(index_map, rules, strict=True):
        missing = tuple(a for a in _axes(axes) if a not in mesh.shape)
        if missing:
            guess = [m for a in missing for m in difflib.get_close_matches(a, mesh.shape, n=1)]
            hint = f"Did you mean {guess[0]!r}? " if guess else ""
            users = rule_paths.get(i, [])
            used = f" (it places {_leaves_word(len(users))}: {_paths_text(users)})" if users else ""
            errors.append(
                Problem(
                    "error",
                    f"rules[{i}]",
                    f"{_fmt_rule(i, (name, axes))} names mesh axis {_fmt_axes(missing)}, which "
                    f"the mesh {mesh.shape} does not have{used}",
                    f"{hint}Use the mesh's axis names {mesh.axis_names!r}.",
                    "rule-unknown-axis",
                )
            )

    any_logical = any(layout.kind == "logical" for layout, _ in groups.values())
    for name, paths in unmatched.items():
        skips = sorted(
            {f"rule {s.rule_index}" for layout, ps in groups.values() for d in layout.dims
             if d.name == name for s in d.skipped}
        )  # fmt: skip
        why = f" ({', '.join(skips)} named it but {'was' if len(skips) == 1 else 'were'} skipped)"
        warnings.append(
            Problem(
                "warning",
                paths[0],
                f"logical name {name!r} is placed by no rule{why if skips else ''}: it is "
                f"replicated in {_leaves_word(len(paths))} ({_paths_text(paths)})",
                f"Add a rule for {name!r} (e.g. ({name!r}, {mesh.axis_names[-1]!r}) if it is "
                f"free), or ({name!r}, None) to keep it whole on purpose.",
                "no-rule",
            )
        )

    if any_logical:
        for i, (name, axes) in zip(index_map, rules, strict=True):
            if placed.get(i) or axes is None:  # an unused ('name', None) changes nothing
                continue
            seen = skipped.get(i)
            if seen:
                message = (
                    f"{_fmt_rule(i, (name, axes))} is never used: it named {name!r} in "
                    f"{_leaves_word(len(seen))} ({_paths_text(seen)}) and was skipped each time"
                )
            else:
                message = (
                    f"{_fmt_rule(i, (name, axes))} is never used: no array dimension is "
                    f"named {name!r}"
                )
            warnings.append(
                Problem(
                    "warning",
                    f"rules[{i}]",
                    message,
                    "Remove it, or keep it if it is meant for activations "
                    "(with_logical_constraint).",
                    "dead-rule",
                )
            )

    if plan.leaves:
        for axis, size in mesh.shape.items():
            if size > 1 and axis not in used_axes:
                warnings.append(
                    Problem(
                        "warning",
                        f"mesh/{axis}",
                        f"mesh axis {axis!r} (size {size}) shards no array: the {size} "
                        f"positions along it hold the same bytes",
                        f"Map a logical name to {axis!r} in the rules (e.g. FSDP: "
                        f"('embed', {axis!r})), or keep it if {axis!r} only splits the batch.",
                        "idle-axis",
                    )
                )
    return errors + warnings


def _axes(entry: Any) -> tuple[str, ...]:
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, tuple):
        return entry
    return ()


def _replicated(path: str, layout: Any, mesh: MeshInfo) -> Problem:
    named = [d for d in layout.dims if d.status == "no-rule"]
    if named:
        hint = f"Add a rule for {', '.join(repr(d.name) for d in named)}."
    elif layout.kind == "unboxed":
        hint = "Box it (with_partitioning / with_logical_partitioning) to shard a dimension."
    else:
        hint = "Name a mesh axis (or a logical name with a rule) for one of its dimensions."
    return Problem(
        "warning",
        path,
        f"{_human(layout.bytes)} array {layout.shape} {layout.dtype} is fully replicated: "
        f"each of the {mesh.size} devices holds all of it",
        hint,
        "replicated",
    )


def raise_for_errors(problems: Sequence[Problem], mesh: MeshInfo) -> None:
    """Raises one :class:`ShardingValidationError` listing every error, if there are any.

    Example:
        >>> from meshplan._check import Problem, raise_for_errors
        >>> from meshplan._plan import mesh_info
        >>> raise_for_errors([Problem("warning", "w", "m", "f", "replicated")], mesh_info({"x": 2}))
    """
    errors = [p for p in problems if p.severity == "error"]
    if not errors:
        return
    n = len(errors)
    header = (
        f"The sharding plan has {n} error{'s' if n != 1 else ''}. The mesh has shape "
        f"{mesh.shape}, axis names {mesh.axis_names!r} ({mesh.size} devices):"
    )
    lines = [f"{p.path}: {p.message}" for p in errors[:_MAX_BULLETS]]
    if n > _MAX_BULLETS:
        lines.append(f"... and {n - _MAX_BULLETS} more (meshplan.check(...) lists them all)")
    fixes = list(dict.fromkeys(p.fix for p in errors))
    if len(fixes) > 8:
        fixes = [*fixes[:8], f"... ({len(fixes) - 8} more)"]
    fix = "To fix:\n" + "\n".join(f"  - {f}" for f in fixes)
    error = ShardingValidationError(problem_message(header, lines, fix))
    error.problems = list(problems)  # type: ignore[attr-defined]
    raise error


def check(
    tree: Any,
    mesh: Any,
    rules: Any = None,
    *,
    strict: bool = False,
    replicated_threshold_bytes: int = DEFAULT_REPLICATED_THRESHOLD,
) -> list[Problem]:
    """Finds every problem in how ``tree`` would be sharded on ``mesh``.

    Errors: a dimension whose size does not divide by its mesh axes (with the
    nearest padded size), names whose length differs from the rank, a mesh
    axis the mesh lacks, one mesh axis on two dimensions, rules that are not
    ``(name, axes)`` pairs, a rule naming a mesh axis the mesh lacks, logical
    names with no rules at all. Warnings: a logical name that no rule places
    (replicated), a rule no leaf uses, a mesh axis that shards nothing, an
    array of at least ``replicated_threshold_bytes`` held whole by every device.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(
        ...     jax.ShapeDtypeStruct((1000, 6), jnp.float32), ("embed", "hidden"))}}
        >>> rules = (("embed", "data"), ("hidden", "model"))
        >>> for p in meshplan.check(tree, mesh, rules):
        ...     print(p.severity, p.path, p.code)
        error params/w indivisible
        >>> meshplan.check(tree, mesh, rules, strict=True)
        Traceback (most recent call last):
        ...
        meshplan._errors.ShardingValidationError: The sharding plan has 1 error. ...
          * params/w: dim 1 ('hidden') of size 6 does not divide by 4 (mesh axis 'model' of size 4)
        To fix:
          - Pad dim 1 to 8 (the nearest multiple of 4), or map it to mesh axes whose size divides 6.

    Args:
        tree: What :func:`meshplan.explain` takes.
        mesh: A ``Mesh``, ``AbstractMesh`` or mapping of axis sizes.
        rules: Logical axis rules; ``None`` uses the active ones.
        strict: Raise one :class:`ShardingValidationError` listing every error
            (warnings do not raise).
        replicated_threshold_bytes: Size from which a fully replicated array
            is reported.

    Returns:
        The problems, errors first.

    Raises:
        ShardingValidationError: ``strict`` and at least one error.
    """
    plan = explain(tree, mesh, rules)
    problems = find_problems(plan, replicated_threshold_bytes)
    if strict:
        raise_for_errors(problems, plan.mesh)
    return problems


def check_specs(tree: Any, mesh: Any, rules: Any = None, *, strict: bool = False) -> list[Problem]:
    """:func:`check` for a tree of logical ``PartitionSpec``s (no shapes, so no sizes).

    Example:
        >>> import meshplan
        >>> from jax.sharding import PartitionSpec as P
        >>> from meshplan._check import check_specs
        >>> [p.path for p in check_specs({"w": P("embed")}, {"data": 2}, (("embed", "dta"),))]
        ['rules[0]', 'mesh/data']
    """
    plan = explain_specs(tree, mesh, rules)
    problems = find_problems(plan)
    if strict:
        raise_for_errors(problems, plan.mesh)
    return problems
