"""What the devices can do: peak FLOP/s by device kind, a measured CPU peak, and MFU.

Model FLOPs utilisation (MFU) is the model FLOPs a step needs (forward and
backward, counted from the model's shapes, not from what the compiler ran)
divided by the step's wall time and by the devices' peak. The peaks of common
accelerators are the planner's table of chips (:data:`PEAKS`, each with its
source: :data:`meshplan._search.predict.chips.CHIPS`, which the hardware profiles are
built from too); a device not in that table gets no MFU, and :func:`mesh_peak` says
why. On emulated CPU devices the peak is measured, by the one measurement the ``cpu``
hardware profile is made of (:func:`measure_cpu_peak`), labelled as such.
"""

from __future__ import annotations

import dataclasses

from meshplan._search.measure.cpu import cpu_devices, matmul_flops
from meshplan._search.predict.chips import CHIPS, Chip, chip_of
from meshplan._search.predict.profiles import calibrate_cpu

__all__ = ["PEAKS", "DevicePeak", "MeshPeak", "measure_cpu_peak", "mesh_peak", "peak_of"]

DevicePeak = Chip
"""One accelerator's peaks (and memory and links): :class:`meshplan._search.predict.chips.Chip`."""

PEAKS: tuple[Chip, ...] = tuple(CHIPS.values())
"""Dense peak FLOP/s of common accelerators, most specific pattern first: the chips table."""


def peak_of(device_kind: str) -> Chip | None:
    """The :data:`PEAKS` entry of a ``device.device_kind``, or ``None`` if it is not listed.

    Example:
        >>> from meshplan.train.flops import peak_of
        >>> peak_of("NVIDIA H200").bfloat16 / 1e12, peak_of("TPU v5 lite").name
        (989.4, 'TPU v5e')
        >>> peak_of("NVIDIA H100 PCIe").name, peak_of("cpu") is None
        ('NVIDIA H100 PCIe', True)
    """
    return chip_of(device_kind)


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
        no peak FLOP/s is known for NVIDIA GeForce GTX 1080 (meshplan.train.flops.PEAKS, ...)
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
            f"no peak FLOP/s is known for {kind} (meshplan.train.flops.PEAKS, the planner's chips, lists {known})",
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


def measure_cpu_peak(dtype: str = "float32", devices: int | None = None) -> float:
    """FLOP/s of matmuls on the first ``devices`` CPU devices (all of this process's, 64 at
    most, by default), all of them at once, together.

    The emulated devices share this host's cores, so this is the host's peak as a sharded
    step on them sees it (XLA's CPU matmuls, not a hardware figure). In float32 it is the
    ``cpu`` hardware profile's figure (:func:`meshplan._search.predict.profiles.calibrate_cpu`,
    cached with it) times the devices; in another dtype, the same measurement in that
    dtype (:func:`meshplan._search.measure.cpu.matmul_flops`, once per process).

    Example:
        >>> from meshplan.train.flops import measure_cpu_peak
        >>> from meshplan._search.predict.profiles import calibrate_cpu
        >>> measure_cpu_peak("float32", 2) == 2 * calibrate_cpu(2).peak_flops
        True
    """
    n = len(cpu_devices(min(devices or 64, 64)))
    if str(dtype) == "float32":
        return n * calibrate_cpu(n).peak_flops
    return n * matmul_flops(n, str(dtype))
