"""Totals of a plan: bytes in all and on each device, for every leaf and by group."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from meshplan._plan.records import LeafPlan

__all__ = ["GROUPS", "Totals", "group_totals"]

GROUPS = ("params", "optimizer", "other")
"""Groups that totals are split by (see :func:`meshplan.explain` for how leaves are classified)."""


@dataclasses.dataclass(frozen=True)
class Totals:
    """Bytes of a group of leaves, in all and per device.

    Attributes:
        leaves: How many array leaves.
        bytes: Bytes of all the arrays (one copy of each).
        device_bytes: Bytes each device holds, in mesh order.
        max_device_bytes: Bytes on the fullest device.
        ideal_bytes: ``bytes / number of devices``, rounded up: the fullest
            device's bytes under a perfect split with no replication.
    """

    leaves: int
    bytes: int
    device_bytes: tuple[int, ...]
    max_device_bytes: int
    ideal_bytes: int

    @property
    def efficiency(self) -> float:
        """``ideal_bytes / max_device_bytes``: 1.0 when nothing is replicated or uneven."""
        return 1.0 if self.max_device_bytes == 0 else self.ideal_bytes / self.max_device_bytes

    def to_dict(self) -> dict[str, object]:
        """The ``totals[group]`` entry of the JSON schema (``docs/plan.md``)."""
        return {
            "leaves": self.leaves,
            "bytes": self.bytes,
            "max_device_bytes": self.max_device_bytes,
            "ideal_bytes": self.ideal_bytes,
            "device_bytes": list(self.device_bytes),
        }


def group_totals(leaves: Sequence[LeafPlan], n_devices: int) -> dict[str, Totals]:
    """:class:`Totals` for ``'all'`` and for each group in :data:`GROUPS`, in that order.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._plan.totals import group_totals
        >>> tree = {"params": {"w": meshplan.Partitioned(
        ...     jax.ShapeDtypeStruct((6,), jnp.float32), ("x",))}}
        >>> plan = meshplan.explain(tree, {"x": 4})
        >>> group_totals(plan.leaves, 4)["params"].device_bytes
        (8, 8, 8, 0)
    """
    count = dict.fromkeys(GROUPS, 0)  # leaves
    nbytes = dict.fromkeys(GROUPS, 0)  # bytes of the arrays
    even = dict.fromkeys(GROUPS, 0)  # bytes on every device, from evenly split leaves
    uneven = {g: np.zeros(n_devices, dtype=np.int64) for g in GROUPS}  # per device, the others
    for leaf in leaves:
        g, lay = leaf.group, leaf._layout
        count[g] += 1
        nbytes[g] += lay.bytes
        if lay.device_bytes is None:
            even[g] += lay.bytes_per_device
        else:
            uneven[g] += lay.device_bytes
    groups = {g: (count[g], nbytes[g], uneven[g] + even[g]) for g in GROUPS}
    everything = (
        sum(count.values()),
        sum(nbytes.values()),
        sum((d for _, _, d in groups.values()), np.zeros(n_devices, dtype=np.int64)),
    )
    return {
        "all": _make_totals(*everything, n_devices),
        **{g: _make_totals(*groups[g], n_devices) for g in GROUPS},
    }


def _make_totals(count: int, nbytes: int, device_bytes: npt.NDArray[np.int64], n: int) -> Totals:
    dev = tuple(int(b) for b in device_bytes)
    return Totals(count, int(nbytes), dev, max(dev, default=0), -(-int(nbytes) // n))
