"""Predictions against published training results of public frameworks (no devices needed).

Each row is a configuration a framework published with its measured speed: the model's
dimensions, batch, sequence, hardware, layout and remat, and the published throughput,
with its source. The step is traced once, abstractly (``jax.make_jaxpr`` of the global
step: no device, no compile), and priced by meshplan's planner on the published layout
and by the search (``meshplan.search_rules``, analytic: ``compile_top=0``).

Per row: predicted / published step time, whether the published layout fits the
predicted memory (it ran, so it must), the search's top-1 (its predicted time relative
to the published layout's, whether it fits) and the search's wall time. The profiles
(``meshplan._search.predict.profiles``) carry one set of physical parameters per hardware
(matmul efficiency, latencies, overlap), never a figure per row; rows marked ``held
out`` were not looked at while choosing those parameters.

Run: ``.venv/bin/python benchmarks/bench_published.py [--rows N] [--only NAME] [--no-search] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from typing import Any

import jax

import meshplan
from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import get_profile, with_attention
from meshplan._search.predict.trace import trace_workload
from meshplan.models.llama import LlamaConfig, llama_step, maxtext_config

MAXTEXT_V5E = "https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/v5e/README.md"
MAXTEXT_V5P = (
    "https://github.com/AI-Hypercomputer/maxtext (README, 'Runtime Performance Results', TPU v5p)"
)
FOUNDRY = "https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md"
TPU_RECIPES_V6E = (
    "https://github.com/AI-Hypercomputer/tpu-recipes/blob/main/training/trillium/"
    "Llama2-70B-MaxText/README.md (config: maxtext benchmarks/maxtext_trillium_model_configs.py"
    " llama2_70b_4096)"
)
MAXTEXT_A3 = (
    "https://github.com/AI-Hypercomputer/maxtext/blob/main/MaxText/configs/a3/llama_2_7b/"
    "README.md (TFLOP/s per chip; configs 1vm.sh and 8vm.sh beside it)"
)
PALM = "Chowdhery et al. 2022, PaLM, arXiv:2204.02311, sec. 4 and appendix B (46.2% MFU)"
MEGATRON = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM, arXiv:2104.04473, Table 1 (the rows without pipeline parallelism)"
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One published configuration and its published speed.

    ``mesh``/``rules``: the published layout; ``published_s``: the published step time
    (``how``: how it follows from the source's figures); ``batch``: sequences per
    microbatch, ``microbatches`` of them accumulated per step; ``flash``: the framework ran
    fused (flash) attention (``False``: the scores written to memory, as Megatron-LM's
    2021 kernels did: the profile without ``fused_attention``).
    """

    name: str
    profile: str
    cfg: LlamaConfig
    batch: int
    seq: int
    mesh: dict[str, int]
    rules: tuple[tuple[str, Any], ...]
    published_s: float
    how: str
    source: str
    held_out: bool = False
    flash: bool = True
    microbatches: int = 1


def _maxtext_flops(cfg: LlamaConfig, batch: int, seq: int) -> float:
    """MaxText's model FLOPs of a training step (``calculate_tflops_training_per_device``,
    times the devices): weights' matmuls forward and backward (3x), attention 3x,
    non-causal, no remat."""
    b, s, e = batch, seq, cfg.embed
    ffn = 2 * b * s * cfg.mlp * e * (3 if cfg.gated else 2)
    qkv = 2 * b * s * e * (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    proj = 2 * b * s * e * cfg.heads * cfg.head_dim
    attn = 4 * b * s * s * cfg.heads * cfg.head_dim
    emb = 2 * b * s * e * cfg.vocab
    return 3 * ((ffn + qkv + proj) * cfg.layers + emb) + 3 * attn * cfg.layers


FSDP_TP: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("activation_embed", "tensor"),
    ("kv", None),
    ("length", None),
    ("layer", None),
)


def _maxtext(
    name: str,
    profile: str,
    scale: int,
    chips: int,
    pdb: int,
    tflops_chip: float,
    remat: str,
    source: str,
    *,
    slices: int = 1,
    tensor: int = 1,
    held_out: bool = False,
) -> Row:
    cfg = maxtext_config(scale, remat=remat)
    devices = chips * slices
    batch, seq = pdb * devices, 2048
    flops = _maxtext_flops(cfg, batch, seq) / devices
    mesh = {"data": slices, "fsdp": chips // tensor, "tensor": tensor}
    mesh = {a: n for a, n in mesh.items() if n > 1}
    how = f"MaxText model FLOPs per chip / {tflops_chip:g} TFLOP/s per chip"
    return Row(
        name,
        profile,
        cfg,
        batch,
        seq,
        mesh,
        FSDP_TP,
        flops / (tflops_chip * 1e12),
        how,
        source,
        held_out,
    )


def _mpt(
    name: str,
    profile: str,
    d: int,
    heads: int,
    layers: int,
    gpus: int,
    micro: int,
    seq: int,
    tokens_s_gpu: float,
    ckpt: bool,
    *,
    held_out: bool = False,
) -> Row:
    cfg = LlamaConfig(
        embed=d,
        heads=heads,
        kv_heads=heads,
        head_dim=d // heads,
        mlp=4 * d,
        layers=layers,
        vocab=50368,
        gated=False,
        remat="full_block" if ckpt else "none",  # torch's checkpoint reruns the block whole
        scan=False,
    )
    how = f"{micro} x {seq} tokens per GPU / {tokens_s_gpu:g} tokens/s/GPU (one microbatch)"
    return Row(
        name,
        profile,
        cfg,
        micro * gpus,
        seq,
        {"fsdp": gpus},
        FSDP_TP,
        micro * seq / tokens_s_gpu,
        how,
        FOUNDRY,
        held_out,
    )


LLAMA2_7B = LlamaConfig(
    embed=4096, heads=32, kv_heads=32, head_dim=128, mlp=11008, layers=32, vocab=32000
)
LLAMA2_70B = LlamaConfig(
    embed=8192, heads=64, kv_heads=8, head_dim=128, mlp=28672, layers=80, vocab=32000
)


def _megatron(
    params_b: float,
    heads: int,
    hidden: int,
    layers: int,
    tensor: int,
    gpus: int,
    batch: int,
    tflops_gpu: float,
    micro: int,
    *,
    held_out: bool = False,
) -> Row:
    """A GPT of Megatron-LM's Table 1 (2021) on DGX A100 80GB: tensor parallelism within a
    host, data parallelism across hosts (gradients all-reduced once per step), full
    activation recomputation, unfused attention, sequence 2048, vocabulary 51,200; the
    published throughput counts the recomputation: ``96 B s l h^2 (1 + s/6h + V/16lh)``
    FLOPs per step (their eq. 3). The microbatch is not in the table: ``micro`` sequences."""
    seq, vocab = 2048, 51200
    cfg = LlamaConfig(
        embed=hidden,
        heads=heads,
        kv_heads=heads,
        head_dim=hidden // heads,
        mlp=4 * hidden,
        layers=layers,
        vocab=vocab,
        gated=False,
        remat="full_block",  # Megatron-LM reruns each layer's forward whole
        scan=False,
    )
    flops = (
        96
        * batch
        * seq
        * layers
        * hidden**2
        * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))
    )
    data = gpus // tensor
    mesh = {"data": data, "tensor": tensor} if tensor > 1 else {"data": data}
    rules = tuple((n, None if n == "activation_embed" else a) for n, a in FSDP_TP)
    how = f"eq. 3 FLOPs ({batch} x {seq} tokens) / ({tflops_gpu:g} TFLOP/s x {gpus} GPUs)"
    return Row(
        f"Megatron-LM {params_b:g}B {gpus}x A100",
        "a100",
        cfg,
        micro * data,
        seq,
        mesh,
        rules,
        flops / (tflops_gpu * 1e12 * gpus),
        how,
        MEGATRON,
        held_out,
        flash=False,
        microbatches=batch // (micro * data),
    )


def _a3(name: str, hosts: int, tflops_chip: float, held_out: bool = True) -> Row:
    """MaxText's Llama2-7B on ``hosts`` A3 hosts of 8 H100s: per-device batch 4, sequence
    4096, FSDP over a host's 8 GPUs, data parallel across hosts, ``remat_policy=
    minimal_flash`` (every matmul without batch dimensions saved), layers not scanned."""
    cfg = dataclasses.replace(LLAMA2_7B, remat="minimal", scan=False)
    gpus, seq = 8 * hosts, 4096
    batch = 4 * gpus
    mesh = {"data": hosts, "fsdp": 8} if hosts > 1 else {"fsdp": 8}
    flops = _maxtext_flops(cfg, batch, seq) / gpus
    how = f"MaxText model FLOPs per GPU / {tflops_chip:g} TFLOP/s per GPU"
    return Row(
        name,
        "h100_a3",
        cfg,
        batch,
        seq,
        mesh,
        FSDP_TP,
        flops / (tflops_chip * 1e12),
        how,
        MAXTEXT_A3,
        held_out=held_out,
    )


def rows() -> list[Row]:
    """The published configurations (module docstring)."""
    v5e, v5p = "tpu_v5e", "tpu_v5p"
    out = [
        _maxtext("MaxText 16B v5e-256", v5e, 16, 256, 6, 120, "full", MAXTEXT_V5E),
        _maxtext("MaxText 32B v5e-256", v5e, 32, 256, 4, 132, "full", MAXTEXT_V5E),
        _maxtext("MaxText 64B v5e-256", v5e, 64, 256, 2, 118, "full", MAXTEXT_V5E, held_out=True),
        _maxtext("MaxText 16B 2x v5e-256", v5e, 16, 256, 6, 117, "full", MAXTEXT_V5E, slices=2),
        _maxtext(
            "MaxText 32B 4x v5e-256",
            v5e,
            32,
            256,
            4,
            126,
            "full",
            MAXTEXT_V5E,
            slices=4,
            held_out=True,
        ),
        _maxtext("MaxText 32B v5p-128", v5p, 32, 64, 7, 328, "minimal", MAXTEXT_V5P, tensor=4),
        _maxtext("MaxText 64B v5p-128", v5p, 64, 64, 3, 323, "minimal", MAXTEXT_V5P, tensor=4),
        _maxtext(
            "MaxText 128B v5p-256",
            v5p,
            128,
            128,
            1,
            315,
            "minimal",
            MAXTEXT_V5P,
            tensor=8,
            held_out=True,
        ),
        _mpt("llm-foundry MPT-7B 8x H100", "h100", 4096, 32, 32, 8, 6, 2048, 10643, False),
        _mpt("llm-foundry MPT-13B 8x H100", "h100", 5120, 40, 40, 8, 2, 2048, 4792, False),
        _mpt(
            "llm-foundry MPT-30B 32x H100",
            "h100",
            7168,
            64,
            48,
            32,
            14,
            2048,
            2308,
            True,
            held_out=True,
        ),
        _mpt("llm-foundry MPT-13B 8x A100", "a100", 5120, 40, 40, 8, 2, 2048, 2262, False),
        _mpt(
            "llm-foundry MPT-30B 8x A100",
            "a100",
            7168,
            64,
            48,
            8,
            3,
            2048,
            916,
            True,
            held_out=True,
        ),
        # v6e: the recipe's logged step; per-device batch 4, sequence 4096, FSDP over 256 chips
        # (ici_fsdp_transpose_parallelism=-1), remat_policy=full, flash attention.
        Row(
            "MaxText Llama2-70B v6e-256",
            "tpu_v6e",
            dataclasses.replace(LLAMA2_70B, remat="full"),
            4 * 256,
            4096,
            {"fsdp": 256},
            FSDP_TP,
            17.373,
            "the recipe's logged step time",
            TPU_RECIPES_V6E,
        ),  # calibrates the v6e profile's matmul efficiency
        _a3("MaxText Llama2-7B 8x H100 (1 A3)", 1, 492),
        _a3("MaxText Llama2-7B 64x H100 (8 A3)", 8, 409),
        # New sources: the same MaxText table's other host counts (the scale), and
        # Megatron-LM's paper (A100, tensor + data parallelism, unfused attention).
        _a3("MaxText Llama2-7B 16x H100 (2 A3)", 2, 422, held_out=False),
        _a3("MaxText Llama2-7B 32x H100 (4 A3)", 4, 407),
        _a3("MaxText Llama2-7B 128x H100 (16 A3)", 16, 375, held_out=False),
        _megatron(1.7, 24, 2304, 24, 1, 32, 512, 137, 4),
        _megatron(3.6, 32, 3072, 30, 2, 64, 512, 138, 4, held_out=True),
        _megatron(7.5, 32, 4096, 36, 4, 128, 512, 142, 4),
        _megatron(18.4, 48, 6144, 40, 8, 256, 1024, 135, 4, held_out=True),
    ]
    # PaLM's remat: its 57.8% hardware FLOPs utilisation over its 46.2% MFU is 1.25x the
    # model FLOPs recomputed, what rematerialising every layer's forward costs here (1.25x).
    palm = LlamaConfig(
        embed=18432,
        heads=48,
        kv_heads=1,
        head_dim=256,
        mlp=73728,
        layers=118,
        vocab=256000,
        parallel=True,
        remat="full",
    )
    tokens = 2048 * 2048
    flops_token = 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    palm_s = tokens * flops_token / (0.462 * 275e12 * 6144)
    # Multi-query attention: one key/value head, which 12-way model parallelism cannot
    # split (the validator rejects kv_heads=tensor on a dimension of size 1): every model
    # shard computes the shared keys and values, heads and the MLP are split.
    palm_rules = tuple((n, None if n == "kv_heads" else a) for n, a in FSDP_TP)
    out.append(
        Row(
            "PaLM 540B 2x TPU v4 pod (6144 chips)",
            "tpu_v4",
            palm,
            2048,
            2048,
            {"data": 2, "fsdp": 256, "tensor": 12},
            palm_rules,
            palm_s,
            "tokens x (6N + 12LHQT) / (46.2% x 275 TFLOP/s x 6144)",
            PALM,
        )
    )
    return out


def row_profile(row: Row) -> meshplan.HardwareProfile:
    """The row's hardware profile, with fused (flash) attention where its framework ran a kernel
    (``attention='flash'``: the model traced here writes attention as matmuls)."""
    return with_attention(get_profile(row.profile), "flash" if row.flash else "xla")


def run_row(row: Row, search: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    state, step, batch = llama_step(row.cfg, row.batch, row.seq)
    work = trace_workload(step, state, batch, read_constraints=True)
    trace_s = time.perf_counter() - t0
    prof = row_profile(row)
    cost = predict(work, row.mesh, row.rules, prof, microbatches=row.microbatches)
    out: dict[str, Any] = {
        "name": row.name,
        "profile": row.profile,
        "held_out": row.held_out,
        "mesh": row.mesh,
        "params": row.cfg.params(),
        "published_s": row.published_s,
        "predicted_s": cost.step_s,
        "error": cost.step_s / row.published_s - 1,
        "memory_bytes": cost.memory_bytes,
        "budget_bytes": prof.memory_bytes,
        "fits": cost.memory_bytes <= prof.memory_bytes,
        "cost": cost.to_dict(),
        "trace_s": trace_s,
        "source": row.source,
        "how": row.how,
    }
    if search:
        t0 = time.perf_counter()
        devices = 1
        for n in row.mesh.values():
            devices *= n
        result = meshplan.search_rules(
            devices, workload=work, profile=prof, compile_top=0, microbatches=row.microbatches
        )
        out["search_s"] = time.perf_counter() - t0
        best = result.best
        if best is not None and best.cost is not None:
            out["top1"] = f"{best.mesh_text} {best.axes_text} {best.short_rules}"
            out["top1_vs_published"] = best.cost.step_s / cost.step_s
            out["top1_fits"] = best.cost.memory_bytes <= prof.memory_bytes
        else:
            out["top1"], out["top1_vs_published"], out["top1_fits"] = None, None, False
    return out


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=None, help="only the first N rows")
    parser.add_argument("--only", default=None, help="only the rows whose name starts so")
    parser.add_argument("--no-search", action="store_true", help="skip the search per row")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="only the pipelined runs (benchmarks/published_pipeline.py)",
    )
    args = parser.parse_args(argv)
    if args.pipeline:  # their own section: published_pipeline.py
        from published_pipeline import main as pipeline_main

        pipeline_main()
        return 0
    print(f"meshplan {meshplan.__version__}, jax {jax.__version__}; traced abstractly, no devices")
    head = (
        f"{'configuration':<38} {'pub s':>7} {'pred s':>7} {'err':>6} {'mem GiB':>8} "
        f"{'fits':>4}  {'top-1 vs pub':>12} {'fits':>4} {'search s':>8}  top-1"
    )
    print(head)
    results = []
    chosen = [r for r in rows() if args.only is None or r.name.startswith(args.only)]
    for row in chosen[: args.rows]:
        r = run_row(row, not args.no_search)
        results.append(r)
        mem = f"{_gib(r['memory_bytes'])}/{_gib(r['budget_bytes'])}"
        top = "-" if r.get("top1_vs_published") is None else f"{r['top1_vs_published']:.2f}"
        name = row.name + (" *" if row.held_out else "")
        print(
            f"{name:<38} {r['published_s']:>7.2f} {r['predicted_s']:>7.2f} "
            f"{r['error']:>+6.0%} {mem:>8} {'yes' if r['fits'] else 'NO':>4}  {top:>12} "
            f"{'yes' if r.get('top1_fits') else '-':>4} {r.get('search_s', 0):>8.1f}  "
            f"{r.get('top1') or '-'}",
            flush=True,
        )
    for label, group in (
        ("calibration", [r for r in results if not r["held_out"]]),
        ("held out (*)", [r for r in results if r["held_out"]]),
        ("all", results),
    ):
        if not group:
            continue
        errs = [abs(r["error"]) for r in group]
        within = sum(e <= 0.25 for e in errs)
        print(
            f"{label}: {len(group)} rows, median |error| {statistics.median(errs):.1%}, "
            f"worst {max(errs):.1%}, within 25%: {within}/{len(group)}, published layout fits: "
            f"{sum(r['fits'] for r in group)}/{len(group)}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
