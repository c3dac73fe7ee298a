"""How a step's arrays are written: Orbax's pytree handler, one replica writing each shard.

Orbax 0.12's default ``ArrayHandler`` saves a replicated array *replica-parallel*:
each replica of a shard slices its share (``jax.lax.slice_in_dim``) and writes it.
Each slice is an eager JAX operation compiled for its own shape and offset, so
the first save of a data-parallel Transformer compiled 64 ``jit(slice)``
programs in the middle of training (issue 33). meshplan writes with
``use_replica_parallel=False`` instead: replica 0 of each shard writes it whole,
nothing is sliced and nothing compiles. (Orbax already makes that its default on
GPU.) The files are the same Orbax format; a step restores onto any mesh as before.

The handler is meshplan's own (a ``PyTreeCheckpointHandler`` with a type registry
of its own), so the process-wide registry a user's own Orbax code reads is left
as it was. Its array handler keeps Orbax's array-metadata store (the
``array_metadatas`` folder of each step), whose class Orbax does not export: it
is imported from ``orbax.checkpoint._src``, and where a later Orbax moves it the
steps are written without that folder (they restore the same).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from meshplan._checkpoint.folder import META_ITEM, STATE_ITEM

__all__ = ["item_handlers", "state_save_args"]


def _metadata_store() -> Any:
    """A fresh Orbax array-metadata store, as Orbax's default array handler has (or None)."""
    try:
        from orbax.checkpoint._src.metadata.array_metadata_store import Store
    except ImportError:  # pragma: no cover - a later Orbax moved it
        return None
    return Store()


def _registry() -> Any:
    """Orbax's standard handlers, with arrays written by one replica per shard."""
    from orbax.checkpoint import type_handlers as th

    arrays = th.ArrayHandler(use_replica_parallel=False, array_metadata_store=_metadata_store())
    scalar = th.ScalarHandler()
    return th.create_type_handler_registry(
        (int, scalar),
        (float, scalar),
        (bytes, scalar),
        (np.number, scalar),
        (np.ndarray, th.NumpyHandler()),
        (jax.Array, arrays),
        (str, th.StringHandler()),
    )


def item_handlers() -> dict[str, Any]:
    """The handlers of a step's two items, for ``ocp.CheckpointManager(item_handlers=...)``.

    Example:
        >>> from meshplan._checkpoint.writer import item_handlers
        >>> sorted((name, type(h).__name__) for name, h in item_handlers().items())
        [('meshplan', 'JsonCheckpointHandler'), ('state', 'PyTreeCheckpointHandler')]
    """
    import orbax.checkpoint as ocp

    return {
        STATE_ITEM: ocp.PyTreeCheckpointHandler(type_handler_registry=_registry()),
        META_ITEM: ocp.JsonCheckpointHandler(),
    }


def state_save_args(tree: Any) -> Any:
    """The save arguments of the state item (its handler is :func:`item_handlers`'s).

    Example:
        >>> import jax.numpy as jnp
        >>> from meshplan._checkpoint.writer import state_save_args
        >>> type(state_save_args({"w": jnp.ones(2)})).__name__
        'PyTreeSaveArgs'
    """
    import orbax.checkpoint as ocp

    return ocp.args.PyTreeSave(tree)
