"""benchmarks/accelerator_check.sh in its CPU mode, on a tiny config: the script cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from child_env import fresh_env

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "accelerator_check.sh"


@pytest.mark.slow
def test_the_accelerator_check_runs_in_cpu_mode(tmp_path):
    env = fresh_env(
        "JAX_PLATFORMS", MESHPLAN_CHECK_MODE="cpu", PYTHON=sys.executable, OUT=str(tmp_path / "out")
    )
    done = subprocess.run(
        ["bash", str(SCRIPT)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    results = (tmp_path / "out" / "accelerator_check.txt").read_text()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1. accelerator tests: passed" in results
    assert "2-train: ok" in results and "3-resume: ok" in results
    assert "4-context: ok" in results and "5-experts: ok" in results
    assert "6-pipeline: ok" in results
    assert "4 stages vmapped on one device" in results  # the accelerator's own command, here
    assert "7-overhead: ok" in results
    assert "ratio" in next(line for line in results.splitlines() if line.startswith("own "))
    lines_of = {line.split(":", 1)[0]: line for line in results.splitlines()}
    assert "tokens/s" in lines_of["context"]
    assert "of expert choices dropped" in lines_of["experts"]
    lines = results.splitlines()
    train = next(line for line in lines if line.startswith("train: "))
    assert "median step time" in train and "tokens/s" in train and "MFU " in train
    assert next(line for line in lines if line.startswith("resume: ")).startswith(
        "resume: 1 timed steps"
    )
    assert "so 8 emulated CPU devices (platform cpu)" in results
    assert "measured CPU peak" in results and "peak memory" in results
    assert results.rstrip().endswith("result: passed")


def test_without_a_results_folder_it_says_how_to_call_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "usage:" in done.stderr
