"""The one measurement of this machine's emulated CPU devices: matmul FLOP/s, memory
bandwidth, and an all-reduce's latency and bandwidth, every device busy at once.

The ``cpu`` hardware profile (:func:`meshplan._search.predict.profiles.calibrate_cpu`)
is made of these figures, and MFU on CPU (:func:`meshplan.train.flops.mesh_peak`) reads
its matmul FLOP/s, so the two agree. Six programs (a chain of matmuls of cache-sized
matrices, 256 x 256 float32; an elementwise op on 4 MiB per device; a ``psum`` and a
chain of 17, of 4 bytes and of 1 MiB per device) run interleaved, one call of each per
round, after two rounds of warm-up, for 15 to 60 rounds (1 s of calls); each figure is
the median over the rounds, and the collectives' are medians of round-by-round
differences (a chain less its single call), so a change in what else runs on the machine
moves the terms of a difference together. Each program donates its operand and runs on
its last result: no call allocates, so none pays the first touch of fresh pages (which
was half the elementwise call's CPU time). That first touch is measured on its own
(:func:`first_touch_seconds`): a step whose temporaries reach 32 MiB a device pays it on
every call. Only this process's devices take part.
``benchmarks/bench_calibration.py`` measures how far the figures move from one process
to the next (docs/benchmarks.md).

A call's seconds are what it takes on this machine with nothing else running
(:func:`call_seconds`): where the devices are at least as many as the cores this process
may run on, every core is kept busy by the devices alone, so a call takes its CPU time
(every device's thread, summed: ``time.process_time``, the kernel's per-thread runtime
in nanoseconds) over the cores. That figure is the work itself: other processes on a
shared machine lengthen the wall clock (a 2-core machine at a load of 8 per core gave 4x
lower FLOP/s and 12x lower bandwidth by the clock, minutes apart), not the CPU time. With
fewer devices than cores it is the wall clock's. A collective's latency is what one
costs inside a program (a chain of them, less one), not a whole call's, whose dispatch a
step pays once, not per collective.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

__all__ = [
    "CpuFigures",
    "call_seconds",
    "cpu_cores",
    "cpu_devices",
    "first_touch_seconds",
    "matmul_flops",
    "measure_cpu",
]

_SIDE = 256  # a matrix of 256 KiB (float32): three per device stay in a core's cache
_CHAIN = 8  # matmuls per call: ~34 MFLOP per device per matmul, ~270 MFLOP a call
_STREAM = 1 << 20  # floats per device the elementwise op reads and writes: 4 MiB
_STREAMS = 4  # operands it cycles through: 128 MiB on 8 devices, none still cached
_CHAINED = 17  # all-reduces in the program whose per-collective cost is the latency
_ARRAYS = 17  # arrays of one combined all-reduce whose per-array cost is array_latency_s
_WARMUP = 2  # rounds not counted: compiled, operands placed, pages touched
_ROUNDS, _MAX_ROUNDS, _BUDGET_S = 15, 60, 1.0  # 15 rounds, more while they take under 1 s


@dataclasses.dataclass(frozen=True, kw_only=True)
class CpuFigures:
    """What each emulated device reaches while all of them run (per second, per device).

    Attributes:
        devices: How many devices ran at once.
        matmul_flops: FLOP/s of float32 matmuls.
        memory_bandwidth: Bytes read and written per second by an elementwise op.
        link_bandwidth: Bytes per second a ring all-reduce moves per device.
        latency_s: Seconds an all-reduce of 4 bytes takes.
        array_latency_s: Seconds each array adds to an all-reduce XLA combined from several
            (of 64 bytes each).
        first_touch_s: Seconds per byte a device's write into memory just allocated adds to
            the same write into memory it has written before (:func:`first_touch_seconds`).
    """

    devices: int
    matmul_flops: float
    memory_bandwidth: float
    link_bandwidth: float
    latency_s: float
    array_latency_s: float
    first_touch_s: float = 0.0


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


class _Kernel:
    """A jitted program that donates its operand and keeps its result as the next call's
    operand, cycling through ``operands``: no call allocates an output, so none pays the
    first touch of fresh pages (a new 4 MiB output per device cost ~2,900 page faults, half
    of the elementwise call's CPU time, and moved from process to process)."""

    def __init__(self, run: Callable[[jax.Array], jax.Array], operands: list[jax.Array]) -> None:
        self.run, self.operands, self.next = run, operands, 0

    def __call__(self) -> jax.Array:
        i = self.next
        self.operands[i] = out = self.run(self.operands[i])
        self.next = (i + 1) % len(self.operands)
        return out


def _rounds(kernels: Sequence[Callable[[], jax.Array]], devices: int) -> list[list[float]]:
    """:func:`call_seconds` of every call of each of ``kernels`` (its result waited for) on
    ``devices`` busy devices, in rounds of one call each, after :data:`_WARMUP` rounds: at
    least :data:`_ROUNDS` rounds, more while they take under :data:`_BUDGET_S` in all.

    Interleaved, every figure is measured over the same seconds, so a change in what else
    runs moves them together (and cancels in a difference of two, taken round by round),
    and the number of calls does not fall with the share of the machine this process gets.
    """
    for _ in range(_WARMUP):
        for kernel in kernels:
            jax.block_until_ready(kernel())
    cores = cpu_cores()
    times: list[list[float]] = [[] for _ in kernels]
    spent = 0.0
    while len(times[0]) < _ROUNDS or (spent < _BUDGET_S and len(times[0]) < _MAX_ROUNDS):
        for kernel, found in zip(kernels, times, strict=True):
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(kernel())
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            found.append(call_seconds(wall, cpu, devices, cores))
            spent += found[-1]
    return times


def _median(values: Sequence[float]) -> float:
    """The middle value (the mean of the middle two of an even count).

    Example:
        >>> from meshplan._search.measure.cpu import _median
        >>> _median([3.0, 1.0, 100.0]), _median([4.0, 1.0, 2.0, 3.0])
        (3.0, 2.5)
    """
    return float(np.median(np.asarray(values, dtype=np.float64)))


def _per_extra(once: Sequence[float], many: Sequence[float], extra: int) -> float:
    """What each of ``extra`` more operations costs: the median over rounds of a chain's
    seconds less the single one's of the same round, over ``extra``.

    Example:
        >>> from meshplan._search.measure.cpu import _per_extra
        >>> _per_extra([1.0, 2.0, 1.0], [5.0, 6.0, 9.0], extra=4)   # rounds: 4, 4, 8
        1.0
    """
    return _median([m - o for o, m in zip(once, many, strict=True)]) / extra


def _split(devices: int) -> jax.sharding.NamedSharding:
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    cpus = cpu_devices(devices)
    mesh = jax.make_mesh((len(cpus),), ("d",), devices=cpus, axis_types=(AxisType.Auto,))
    return NamedSharding(mesh, PartitionSpec("d"))


def _matmuls(split: jax.sharding.NamedSharding, dtype: str) -> _Kernel:
    """A chain of :data:`_CHAIN` matmuls of :data:`_SIDE`-square matrices on every device,
    whose operand stays at ones (times a matrix of ``1 / _SIDE``, a power of two: exact)."""
    import jax.numpy as jnp

    n, kind = len(split.mesh.devices.flat), jnp.dtype(dtype)
    b = jax.device_put(np.full((n, _SIDE, _SIDE), 1 / _SIDE, kind), split)

    def chain(a: jax.Array, b: jax.Array) -> jax.Array:
        for _ in range(_CHAIN):
            a = jnp.einsum("nij,njk->nik", a, b, preferred_element_type=kind)
        return a

    run = jax.jit(chain, out_shardings=split, donate_argnums=0)
    return _Kernel(lambda a: run(a, b), [jax.device_put(np.ones((n, _SIDE, _SIDE), kind), split)])


def _flops(seconds: float) -> float:
    return 2 * _SIDE**3 * _CHAIN / seconds


def matmul_flops(devices: int, dtype: str = "float32") -> float:
    """Matmul FLOP/s of each of the first ``devices`` CPU devices while all of them run one
    (measured once per process, count and dtype; a second or two). In float32 it is
    :func:`measure_cpu`'s figure, the one measurement.

    Example:
        >>> from meshplan._search.measure.cpu import matmul_flops, measure_cpu
        >>> matmul_flops(2) > 1e8, matmul_flops(2) == measure_cpu(2).matmul_flops
        (True, True)
    """
    n, kind = len(cpu_devices(devices)), str(dtype)
    if np.dtype(kind) == np.float32:
        return _measure(n).matmul_flops
    return _matmul_flops(n, kind)


@functools.cache
def _matmul_flops(n: int, dtype: str) -> float:
    (times,) = _rounds([_matmuls(_split(n), dtype)], n)
    return _flops(_median(times))


def _psums(split: jax.sharding.NamedSharding, times: int, floats: int) -> _Kernel:
    """``times`` all-reduces in a row of ``floats`` zeros per device (zeros stay zeros)."""
    from jax.sharding import PartitionSpec

    def total(y: jax.Array) -> jax.Array:
        for _ in range(times):  # each waits for the last: none combined or overlapped
            y = jax.lax.psum(y, "d")  # type: ignore[no-untyped-call]
        return y

    specs = PartitionSpec("d")
    run = jax.jit(
        jax.shard_map(total, mesh=split.mesh, in_specs=specs, out_specs=specs),
        donate_argnums=0,
    )
    n = len(split.mesh.devices.flat)
    return _Kernel(run, [jax.device_put(np.zeros((n, floats), np.float32), split)])


def _combined(split: jax.sharding.NamedSharding, arrays: int) -> _Kernel:
    """One all-reduce of ``arrays`` arrays (XLA combines their sums over the devices):
    zeros of 16 floats per device each, summed, broadcast back (zeros stay zeros)."""
    import jax.numpy as jnp

    n = len(split.mesh.devices.flat)

    def sums(ys: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        return tuple(jnp.broadcast_to(y.sum(0, keepdims=True), y.shape) for y in ys)

    run = jax.jit(sums, out_shardings=(split,) * arrays, donate_argnums=0)
    zeros = tuple(jax.device_put(np.zeros((n, 16), np.float32), split) for _ in range(arrays))
    return _Kernel(run, [zeros])  # type: ignore[list-item]


def measure_cpu(devices: int) -> CpuFigures:
    """Every figure of the first ``devices`` CPU devices, all busy at once (a second or two;
    once per process and count).

    Matmul FLOP/s (float32), memory bandwidth (an elementwise op on 4 MiB per device), and a
    ``psum`` over all of them: its latency (of 4 bytes, inside a program: a chain of them
    less one) and bandwidth (1 MiB per device, as a ring would move it; the same chain's,
    less the latency), and what each array adds to an all-reduce XLA combined from
    several (one of 17 arrays less one of one), and what writing new memory adds
    (:func:`first_touch_seconds`). Seconds are :func:`call_seconds`' (CPU
    time over the cores where the devices keep every core busy); the programs run
    interleaved, round by round, each figure the median over the rounds (:func:`_rounds`).

    Example:
        >>> from meshplan._search.measure.cpu import measure_cpu
        >>> figures = measure_cpu(2)
        >>> figures.devices, figures.matmul_flops > 1e8, figures.latency_s > 0
        (2, True, True)
    """
    return _measure(len(cpu_devices(devices)))


@functools.cache
def _measure(n: int) -> CpuFigures:
    split = _split(n)
    streams = [jax.device_put(np.ones((n, _STREAM), np.float32), split) for _ in range(_STREAMS)]
    scale = jax.jit(lambda x: 1.5 - 0.5 * x, out_shardings=split, donate_argnums=0)  # ones stay
    chunk = 1 << 18  # floats: 1 MiB per device
    kernels = [
        _matmuls(split, "float32"),
        _Kernel(scale, streams),
        _psums(split, 1, 1),
        _psums(split, _CHAINED, 1),
        _psums(split, 1, chunk),
        _psums(split, _CHAINED, chunk),
        _combined(split, 1),
        _combined(split, _ARRAYS),
    ]
    matmuls, elementwise, tiny_one, tiny_many, big_one, big_many, one, many = _rounds(kernels, n)
    latency = max(_per_extra(tiny_one, tiny_many, _CHAINED - 1), 1e-7)
    moving = _per_extra(
        [b - t for b, t in zip(big_one, tiny_one, strict=True)],
        [b - t for b, t in zip(big_many, tiny_many, strict=True)],
        _CHAINED - 1,
    )
    ring = 2 * (n - 1) / n if n > 1 else 1.0
    return CpuFigures(
        devices=n,
        matmul_flops=_flops(_median(matmuls)),
        memory_bandwidth=2 * 4 * _STREAM / _median(elementwise),
        link_bandwidth=ring * 4 * chunk / max(moving, 1e-7),
        latency_s=latency,
        array_latency_s=max(_per_extra(one, many, _ARRAYS - 1), 0.0),
        first_touch_s=first_touch_seconds(n),
    )


FRESH_BYTES = 32 << 20
"""glibc's ``malloc`` takes a block of at least 32 MiB straight from the kernel (``mmap``)
and gives it back when freed (``munmap``): its ``M_MMAP_THRESHOLD`` rises to the size of the
blocks a program frees, up to ``DEFAULT_MMAP_THRESHOLD_MAX``, 32 MiB on 64-bit machines
(``man mallopt``). So XLA:CPU's one temporary buffer of a step, allocated per call, is new
memory each call from that size on, its pages faulted in as the step first writes them."""


def first_touch_seconds(devices: int, rounds: int = 5) -> float:
    """Seconds per byte a device's write into memory just allocated adds, all of the first
    ``devices`` writing at once, over writing memory written before: a program whose
    output (a little over :data:`FRESH_BYTES` a device) is new on every call, less the same
    program donating its operand to its output, the median over ``rounds`` rounds of their
    difference. On a 13-core machine, 8 devices: about 3 ms a MiB; a few hundred ms in all.

    Example:
        >>> from meshplan._search.measure.cpu import first_touch_seconds
        >>> 0.0 <= first_touch_seconds(2) < 1e-6   # under 1 s a MiB
        True
    """
    fresh, reused, nbytes = _fresh_and_reused(_split(devices))
    n, cores = len(cpu_devices(devices)), cpu_cores()
    extra = []
    for i in range(rounds + 1):  # the first round compiles
        seconds = []
        for kernel in (fresh, reused):
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(kernel())  # the fresh output freed here, given back
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            seconds.append(call_seconds(wall, cpu, n, cores))
        if i:
            extra.append(seconds[0] - seconds[1])
    return max(_median(extra), 0.0) / nbytes


def _fresh_and_reused(
    split: jax.sharding.NamedSharding,
) -> tuple[Callable[[], jax.Array], _Kernel, int]:
    """Two calls of one elementwise program on every device, of a little over
    :data:`FRESH_BYTES` a device, on one operand: one writing new memory on every call (the
    operand kept), one writing into the operand's memory (donated); and those bytes. Both
    read what they write, as a step's kernels do."""
    import jax.numpy as jnp

    n = len(split.mesh.devices.flat)
    floats = (FRESH_BYTES + (4 << 20)) // 4  # 36 MiB a device: always new from the kernel

    def scale(x: jax.Array) -> jax.Array:
        out: jax.Array = x * jnp.float32(0.5) + jnp.float32(0.5)  # ones stay ones
        return out

    fresh = jax.jit(scale, out_shardings=split)
    ones = [jax.device_put(np.ones((n, floats), np.float32), split)]
    reused = _Kernel(jax.jit(scale, out_shardings=split, donate_argnums=0), ones)
    return (lambda: fresh(reused.operands[0])), reused, 4 * floats
