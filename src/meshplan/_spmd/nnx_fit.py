"""Whether a Flax NNX variable's placement fits its value on the mesh, before Flax places it.

Flax NNX 0.12 places a variable in ``Variable.__init__`` when a mesh is active
(eager sharding): a dimension the mesh axes do not divide then fails inside JAX
(``IndivisibleError``, or ``reshard``'s ``ValueError`` on an Explicit mesh),
naming neither the variable nor its logical names. :func:`check_fit` runs the
one validator on the value's shape first, so meshplan's error comes instead:
the dimension, its logical name, the mesh axes and their sizes, and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from meshplan._errors import Problem, ShardingValidationError, error_from_problems
from meshplan._spmd.mesh_info import MeshLike, mesh_info
from meshplan._spmd.rules import NamesKind, rules_problems
from meshplan._spmd.validate import DimCheck, check_leaf, validate

__all__ = ["check_fit", "fit_problems"]


def _indivisible_fix(d: DimCheck, logical: bool) -> str:
    pad = f"Pad dim {d.index} to {d.padded_size} (the nearest multiple of {d.shards})"
    if logical and isinstance(d.name, str):
        by = f" (rules[{d.rule_index}] maps it now)" if d.rule_index is not None else ""
        return (
            f"{pad}, or put a rule for {d.name!r} first{by} that maps it to mesh axes whose "
            f"size divides {d.size}, or ({d.name!r}, None) to keep it whole."
        )
    return f"{pad}, or give dim {d.index} mesh axes whose size divides {d.size}, or None."


def fit_problems(
    names: Sequence[Any], shape: Sequence[int], mesh: MeshLike, rules: Sequence[Any]
) -> list[Problem]:
    """The errors of placing a value of ``shape`` by ``names`` on ``mesh``.

    ``names`` are logical (resolved by ``rules``) when there are rules, mesh axes
    when there are none, as in Flax NNX.

    Example:
        >>> from meshplan._spmd.nnx_fit import fit_problems
        >>> [p] = fit_problems(("embed", "hidden"), (4, 6), {"data": 2, "model": 4},
        ...                    (("embed", "data"), ("hidden", "model")))
        >>> p.code, p.message
        ('indivisible', "dim 1 ('hidden') of size 6 does not divide by 4 (mesh axis 'model' of size 4)")
        >>> p.fix
        "Pad dim 1 to 8 (the nearest multiple of 4), or put a rule for 'hidden' first (rules[1] maps it now) that maps it to mesh axes whose size divides 6, or ('hidden', None) to keep it whole."
    """
    kind: NamesKind = "logical" if rules else "mesh"
    names, shape = tuple(names), tuple(int(s) for s in shape)
    info = mesh_info(mesh)
    found = validate("", shape, names, mesh, tuple(rules), kind=kind)
    errors = [p for p in found if p.severity == "error" and p.code != "indivisible"]
    valid, index_map, _ = rules_problems(tuple(rules))
    leaf = check_leaf(kind, names, shape, valid, index_map, info)
    indivisible = [p for p in leaf.problems if p.code == "indivisible"]
    for d, p in zip([d for d in leaf.dims if not d.divides], indivisible, strict=True):
        fix = _indivisible_fix(d, kind == "logical")
        errors.append(Problem("error", "", p.message, fix, p.code))
    return errors


def check_fit(
    names: Sequence[Any], shape: Sequence[int], mesh: MeshLike, rules: Sequence[Any], what: str
) -> None:
    """Raises one ``ShardingValidationError`` for :func:`fit_problems`, if any; ``what`` opens it.

    Example:
        >>> import meshplan
        >>> from meshplan._spmd.nnx_fit import check_fit
        >>> check_fit(("hidden",), (6,), {"model": 4}, (("hidden", "model"),), "a Param")
        Traceback (most recent call last):
        ...
        meshplan.ShardingValidationError: Cannot place a Param of shape (6,) by ('hidden',) on the mesh {'model': 4}:
          * dim 0 ('hidden') of size 6 does not divide by 4 (mesh axis 'model' of size 4)
        Pad dim 0 to 8 (the nearest multiple of 4), or put a rule for 'hidden' first (rules[0] maps it now) that maps it to mesh axes whose size divides 6, or ('hidden', None) to keep it whole.
    """
    problems = fit_problems(names, shape, mesh, rules)
    if problems:
        header = (
            f"Cannot place {what} of shape {tuple(shape)} by {tuple(names)!r} on the mesh "
            f"{mesh_info(mesh).shape}:"
        )
        raise error_from_problems(ShardingValidationError, header, problems)
