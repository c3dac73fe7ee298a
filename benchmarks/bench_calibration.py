"""How stable the ``cpu`` calibration is from one process to the next (issue 31 item 4).

Runs ``measure_cpu(8)`` (:mod:`meshplan._search.measure.cpu`, what the ``cpu`` profile and
the CPU MFU are made of) in ``--processes`` fresh processes, one after another, and prints
per figure: the median across processes, the interquartile range over the median, and how
many processes came within 10% of the median (target: IQR under 10%, at least 9 of 10
within 10%), with the calibration's own seconds (JAX's start and the process's excluded)
and the machine's 1-minute load average before and after.

``--groups`` measures instead what one ``psum`` costs over groups of 2, 4 and 8 of the
devices (the rest of the mesh running the same at once) at 4 bytes, 1 MiB and 8 MiB per
device, against what the calibration's one figure at all 8 and 1 MiB implies (the ``cpu``
profile prices a group of ``k`` as a ring: ``2 (k-1)/k`` of the bytes):

    .venv/bin/python benchmarks/bench_calibration.py --groups

``--arrays`` measures what one all-reduce that XLA combined from several costs, by the
number of arrays it carries (1 to 64, 64 KiB and 1 MiB a device in all) and the group (2, 4
and 8 devices), against what the ``cpu`` profile prices for its latencies: ``k / devices``
(``latency_per_device``) of the calibration's latency plus its ``array_latency_s`` for each
array beyond the first:

    .venv/bin/python benchmarks/bench_calibration.py --arrays

``--in-step`` times the same inside a training step: the suite's decoder
(``tests/xla_suite.py``) data parallel in ``shard_map``, with and without a ``psum`` of its
gradients (one all-reduce XLA combines from all of them), against what the ``cpu`` profile
prices for that all-reduce's latencies and bytes:

    .venv/bin/python benchmarks/bench_calibration.py --in-step

``--skew`` measures what a ``psum`` of 4 bytes costs when each device first runs some work
(a segment of 10 or 40 small kernels, 64K floats each), by group, against the same chain
with no work between (the calibration's setting): the difference is what synchronising
after work adds (the wait for the group's slowest device, and more), printed with its share
of the segment's time (docs/benchmarks.md, "Session 17"):

    .venv/bin/python benchmarks/bench_calibration.py --skew

``--written`` measures whether a ``psum`` costs more when a kernel has just written its
operand, as an activation's all-reduce in a step follows the matmul that made it: per
group, at 64 KiB and 256 KiB per device (the suite's activations), a chain of ``psum``s
alone, of ``tanh`` kernels alone, and of each ``tanh`` then a ``psum`` of its result, the
``psum`` after the kernel being the third less the second, beside what the ``cpu`` profile
prices for it (docs/benchmarks.md, "Session 21"):

    .venv/bin/python benchmarks/bench_calibration.py --written

``--after-matmul`` measures the same with a matmul as the kernel (``[rows, 1024] @ [1024,
1024]`` per device, 128 and 512 KiB results), as a tensor-parallel layer's all-reduce follows
the matmul whose partial sums it adds: XLA:CPU's matmuls run on threads the devices share,
so the devices reach the ``psum`` at different times and it waits for the last. Printed
with the matmul's own seconds and the wait over them, and that share over the expected
largest of ``group`` standard normal draws (the wait for the slowest of ``group`` devices
whose times scatter alike; docs/benchmarks.md, "Session 22"):

    .venv/bin/python benchmarks/bench_calibration.py --after-matmul

``--arrival`` measures what a ``psum`` of 4 bytes adds after work, by group, when every
device did the same work (``tanh`` kernels in a loop, 3 or 10 of them) and when only the
group's first device did (the others arrive at once and wait): each against the chain with
no work between, printed with the wait over the work and that share over the expected
largest of ``group`` standard normal draws: the relative scatter of the devices' arrivals,
if they scatter normally (docs/benchmarks.md, "Session 25"):

    .venv/bin/python benchmarks/bench_calibration.py --arrival

``--fresh`` times a tensor-parallel MLP's step (two blocks of LayerNorm, a Dense to 1024,
GELU and a Dense back to 256, sequence 64) at batches 32, 64 and 128 under data parallelism
and tensor parallelism on 2 x 4, 4 x 2 and 1 x 8, beside XLA's temporaries of the program
timed (its state donated, as a training loop runs it) and the planner's: from 32 MiB a
device, XLA:CPU's temporaries are new memory every step (the page faults a step are
printed), and their first touch (``first_touch_s``, measured by the calibration) is priced
(docs/benchmarks.md, "Session 23"):

    .venv/bin/python benchmarks/bench_calibration.py --fresh

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
import resource
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


def _interleaved(kernels: dict[Any, Any], devices: int, rounds: int) -> dict[Any, list[float]]:
    """Each kernel's call seconds (:func:`call_seconds`), ``rounds`` interleaved rounds
    after two not counted."""
    import jax

    from meshplan._search.measure.cpu import call_seconds, cpu_cores

    for k in kernels.values():
        for _ in range(2):
            jax.block_until_ready(k())
    seconds: dict[Any, list[float]] = {key: [] for key in kernels}
    cores = cpu_cores()
    for _ in range(rounds):
        for key, k in kernels.items():
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(k())
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            seconds[key].append(call_seconds(wall, cpu, devices, cores))
    return seconds


def _chained(devices: int, group: int, chain: Any, *arrays: Any) -> Any:
    """A call running ``chain`` (in ``shard_map``, over ``'b'``: groups of ``group`` of the
    ``devices``; ``'a'``: the rest, running the same at once) on ``arrays`` split over every
    device, each call on the last one's results (donated: no call allocates)."""
    import jax
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((devices // group, group), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    spec = P(("a", "b"))
    specs = (spec,) * len(arrays)
    run = jax.jit(
        jax.shard_map(
            chain, mesh=mesh, in_specs=specs, out_specs=specs if len(arrays) > 1 else spec
        ),
        donate_argnums=tuple(range(len(arrays))),
    )
    box = [tuple(jax.device_put(a, NamedSharding(mesh, spec)) for a in arrays)]

    def call() -> Any:
        out = run(*box[0])
        box[0] = out if isinstance(out, tuple) else (out,)
        return out

    return call


def groups(devices: int, rounds: int = 15) -> None:
    """Seconds per ``psum`` over groups of 2, 4, ... ``devices`` (module docstring): a chain
    of 5 less a single one, the median over interleaved rounds, in call seconds."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import numpy as np

    def kernel(group: int, times: int, floats: int) -> Any:
        def total(y: Any) -> Any:
            for _ in range(times):
                y = jax.lax.psum(y, "b")  # type: ignore[no-untyped-call]
            return y

        return _chained(devices, group, total, np.zeros((devices, floats), np.float32))

    sizes = (1, 1 << 18, 1 << 21)
    sides = [g for g in (2, 4, 8, 16) if g <= devices and devices % g == 0]
    kernels = {(g, f, t): kernel(g, t, f) for g in sides for f in sizes for t in (1, 5)}
    seconds = _interleaved(kernels, devices, rounds)
    print(f"{'group':>5} {'bytes/device':>12} {'us per psum':>12} {'ring GB/s':>10}")
    for f in sizes:
        for g in sides:
            once, many = seconds[(g, f, 1)], seconds[(g, f, 5)]
            each = statistics.median(m - o for o, m in zip(once, many, strict=True)) / 4
            ring = 2 * (g - 1) / g * 4 * f / each / 1e9 if f > 1 else float("nan")
            print(f"{g:5d} {4 * f:12,d} {each * 1e6:12.1f} {ring:10.2f}")


def _summed(devices: int, group: int, arrays: int, floats: int, reduce: bool) -> Any:
    """A program of ``arrays`` sums over a ``group``-sized axis that XLA combines into one
    all-reduce of that many operands (``reduce``), or the same sums without it."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((devices // group, group), ("a", "b"), axis_types=(AxisType.Auto,) * 2)
    ins = NamedSharding(mesh, P("b" if reduce else None, "a"))
    outs = NamedSharding(mesh, P(None, "a"))

    def sums(*xs: Any) -> Any:
        return tuple(jnp.sum(x * 0.5, axis=0, keepdims=True) for x in xs)

    run = jax.jit(sums, in_shardings=(ins,) * arrays, out_shardings=(outs,) * arrays)
    shape = (group if reduce else 1, devices // group * floats)
    box = [jax.device_put(np.ones(shape, np.float32), ins) for _ in range(arrays)]
    return lambda: run(*box)


def arrays(devices: int, rounds: int = 15) -> None:
    """Seconds of one combined all-reduce by its arrays and group (module docstring): the
    program with it less the same without, medians over interleaved rounds, call seconds."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"

    from meshplan._search.predict.profiles import get_profile

    sides = [g for g in (2, 4, 8, 16) if g <= devices and devices % g == 0]
    keys = [(g, f, a) for g in sides for f in (1 << 14, 1 << 18) for a in (1, 4, 16, 64)]
    kernels = {(*k, r): _summed(devices, k[0], k[2], k[1] // k[2], r) for k in keys for r in (0, 1)}
    seconds = _interleaved(kernels, devices, rounds)
    profile = get_profile("cpu", devices)
    latency, array = profile.latency_s, profile.array_latency_s
    print(
        f"the cpu profile over all {devices} devices: latency {latency * 1e6:.1f} us, "
        f"{array * 1e6:.1f} us per further array"
    )
    print(
        f"{'group':>5} {'bytes/device':>12} {'arrays':>6} {'us':>9} {'us per array':>12} {'latency priced':>14}"
    )
    for g, f, a in keys:
        each = statistics.median(seconds[(g, f, a, 1)]) - statistics.median(seconds[(g, f, a, 0)])
        priced = (latency + (a - 1) * array) * g / devices
        print(
            f"{g:5d} {4 * f:12,d} {a:6d} {each * 1e6:9.1f} {each / a * 1e6:12.1f} {priced * 1e6:14.1f}"
        )


def in_step(devices: int, rounds: int = 40) -> None:
    """The decoder's data parallel step with and without its gradients' ``psum`` (module
    docstring): the medians of the round-by-round differences, in call seconds."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    sys.path.insert(0, str(ROOT / "tests"))
    import jax
    import numpy as np
    from flax import linen as nn
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import xla_suite
    from meshplan._search.predict.collectives import array_latency, collective_time
    from meshplan._search.predict.profiles import get_profile

    model = xla_suite.TakeDecoder(embed=64, mlp=128, layers=2)
    tokens = np.zeros((2 * devices, 32), np.int32)
    params = nn.unbox(model.init(jax.random.key(0), tokens[:2]))["params"]
    mesh = jax.make_mesh((devices,), ("data",))

    def program(reduce: bool) -> Any:
        def local(p: Any, t: Any) -> Any:
            loss = lambda q: xla_suite._next_token(model.apply({"params": q}, t), t)  # noqa: E731
            g = jax.grad(loss)(p)
            g = jax.lax.psum(g, "data") if reduce else g  # type: ignore[no-untyped-call]
            return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

        specs = (P(), P("data"))
        return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P()))

    p = jax.device_put(params, NamedSharding(mesh, P()))
    t = jax.device_put(tokens, NamedSharding(mesh, P("data")))
    kernels = {r: (lambda f: lambda: f(p, t))(program(r)) for r in (False, True)}
    seconds = _interleaved(kernels, devices, rounds)
    extra = statistics.median(b - a for a, b in zip(seconds[False], seconds[True], strict=True))
    leaves = jax.tree.leaves(params)
    nbytes = sum(x.size * x.dtype.itemsize for x in leaves)
    profile = get_profile("cpu", devices)
    sizes, axes = {"data": devices}, ("data",)
    priced = collective_time(profile, "all-reduce", sizes, axes, nbytes) + (
        len(leaves) - 1
    ) * array_latency(profile, sizes, axes)
    print(
        f"step without the psum {statistics.median(seconds[False]) * 1e3:.2f} ms; the psum of "
        f"{len(leaves)} arrays ({nbytes:,} bytes) adds {extra * 1e6:.0f} us, priced {priced * 1e6:.0f} us"
    )


def fresh(devices: int, rounds: int = 5) -> None:
    """A tensor-parallel MLP's step by batch and mesh (module docstring): XLA's temporaries
    of the program timed and the planner's, the step predicted (its first touch apart) and
    measured (median of ``rounds`` interleaved turns of 5 steps, the first of each dropped),
    and the minor page faults a step (``getrusage``: 0 where the system does not count
    them)."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    import meshplan
    from meshplan._search.measure.timing import prepare_step
    from meshplan._search.predict.cost import predict
    from meshplan._search.predict.profiles import get_profile
    from meshplan._search.predict.step import linen_step
    from meshplan._search.predict.trace import trace_workload

    def dense(features: int, names: tuple[str | None, str]) -> nn.Dense:
        init = meshplan.with_logical_partitioning(nn.initializers.lecun_normal(), names)
        zeros = meshplan.with_logical_partitioning(nn.initializers.zeros, names[1:])
        return nn.Dense(features, kernel_init=init, bias_init=zeros)

    class Mlp(nn.Module):  # two residual blocks: LayerNorm, Dense, GELU, Dense
        @nn.compact
        def __call__(self, x: Any) -> Any:
            x = dense(256, (None, "embed"))(x)
            for _ in range(2):
                h = nn.gelu(dense(1024, ("embed", "mlp"))(nn.LayerNorm()(x)))
                x = x + dense(256, ("mlp", "embed"))(h)
            return x.mean(1)

    def loss(out: Any, batch: Any) -> Any:
        return jnp.mean(jnp.square(out - jax.nn.one_hot(batch[1], out.shape[-1])))

    tp = (("batch", "data"), ("mlp", "tensor"))
    meshes = {
        "dp": ({"data": devices}, (("batch", "data"),)),
        "2x4": ({"data": 2, "tensor": devices // 2}, tp),
        "4x2": ({"data": devices // 2, "tensor": 2}, tp),
        "1x8": ({"data": 1, "tensor": devices}, tp),
    }
    profile = get_profile("cpu", devices)
    print(f"first touch: {profile.first_touch_s * 2**20 * 1e3:.2f} ms a MiB a device")
    print(
        "batch mesh  XLA temporaries MiB  predicted MiB  predicted ms (first touch)  "
        "measured ms  page faults"
    )
    for batch in (32, 64, 128):
        inputs = (
            jax.ShapeDtypeStruct((batch, 64, 32), jnp.float32),
            jax.ShapeDtypeStruct((batch,), jnp.int32),
        )
        state, step, example = linen_step(Mlp(), inputs, loss)
        work = trace_workload(step, state, example, read_constraints=True)
        costs = {k: predict(work, m, r, profile) for k, (m, r) in meshes.items()}
        ready = {k: prepare_step(step, state, example, m, r) for k, (m, r) in meshes.items()}
        walls: dict[str, list[float]] = {k: [] for k in meshes}
        faults = dict.fromkeys(meshes, 0)
        for _ in range(rounds):
            for k, p in ready.items():
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                walls[k] += [t.wall_s for t in p.run_timed(5)[1:]]
                faults[k] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        for k, c in costs.items():
            xla = ready[k].compiled.memory_analysis().temp_size_in_bytes / 2**20
            mine = (c.activation_bytes + c.temporary_bytes) / 2**20
            print(
                f"{batch:5d} {k:4} {xla:20.1f} {mine:14.1f} {c.step_s * 1e3:13.1f} "
                f"({c.first_touch_s * 1e3:5.1f}) {statistics.median(walls[k]) * 1e3:12.1f} "
                f"{faults[k] / (5 * rounds):12.0f}",
                flush=True,
            )


def _segments(devices: int, group: int, times: int, segment: Any, reduce: bool) -> Any:
    """A call of ``times`` segments: ``segment`` on 64K floats per device, then (with
    ``reduce``) a ``psum`` of 4 bytes over the group that waits for it."""
    import jax
    import numpy as np

    def chain(y: Any, m: Any) -> Any:
        for _ in range(times):
            m = segment(m)
            y = y + m[:1] * 0  # the psum waits for the segment
            if reduce:
                y = jax.lax.psum(y, "b")  # type: ignore[no-untyped-call]
        return y, m

    zeros, ones = np.zeros(devices, np.float32), np.ones(devices << 16, np.float32)
    return _chained(devices, group, chain, zeros, ones)


def skew(devices: int, rounds: int = 15) -> None:
    """A ``psum``'s seconds after a segment of work, by group (module docstring): chains of
    9 segments less chains of 1, with and without the ``psum``s, medians over rounds."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp

    def kernel(group: int, times: int, work: int, reduce: bool) -> Any:
        def segment(m: Any) -> Any:
            for _ in range(work):  # each its own kernel: the barrier stops fusion
                m = jax.lax.optimization_barrier(jnp.tanh(m) * 0.5 + 0.25)
            return m

        return _segments(devices, group, times, segment, reduce)

    sides = [g for g in (2, 4, 8, 16) if g <= devices and devices % g == 0]
    cases = [
        (g, w, r, t) for g in sides for w in (0, 10, 40) for r in (False, True) for t in (1, 9)
    ]
    seconds = _interleaved({c: kernel(c[0], c[3], c[1], c[2]) for c in cases}, devices, rounds)

    def each(g: int, w: int, r: bool) -> float:
        once, many = seconds[(g, w, r, 1)], seconds[(g, w, r, 9)]
        return statistics.median(m - o for o, m in zip(once, many, strict=True)) / 8

    print(
        f"{'group':>5} {'kernels':>7} {'work us':>8} {'psum us':>8} {'added us':>8} {'of work':>7}"
    )
    for g in sides:
        tight = each(g, 0, True) - each(g, 0, False)
        for w in (0, 10, 40):
            work, psum = each(g, w, False), each(g, w, True) - each(g, w, False)
            share = (psum - tight) / work if w else float("nan")
            added = (psum - tight) * 1e6
            print(f"{g:5d} {w:7d} {work * 1e6:8.1f} {psum * 1e6:8.1f} {added:8.1f} {share:7.2f}")


def arrival(devices: int, rounds: int = 15) -> None:
    """A ``psum``'s seconds after the same work on every device, and after work on the
    group's first device alone, by group (module docstring): chains of 9 less chains of 1,
    with and without the ``psum``s, medians over rounds."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp

    def kernel(group: int, times: int, who: str, loops: int, reduce: bool) -> Any:
        def segment(m: Any) -> Any:
            first = jax.lax.axis_index("b") == 0
            n = {"all": loops, "first": jnp.where(first, loops, 0), "none": 0}[who]
            return jax.lax.fori_loop(0, n, lambda _, m: jnp.tanh(m) * 0.5 + 0.25, m)

        return _segments(devices, group, times, segment, reduce)

    sides = [g for g in (2, 4, 8, 16) if g <= devices and devices % g == 0]
    ways = [("none", 0), ("all", 3), ("first", 3), ("all", 10), ("first", 10)]
    cases = [(g, t, w, n, r) for g in sides for t in (1, 9) for w, n in ways for r in (0, 1)]
    seconds = _interleaved({c: kernel(*c) for c in cases}, devices, rounds)

    def each(g: int, w: str, n: int, r: bool) -> float:
        once, many = seconds[(g, 1, w, n, r)], seconds[(g, 9, w, n, r)]
        return statistics.median(m - o for o, m in zip(once, many, strict=True)) / 8

    print(
        f"{'group':>5} {'work':>6} {'loops':>5} {'work us':>8} {'psum us':>8} "
        f"{'added us':>8} {'of work':>7} {'/ E[max]':>8}"
    )
    for g in sides:
        tight = each(g, "none", 0, True) - each(g, "none", 0, False)
        print(f"{g:5d} {'none':>6} {0:5d} {0.0:8.1f} {tight * 1e6:8.1f}")
        for w, n in ways[1:]:
            work = each(g, w, n, False)
            added = each(g, w, n, True) - work - tight
            share = added / work
            print(
                f"{g:5d} {w:>6} {n:5d} {work * 1e6:8.1f} {(added + tight) * 1e6:8.1f} "
                f"{added * 1e6:8.1f} {share:7.2f} {share / _expected_max(g):8.2f}"
            )


def written(devices: int, rounds: int = 15, matmul: bool = False) -> None:
    """A ``psum``'s seconds alone and right after a kernel that writes its operand, by group
    and size (module docstring): chains of 5 less chains of 1, medians over rounds. The
    kernel: a ``tanh``, or with ``matmul`` a matmul by a ``[1024, 1024]`` matrix."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshplan._search.predict.collectives import collective_time
    from meshplan._search.predict.profiles import get_profile

    side = 1024  # the matmul's [side, side] matrix per device (tanh: one float, unread)
    if matmul:
        weights = np.random.default_rng(0).standard_normal((devices * side, side), np.float32)
        weights /= side
    else:
        weights = np.zeros((devices, 1), np.float32)

    def kernel(group: int, floats: int, times: int, work: bool, reduce: bool) -> Any:
        def chain(y: Any, m: Any) -> Any:
            for _ in range(times):  # zeros stay zeros: tanh(0), 0 @ m and sums of 0
                # each kernel its own, in both chains: the barrier stops fusion
                made = (y @ m) if matmul else jnp.tanh(y)
                y = jax.lax.optimization_barrier(made) if work else y
                y = jax.lax.psum(y, "b") if reduce else y  # type: ignore[no-untyped-call]
            return y, m

        rows = np.zeros(
            (devices * floats // side, side) if matmul else (devices, floats), np.float32
        )
        return _chained(devices, group, chain, rows, weights)

    sides = [g for g in (2, 4, 8, 16) if g <= devices and devices % g == 0]
    sizes = (1 << 15, 1 << 17) if matmul else (1 << 14, 1 << 16)
    ways = ((False, True), (True, False), (True, True))  # psum alone, kernel alone, both
    cases = [(g, f, t, w, r) for g in sides for f in sizes for t in (1, 5) for w, r in ways]
    seconds = _interleaved({c: kernel(*c) for c in cases}, devices, rounds)

    def each(g: int, f: int, w: bool, r: bool) -> float:
        once, many = seconds[(g, f, 1, w, r)], seconds[(g, f, 5, w, r)]
        return statistics.median(m - o for o, m in zip(once, many, strict=True)) / 4

    profile = get_profile("cpu", devices)
    name = "matmul" if matmul else "tanh"
    print(
        f"{'group':>5} {'KiB/device':>10} {name + ' us':>9} {'psum us':>8} "
        f"{'after ' + name + ' us':>15} {'priced us':>9} {'wait/' + name:>11} {'/ E[max]':>8}"
    )
    for g in sides:
        for f in sizes:
            alone, work = each(g, f, False, True), each(g, f, True, False)
            after = each(g, f, True, True) - work
            priced = collective_time(profile, "all-reduce", {"b": g}, ("b",), 4 * f)
            share = (after - alone) / work
            print(
                f"{g:5d} {4 * f // 1024:10d} {work * 1e6:9.1f} {alone * 1e6:8.1f} "
                f"{after * 1e6:15.1f} {priced * 1e6:9.1f} {share:11.3f} "
                f"{share / _expected_max(g):8.3f}"
            )


def _expected_max(k: int) -> float:
    """The expected largest of ``k`` standard normal draws (2: 0.564, 4: 1.029, 8: 1.424)."""
    from scipy import integrate, stats

    density = lambda x: x * k * stats.norm.pdf(x) * stats.norm.cdf(x) ** (k - 1)  # noqa: E731
    return float(integrate.quad(density, -10, 10)[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=10, help="fresh processes (>= 4)")
    parser.add_argument("--devices", type=int, default=8, help="emulated CPU devices")
    parser.add_argument("--against", metavar="REF", help="also the procedure at git REF")
    parser.add_argument("--groups", action="store_true", help="a psum's cost by group and size")
    parser.add_argument("--arrays", action="store_true", help="a combined all-reduce by arrays")
    parser.add_argument("--in-step", action="store_true", help="a step's combined all-reduce")
    parser.add_argument("--skew", action="store_true", help="a psum's wait after some work")
    parser.add_argument("--written", action="store_true", help="a psum of a kernel's result")
    parser.add_argument("--after-matmul", action="store_true", help="a psum of a matmul's result")
    parser.add_argument("--fresh", action="store_true", help="steps whose temporaries are new")
    parser.add_argument("--arrival", action="store_true", help="a psum after even, uneven work")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        return _child(args.child, args.devices)
    if args.groups:
        return groups(args.devices)
    if args.arrays:
        return arrays(args.devices)
    if args.in_step:
        return in_step(args.devices)
    if args.skew:
        return skew(args.devices)
    if args.fresh:
        return fresh(args.devices)
    if args.arrival:
        return arrival(args.devices)
    if args.written or args.after_matmul:
        return written(args.devices, matmul=args.after_matmul)
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
