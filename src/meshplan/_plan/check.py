"""Checking a sharding plan: :func:`check` lists its problems, or raises them all in one error."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshplan._errors import Problem, ShardingValidationError, problem_message
from meshplan._plan.explain import explain, explain_specs
from meshplan._plan.problems import DEFAULT_REPLICATED_THRESHOLD, find_problems
from meshplan._spmd.mesh_info import MeshInfo

__all__ = ["check", "check_specs", "raise_for_errors"]

_MAX_BULLETS = 40


def raise_for_errors(problems: Sequence[Problem], mesh: MeshInfo) -> None:
    """Raises one :class:`ShardingValidationError` listing every error, if there are any.

    Example:
        >>> from meshplan._plan.check import Problem, raise_for_errors
        >>> from meshplan._spmd.mesh_info import mesh_info
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
        meshplan.ShardingValidationError: The sharding plan has 1 error. ...
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
        >>> from meshplan._plan.check import check_specs
        >>> [p.path for p in check_specs({"w": P("embed")}, {"data": 2}, (("embed", "dta"),))]
        ['rules[0]', 'mesh/data']
    """
    plan = explain_specs(tree, mesh, rules)
    problems = find_problems(plan)
    if strict:
        raise_for_errors(problems, plan.mesh)
    return problems
