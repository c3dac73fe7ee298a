"""What only a Flax NNX model shows: where Flax NNX itself would place its variables otherwise.

:func:`nnx_problems` walks a tree's NNX variables and returns warnings for
:func:`meshplan.check` to add to its own (``_plan`` calls it):

- ``'flax-placement'``: Flax NNX's dict semantics (the last rule for a name
  wins, a mesh axis may repeat, a name no rule matches is kept as a mesh axis)
  give this variable another spec than meshplan's rules do, so Flax's eager
  sharding, ``nnx.get_partition_spec`` and ``nnx.get_abstract_model`` would
  place it otherwise. Both placements are in the message.
- ``'unnamed-transform-axis'``: a variable with fewer names than dimensions.
  In NNX that is what ``nnx.vmap``/``nnx.scan`` leave when their
  ``transform_metadata`` lacks ``nnx.PARTITION_NAME``: the names then sit one
  dimension off.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

from meshplan._errors import LogicalNamesError, Problem, RulesError
from meshplan._spmd.leaves import is_leaf
from meshplan._spmd.nnx import flax_placement, is_variable, variable_names, variable_spec
from meshplan._spmd.rules import LogicalRules, get_logical_axis_rules
from meshplan._text import path_text

__all__ = ["flax_rules", "nnx_problems"]


def flax_rules(
    active: Sequence[tuple[str, Any]], local: Sequence[tuple[str, Any]]
) -> tuple[dict[str, Any], list[str]]:
    """Flax's ``composite_rules``: a dict of ``active`` updated by ``local``, and the names on
    which the two disagree (Flax raises "Inconsistent logical axis annotations" for those when
    ``active`` are its own context rules; meshplan's rules are not, so :func:`nnx_problems`
    compares placements only).

    Example:
        >>> from meshplan._spmd.nnx_check import flax_rules
        >>> flax_rules((("embed", "data"), ("embed", "model")), (("embed", "data"),))
        ({'embed': 'data'}, ['embed'])
    """
    table = dict(active)
    conflicts = []
    for name, axes in local:
        if name in table and table[name] != axes:
            conflicts.append(name)
        table[name] = axes
    return table, conflicts


def _spec_text(spec: PartitionSpec) -> str:
    return repr(spec).replace("PartitionSpec", "P")


def nnx_problems(tree: Any, rules: LogicalRules | None = None) -> list[Problem]:
    """Warnings about a tree's NNX variables that only Flax NNX's own semantics explain.

    ``rules``: the rules meshplan resolves with (``None``: the active ones). Bad
    names or rules are left to the validator (:func:`meshplan.check` reports them).

    Example:
        >>> import jax, jax.numpy as jnp
        >>> from flax import nnx
        >>> from meshplan._spmd.nnx_check import nnx_problems
        >>> w = nnx.Param(jnp.ones((4, 8)), out_sharding=("embed", "hidden"), eager_sharding=False)
        >>> rules = (("embed", "data"), ("embed", "model"), ("hidden", "data"), ("hidden", "model"))
        >>> [problem] = nnx_problems(nnx.state(nnx.Dict(w=w)), rules)
        >>> problem.code, problem.path
        ('flax-placement', 'w')
        >>> print(problem.message)
        Flax NNX places out_sharding ('embed', 'hidden') as P('model', 'model'), meshplan's rules as P('data', 'model')
    """
    if not any(is_variable(x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_leaf)):
        return []  # no NNX variable: skip the walk by path (a Linen state pays one cheap pass)
    active: Any = get_logical_axis_rules() if rules is None else rules  # validated later
    try:
        active_pairs: list[tuple[str, Any]] = [tuple(r) for r in active]
    except TypeError:
        return []  # not rules at all: the validator reports that
    out: list[Problem] = []
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    for keypath, leaf in flat:
        if not is_variable(leaf):
            continue
        try:
            info = variable_names(leaf, rules)
            spec = variable_spec(leaf, rules)
        except (LogicalNamesError, RulesError, TypeError, ValueError):
            continue  # bad names or rules: the validator's errors
        if info.names is None or spec is None:
            continue
        path = path_text(keypath)
        shape = getattr(leaf.get_value(), "shape", None)
        if shape is not None and len(info.names) < len(shape):
            out.append(
                Problem(
                    "warning",
                    path,
                    f"out_sharding {info.names!r} names {len(info.names)} of the "
                    f"{len(shape)} dimensions of shape {tuple(shape)}: when nnx.vmap or "
                    f"nnx.scan adds an axis without transform_metadata="
                    f"{{nnx.PARTITION_NAME: ...}}, Flax leaves the names one dimension off",
                    "Pass transform_metadata={nnx.PARTITION_NAME: 'layers'} (or None for an "
                    "unsharded axis) to the nnx.vmap/nnx.scan that creates it; if fewer names "
                    "are meant, nothing to do (the trailing dimensions are unsharded).",
                    "unnamed-transform-axis",
                )
            )
        if info.kind != "logical":
            continue  # mesh axes: Flax and meshplan read them the same
        table, _ = flax_rules(active_pairs, info.local_rules)
        theirs = flax_placement(info.names, tuple(table.items()))
        if tuple(theirs) != tuple(spec):
            out.append(
                Problem(
                    "warning",
                    path,
                    f"Flax NNX places out_sharding {info.names!r} as {_spec_text(theirs)}, "
                    f"meshplan's rules as {_spec_text(spec)}",
                    "Nothing to do when meshplan places the model (meshplan.get_sharding, "
                    "meshplan.with_nnx_partitioning at creation); Flax's eager sharding and "
                    "nnx.get_partition_spec use the last rule for each name and keep names no "
                    "rule matches, so give each name one rule to make them agree.",
                    "flax-placement",
                )
            )
    return out
