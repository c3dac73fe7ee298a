"""Published training runs that use pipeline parallelism, against meshplan's pipeline pricing.

Each row is a configuration its authors published with its measured speed, with tensor,
pipeline and data parallelism (Megatron-LM's 3-D layout). The step of the same model is
traced once, abstractly, without a pipeline, and priced by
:func:`meshplan._search.predict.pipeline.predict_pipeline`: one stage's devices (tensor x data)
priced by the planner, the layers split over the ``pipeline`` axis, the schedule's bubble,
the sends of activations and their gradients between stages (over InfiniBand: a stage's
8 GPUs are one host) and the data-parallel reduction of each stage's gradients. The
profiles' physical parameters are the ones every other row uses; nothing is fitted here.

Published step time: the source's own seconds per iteration where it gives them (BLOOM's
training log, MT-NLG's paper), else its model FLOPs per step (Megatron-LM's count, which
includes the recomputed forward of full activation recomputation:
``96 B s l h^2 (1 + s / 6h + V / 16 l h)``) over its achieved FLOP/s per GPU and the GPUs.
The count reproduces both published times (104.70 s from BLOOM's 149.77 TFLOP/s, 59.97 s
from MT-NLG's 126 against 60.1 s).

Run: ``.venv/bin/python benchmarks/published_pipeline.py`` (or ``bench_published.py
--pipeline``, which prints these rows after its own).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from meshplan._search.predict.pipeline import predict_pipeline
from meshplan._search.predict.profiles import get_profile, with_attention
from meshplan._search.predict.trace import trace_workload
from meshplan.models.llama import LlamaConfig, llama_step

MEGATRON = (
    "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM, arXiv:2104.04473, Table 1 (A100 80GB, Selene; seq 2048, vocab 51200); "
    "the 1T row's 163 TFLOP/s per GPU is the abstract's 502 petaFLOP/s on 3072 GPUs"
)
BLOOM = (
    "BigScience, tr11-176B-ml training README and slurm script (github.com/bigscience-workshop/"
    "bigscience, train/tr11-176B-ml: 48 nodes of 8 A100 80GB, TP 4 x PP 12 x DP 8, micro "
    "batch 2, global batch 2048, seq 2048, 70 layers, hidden 14336, 112 heads, vocab padded to "
    "250880; log at iteration 85376: 104.70 s per iteration, 149.77 TFLOP/s) and "
    "arXiv:2211.05100 sec. 3"
)
MTNLG = (
    "Smith et al. 2022, Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B, "
    "arXiv:2201.11990 sec. 2.4: 280 DGX A100 (2240 GPUs), TP 8 x PP 35 x DP 8, batch 1920, "
    "60.1 s per iteration, 126 TFLOP/s per GPU (105 layers, hidden 20480, 128 heads)"
)

RULES: tuple[tuple[str, Any], ...] = (
    ("batch", "data"),
    ("stage", "pipeline"),
    ("layer", "pipeline"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("activation_embed", "tensor"),
    ("embed", None),
    ("kv", None),
    ("length", None),
)
"""Megatron-LM's 3-D layout: tensor parallel within a host, the pipeline and data
parallelism across hosts, no sharded optimizer state (2021)."""


@dataclasses.dataclass(frozen=True)
class PipelineRow:
    """One published pipelined run: its model, layout, schedule and speed."""

    name: str
    cfg: LlamaConfig
    batch: int
    seq: int
    tensor: int
    pipeline: int
    gpus: int
    micro: int
    tflops_gpu: float
    source: str
    held_out: bool = False
    iteration_s: float | None = None
    """The source's own seconds per iteration, where it gives them."""

    @property
    def data(self) -> int:
        return self.gpus // (self.tensor * self.pipeline)

    @property
    def microbatches(self) -> int:
        return self.batch // (self.data * self.micro)

    @property
    def mesh(self) -> dict[str, int]:
        return {"pipeline": self.pipeline, "data": self.data, "tensor": self.tensor}

    @property
    def published_s(self) -> float:
        if self.iteration_s is not None:
            return self.iteration_s
        c, b, s = self.cfg, self.batch, self.seq
        h, layers, v = c.embed, c.layers, c.vocab
        flops = 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
        return flops / (self.tflops_gpu * 1e12 * self.gpus)


def _gpt(h: int, heads: int, layers: int, vocab: int = 51200) -> LlamaConfig:
    return LlamaConfig(
        embed=h,
        heads=heads,
        kv_heads=heads,
        head_dim=h // heads,
        mlp=4 * h,
        layers=layers,
        vocab=vocab,
        gated=False,
        remat="full_block",  # Megatron-LM and DeepSpeed rerun each layer's forward whole
    )


def pipeline_rows() -> list[PipelineRow]:
    """The published pipelined configurations (module docstring)."""
    return [
        PipelineRow(
            "Megatron-LM 39.1B (PP 2)",
            _gpt(8192, 64, 48),
            1536,
            2048,
            8,
            2,
            512,
            1,
            138,
            MEGATRON,
            held_out=True,
        ),
        PipelineRow(
            "Megatron-LM 145.6B (PP 8)",
            _gpt(12288, 96, 80),
            2304,
            2048,
            8,
            8,
            1536,
            1,
            148,
            MEGATRON,
        ),
        PipelineRow(
            "Megatron-LM 310.1B (PP 16)",
            _gpt(16384, 128, 96),
            2160,
            2048,
            8,
            16,
            1920,
            1,
            155,
            MEGATRON,
        ),
        PipelineRow(
            "Megatron-LM 1T (PP 64)",
            _gpt(25600, 160, 128),
            3072,
            2048,
            8,
            64,
            3072,
            1,
            163,
            MEGATRON,
            held_out=True,
        ),
        PipelineRow(
            "BLOOM-176B (PP 12)",
            _gpt(14336, 112, 70, vocab=250880),
            2048,
            2048,
            4,
            12,
            384,
            2,
            149.77,
            BLOOM,
            iteration_s=104.70,
        ),
        PipelineRow(
            "MT-NLG 530B (PP 35)",
            _gpt(20480, 128, 105),
            1920,
            2048,
            8,
            35,
            2240,
            1,
            126,
            MTNLG,
            held_out=True,
            iteration_s=60.1,
        ),
    ]


def run_pipeline_row(row: PipelineRow) -> dict[str, Any]:
    """The row priced: predicted against published step time, and whether it fits."""
    t0 = time.perf_counter()
    state, step, batch = llama_step(row.cfg, row.batch, row.seq)
    work = trace_workload(step, state, batch, read_constraints=True)
    prof = with_attention(get_profile("a100"), "flash")  # as priced since these rows came in
    pp = predict_pipeline(
        work, row.mesh, RULES, prof, microbatches=row.microbatches, schedule="1f1b"
    )
    cost = pp.cost
    return {
        "name": row.name,
        "held_out": row.held_out,
        "mesh": row.mesh,
        "microbatches": row.microbatches,
        "bubble": pp.schedule.bubble,
        "published_s": row.published_s,
        "predicted_s": cost.step_s,
        "error": cost.step_s / row.published_s - 1,
        "memory_bytes": cost.memory_bytes,
        "budget_bytes": prof.memory_bytes,
        "fits": cost.memory_bytes <= prof.memory_bytes,
        "send_s": pp.send_s,
        "link": pp.link,
        "block_fraction": pp.block_fraction,
        "source": row.source,
        "seconds": time.perf_counter() - t0,
    }


def main() -> list[dict[str, Any]]:
    print(
        f"{'pipelined configuration':<30} {'mesh p x d x t':>15} {'M':>4} {'bubble':>6} "
        f"{'pub s':>7} {'pred s':>7} {'err':>6} {'mem GiB':>9} {'fits':>4} {'sends s':>7}"
    )
    results = []
    for row in pipeline_rows():
        r = run_pipeline_row(row)
        results.append(r)
        m = row.mesh
        mesh = f"{m['pipeline']}x{m['data']}x{m['tensor']}"
        mem = f"{r['memory_bytes'] / 2**30:.0f}/{r['budget_bytes'] / 2**30:.0f}"
        name = row.name + (" *" if row.held_out else "")
        print(
            f"{name:<30} {mesh:>15} {row.microbatches:>4} {r['bubble']:>6.1%} "
            f"{r['published_s']:>7.2f} {r['predicted_s']:>7.2f} {r['error']:>+6.0%} {mem:>9} "
            f"{'yes' if r['fits'] else 'NO':>4} {r['send_s']:>7.2f}",
            flush=True,
        )
    errs = [abs(r["error"]) for r in results]
    print(
        f"pipeline rows: {len(results)}, median |error| {statistics.median(errs):.1%}, worst "
        f"{max(errs):.1%}, within 25%: {sum(e <= 0.25 for e in errs)}/{len(errs)}, fit: "
        f"{sum(r['fits'] for r in results)}/{len(results)}"
    )
    return results


if __name__ == "__main__":
    main()
