"""The one measurement of this machine's emulated CPU devices: matmul FLOP/s, memory
bandwidth, and an all-reduce's latency and bandwidth, every device busy at once.

The ``cpu`` hardware profile (:func:`meshplan._search.predict.profiles.calibrate_cpu`)
is made of these figures, and MFU on CPU (:func:`meshplan.train.flops.mesh_peak`) reads
its matmul FLOP/s, so the two agree. Each figure is the median of many timed calls after
a warm-up (a median, not the best: one lucky call under another process's pause does not
set it), and each call is long enough for the dispatch to be a small part of it: a chain
of matmuls of cache-sized matrices (256 x 256 float32, 256 KiB each) in one program.
Only this process's devices take part (no other process is waited for).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable

import jax
import numpy as np

__all__ = ["CpuFigures", "cpu_devices", "matmul_flops", "measure_cpu"]

_SIDE = 256  # a matrix of 256 KiB (float32): three per device stay in a core's cache
_CHAIN = 8  # matmuls per call: ~34 MFLOP per device per matmul, ~270 MFLOP a call
_WARMUP = 3
_CALLS, _MAX_CALLS, _BUDGET_S = 11, 100, 0.4  # at least 11 calls, more within 0.4 s


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


def _median_seconds(fn: Callable[[], object]) -> float:
    """The median seconds of ``fn()`` (its result waited for), after a warm-up: at least
    :data:`_CALLS` calls, more while they take under :data:`_BUDGET_S` in all."""
    for _ in range(_WARMUP):
        jax.block_until_ready(fn())
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < _CALLS or (
        time.perf_counter() - started < _BUDGET_S and len(times) < _MAX_CALLS
    ):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
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
    return 2 * _SIDE**3 * _CHAIN / _median_seconds(lambda: run(a, b))


def measure_cpu(devices: int) -> CpuFigures:
    """Every figure of the first ``devices`` CPU devices, all busy at once (a second or two).

    Matmul FLOP/s (:func:`matmul_flops`, float32), memory bandwidth (an elementwise op on
    4 MiB per device), and a ``psum`` over all of them: its latency (4 bytes) and
    bandwidth (1 MiB per device, as a ring would move it).

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
    memory_bandwidth = 2 * 4 * (1 << 20) / _median_seconds(lambda: scale(big))

    def total(y: jax.Array) -> jax.Array:
        summed: jax.Array = jax.lax.psum(y, "d")  # type: ignore[no-untyped-call]
        return summed

    specs = PartitionSpec("d")
    reduce = jax.jit(jax.shard_map(total, mesh=split.mesh, in_specs=specs, out_specs=specs))
    tiny = jax.device_put(np.ones((n, 1), np.float32), split)
    latency = _median_seconds(lambda: reduce(tiny))
    chunk = 1 << 18  # floats: 1 MiB per device
    data = jax.device_put(np.ones((n, chunk), np.float32), split)
    moving = max(_median_seconds(lambda: reduce(data)) - latency, 1e-7)
    ring = 2 * (n - 1) / n if n > 1 else 1.0
    return CpuFigures(
        devices=n,
        matmul_flops=flops,
        memory_bandwidth=memory_bandwidth,
        link_bandwidth=ring * 4 * chunk / moving,
        latency_s=latency,
    )
