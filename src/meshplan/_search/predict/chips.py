"""The one table of accelerators: each chip's peaks, memory and links, with its source.

MFU (:func:`meshplan.train.flops.mesh_peak`) reads a chip's peak FLOP/s here; the
planner's hardware profiles (:data:`meshplan._search.predict.profiles.PROFILES`) are
built from a chip and the system around it (hosts, network, what the backend does), so
no figure is written twice. A chip is matched to JAX's ``device.device_kind`` by its
``pattern`` (:func:`chip_of`).
"""

from __future__ import annotations

import dataclasses
import re

__all__ = ["CHIPS", "Chip", "chip_of"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Chip:
    """One accelerator's published figures (dense, no sparsity; per direction for links).

    Attributes:
        name: The accelerator, as its maker names it.
        pattern: A regular expression matched against JAX's ``device.device_kind``.
        bfloat16: Peak bf16 FLOP/s (dense matrix units).
        float32: Peak FLOP/s of float32 matmuls as JAX runs them by default (TF32 tensor
            cores on NVIDIA GPUs since Ampere), or ``None`` when none is published (TPUs
            run float32 matmuls as several bf16 passes).
        memory_bytes: Device memory.
        usable_bytes: Of ``memory_bytes``, what the runtime lets a program use (JAX's
            ``device.memory_stats()["bytes_limit"]``) where it is measured or published;
            ``None``: not known. A hardware profile's budget is this where it is known.
        memory_bandwidth: Bytes per second the chip reads or writes its memory.
        link_bandwidth: Bytes per second each way to its peers on the fast links (NVLink;
            a TPU's ICI along one torus axis; PCIe where there is no NVLink).
        source: Where the figures come from.

    Example:
        >>> from meshplan._search.predict.chips import CHIPS
        >>> h200 = CHIPS["h200"]
        >>> h200.flops("bfloat16") / 1e12, h200.memory_bytes // 10**9
        (989.4, 141)
    """

    name: str
    pattern: str
    bfloat16: float
    float32: float | None
    memory_bytes: int
    usable_bytes: int | None = None
    memory_bandwidth: float
    link_bandwidth: float
    source: str

    def flops(self, dtype: str) -> float | None:
        """The peak for ``dtype`` (``'bfloat16'`` or ``'float32'``)."""
        return self.bfloat16 if dtype == "bfloat16" else self.float32


T = 1e12
GB, GiB = 10**9, 1 << 30

# NVIDIA's datasheets give tensor-core figures with 2:4 sparsity; the dense ones are half.
CHIPS: dict[str, Chip] = {
    "b200": Chip(
        name="NVIDIA B200",
        pattern=r"B200",
        bfloat16=2250 * T,
        float32=1100 * T,
        memory_bytes=180 * GB,
        memory_bandwidth=8e12,
        link_bandwidth=900e9,
        source="NVIDIA DGX/HGX B200 datasheet, per GPU (1/8 of the system; 36 PFLOPS bf16 and "
        "18 PFLOPS TF32 per 8 GPUs, halved: sparsity); NVLink 5 1.8 TB/s",
    ),
    "h200": Chip(
        name="NVIDIA H200",
        pattern=r"H200",
        bfloat16=989.4 * T,
        float32=494.7 * T,
        memory_bytes=141 * GB,
        memory_bandwidth=4.8e12,
        link_bandwidth=450e9,
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM; 1,979 / 989 TFLOPS are with "
        "sparsity); NVLink 900 GB/s",
    ),
    "h100_pcie": Chip(
        name="NVIDIA H100 PCIe",
        pattern=r"H100.*PCIe",
        bfloat16=756.5 * T,
        float32=378.0 * T,
        memory_bytes=80 * GB,
        memory_bandwidth=2.0e12,
        link_bandwidth=300e9,
        source="NVIDIA H100 Tensor Core GPU datasheet (PCIe; the sheet's figures halved: they "
        "are with sparsity); NVLink bridge 600 GB/s",
    ),
    "h100": Chip(
        name="NVIDIA H100 SXM",
        pattern=r"H100",
        bfloat16=989.4 * T,
        float32=494.7 * T,
        memory_bytes=80 * GB,
        memory_bandwidth=3.35e12,
        link_bandwidth=450e9,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM; the sheet's figures halved: they "
        "are with sparsity); NVLink 4 900 GB/s",
    ),
    "a100": Chip(
        name="NVIDIA A100",
        pattern=r"A100",
        bfloat16=312.0 * T,
        float32=156.0 * T,
        memory_bytes=80 * GB,
        memory_bandwidth=2.039e12,
        link_bandwidth=300e9,
        source="NVIDIA A100 Tensor Core GPU datasheet (BF16 and TF32 dense, SXM and PCIe "
        "alike; memory: SXM4 80GB); NVLink 3 600 GB/s",
    ),
    "l4": Chip(
        name="NVIDIA L4",
        pattern=r"\bL4\b",
        bfloat16=121.0 * T,
        float32=60.0 * T,
        memory_bytes=24 * GB,
        memory_bandwidth=300e9,
        link_bandwidth=32e9,
        source="NVIDIA L4 Tensor Core GPU datasheet (the sheet's figures halved: they are with "
        "sparsity); PCIe Gen4 x16 64 GB/s, no NVLink",
    ),
    "tpu_v4": Chip(
        name="TPU v4",
        pattern=r"TPU v4",
        bfloat16=275.0 * T,
        float32=None,
        memory_bytes=32 * GiB,
        memory_bandwidth=1.2e12,
        link_bandwidth=100e9,
        source="Google Cloud TPU documentation, 'TPU v4' (275 TFLOPS bf16 per chip, 32 GiB "
        "HBM2 at 1,200 GB/s); ICI: 2 of 6 ports of 50 GB/s along one torus axis (Jouppi et "
        "al., ISCA 2023)",
    ),
    "tpu_v5e": Chip(
        name="TPU v5e",
        pattern=r"TPU v5 ?(lite|e)",
        bfloat16=197.0 * T,
        float32=None,
        memory_bytes=16 * GiB,
        usable_bytes=16_909_336_064,
        memory_bandwidth=819e9,
        link_bandwidth=100e9,
        source="Google Cloud TPU documentation, 'TPU v5e' (197 TFLOPS bf16 per chip, 16 GiB "
        "HBM2 at 819 GB/s, ICI 400 GB/s over 4 ports: 2 along one axis); usable: JAX's "
        "bytes_limit on a v5e chip, 15.75 GiB (benchmarks/bench_accelerator.py)",
    ),
    "tpu_v5p": Chip(
        name="TPU v5p",
        pattern=r"TPU v5p?$",
        bfloat16=459.0 * T,
        float32=None,
        memory_bytes=95 * GiB,
        memory_bandwidth=2.765e12,
        link_bandwidth=200e9,
        source="Google Cloud TPU documentation, 'TPU v5p' (459 TFLOPS bf16 per chip, 95 GiB "
        "HBM2e at 2,765 GB/s, ICI 600 GB/s over 6 ports: 2 along one axis)",
    ),
    "tpu_v6e": Chip(
        name="TPU v6e (Trillium)",
        pattern=r"TPU v6 ?(lite|e)",
        bfloat16=918.0 * T,
        float32=None,
        memory_bytes=32 * GiB,
        usable_bytes=33_550_237_696,
        memory_bandwidth=1.64e12,
        link_bandwidth=112e9,
        source="Google Cloud TPU documentation, 'TPU v6e' (918 TFLOPS bf16 per chip, 32 GiB "
        "HBM at 1,640 GB/s, ICI 448 GB/s over 4 ports: 2 along one axis); usable: JAX's "
        "bytes_limit on a v6e chip, 31.25 GiB (vllm-project/vllm#16211)",
    ),
}
"""Published accelerators by short name, the most specific ``pattern`` first
(``H100.*PCIe`` before ``H100``)."""


def chip_of(device_kind: str) -> Chip | None:
    """The :data:`CHIPS` entry of a ``device.device_kind``, or ``None`` if it is not listed.

    Example:
        >>> from meshplan._search.predict.chips import chip_of
        >>> chip_of("NVIDIA H100 PCIe").name, chip_of("TPU v5 lite").name, chip_of("cpu")
        ('NVIDIA H100 PCIe', 'TPU v5e', None)
    """
    for chip in CHIPS.values():
        if re.search(chip.pattern, device_kind, flags=re.IGNORECASE):
            return chip
    return None
