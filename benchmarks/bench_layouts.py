"""What each built-in layout costs: step time, memory and communication, on a 2x4 mesh.

For each rule set of :mod:`meshplan.layouts` (``data_parallel``, ``fsdp``,
``tensor_parallel``, ``fsdp_tp``) this compiles the Transformer's AdamW train
step on an 8-device ``('data', 'model')`` mesh (2x4, emulated CPU devices, as
``meshplan train`` runs it) and measures:

* step time (median of ``--steps`` blocked steps) and tokens per second;
* per-device state memory: the bytes of device 0's shards of params and Adam
  state, ``meshplan.explain``'s largest per-device total (when available), and
  XLA's ``memory_analysis()`` of the compiled step (arguments and temporaries);
* bytes moved by collectives per step and per device: the operand bytes of every
  all-reduce / all-gather / reduce-scatter / all-to-all / collective-permute in
  the compiled HLO, counted once per trip of the ``while`` loop they are in
  (``nn.scan``'s layers);

each also as a ratio to ``data_parallel``, printed as one table. Then it times
compiling the step of the scanned model against the for-loop one at 4, 16 and
64 layers (tiny width, ``fsdp_tp``).

    .venv/bin/python benchmarks/bench_layouts.py              # ~4 minutes on 2 cores
    .venv/bin/python benchmarks/bench_layouts.py --steps 5 --depths 2,4
"""

from __future__ import annotations

import os
import resource

if "MESHPLAN_BENCH_MEMORY_CAP" in os.environ:  # a capped compile child (see below)
    _cap = int(os.environ["MESHPLAN_BENCH_MEMORY_CAP"])
    resource.setrlimit(resource.RLIMIT_AS, (_cap, _cap))

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import meshplan
import meshplan.layouts
from meshplan._search.measure.hlo import collective_bytes
from meshplan.models.data import ByteCorpus, shard_batch
from meshplan.models.transformer import Transformer, config_from_name, loss_fn

LAYOUT_NAMES = ("data_parallel", "fsdp", "tensor_parallel", "fsdp_tp")
MiB = 2**20


# ---------------------------------------------------------------------------
# One layout
# ---------------------------------------------------------------------------


def build_step(model: Transformer, mesh: Mesh, rules: Any, batch: int, seq: int):
    """Abstract state, its shardings and the jitted AdamW train step."""
    tx = optax.adamw(3e-3, b2=0.98, weight_decay=0.01)
    example = np.zeros((batch, seq), np.int32)

    def init() -> Any:
        params = model.init(jax.random.key(0), example)["params"]
        return params, tx.init(params)

    def step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, model)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    abstract = jax.eval_shape(init)
    shardings = meshplan.logical_to_mesh_sharding(
        meshplan.get_partition_spec(abstract), mesh, rules
    )
    tokens_sharding = NamedSharding(mesh, meshplan.logical_to_mesh_axes(("batch", "length"), rules))
    jitted = jax.jit(
        step,
        in_shardings=(shardings, tokens_sharding),
        out_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
        donate_argnums=(0,),
    )
    return init, abstract, shardings, tokens_sharding, jitted


def prepare_layout(name: str, model: Transformer, mesh: Mesh, args: argparse.Namespace) -> dict:
    """Compiles the layout's step and creates its state; everything but the timing."""
    rules = meshplan.layouts.get_layout(name)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        init, abstract, shardings, _, jitted = build_step(model, mesh, rules, args.batch, args.seq)
        tokens_abstract = jax.ShapeDtypeStruct((args.batch, args.seq + 1), np.int32)
        t0 = time.perf_counter()
        compiled = jitted.lower(abstract, tokens_abstract).compile()
        compile_s = time.perf_counter() - t0
        memory = compiled.memory_analysis()
        by_kind = collective_bytes(compiled.as_text())
        comm = sum(by_kind.values())
        state = jax.jit(init, out_shardings=shardings)()
        device0 = mesh.devices.flat[0]
        state_bytes = sum(
            s.data.nbytes
            for a in jax.tree.leaves(state)
            for s in a.addressable_shards
            if s.device == device0
        )
        explain_bytes = None
        if hasattr(meshplan, "explain"):
            explain_bytes = meshplan.explain(abstract, mesh, rules).totals["all"].max_device_bytes
    return {
        "name": name,
        "rules": rules,
        "compiled": compiled,
        "state": state,
        "compile_s": compile_s,
        "state_bytes": state_bytes,
        "explain_bytes": explain_bytes,
        "xla_args": memory.argument_size_in_bytes,
        "xla_temp": memory.temp_size_in_bytes,
        "comm_bytes": comm,
        "comm_kinds": by_kind,
        "times": [],
    }


def time_layouts(
    rows: list[dict], mesh: Mesh, corpus: ByteCorpus, args: argparse.Namespace
) -> None:
    """Steps the layouts in turn, one step each per round, so that a noisy machine
    (other processes on the same cores) slows them all alike; one step in flight."""
    for i in range(args.warmup + args.steps):
        tokens_np = corpus.batch_at("train", i, 0, args.batch, args.seq)
        for row in rows:
            with jax.set_mesh(mesh), meshplan.logical_axis_rules(row["rules"]):
                tokens = shard_batch(tokens_np, mesh, row["rules"])
                t0 = time.perf_counter()
                row["state"], loss = row["compiled"](row["state"], tokens)
                loss.block_until_ready()
                if i >= args.warmup:
                    row["times"].append(time.perf_counter() - t0)
                row["loss"] = float(loss)
    for row in rows:
        row["step_s"] = statistics.median(row["times"])
        row["tokens_per_s"] = args.batch * args.seq / row["step_s"]


# ---------------------------------------------------------------------------
# Compile time, scanned vs for-loop
# ---------------------------------------------------------------------------


def compile_seconds(model: Transformer, mesh: Mesh, rules: Any, batch: int, seq: int) -> float:
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        _, abstract, _, _, jitted = build_step(model, mesh, rules, batch, seq)
        t0 = time.perf_counter()
        jitted.lower(abstract, jax.ShapeDtypeStruct((batch, seq + 1), np.int32)).compile()
        return time.perf_counter() - t0


def compile_in_subprocess(
    depth: int, scan: bool, args: argparse.Namespace
) -> tuple[float | None, float | None, str]:
    """Compiles one depth in a child process capped in time and address space.

    Returns ``(seconds, peak RSS in GiB, note)``; the note says why there is no
    time (``timeout``, ``out of memory``). An unrolled deep model can need many
    GB to compile, so the cap keeps the benchmark from taking a shared machine down.
    """
    cmd = [sys.executable, __file__, "--compile-one", f"{depth},{int(scan)}"]
    cmd += ["--size", args.config, "--batch", str(args.batch), "--seq", str(args.seq)]
    env = dict(os.environ, MESHPLAN_BENCH_MEMORY_CAP=str(int(args.compile_memory_gb * 2**30)))
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, timeout=args.compile_timeout, env=env
        )
    except subprocess.TimeoutExpired:
        return None, None, f"> {args.compile_timeout:.0f} s (stopped)"
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            return result["seconds"], result["rss_gib"], ""
    err = done.stderr
    if any(m in err for m in ("bad_alloc", "RESOURCE_EXHAUSTED", "MemoryError", "Out of memory")):
        return None, None, f"> {args.compile_memory_gb:g} GB (stopped)"
    last = err.strip().splitlines()[-1] if err.strip() else ""
    return None, None, f"failed (exit {done.returncode}): {last[:80]}"


def compile_one(spec: str, args: argparse.Namespace) -> None:
    """The child of :func:`compile_in_subprocess`: prints one JSON line."""
    depth, scan = (int(x) for x in spec.split(","))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    config = config_from_name(args.config, num_layers=depth, scan_layers=bool(scan))
    seconds = compile_seconds(
        Transformer(config), mesh, meshplan.layouts.fsdp_tp, args.batch, args.seq
    )
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps({"seconds": seconds, "rss_gib": rss_gib}), flush=True)


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "n/a"
    return f"{value / base:.2f}x"


def layouts_table(rows: list[dict[str, Any]]) -> str:
    base = rows[0]
    head = (
        "| layout | step ms | tokens/s | state MiB/dev (shards) | explain MiB/dev "
        "| XLA args MiB | XLA temp MiB | collectives MiB/step/dev | kinds |\n"
        "|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        kinds = ", ".join(
            f"{k.replace('collective-', 'c-')} {v / MiB:.1f}"
            for k, v in sorted(r["comm_kinds"].items())
            if v
        )
        explain = "n/a" if r["explain_bytes"] is None else f"{r['explain_bytes'] / MiB:.2f}"
        lines.append(
            f"| {r['name']} "
            f"| {r['step_s'] * 1e3:.0f} ({_ratio(r['step_s'], base['step_s'])}) "
            f"| {r['tokens_per_s']:,.0f} ({_ratio(r['tokens_per_s'], base['tokens_per_s'])}) "
            f"| {r['state_bytes'] / MiB:.2f} ({_ratio(r['state_bytes'], base['state_bytes'])}) "
            f"| {explain} ({_ratio(r['explain_bytes'], base['explain_bytes'])}) "
            f"| {r['xla_args'] / MiB:.2f} ({_ratio(r['xla_args'], base['xla_args'])}) "
            f"| {r['xla_temp'] / MiB:.1f} ({_ratio(r['xla_temp'], base['xla_temp'])}) "
            f"| {r['comm_bytes'] / MiB:.2f} ({_ratio(r['comm_bytes'], base['comm_bytes'])}) "
            f"| {kinds or '-'} |"
        )
    return "\n".join(lines)


def compile_table(results: list[tuple[int, tuple, tuple]]) -> str:
    lines = [
        "| layers | scanned: compile s | peak RSS GiB | for-loop: compile s | peak RSS GiB "
        "| loop / scan |",
        "|---|---|---|---|---|---|",
    ]

    def cells(result: tuple) -> str:
        seconds, rss, note = result
        if seconds is None:
            return f"{note} | -"
        return f"{seconds:.1f} | {rss:.1f}"

    for depth, scan, loop in results:
        ratio = f"{loop[0] / scan[0]:.1f}x" if loop[0] and scan[0] else "-"
        lines.append(f"| {depth} | {cells(scan)} | {cells(loop)} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", dest="config", default="tiny", help="model preset (default tiny)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per step (default 32)")
    parser.add_argument("--seq", type=int, default=128, help="bytes per sequence (default 128)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per layout")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per layout")
    parser.add_argument(
        "--depths", default="4,16,64", help="layer counts for the compile-time comparison"
    )
    parser.add_argument(
        "--compile-timeout", type=float, default=120, help="seconds per compile (default 120)"
    )
    parser.add_argument(
        "--compile-memory-gb",
        type=float,
        default=6,
        help="address-space cap of each compile process in GB (default 6)",
    )
    parser.add_argument("--compile-one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.compile_one:
        compile_one(args.compile_one, args)
        return

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    config = config_from_name(args.config)
    model = Transformer(config)
    corpus = ByteCorpus.from_stdlib(max_bytes=2_000_000)
    print(
        f"jax {jax.__version__}, {jax.device_count()} {jax.devices()[0].platform} devices, "
        f"mesh 2x4 ('data', 'model') Auto; config {args.config} "
        f"({config.num_layers} layers, embed {config.embed_dim}, mlp {config.mlp_dim}, "
        f"{config.num_heads} heads, scan), AdamW, batch {args.batch} x seq {args.seq}, "
        f"median of {args.steps} steps after {args.warmup}",
        flush=True,
    )
    rows = []
    for name in LAYOUT_NAMES:
        rows.append(prepare_layout(name, model, mesh, args))
        print(f"  {name}: compiled in {rows[-1]['compile_s']:.1f}s", flush=True)
    time_layouts(rows, mesh, corpus, args)
    losses = ", ".join(f"{r['name']} {r['loss']:.3f}" for r in rows)
    print(f"  loss after {args.warmup + args.steps} steps (same batches): {losses}")
    print()
    print(layouts_table(rows))
    print()

    depths = [int(d) for d in args.depths.split(",") if d]
    results = []
    for depth in depths:
        scan = compile_in_subprocess(depth, True, args)
        loop = compile_in_subprocess(depth, False, args)
        results.append((depth, scan, loop))
        print(f"  {depth} layers compiled: scanned {scan[:2]}, for-loop {loop[:2]}", flush=True)
    print()
    print(
        f"Compile time of the train step (lower + compile, one process each, capped at "
        f"{args.compile_timeout:.0f} s and {args.compile_memory_gb:g} GB), "
        f"{args.config} width, fsdp_tp, 2x4:"
    )
    print(compile_table(results))


if __name__ == "__main__":
    main()
