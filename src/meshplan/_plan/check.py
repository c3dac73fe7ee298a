"""Checking a sharding plan: :func:`check` lists its problems, or raises them all in one error."""

from __future__ import annotations

from jax.sharding import AbstractMesh

from meshplan._errors import Problem
from meshplan._plan.explain import explain
from meshplan._plan.problems import DEFAULT_REPLICATED_THRESHOLD, find_problems
from meshplan._spmd.mesh_info import MeshLike
from meshplan._spmd.nnx_check import nnx_problems
from meshplan._spmd.rules import LogicalRules
from meshplan._spmd.tree_check import raise_for_errors
from meshplan._types import PyTree

__all__ = ["check"]


def check(
    tree: PyTree,
    mesh: MeshLike,
    rules: LogicalRules | None = None,
    *,
    strict: bool = False,
    replicated_threshold_bytes: int = DEFAULT_REPLICATED_THRESHOLD,
) -> list[Problem]:
    """Finds every problem in how ``tree`` would be sharded on ``mesh``.

    Errors: a dimension whose size does not divide by its mesh axes (with the
    nearest padded size), more names than the array has dimensions, a mesh
    axis the mesh lacks, one mesh axis on two dimensions, rules that are not
    ``(name, axes)`` pairs, a rule naming a mesh axis the mesh lacks, logical
    names with no rules at all. Warnings: a logical name that no rule places
    (replicated), a rule no leaf uses, a mesh axis that shards nothing, an
    array of at least ``replicated_threshold_bytes`` held whole by every device,
    an ``AbstractMesh`` (its shardings work in ``jax.jit`` only under
    ``jax.set_mesh``). Information: fewer names than dimensions (the trailing
    ones are unsharded, as with a shorter ``PartitionSpec``).

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
    # Flax NNX variables: where Flax's own semantics would place them otherwise, and the like.
    nnx_warnings = nnx_problems(tree, plan.rules)
    if nnx_warnings:
        infos = [p for p in problems if p.severity == "info"]
        problems = [p for p in problems if p.severity != "info"] + nnx_warnings + infos
    if isinstance(mesh, AbstractMesh):
        problems.insert(
            sum(p.severity == "error" for p in problems), _abstract_mesh_warning(plan.mesh.shape)
        )
    if strict:
        raise_for_errors(problems, plan.mesh)
    return problems


def _abstract_mesh_warning(shape: dict[str, int]) -> Problem:
    return Problem(
        "warning",
        "mesh",
        f"the mesh {shape} is an AbstractMesh: the NamedShardings get_sharding builds on it "
        f"work in jax.jit only under jax.set_mesh of a concrete mesh (elsewhere jit fails with "
        f"'lowering_platforms ... AbstractMesh')",
        "Pass the concrete jax.sharding.Mesh (jax.make_mesh(...)), or jit inside "
        "`with jax.set_mesh(mesh):`.",
        "abstract-mesh",
    )
