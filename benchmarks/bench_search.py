"""How well ``meshplan.search_rules`` predicts: every candidate that fits, measured, on 8 devices.

For each model (the guide's MLP, the Transformer ``tiny`` and ``small``), one at a time:

1. the search (``profile='cpu'``, calibrated here; ``compile_top`` compiled), timed;
2. the ground truth: EVERY candidate that passed (or the first ``--limit`` by
   prediction plus an even spread of the rest, when capped), compiled and run in
   chunks of ``--chunk`` (compiled executables are large), interleaved round by
   round within a chunk (``--rounds`` turns of ``--turn`` steps, the first step of
   a turn dropped: it pays for switching programs), the median per candidate; a
   data-parallel candidate runs in every chunk as the reference that cancels the
   machine's drift between chunks; the noise is the median relative spread (IQR /
   median) of a candidate's steps, the drift the range of the reference's medians;
3. the figures, with targets: Spearman rank correlation of predicted vs measured
   (>= 0.8); top-1 measured / best measured (<= 1.05); top-1 measured / best
   built-in measured (<= 1.0, 1.05 with noise); search wall time (< 60 s);
   compiled / enumerated (<= 10%);
4. the search again with ``measure=True``: the first few by prediction (at most 10,
   and within 10% of the candidates compiled) run, the fastest kept, and the same
   figures for its choice.

    .venv/bin/python benchmarks/bench_search.py --models mlp          # one model at a time
    .venv/bin/python benchmarks/bench_search.py --models small --limit 48

It ends with the 1B-parameter Transformer planned only (no arrays) under the
``h100`` and ``tpu_v5e`` profiles (``--plan-1b``).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import functools
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import meshplan
from meshplan._search.measure.hlo import collective_bytes
from meshplan._search.measure.timing import prepare_step
from meshplan.models.mlp import LogicalMLP, init_fn
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
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
    samples, bytes_err, drift = measure_all(step, state, batch, chosen, args)
    measure_all_s = time.perf_counter() - t1
    measured = [statistics.median(s) for s in samples]
    noise = statistics.median(
        (statistics.quantiles(s, n=4)[2] - statistics.quantiles(s, n=4)[0]) / statistics.median(s)
        for s in samples
    )
    predicted = [r.predicted_s or 0.0 for r in chosen]
    rho = spearman(predicted, measured)
    best = min(measured)
    top1 = measured[0]
    builtin = min(m for r, m in zip(chosen, measured, strict=True) if r.layout != "searched")
    top1_row = chosen[0]
    best_row = chosen[measured.index(best)]
    # The search with measure=True: the first measure_top by prediction run, the fastest kept;
    # by default as many as keep compiles within 10% of the candidates (at most 10).
    enumerated = result.counts["enumerated"]
    measure_top = args.measure_top or max(1, min(10, enumerated // 10 - args.compile_top))
    t2 = time.perf_counter()
    timed = meshplan.search_rules(
        8,
        state,
        step,
        batch,
        profile="cpu",
        compile_top=args.compile_top,
        measure=True,
        measure_top=measure_top,
        measure_steps=args.rounds,
    )
    measure_s = time.perf_counter() - t2
    pick = timed.best
    assert pick is not None
    same = [
        m
        for r, m in zip(chosen, measured, strict=True)
        if (r.mesh, r.rules) == (pick.mesh, pick.rules)
    ]
    picked = same[0] if same else (pick.measured_s or math.nan)
    print(
        f"{name}: measured {len(chosen)} of {len(ok)} ok (compiled and run in {measure_all_s:.0f} s, chunk drift {100 * drift:.1f}%); "
        f"top-1 {top1_row.mesh_text} {top1_row.short_rules} {top1 * 1e3:.1f} ms; "
        f"best measured {best_row.mesh_text} {best_row.short_rules} {best * 1e3:.1f} ms",
        flush=True,
    )
    print(
        f"{name}: predicted collective bytes off the timed programs' HLO by "
        f"{100 * statistics.median(bytes_err or [0]):.1f}% (median of {len(bytes_err)})",
        flush=True,
    )
    return {
        "model": name,
        "enumerated": result.counts["enumerated"],
        "ok": len(ok),
        "measured": len(chosen),
        "spearman": rho,
        "top1_best": top1 / best,
        "top1_builtin": top1 / builtin,
        "search_s": search_s,
        "compiled_frac": result.counts["compiled"] / result.counts["enumerated"],
        "noise": noise,
        "measured_best": picked / best,
        "measured_builtin": picked / builtin,
        "measure_s": measure_s,
        "measure_top": measure_top,
        "measured_frac": (timed.counts["compiled"] + timed.counts["measured"])
        / timed.counts["enumerated"],
    }


def measure_all(
    step: Any, state: Any, batch: Any, chosen: list[Any], args: argparse.Namespace
) -> tuple[list[list[float]], list[float], float]:
    """Every chosen candidate's step times, and its predicted collective bytes' error.

    Compiled executables are large on the CPU (all of the tiny Transformer's 176 at once
    exhaust 24 GiB), so candidates run in chunks of ``--chunk``, interleaved round by round
    within a chunk. A data-parallel candidate runs in every chunk as the reference:
    each chunk's times are scaled by the reference's overall median over its median in
    that chunk, so that drift in the machine's speed between chunks cancels out. Returns
    the samples, the relative errors of the predicted collective bytes against the HLO of
    the programs timed, and the drift (the range of the reference's chunk medians over
    their median).
    """
    # The reference: data parallelism's step has one reduction at its end, so its time
    # follows the machine's speed, not the scheduling of collectives mid-step.
    r0 = next((i for i, r in enumerate(chosen) if r.layout == "data_parallel"), 0)
    others = [i for i in range(len(chosen)) if i != r0]
    per = max(1, args.chunk - 1)
    chunks = [others[i : i + per] for i in range(0, len(others), per)] or [[]]
    samples: list[list[float]] = [[] for _ in chosen]
    ref_by_chunk: list[list[float]] = []
    errors: list[float] = []
    for c, chunk in enumerate(chunks):
        idx = [r0, *chunk]
        prepared = [prepare_step(step, state, batch, chosen[i].mesh, chosen[i].rules) for i in idx]
        for n, (i, p) in enumerate(zip(idx, prepared, strict=True)):
            cost = chosen[i].cost
            hlo = sum(collective_bytes(p.compiled.as_text()).values())
            if hlo and cost is not None and (n or not c):
                errors.append(abs(sum(cost.comm_bytes.values()) / hlo - 1))
        times: list[list[float]] = [[] for _ in idx]
        for _ in range(args.rounds):
            for n, p in enumerate(prepared):
                # A turn of --turn steps, the first dropped: it pays for switching programs.
                times[n] += p.run(args.turn)[1:]
        ref_by_chunk.append(times[0])
        for n, i in enumerate(chunk, 1):
            samples[i] = times[n]
        del prepared, p
        print(f"  chunk {c + 1}/{len(chunks)}: {len(idx)} candidates", flush=True)
    overall = statistics.median(t for ts in ref_by_chunk for t in ts)
    medians = [statistics.median(ts) for ts in ref_by_chunk]
    for c, chunk in enumerate(chunks):
        for i in chunk:
            samples[i] = [t * overall / medians[c] for t in samples[i]]
    samples[r0] = [t for ts in ref_by_chunk for t in ts]
    drift = (max(medians) - min(medians)) / statistics.median(medians)
    return samples, errors, drift


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
        if b is None or b.cost is None:  # every candidate over the budget: say by how much
            priced = [x for x in r.rows if x.cost is not None]
            least = min(priced, key=lambda x: x.cost.memory_bytes) if priced else None
            print(
                f"{profile} x{devices}: no layout fits {r.budget_bytes / 2**30:.2f} GiB/device "
                f"({r.counts['pruned']['memory']} over it); the least memory: "
                + (
                    f"{least.mesh_text} ({least.axes_text}) {least.short_rules}, "
                    f"{least.cost.memory_bytes / 2**30:.2f} GiB/device"
                    if least
                    else "none priced"
                )
                + f"; search {r.seconds:.1f} s"
            )
            continue
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
    parser.add_argument(
        "--models", default=None, help="default: mlp,tiny,small; none with --plan-1b alone"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--limit", type=int, default=0, help="measure at most this many")
    parser.add_argument("--compile-top", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=24, help="candidates compiled at once")
    parser.add_argument(
        "--turn", type=int, default=3, help="steps per candidate per round, the first dropped"
    )
    parser.add_argument(
        "--measure-top",
        type=int,
        default=0,
        help="the search's measure_top (default: 10, or fewer to compile at most 10%%)",
    )
    parser.add_argument("--plan-1b", action="store_true")
    args = parser.parse_args()
    cases = {
        "mlp": mlp,
        "tiny": lambda: transformer("tiny"),
        "small": lambda: transformer("small", 16),
    }
    if args.models is None:
        args.models = "" if args.plan_1b else "mlp,tiny,small"
    rows = []
    for name in args.models.split(","):
        if name:
            rows.append(bench(name, cases[name](), args))
    if rows:
        print(
            "\n| model | enumerated | ok | measured | Spearman | top-1/best | "
            "top-1/best built-in | search s | compiled/enumerated | noise |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['enumerated']} | {r['ok']} | {r['measured']} | "
                f"{r['spearman']:.2f} | {r['top1_best']:.3f} | {r['top1_builtin']:.3f} | "
                f"{r['search_s']:.1f} | {100 * r['compiled_frac']:.1f}% | {100 * r['noise']:.1f}% |"
            )
        print("\nWith measure=True (the first few by prediction run, the fastest kept):")
        print(
            "\n| model | measured | top-1/best | top-1/best built-in | search s | compiled/enumerated |"
        )
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['model']} | {r['measure_top']} | {r['measured_best']:.3f} | {r['measured_builtin']:.3f} | "
                f"{r['measure_s']:.1f} | {100 * r['measured_frac']:.1f}% |"
            )
    if args.plan_1b:
        plan_1b()


if __name__ == "__main__":
    main()
