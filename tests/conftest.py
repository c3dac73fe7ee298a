"""Fixtures shared by the test files (the root conftest.py sets 8 CPU devices)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import meshplan


@pytest.fixture(scope="session")
def auto_mesh() -> Mesh:
    """The guide's 2x4 ``('data', 'model')`` mesh with Auto axes."""
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


@pytest.fixture(scope="session")
def explicit_mesh() -> Mesh:
    """The same mesh as ``jax.make_mesh`` builds it: Explicit axes."""
    return jax.make_mesh((2, 4), ("data", "model"))


@pytest.fixture(autouse=True)
def _no_active_rules():
    """Every test starts, and leaves, with no active logical axis rules."""
    meshplan.set_logical_axis_rules(())
    yield
    meshplan.set_logical_axis_rules(())
