"""Restoring a checkpoint onto any mesh, with no model code and no target tree.

:func:`restore` reads the metadata first, maps each array's logical names
through the rules you give (or the saved ones) to a ``NamedSharding`` on the
mesh you give, and asks Orbax to read every array straight into that sharding.
So a run saved on a 2x4 mesh with one layout restores onto 4x2, 8x1 or a
single device with another, bit for bit, and a run saved by several processes
restores in one (or the other way round).
"""

from __future__ import annotations

import os
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from etils import epath
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from meshplan._checkpoint.checksum import checksum_mismatches
from meshplan._checkpoint.folder import (
    META_ITEM,
    STATE_ITEM,
    checkpoint_path,
    damaged_fix,
    metadata_of,
    open_manager,
    step_number,
)
from meshplan._checkpoint.integrity import check_step, intact_step
from meshplan._checkpoint.metadata import CheckpointMetadata, UnverifiedWarning
from meshplan._checkpoint.quiet import drop_orbax_leftovers, quiet_late_callbacks
from meshplan._checkpoint.tree import flatten_state, nest, path_of, unnest
from meshplan._errors import (
    ArgumentError,
    CheckpointError,
    Problem,
    error_for,
    error_from_problems,
    problem_message,
)
from meshplan._spmd.boxes import LogicallyPartitioned, Partitioned, is_box
from meshplan._spmd.leaves import is_leaf, leaf_kind
from meshplan._spmd.rules import LogicalRules, NamesKind, logical_to_mesh_axes, normalize_rules
from meshplan._spmd.validate import validate
from meshplan._types import PyTree

__all__ = ["Restored", "mismatch_problems", "restore", "restore_into", "target_shardings"]


def _single_device_mesh(axis_names: tuple[str, ...]) -> Mesh:
    """A mesh of size 1 on the first device, with ``Auto`` axes named as the saved ones."""
    names = axis_names or ("data", "model")
    return jax.make_mesh(
        (1,) * len(names),
        names,
        axis_types=(AxisType.Auto,) * len(names),
        devices=jax.devices()[:1],
    )


def target_shardings(
    metadata: CheckpointMetadata, mesh: Mesh, rules: LogicalRules | None = None
) -> dict[str, NamedSharding]:
    """The ``NamedSharding`` of every saved array on ``mesh``, from its stored names.

    Logical names go through ``rules`` (default: the rules saved with the
    checkpoint); arrays saved unboxed are replicated.

    Raises:
        CheckpointError: listing every array whose names use an axis ``mesh``
            lacks, or whose dimension the mesh axes do not divide.
    """
    rules = metadata.rules if rules is None else normalize_rules(rules)
    problems: list[Problem] = []
    out: dict[str, NamedSharding] = {}
    for key, info in metadata.arrays.items():
        kind: NamesKind = "unboxed" if info.names is None else "logical" if info.logical else "mesh"
        errors = [
            p
            for p in validate(key, info.shape, info.names, mesh, rules, kind=kind)
            if p.severity == "error"
        ]
        if errors:
            problems.extend(errors)
        elif info.names is None:  # unboxed
            out[key] = NamedSharding(mesh, PartitionSpec())
        elif info.logical:
            out[key] = NamedSharding(mesh, logical_to_mesh_axes(info.names, rules))
        else:
            out[key] = NamedSharding(mesh, PartitionSpec(*info.names))
    if problems:
        raise error_from_problems(
            CheckpointError,
            f"Cannot lay the checkpoint's arrays out on the mesh {dict(mesh.shape)} with these "
            f"rules:",
            problems,
        )
    return out


class Restored(NamedTuple):
    """What :func:`restore` returns; unpacks as ``state, metadata = restore(...)``.

    Attributes:
        state: Nested dicts keyed by the saved tree's path parts (``state["params"]
            ["Embed_0"]["embedding"]``). Arrays saved from a ``LogicallyPartitioned``
            box come back in one (same names, no rules or mesh attached, value
            sharded on the restore mesh); the others as plain ``jax.Array``.
        metadata: The :class:`CheckpointMetadata` stored beside the arrays.

    Example:
        >>> import tempfile, jax.numpy as jnp, meshplan
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(jnp.ones((2, 4)),
        ...                                                      ("embed", "mlp"))},
        ...         "step": jnp.int32(3)}
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with meshplan.Checkpointer(folder) as ckpt:
        ...         _ = ckpt.save(3, tree)
        ...     state, metadata = meshplan.restore(folder)
        >>> state["params"]["w"].names, int(state["step"]), metadata.step
        (('embed', 'mlp'), 3, 3)
    """

    state: dict[str, object]
    metadata: CheckpointMetadata

    def arrays(self) -> dict[str, jax.Array]:
        """Every raw array keyed by its path (``"params/Embed_0/embedding"``).

        Example:
            >>> import jax.numpy as jnp, meshplan
            >>> state = {"params": {"w": meshplan.LogicallyPartitioned(jnp.ones((2, 4)),
            ...                                                       ("embed", "mlp"))}}
            >>> restored = meshplan.Restored(state, meshplan.CheckpointMetadata.describe(0, state))
            >>> {path: array.shape for path, array in restored.arrays().items()}
            {'params/w': (2, 4)}
        """
        return {k: (v.value if is_box(v) else v) for k, v in unnest(self.state)}

    def into(self, template: PyTree) -> PyTree:
        """``template`` (e.g. an abstract ``TrainState``) with the restored arrays in it.

        Boxes of ``template`` keep their own metadata and get the restored value.

        Raises:
            CheckpointError: listing every path whose shape or dtype differs, or
                that one side has and the other lacks.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> state = {"w": meshplan.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))}
            >>> restored = meshplan.Restored(state, meshplan.CheckpointMetadata.describe(0, state))
            >>> template = {"w": meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((2, 4), jnp.float32), (None, "model"))}
            >>> out = restored.into(template)
            >>> out["w"].names, float(out["w"].value.sum())
            ((None, 'model'), 8.0)
        """
        problems = mismatch_problems(self.metadata, template)
        if problems:
            raise error_from_problems(
                CheckpointError,
                f"The checkpoint (step {self.metadata.step}) does not fit this state:",
                problems,
            )
        arrays = self.arrays()
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_leaf)
        new = []
        for path, leaf in leaves:
            key = path_of(path)
            kind = leaf_kind(leaf)
            if kind is not None:  # a box or a Flax NNX variable keeps its metadata
                new.append(kind.with_value(leaf, arrays[key]))
            elif hasattr(leaf, "shape"):
                new.append(arrays[key])
            else:
                new.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, new)


_MISMATCH_FIX = "Use the model config the checkpoint was saved with, or a new checkpoint folder."


def mismatch_problems(metadata: CheckpointMetadata, template: PyTree) -> list[Problem]:
    """One :class:`Problem` per array whose shape/dtype differs between ``template`` and the
    checkpoint (code ``'checkpoint-mismatch'``, its path the array's key).

    ``template`` may be abstract (``jax.eval_shape`` output). An empty list
    means :meth:`Restored.into` will succeed.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._checkpoint.restore import mismatch_problems
        >>> saved = meshplan.CheckpointMetadata.describe(0, {"w": jnp.ones((2, 4))})
        >>> [(p.code, p.path, p.message) for p in mismatch_problems(saved, {"w": jnp.ones(3)})]
        [('checkpoint-mismatch', 'w', 'checkpoint shape (2, 4), this model (3,)')]
    """
    found: list[tuple[str, str]] = []
    flat = flatten_state(template)
    for key, (value, _) in flat.items():
        info = metadata.arrays.get(key)
        if info is None:
            found.append((key, f"shape {tuple(value.shape)} is not in the checkpoint"))
            continue
        shape, dtype = tuple(value.shape), str(np.dtype(value.dtype))
        if shape != info.shape:
            found.append((key, f"checkpoint shape {info.shape}, this model {shape}"))
        elif dtype != info.dtype:
            found.append((key, f"checkpoint dtype {info.dtype}, this model {dtype}"))
    found += [
        (key, f"shape {info.shape} is in the checkpoint but not in this model")
        for key, info in metadata.arrays.items()
        if key not in flat
    ]
    return [
        Problem("error", key, text, _MISMATCH_FIX, "checkpoint-mismatch") for key, text in found
    ]


def restore(
    path: str | os.PathLike[str],
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    step: int | str | None = None,
    *,
    fallback: bool = False,
) -> Restored:
    """Restores a meshplan checkpoint onto ``mesh`` with ``rules``: no target tree, no model.

    The target sharding of every array comes from the logical names stored
    with it, mapped through ``rules``; Orbax reads each array straight into
    that sharding, whatever mesh and rules the checkpoint was saved with.

    Args:
        path: The checkpoint folder a :class:`Checkpointer` saved into: a local
            path or any path Orbax reads (``gs://...``).
        mesh: The mesh to restore onto. ``None`` uses one device (a mesh of
            size 1 with the saved axis names).
        rules: Logical axis rules for ``mesh``; ``None`` uses the saved ones.
        step: The step to restore; ``None`` for the latest complete one (as
            Orbax's ``CheckpointManager`` finds them: a save killed midway is not one).
            A digit string (``"20"``) is taken as that number.
        fallback: When the step cannot be read (damaged), restore the newest
            earlier step that can instead, and say which steps were skipped and
            why with one ``UserWarning`` each. Each damaged step costs a cheap
            check (:func:`~meshplan._checkpoint.integrity.check_step`), the intact
            one is read once.

    Returns:
        :class:`Restored` ``(state, metadata)``: nested dicts of arrays (boxed
        as ``LogicallyPartitioned`` where they were saved boxed) and the
        :class:`CheckpointMetadata`.

    Raises:
        CheckpointError: the folder is missing, empty, not a meshplan
            checkpoint, lacks ``step``, or the mesh cannot hold its arrays; the
            step is damaged (code ``'ckpt-damaged'``, naming the step and what is
            damaged, including arrays whose bytes no longer match the checksum
            stored at save; with ``fallback=True``: only when no step can be read).
        ArgumentError: ``mesh`` is not a ``jax.sharding.Mesh`` (e.g. ``"2x4"``),
            or ``step`` is not a whole number.

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, meshplan
        >>> tree = {"w": meshplan.LogicallyPartitioned(jnp.arange(8.0).reshape(2, 4),
        ...                                           ("embed", "mlp"))}
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with meshplan.Checkpointer(folder) as ckpt:
        ...         _ = ckpt.save(1, tree, rules=(("mlp", "model"),))
        ...     state, meta = meshplan.restore(folder, mesh)
        >>> state["w"].names, state["w"].value.sharding.spec, meta.step
        (('embed', 'mlp'), P(None, 'model'), 1)
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise error_for(
            ArgumentError,
            "ckpt-bad-mesh",
            "mesh",
            f"restore(mesh=...) takes a jax.sharding.Mesh, got {mesh!r} ({type(mesh).__name__})",
            "Build one, e.g. jax.make_mesh((2, 4), ('data', 'model')), or pass mesh=None "
            "for one device.",
        )
    step = step_number(step)
    p = checkpoint_path(path)
    if not fallback:
        return _restore_step(p, mesh, rules, step)
    chosen = _first_step(p, step)
    tried: list[Problem] = []
    while True:
        try:
            return _restore_step(p, mesh, rules, chosen)
        except CheckpointError as e:
            if not e.problems or e.problems[0].code != "ckpt-damaged":
                raise
            skipped = [e.problems[0]]
        found = intact_step(p, before=chosen)
        for problem in [*skipped, *found.skipped]:
            warnings.warn(_skipped_text(problem), stacklevel=2)
            tried.append(problem)
        if found.step is None:
            raise CheckpointError(
                problem_message(
                    f"No step of {str(p)!r} can be read:",
                    [problem.message for problem in tried],
                    "Save into a new folder to start afresh.",
                ),
                tried,
            )
        chosen = found.step


def _skipped_text(problem: Problem) -> str:
    return f"Skipped {problem.path}: {problem.message.removeprefix(problem.path + ': ')}"


def _first_step(p: epath.Path, step: int | None) -> int | None:
    """``step``, or the latest one; raises the folder's error when there is none."""
    if step is not None:
        return step
    with open_manager(p) as manager:
        steps: list[int] = sorted(manager.all_steps())
        if not steps:
            metadata_of(manager, p)  # raises why (missing, empty, ...)
    return steps[-1]


def _restore_step(
    p: epath.Path, mesh: Mesh | None, rules: LogicalRules | None, step: int | None
) -> Restored:
    # Every process restores its part of the arrays: they open the manager together.
    with open_manager(p, all_processes=True) as manager:
        metadata = metadata_of(manager, p, step)
        if mesh is None:
            mesh = _single_device_mesh(metadata.axis_names)
        shardings = target_shardings(metadata, mesh, rules)
        return _read(manager, p, metadata, shardings, stacklevel=4)  # restore's caller


def restore_into(
    path: str | os.PathLike[str], template: PyTree, shardings: PyTree, step: int
) -> PyTree:
    """Step ``step`` of ``path`` read straight into ``shardings``: ``template`` with the arrays.

    For a caller that has its state's layout already (a
    :class:`~meshplan.train.trainer.Trainer`): each array is read into the sharding
    the caller gave the array of that path (``shardings``, a tree like ``template``
    with a ``NamedSharding`` per array), and put into ``template`` as
    :meth:`Restored.into` does. The checksums are verified as :func:`restore` does.

    Raises:
        CheckpointError: the step does not fit ``template`` (every array that differs,
            before any is read), or it is damaged (``'ckpt-damaged'``).

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, meshplan
        >>> from jax.sharding import NamedSharding, PartitionSpec as P
        >>> from meshplan._checkpoint.restore import restore_into
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> tree = {"w": meshplan.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))}
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     with meshplan.Checkpointer(folder) as ckpt:
        ...         _ = ckpt.save(1, tree)
        ...     state = restore_into(folder, tree, {"w": NamedSharding(mesh, P(None, "model"))}, 1)
        >>> state["w"].names, state["w"].value.sharding.spec
        (('embed', 'mlp'), P(None, 'model'))
    """
    p = checkpoint_path(path)
    with open_manager(p, all_processes=True) as manager:
        metadata = metadata_of(manager, p, step)
        problems = mismatch_problems(metadata, template)
        if problems:
            raise error_from_problems(
                CheckpointError,
                f"The checkpoint (step {metadata.step}) does not fit this state:",
                problems,
            )
        by_path = _shardings_by_path(shardings)
        missing = sorted(set(metadata.arrays) - set(by_path))
        if missing:
            raise error_for(
                CheckpointError,
                "ckpt-no-sharding",
                missing[0],
                f"restore_into was given no sharding for {len(missing)} array(s) of step "
                f"{metadata.step}: {', '.join(missing[:5])}",
                "Pass `shardings` as a tree like `template`, with a NamedSharding for every "
                "array the checkpoint holds.",
            )
        restored = _read(manager, p, metadata, by_path, stacklevel=3)
    return restored.into(template)


def _is_sharding(x: object) -> bool:
    return isinstance(x, NamedSharding)


def _shardings_by_path(shardings: PyTree) -> dict[str, NamedSharding]:
    """Each array's sharding by its checkpoint path: the paths :meth:`Restored.into` reads
    (a box or a Flax NNX variable is one leaf, its sharding inside it)."""
    out: dict[str, NamedSharding] = {}
    flat = jax.tree_util.tree_flatten_with_path(
        shardings, is_leaf=lambda x: _is_sharding(x) or is_leaf(x)
    )[0]
    for keys, leaf in flat:
        inner = [x for x in jax.tree.leaves(leaf, is_leaf=_is_sharding) if _is_sharding(x)]
        if inner:
            out[path_of(keys)] = inner[0]
    return out


def _read(
    manager: Any,
    p: epath.Path,
    metadata: CheckpointMetadata,
    shardings: dict[str, NamedSharding],
    stacklevel: int,
) -> Restored:
    """The arrays of ``metadata``'s step, each read into its sharding, verified and boxed
    (an :class:`UnverifiedWarning` at ``stacklevel`` when it cannot be verified)."""
    import orbax.checkpoint as ocp

    target = nest(
        {
            key: jax.ShapeDtypeStruct(info.shape, np.dtype(info.dtype), sharding=shardings[key])
            for key, info in metadata.arrays.items()
        }
    )
    where = f"{str(p)!r} (step {metadata.step})"
    failure: str | None = None
    # A read that fails leaves others in flight, which call back into Orbax's closed
    # event loop (a bare "Event loop is closed" traceback each): left out from here on.
    quiet_late_callbacks()
    try:
        restored = manager.restore(
            metadata.step,
            args=ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(target)}),
        )[STATE_ITEM]
    except KeyError as e:
        raise error_for(
            CheckpointError,
            "ckpt-damaged",
            where,
            f"{where} has its '{META_ITEM}' metadata but no '{STATE_ITEM}' arrays "
            f"({e.args[0] if e.args else e})",
            damaged_fix(sorted(manager.all_steps()), metadata.step),
        ) from e
    except Exception as e:  # Orbax and TensorStore raise a bare Exception, ValueError...
        failure = f"{type(e).__name__}: {_first_line(e)}"
    if failure is not None:
        # Raised outside the except block: Orbax's exception (a screen of TensorStore
        # traceback, holding the failed read coroutines) is neither chained nor kept, so
        # its coroutines are collected here, quietly, not printed at exit.
        drop_orbax_leftovers()
        # Name what is damaged: the cheap check usually finds it; else Orbax's words.
        found = check_step(p, metadata.step, manager)
        detail = (
            found.message
            if found is not None
            else f"{where}: its '{STATE_ITEM}' arrays cannot be read ({failure})"
        )
        raise error_for(
            CheckpointError,
            "ckpt-damaged",
            where,
            detail,
            damaged_fix(sorted(manager.all_steps()), metadata.step),
        )
    flat = dict(unnest(restored))
    changed = checksum_mismatches(
        {key: info.checksum for key, info in metadata.arrays.items()}, flat
    )
    if changed:
        shown = ", ".join(repr(k) for k in changed[:5]) + (
            f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        )
        raise error_for(
            CheckpointError,
            "ckpt-damaged",
            where,
            f"{where}: the bytes of {len(changed)} array{'s' * (len(changed) != 1)} "
            f"changed since it was saved (checksum mismatch): {shown}",
            damaged_fix(sorted(manager.all_steps()), metadata.step),
        )
    missing = metadata.unverified()
    if missing:
        what = "its metadata carries no digest" if "metadata" in missing else ""
        arrays = [k for k in missing if k != "metadata"]
        if arrays:
            what += (" and " if what else "") + (
                f"{len(arrays)} of its {len(metadata.arrays)} arrays carry no checksum"
            )
        warnings.warn(
            UnverifiedWarning(
                f"{where} was restored unverified: {what} (saved by an older meshplan, or "
                f"its metadata edited by hand), so damage to its arrays or a changed "
                f"logical name would go unnoticed. Save it again to seal it."
            ),
            stacklevel=stacklevel,
        )
    boxed = {}
    for key, value in unnest(restored):
        info = metadata.arrays[key]
        if info.names is None:
            boxed[key] = value
        elif info.logical:
            boxed[key] = LogicallyPartitioned(value, info.names)
        else:
            boxed[key] = Partitioned(value, info.names)
    return Restored(nest(boxed), metadata)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    line = text.splitlines()[0] if text else type(e).__name__
    # Orbax appends the repr of a TensorStore method ("See full TensorStore details: <bound
    # method ...>"), which says nothing to a reader.
    return line.split(" See full TensorStore details", 1)[0].rstrip()
