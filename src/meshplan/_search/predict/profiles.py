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
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TypedDict

import jax

from meshplan._errors import ArgumentError, error_for
from meshplan._search.measure.cpu import FRESH_BYTES, cpu_devices, measure_cpu
from meshplan._search.measure.machine_load import load_per_core, same_load
from meshplan._search.predict.chips import CHIPS, GiB
from meshplan._search.predict.inputs import check_profile, check_profile_arg, profile_fields

__all__ = [
    "ATTENTION",
    "PROFILES",
    "HardwareProfile",
    "calibrate_cpu",
    "get_profile",
    "load_profile",
    "runs_here",
    "with_attention",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
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
        latency_s: Seconds each collective within a domain costs whatever its size.
        source: Where the figures come from.
        slow_latency_s: The same across domains (default: ``latency_s``).
        matmul_efficiency: The fraction of ``peak_flops`` large matmuls reach.
        fused_attention: Attention runs as one fused (flash) kernel: its scores never
            reach memory. A framework's kernel (Pallas' splash, cuDNN, FlashAttention) does
            this; XLA makes none of attention written as matmuls and a softmax
            (``jax.nn.dot_product_attention``'s default too), so it is off in every built-in
            profile: ``attention='flash'`` (``--attention flash``) prices a step as such a
            kernel would run its attention (:func:`with_attention`).
        reduce_scatter: The backend reduces a gradient into its shards (FSDP) with a
            reduce-scatter rather than an all-reduce.
        overlap: The fraction of compute time that hides independent collectives
            (weight gathers, gradient reductions; XLA's async collectives); 0: none.
        combine_bytes: Independent collectives are combined up to this many bytes (as
            XLA's combiner passes do), so they pay one latency; 0: no limit (each kind's
            on one mesh axis group, once per loop iteration, is one collective), and
            no reduction is kept pending for a combined one in the memory peak.
        combines_gathers: XLA combines independent all-gathers and reduce-scatters too
            (its ``AllGatherCombiner``/``ReduceScatterCombiner`` passes, on GPU and TPU);
            ``False``: each array's pays its own latency, as on CPU, where XLA runs only
            its all-reduce combiner (``CpuAllReduceCombiner``, no byte limit).
        regather: A weight FSDP gathers for the forward pass is gathered again for the
            backward pass (not kept alive between them), as on TPU and GPU; XLA on CPU
            keeps it.
        rematerialize: XLA recomputes cheap elementwise values (a norm's float32 copy, an
            activation's derivative) where they are used rather than keep them for the
            backward pass, as its fusion and rematerialisation passes do against a device's
            memory (TPU, GPU); XLA on CPU, with no memory limit, keeps them.
        attention_efficiency: The fraction of ``peak_flops`` the fused attention kernels
            reach, forward and backward (the backward's recompute of the scores counted as
            FLOPs: :mod:`meshplan._search.predict.attention`); 0: ``matmul_efficiency``.
        attention_head_dim: The head dimension from which the attention kernels reach
            ``attention_efficiency``; below it their time goes with their scores, not their
            FLOPs (the softmax on each score, on a TPU's vector units, bounds them), so a
            head dimension ``d`` reaches ``d / attention_head_dim`` of it; 0: the efficiency
            whatever the head dimension.
        causal_block: Keys per tile of the fused attention kernel: under a causal mask the
            tiles wholly masked are skipped (0: none skipped, the whole square computed).
        hop_latency_s: Seconds each step of a ring collective adds within a domain (NCCL's
            per-hop latency over NVLink; a ring over ``k`` devices takes ``k - 1`` steps per
            phase, a tree ``log2 k``).
        slow_hop_latency_s: The same for each step that crosses domains (a network hop).
        overlap_cost: The fraction of a hidden collective's time that the compute it
            overlaps loses anyway: NCCL's kernels run on the GPU's cores (its channels take
            streaming multiprocessors) and read and write its memory; 0: none (a TPU's ICI
            has its own DMA engines).
        combines_remat_collectives: A rematerialised region of an unrolled (not scanned)
            layer whose recomputation contains a partial-sum all-reduce (a tensor-parallel
            projection's) runs in the forward pass: the collective combiner merges that
            all-reduce with the forward's own of the same layer into one, so the
            recomputation up to it is computed there, and what it computes for the backward
            pass is kept from then on, as if not rematerialised. XLA on CPU does
            (its pass ``cpu-all-reduce-combiner``); not known of TPU's or GPU's combiners.
        late_gradients: The gradients' reductions over the batch (a weight gradient's matmul
            or convolution, a bias's sum) run after the rest of the backward pass, so the
            activation gradients and saved inputs they read stay alive until then
            (:func:`meshplan._search.predict.memory.late_moves`): XLA on CPU, whose
            memory-optimised scheduler works back from the one all-reduce combining every
            gradient (measured: its buffer assignment). That scheduler is XLA's depth-first
            one: the program walks the top-level equations in its order, each value's
            operands those made from the most bytes first, so a weight gradient off the
            path to the first gradient it reaches waits until the end of the backward
            pass; on TPU and GPU the gradients'
            reductions start as soon as each is made, to overlap the backward pass. The
            same program (XLA:CPU's) makes a value cheap ops compute that a matmul reads
            transposed (a weight gradient's activation gradient) where each matmul reads
            it, its sources alive until the last: XLA:CPU fuses its computation into the
            transposed copy, and again for its other readers
            (:func:`meshplan._search.predict.memory.copied`); and it counts the index
            arrays XLA:CPU makes for a max-pool and its gradient
            (:data:`meshplan._search.predict.memory.EXPANDED`).
        fusion_reads: The memory traffic counts what each loop fusion reads, every buffer
            its computation starts from, once per kernel
            (:mod:`meshplan._search.predict.fusion_reads`): checked against XLA:CPU's
            ``cost_analysis()`` bytes on the suite of ``tests/xla_suite.py``; not yet on
            TPU or GPU (their published rows are priced without it). With it, an array
            gathered on a dimension inside it is copied for each matmul that reads it
            (:func:`meshplan._search.predict.cost.relayout_bytes`).
        regathers_unnamed: An activation gathered for a matmul of the forward pass is
            gathered again for the backward pass's where no logical constraint names it
            (XLA:CPU: its propagation gives the backward's read a sharding of its own); a
            named one is gathered once and its gathered copy kept (``regather`` gathers
            every one again).
        array_latency_s: Seconds each array of a combined collective adds beyond the
            first, over the whole domain: XLA:CPU reduces a combined all-reduce's operands
            one after another, each a meeting of the group's threads (the ``cpu`` profile
            measures it: ``benchmarks/bench_calibration.py --arrays``); 0: a combined
            collective pays one latency, whatever it carries.
        latency_per_device: A collective over ``k`` of a domain's devices pays
            ``k / domain_devices`` of its latencies (``latency_s`` and ``array_latency_s``,
            measured over all of them): XLA:CPU's device threads meet one after another,
            so a pair meets about four times as fast as eight.
        fresh_bytes: A step whose temporaries take at least this many bytes of a device
            gets them as new memory on every call (XLA:CPU allocates them as one buffer per
            call, and glibc's ``malloc`` maps a block of 32 MiB or more from the kernel
            afresh: :data:`meshplan._search.measure.cpu.FRESH_BYTES`); 0: never (an
            accelerator's allocator keeps its memory).
        first_touch_s: Seconds per byte that writing new memory adds (its pages faulted in,
            every device at once), paid once a step on the temporaries where ``fresh_bytes``
            says they are new: the ``cpu`` profile measures it
            (:func:`meshplan._search.measure.cpu.first_touch_seconds`; ``benchmarks/
            bench_calibration.py --fresh`` checks it in steps).
        holds_broadcasts: A step also holds what XLA:CPU's default schedule, the one
            every ``jax.jit`` on CPU runs, keeps beyond the memory-optimised one the rest of
            the memory model follows: both operands of each outer product of the forward
            pass (a norm's ``rsqrt`` times its scale, ``[b, s, 1] * [1, 1, d]``), written
            out at the product's shape and held until the backward pass reads them
            (:attr:`meshplan._search.predict.trace.Workload.held_broadcasts`; read in its
            buffer live ranges: Hugging Face's GPT-Neo, and an MLP of LayerNorms). The
            memory-optimised schedule makes each just before its reader.
        matmul_bytes_serial: A matmul takes its arithmetic's time plus its bytes' (operands
            read, output written over ``memory_bandwidth``), not the larger of the two:
            XLA:CPU's dot kernels do not overlap them. Measured on the suite of
            ``tests/xla_suite.py``: its mixture of experts contracts its experts' output
            through an intermediate twice as large under 2x4 as under 4x2, for the same
            FLOPs, and that matmul takes 1.15x as long (docs/benchmarks.md, sessions 27
            and 28); priced by the larger alone, 2x4 ranked first and ran 1.08-1.11x as
            long as 4x2 (with the sum, the two are within the search's tie).

    Example:
        >>> import meshplan
        >>> mine = meshplan.HardwareProfile(
        ...     name="mine", peak_flops=100e12, memory_bytes=32 * 2**30, memory_bandwidth=1e12,
        ...     fast_bandwidth=200e9, slow_bandwidth=25e9, domain_devices=4, latency_s=1e-5,
        ... )
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
    slow_latency_s: float | None = None
    matmul_efficiency: float = 1.0
    fused_attention: bool = False
    reduce_scatter: bool = True
    overlap: float = 0.0
    combine_bytes: int = 0
    combines_gathers: bool = True
    regather: bool = False
    rematerialize: bool = False
    combines_remat_collectives: bool = False
    attention_efficiency: float = 0.0
    attention_head_dim: int = 0
    causal_block: int = 0
    hop_latency_s: float = 0.0
    slow_hop_latency_s: float = 0.0
    overlap_cost: float = 0.0
    late_gradients: bool = False
    fusion_reads: bool = False
    array_latency_s: float = 0.0
    latency_per_device: bool = False
    regathers_unnamed: bool = False
    fresh_bytes: int = 0
    first_touch_s: float = 0.0
    holds_broadcasts: bool = False
    matmul_bytes_serial: bool = False

    def __post_init__(self) -> None:
        if self.slow_latency_s is None:
            object.__setattr__(self, "slow_latency_s", self.latency_s)
        check_profile(self)  # finite, in range, of its type: meshplan._search.predict.inputs

    def axis_bandwidth(self, mesh: Mapping[str, int], axis: str) -> float:
        """The bandwidth of ``axis`` of ``mesh`` (row-major over the devices).

        Example:
            >>> from meshplan._search.predict.profiles import get_profile
            >>> h100 = get_profile("h100")
            >>> mesh = {"data": 4, "tensor": 8}       # 32 GPUs, 8 per NVLink host
            >>> h100.axis_bandwidth(mesh, "tensor") > h100.axis_bandwidth(mesh, "data")
            True
        """
        names = list(mesh)
        stride = math.prod(mesh[a] for a in names[names.index(axis) + 1 :])
        span = stride * mesh[axis]
        return self.fast_bandwidth if span <= self.domain_devices else self.slow_bandwidth

    def to_dict(self) -> dict[str, object]:
        """The figures as plain data (what :func:`load_profile` reads back).

        Example:
            >>> import meshplan
            >>> meshplan.get_profile("h100").to_dict()["domain_devices"]
            8
        """
        return dataclasses.asdict(self)


class Backend(TypedDict, total=False):
    """What a backend's compiler and collectives library do: :class:`HardwareProfile`'s
    behaviour fields (documented there), as :data:`BACKENDS` gives them."""

    fused_attention: bool
    reduce_scatter: bool
    overlap: float
    combine_bytes: int
    combines_gathers: bool
    regather: bool
    rematerialize: bool
    combines_remat_collectives: bool
    causal_block: int
    hop_latency_s: float
    slow_hop_latency_s: float
    overlap_cost: float
    late_gradients: bool
    fusion_reads: bool
    latency_per_device: bool
    regathers_unnamed: bool
    fresh_bytes: int
    holds_broadcasts: bool
    matmul_bytes_serial: bool


# Physical parameters shared by a backend's profiles (never fitted per model or run):
# XLA on TPU and on GPU runs collectives asynchronously, overlapping weight gathers and
# gradient reductions with the layers around them, combines small ones (the combiner
# passes' thresholds are tens of MiB) and reduce-scatters FSDP gradients. Fused (flash)
# attention is the program's, not the backend's: a kernel the framework calls (Pallas' on
# TPU, cuDNN's on GPU); XLA writes the scores of attention written as matmuls to memory
# (measured on a TPU v5e: benchmarks/bench_accelerator.py), so no backend entry sets it.
BACKENDS: dict[str, Backend] = {
    # MaxText's TPU attention is Pallas' splash kernel, whose tiles (sa_block_q, sa_block_kv)
    # are 512 wide: it skips those a causal mask hides (where attention='flash').
    "tpu": Backend(
        overlap=0.9,
        combine_bytes=32 << 20,
        regather=True,
        rematerialize=True,
        causal_block=512,
    ),
    # NCCL's collectives take steps: its tuning model (src/graph/tuning.cc, ``hwLat``, per ring
    # step) gives 0.4 us over NVLink with its LL protocol, the one it picks for the small
    # messages whose latency matters within a host, and 6.6 us over the network with its
    # Simple protocol, the one it picks for the large chunks a sharded weight's ring moves.
    # Its kernels run on the GPU's streaming multiprocessors (a channel each: 16 to 32 of an
    # H100's 132) and share its memory bandwidth with the compute they overlap, which loses
    # a fifth of the time they run (overlap_cost 0.2: fitted with the matmul efficiencies on
    # the calibration rows, within that share). Flash kernels skip the tiles a causal mask
    # hides (128 keys a tile: FlashAttention 2 and 3, cuDNN).
    "gpu": Backend(
        overlap=0.9,
        combine_bytes=32 << 20,
        regather=True,
        rematerialize=True,
        hop_latency_s=0.4e-6,
        slow_hop_latency_s=6.6e-6,
        overlap_cost=0.2,
        causal_block=128,
    ),
    # What XLA on CPU does, not measured (so a profile cached before a field was added has
    # it): its all-reduce combiner (cpu-all-reduce-combiner) merges an unrolled layer's
    # rematerialised partial-sum all-reduce with the forward pass's own, running that
    # recomputation in the forward; it combines no all-gathers or reduce-scatters (its
    # only combiner is that one), and has no fused attention. It does not reduce-scatter:
    # an FSDP gradient's partial sums are all-reduced whole, then sliced (no reduce-scatter
    # in any compiled step of tests/xla_suite.py).
    # Its memory-optimised scheduler is XLA's depth-first one (DFSMemoryScheduler), from
    # that one all-reduce: the gradients off the path to the first it reaches run last,
    # just before it (read in its schedules and buffer assignment: late_gradients).
    # Its collectives are meetings of the devices' threads: a combined all-reduce meets once
    # per operand (the profile measures what each costs: array_latency_s), and a meeting
    # takes longer the more threads it waits for (on 8 devices, 13 cores: 47, 99 and 209 us
    # per operand for groups of 2, 4 and 8). Its temporaries are one buffer, allocated per
    # call: from 32 MiB a device on, new memory each step (fresh_bytes). Its default
    # schedule holds an outer product's broadcast operands from the forward pass to the
    # backward (holds_broadcasts). Its dot kernels' arithmetic does not hide their operands'
    # reads and output's writes: a matmul costs both (matmul_bytes_serial; measured on the
    # suite's models, docs/benchmarks.md, session 28).
    "cpu": Backend(
        combines_remat_collectives=True,
        combines_gathers=False,
        reduce_scatter=False,
        late_gradients=True,
        fusion_reads=True,
        latency_per_device=True,
        regathers_unnamed=True,
        fresh_bytes=FRESH_BYTES,
        holds_broadcasts=True,
        matmul_bytes_serial=True,
    ),
}
"""What each backend does, by JAX platform name; a profile takes its backend's entry."""


class _Chip(TypedDict):
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float
    fast_bandwidth: float


def _chip(name: str) -> _Chip:
    """A profile's figures of one device: the bf16 peak, memory (what a program may use,
    where known) and fast links of :data:`~meshplan._search.predict.chips.CHIPS`."""
    chip = CHIPS[name]
    return _Chip(
        peak_flops=chip.bfloat16,
        memory_bytes=chip.usable_bytes or chip.memory_bytes,
        memory_bandwidth=chip.memory_bandwidth,
        fast_bandwidth=chip.link_bandwidth,
    )


class _Latency(TypedDict):
    latency_s: float
    slow_latency_s: float


class _Efficiency(TypedDict, total=False):
    matmul_efficiency: float
    attention_efficiency: float
    attention_head_dim: int


# A collective's latency on DGX-style GPU hosts, ~10 us within a host (NCCL), 20 across;
# on Google Cloud TPU pods, 5 us within a pod (ICI), 50 across (DCN).
_DGX = _Latency(latency_s=10e-6, slow_latency_s=20e-6)
_POD = _Latency(latency_s=5e-6, slow_latency_s=50e-6)

# GPU matmul efficiencies (the fraction of the datasheet peak large bf16 matmuls reach),
# fitted on the calibration rows of benchmarks/bench_published.py (llm-foundry's PyTorch
# FSDP runs, MaxText's A3 runs at 2 and 16 hosts, Megatron-LM's; the held-out rows check
# them): A100 0.62 of 312 TFLOP/s, H100-class 0.48 of 989 (Hopper's bf16 peak is rarely
# approached by those kernels). Attention efficiencies from the kernels' papers:
# FlashAttention-2 reaches 50-73% of an A100's peak (Dao 2023, arXiv:2307.08691, abstract;
# the low end under causal masks and short sequences): 0.55; and 35% of an H100's (Shah et
# al. 2024, FlashAttention-3, arXiv:2407.08608, abstract): 0.35.
_A100 = _Efficiency(matmul_efficiency=0.62, attention_efficiency=0.55)
_HOPPER = _Efficiency(matmul_efficiency=0.48, attention_efficiency=0.35)
_TPU_MATMUL = 0.86
_TPU_EFF = _Efficiency(matmul_efficiency=_TPU_MATMUL)
# Pallas' splash attention kernel (the one MaxText calls, with its 512-wide tiles), timed
# alone on a TPU v5e chip (benchmarks/bench_accelerator.py --kernel-only splash): forward and
# backward reach 0.16 of the peak at head dimension 64, 0.30-0.32 at 128 and 0.35 at 256,
# sequence 2048 (0.37 and 0.42 at 4096, 0.45 at 8192). Up to 128 the time goes with the
# scores, not the FLOPs (28-30 ps a score: the softmax on the vector units bounds it); at
# 256 with the FLOPs, at 0.35. So 0.35 from a head dimension of 149 (0.35 x 128 / 0.30) and
# in proportion below it. Measured on v5e only: the other TPUs keep their matmul efficiency
# for attention (v5p's published rows are within 2% so).
_V5E_EFF = _Efficiency(
    matmul_efficiency=_TPU_MATMUL, attention_efficiency=0.35, attention_head_dim=149
)

PROFILES: dict[str, HardwareProfile] = {
    "a100": HardwareProfile(
        name="a100",
        **_chip("a100"),
        slow_bandwidth=25e9,  # DGX A100: 8x 200 Gb/s HDR InfiniBand per 8 GPUs
        domain_devices=8,
        **_DGX,
        **_A100,
        **BACKENDS["gpu"],
        source="NVIDIA A100 SXM4 80GB datasheet; DGX A100 (8x HDR 200 Gb/s InfiniBand)",
    ),
    "h100": HardwareProfile(
        name="h100",
        **_chip("h100"),
        slow_bandwidth=50e9,  # DGX H100: 8x 400 Gb/s ConnectX-7 InfiniBand per 8 GPUs
        domain_devices=8,
        **_DGX,
        **_HOPPER,
        **BACKENDS["gpu"],
        source="NVIDIA H100 SXM5 datasheet; DGX H100 (8x ConnectX-7 400 Gb/s)",
    ),
    # Google Cloud A3 VMs (a3-highgpu-8g, cloud.google.com/compute/docs/gpus, "A3 High"): 8
    # H100 SXM on NVLink 4; between VMs GPUDirect-TCPX over 4 NICs of 200 Gb/s for the GPUs:
    # 800 Gb/s per 8 GPUs, 12.5 GB/s per GPU each way. MaxText's A3 results ran here.
    "h100_a3": HardwareProfile(
        name="h100_a3",
        **_chip("h100"),
        slow_bandwidth=12.5e9,
        domain_devices=8,
        **_DGX,
        **_HOPPER,
        **BACKENDS["gpu"],
        source="NVIDIA H100 SXM5 datasheet; Google Cloud A3 High (4x 200 Gb/s GPUDirect-TCPX "
        "per VM)",
    ),
    "h200": HardwareProfile(
        name="h200",
        **_chip("h200"),
        slow_bandwidth=50e9,  # as DGX H100
        domain_devices=8,
        **_DGX,
        **_HOPPER,
        **BACKENDS["gpu"],
        source="NVIDIA H200 SXM datasheet; DGX-style hosts (8x 400 Gb/s InfiniBand)",
    ),
    "b200": HardwareProfile(
        name="b200",
        **_chip("b200"),
        slow_bandwidth=50e9,  # DGX B200: 8x 400 Gb/s ConnectX-7 per 8 GPUs
        domain_devices=8,
        **_DGX,
        **_HOPPER,
        **BACKENDS["gpu"],
        source="NVIDIA DGX B200 datasheet (per GPU: 1/8 of the system)",
    ),
    # A pod (ICI domain) is 4,096 chips. DCN between pods: 100 Gb/s per host of 4 chips =
    # 3.1 GB/s per chip.
    "tpu_v4": HardwareProfile(
        name="tpu_v4",
        **_chip("tpu_v4"),
        slow_bandwidth=3.1e9,
        domain_devices=4096,
        **_POD,
        **_TPU_EFF,
        **BACKENDS["tpu"],
        source="Google Cloud TPU v4 documentation (system architecture); Jouppi et al., ISCA 2023",
    ),
    # A pod is 256 chips. DCN: 2x 100 Gb/s NIC per host of 8 chips (6.4 Tb/s per pod) =
    # 3.1 GB/s per chip.
    "tpu_v5e": HardwareProfile(
        name="tpu_v5e",
        **_chip("tpu_v5e"),
        slow_bandwidth=3.125e9,
        domain_devices=256,
        **_POD,
        **_V5E_EFF,
        **BACKENDS["tpu"],
        source="Google Cloud TPU v5e documentation (system architecture)",
    ),
    # A pod is 8,960 chips. DCN assumed as v5e per chip. The TPU pages' "GB" of HBM are GiB
    # (v5p's English page gives "HBM capacity per chip (GiB) 95"; JAX reports 33,550,237,696
    # usable bytes, 31.25 GiB, on a "32 GB" v6e chip: vllm-project/vllm#16211, and
    # 16,909,336,064, 15.75 GiB, on a 16 GiB v5e: the budgets are those).
    "tpu_v5p": HardwareProfile(
        name="tpu_v5p",
        **_chip("tpu_v5p"),
        slow_bandwidth=3.125e9,
        domain_devices=8960,
        **_POD,
        **_TPU_EFF,
        **BACKENDS["tpu"],
        source="Google Cloud TPU v5p documentation (system architecture)",
    ),
    # A pod is 256 chips. DCN: 4x 200 Gb/s per host of 8 chips. Matmul efficiency: v6e's two
    # 256x256 MXUs reach less of their peak than v5e's 128x128 ones; MaxText's published v6e
    # runs are at 43.8-50.3% MFU (docs/reference/models/tiering.md) against 56-67% on v5e.
    # The figure is fitted on the one published v6e run with a layout the planner models
    # exactly (Llama2-70B, full remat, FSDP 256, a calibration row of
    # benchmarks/bench_published.py); no held-out v6e row checks it.
    "tpu_v6e": HardwareProfile(
        name="tpu_v6e",
        **_chip("tpu_v6e"),
        slow_bandwidth=12.5e9,
        domain_devices=256,
        **_POD,
        matmul_efficiency=0.60,
        **BACKENDS["tpu"],
        source="Google Cloud TPU v6e documentation (system architecture); matmul efficiency "
        "fitted on MaxText's published Llama2-70B v6e-256 run",
    ),
}
"""Published profiles by name, each a chip of
:data:`~meshplan._search.predict.chips.CHIPS` in its system; ``cpu`` is measured
(:func:`get_profile`)."""

_CPU: dict[int, HardwareProfile] = {}
_CACHE_VERSION = (
    "v6"  # v6: first_touch_s; v5: array_latency_s; v4: no first-touch faults, interleaved
)


def calibrate_cpu(devices: int | None = None) -> HardwareProfile:
    """This machine's emulated JAX devices, measured all busy at once
    (:func:`meshplan._search.measure.cpu.measure_cpu`: matmul FLOP/s and memory bandwidth
    per device, a ``psum``'s latency and bandwidth), as the ``cpu`` profile.

    Cached per device count, in this process and in ``~/.cache/meshplan/cpu-profile-v6-N.json``
    with the machine's load, and measured again under another load
    (:mod:`meshplan._search.measure.machine_load`) or with ``MESHPLAN_RECALIBRATE=1``.

    Example:
        >>> from meshplan._search.predict.profiles import calibrate_cpu
        >>> cpu = calibrate_cpu(2)
        >>> cpu.name, cpu.domain_devices, cpu.peak_flops > 1e8
        ('cpu', 2, True)
    """
    n = len(cpu_devices(devices))
    if n in _CPU:
        return _CPU[n]
    cached = _cached_cpu(n)
    if cached is not None:
        _CPU[n] = cached
        return cached
    figures = measure_cpu(n)
    profile = HardwareProfile(
        name="cpu",
        peak_flops=figures.matmul_flops,
        memory_bytes=8 * GiB,
        memory_bandwidth=figures.memory_bandwidth,
        fast_bandwidth=figures.link_bandwidth,
        slow_bandwidth=figures.link_bandwidth,
        domain_devices=n,
        latency_s=figures.latency_s,
        array_latency_s=figures.array_latency_s,
        first_touch_s=figures.first_touch_s,
        source=f"measured on this machine: {n} emulated devices (cpu)",
        **BACKENDS["cpu"],
    )
    _CPU[n] = profile
    _save_cpu(n, profile)
    return profile


def _cache_path(n: int) -> Path:

    root = os.environ.get("MESHPLAN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "meshplan"
    )
    return Path(root) / f"cpu-profile-{_CACHE_VERSION}-{n}.json"


def _cached_cpu(n: int) -> HardwareProfile | None:
    """The measured profile of an earlier run (so two runs rank alike), unless
    ``MESHPLAN_RECALIBRATE=1`` asks for a new measurement."""
    import json
    import os

    if os.environ.get("MESHPLAN_RECALIBRATE") == "1":
        return None
    try:
        data = json.loads(_cache_path(n).read_text())
        if not same_load(data.pop("load_per_core", None), load_per_core()):
            return None  # measured under another load: machine_load says why
        return HardwareProfile(**{**data, **BACKENDS["cpu"]})
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _save_cpu(n: int, profile: HardwareProfile) -> None:
    import json

    path = _cache_path(n)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**profile.to_dict(), "load_per_core": load_per_core()}))
    except OSError:
        pass  # a read-only home: measured again next time


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """A profile from a JSON file: an object of :class:`HardwareProfile`'s fields.

    Required: ``name``, ``peak_flops``, ``memory_bytes``, ``memory_bandwidth``,
    ``fast_bandwidth``, ``slow_bandwidth``, ``domain_devices``, ``latency_s``; the others
    have defaults. Every problem (a missing or unknown field, a value of the wrong type
    or not positive) is listed in one error.

    Example:
        >>> import json, os, tempfile
        >>> from meshplan._search.predict.profiles import get_profile, load_profile
        >>> mine = dict(get_profile("tpu_v5e").to_dict(), name="mine", peak_flops=100e12)
        >>> path = os.path.join(tempfile.mkdtemp(), "mine.json")
        >>> with open(path, "w") as f:
        ...     json.dump(mine, f)
        >>> load_profile(path).peak_flops
        100000000000000.0
    """
    import json

    if not isinstance(path, str | os.PathLike):
        raise error_for(
            ArgumentError,
            "bad-argument",
            "path",
            f"load_profile reads a JSON file, and got a {type(path).__name__}: {path!r}",
            "Pass the file's path; build a profile from its fields with "
            "meshplan.HardwareProfile(**fields).",
        )
    path = os.fspath(path)
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise error_for(
            ArgumentError,
            "profile-unreadable",
            path,
            f"Cannot read the profile {path!r}: {e.strerror}",
            f"Pass a JSON file of HardwareProfile fields, or a profile name: cpu, "
            f"{', '.join(PROFILES)}.",
        ) from None
    except ValueError as e:
        raise error_for(
            ArgumentError,
            "profile-not-json",
            path,
            f"The profile {path!r} is not JSON: {e}",
            "Write an object of HardwareProfile fields, e.g. "
            "meshplan.get_profile('h100').to_dict() saved with json.dump.",
        ) from None
    if not isinstance(data, dict):
        raise error_for(
            ArgumentError,
            "profile-not-object",
            path,
            f"The profile {path!r} holds a {type(data).__name__}, not an object of fields",
            'Write an object like {"name": "mine", "peak_flops": 1e14, ...}.',
        )
    return HardwareProfile(**profile_fields(data, path, HardwareProfile))


def get_profile(profile: str | HardwareProfile, devices: int | None = None) -> HardwareProfile:
    """A profile by name (``cpu``, :data:`PROFILES`), a JSON file (``*.json``), or ``profile`` itself.

    Example:
        >>> from meshplan._search.predict.profiles import get_profile
        >>> p = get_profile("tpu_v5e")
        >>> p.peak_flops, round(p.memory_bytes / 2**30, 2)  # what JAX lets a program use
        (197000000000000.0, 15.75)
        >>> get_profile("a1000")
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: Unknown hardware profile 'a1000'. Known: cpu, a100, h100, h100_a3, h200, b200, tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e.
        Pass one of those, a JSON file of HardwareProfile fields, or a meshplan HardwareProfile.
    """
    check_profile_arg(profile, devices, ("cpu", *PROFILES), HardwareProfile)
    if isinstance(profile, HardwareProfile):
        return profile
    if profile == "cpu":
        return calibrate_cpu(devices)
    if profile.endswith(".json"):
        return load_profile(profile)
    if profile not in PROFILES:
        raise error_for(
            ArgumentError,
            "unknown-profile",
            "profile",
            f"Unknown hardware profile {profile!r}. Known: cpu, {', '.join(PROFILES)}",
            "Pass one of those, a JSON file of HardwareProfile fields, or a meshplan "
            "HardwareProfile.",
        )
    return PROFILES[profile]


def runs_here(profile: HardwareProfile) -> bool:
    """Whether ``profile`` behaves as this machine's backend (its :data:`BACKENDS` entry), so
    that what XLA compiles here (collectives, temporaries) is what the profile's hardware runs.

    Example:
        >>> import jax
        >>> from meshplan._search.predict.profiles import get_profile, runs_here
        >>> runs_here(get_profile("h100")) == (jax.default_backend() == "gpu")
        True
    """
    backend = BACKENDS.get(jax.default_backend())
    return backend is not None and all(getattr(profile, k) == v for k, v in backend.items())


ATTENTION = ("flash", "xla")
"""How a step's attention runs: ``'flash'`` as one fused kernel, ``'xla'`` as written."""


def with_attention(profile: HardwareProfile, attention: str | None) -> HardwareProfile:
    """``profile`` pricing attention as ``attention`` says (``None``: as the profile does).

    ``'flash'``: the scores never reach memory, the kernel's efficiency and causal blocks
    (the framework calls a fused kernel, as MaxText, Megatron-LM and llm-foundry do);
    ``'xla'``: the matmuls and the softmax as written, the scores in memory (what XLA
    makes of ``jax.nn.dot_product_attention`` and of attention written by hand).

    Example:
        >>> from meshplan._search.predict.profiles import get_profile, with_attention
        >>> h100 = get_profile("h100")
        >>> h100.fused_attention, with_attention(h100, "flash").fused_attention
        (False, True)
        >>> with_attention(h100, "fast")
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: attention='fast' is not a way attention runs: expected 'flash' or 'xla'.
        Pass attention='flash' (a fused kernel), 'xla' (as written) or None (the profile's).
    """
    if attention is None:
        return profile
    if attention not in ATTENTION:
        raise error_for(
            ArgumentError,
            "bad-argument",
            "attention",
            f"{attention=} is not a way attention runs: expected 'flash' or 'xla'",
            "Pass attention='flash' (a fused kernel), 'xla' (as written) or None (the profile's).",
        )
    return dataclasses.replace(profile, fused_attention=attention == "flash")
