"""Do names inferred from the step search as well as the names a person wrote?

For each model, ``meshplan.search_rules(devices, ..., profile=..., compile_top=0)``
(analytic: nothing compiled) runs twice: on the model with its hand-written names
(meshplan's Transformer and Llama examples carry their own; Hugging Face's GPT-2 and
Llama get the path rules of ``tests/unnamed_models.py``, written once by hand), and on
the same model with no names at all, which the search names by
:func:`meshplan.infer_names`. Prints each top-1's predicted step time, mesh and
rules, the ratio inferred/hand (the goal: within 5%), and what ``infer_names`` itself
took (median of ``--repeats``).

    .venv/bin/python benchmarks/bench_infer.py
    .venv/bin/python benchmarks/bench_infer.py --repeats 1
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import meshplan
import unnamed_models as um

MODELS: dict[str, tuple[Callable[[], Any], Any, int, str]] = {
    # name: (build, hand path rules (None: the model's own names), devices, profile)
    "transformer tiny": (lambda: um.transformer("tiny", batch=16, seq=128), None, 8, "h100"),
    "transformer small": (
        lambda: um.transformer("small", batch=256, seq=512),
        None,
        256,
        "tpu_v5e",
    ),
    "llama example (GQA)": (
        lambda: um.llama(
            32, 256, embed=1024, heads=8, kv_heads=4, head_dim=128, mlp=4096, layers=4, vocab=32000
        ),
        None,
        8,
        "h100",
    ),
    "HF FlaxGPT2LMHeadModel": (
        lambda: um.gpt2(768, 12, 2, 50257, 16, 256),
        um.GPT2_NAMES,
        8,
        "h100",
    ),
    "HF FlaxLlamaForCausalLM": (
        lambda: um.hf_llama(1024, 8, 4096, 2, 32000, 16, 256),
        um.LLAMA_NAMES,
        8,
        "h100",
    ),
}


def _both(build: Callable[[], Any], hand: Any) -> tuple[Any, Any, Any, Any, Any, Any]:
    """(unnamed state, its step, tokens, hand-named state, its step, the step to infer on)."""
    state, step, tokens = build()
    if hand is None:  # meshplan's examples: strip their names
        return meshplan.unbox(state), step, tokens, state, step, step

    def plain(s: Any, x: Any) -> Any:
        return step(meshplan.unbox(s), x)

    return state, step, tokens, meshplan.name_by_path(state, hand), plain, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="infer_names runs (default 3)")
    args = parser.parse_args()
    print(
        f"{'model':<24} {'devices':>8}  {'hand top-1':>22}  {'inferred top-1':>22}  ratio"
        f"  infer_names"
    )
    for name, (build, hand, devices, profile) in MODELS.items():
        state, step, tokens, named, named_step, _ = _both(build, hand)
        seconds = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            meshplan.infer_names(step, state, tokens)
            seconds.append(time.perf_counter() - t0)
        top = [
            meshplan.search_rules(devices, s, f, tokens, profile=profile, compile_top=0).best
            for s, f in ((named, named_step), (state, step))
        ]
        cells = [f"{r.cost.step_s * 1e3:8.3f} ms {r.mesh_text:>4} " for r in top]
        ratio = top[1].cost.step_s / top[0].cost.step_s
        print(
            f"{name:<24} {devices:>4} {profile:<7} {cells[0]:>18} {cells[1]:>18}  {ratio:.4f}"
            f"  {statistics.median(seconds):.2f} s",
            flush=True,
        )
        for label, r in zip(("hand", "inferred"), top, strict=True):
            print(f"{'':<24}   {label}: {r.layout} {r.short_rules}")


if __name__ == "__main__":
    main()
