"""One jitted reduction per device set: a small row per array, computed where the array lives.

:mod:`meshplan._checkpoint.finite` (is each array finite) and
:mod:`meshplan._checkpoint.checksum` (each array's checksum) both reduce every
array of a state to a few numbers. :func:`reduce_arrays` groups the arrays by
where they live (the mesh of a ``NamedSharding``, else the set of devices), runs
one compiled program per group with a replicated result (so every process of a
multi-process run can read it), and brings only those rows to the host. The
program is compiled once per function, device set and state structure.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

__all__ = ["reduce_arrays"]

Rows = Callable[[Sequence[jax.Array]], jax.Array]
"""Arrays to one stacked row per array (``jnp.stack([...])``)."""


@functools.lru_cache(maxsize=16)
def _jitted(rows: Rows, mesh: Any) -> Any:
    """``rows`` jitted: with a replicated result on ``mesh``, or as it is (``mesh=None``)."""
    if mesh is None:
        return jax.jit(rows)
    return jax.jit(rows, out_shardings=NamedSharding(mesh, PartitionSpec()))


def _group_key(value: jax.Array) -> object:
    sharding = value.sharding
    if isinstance(sharding, NamedSharding):
        return ("mesh", sharding.mesh)
    ids = sorted(int(d.id) for d in sharding.device_set)  # type: ignore[attr-defined]
    return ("devices", tuple(ids))


def reduce_arrays(arrays: Mapping[str, jax.Array], rows: Rows) -> dict[str, np.ndarray]:
    """``rows`` over ``arrays``, one program per device set: each array's row, by path.

    Every process of a multi-process run must call it together (like saving).

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan._checkpoint.reduction import reduce_arrays
        >>> def sizes(arrays): return jnp.stack([jnp.float32(x.size) for x in arrays])
        >>> {k: float(v) for k, v in reduce_arrays({"a": jnp.ones(3), "b": jnp.ones(2)},
        ...                                         sizes).items()}
        {'a': 3.0, 'b': 2.0}
    """
    groups: dict[Any, list[tuple[str, jax.Array]]] = {}
    for key, value in arrays.items():
        groups.setdefault(_group_key(value), []).append((key, value))
    out: dict[str, np.ndarray] = {}
    for (kind, where), items in groups.items():
        result = _jitted(rows, where if kind == "mesh" else None)([value for _, value in items])
        # Replicated: any shard this process holds is the whole answer.
        host = np.asarray(result.addressable_shards[0].data)
        out.update((key, row) for (key, _), row in zip(items, host, strict=True))
    return out
