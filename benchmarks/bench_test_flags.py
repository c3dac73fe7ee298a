"""Compile time of a small train step under the test session's XLA flags and XLA's defaults.

The root ``conftest.py`` compiles the suite's programs with ``SESSION_XLA_FLAGS``
(``tests/child_env.py``): LLVM's lowest optimisation level and XLA:CPU's older LLVM fusion
emitters. For each setting this measures, in ``--rounds`` fresh processes (interleaved), a
2-layer Llama-style decoder's AdamW step under fsdp_tp on 2x4 emulated CPU devices with
:func:`meshplan._search.measure.hlo.measure_step`; it prints the median time to trace,
lower and compile it, the ratio to XLA's defaults, and the step's temporaries and
collectives, which the flags should leave as they are (a few bytes at most).

    .venv/bin/python benchmarks/bench_test_flags.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from child_env import SESSION_XLA_FLAGS

SETTINGS = {
    "xla defaults": {},
    "-O0": {"--xla_backend_optimization_level": "0"},
    "tests (SESSION_XLA_FLAGS)": SESSION_XLA_FLAGS,
}

CHILD = """
import json
from meshplan import layouts
from meshplan._search.measure.hlo import measure_step
from meshplan.models.llama import LlamaConfig, llama_step

state, step, batch = llama_step(LlamaConfig(dtype="float32"), batch=8, seq=64)
found = measure_step(step, state, batch, {"data": 2, "model": 4}, layouts.fsdp_tp)
print(json.dumps({k: found[k] for k in ("compile_seconds", "xla_temp_bytes", "collectives")}))
"""


def _once(flags: dict[str, str]) -> dict[str, object]:
    given = " ".join(f"{flag}={value}" for flag, value in flags.items())
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XLA_FLAGS=f"{given} --xla_force_host_platform_device_count=8".strip())
    env.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, flags in SETTINGS.items():
            runs[name].append(_once(flags))
    medians = {
        name: statistics.median(float(str(r["compile_seconds"])) for r in rows)
        for name, rows in runs.items()
    }
    for name, rows in runs.items():
        print(
            f"{name:26s} compile {medians[name]:5.2f} s "
            f"(x{medians[name] / medians['xla defaults']:.2f}), "
            f"temporaries {rows[0]['xla_temp_bytes']} B, collectives {rows[0]['collectives']}"
        )


if __name__ == "__main__":
    main()
