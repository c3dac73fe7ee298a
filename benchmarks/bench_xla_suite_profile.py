"""Where the suite's steps spend their time, op by op, against the planner's prediction.

For each model of ``tests/xla_suite.py`` at the benchmark's scale (``bench_xla_suite.SCALES``)
and each built-in layout the analytic search passed (``--layouts``, default: tensor
parallel): XLA's profiler (``jax.profiler``, a Perfetto trace of ``--steps`` steps) gives
each compiled op's time on each device's thread, summed per device and step into kernels
(matmuls and fusions) and collectives (with the time each waits for the other devices),
printed beside the prediction's compute plus memory traffic and its communication, and the
median step.

``--ops N`` also prints, per layout, the kernels' milliseconds by kind (matmul, reduce,
transcendental, copy or transpose, elementwise: what the compiled HLO's fusion computes)
with the bytes per second their operands and results give, the ``N`` slowest kernels with
the source op each was made for, and every collective's measured milliseconds beside the
``cpu`` profile's price for its kind, group, arrays and bytes
(:func:`~meshplan._search.predict.collectives.collective_time`).

``--arrivals`` also prints, per layout, the cores a step keeps busy (its CPU time over its
wall time) and each collective's medians over devices and steps: its time, the part its
thread waited for the group's last thread to arrive (XLA:CPU's ``Rendezvous`` in the
profile), the rest, and the time since the device's previous collective ended
(docs/benchmarks.md, "Session 25").

    .venv/bin/python benchmarks/bench_xla_suite_profile.py --models moe vit
    .venv/bin/python benchmarks/bench_xla_suite_profile.py --models moe --arrivals
    .venv/bin/python benchmarks/bench_xla_suite_profile.py --models vit --ops 10
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
import math
import re
import statistics
import tempfile

import jax

import meshplan
from bench_xla_suite import SCALES, _candidates
from meshplan._search.measure.hlo import COLLECTIVES, DTYPE_BYTES
from meshplan._search.measure.timing import prepare_step
from meshplan._search.predict.collectives import array_latency, collective_time
from meshplan._search.predict.profiles import HardwareProfile, get_profile
from xla_suite import SUITE, suite_step


def _bytes(types: str) -> int:
    """The bytes of the arrays an HLO type text names (``(f32[8,64], bf16[4])``)."""
    return sum(
        DTYPE_BYTES.get(t, 1) * math.prod(int(d) for d in dims.split(",") if d)
        for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", types)
    )


def op_bytes(hlo: str) -> dict[str, tuple[int, str]]:
    """Each instruction's operand and result bytes (what its kernel reads and writes, once
    each), and the source op it was made for (its ``op_name``)."""
    sizes: dict[str, int] = {}
    found: dict[str, tuple[int, str]] = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (.*?) [\w-]+\((.*?)\)(, .*)?$", line)
        if not m:
            continue
        name, result, operands, rest = m.group(1), m.group(2), m.group(3), m.group(4) or ""
        sizes[name] = _bytes(result)
        read = sum(sizes.get(o, 0) for o in re.findall(r"%([\w.-]+)", operands))
        source = re.search(r'op_name="([^"]*)"', rest)
        found[name] = (sizes[name] + read, source.group(1) if source else "")
    return found


def op_kinds(hlo: str) -> dict[str, str]:
    """Each instruction's kind in a compiled module's text: a matmul (or a fusion of
    one), a collective, a fusion with a transcendental, a reduction, a copy or transpose,
    else elementwise."""
    bodies: dict[str, str] = {}
    for m in re.finditer(r"^(?:ENTRY )?%?([\w.-]+) .*?\{\n(.*?)\n\}", hlo, re.S | re.M):
        bodies[m.group(1)] = m.group(2)
    kinds: dict[str, str] = {}
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = \S+(?: \S+)*? ([\w-]+)\(", line)
        if not m:
            continue
        name, op = m.groups()
        body = op + " " + line
        called = re.search(r"calls=%?([\w.-]+)", line)
        if called:
            body += bodies.get(called.group(1), "")
        kinds[name] = _kind(body)
    return kinds


def _kind(body: str) -> str:
    body = re.sub(r"metadata=\{[^}]*\}", "", body)  # op names: 'transpose(jvp(...))'
    if re.search(r"\b(dot|convolution)\(", body):
        return "matmul"
    if any(c + "(" in body or c + "-start(" in body for c in COLLECTIVES):
        return "collective"
    if re.search(r"\b(exponential|tanh|log|rsqrt|sqrt|erf|power|logistic)\(", body):
        return "transcendental"
    if re.search(r"\breduce(-window)?\(", body):
        return "reduce"
    if re.search(r"\b(transpose|copy)\(", body):
        return "copy"
    return "elementwise"


def op_times(trace_dir: str, steps: int, devices: int = 8) -> dict[str, list[float]]:
    """``[seconds, runs]`` per device and step of each op name in a profile."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)["traceEvents"]
    total: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for e in events:
        if e.get("ph") == "X" and "dur" in e:
            total[e.get("name", "")][0] += e["dur"] / 1e6 / (steps * devices)
            total[e.get("name", "")][1] += 1 / (steps * devices)
    return total


def arrivals(trace_dir: str) -> dict[str, list[tuple[float, float, float]]]:
    """Each collective's calls, as ``(seconds, seconds waiting for the group, seconds since
    the device's previous collective ended)``: from the profile's ``Rendezvous`` events
    (XLA:CPU's wait for every participant's thread to arrive) within each call, and each
    call's ``device_ordinal``."""
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    with gzip.open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    waits = collections.defaultdict(list)  # thread -> [(start, dur)] of its rendezvous
    for e in events:
        if e["name"] == "Rendezvous":
            waits[e["tid"]].append((e["ts"], e["dur"]))
    calls = sorted(
        (
            e
            for e in events
            if any(c in e["name"] for c in COLLECTIVES)
            and "args" in e
            and "device_ordinal" in e["args"]
        ),
        key=lambda e: e["ts"],
    )
    found: dict[str, list[tuple[float, float, float]]] = collections.defaultdict(list)
    last: dict[str, float] = {}
    for e in calls:
        start, end, device = e["ts"], e["ts"] + e["dur"], e["args"]["device_ordinal"]
        wait = sum(d for t, d in waits[e["tid"]] if start <= t <= end)
        since = start - last[device] if device in last else math.nan
        found[e["name"]].append((e["dur"] / 1e6, wait / 1e6, since / 1e6))
        last[device] = end
    return found


def _print_arrivals(found: dict[str, list[tuple[float, float, float]]]) -> None:
    """Per collective: medians over devices and steps of its time, the part spent waiting
    for the group's last thread to arrive, the rest, and the time since the device's
    previous collective (its kernels, and what it waited for between them)."""
    print("   collective         ms   waiting   rest   since previous  wait / since")
    for name, calls in found.items():
        t, w, since = (statistics.median(c[i] for c in calls) for i in range(3))
        share = f"{w / since:13.2f}" if since > 1e-5 else f"{'-':>13s}"  # right after another
        print(
            f"   {name:16s} {t * 1e3:6.3f} {w * 1e3:8.3f} {(t - w) * 1e3:7.3f}"
            f" {since * 1e3:14.3f} {share}"
        )


def op_seconds(times: dict[str, list[float]]) -> dict[str, float]:
    """Seconds per device and step of the kernels (matmuls and fusions) and the collectives
    among :func:`op_times`."""
    total: dict[str, float] = collections.defaultdict(float)
    for name, (t, _) in times.items():
        if any(c in name for c in COLLECTIVES):
            total["collectives"] += t
        elif any(k in name for k in ("fusion", "dot", "convolution")):
            total["kernels"] += t
    return total


def _print_ops(times: dict[str, list[float]], hlo: str, n: int) -> None:
    """Milliseconds per device-step by kind (with the bytes their kernels read and write
    per second), then the ``n`` slowest kernels."""
    kinds, nbytes = op_kinds(hlo), op_bytes(hlo)
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (t, runs) in times.items():
        if name in kinds:
            by_kind[kinds[name]][0] += t
            by_kind[kinds[name]][1] += nbytes.get(name, (0, ""))[0] * runs
    print("   by kind: ms, GB/s")
    for k, (t, b) in sorted(by_kind.items()):
        print(f"     {k:14s} {t * 1e3:6.2f} {b / t / 1e9 if t else 0:6.1f}")
    ops = sorted(
        (kv for kv in times.items() if kinds.get(kv[0], "collective") != "collective"),
        key=lambda kv: -kv[1][0],
    )
    for name, (t, runs) in ops[:n]:
        moved, source = nbytes.get(name, (0, ""))
        source = "/".join(source.split("/")[-3:])
        print(
            f"   {t * 1e3:7.3f} ms {moved * runs / 1e6:7.2f} MB {kinds[name]:14s} {name} {source}"
        )


def _print_collectives(times: dict[str, list[float]], hlo: str, profile: HardwareProfile) -> None:
    """Each collective's measured milliseconds per device-step beside the profile's price
    of its kind, group and bytes (:func:`collective_time`, plus each further array of a
    combined one)."""
    print("   collective         group  arrays      MB  measured ms  priced ms")
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.-]+) = (.*?) ([\w-]+?)(?:-start)?\(", line)
        if not m or m.group(3) not in COLLECTIVES or m.group(1) not in times:
            continue
        name, result, kind = m.groups()
        iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
        listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
        n = int(iota.group(2)) if iota else len(listed.group(1).split(",")) if listed else 8
        named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)
        if named:  # mesh['axis_0'=2,...] {'axis_0'}: the named axes' devices
            sizes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
            n = math.prod(int(sizes[a]) for a in re.findall(r"'(\w+)'", named.group(2)))
        shapes, nbytes = re.findall(r"\b[a-z]+\d*\[", result), _bytes(result)
        if kind == "all-gather":
            nbytes //= n  # the shard each device contributes
        mesh, (t, runs) = {"group": n}, times[name]
        priced = collective_time(profile, kind, mesh, ("group",), nbytes)
        if len(shapes) > 1 and profile.array_latency_s:
            priced += (len(shapes) - 1) * array_latency(profile, mesh, ("group",))
        print(
            f"   {name:18s} {n:5d} {len(shapes):7d} {nbytes / 1e6:7.2f} {t * 1e3:12.3f}"
            f" {priced * runs * 1e3:10.3f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(SUITE))
    ap.add_argument("--layouts", nargs="+", default=["tensor_parallel"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--ops", type=int, default=0, help="also print the N slowest ops and kinds")
    ap.add_argument("--arrivals", action="store_true", help="each collective's wait for its group")
    args = ap.parse_args()
    print(
        "model     layout          mesh  predicted c+m  kernels  predicted comm  collectives  step"
    )
    profile = get_profile("cpu", 8)
    print("cpu profile:", {k: v for k, v in profile.to_dict().items() if isinstance(v, float)})
    for name in args.models:
        state, step, batch = suite_step(name, SCALES[name])
        found = meshplan.search_rules(8, state, step, batch, profile="cpu", compile_top=0)
        for row in (r for r in _candidates(found) if r.layout in args.layouts):
            prepared = prepare_step(step, state, batch, row.mesh, row.rules)
            timed = prepared.run_timed(20)[2:]
            median = statistics.median(t.wall_s for t in timed)
            busy = statistics.median(t.cpu_s / t.wall_s for t in timed)
            with tempfile.TemporaryDirectory() as trace_dir:
                jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
                prepared.run(args.steps)
                jax.profiler.stop_trace()
                times = op_times(trace_dir, args.steps)
                waited = arrivals(trace_dir) if args.arrivals else {}
                ops = op_seconds(times)
            c = row.cost
            mesh = "x".join(str(n) for n in row.mesh.values())
            print(
                f"{name:9s} {row.layout:15s} {mesh:4s} {(c.compute_s + c.memory_s) * 1e3:13.2f}"
                f" {ops.get('kernels', 0) * 1e3:8.2f} {c.comm_s * 1e3:15.2f}"
                f" {ops.get('collectives', 0) * 1e3:12.2f} {median * 1e3:5.2f}"
            )
            if args.ops:
                _print_ops(times, prepared.compiled.as_text(), args.ops)
                _print_collectives(times, prepared.compiled.as_text(), profile)
            if waited:
                print(f"   cores busy during a step (CPU time / wall, median): {busy:.1f}")
                _print_arrivals(waited)


if __name__ == "__main__":
    main()
