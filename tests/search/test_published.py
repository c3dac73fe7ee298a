"""Two rows of ``benchmarks/bench_published.py``: the planner against published results.

The benchmark itself (every row, with the search) is run by hand and reported in
``docs/benchmarks.md``; this catches a regression of the cost or memory model cheaply.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_published

pytestmark = pytest.mark.slow  # each test here takes seconds: processes or long compiles

ROWS = ["MaxText 16B v5e-256", "llm-foundry MPT-30B 8x A100", "Megatron-LM 1.7B 32x A100"]


@pytest.mark.parametrize("name", ROWS)
def test_a_published_configuration_is_predicted_within_25_percent_and_fits(name):
    row = next(r for r in bench_published.rows() if r.name == name)
    result = bench_published.run_row(row, search=False)
    assert abs(result["error"]) <= 0.25, result
    assert result["fits"], result
