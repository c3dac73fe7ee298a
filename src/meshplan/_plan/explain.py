"""Sharding plans: where each array of a tree goes on a mesh, why, and what it costs.

:func:`explain` walks a tree the way :func:`meshplan.get_sharding` does and
records, for every array leaf, the rule that placed each dimension (and the
rules that named it but were skipped), the resulting mesh spec, the shard each
device holds and the bytes that costs. A :class:`Plan` prints as a table,
serialises to a stable JSON schema (``docs/plan.md``) and draws itself as a
PNG; :func:`meshplan.check` turns it into a list of problems.

This module turns the one walk (:func:`meshplan._spmd.leaves.array_leaves`) into
plan records: paths and groups, and one layout per distinct (kind, names,
shape, dtype, rules), each checked by the one validator
(:func:`meshplan._spmd.validate.check_leaf`, through ``_plan.layout``). The
records are in ``_plan.records``, the :class:`Plan` object in ``_plan.plan``.
"""

from __future__ import annotations

from typing import Any

from meshplan._errors import Problem
from meshplan._plan.layout import build_layout
from meshplan._plan.plan import Plan
from meshplan._plan.records import LeafLayout, LeafPlan
from meshplan._spmd.leaves import array_leaves
from meshplan._spmd.mesh_info import MeshInfo, MeshLike, mesh_info
from meshplan._spmd.rules import LogicalRules, get_logical_axis_rules, rules_problems
from meshplan._text import path_text
from meshplan._types import PyTree

__all__ = ["explain"]


def _mesh_and_rules(
    mesh: MeshLike | MeshInfo, rules: LogicalRules | None
) -> tuple[MeshInfo, tuple[tuple[str, Any], ...], tuple[int, ...], list[Problem]]:
    """The mesh's :class:`MeshInfo`; the valid rules of ``rules`` (else the active ones), their
    indices as given, and the validator's problem with each invalid one."""
    info = mesh_info(mesh)
    valid, index_map, problems = rules_problems(
        get_logical_axis_rules() if rules is None else rules
    )
    return info, valid, index_map, problems


def _key_str(key: object) -> str:
    """One key's part of the path (``path_text`` of the whole path joins these with '/')."""
    return path_text((key,))


_GROUP_OF_PART = {"opt_state": "optimizer", "params": "params"}


def explain(tree: PyTree, mesh: MeshLike, rules: LogicalRules | None = None) -> Plan:
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
    info, rules, index_map, rule_problems = _mesh_and_rules(mesh, rules)
    flat, skipped = array_leaves(tree, rules)

    cache: dict[object, LeafLayout] = {}
    key_text: dict[object, str] = {}
    leaves: list[LeafPlan] = []
    for leaf in flat:
        kind, names, shape, dtype, own_rules = (
            leaf.kind,
            leaf.names,
            leaf.shape,
            leaf.dtype,
            leaf.own_rules,
        )
        keypath = leaf.keypath
        key: tuple[object, ...] | None = (kind, names, shape, dtype, own_rules)
        try:
            layout = cache.get(key)
        except TypeError:  # unhashable names
            key, layout = None, None
        if layout is None:
            if own_rules is not None and kind == "logical":
                r, m, _ = rules_problems(own_rules)
            else:
                r, m = rules, index_map
            layout = build_layout(kind, names, shape, dtype, r, m, info)
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
