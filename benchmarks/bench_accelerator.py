"""The planner against a real accelerator: predicted step time and memory, then measured.

On the machine's first device (a TPU or a GPU that :data:`meshplan.PROFILES`' chips name),
for decoders of a few shapes and remat choices that fit one device (``CASES``): the
prediction of ``meshplan.predict`` with the chip's published profile (one device: no
collectives, so this checks the compute, memory traffic and memory model), then the step
compiled and run (zero state, ``--steps`` steps after two warm-ups, the median) and its
memory read from XLA (``compiled.memory_analysis()``: arguments + temporaries) and from the
device (``memory_stats()['peak_bytes_in_use']``). Prints measured / predicted per case and
the median |error|.

    python benchmarks/bench_accelerator.py                # every case
    python benchmarks/bench_accelerator.py --cases 350m-none --steps 5
    python benchmarks/bench_accelerator.py --list

Needs an accelerator (``jax.default_backend() != 'cpu'``); run where meshplan's dependencies
are installed (``PYTHONPATH=src`` will do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax

import meshplan
from meshplan._search.measure.timing import prepare_step
from meshplan._search.predict.chips import CHIPS, chip_of
from meshplan.models.llama import LlamaConfig, llama_step

_350M = {"embed": 1024, "heads": 16, "kv_heads": 16, "head_dim": 64, "mlp": 4096, "layers": 16}
_600M = {"embed": 2048, "heads": 16, "kv_heads": 16, "head_dim": 128, "mlp": 5632, "layers": 8}
CASES: dict[str, tuple[dict[str, Any], int, int]] = {
    # name: (LlamaConfig fields beside vocab 32000 and bfloat16, batch, sequence)
    "350m-none": ({**_350M, "remat": "none"}, 4, 2048),
    "350m-full": ({**_350M, "remat": "full"}, 8, 2048),
    "350m-minimal": ({**_350M, "remat": "minimal"}, 8, 2048),
    "350m-unrolled-full": ({**_350M, "remat": "full", "scan": False}, 8, 2048),
    "600m-full": ({**_600M, "remat": "full"}, 4, 2048),
    "600m-dots-gqa": ({**_600M, "kv_heads": 4, "remat": "dots"}, 4, 2048),
}
"""Decoders (``meshplan.models.llama``) that fit one 16 GiB device with AdamW's f32 state."""

RULES = (("batch", "data"),)


def profile_name() -> str:
    """The :data:`~meshplan._search.predict.chips.CHIPS` key of this machine's first device."""
    kind = jax.devices()[0].device_kind
    chip = chip_of(kind)
    if chip is None:
        sys.exit(f"no profile for this device ({kind!r}): add its chip to chips.CHIPS")
    return next(k for k, c in CHIPS.items() if c is chip)


def run_case(name: str, profile: str, steps: int) -> dict[str, Any]:
    """One case: predicted and measured step seconds and memory bytes."""
    fields, batch, seq = CASES[name]
    cfg = LlamaConfig(vocab=32000, dtype="bfloat16", **fields)
    state, step, tokens = llama_step(cfg, batch, seq)
    mesh = {"data": 1}
    t0 = time.perf_counter()
    pred = meshplan.predict(state, step, tokens, mesh=mesh, rules=RULES, profile=profile)
    predict_s = time.perf_counter() - t0
    prepared = prepare_step(step, state, tokens, mesh, RULES)
    times = prepared.run(steps + 2)[2:]
    memory = prepared.compiled.memory_analysis()
    xla = memory.argument_size_in_bytes + memory.temp_size_in_bytes
    stats = jax.devices()[0].memory_stats() or {}
    cost = pred.cost
    row = {
        "case": name,
        "params": cfg.params(),
        "batch": batch,
        "seq": seq,
        "predicted_s": pred.step_s,
        "compute_s": cost.compute_s,
        "memory_s": cost.memory_s,
        "measured_s": statistics.median(times),
        "fastest_s": min(times),
        "predicted_bytes": pred.memory_bytes,
        "state_bytes": cost.state_bytes,
        "activation_bytes": cost.activation_bytes + cost.temporary_bytes,
        "xla_bytes": xla,
        "xla_temp_bytes": memory.temp_size_in_bytes,
        "device_peak_bytes": stats.get("peak_bytes_in_use"),
        "flops": cost.flops_per_device,
        "xla_flops": (prepared.compiled.cost_analysis() or {}).get("flops"),
        "predict_seconds": round(predict_s, 2),
    }
    del prepared
    return row


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:6.2f}"


def report(rows: list[dict[str, Any]], profile: str) -> None:
    """The table and the medians."""
    print(f"device: {jax.devices()[0].device_kind} · profile {profile} · jax {jax.__version__}")
    head = (
        f"{'case':20} {'params':>7} {'pred ms':>8} {'meas ms':>8} {'t m/p':>6} "
        f"{'pred GiB':>8} {'XLA GiB':>8} {'peak GiB':>8} {'mem m/p':>7} {'flops x/p':>9}"
    )
    print(head)
    for r in rows:
        xf = r["xla_flops"] / r["flops"] if r["xla_flops"] and r["flops"] else float("nan")
        print(
            f"{r['case']:20} {r['params'] / 1e6:6.0f}M {r['predicted_s'] * 1e3:8.1f} "
            f"{r['measured_s'] * 1e3:8.1f} {r['measured_s'] / r['predicted_s']:6.2f} "
            f"{_gib(r['predicted_bytes'])} {_gib(r['xla_bytes'])} "
            f"{_gib(r['device_peak_bytes'])} {r['xla_bytes'] / r['predicted_bytes']:7.2f} "
            f"{xf:9.2f}"
        )
    t = [abs(r["measured_s"] / r["predicted_s"] - 1) for r in rows]
    m = [abs(r["xla_bytes"] / r["predicted_bytes"] - 1) for r in rows]
    print(
        f"median |error|: step time {statistics.median(t):.1%} (worst {max(t):.1%}), "
        f"memory {statistics.median(m):.1%} (worst {max(m):.1%}) over {len(rows)} cases"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (fields, batch, seq) in CASES.items():
            print(name, fields, f"batch {batch}, seq {seq}")
        return 0
    if jax.default_backend() == "cpu":
        sys.exit("bench_accelerator.py needs an accelerator (jax.default_backend() is 'cpu')")
    profile = profile_name()
    rows = []
    for name in args.cases:
        try:
            rows.append(run_case(name, profile, args.steps))
        except Exception as e:  # one case that does not fit or compile: say so, go on
            print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        print(json.dumps(rows[-1]), flush=True)
    if rows:
        report(rows, profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
