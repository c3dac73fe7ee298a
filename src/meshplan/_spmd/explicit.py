"""Code written for Auto meshes run on Explicit axes: JAX's sharding type error, worded with its fix.

On a mesh whose axes are ``Explicit`` (``jax.make_mesh``'s default), every array's
sharding is part of its type, and an operation whose output sharding JAX cannot
decide is refused at trace time (``ShardingTypeError``). Code written without
that in mind fails there: Hugging Face's Flax models look up token embeddings
with ``table[ids]``, and with ``ids`` split over the batch's axis JAX asks for
``.at[...].get(out_sharding=)``, whatever the table's layout. On ``Auto`` axes
(``meshplan train``'s meshes) XLA decides, and the same code runs.
:func:`explicit_mesh_error` turns that error into a :class:`~meshplan.MeshError`
(code ``'explicit-mesh'``) that names the call and says to use Auto axes.
"""

from __future__ import annotations

from jax.sharding import AxisType

from meshplan._errors import MeshError, MeshplanError, error_for
from meshplan._spmd.place import active_mesh

__all__ = ["explicit_mesh_error", "is_sharding_type_error"]


def is_sharding_type_error(error: BaseException) -> bool:
    """Whether ``error`` is JAX's ``ShardingTypeError`` (a private class: matched by name).

    Example:
        >>> from meshplan._spmd.explicit import is_sharding_type_error
        >>> is_sharding_type_error(ValueError("x"))
        False
    """
    return any(cls.__name__ == "ShardingTypeError" for cls in type(error).__mro__)


def explicit_mesh_error(error: BaseException, call: str) -> MeshplanError:
    """``error`` (a ``ShardingTypeError`` raised inside ``call``) as a :class:`MeshError`.

    Example:
        >>> import jax
        >>> from meshplan._spmd.explicit import explicit_mesh_error
        >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        ...     e = explicit_mesh_error(TypeError("Use `.at[...].get(out_sharding=)` ..."), "apply")
        >>> print(e)
        apply cannot run on a mesh with Explicit axes ('data', 'model'): JAX refused an operation whose output sharding it cannot decide (Use `.at[...].get(out_sharding=)` ...).
        Build the mesh with Auto axes: jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(names)) ...
        >>> e.problems[0].code
        'explicit-mesh'
    """
    mesh = active_mesh()
    types = getattr(mesh, "axis_types", ()) or ()
    names = getattr(mesh, "axis_names", ()) or ()
    explicit = tuple(n for n, t in zip(names, types, strict=False) if t == AxisType.Explicit)
    first = str(error).strip().split("\n", 1)[0]
    where = f"a mesh with Explicit axes {explicit}" if explicit else "an Explicit mesh"
    return error_for(
        MeshError,
        "explicit-mesh",
        call,
        f"{call} cannot run on {where}: JAX refused an operation whose output sharding it "
        f"cannot decide ({first})",
        "Build the mesh with Auto axes: jax.make_mesh(shape, names, axis_types="
        "(jax.sharding.AxisType.Auto,) * len(names)) (meshplan.train.device_mesh.make_mesh "
        "builds them so), or call it inside jax.sharding.auto_axes. Code written for Auto "
        "meshes, such as Hugging Face's Flax models (embedding lookups by sharded token ids), "
        "cannot give JAX the out_sharding that Explicit axes ask for.",
    )
