"""The environment of a process a test starts, as a reader's shell would give it."""

from __future__ import annotations

import os

COUNT_FLAG = "--xla_force_host_platform_device_count"
SESSION_XLA_FLAGS = {
    "--xla_backend_optimization_level": "0",
    "--xla_cpu_use_fusion_emitters": "false",
}
"""The test session's CPU code generation (the root ``conftest.py`` says why), by flag: what
``benchmarks/bench_test_flags.py`` compares with XLA's defaults."""


def fresh_env(*drop: str, **extra: str) -> dict[str, str]:
    """This process's environment without the test session's device count, for a process
    that sets its own (``meshplan --devices``, or one CPU device).

    ``XLA_FLAGS`` keeps the session's other flags (its CPU code generation settings, see the
    root ``conftest.py``); ``drop`` names variables to leave out; ``extra`` sets others.
    """
    env = {k: v for k, v in os.environ.items() if k not in drop}
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(extra)
    return env
