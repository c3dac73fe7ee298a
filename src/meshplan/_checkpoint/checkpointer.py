"""Saving meshplan checkpoints with Orbax's ``CheckpointManager``, asynchronously.

A meshplan checkpoint is an Orbax ``CheckpointManager`` folder. Each step folder
holds two items:

* ``state``: the raw (unboxed) arrays, as a nested dict keyed by their paths in
  the saved tree (``params/Embed_0/embedding``, ``opt_state/1/0/mu/...``);
* ``meshplan``: JSON metadata beside them: the step, the model config, the
  shape, dtype and logical axis names of every array (keyed by path), the rules
  and the mesh shape the run used, and the meshplan version.

The parts, one concern each:

* :mod:`meshplan._checkpoint.tree`: arrays by their path in a tree;
* :mod:`meshplan._checkpoint.metadata`: the JSON beside the arrays;
* :mod:`meshplan._checkpoint.folder`: the steps and metadata of a folder, through
  Orbax's ``CheckpointManager``;
* :mod:`meshplan._checkpoint.restore`: :func:`~meshplan.restore` onto any mesh;
* this module: :class:`Checkpointer`, the saving side.

Orbax writes each step into ``<step>.orbax-checkpoint-tmp-...`` and renames it
when complete (on cloud storage: writes a commit marker), so a run killed in the
middle of a save leaves the previous steps intact; only steps Orbax finalized
are ever listed or restored.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from meshplan._checkpoint.folder import (
    ITEM_NAMES,
    META_ITEM,
    STATE_ITEM,
    checkpoint_path,
    remove_incomplete_steps,
)
from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._checkpoint.tree import flatten_state, nest
from meshplan._errors import CheckpointError

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves meshplan checkpoints with Orbax's ``CheckpointManager`` (asynchronously).

    Each :meth:`save` returns once the arrays are copied off the devices and
    writes them in the background; the next save (or :meth:`wait`,
    :meth:`close`) waits for the previous one. Only the last ``max_to_keep``
    complete steps are kept. Leftovers of a save that was killed midway are
    removed when the folder is opened.

    Args:
        directory: The checkpoint folder (created if missing): a local path or
            any path Orbax writes (``gs://...``).
        max_to_keep: How many complete steps to keep.
        async_save: Write in a background thread (``False``: each save blocks).

    Example:
        >>> import tempfile, jax.numpy as jnp, meshplan
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     ckpt = meshplan.Checkpointer(folder, max_to_keep=2)
        ...     for step in (1, 2, 3):
        ...         _ = ckpt.save(step, {"step": jnp.int32(step)})
        ...     ckpt.wait()  # the last save is now complete on disk
        ...     print(ckpt.all_steps(), ckpt.latest_step())
        ...     ckpt.close()  # or use the Checkpointer as a context manager
        [2, 3] 3
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
    ) -> None:
        import orbax.checkpoint as ocp

        self.directory = checkpoint_path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise CheckpointError(
                f"Cannot save checkpoints into {str(self.directory)!r}: it is a file.\n"
                f"Pass a folder path (it is created if missing)."
            )
        if jax.process_index() == 0:
            # Orbax's own clean-up (cleanup_tmp_directories) runs in the background and
            # may not be done when the manager is closed; this one is done on return.
            # The other processes wait for it in the manager's create barrier.
            remove_incomplete_steps(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep,
            create=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=ITEM_NAMES
        )
        self._saving: int | None = None

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

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         print(ckpt.save(5, {"w": jnp.ones(2)}, config={"layers": 2}))
            ...         print(ckpt.save(5, {"w": jnp.zeros(2)}))  # step 5 exists
            True
            False
        """
        import orbax.checkpoint as ocp

        if step in self._manager.all_steps():  # finalized, or being written
            return False
        flat = flatten_state(state)
        metadata = CheckpointMetadata.from_flat(
            step, flat, rules=rules, mesh=mesh, config=config, extra=extra
        )
        raw = nest({key: value for key, (value, _) in flat.items()})
        saved = bool(
            self._manager.save(
                int(step),
                args=ocp.args.Composite(
                    **{
                        STATE_ITEM: ocp.args.StandardSave(raw),
                        META_ITEM: ocp.args.JsonSave(metadata.to_json()),
                    }
                ),
                force=True,
            )
        )
        if saved:
            self._saving = int(step)
        return saved

    def all_steps(self) -> list[int]:
        """The complete steps on disk, oldest first (a save still running is not among them).

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder, async_save=False) as ckpt:
            ...         print(ckpt.all_steps())
            ...         for step in (20, 10):
            ...             _ = ckpt.save(step, {"w": jnp.ones(2)})
            ...         print(ckpt.all_steps())
            []
            [10, 20]
        """
        # The manager lists a step from the moment its save starts; leave that one out
        # until Orbax has finalized it.
        in_progress = self._manager.is_saving_in_progress()
        steps = sorted(self._manager.all_steps())
        if in_progress and self._saving in steps:
            steps.remove(self._saving)
        return steps

    def latest_step(self) -> int | None:
        """The latest complete step on disk, or ``None``.

        Example:
            >>> import tempfile, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder) as ckpt:
            ...         print(ckpt.latest_step())  # an empty folder
            None
        """
        steps = self.all_steps()
        return steps[-1] if steps else None

    def wait(self) -> None:
        """Blocks until the save in progress (if any) is complete on disk.

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     with meshplan.Checkpointer(folder) as ckpt:
            ...         _ = ckpt.save(1, {"w": jnp.ones(2)})  # returns while writing
            ...         ckpt.wait()
            ...         print(ckpt.latest_step())
            1
        """
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for the save in progress, then releases Orbax's resources.

        Leaving a ``with Checkpointer(...)`` block calls it.

        Example:
            >>> import tempfile, jax.numpy as jnp, meshplan
            >>> with tempfile.TemporaryDirectory() as folder:
            ...     ckpt = meshplan.Checkpointer(folder)
            ...     _ = ckpt.save(1, {"w": jnp.ones(2)})
            ...     ckpt.close()
            ...     print(meshplan.restore(folder).metadata.step)
            1
        """
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
