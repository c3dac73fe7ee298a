"""What the devices can do: peak FLOP/s by device kind, a measured CPU peak, and MFU.

Model FLOPs utilisation (MFU) is the model FLOPs a step needs (forward and
backward, counted from the model's shapes, not from what the compiler ran)
divided by the step's wall time and by the devices' peak. The peaks of common
accelerators are in :data:`PEAKS`, each with its source; a device not in that
table gets no MFU, and :func:`mesh_peak` says why. On emulated CPU devices the
peak is measured: a short matmul microbenchmark on every device at once
(:func:`measure_cpu_peak`), labelled as such.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time

__all__ = ["PEAKS", "DevicePeak", "MeshPeak", "measure_cpu_peak", "mesh_peak", "peak_of"]


@dataclasses.dataclass(frozen=True)
class DevicePeak:
    """The dense peak FLOP/s of one accelerator (no sparsity), by compute dtype.

    Attributes:
        name: The accelerator, as its maker names it.
        pattern: A regular expression matched against JAX's ``device.device_kind``.
        bfloat16: Peak bf16 FLOP/s (dense matrix units).
        float32: Peak FLOP/s of float32 matmuls as JAX runs them by default
            (TF32 tensor cores on NVIDIA GPUs since Ampere), or ``None`` when
            none is published (TPUs run float32 matmuls as several bf16 passes).
        source: Where the figures come from.
    """

    name: str
    pattern: str
    bfloat16: float
    float32: float | None
    source: str

    def flops(self, dtype: str) -> float | None:
        """The peak for ``dtype`` (``'bfloat16'`` or ``'float32'``)."""
        return self.bfloat16 if dtype == "bfloat16" else self.float32


T = 1e12

PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(
        "NVIDIA H200", r"H200", 989.4 * T, 494.7 * T,
        "NVIDIA H200 Tensor Core GPU datasheet (SXM; 1,979 / 989 TFLOPS are with sparsity)",
    ),
    DevicePeak(
        "NVIDIA H100 PCIe", r"H100.*PCIe", 756.5 * T, 378.0 * T,
        "NVIDIA H100 Tensor Core GPU datasheet (PCIe; the sheet's figures halved: they are "
        "with sparsity)",
    ),
    DevicePeak(
        "NVIDIA H100 SXM", r"H100", 989.4 * T, 494.7 * T,
        "NVIDIA H100 Tensor Core GPU datasheet (SXM; the sheet's figures halved: they are with "
        "sparsity)",
    ),
    DevicePeak(
        "NVIDIA A100", r"A100", 312.0 * T, 156.0 * T,
        "NVIDIA A100 Tensor Core GPU datasheet (BF16 and TF32 dense, SXM and PCIe alike)",
    ),
    DevicePeak(
        "NVIDIA L4", r"\bL4\b", 121.0 * T, 60.0 * T,
        "NVIDIA L4 Tensor Core GPU datasheet (the sheet's figures halved: they are with sparsity)",
    ),
    DevicePeak(
        "TPU v4", r"TPU v4", 275.0 * T, None,
        "Google Cloud TPU documentation, 'TPU v4' (275 TFLOPS bf16 per chip)",
    ),
    DevicePeak(
        "TPU v5e", r"TPU v5 ?(lite|e)", 197.0 * T, None,
        "Google Cloud TPU documentation, 'TPU v5e' (197 TFLOPS bf16 per chip)",
    ),
    DevicePeak(
        "TPU v5p", r"TPU v5p?$", 459.0 * T, None,
        "Google Cloud TPU documentation, 'TPU v5p' (459 TFLOPS bf16 per chip)",
    ),
    DevicePeak(
        "TPU v6e (Trillium)", r"TPU v6 ?(lite|e)", 918.0 * T, None,
        "Google Cloud TPU documentation, 'TPU v6e' (918 TFLOPS bf16 per chip)",
    ),
)  # fmt: skip
"""Dense peak FLOP/s of common accelerators, most specific pattern first."""


def peak_of(device_kind: str) -> DevicePeak | None:
    """The :data:`PEAKS` entry of a ``device.device_kind``, or ``None`` if it is not listed.

    Example:
        >>> from meshplan.train.flops import peak_of
        >>> peak_of("NVIDIA H200").bfloat16 / 1e12, peak_of("TPU v5 lite").name
        (989.4, 'TPU v5e')
        >>> peak_of("NVIDIA H100 PCIe").name, peak_of("cpu") is None
        ('NVIDIA H100 PCIe', True)
    """
    for peak in PEAKS:
        if re.search(peak.pattern, device_kind, flags=re.IGNORECASE):
            return peak
    return None


@dataclasses.dataclass(frozen=True)
class MeshPeak:
    """The peak FLOP/s of the devices a run uses, together, and how it was found.

    Attributes:
        flops: Peak FLOP/s of all the devices together, or ``None`` (no MFU).
        label: How to read MFU against it, for a summary (``None`` with no peak).
        why: Why there is no peak (``None`` when there is one); :attr:`fix` says
            how to get one.
        code: The kind of reason there is no peak: ``'peak-unknown-device'`` (no
            figure for this kind of device) or ``'peak-unknown-dtype'`` (none for
            this dtype, fields :attr:`device` and :attr:`dtype`); ``None`` with a peak.
        fix: How to get one, in terms of the API (``''``: nothing to do).
        device: The device kind without a figure (``None`` with a peak).
        dtype: The compute dtype without a figure (``None`` with a peak).
    """

    flops: float | None
    label: str | None
    why: str | None = None
    code: str | None = None
    fix: str = ""
    device: str | None = None
    dtype: str | None = None


def mesh_peak(platform: str, kind: str, count: int, dtype: str) -> MeshPeak:
    """The peak of ``count`` devices of ``kind`` computing in ``dtype``.

    Accelerators: :data:`PEAKS` times ``count``. Emulated CPU devices share the
    host's cores: the peak is the host's, :func:`measure_cpu_peak`, whatever ``count``.

    Example:
        >>> from meshplan.train.flops import mesh_peak
        >>> peak = mesh_peak("gpu", "NVIDIA H200", 8, "bfloat16")
        >>> round(peak.flops / 1e15, 2), peak.label
        (7.92, '8 x NVIDIA H200 bf16 peak 989 TFLOP/s (NVIDIA H200 Tensor Core GPU datasheet ...)')
        >>> print(mesh_peak("gpu", "NVIDIA GeForce GTX 1080", 1, "float32").why)
        no peak FLOP/s is known for NVIDIA GeForce GTX 1080 (meshplan.train.flops.PEAKS lists ...)
    """
    if platform == "cpu":
        measured = measure_cpu_peak(dtype)
        return MeshPeak(
            measured,
            f"measured CPU peak: a {dtype} matmul on every emulated CPU device at once does "
            f"{measured / 1e9:,.1f} GFLOP/s on this host (not a hardware figure)",
        )
    peak = peak_of(kind)
    if peak is None:
        known = ", ".join(p.name for p in PEAKS)
        return MeshPeak(
            None,
            None,
            f"no peak FLOP/s is known for {kind} (meshplan.train.flops.PEAKS lists {known})",
            "peak-unknown-device",
            device=kind,
        )
    per_device = peak.flops(dtype)
    if per_device is None:
        reason = (
            f"{peak.name} publishes no {dtype} peak (it runs {dtype} matmuls as several bf16 "
            f"passes)"
        )
        fix = "compute in bfloat16 (dtype='bfloat16') for MFU"
        return MeshPeak(None, None, reason, "peak-unknown-dtype", fix, peak.name, str(dtype))
    short = "bf16" if dtype == "bfloat16" else "fp32 (TF32)"
    return MeshPeak(
        per_device * count,
        f"{count} x {peak.name} {short} peak {per_device / 1e12:,.0f} TFLOP/s ({peak.source})",
    )


def measure_cpu_peak(dtype: str = "float32") -> float:
    """FLOP/s of a square matmul on every CPU device at once (64 at most): the best of a few rounds.

    The emulated devices share this host's cores, so this is the host's peak as
    a sharded step sees it (XLA's CPU matmuls, not a hardware figure). About a
    quarter of a second; measured once per process and dtype.
    """
    return _measure_cpu_peak(str(dtype))


@functools.cache
def _measure_cpu_peak(dtype: str) -> float:
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    # This process's devices (no other process takes part), at most 64: enough to keep every
    # core busy, and XLA's CPU backend cannot compile one program over thousands of them.
    cpus = jax.local_devices(backend="cpu")[:64]
    n = 256
    mesh = jax.make_mesh((len(cpus),), ("d",), devices=cpus, axis_types=(AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    x = jax.device_put(jnp.ones((len(cpus), n, n), dtype), sharding)
    matmul = jax.jit(
        lambda a: jnp.einsum("bij,bjk->bik", a, a, preferred_element_type=dtype),
        out_shardings=sharding,
    )
    matmul(x).block_until_ready()  # compiles
    flops = 2 * n**3 * len(cpus)
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(4):
            y = matmul(x)
        y.block_until_ready()
        best = min(best, (time.perf_counter() - started) / 4)
    return flops / best
