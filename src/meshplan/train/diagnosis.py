"""Why a training loss is not finite: the data, the start, or a divergence.

A NaN loss has three usual causes, each with its own fix, and only the last is
the learning rate's:

* ``'data'``: the step's batch itself holds NaN or infinite values;
* ``'start'``: the first step of the run is already NaN, on the parameters it
  started from (before any update): the model or the loss computes it;
* ``'diverged'``: the loss was finite and then was not: the updates diverged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from meshplan._types import PyTree

__all__ = ["NanCause", "nan_cause", "nonfinite_leaves"]


class NanCause(NamedTuple):
    """What :func:`nan_cause` found: ``kind`` (``'data'``, ``'start'``, ``'diverged'``) and a phrase."""

    kind: str
    detail: str


def nonfinite_leaves(batch: PyTree) -> list[tuple[str, int, int]]:
    """``(path, non-finite count, size)`` of every floating array of ``batch`` that holds NaN or inf.

    Example:
        >>> import numpy as np
        >>> from meshplan.train.diagnosis import nonfinite_leaves
        >>> nonfinite_leaves({"x": np.array([1.0, np.nan, np.inf]), "y": np.arange(3)})
        [("batch['x']", 2, 3)]
    """
    out = []
    for path, x in jax.tree_util.tree_leaves_with_path(batch):
        dtype = getattr(x, "dtype", None)
        if dtype is None or not jnp.issubdtype(dtype, jnp.inexact):
            continue
        bad = int(jnp.sum(~jnp.isfinite(jnp.asarray(x))))
        if bad:
            out.append(("batch" + jax.tree_util.keystr(tuple(path)), bad, int(np.prod(x.shape))))
    return out


def nan_cause(step: int, start: int, batch: PyTree = None) -> NanCause:
    """Why the loss of ``step`` is not finite; ``batch``: that step's batch (``None``: unknown).

    ``start``: the step the run started from (its first step is ``start + 1``).

    Example:
        >>> import numpy as np
        >>> from meshplan.train.diagnosis import nan_cause
        >>> nan_cause(5, 0, {"x": np.array([np.nan, 1.0])}).kind
        'data'
        >>> nan_cause(1, 0, {"x": np.ones(2)}).kind, nan_cause(7, 0, {"x": np.ones(2)}).kind
        ('start', 'diverged')
    """
    if batch is not None:
        bad = nonfinite_leaves(batch)
        if bad:
            shown = ", ".join(f"{path} ({n} of {size} values)" for path, n, size in bad[:3])
            return NanCause("data", f"its batch holds NaN or infinite values: {shown}")
    if step == start + 1:
        return NanCause(
            "start",
            "it is not finite from the run's first step, computed on the parameters the run "
            "started from (before any update)",
        )
    return NanCause("diverged", "")
