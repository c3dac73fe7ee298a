"""Which floating arrays of a state hold a NaN or an infinity: one jitted reduction.

Cost: every floating array on devices goes through one compiled program (one per
device set, e.g. the run's mesh: :mod:`meshplan._checkpoint.reduction`) that reduces each to one ``bool``
(``all(isfinite(x))``), on the devices where it lives, in parallel; only those
booleans (one byte per array) come to the host. So it reads each element once
from device memory (about ``state bytes / memory bandwidth``: ~1 ms per GB on
an accelerator) and copies nothing else. The program is compiled once per
state structure (shapes, dtypes, shardings) and cached by ``jax.jit``. Calling
it waits for the computation that produced the state, as saving does anyway.
Host arrays (NumPy) are checked with NumPy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from meshplan._checkpoint.reduction import reduce_arrays

__all__ = ["nonfinite_paths"]


def _flags(arrays: Sequence[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in arrays])


def nonfinite_paths(flat: Mapping[str, tuple[object, object]]) -> list[str]:
    """Paths of the floating arrays of ``flat`` (from ``flatten_state``) that hold NaN or inf.

    Every process of a multi-process run must call it together (like saving).

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan._checkpoint.finite import nonfinite_paths
        >>> from meshplan._checkpoint.tree import flatten_state
        >>> state = {"w": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2), "n": jnp.int32(3)}
        >>> nonfinite_paths(flatten_state(state))
        ['w']
    """
    on_devices: dict[str, jax.Array] = {}
    bad: set[str] = set()
    for key, (value, _) in flat.items():
        dtype = getattr(value, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            continue
        if isinstance(value, jax.Array):
            on_devices[key] = value
        elif not np.isfinite(np.asarray(value)).all():
            bad.add(key)
    bad.update(key for key, ok in reduce_arrays(on_devices, _flags).items() if not ok)
    return [key for key in flat if key in bad]
