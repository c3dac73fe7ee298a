"""The collectives of a reshard: a logical constraint that moves a value's mesh axes.

A constraint that renames a value (a mixture of experts' dispatch:
``('batch', 'length', 'embed')`` to ``('expert', 'expert_batch', 'capacity',
'embed')``) gives each of its mesh axes a new dimension, or none. Per axis of the
value before it (its *source* spec):

* the same dimension after: nothing moves;
* another dimension after: an **all-to-all** over that axis (each device keeps
  ``1/n`` of its shard and sends the rest: expert parallelism's dispatch, and its
  combine back);
* no dimension after: an **all-gather** over that axis.

An axis only the value after has is a local slice (free). Each is priced by
:func:`meshplan._search.predict.collectives.collective_time` on the bytes of the source
shard, as the HLO counts the operand.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["batch_first", "reshard_collectives"]

Spec = Sequence[Sequence[str]]


def batch_first(names: Sequence[object]) -> list[int]:
    """The order a value's dimensions take their mesh axes in: ``batch`` first (as a
    matmul's output takes them: :mod:`meshplan._search.predict.cost`), then in order.

    Example:
        >>> from meshplan._search.predict.reshard import batch_first
        >>> batch_first(("expert", "batch", "embed"))
        [1, 0, 2]
    """
    return sorted(range(len(names)), key=lambda i: names[i] != "batch")


def reshard_collectives(before: Spec, after: Spec) -> list[tuple[str, tuple[str, ...]]]:
    """``[(kind, axes)]``: the collectives that take a value from spec ``before`` to ``after``.

    Example:
        >>> from meshplan._search.predict.reshard import reshard_collectives
        >>> # dispatched tokens [expert, batch, embed]: from split by batch to split by expert
        >>> reshard_collectives([(), ("data", "expert"), ()], [("expert",), ("data",), ()])
        [('all-to-all', ('expert',))]
        >>> reshard_collectives([("data",), ("tensor",)], [("data",), ()])
        [('all-gather', ('tensor',))]
    """
    where = {a: j for j, axes in enumerate(after) for a in axes}
    moved: list[str] = []
    gathered: list[str] = []
    for i, axes in enumerate(before):
        for a in axes:
            if a not in where:
                gathered.append(a)
            elif where[a] != i:
                moved.append(a)
    out: list[tuple[str, tuple[str, ...]]] = []
    if moved:
        out.append(("all-to-all", tuple(moved)))
    if gathered:
        out.append(("all-gather", tuple(gathered)))
    return out
