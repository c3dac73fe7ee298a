"""Fixtures shared by the test files (the root conftest.py sets 8 CPU devices)."""

import subprocess
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

import meshplan


def pytest_collection_modifyitems(config, items):
    """The files with the most tests marked slow run first, each file's tests kept together
    and in order (its module fixtures are made once): with two workers sharing the queue,
    the last tests to start are short ones, so neither waits long for the other at the end."""
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    rank = {path: (-count, i) for i, (path, count) in enumerate(slow.items())}
    items.sort(key=lambda item: rank[item.path])


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


def _can_mount(tmp_path: Path) -> bool:
    probe = tmp_path / "mount-probe"
    probe.mkdir()
    command = ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)]
    if subprocess.run(command, capture_output=True).returncode != 0:
        return False
    subprocess.run(["umount", str(probe)], check=True)
    return True


def _tmpfs(tmp_path, size: str):
    if not _can_mount(tmp_path):
        yield None
        return
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs (``None`` where ``mount`` is not permitted); unmounted afterwards.

    Faults are tested on real files: a full disk is this tmpfs filling up, a read-only
    folder is it remounted read-only (``chmod`` denies nothing to root). Where ``mount``
    is refused the tests inject the same errors into the write path instead.
    """
    yield from _tmpfs(tmp_path, "1m")


@pytest.fixture
def train_disk(tmp_path):
    """The same as ``small_disk``, 3 MiB: a training run's first checkpoint (with its
    checksums) fits, a few more fill it."""
    yield from _tmpfs(tmp_path, "3m")
