"""What a generated candidate's checks depend on through its rules alone, found once per rules.

:func:`meshplan.search_rules` generates many mesh shapes of the same axes under the same
rules (``8x768`` and ``16x384`` of ``fsdp,tensor``...). Where every mesh axis the rules
name splits (a size above 1), each array's spec, where each axis splits (the symmetry
signature), the axes used and which dimensions must divide by which axes do not depend
on the sizes: a :class:`RuleRecord` holds them, keyed once per rules, and each candidate
only multiplies its sizes in. Every answer is the one the per-candidate functions of
:mod:`meshplan._search.search.rule_search` give (``tests/search/test_search_rules.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from meshplan._search.predict.cost import Resolved, Spec, _Specs
from meshplan._search.predict.trace import Names
from meshplan._spmd.rules import RulePairs, logical_to_mesh_axes, mesh_axes_of

__all__ = ["Places", "RuleRecord", "signature_key"]

Places = dict[tuple[tuple[int, int], ...], int]
"""Where an axis splits the arrays ((array, dimension) pairs), as a small int: one per
distinct place in a search, so that signatures hash and compare as ints."""


def signature_key(
    sizes: Mapping[str, int], place: Mapping[str, int], hierarchical: bool
) -> tuple[tuple[int, int], ...]:
    """The symmetry signature of a mesh of ``sizes`` whose axes split at ``place``:
    ``(size, place)`` per axis above 1 in mesh order where the links differ by position
    (``hierarchical``), else per place, the axes that split the same place merged into
    one of their product, sorted."""
    if hierarchical:
        return tuple((s, place[a]) for a, s in sizes.items() if s > 1)
    merged: dict[int, int] = {}
    for a, s in sizes.items():
        if s > 1:
            merged[place[a]] = merged.get(place[a], 1) * s
    return tuple(sorted((size, p) for p, size in merged.items()))


def place_ids(
    where: Mapping[str, tuple[tuple[int, int], ...]], axes: list[str], places: Places
) -> dict[str, int]:
    """Each of ``axes``' place (``where``, empty where it splits nothing) as its int in
    ``places`` (added when new)."""
    return {a: places.setdefault(where.get(a, ()), len(places)) for a in axes}


class RuleRecord:
    """One generated rules' answers, valid for every mesh on which each axis they name
    splits (:meth:`applies`).

    ``specs``: each array's spec (the :class:`meshplan._search.predict.cost._Specs` cache the
    candidates share); ``place``: where each named axis splits (:data:`Places`);
    ``used``: the axes that split a state array, the batch or an activation; ``clean``:
    only a dimension that does not divide can make such a candidate invalid (the rules
    and the leaves have no error of their own); ``divides``: per group of axes that
    split a leaf's dimension, the gcd of those dimensions and each ``(leaf index, size)``;
    ``batch_axes``: the axes of the batch's first dimension; ``entries``: each array's
    resolved ``PartitionSpec`` entries, as the validator's cache keys them.
    """

    __slots__ = (
        "axes",
        "batch_axes",
        "clean",
        "divides",
        "entries",
        "named",
        "place",
        "rules",
        "specs",
        "used",
    )

    def __init__(
        self,
        rules: RulePairs,
        resolved: Resolved,
        leaves: list[tuple[Names, tuple[int, ...]]],
        sig_arrays: list[tuple[Names, tuple[int, ...]]],
        batch_names: Names,
        acts: Names,
        clean: bool,
        places: Places,
    ) -> None:
        self.rules = rules
        self.named = tuple(dict.fromkeys(a for _, axes in rules for a in mesh_axes_of(axes)))
        self.axes = frozenset(self.named)
        self.specs: dict[Names, Spec] = {}
        # Any sizes above 1: where every named axis splits, the specs do not depend on them.
        specs = _Specs({a: 2 for a in self.named}, rules, resolved, True, self.specs, True)
        found: dict[str, list[tuple[int, int]]] = {}
        for i, (names, shape) in enumerate([*sig_arrays, (batch_names, (0,) * len(batch_names))]):
            for d, axes in enumerate(specs(names, len(shape))):
                for a in axes:
                    found.setdefault(a, []).append((i, d))
        self.place = place_ids({a: tuple(w) for a, w in found.items()}, list(self.named), places)
        used = {a for names, shape in leaves for axes in specs(names, len(shape)) for a in axes}
        used |= {a for axes in specs(batch_names, len(batch_names)) for a in axes}
        used |= {a for axes in specs(acts, len(acts)) for a in axes}
        self.used = frozenset(used)
        self.clean = clean
        groups: dict[tuple[str, ...], list[tuple[int, int]]] = {}
        for i, (names, shape) in enumerate(leaves):
            for size, axes in zip(shape, specs(names, len(shape)), strict=True):
                if axes:
                    groups.setdefault(axes, []).append((i, size))
        self.divides = tuple(
            (axes, math.gcd(*(s for _, s in at)), tuple(at)) for axes, at in groups.items()
        )
        self.batch_axes = specs(batch_names, len(batch_names))[0]
        self.entries: dict[Names, tuple[object, ...]] = {}

    def applies(self, sizes: Mapping[str, int]) -> bool:
        """Whether every axis the rules name is in the mesh and splits, and they name every
        axis of the mesh."""
        return sizes.keys() == self.axes and all(s > 1 for s in sizes.values())

    def first_indivisible(self, sizes: Mapping[str, int]) -> int | None:
        """The index of the first leaf with a dimension its axes' sizes do not divide, or
        None: :func:`meshplan._search.search.rule_search._divides`'s answer."""
        first: int | None = None
        for axes, gcd, at in self.divides:
            split = 1
            for a in axes:
                split *= sizes[a]
            if gcd % split:
                i = next(i for i, size in at if size % split)
                first = i if first is None else min(first, i)
        return first

    def entries_of(self, names: Names) -> tuple[object, ...]:
        """``logical_to_mesh_axes(names, rules)``'s entries, resolved once per names."""
        got = self.entries.get(names)
        if got is None:
            got = self.entries[names] = tuple(logical_to_mesh_axes(names, self.rules))
        return got
