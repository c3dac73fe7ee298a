"""The one measurement of this machine's emulated CPU devices: matmul FLOP/s, memory
bandwidth, and an all-reduce's latency and bandwidth, every device busy at once.

The ``cpu`` hardware profile (:func:`meshplan._search.predict.profiles.calibrate_cpu`)
is made of these figures, and MFU on CPU (:func:`meshplan.train.flops.mesh_peak`) reads
its matmul FLOP/s, so the two agree. Each figure is the median of many timed calls after
a warm-up (a median, not the best: one lucky call under another process's pause does not
set it), and each call is long enough for the dispatch to be a small part of it: a chain
of matmuls of cache-sized matrices (256 x 256 float32, 256 KiB each) in one program.
Only this process's devices take part (no other process is waited for).

A call's seconds are what it takes on this machine with nothing else running
(:func:`call_seconds`): where the devices are at least as many as the cores this process
may run on, every core is kept busy by the devices alone, so a call takes its CPU time
(every device's thread, summed) over the cores. That figure is the work itself: other
processes on a shared machine lengthen the wall clock (a 2-core machine at a load of 8
per core gave 4x lower FLOP/s and 12x lower bandwidth by the clock, minutes apart), not
the CPU time. With fewer devices than cores it is the wall clock's. A collective's
latency is what one costs inside a program (a chain of them, less one), not a whole
call's, whose dispatch a step pays once, not per collective.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable

import jax
import numpy as np

__all__ = ["CpuFigures", "call_seconds", "cpu_cores", "cpu_devices", "matmul_flops", "measure_cpu"]

_SIDE = 256  # a matrix of 256 KiB (float32): three per device stay in a core's cache
_CHAIN = 8  # matmuls per call: ~34 MFLOP per device per matmul, ~270 MFLOP a call
_WARMUP = 3
_CALLS, _MAX_CALLS, _BUDGET_S = 11, 100, 0.4  # at least 11 calls, more within 0.4 s
_CHAINED = 17  # all-reduces in the program whose per-collective cost is the latency


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuFigures:
    """What each emulated device reaches while all of them run (per second, per device).

    Attributes:
        devices: How many devices ran at once.
        matmul_flops: FLOP/s of float32 matmuls.
        memory_bandwidth: Bytes read and written per second by an elementwise op.
        link_bandwidth: Bytes per second a ring all-reduce moves per device.
        latency_s: Seconds an all-reduce of 4 bytes takes.
    """

    devices: int
    matmul_flops: float
    memory_bandwidth: float
    link_bandwidth: float
    latency_s: float


def cpu_devices(devices: int | None = None) -> list[jax.Device]:
    """The first ``devices`` of this process's CPU devices (all of them by default).

    Example:
        >>> from meshplan._search.measure.cpu import cpu_devices
        >>> len(cpu_devices(2)), cpu_devices(1)[0].platform
        (2, 'cpu')
    """
    local: list[jax.Device] = jax.local_devices(backend="cpu")
    return local[: min(devices or len(local), len(local))]


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity where the system has one).

    Example:
        >>> from meshplan._search.measure.cpu import cpu_cores
        >>> cpu_cores() >= 1
        True
    """
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this system (macOS)
        return os.cpu_count() or 1


def call_seconds(wall_s: float, cpu_s: float, devices: int, cores: int) -> float:
    """The seconds a call of ``devices`` busy devices takes with nothing else running on
    ``cores``: its CPU time over the cores where the devices keep every core busy (the
    wall clock of a shared machine counts the other processes' turns too), else the wall
    time.

    Example:
        >>> from meshplan._search.measure.cpu import call_seconds
        >>> call_seconds(0.8, 0.4, devices=8, cores=2)   # 8 devices on 2 cores, at half share
        0.2
        >>> call_seconds(0.8, 0.4, devices=2, cores=16)
        0.8
    """
    return cpu_s / cores if devices >= cores else wall_s


def _median_seconds(fn: Callable[[], object], devices: int) -> float:
    """The median :func:`call_seconds` of ``fn()`` (its result waited for) on ``devices``
    busy devices, after a warm-up: at least :data:`_CALLS` calls, more while they take
    under :data:`_BUDGET_S` in all."""
    for _ in range(_WARMUP):
        jax.block_until_ready(fn())
    cores = cpu_cores()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < _CALLS or (
        time.perf_counter() - started < _BUDGET_S and len(times) < _MAX_CALLS
    ):
        c0, t0 = time.process_time(), time.perf_counter()
        jax.block_until_ready(fn())
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        times.append(call_seconds(wall, cpu, devices, cores))
    return sorted(times)[len(times) // 2]


def _split(devices: int) -> jax.sharding.NamedSharding:
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    cpus = cpu_devices(devices)
    mesh = jax.make_mesh((len(cpus),), ("d",), devices=cpus, axis_types=(AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec("d"))


def matmul_flops(devices: int, dtype: str = "float32") -> float:
    """Matmul FLOP/s of each of the first ``devices`` CPU devices while all of them run one
    (measured once per process, count and dtype; a second or less).

    Example:
        >>> from meshplan._search.measure.cpu import matmul_flops
        >>> matmul_flops(2) > 1e8
        True
    """
    return _matmul_flops(len(cpu_devices(devices)), str(dtype))


@functools.cache
def _matmul_flops(n: int, dtype: str) -> float:
    import jax.numpy as jnp

    split = _split(n)
    kind = jnp.dtype(dtype)
    a = jax.device_put(np.ones((n, _SIDE, _SIDE), kind), split)
    b = jax.device_put(np.full((n, _SIDE, _SIDE), 1 / _SIDE, kind), split)  # keeps a at ones

    def chain(a: jax.Array, b: jax.Array) -> jax.Array:
        for _ in range(_CHAIN):
            a = jnp.einsum("nij,njk->nik", a, b, preferred_element_type=kind)
        return a

    run = jax.jit(chain, out_shardings=split)
    return 2 * _SIDE**3 * _CHAIN / _median_seconds(lambda: run(a, b), n)


def measure_cpu(devices: int) -> CpuFigures:
    """Every figure of the first ``devices`` CPU devices, all busy at once (a second or two).

    Matmul FLOP/s (:func:`matmul_flops`, float32), memory bandwidth (an elementwise op on
    4 MiB per device), and a ``psum`` over all of them: its latency (of 4 bytes, inside a
    program: a chain of them less one) and bandwidth (1 MiB per device, as a ring would
    move it; the same chain's, less the latency). Seconds are :func:`call_seconds`' (CPU time over the cores where the devices
    keep every core busy).

    Example:
        >>> from meshplan._search.measure.cpu import measure_cpu
        >>> figures = measure_cpu(2)
        >>> figures.devices, figures.matmul_flops > 1e8, figures.latency_s > 0
        (2, True, True)
    """
    from jax.sharding import PartitionSpec

    n = len(cpu_devices(devices))
    split = _split(n)
    flops = matmul_flops(n)
    big = jax.device_put(np.ones((n, 1 << 20), np.float32), split)
    scale = jax.jit(lambda x: x * 1.5 + 1.0, out_shardings=split)
    memory_bandwidth = 2 * 4 * (1 << 20) / _median_seconds(lambda: scale(big), n)

    def chained(times: int) -> Callable[[jax.Array], jax.Array]:
        def total(y: jax.Array) -> jax.Array:
            for _ in range(times):  # each waits for the last: none combined or overlapped
                y = jax.lax.psum(y, "d")  # type: ignore[no-untyped-call]
            return y

        specs = PartitionSpec("d")
        run = jax.jit(jax.shard_map(total, mesh=split.mesh, in_specs=specs, out_specs=specs))
        return lambda x: run(x)

    once, many = chained(1), chained(_CHAINED)
    tiny = jax.device_put(np.ones((n, 1), np.float32), split)
    one = _median_seconds(lambda: once(tiny), n)
    latency = max((_median_seconds(lambda: many(tiny), n) - one) / (_CHAINED - 1), 1e-7)
    chunk = 1 << 18  # floats: 1 MiB per device
    data = jax.device_put(np.ones((n, chunk), np.float32), split)
    big_one = _median_seconds(lambda: once(data), n)
    each = (_median_seconds(lambda: many(data), n) - big_one) / (_CHAINED - 1)
    moving = max(each - latency, 1e-7)
    ring = 2 * (n - 1) / n if n > 1 else 1.0
    return CpuFigures(
        devices=n,
        matmul_flops=flops,
        memory_bandwidth=memory_bandwidth,
        link_bandwidth=ring * 4 * chunk / moving,
        latency_s=latency,
    )
