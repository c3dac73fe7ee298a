"""Runs before JAX is imported anywhere in the test session: 8 emulated CPU devices, quick
CPU code generation, and one compilation cache for the session.

The cache is JAX's persistent compilation cache in a fresh temporary folder, shared by the
pytest workers and by the ``meshplan`` processes the tests start: a program compiled once
(the same tiny Transformer's step, say) is read back instead of compiled again. The folder
is made new for each session and removed after it, so no test sees an earlier run's
programs. ``JAX_COMPILATION_CACHE_DIR`` set in the environment is used as it is.

meshplan's own cache (``MESHPLAN_CACHE``: the CPU profile it measures) is a fresh folder
too, unless set: the tests neither read nor write the user's ``~/.cache/meshplan``.
"""

import atexit
import os
import shutil
import tempfile

from child_env import SESSION_XLA_FLAGS  # tests/ is on the path (pyproject's pythonpath)

# CPU code generation at LLVM's lowest optimisation level: the programs are the ones users
# get (the same HLO, SPMD partitioning and buffer assignment; tests/search/test_memory.py reads
# memory_analysis()), only their machine code is less optimised, which the tests' tiny models
# do not notice, and a train step compiles in half the time (a sharded init in a quarter).
# Its fusions are emitted by XLA's older LLVM emitters, not the MLIR fusion emitters, which
# also group some ops differently (a small step's 264 fusions become 208): a train step
# compiles in half the time again. The collectives are the same and memory_analysis()'s
# temporaries move by bytes (benchmarks/bench_test_flags.py: 128 B of 8.9 MB); the
# memory-against-XLA suite's figures (`benchmarks/bench_xla_suite.py --memory`) are the same
# with and without it, and with XLA's defaults. Both flags: SESSION_XLA_FLAGS.
# Processes the tests start keep them (tests/child_env.py drops only the device count).
_flags = os.environ.get("XLA_FLAGS", "")
for _flag, _value in SESSION_XLA_FLAGS.items():
    if _flag not in _flags:  # one the environment sets wins
        _flags += f" {_flag}={_value}"
os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

if "MESHPLAN_CACHE" not in os.environ:  # the measured CPU profile: not the user's own cache
    _ours = tempfile.mkdtemp(prefix="meshplan-tests-cache-")
    atexit.register(shutil.rmtree, _ours, ignore_errors=True)
    os.environ["MESHPLAN_CACHE"] = _ours

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # pytest workers inherit the folder
    _cache = tempfile.mkdtemp(prefix="meshplan-tests-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")


def pytest_collection_modifyitems(config, items):
    """The docstring examples of ``meshplan.examples`` build and run whole models: slow."""
    import pytest

    for item in items:
        if type(item).__name__ == "DoctestItem" and item.name.startswith("meshplan.examples."):
            item.add_marker(pytest.mark.slow)
