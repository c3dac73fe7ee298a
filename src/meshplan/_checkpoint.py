"""Checkpoints that restore onto any mesh, with no model code and no target tree.

A meshplan checkpoint is an Orbax ``CheckpointManager`` folder. Each step folder
holds two items:

* ``state``: the raw (unboxed) arrays, as a nested dict keyed by their paths in
  the saved tree (``params/Embed_0/embedding``, ``opt_state/1/0/mu/...``);
* ``meshplan``: JSON metadata beside them: the step, the model config, the
  shape, dtype and logical axis names of every array (keyed by path), the rules
  and the mesh shape the run used, and the meshplan version.

:func:`restore` reads the metadata first, maps each array's logical names
through the rules you give (or the saved ones) to a ``NamedSharding`` on the
mesh you give, and asks Orbax to read every array straight into that sharding.
So a run saved on a 2x4 mesh with one layout restores onto 4x2, 8x1 or a
single device with another, bit for bit.

Orbax writes each step into ``<step>.orbax-checkpoint-tmp`` and renames it when
complete, so a run killed in the middle of a save leaves the previous steps
intact; only complete steps are ever restored.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan._boxes import LogicallyPartitioned, Partitioned, is_box
from meshplan._errors import CheckpointError, problem_message
from meshplan._rules import logical_to_mesh_axes, normalize_rules

__all__ = [
    "ArrayInfo",
    "CheckpointMetadata",
    "Checkpointer",
    "Restored",
    "flatten_state",
    "read_metadata",
    "restore",
]

FORMAT = "meshplan-checkpoint"
"""Value of the ``format`` field that marks meshplan's metadata."""

FORMAT_VERSION = 1
_STATE, _META = "state", "meshplan"
_TMP_SUFFIX = ".orbax-checkpoint-tmp"


# ---------------------------------------------------------------------------
# Paths and metadata
# ---------------------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            name = str(getattr(key, attr))
            break
    else:  # pragma: no cover - a key type JAX may add later
        name = str(key)
    if "/" in name or not name:
        raise CheckpointError(
            f"Cannot save a tree whose key {name!r} is empty or contains '/', got {key=}.\n"
            f"Rename the module or dict key: '/' separates path parts in checkpoints."
        )
    return name


def flatten_state(tree: Any) -> dict[str, tuple[Any, Any]]:
    """Every array of ``tree`` by its path: ``{"params/w": (value, box_or_None)}``.

    Boxes (``LogicallyPartitioned``, ``Partitioned``) are leaves here, so the
    second element carries their axis names; unboxed arrays give ``None``.

    Example:
        >>> import jax.numpy as jnp, meshplan
        >>> from meshplan._checkpoint import flatten_state
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(jnp.ones((2, 4)),
        ...                                                      ("embed", "mlp"))},
        ...         "step": jnp.int32(0)}
        >>> {k: (v.shape, b and b.names) for k, (v, b) in flatten_state(tree).items()}
        {'params/w': ((2, 4), ('embed', 'mlp')), 'step': ((), None)}
    """
    out: dict[str, tuple[Any, Any]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
        key = "/".join(_key_name(k) for k in path)
        if is_box(leaf):
            value = leaf.value
            while is_box(value):
                value = value.value
            out[key] = (value, leaf)
        elif hasattr(leaf, "shape"):
            out[key] = (leaf, None)
    return out


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What a checkpoint knows about one array.

    Attributes:
        shape: The array's global shape.
        dtype: Its dtype name (``"float32"``).
        names: One axis name (or ``None``) per dimension, or ``None`` for an
            array that was saved unboxed (replicated on restore).
        logical: ``True`` when ``names`` are logical names (mapped through
            rules), ``False`` when they are mesh axis names.
    """

    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...] | None = None
    logical: bool = True

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "names": None if self.names is None else list(self.names),
            "logical": self.logical,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArrayInfo:
        """The inverse of :meth:`to_json`."""
        names = data.get("names")
        return cls(
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
            names=None if names is None else tuple(_name_from_json(n) for n in names),
            logical=bool(data.get("logical", True)),
        )


def _name_from_json(name: Any) -> Any:
    return tuple(name) if isinstance(name, list) else name


def _rules_to_json(rules: Any) -> list[list[Any]]:
    return [[name, list(axes) if isinstance(axes, tuple) else axes] for name, axes in rules]


def _rules_from_json(rules: Any) -> tuple[tuple[str, Any], ...]:
    return normalize_rules(
        tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)
    )


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """The JSON stored beside a checkpoint's arrays.

    Attributes:
        step: The training step the checkpoint was saved at.
        arrays: :class:`ArrayInfo` of every array, keyed by its path.
        rules: The logical axis rules of the run that saved it.
        mesh_shape: Mesh axis name to size, in the mesh's order (``{}`` if unknown).
        config: The model config as a dict (``None`` if none was given).
        extra: Anything else the saver stored (training settings, best loss, ...).
        meshplan_version: The meshplan version that wrote it.
    """

    step: int
    arrays: dict[str, ArrayInfo]
    rules: tuple[tuple[str, Any], ...] = ()
    mesh_shape: dict[str, int] = dataclasses.field(default_factory=dict)
    config: dict[str, Any] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    meshplan_version: str = ""

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The saving mesh's axis names, in order."""
        return tuple(self.mesh_shape)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict, marked with :data:`FORMAT`."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "meshplan_version": self.meshplan_version,
            "step": self.step,
            "config": self.config,
            "rules": _rules_to_json(self.rules),
            "mesh": {"axis_names": list(self.mesh_shape), "shape": list(self.mesh_shape.values())},
            "arrays": {k: v.to_json() for k, v in self.arrays.items()},
            "extra": self.extra,
        }

    @classmethod
    def from_json(cls, data: Any, where: str = "checkpoint") -> CheckpointMetadata:
        """The inverse of :meth:`to_json`; raises :class:`CheckpointError` on anything else."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise CheckpointError(
                f"{where} is not a meshplan checkpoint: its 'meshplan' item is not meshplan "
                f"metadata, got format={data.get('format') if isinstance(data, Mapping) else None!r}."
                f"\nPoint at a folder written by `meshplan train` or meshplan.Checkpointer."
            )
        if int(data.get("format_version", 0)) > FORMAT_VERSION:
            raise CheckpointError(
                f"{where} was written by a newer meshplan "
                f"({data.get('meshplan_version')!r}, format_version="
                f"{data.get('format_version')}), this one reads format_version "
                f"{FORMAT_VERSION}.\nUpgrade meshplan to restore it."
            )
        mesh = data.get("mesh") or {}
        return cls(
            step=int(data["step"]),
            arrays={k: ArrayInfo.from_json(v) for k, v in data["arrays"].items()},
            rules=_rules_from_json(data.get("rules") or ()),
            mesh_shape=dict(zip(mesh.get("axis_names", ()), mesh.get("shape", ()), strict=True)),
            config=data.get("config"),
            extra=dict(data.get("extra") or {}),
            meshplan_version=str(data.get("meshplan_version", "")),
        )


def _nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split("/")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def _unnest(tree: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _unnest(value, path + "/")
        else:
            yield path, value


# ---------------------------------------------------------------------------
# The folder: complete steps, incomplete ones, and what is not a checkpoint
# ---------------------------------------------------------------------------


def _complete_steps(path: Path) -> list[int]:
    """Step folders Orbax finished writing (an incomplete one keeps its tmp suffix)."""
    steps = []
    for child in path.iterdir():
        if child.is_dir() and child.name.isdigit():
            steps.append(int(child.name))
    return sorted(steps)


def _incomplete_steps(path: Path) -> list[str]:
    return sorted(c.name for c in path.iterdir() if _TMP_SUFFIX in c.name)


def _check_folder(path: Path) -> list[int]:
    """The complete steps of ``path``; a :class:`CheckpointError` when there are none."""
    if not path.exists():
        raise CheckpointError(
            f"No checkpoint folder at {str(path)!r}: it does not exist.\n"
            f"Check the path (--ckpt-dir), or train first: meshplan train --ckpt-dir {path}"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"{str(path)!r} is a file, not a checkpoint folder.\n"
            f"Pass the folder that `meshplan train --ckpt-dir` wrote."
        )
    steps = _complete_steps(path)
    if steps:
        return steps
    entries = sorted(c.name for c in path.iterdir())
    incomplete = _incomplete_steps(path)
    if incomplete:
        problem = (
            f"it holds only incomplete steps {incomplete} (the run stopped while saving "
            f"its first checkpoint)"
        )
    elif not entries:
        problem = "it is empty"
    else:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        problem = f"it holds no step folders, only: {shown}"
    raise CheckpointError(
        f"{str(path)!r} is not a meshplan checkpoint: {problem}.\n"
        f"Point at a folder written by `meshplan train --ckpt-dir`, or start a new run "
        f"without --resume."
    )


def latest_step(path: str | os.PathLike[str]) -> int | None:
    """The latest complete step in ``path``, or ``None`` when there is none (or no folder).

    Example:
        >>> from meshplan._checkpoint import latest_step
        >>> latest_step("/nonexistent/run") is None
        True
    """
    p = Path(path)
    if not p.is_dir():
        return None
    steps = _complete_steps(p)
    return steps[-1] if steps else None


def read_metadata(path: str | os.PathLike[str], step: int | None = None) -> CheckpointMetadata:
    """The :class:`CheckpointMetadata` of ``step`` (default: the latest complete one).

    Reads only the small JSON file, no arrays: use it to check a checkpoint
    against a model config before any work starts.

    Raises:
        CheckpointError: ``path`` is missing, empty, holds no complete step, is
            not a meshplan checkpoint, or lacks ``step``.

    Example:
        >>> import meshplan
        >>> from meshplan._checkpoint import read_metadata
        >>> try:
        ...     read_metadata("/nonexistent/run")
        ... except meshplan.CheckpointError as e:
        ...     print(str(e).splitlines()[0])
        No checkpoint folder at '/nonexistent/run': it does not exist.
    """
    p = Path(path).absolute()
    steps = _check_folder(p)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(
            f"{str(p)!r} has no complete checkpoint at {step=}; it has steps {steps}.\n"
            f"Pass one of those steps, or step=None for the latest."
        )
    meta_file = p / str(step) / _META / "metadata"
    where = f"{str(p)!r} (step {step})"
    if not meta_file.is_file():
        raise CheckpointError(
            f"{where} is not a meshplan checkpoint: it has no '{_META}' metadata item "
            f"(looked for {str(meta_file)!r}).\nPoint at a folder written by `meshplan train` "
            f"or meshplan.Checkpointer; plain Orbax checkpoints need a target tree."
        )
    try:
        data = json.loads(meta_file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{where}: cannot read its metadata {str(meta_file)!r}: {e}.\n"
            f"The file is damaged; restore an earlier step (step=...)."
        ) from e
    return CheckpointMetadata.from_json(data, where)


# ---------------------------------------------------------------------------
# Restoring
# ---------------------------------------------------------------------------


def _single_device_mesh(axis_names: tuple[str, ...]) -> Mesh:
    names = axis_names or ("data", "model")
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)


def _mesh_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def target_shardings(
    metadata: CheckpointMetadata, mesh: Mesh, rules: Any = None
) -> dict[str, NamedSharding]:
    """The ``NamedSharding`` of every saved array on ``mesh``, from its stored names.

    Logical names go through ``rules`` (default: the rules saved with the
    checkpoint); arrays saved unboxed are replicated.

    Raises:
        CheckpointError: listing every array whose names use an axis ``mesh``
            lacks, or whose dimension the mesh axes do not divide.
    """
    rules = metadata.rules if rules is None else normalize_rules(rules)
    sizes = dict(mesh.shape)
    problems: list[str] = []
    out: dict[str, NamedSharding] = {}
    for key, info in metadata.arrays.items():
        if info.names is None:
            spec = PartitionSpec()
        elif info.logical:
            spec = logical_to_mesh_axes(info.names, rules)
        else:
            spec = PartitionSpec(*info.names)
        bad = False
        for dim, (size, entry) in enumerate(zip(info.shape, tuple(spec), strict=False)):
            axes = _mesh_axes(entry)
            missing = [a for a in axes if a not in sizes]
            if missing:
                problems.append(
                    f"{key}: dimension {dim} maps to mesh axes {missing} that the mesh "
                    f"{sizes} lacks"
                )
                bad = True
                continue
            parts = int(np.prod([sizes[a] for a in axes])) if axes else 1
            if size % parts:
                problems.append(
                    f"{key}: dimension {dim} of size {size} ({info.names[dim]!r}) does not "
                    f"divide over mesh axes {axes} of total size {parts}"
                )
                bad = True
        if not bad:
            out[key] = NamedSharding(mesh, spec)
    if problems:
        raise CheckpointError(
            problem_message(
                f"Cannot lay the checkpoint's arrays out on the mesh {sizes} with these rules:",
                problems,
                "Use a mesh whose axes divide these dimensions, or rules that leave them "
                "unsharded (e.g. data_parallel).",
            )
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
    """

    state: dict[str, Any]
    metadata: CheckpointMetadata

    def arrays(self) -> dict[str, jax.Array]:
        """Every raw array keyed by its path (``"params/Embed_0/embedding"``)."""
        return {k: (v.value if is_box(v) else v) for k, v in _unnest(self.state)}

    def into(self, template: Any) -> Any:
        """``template`` (e.g. an abstract ``TrainState``) with the restored arrays in it.

        Boxes of ``template`` keep their own metadata and get the restored value.

        Raises:
            CheckpointError: listing every path whose shape or dtype differs, or
                that one side has and the other lacks.
        """
        problems = compatibility_problems(self.metadata, template)
        if problems:
            raise CheckpointError(
                problem_message(
                    f"The checkpoint (step {self.metadata.step}) does not fit this state:",
                    problems,
                    "Use the model config the checkpoint was saved with, or a new checkpoint "
                    "folder.",
                )
            )
        arrays = self.arrays()
        leaves, treedef = jax.tree_util.tree_flatten_with_path(template, is_leaf=is_box)
        new = []
        for path, leaf in leaves:
            key = "/".join(_key_name(k) for k in path)
            if is_box(leaf):
                new.append(leaf.replace_boxed(arrays[key]))
            elif hasattr(leaf, "shape"):
                new.append(arrays[key])
            else:
                new.append(leaf)
        return jax.tree_util.tree_unflatten(treedef, new)


def compatibility_problems(metadata: CheckpointMetadata, template: Any) -> list[str]:
    """One line per array whose shape/dtype differs between ``template`` and the checkpoint.

    ``template`` may be abstract (``jax.eval_shape`` output). An empty list
    means :meth:`Restored.into` will succeed.
    """
    problems = []
    flat = flatten_state(template)
    for key, (value, _) in flat.items():
        info = metadata.arrays.get(key)
        if info is None:
            problems.append(f"{key}: shape {tuple(value.shape)} is not in the checkpoint")
            continue
        shape, dtype = tuple(value.shape), str(np.dtype(value.dtype))
        if shape != info.shape:
            problems.append(f"{key}: checkpoint shape {info.shape}, this model {shape}")
        elif dtype != info.dtype:
            problems.append(f"{key}: checkpoint dtype {info.dtype}, this model {dtype}")
    problems += [
        f"{key}: shape {info.shape} is in the checkpoint but not in this model"
        for key, info in metadata.arrays.items()
        if key not in flat
    ]
    return problems


def restore(
    path: str | os.PathLike[str],
    mesh: Mesh | None = None,
    rules: Any = None,
    step: int | None = None,
) -> Restored:
    """Restores a meshplan checkpoint onto ``mesh`` with ``rules``: no target tree, no model.

    The target sharding of every array comes from the logical names stored
    with it, mapped through ``rules``; Orbax reads each array straight into
    that sharding, whatever mesh and rules the checkpoint was saved with.

    Args:
        path: The checkpoint folder (``meshplan train --ckpt-dir``).
        mesh: The mesh to restore onto. ``None`` uses one device (a mesh of
            size 1 with the saved axis names).
        rules: Logical axis rules for ``mesh``; ``None`` uses the saved ones.
        step: The step to restore; ``None`` for the latest complete one.

    Returns:
        :class:`Restored` ``(state, metadata)``: nested dicts of arrays (boxed
        as ``LogicallyPartitioned`` where they were saved boxed) and the
        :class:`CheckpointMetadata`.

    Raises:
        CheckpointError: the folder is missing, empty, not a meshplan
            checkpoint, lacks ``step``, or the mesh cannot hold its arrays.

    Example:
        >>> import tempfile, jax, jax.numpy as jnp, meshplan
        >>> tree = {"w": meshplan.LogicallyPartitioned(jnp.arange(8.0).reshape(2, 4),
        ...                                           ("embed", "mlp"))}
        >>> folder = tempfile.mkdtemp()
        >>> with meshplan.Checkpointer(folder) as ckpt:
        ...     ckpt.save(1, tree, rules=(("mlp", "model"),))
        True
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> state, meta = meshplan.restore(folder, mesh)
        >>> state["w"].names, state["w"].value.sharding.spec, meta.step
        (('embed', 'mlp'), P(None, 'model'), 1)
    """
    import orbax.checkpoint as ocp

    p = Path(path).absolute()
    metadata = read_metadata(p, step)
    if mesh is None:
        mesh = _single_device_mesh(metadata.axis_names)
    shardings = target_shardings(metadata, mesh, rules)
    target = _nest(
        {
            key: jax.ShapeDtypeStruct(info.shape, np.dtype(info.dtype), sharding=shardings[key])
            for key, info in metadata.arrays.items()
        }
    )
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(p / str(metadata.step) / _STATE, target)
    boxed = {}
    for key, value in _unnest(restored):
        info = metadata.arrays[key]
        if info.names is None:
            boxed[key] = value
        elif info.logical:
            boxed[key] = LogicallyPartitioned(value, info.names)
        else:
            boxed[key] = Partitioned(value, info.names)
    return Restored(_nest(boxed), metadata)


# ---------------------------------------------------------------------------
# Saving
# ---------------------------------------------------------------------------


def _mesh_of(flat: Mapping[str, tuple[Any, Any]]) -> Any:
    for value, _ in flat.values():
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


class Checkpointer:
    """Saves meshplan checkpoints with Orbax's ``CheckpointManager`` (asynchronously).

    Each :meth:`save` returns once the arrays are copied off the devices and
    writes them in the background; the next save (or :meth:`wait`,
    :meth:`close`) waits for the previous one. Only the last ``max_to_keep``
    complete steps are kept. Leftovers of a save that was killed midway are
    removed when the folder is opened.

    Args:
        directory: The checkpoint folder (created if missing).
        max_to_keep: How many complete steps to keep.
        async_save: Write in a background thread (``False``: each save blocks).

    Example:
        >>> import tempfile, jax.numpy as jnp, meshplan
        >>> folder = tempfile.mkdtemp()
        >>> with meshplan.Checkpointer(folder, max_to_keep=2) as ckpt:
        ...     for step in (1, 2, 3):
        ...         _ = ckpt.save(step, {"step": jnp.int32(step)})
        ...     ckpt.wait()
        ...     ckpt.all_steps()
        [2, 3]
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
    ) -> None:
        import orbax.checkpoint as ocp

        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                f"Cannot save checkpoints into {str(self.directory)!r}: it is a file.\n"
                f"Pass a folder path (it is created if missing)."
            )
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            cleanup_tmp_directories=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(
        self,
        step: int,
        state: Any,
        *,
        rules: Any = None,
        mesh: Mesh | None = None,
        config: Mapping[str, Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> bool:
        """Starts saving ``state`` (boxed or raw arrays) as ``step``; ``False`` if it exists.

        Args:
            step: The step number (the folder name).
            state: Any pytree of arrays; boxes record their axis names.
            rules: The rules of the run (default: the active ones).
            mesh: The run's mesh (default: the mesh of the first sharded array).
            config: The model config as a JSON-serialisable dict.
            extra: More JSON-serialisable data to store (e.g. training settings).
        """
        import orbax.checkpoint as ocp

        from meshplan import __version__
        from meshplan._rules import get_logical_axis_rules

        if step in self._manager.all_steps():
            return False
        flat = flatten_state(state)
        mesh = mesh if mesh is not None else _mesh_of(flat)
        arrays = {
            key: ArrayInfo(
                shape=tuple(int(d) for d in value.shape),
                dtype=str(np.dtype(value.dtype)),
                names=None if box is None else tuple(box.names),
                logical=box is None or isinstance(box, LogicallyPartitioned),
            )
            for key, (value, box) in flat.items()
        }
        metadata = CheckpointMetadata(
            step=int(step),
            arrays=arrays,
            rules=normalize_rules(rules) if rules is not None else get_logical_axis_rules(),
            mesh_shape={} if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
            config=None if config is None else dict(config),
            extra=dict(extra or {}),
            meshplan_version=__version__,
        )
        raw = _nest({key: value for key, (value, _) in flat.items()})
        return bool(
            self._manager.save(
                int(step),
                args=ocp.args.Composite(
                    **{
                        _STATE: ocp.args.StandardSave(raw),
                        _META: ocp.args.JsonSave(metadata.to_json()),
                    }
                ),
                force=True,
            )
        )

    def all_steps(self) -> list[int]:
        """The complete steps on disk, oldest first (a save still running is not among them)."""
        return _complete_steps(self.directory) if self.directory.is_dir() else []

    def latest_step(self) -> int | None:
        """The latest complete step on disk, or ``None``."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def wait(self) -> None:
        """Blocks until the save in progress (if any) is complete on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in progress, then releases Orbax's resources."""
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
