"""``meshplan train --model pkg.module:factory``: the factory's batches and loss checked up front.

Before any array is placed or any step compiled, the first validation and training
batches are drawn and compared with the example batch (the same tree, shapes and
dtypes: a batch of another size would train silently with wrong figures; strings
or other dtypes would end in a JAX traceback), and the loss is traced on the
example batch (``jax.eval_shape``: nothing runs) and must give one floating scalar.
Each problem names the value, the form expected and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from meshplan._errors import ArgumentError
from meshplan._types import PyTree
from meshplan.cli.factory import IterableBatches, Trainable
from meshplan.cli.train.findings import Findings

__all__ = ["factory_problems"]


def _leaf_name(path: Sequence[object]) -> str:
    return "batch" + jax.tree_util.keystr(tuple(path))


def _batch_problems(
    spec: str, what: str, batch: PyTree, example: PyTree, problems: Findings
) -> None:
    """What differs between ``batch`` (e.g. ``batches('train', 0)``) and the example batch."""
    got = jax.tree_util.tree_structure(batch)
    want = jax.tree_util.tree_structure(example)
    if str(got) != str(want):
        problems.add(
            ArgumentError,
            f"--model {spec}: {what} is a {got}, the example batch a {want}",
            "Return batches of the example batch's form (the same tuple or dict of arrays).",
            "factory-batch",
        )
        return
    pairs = zip(
        jax.tree_util.tree_leaves_with_path(batch),
        jax.tree.leaves(example),
        strict=True,
    )
    for (path, leaf), ref in pairs:
        name = _leaf_name(path)
        try:
            value = np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
        except Exception as e:  # ragged lists, objects
            problems.add(
                ArgumentError,
                f"--model {spec}: {what}, {name}, is not an array ({type(e).__name__}: {e})",
                f"Return arrays of shape {tuple(ref.shape)} and dtype {ref.dtype}.",
                "factory-batch",
            )
            continue
        dtype = np.dtype(value.dtype)
        if dtype.kind in "OSUV":
            problems.add(
                ArgumentError,
                f"--model {spec}: {what}, {name}, holds {dtype.name} values "
                f"({'strings' if dtype.kind in 'SU' else 'Python objects'}), which no device "
                f"array can hold",
                f"Encode them as numbers in the factory (e.g. token ids as int32), as the "
                f"example batch's {ref.dtype}.",
                "factory-batch",
            )
            continue
        shape, want_shape = tuple(value.shape), tuple(ref.shape)
        if shape != want_shape:
            rows = shape[:1] != want_shape[:1] and shape[1:] == want_shape[1:]
            problems.add(
                ArgumentError,
                f"--model {spec}: {what}, {name}, has shape {shape}, the example batch's "
                f"{want_shape}"
                + (
                    f": {shape[0] if shape else 0} rows where the example has "
                    f"{want_shape[0]}, so the step would be compiled, placed and reported "
                    f"for the wrong batch size"
                    if rows
                    else ""
                ),
                f"Return batches of shape {want_shape} (the example batch sets the batch "
                f"size and the shapes), or change the example batch.",
                "factory-batch",
            )
        if dtype != np.dtype(ref.dtype):
            integer = np.issubdtype(ref.dtype, np.integer)
            problems.add(
                ArgumentError,
                f"--model {spec}: {what}, {name}, has dtype {dtype}, the example batch's "
                f"{ref.dtype}" + (" (integer labels or ids given as floats?)" if integer else ""),
                f"Return {ref.dtype} arrays there (e.g. .astype(np.{ref.dtype})), as the "
                f"example batch.",
                "factory-batch",
            )


def _loss_problems(spec: str, trainable: Trainable, params: PyTree, problems: Findings) -> None:
    """The loss traced on the example batch: one floating scalar, or the error it raised."""
    train = trainable.model
    try:
        out = jax.eval_shape(train.loss, params, trainable.example_batch)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        problems.add(
            ArgumentError,
            f"--model {spec}: the loss, called as loss(model(inputs), example_batch), raised "
            f"{type(e).__name__}: {first}",
            "Make the loss run on the example batch (its labels of the dtype it indexes "
            "with, e.g. int32 for integer labels), returning one number.",
            "factory-loss",
        )
        return
    value = out[0] if train.has_aux else out
    shape = tuple(getattr(value, "shape", ()))
    dtype = getattr(value, "dtype", None)
    if shape != () or dtype is None or not np.issubdtype(np.dtype(dtype), np.floating):
        problems.add(
            ArgumentError,
            f"--model {spec}: the loss returns an array of shape {shape} and dtype {dtype}, "
            f"not one floating number",
            "Return one float, e.g. jnp.mean(per_example_losses); the gradient is taken of it.",
            "factory-loss",
        )


def factory_problems(
    spec: str, trainable: Trainable, params: PyTree, eval_batches: int, problems: Findings
) -> None:
    """Adds to ``problems`` what is wrong with the factory's batches and loss (see the module).

    ``params``: the abstract parameters (``jax.eval_shape``), as the loss takes them.
    """
    source = trainable.batches
    drawn: list[tuple[str, PyTree]] = []
    try:
        if isinstance(source, IterableBatches):
            source.hold_out(eval_batches)  # as the run does: validation first
        if eval_batches:
            drawn.append(("batches('valid', 0)", source("valid", 0)))
        drawn.append(("batches('train', 0)", source("train", 0)))
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        problems.add(
            ArgumentError,
            f"--model {spec}: drawing the first batch raised {type(e).__name__}: {first}",
            "Return batches(split, index) -> batch for split 'train' and 'valid' and any "
            "index from 0, or an iterable of batches.",
            "factory-batch",
        )
    for what, batch in drawn:
        _batch_problems(spec, what, batch, trainable.example_batch, problems)
    _loss_problems(spec, trainable, params, problems)
