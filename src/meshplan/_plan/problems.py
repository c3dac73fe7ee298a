"""Finding the problems of a sharding plan: every one at once, each with its path and its fix."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from meshplan._errors import Problem
from meshplan._spmd.mesh_info import MeshInfo
from meshplan._spmd.tree_check import (
    no_names_problem,
    no_rules_problem,
    only_unmatched,
    rule_axis_problems,
)
from meshplan._text import count_text, human_bytes, paths_text, rule_text

if TYPE_CHECKING:
    from meshplan._plan.plan_data import PlanData
    from meshplan._plan.records import LeafLayout

__all__ = ["DEFAULT_REPLICATED_THRESHOLD", "find_problems"]

DEFAULT_REPLICATED_THRESHOLD = 1 << 20
"""Arrays of at least this many bytes that every device holds whole are reported (1 MiB)."""


ACTIVATION_NAMES = frozenset({"batch", "length", "seq", "sequence", "stage"})
"""Logical names that, by convention, name activations, not parameters (Flax's guide,
MaxText's ``activation_*`` too; ``stage``, the pipeline's stage dimension of activations
and of the layers as the step splits them): a rule for one of them places no array of the
state, and that is how it should be."""


def _names_activations(name: str) -> bool:
    return name in ACTIVATION_NAMES or name.startswith("activation_")


def _leaves_text(n: int) -> str:
    return count_text(n, "leaf", "leaves")


def find_problems(
    plan: PlanData, replicated_threshold_bytes: int = DEFAULT_REPLICATED_THRESHOLD
) -> list[Problem]:
    """Every problem of ``plan``: errors first, then warnings, each in tree/rule order.

    A tree in which no array carries a name, with rules given, is said first (code
    ``'no-names'``), and then not again per array or mesh axis: the rules place nothing
    because nothing is named, not because a rule or an axis is missing.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._plan.problems import find_problems
        >>> tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((6,), jnp.float32), ("x",))}
        >>> [p.code for p in find_problems(meshplan.explain(tree, {"x": 4}))]
        ['indivisible']
    """
    errors: list[Problem] = []
    warnings: list[Problem] = []
    mesh = plan.mesh

    errors.extend(plan.rule_problems)

    # Leaves that share a layout share their analysis.
    leaf_errors: list[Problem] = []
    groups: dict[int, tuple[LeafLayout, list[str]]] = {}
    for leaf in plan.leaves:
        entry = groups.get(id(leaf._layout))
        if entry is None:
            groups[id(leaf._layout)] = (leaf._layout, [leaf.path])
        else:
            entry[1].append(leaf.path)

    rules = plan.rules or ()
    named_any = any(layout.kind != "unboxed" for layout, _ in groups.values())
    no_names = bool(rules) and bool(groups) and not named_any
    index_map = plan.rule_index_map
    placed = dict.fromkeys(index_map, 0)
    skipped: dict[int, list[str]] = {}
    rule_paths: dict[int, list[str]] = {}
    unmatched: dict[str, list[str]] = {}
    used_axes: set[str] = set()
    logical_without_rules: list[str] = []
    infos: list[Problem] = []
    for layout, paths in groups.values():
        for issue in layout.issues:
            found = leaf_errors if issue.severity == "error" else infos
            found.extend(dataclasses.replace(issue, path=path) for path in paths)
        if layout.kind == "logical" and not rules and only_unmatched(layout.dims):
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
            and not no_names
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
        errors.append(no_rules_problem(logical_without_rules))
    errors.extend(rule_axis_problems(rules, index_map, mesh, rule_paths))

    any_logical = any(layout.kind == "logical" for layout, _ in groups.values())
    for name, paths in unmatched.items():
        skips = sorted(
            {
                f"rule {s.rule_index}"
                for layout, ps in groups.values()
                for d in layout.dims
                if d.name == name
                for s in d.skipped
            }
        )
        why = f" ({', '.join(skips)} named it but {'was' if len(skips) == 1 else 'were'} skipped)"
        warnings.append(
            Problem(
                "warning",
                paths[0],
                f"logical name {name!r} is placed by no rule{why if skips else ''}: it is "
                f"replicated in {_leaves_text(len(paths))} ({paths_text(paths)})",
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
                    f"{rule_text(i, (name, axes))} is never used: it named {name!r} in "
                    f"{_leaves_text(len(seen))} ({paths_text(seen)}) and was skipped each time"
                )
            else:
                message = (
                    f"{rule_text(i, (name, axes))} is never used: no array dimension is "
                    f"named {name!r}"
                )
            activation = not seen and _names_activations(name)
            (infos if activation else warnings).append(
                Problem(
                    "info" if activation else "warning",
                    f"rules[{i}]",
                    message + (" (it names activations)" if activation else ""),
                    "Nothing to do: with_logical_constraint uses it."
                    if activation
                    else "Remove it, or keep it if it is meant for activations "
                    "(with_logical_constraint).",
                    "dead-rule",
                )
            )

    splits_activations = {
        a
        for name, axes in rules
        if _names_activations(name)
        for a in ((axes,) if isinstance(axes, str) else (axes or ()))
    }
    if no_names:  # said first, once: not again as idle axes or replicated arrays
        nbytes = sum(leaf._layout.bytes for leaf in plan.leaves)
        paths = [leaf.path for leaf in plan.leaves]
        return [no_names_problem(paths, nbytes), *errors, *warnings, *infos]
    if plan.leaves and named_any:
        for axis, size in mesh.shape.items():
            if size > 1 and axis not in used_axes and axis in splits_activations:
                infos.append(
                    Problem(
                        "info",
                        f"mesh/{axis}",
                        f"mesh axis {axis!r} (size {size}) shards no array of the state: it "
                        f"splits activations only (data parallelism)",
                        "Nothing to do; for FSDP map a parameter name to it, e.g. "
                        f"('embed', {axis!r}).",
                        "idle-axis",
                    )
                )
            elif size > 1 and axis not in used_axes:
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
    return errors + warnings + infos


def _replicated(path: str, layout: LeafLayout, mesh: MeshInfo) -> Problem:
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
        f"{human_bytes(layout.bytes)} array {layout.shape} {layout.dtype} is fully replicated: "
        f"each of the {mesh.size} devices holds all of it",
        hint,
        "replicated",
    )
