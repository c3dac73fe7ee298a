"""How stable the ``cpu`` calibration is from one process to the next (issue 31 item 4).

Runs ``measure_cpu(8)`` (:mod:`meshplan._search.measure.cpu`, what the ``cpu`` profile and
the CPU MFU are made of) in ``--processes`` fresh processes, one after another, and prints
per figure: the median across processes, the interquartile range over the median, and how
many processes came within 10% of the median (target: IQR under 10%, at least 9 of 10
within 10%), with the calibration's own seconds (JAX's start and the process's excluded)
and the machine's 1-minute load average before and after.

``--against REF`` also runs the procedure of ``src/meshplan/_search/measure/cpu.py`` as it
was at git revision ``REF``, alternating process by process with this one, so both see the
same load:

    .venv/bin/python benchmarks/bench_calibration.py --processes 10
    .venv/bin/python benchmarks/bench_calibration.py --processes 10 --against main
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODULE = "src/meshplan/_search/measure/cpu.py"
FIGURES = ("matmul_flops", "memory_bandwidth", "link_bandwidth", "latency_s")
UNITS = {
    "matmul_flops": (1e9, "GFLOP/s"),
    "memory_bandwidth": (1e9, "GB/s"),
    "link_bandwidth": (1e9, "GB/s"),
    "latency_s": (1e-6, "us"),
}


def _child(module: str, devices: int) -> None:
    """One calibration in this fresh process: its figures and seconds as one JSON line."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax

    jax.devices()  # the backend started before the clock
    if module:
        spec = importlib.util.spec_from_file_location("cpu_at_revision", module)
        assert spec is not None and spec.loader is not None
        cpu: Any = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = cpu  # its dataclass looks its module up
        spec.loader.exec_module(cpu)
    else:
        from meshplan._search.measure import cpu
    t0 = time.perf_counter()
    figures = cpu.measure_cpu(devices)
    seconds = time.perf_counter() - t0
    print(json.dumps({**{k: getattr(figures, k) for k in FIGURES}, "seconds": seconds}))


def _run(module: str, devices: int) -> dict[str, float]:
    done = subprocess.run(
        [sys.executable, __file__, "--child", module, "--devices", str(devices)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"a calibration process failed:\n{done.stderr}")
    row: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def _stats(values: list[float]) -> tuple[float, float, int]:
    """Median, interquartile range over the median, count within 10% of the median."""
    median = statistics.median(values)
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    within = sum(abs(v / median - 1) <= 0.10 for v in values)
    return median, (q3 - q1) / median, within


def _report(name: str, rows: list[dict[str, float]]) -> None:
    print(f"{name}: {len(rows)} fresh processes")
    for key in (*FIGURES, "seconds"):
        scale, unit = UNITS.get(key, (1.0, "s"))
        values = [r[key] for r in rows]
        median, iqr, within = _stats(values)
        print(
            f"  {key:17s} median {median / scale:9.3f} {unit:8s} IQR {100 * iqr:5.1f}%"
            f"  within 10%: {within}/{len(values)}"
            f"  range {min(values) / scale:.3f}-{max(values) / scale:.3f}"
        )


def _at_revision(ref: str, folder: str) -> str:
    text = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{ref}:{MODULE}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = os.path.join(folder, "cpu_at_revision.py")
    Path(path).write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=10, help="fresh processes (>= 4)")
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    parser.add_argument("--against", metavar="REF", help="also the procedure at git REF")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return _child(args.child, args.devices)
    if args.processes < 4:
        parser.error("--processes must be at least 4 (quartiles of fewer mean little)")
    with tempfile.TemporaryDirectory() as folder:
        procedures = {"this tree": ""}
        if args.against:
            procedures[f"at {args.against}"] = _at_revision(args.against, folder)
        print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in procedures}
        for i in range(args.processes):
            order = list(procedures.items())
            for name, module in order if i % 2 == 0 else order[::-1]:
                rows[name].append(_run(module, args.devices))
        print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, found in rows.items():
        _report(name, found)


if __name__ == "__main__":
    main()
