"""Where the suite's steps spend their time, op by op, against the planner's prediction.

For each model of ``tests/xla_suite.py`` at the benchmark's scale (``bench_xla_suite.SCALES``)
and each built-in layout the analytic search passed (``--layouts``, default: tensor
parallel): XLA's profiler (``jax.profiler``, a Perfetto trace of ``--steps`` steps) gives
each compiled op's time on each device's thread, summed per device and step into kernels
(matmuls and fusions) and collectives (with the time each waits for the other devices),
printed beside the prediction's compute plus memory traffic and its communication, and the
median step.

    .venv/bin/python benchmarks/bench_xla_suite_profile.py --models moe vit
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.dirname(__file__))

import argparse
import collections
import glob
import gzip
import json
import statistics
import tempfile

import jax

import meshplan
from bench_xla_suite import SCALES, _candidates
from meshplan._search.measure.timing import prepare_step
from xla_suite import SUITE, suite_step

COLLECTIVES = ("all-reduce", "all-gather", "collective-permute", "all-to-all", "reduce-scatter")


def op_seconds(trace_dir: str, steps: int, devices: int = 8) -> dict[str, float]:
    """Seconds per device and step of the kernels and the collectives in a profile."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    total: dict[str, float] = collections.defaultdict(float)
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if any(c in name for c in COLLECTIVES):
            total["collectives"] += e["dur"] / 1e6
        elif any(k in name for k in ("fusion", "dot", "convolution")):
            total["kernels"] += e["dur"] / 1e6
    return {k: v / (steps * devices) for k, v in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SUITE))
    ap.add_argument("--layouts", nargs="+", default=["tensor_parallel"])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    print(
        "model     layout          mesh  predicted c+m  kernels  predicted comm  collectives  step"
    )
    for name in args.models:
        state, step, batch = suite_step(name, SCALES[name])
        found = meshplan.search_rules(8, state, step, batch, profile="cpu", compile_top=0)
        for row in (r for r in _candidates(found) if r.layout in args.layouts):
            prepared = prepare_step(step, state, batch, row.mesh, row.rules)
            median = statistics.median(prepared.run(20)[2:])
            with tempfile.TemporaryDirectory() as trace_dir:
                jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
                prepared.run(args.steps)
                jax.profiler.stop_trace()
                ops = op_seconds(trace_dir, args.steps)
            c = row.cost
            mesh = "x".join(str(n) for n in row.mesh.values())
            print(
                f"{name:9s} {row.layout:15s} {mesh:4s} {(c.compute_s + c.memory_s) * 1e3:13.2f}"
                f" {ops.get('kernels', 0) * 1e3:8.2f} {c.comm_s * 1e3:15.2f}"
                f" {ops.get('collectives', 0) * 1e3:12.2f} {median * 1e3:5.2f}"
            )


if __name__ == "__main__":
    main()
