"""`meshplan demo` runs the whole workflow from the command line."""

import subprocess
import sys

import pytest

from child_env import fresh_env

pytestmark = pytest.mark.slow  # each test here takes seconds: processes or long compiles


def test_demo_command_runs_every_step_and_restores_onto_another_mesh():
    env = fresh_env()
    out = subprocess.run(
        [sys.executable, "-m", "meshplan.cli", "demo", "--depth", "128", "--steps", "1"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "8 emulated CPU devices" in text  # it set XLA_FLAGS itself, and said so
    for step in ("device-axis, loop", "device-axis, scan", "logical, loop", "logical, scan"):
        assert step in text
    assert "shardings equal to the device-axis variant: True" in text
    assert "values equal: True" in text
    assert "same specs as on the Auto mesh: True" in text
    assert "CPU 0,4" in text  # the picture of W1's layout
    assert "Done in" in text
