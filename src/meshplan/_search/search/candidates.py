"""Candidates in rule space: mesh shapes with roles, and the rules that give each name an axis.

A generated candidate gives each mesh axis (1 to 3 of them, every size > 1)
one *role*, and names the axis after it:

* ``data``: splits the batch (``'batch'``) only;
* ``fsdp``: splits the batch and one parameter name ``F`` (ZeRO-3: the state is
  sharded, each weight gathered before use);
* ``tensor``: splits a set ``T`` of parameter names (Megatron-style: heads, MLP,
  vocabulary), never the batch;
* ``context``: splits the sequence of the activations (a name of
  :data:`CONTEXT_NAMES` the model uses: ``length``, ``seq``...), never a parameter
  (context parallelism: keys and values are gathered, or passed round a ring);
* ``expert``: splits the parameters named ``expert`` (a mixture of experts' weights) and
  the batch (expert parallelism: tokens go to their experts by all-to-all); the
  dispatched tokens' batch (``expert_batch``) keeps the batch's other axes.

``context`` and ``expert`` are offered only to models with such names.

Its rules are ``('batch', data and fsdp axes)``, ``(F, fsdp axis)``, ``(t,
tensor axis)`` for ``t`` in ``T``, and ``None`` for every other name, batch first
so that an activation's batch dimension takes its axes before any other.
Two axes with the same role would be one axis of their product (on one
network), so a role is used once (*dominance*). Rules that split nothing over
an axis (a ``tensor`` axis with no name, an ``fsdp`` axis whose name is missing)
leave devices doing the same work: rejected as ``idle``. Candidates that differ
only by the order of axes that cross no slower link are the same candidate
(*symmetry*): the first is kept. The built-in layouts, over every shape of
their ``('data', 'model')`` mesh, come first.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Mapping, Sequence

from meshplan._search.predict.role_names import CONTEXT_NAMES, EXPERT_BATCH_NAMES, EXPERT_NAMES
from meshplan._spmd.rules import MeshAxes, RulePairs

__all__ = [
    "ALL_ROLES",
    "CONTEXT_NAMES",
    "EXPERT_BATCH_NAMES",
    "EXPERT_NAMES",
    "Candidate",
    "generate",
    "layout_candidates",
    "mesh_factorizations",
    "mesh_shapes",
]

ROLES = ("data", "fsdp", "tensor")
"""The mesh axis roles every model gets."""

ALL_ROLES = ("data", "fsdp", "tensor", "context", "expert")
"""Every role; ``context`` and ``expert`` only where the model has the names."""


@dataclasses.dataclass
class Candidate:
    """A mesh (axis name -> size) and rules; ``layout``: a built-in's name, else ``'searched'``."""

    mesh: dict[str, int]
    rules: RulePairs
    layout: str = "searched"


def mesh_shapes(devices: int, n_axes: int = 2) -> list[tuple[int, ...]]:
    """Every ordered shape of ``n_axes`` axes whose sizes multiply to ``devices`` (sizes of 1 too).

    Example:
        >>> from meshplan._search.search.candidates import mesh_shapes
        >>> mesh_shapes(8)
        [(1, 8), (2, 4), (4, 2), (8, 1)]
    """
    if n_axes == 1:
        return [(devices,)]
    divisors = [d for d in range(1, devices + 1) if devices % d == 0]
    return [(d, *rest) for d in divisors for rest in mesh_shapes(devices // d, n_axes - 1)]


def layout_candidates(
    devices: int,
    layouts: Mapping[str, RulePairs],
    axis_names: Sequence[str] = ("data", "model"),
    *,
    layouts_first: bool = False,
) -> list[Candidate]:
    """The given layouts over every shape of ``axis_names`` for ``devices``.

    Shape by shape (every layout on ``1x8``, then on ``2x4``...), or layout by layout
    with ``layouts_first``.

    Example:
        >>> from meshplan._search.search.candidates import layout_candidates
        >>> [(c.mesh, c.layout) for c in layout_candidates(2, {"dp": (("batch", "data"),)})]
        [({'data': 1, 'model': 2}, 'dp'), ({'data': 2, 'model': 1}, 'dp')]
    """
    shapes = mesh_shapes(devices, len(axis_names))
    pairs = (
        [(s, n) for n in layouts for s in shapes]
        if layouts_first
        else [(s, n) for s in shapes for n in layouts]
    )
    return [Candidate(dict(zip(axis_names, s, strict=True)), layouts[n], n) for s, n in pairs]


def mesh_factorizations(devices: int, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Every ordered way to write ``devices`` as 1 to ``max_axes`` factors, each above 1.

    Example:
        >>> from meshplan._search.search.candidates import mesh_factorizations
        >>> mesh_factorizations(8)
        [(8,), (2, 4), (4, 2), (2, 2, 2)]
    """
    out: list[tuple[int, ...]] = []

    def rec(left: int, prefix: tuple[int, ...], k: int) -> None:
        if k == 1:
            if left > 1:
                out.append((*prefix, left))
            return
        for d in range(2, left):
            if left % d == 0:
                rec(left // d, (*prefix, d), k - 1)

    for k in range(1, max_axes + 1):
        if devices == 1 and k == 1:
            out.append((1,))
        rec(devices, (), k)
    return out


def _tensor_sets(names: Sequence[str]) -> list[tuple[str, ...]]:
    """Sets of names a tensor axis splits: all subsets when few, else a structured few."""
    names = list(names)
    if len(names) <= 6:
        return [c for k in range(1, len(names) + 1) for c in itertools.combinations(names, k)]
    out = [(n,) for n in names] + [tuple(names)]
    out += [tuple(m for m in names if m != n) for n in names]
    return list(dict.fromkeys(out))


def generate(
    devices: int,
    param_names: Sequence[str],
    *,
    batch_name: str = "batch",
    other_names: Sequence[str] = (),
    max_axes: int = 3,
    roles: Sequence[str] = ROLES,
) -> Iterator[Candidate]:
    """Every generated candidate (module docstring) for ``devices``, before any pruning.

    Example:
        >>> from meshplan._search.search.candidates import generate
        >>> cands = list(generate(4, ["embed", "mlp"]))
        >>> len(cands)
        20
        >>> cands[0].mesh, cands[0].rules[0]
        ({'data': 4}, ('batch', ('data',)))

    Args:
        devices: The device count.
        param_names: Names the parameters carry that ``fsdp`` or ``tensor`` may split.
        batch_name: The batch's name.
        other_names: More names, always ``None`` (activations' ``length``, ``layer``...).
        max_axes: At most this many mesh axes.
        roles: The axis names (roles) to use, of :data:`ALL_ROLES` (``context`` and
            ``expert`` are dropped where the model lacks their names).
    """
    all_names = [batch_name, *param_names, *(n for n in other_names if n not in param_names)]
    context = [n for n in all_names if n in CONTEXT_NAMES]
    experts = [n for n in param_names if n in EXPERT_NAMES]
    expert_batch = [n for n in all_names if n in EXPERT_BATCH_NAMES]
    roles = [r for r in roles if (r != "context" or context) and (r != "expert" or experts)]
    plain = [n for n in param_names if n not in experts]

    def rules_of(axes: tuple[str, ...]) -> list[RulePairs]:
        """Every rules of a mesh of ``axes``, in order (the same for every shape)."""
        out: list[RulePairs] = []
        batch_axes = tuple(a for a in axes if a in ("data", "fsdp", "expert"))
        fsdp_names: Sequence[str | None] = plain if "fsdp" in axes else [None]
        for f in fsdp_names:
            rest = [n for n in plain if n != f]
            t_sets: list[tuple[str, ...]] = _tensor_sets(rest) if "tensor" in axes else [()]
            for t in t_sets:
                rules: list[tuple[str, MeshAxes]] = [(batch_name, batch_axes or None)]
                if "expert" in axes:
                    rules += [(n, "expert") for n in experts]
                rest_batch = tuple(a for a in batch_axes if a != "expert") or None
                rules += [(n, rest_batch) for n in expert_batch]
                if "context" in axes:
                    rules += [(n, "context") for n in context]
                if f is not None:
                    rules.append((f, "fsdp"))
                rules += [(n, "tensor") for n in t]
                given = {r[0] for r in rules}
                rules += [(n, None) for n in all_names if n not in given]
                out.append(tuple(rules))
        return out

    by_axes: dict[tuple[str, ...], list[RulePairs]] = {}  # built once, shared by the shapes
    for shape in mesh_factorizations(devices, max_axes):
        for axes in itertools.permutations(roles, len(shape)):
            mesh = dict(zip(axes, shape, strict=True))
            if axes not in by_axes:
                by_axes[axes] = rules_of(axes)
            for rules in by_axes[axes]:
                yield Candidate(dict(mesh), rules)
