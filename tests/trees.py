"""Small abstract leaves for tests: shapes without data."""

import jax
import jax.numpy as jnp

import meshplan


def sds(*shape: int) -> jax.ShapeDtypeStruct:
    """A float32 ``ShapeDtypeStruct`` of ``shape``."""
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def logical(*shape: int, names) -> meshplan.LogicallyPartitioned:
    """A logical box around an abstract float32 array."""
    return meshplan.LogicallyPartitioned(sds(*shape), names)


def mesh_box(*shape: int, names) -> meshplan.Partitioned:
    """A mesh-axis box around an abstract float32 array."""
    return meshplan.Partitioned(sds(*shape), names)
