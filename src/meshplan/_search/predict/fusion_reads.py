"""The bytes XLA's loop fusions read: each kernel reads every buffer its computation starts from.

:mod:`meshplan._search.predict.trace` counts a value's bytes where it leaves a fusion (written
once, read by each consumer that is a kernel of its own: a collective, a gather, a loop). A
loop fusion also *reads*: every buffer in memory its elementwise computation starts from,
once per kernel, and XLA makes one kernel per value written to memory, duplicating the cheap
elementwise work before it rather than sharing it (Adam's update of one parameter is three
kernels on XLA:CPU, reading the gradient, the two moments and the parameter: ten times the
parameter's bytes, where the written values alone are three). A reduction is a kernel of its
own too (its result a buffer the next kernel reads, beside the values it reduced).

:class:`FusionReads` follows the walk: per value computed inside a fusion, the buffers it is
made from (:meth:`leaves`); where a value is written to memory, or reduced, those buffers
are read once (:meth:`reads`). Checked against XLA's ``compiled.cost_analysis()['bytes
accessed']`` on the suite of ``tests/xla_suite.py`` (``benchmarks/bench_xla_suite.py
--decompose``).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Any, TypeGuard

from meshplan._search.predict.primitives import KINDS

__all__ = ["REDUCTIONS", "FusionReads"]

REDUCTIONS = KINDS["reduction"]
"""Reductions: on XLA a fusion ends at one (its result a buffer the next kernel reads)."""

Cell = tuple[Any, tuple[int, ...], bool]


class FusionReads:
    """The buffers each value computed inside a fusion is made from, during one walk.

    ``leaf``: a buffer in memory (a value written by a kernel, an input of the walked
    program) ``{var: (cell, bytes)}``, the cell as :attr:`Workload.traffic` keys it;
    ``made_from``: a fused value ``{var: buffers}``.

    Example:
        >>> from meshplan._search.predict.fusion_reads import FusionReads
        >>> reads = FusionReads()
        >>> reads.buffer("x", (("batch",), (8,), False), 32)
        >>> reads.fused("y", ["x", "x"])            # y = x * x, not written
        >>> reads.reads(["y", 2.0])                  # a kernel computing from y reads x once
        [((('batch',), (8,), False), 32)]
    """

    def __init__(self) -> None:
        self.leaf: dict[Hashable, tuple[Cell, int]] = {}
        self.made_from: dict[Hashable, frozenset[Hashable]] = {}
        # a loop's or call's inputs computed from no input outside (a mask from iotas):
        # computed in each kernel that reads them, as outside, never a buffer
        self.computed: set[Hashable] = set()

    def buffer(self, var: Hashable, cell: Cell, nbytes: int) -> None:
        """``var`` is in memory (written by a kernel, or an input): a kernel reads it whole."""
        self.leaf[var] = (cell, nbytes)
        self.made_from.pop(var, None)

    def known(self, var: Hashable) -> bool:
        """Whether ``var`` is a buffer, made from some, or computed in its kernels."""
        return var in self.leaf or var in self.made_from or var in self.computed

    def leaves(self, invars: Iterable[object]) -> frozenset[Hashable]:
        """The buffers values ``invars`` are computed from (unknown values: none)."""
        out: set[Hashable] = set()
        for v in invars:
            if not _hashable(v):
                continue
            if v in self.leaf:
                out.add(v)
            else:
                out.update(self.made_from.get(v, ()))
        return frozenset(out)

    def fused(self, var: Hashable, invars: Sequence[object]) -> None:
        """``var`` is computed inside a fusion from ``invars``: not written, made from
        their buffers."""
        self.made_from[var] = self.leaves(invars)

    def same(self, outer: Hashable, inner: object) -> None:
        """``outer`` is ``inner`` (a call's result, a constraint's value)."""
        if _hashable(inner) and inner in self.leaf:
            self.leaf[outer] = self.leaf[inner]
        elif _hashable(inner) and inner in self.made_from:
            self.made_from[outer] = self.made_from[inner]

    def reads(self, invars: Sequence[object]) -> list[tuple[Cell, int]]:
        """``(cell, bytes)`` a kernel computing from ``invars`` reads: each buffer once."""
        return [self.leaf[v] for v in self.leaves(invars)]


def _hashable(v: object) -> TypeGuard[Hashable]:
    try:
        hash(v)
    except TypeError:
        return False
    return True
