"""How well ``meshplan.search_rules`` predicts: every candidate that fits, measured, on 8 devices.

For each model (the guide's MLP, the Transformer ``tiny`` and ``small``), one at a time:

1. the search (``profile='cpu'``, calibrated here; ``compile_top`` compiled), timed;
2. the ground truth: EVERY candidate that passed (or the first ``--limit`` by
   prediction plus an even spread of the rest, when capped), compiled and run,
   interleaved round by round (``--rounds`` rounds of one step each), the median
   per candidate; the noise is the median relative spread (IQR / median);
3. the figures, with targets: Spearman rank correlation of predicted vs measured
   (>= 0.8); top-1 measured / best measured (<= 1.05); top-1 measured / best
   built-in measured (<= 1.0, 1.05 with noise); search wall time (< 60 s);
   compiled / enumerated (<= 10%).

    .venv/bin/python benchmarks/bench_search.py --models mlp          # one model at a time
    .venv/bin/python benchmarks/bench_search.py --models tiny --limit 60

It ends with the 1B-parameter Transformer planned only (no arrays) under the
``h100`` and ``tpu_v5e`` profiles (``--plan-1b``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import functools
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import meshplan
from meshplan._search.hlo import collective_bytes
from meshplan._search.timing import prepare_step
from meshplan.examples.mlp import LogicalMLP, init_fn
from meshplan.examples.transformer import Transformer, config_from_name, loss_fn
from meshplan.train.settings import TrainSettings
from meshplan.train.state import abstract_train_state


def mlp() -> tuple[Any, Any, Any]:
    model = LogicalMLP(num_layers=4, depth=1024, use_scan=True)
    x = jax.ShapeDtypeStruct((256, 1024), jnp.float32)
    state = jax.eval_shape(
        functools.partial(init_fn, model=model, optimizer=optax.adam(1e-3)), jax.random.key(0), x
    )

    def step(state: Any, x: Any) -> Any:
        grads = jax.grad(lambda p: (state.apply_fn({"params": p}, x) ** 2).mean())(state.params)
        return state.apply_gradients(grads=grads)

    return state, step, x


def transformer(size: str, batch: int = 32, seq: int = 128) -> tuple[Any, Any, Any]:
    model = Transformer(config_from_name(size))
    state = abstract_train_state(model, optax.adam(1e-3), TrainSettings(batch=batch, seq_len=seq))

    def step(state: Any, tokens: Any) -> Any:
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    return state, step, jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)


def ranks(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    va = sum((x - ma) ** 2 for x in ra) ** 0.5
    vb = sum((y - mb) ** 2 for y in rb) ** 0.5
    return cov / (va * vb) if va and vb else float("nan")


def bench(name: str, case: tuple[Any, Any, Any], args: argparse.Namespace) -> dict[str, Any]:
    state, step, batch = case
    t0 = time.perf_counter()
    result = meshplan.search_rules(
        8, state, step, batch, profile="cpu", compile_top=args.compile_top
    )
    search_s = time.perf_counter() - t0
    print(result.table(12), flush=True)
    ok = result.ok
    chosen = ok
    if args.limit and len(ok) > args.limit:
        head = ok[: args.limit // 2]
        rest = ok[args.limit // 2 :]
        step_n = len(rest) / (args.limit - len(head))
        spread = [rest[int(i * step_n)] for i in range(args.limit - len(head))]
        builtins = [r for r in ok if r.layout != "searched" and r not in head and r not in spread]
        chosen = head + spread + builtins
    t1 = time.perf_counter()
    prepared = [prepare_step(step, state, batch, r.mesh, r.rules) for r in chosen]
    compile_s = time.perf_counter() - t1
    samples: list[list[float]] = [[] for _ in chosen]
    for _ in range(args.rounds):
        for i, p in enumerate(prepared):
            samples[i] += p.run(1)
    measured = [statistics.median(s) for s in samples]
    noise = statistics.median(
        (statistics.quantiles(s, n=4)[2] - statistics.quantiles(s, n=4)[0]) / statistics.median(s)
        for s in samples
    )
    predicted = [r.predicted_s or 0.0 for r in chosen]
    rho = spearman(predicted, measured)
    # The model's inputs against the very programs timed: FLOPs per device (XLA's cost
    # analysis) and collective bytes per device (the HLO), the median relative error.
    flops_err, bytes_err = [], []
    for r, p in zip(chosen, prepared, strict=True):
        assert r.cost is not None
        analysis = p.compiled.cost_analysis()
        analysis = analysis[0] if isinstance(analysis, list) else analysis
        if analysis and analysis.get("flops"):
            flops_err.append(abs(r.cost.flops_per_device / analysis["flops"] - 1))
        hlo = sum(collective_bytes(p.compiled.as_text()).values())
        if hlo:
            bytes_err.append(abs(sum(r.cost.comm_bytes.values()) / hlo - 1))
    best = min(measured)
    top1 = measured[0]
    builtin = min(m for r, m in zip(chosen, measured, strict=True) if r.layout != "searched")
    top1_row = chosen[0]
    best_row = chosen[measured.index(best)]
    print(
        f"{name}: measured {len(chosen)} of {len(ok)} ok (compile {compile_s:.0f} s); "
        f"top-1 {top1_row.mesh_text} {top1_row.short_rules} {top1 * 1e3:.1f} ms; "
        f"best measured {best_row.mesh_text} {best_row.short_rules} {best * 1e3:.1f} ms",
        flush=True,
    )
    print(
        f"{name}: the model against the programs timed: matmul FLOPs per device off XLA's "
        f"cost analysis by {100 * statistics.median(flops_err or [0]):.1f}% (median; XLA counts "
        f"elementwise FLOPs too), collective bytes off the HLO's by "
        f"{100 * statistics.median(bytes_err or [0]):.1f}% (median of {len(bytes_err)})",
        flush=True,
    )
    return {
        "model": name, "enumerated": result.counts["enumerated"], "ok": len(ok),
        "measured": len(chosen), "spearman": rho, "top1_best": top1 / best,
        "top1_builtin": top1 / builtin, "search_s": search_s,
        "compiled_frac": result.counts["compiled"] / result.counts["enumerated"],
        "noise": noise,
    }  # fmt: skip


def plan_1b() -> None:
    cfg = config_from_name(
        "small",
        num_layers=16,
        embed_dim=2048,
        num_heads=16,
        mlp_dim=8192,
        vocab_size=32768,
        max_len=2048,
    )
    model = Transformer(cfg)
    batch, seq = 256, 2048
    state = abstract_train_state(model, optax.adam(1e-3), TrainSettings(batch=batch, seq_len=seq))
    n = sum(x.size for x in jax.tree.leaves(state.params))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)

    def step(state: Any, tokens: Any) -> Any:
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    print(f"\n1B config: {n / 1e9:.2f}B parameters, batch {batch} x {seq} tokens")
    for devices, profile in ((64, "h100"), (256, "tpu_v5e")):
        r = meshplan.search_rules(devices, state, step, tokens, profile=profile, compile_top=0)
        b = r.best
        assert b is not None and b.cost is not None
        print(
            f"{profile} x{devices}: {b.mesh_text} ({b.axes_text}) {b.short_rules}"
            f"{'' if b.layout == 'searched' else ' (' + b.layout + ')'}: predicted "
            f"{b.cost.step_s:.3f} s/step, {b.cost.memory_bytes / 2**30:.2f} GiB/device "
            f"(state {b.cost.state_bytes / 2**30:.2f}); search {r.seconds:.1f} s, "
            f"{r.counts['scored']} scored of {r.counts['enumerated']}"
        )
        bi = r.best_builtin()
        if bi is not None and bi.cost is not None:
            print(f"   best built-in: {bi.mesh_text} {bi.layout}: {bi.cost.step_s:.3f} s/step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="mlp,tiny,small")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--limit", type=int, default=0, help="measure at most this many")
    parser.add_argument("--compile-top", type=int, default=3)
    parser.add_argument("--plan-1b", action="store_true")
    args = parser.parse_args()
    cases = {
        "mlp": mlp,
        "tiny": lambda: transformer("tiny"),
        "small": lambda: transformer("small", 16),
    }
    rows = []
    for name in args.models.split(","):
        if name:
            rows.append(bench(name, cases[name](), args))
    if rows:
        print("\n| model | enumerated | ok | measured | Spearman | top-1/best | "
              "top-1/best built-in | search s | compiled/enumerated | noise |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['enumerated']} | {r['ok']} | {r['measured']} | "
                f"{r['spearman']:.2f} | {r['top1_best']:.3f} | {r['top1_builtin']:.3f} | "
                f"{r['search_s']:.1f} | {100 * r['compiled_frac']:.1f}% | {100 * r['noise']:.1f}% |"
            )
    if args.plan_1b:
        plan_1b()


if __name__ == "__main__":
    main()
