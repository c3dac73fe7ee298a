#!/usr/bin/env bash
# The accelerator check of meshplan, for a machine with one NVIDIA GPU (made for an H200) and
# jax (CUDA), flax, optax, orbax-checkpoint, rich and matplotlib installed, and no network.
#
#   benchmarks/accelerator_check.sh [RESULTS_DIR]      (or OUT=RESULTS_DIR benchmarks/...)
#
# In under 8 minutes:
#   0. installs meshplan with `pip install --no-deps -e .` (PYTHONPATH=src if that fails);
#   1. runs the tests marked `accelerator` (tests/test_accelerator.py; without pytest, as a script);
#   2. trains `--size base --dtype bfloat16` for $STEPS steps: tokens/s, step time, MFU and
#      peak device memory (device.memory_stats());
#   3. resumes that run onto the same device for $RESUME_STEPS more steps;
#   4. context parallelism: `--rules fsdp_cp` at sequence 4096 (batch 8), $LAYOUT_STEPS steps;
#   5. mixture of experts: `--experts 8 --top-k 2 --rules expert_parallel`, $LAYOUT_STEPS steps
#      (with one device the context and expert axes have size 1: these measure the long-sequence
#      and MoE steps' time and memory, and that the layouts run on the device);
#   6. pipeline: benchmarks/bench_pipeline.py --one-device --quick (4 stages vmapped on the one
#      device: the bubble counted and timed), in both modes.
#   7. the step loop's own cost: benchmarks/bench_train_overhead.py, Trainer against a bare
#      jitted loop of the same model, optimizer and batches (a few-millisecond Transformer step
#      and a --model factory's), alternating; prints the ratios (target <= 1.03).
# Results: $OUT (or RESULTS_DIR)/accelerator_check.txt, with the logs and --metrics beside it.
#
# MESHPLAN_CHECK_MODE=cpu runs the same steps on a tiny config on 8 emulated CPU devices, with
# no install (tests/test_accelerator_check.py runs it, so the script cannot rot).
set -uo pipefail

cd "$(dirname "$0")/.."
out="${OUT:-${1:-}}"
if [ -z "$out" ]; then
  echo "usage: $0 RESULTS_DIR   (or set OUT=RESULTS_DIR)" >&2
  exit 2
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
results="$out/accelerator_check.txt"
python="${PYTHON:-python3}"
mode="${MESHPLAN_CHECK_MODE:-gpu}"
steps="${STEPS:-60}"
resume_steps="${RESUME_STEPS:-20}"
failed=0
: > "$results"

note() { echo "$*" | tee -a "$results"; }

if [ "$mode" = cpu ]; then
  size=(--size tiny --layers 1 --embed 32 --mlp 64 --max-len 64 --batch 8 --seq 32)
  where=(--platform cpu --devices 8 --mesh 2x4)
  export JAX_PLATFORMS=cpu
  steps="${STEPS:-4}"
  resume_steps="${RESUME_STEPS:-2}"
  layout_steps="${LAYOUT_STEPS:-2}"
  long=(--seq 32)
  experts=(--experts 4)
  overhead=(--platform cpu --case own --steps 3 --rounds 1)
else
  size=(--size base --dtype bfloat16)
  where=(--mesh 1x1)
  layout_steps="${LAYOUT_STEPS:-20}"
  long=(--seq 4096 --max-len 4096 --batch 8)
  experts=(--experts 8 --top-k 2 --batch 16)
  overhead=(--platform gpu --case small --case own --steps 20 --rounds 10)
  export JAX_PLATFORMS=  # every platform: the test suite's conftest would otherwise pick the CPU
  if ! "$python" -m pip install --quiet --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 \
     && ! "$python" -m pip install --quiet --no-deps -e . >>"$out/install.log" 2>&1; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    note "install: pip install --no-deps -e . failed (see install.log): using PYTHONPATH=src"
  fi
fi

note "meshplan accelerator check, $(date -u +%Y-%m-%dT%H:%M:%SZ), mode $mode"
"$python" - <<'PY' 2>&1 | tee -a "$results"
import jax
d = jax.devices()[0]
print(f"jax {jax.__version__}: {jax.device_count()} x {d.device_kind} (platform {d.platform})")
PY

# 1. The tests marked `accelerator`.
if "$python" -c "import pytest" 2>/dev/null; then
  tests=("$python" -m pytest -q -p no:cacheprovider -m accelerator tests/test_accelerator.py)
else
  tests=("$python" tests/test_accelerator.py)
fi
if timeout 90 "${tests[@]}" >"$out/tests.log" 2>&1; then
  note "1. accelerator tests: passed ($(tail -n 1 "$out/tests.log"))"
else
  failed=1
  note "1. accelerator tests: FAILED (exit $?); the end of tests.log:"
  tail -n 20 "$out/tests.log" | tee -a "$results"
fi

# 2. Training for a fixed number of steps; 3. one resume onto the same device.
run="$out/run"
rm -rf "$run" "$out/metrics.jsonl"
common=(--eval-every 0 --eval-batches 1 --ckpt-every 0 --ckpt-dir "$run"
        --metrics "$out/metrics.jsonl")
train() {  # train NAME SECONDS ARGS...: runs meshplan train, its output in $out/NAME.log
  local name="$1" limit="$2"; shift 2
  if timeout "$limit" "$python" -m meshplan.cli train "$@" >"$out/$name.log" 2>&1; then
    note "$name: ok ($*)"
  else
    failed=1
    note "$name: FAILED (exit $?: $*); the end of $name.log:"
    tail -n 30 "$out/$name.log" | tee -a "$results"
  fi
}
train 2-train 240 "${where[@]}" "${size[@]}" --steps "$steps" "${common[@]}"
train 3-resume 150 "${where[@]}" --resume --steps "$((steps + resume_steps))" "${common[@]}"
# 4. and 5.: the context- and expert-parallel layouts (their mesh axes: data,context and
# data,expert, from the layout), without checkpoints.
layout_common=(--eval-every 0 --eval-batches 1 --ckpt-every 0 --steps "$layout_steps")
train 4-context 150 "${where[@]}" "${size[@]}" --rules fsdp_cp "${long[@]}" \
  "${layout_common[@]}" --metrics "$out/metrics-context.jsonl"
train 5-experts 150 "${where[@]}" "${size[@]}" --rules expert_parallel "${experts[@]}" \
  "${layout_common[@]}" --metrics "$out/metrics-experts.jsonl"
# 6. The pipeline: on one device its stages are vmapped there (no pipeline axis to split).
# The same command in cpu mode: the one the accelerator runs is the one kept from rotting
# (a pipeline trained over 8 CPU devices is tests/cli/test_train_pipeline.py's).
if timeout 150 "$python" benchmarks/bench_pipeline.py --one-device --quick \
     >"$out/6-pipeline.log" 2>&1; then
  note "6-pipeline: ok (bench_pipeline.py --one-device --quick)"
  tee -a "$results" <"$out/6-pipeline.log"
else
  failed=1
  note "6-pipeline: FAILED (exit $?); the end of 6-pipeline.log:"
  tail -n 30 "$out/6-pipeline.log" | tee -a "$results"
fi

# 6. The step loop against a bare jitted loop (its lines go into the results as printed).
if timeout 150 "$python" benchmarks/bench_train_overhead.py "${overhead[@]}" >"$out/7-overhead.log" 2>&1; then
  note "7-overhead: ok (trainer / bare loop, median step times; target ratio <= 1.03)"
  grep -E "^(jax|tiny|small|own) " "$out/7-overhead.log" | tee -a "$results"
else
  failed=1
  note "7-overhead: FAILED (exit $?); the end of 7-overhead.log:"
  tail -n 20 "$out/7-overhead.log" | tee -a "$results"
fi

# The figures: from --metrics (every timed step) and the summaries (MFU's peak, memory).
"$python" - "$out" "$steps" <<'PY' 2>&1 | tee -a "$results"
import json, statistics, sys
from pathlib import Path

out, steps = Path(sys.argv[1]), int(sys.argv[2])
records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
for name, part in (("train", lambda s: s <= steps), ("resume", lambda s: s > steps)):
    timed = [r for r in records if "step_time_s" in r and r["step_time_s"] and part(r["step"])]
    if not timed:
        print(f"{name}: no timed step")
        continue
    median = statistics.median(r["step_time_s"] for r in timed)
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    mfu = f"{statistics.median(mfus):.1%}" if mfus else "- (see the log: no peak)"
    losses = [r["loss"] for r in records if "loss" in r and part(r["step"])]
    print(f"{name}: {len(timed)} timed steps, median step time {median * 1e3:.1f} ms, "
          f"{tps:,.0f} tokens/s, MFU {mfu}, last loss {losses[-1]:.3f}")
for name in ("context", "experts"):
    path = out / f"metrics-{name}.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines() if x] if path.exists() else []
    timed = [r for r in rows if r.get("step_time_s")]
    if not timed:
        print(f"{name}: no timed step")
        continue
    median = statistics.median(r["step_time_s"] for r in timed)
    tps = statistics.median(r["tokens_per_s"] for r in timed)
    line = f"{name}: {len(timed)} timed steps, median step time {median * 1e3:.1f} ms, {tps:,.0f} tokens/s"
    moe = [r["metrics"] for r in rows if r.get("metrics") and r["metrics"].get("routed")]
    if moe:
        dropped = sum(m["dropped"] for m in moe) / sum(m["routed"] for m in moe)
        line += f", {dropped:.2%} of expert choices dropped"
    print(line)
for log in ("2-train", "3-resume", "4-context", "5-experts"):
    path = out / f"{log}.log"
    if not path.exists():
        continue
    for line in path.read_text().splitlines():
        words = " ".join(line.replace("│", " ").split())
        if words.startswith(("devices:", "MFU against", "no MFU", "peak memory", "MFU ")):
            print(f"  {log}: {words}")
PY
note "result: $([ "$failed" = 0 ] && echo passed || echo FAILED)"
exit "$failed"
