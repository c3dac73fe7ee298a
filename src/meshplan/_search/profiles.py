"""Hardware profiles: what a device computes and moves per second, as data.

A :class:`HardwareProfile` gives one device's peak matmul FLOP/s, its memory
and memory bandwidth, and the bandwidth of a mesh axis by where it runs:
within a *fast domain* (the NVLink island of one GPU host, a TPU slice's ICI)
or between hosts (the network). A mesh is laid out row-major over the devices
(the last axis varies fastest), so an axis whose devices lie within one
domain gets the fast link, the others the slow one (:meth:`axis_bandwidth`).

The GPU and TPU profiles carry published figures, each with its source; the
``cpu`` profile is measured on this machine, on its emulated JAX devices, by
:func:`calibrate_cpu` (a second or two, once per process).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping
from typing import Any

from meshplan._errors import ArgumentError

__all__ = ["PROFILES", "HardwareProfile", "calibrate_cpu", "get_profile"]


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """One device's figures (per second, per direction), and how its links are arranged.

    Attributes:
        name: The profile's name.
        peak_flops: Matmul FLOP/s one device reaches (bf16 dense for accelerators).
        memory_bytes: Device memory (the default budget).
        memory_bandwidth: Bytes per second one device reads or writes memory.
        fast_bandwidth: Bytes per second per device on an axis within a fast domain.
        slow_bandwidth: Bytes per second per device on an axis that crosses domains.
        domain_devices: Devices per fast domain (NVLink host, TPU slice).
        latency_s: Seconds each collective costs whatever its size.
        source: Where the figures come from.

    Example:
        >>> import meshplan
        >>> mine = meshplan.HardwareProfile("mine", 100e12, 32 * 2**30, 1e12, 200e9, 25e9, 4, 1e-5)
        >>> mine.axis_bandwidth({"data": 8, "tensor": 4}, "data")   # crosses the 4-device hosts
        25000000000.0
    """

    name: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float
    fast_bandwidth: float
    slow_bandwidth: float
    domain_devices: int
    latency_s: float
    source: str = ""

    def axis_bandwidth(self, mesh: Mapping[str, int], axis: str) -> float:
        """The bandwidth of ``axis`` of ``mesh`` (row-major over the devices).

        Example:
            >>> from meshplan._search.profiles import get_profile
            >>> h100 = get_profile("h100")
            >>> mesh = {"data": 4, "tensor": 8}       # 32 GPUs, 8 per NVLink host
            >>> h100.axis_bandwidth(mesh, "tensor") > h100.axis_bandwidth(mesh, "data")
            True
        """
        names = list(mesh)
        stride = math.prod(mesh[a] for a in names[names.index(axis) + 1 :])
        span = stride * mesh[axis]
        return self.fast_bandwidth if span <= self.domain_devices else self.slow_bandwidth

    def to_dict(self) -> dict[str, Any]:
        """The figures as plain data.

        Example:
            >>> import meshplan
            >>> meshplan.HardwareProfile("x", 1.0, 2, 3.0, 4.0, 5.0, 6, 0.0).to_dict()["domain_devices"]
            6
        """
        return dataclasses.asdict(self)


GiB = 1 << 30

PROFILES: dict[str, HardwareProfile] = {
    # NVIDIA H100 SXM5 datasheet (nvidia.com/en-us/data-center/h100): 989 TFLOP/s dense bf16
    # (1,979 with sparsity), 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s per GPU (both
    # directions: 450 GB/s each way). Between hosts: DGX H100, 8x 400 Gb/s ConnectX-7
    # InfiniBand per 8 GPUs = 50 GB/s per GPU each way. Collective latency ~10 us (NCCL).
    "h100": HardwareProfile(
        "h100", 989e12, 80 * 10**9, 3.35e12, 450e9, 50e9, 8, 10e-6,
        "NVIDIA H100 SXM5 datasheet; DGX H100 (8x ConnectX-7 400 Gb/s)",
    ),
    # NVIDIA H200 SXM datasheet (nvidia.com/en-us/data-center/h200): 989 TFLOP/s dense bf16,
    # 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (450 GB/s each way); hosts as DGX H100.
    "h200": HardwareProfile(
        "h200", 989e12, 141 * 10**9, 4.8e12, 450e9, 50e9, 8, 10e-6,
        "NVIDIA H200 SXM datasheet; DGX-style hosts (8x 400 Gb/s InfiniBand)",
    ),
    # Google Cloud TPU v5e (cloud.google.com/tpu/docs/v5e): 197 TFLOP/s bf16, 16 GiB HBM2
    # at 819 GB/s, inter-chip interconnect 1,600 Gbps (200 GB/s) per chip; a pod (one ICI
    # domain) is 256 chips. Between pods (DCN, multislice): assumed 100 Gbps = 12.5 GB/s
    # per chip each way (an assumption, not a published per-chip figure).
    "tpu_v5e": HardwareProfile(
        "tpu_v5e", 197e12, 16 * GiB, 819e9, 100e9, 12.5e9, 256, 5e-6,
        "Google Cloud TPU v5e documentation; DCN bandwidth assumed",
    ),
}  # fmt: skip
"""Published profiles by name; ``cpu`` is measured (:func:`get_profile`)."""

_CPU: dict[int, HardwareProfile] = {}


def _median_seconds(fn: Any, *args: Any, repeat: int = 7) -> float:
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def calibrate_cpu(devices: int | None = None) -> HardwareProfile:
    """Measures this machine's emulated JAX devices, all busy at once (cached per count).

    Matmul FLOP/s per device (a 384^3 float32 matmul on each device at once), memory
    bandwidth per device (an elementwise op on 4 MiB each), and a ``psum`` over all
    of them: its latency (4 bytes) and bandwidth (1 MiB each, as a ring would move it).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec

    n = min(devices or jax.device_count(), jax.device_count())
    if n in _CPU:
        return _CPU[n]
    mesh = jax.make_mesh((n,), ("d",), devices=jax.devices()[:n])
    split = NamedSharding(mesh, PartitionSpec("d"))
    m = 384
    a = jax.device_put(np.ones((n, m, m), np.float32), split)
    matmul = jax.jit(lambda a: jnp.einsum("nij,njk->nik", a, a), out_shardings=split)
    flops = 2 * m**3 / _median_seconds(matmul, a)
    big = jax.device_put(np.ones((n, 1 << 20), np.float32), split)
    scale = jax.jit(lambda x: x * 1.5 + 1.0, out_shardings=split)
    memory_bw = 2 * 4 * (1 << 20) / _median_seconds(scale, big)

    def total(y: Any) -> Any:
        return jax.lax.psum(y, "d")  # type: ignore[no-untyped-call]

    def allreduce(x: Any) -> Any:
        specs = PartitionSpec("d")
        return jax.shard_map(total, mesh=mesh, in_specs=specs, out_specs=specs)(x)

    tiny = jax.device_put(np.ones((n, 1), np.float32), split)
    reduce = jax.jit(allreduce)
    latency = _median_seconds(reduce, tiny)
    chunk = 1 << 18  # floats: 1 MiB per device
    data = jax.device_put(np.ones((n, chunk), np.float32), split)
    t = max(_median_seconds(reduce, data) - latency, 1e-7)
    ring = 2 * (n - 1) / n if n > 1 else 1.0
    link = ring * 4 * chunk / t
    profile = HardwareProfile(
        "cpu", flops, 8 * GiB, memory_bw, link, link, n, latency,
        f"measured on this machine: {n} emulated devices ({jax.devices()[0].platform})",
    )  # fmt: skip
    _CPU[n] = profile
    return profile


def get_profile(profile: str | HardwareProfile, devices: int | None = None) -> HardwareProfile:
    """A profile by name (``cpu``, ``h100``, ``h200``, ``tpu_v5e``), or ``profile`` itself.

    Example:
        >>> from meshplan._search.profiles import get_profile
        >>> p = get_profile("tpu_v5e")
        >>> p.peak_flops, p.memory_bytes // 2**30
        (197000000000000.0, 16)
        >>> get_profile("a100")
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: Unknown hardware profile 'a100'. Known: cpu, h100, h200, tpu_v5e.
        Pass one of those, or a meshplan HardwareProfile with your own figures.
    """
    if isinstance(profile, HardwareProfile):
        return profile
    if profile == "cpu":
        return calibrate_cpu(devices)
    if profile not in PROFILES:
        raise ArgumentError(
            f"Unknown hardware profile {profile!r}. Known: cpu, {', '.join(PROFILES)}.\n"
            f"Pass one of those, or a meshplan HardwareProfile with your own figures."
        )
    return PROFILES[profile]
