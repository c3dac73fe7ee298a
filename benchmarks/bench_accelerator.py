"""The planner against a real accelerator: predicted step time and memory, then measured.

On the machine's first device (a TPU or a GPU that :data:`meshplan.PROFILES`' chips name),
for decoders of a few shapes and remat choices that fit one device (``CASES``): the
prediction of ``meshplan.predict`` with the chip's published profile (one device: no
collectives, so this checks the compute, memory traffic and memory model), then the step
compiled and run (zero state, ``--steps`` steps after two warm-ups, the median) and its
memory read from XLA (``compiled.memory_analysis()``: arguments + temporaries). Prints
measured / predicted per case and the median |error|; a step XLA finds too big for the
device is listed with the prediction's verdict. The decoders write attention with
``jax.nn.dot_product_attention``, which XLA runs as written (no flash kernel): the
prediction prices it so (``attention='xla'``, the default); ``flash ms`` is what a flash
kernel's step would be predicted to take.

    python benchmarks/bench_accelerator.py                # every case
    python benchmarks/bench_accelerator.py --cases 350m-none --steps 5
    python benchmarks/bench_accelerator.py --list

Needs an accelerator (``jax.default_backend() != 'cpu'``); run where meshplan's dependencies
are installed (``PYTHONPATH=src`` will do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import jax

import meshplan
from meshplan._search.measure.timing import prepare_step
from meshplan._search.predict.chips import CHIPS, chip_of
from meshplan.models.llama import LlamaConfig, llama_step

_350M = {"embed": 1024, "heads": 16, "kv_heads": 16, "head_dim": 64, "mlp": 4096, "layers": 16}
_600M = {"embed": 2048, "heads": 16, "kv_heads": 16, "head_dim": 128, "mlp": 5632, "layers": 8}
CASES: dict[str, tuple[dict[str, Any], int, int]] = {
    # name: (LlamaConfig fields beside vocab 32000 and bfloat16, batch, sequence)
    "350m-none": ({**_350M, "remat": "none"}, 4, 2048),
    "350m-full": ({**_350M, "remat": "full"}, 8, 2048),
    "350m-minimal": ({**_350M, "remat": "minimal"}, 8, 2048),
    "350m-unrolled-full": ({**_350M, "remat": "full", "scan": False}, 8, 2048),
    "600m-full": ({**_600M, "remat": "full"}, 4, 2048),
    "600m-dots-gqa": ({**_600M, "kv_heads": 4, "remat": "dots"}, 4, 2048),
}
"""Decoders (``meshplan.models.llama``) that fit one 16 GiB device with AdamW's f32 state."""

RULES = (("batch", "data"),)


def profile_name() -> str:
    """The :data:`~meshplan._search.predict.chips.CHIPS` key of this machine's first device."""
    kind = jax.devices()[0].device_kind
    chip = chip_of(kind)
    if chip is None:
        sys.exit(f"no profile for this device ({kind!r}): add its chip to chips.CHIPS")
    return next(k for k, c in CHIPS.items() if c is chip)


def _heads_major(query: Any, key: Any, value: Any) -> tuple[Any, Any, Any]:
    """``[batch, seq, heads, head_dim]`` to the kernels' ``[batch, heads, seq, head_dim]``,
    grouped keys and values repeated to the query's heads."""
    import jax.numpy as jnp

    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (query, key, value))
    k, v = (jnp.repeat(x, q.shape[1] // x.shape[1], axis=1) for x in (k, v))
    return q, k, v


def _pallas_attention(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """``jax.nn.dot_product_attention``'s causal case as Pallas' TPU flash kernel runs it
    (``[batch, seq, heads, head_dim]`` in and out; grouped keys repeated to the heads)."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    q, k, v = _heads_major(query, key, value)
    b = min(512, q.shape[2])
    blocks = fa.BlockSizes(
        block_q=b, block_k_major=b, block_k=b, block_b=1,
        block_q_major_dkv=b, block_k_major_dkv=b, block_k_dkv=b, block_q_dkv=b,
        block_k_major_dq=b, block_k_dq=b, block_q_dq=b,
    )  # fmt: skip
    out = fa.flash_attention(q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5, block_sizes=blocks)
    return jnp.swapaxes(out, 1, 2)


def _splash_attention(query: Any, key: Any, value: Any, *args: Any, **kw: Any) -> Any:
    """The same as Pallas' splash kernel runs it, with MaxText's default tiles (512: its
    ``sa_block_*`` settings), the one MaxText's TPU attention calls."""
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    q, k, v = _heads_major(query, key, value)
    heads, seq = q.shape[1], q.shape[2]
    b = min(512, seq)
    blocks = sk.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
        block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b,
    )  # fmt: skip
    mask = sm.MultiHeadMask([sm.CausalMask((seq, seq)) for _ in range(heads)])
    kernel = sk.make_splash_mha(
        mask=mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
        interpret=jax.default_backend() == "cpu",
    )  # fmt: skip
    out = jax.vmap(kernel)(q * q.shape[-1] ** -0.5, k, v)
    return jnp.swapaxes(out, 1, 2)


KERNELS = {"flash": _pallas_attention, "splash": _splash_attention}
"""The Pallas TPU attention kernels ``--kernel`` and ``--kernel-only`` run, by name."""

KERNEL_SHAPES = [
    (8, 16, 2048, 64),
    (4, 16, 2048, 128),
    (2, 16, 4096, 128),
    (8, 32, 2048, 128),
    (1, 16, 8192, 128),
    (4, 16, 2048, 256),
]
"""``(batch, heads, seq, head_dim)`` of :func:`kernel_efficiency`'s attention calls."""


def _median_call(f: Any, *args: Any, calls: int = 10) -> float:
    jax.block_until_ready(f(*args))
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_efficiency(peak: float, name: str = "flash") -> None:
    """A Pallas kernel of :data:`KERNELS` alone (causal): the fraction of ``peak`` its
    forward and its forward + backward reach (FLOPs of the blocks on and below the diagonal;
    the backward 2.5 times the forward's), and XLA's attention against it."""
    import jax.numpy as jnp

    attend = KERNELS[name]

    for b, h, s, d in KERNEL_SHAPES:
        keys = jax.random.split(jax.random.PRNGKey(0), 3)
        q, k, v = (jax.random.normal(key, (b, s, h, d), jnp.bfloat16) for key in keys)

        def loss(attend: Any) -> Any:
            return jax.jit(
                jax.grad(lambda *x: attend(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2))
            )

        def xla(*x: Any) -> Any:
            return jax.nn.dot_product_attention(*x, is_causal=True)

        fwd = _median_call(jax.jit(attend), q, k, v)
        both = _median_call(loss(attend), q, k, v)
        try:
            plain = _median_call(loss(xla), q, k, v)
            versus = (
                f"XLA attention fwd+bwd {plain * 1e3:.2f} ms ({plain / both:.2f}x the kernel's)"
            )
        except Exception as e:  # XLA's scores may not fit where the kernel's tiles do
            versus = f"XLA attention: {type(e).__name__}"
        blocks = s // min(512, s)
        causal = 4 * b * h * s * s * d * (blocks + 1) / (2 * blocks)
        print(
            f"{name} b{b} h{h} s{s} d{d}: fwd {fwd * 1e3:.2f} ms = {causal / fwd / peak:.2f} of peak; "
            f"fwd+bwd {both * 1e3:.2f} ms = {3.5 * causal / both / peak:.2f} of peak; " + versus,
            flush=True,
        )


def _prepare(step: Any, state: Any, tokens: Any, mesh: Any, kernel: str | None) -> Any:
    """The step compiled and placed; with ``kernel``, its attention that Pallas kernel."""
    if not kernel:
        return prepare_step(step, state, tokens, mesh, RULES)
    original = jax.nn.dot_product_attention
    jax.nn.dot_product_attention = KERNELS[kernel]
    try:
        return prepare_step(step, state, tokens, mesh, RULES)
    finally:
        jax.nn.dot_product_attention = original


def run_case(
    name: str, profile: str, steps: int, kernel: str | None = None, batch: int | None = None
) -> dict[str, Any]:
    """One case: predicted (attention as written, and as a flash kernel would run it) and
    measured step seconds and memory bytes; a step that does not fit on the device has the
    error XLA gave in ``error`` and no measured figures. ``kernel``: the step runs that
    kernel of :data:`KERNELS` for its attention, against the flash prediction."""
    fields, case_batch, seq = CASES[name]
    batch = batch or case_batch
    cfg = LlamaConfig(vocab=32000, dtype="bfloat16", **fields)
    state, step, tokens = llama_step(cfg, batch, seq)
    mesh = {"data": 1}
    t0 = time.perf_counter()
    work = meshplan.trace_workload(step, state, tokens, read_constraints=True)
    xla = meshplan.predict(workload=work, mesh=mesh, rules=RULES, profile=profile)
    flash = meshplan.predict(
        workload=work, mesh=mesh, rules=RULES, profile=profile, attention="flash"
    )
    pred = flash if kernel else xla
    row: dict[str, Any] = {
        "case": name,
        "params": cfg.params(),
        "batch": batch,
        "seq": seq,
        "predicted_s": pred.step_s,
        "compute_s": pred.cost.compute_s,
        "memory_s": pred.cost.memory_s,
        "kernel": kernel,
        "flash_predicted_s": flash.step_s,
        "predicted_bytes": pred.memory_bytes,
        "flash_predicted_bytes": flash.memory_bytes,
        "budget_bytes": pred.budget_bytes,
        "state_bytes": pred.cost.state_bytes,
        "flops": pred.cost.flops_per_device,
        "predict_seconds": round(time.perf_counter() - t0, 2),
    }
    try:
        prepared = _prepare(step, state, tokens, mesh, kernel)
    except Exception as e:  # XLA's own words: out of memory on the device, say
        row["error"] = f"{type(e).__name__}: {str(e)[:240]}"
        return row
    times = prepared.run(steps + 2)[2:]
    memory = prepared.compiled.memory_analysis()
    row.update(
        measured_s=statistics.median(times),
        fastest_s=min(times),
        xla_bytes=memory.argument_size_in_bytes + memory.temp_size_in_bytes,
        xla_temp_bytes=memory.temp_size_in_bytes,
        xla_flops=(prepared.compiled.cost_analysis() or {}).get("flops"),
    )
    del prepared
    return row


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:6.2f}"


def report(rows: list[dict[str, Any]], profile: str) -> None:
    """The table and the medians: against the prediction of attention as written (the
    default), or as a flash kernel where the step ran one (``--kernel``)."""
    kernel = next((r["kernel"] for r in rows if r.get("kernel")), None)
    stats = jax.devices()[0].memory_stats() or {}
    limit = f" · usable {_gib(stats['bytes_limit'])} GiB" if "bytes_limit" in stats else ""
    how = f"as Pallas' {kernel} kernel (t m/p: against flash ms)" if kernel else "as written (XLA)"
    print(
        f"device: {jax.devices()[0].device_kind} · profile {profile}{limit} · jax {jax.__version__}"
        f" · attention run {how}"
    )
    print(
        f"{'case':20} {'params':>7} {'pred ms':>8} {'flash ms':>8} {'meas ms':>8} "
        f"{'t m/p':>6} {'pred GiB':>8} {'XLA GiB':>8} {'mem x/p':>7}"
    )
    for r in rows:
        head = (
            f"{r['case']:20} {r['params'] / 1e6:6.0f}M {r['predicted_s'] * 1e3:8.1f} "
            f"{r['flash_predicted_s'] * 1e3:8.1f} "
        )
        if "error" in r:
            fits = "fits" if r["predicted_bytes"] <= r["budget_bytes"] else "over"
            print(
                f"{head}{'-':>8} {'-':>6} {_gib(r['predicted_bytes'])} (predicted {fits}; "
                f"XLA: {r['error'][:90]})"
            )
            continue
        print(
            f"{head}{r['measured_s'] * 1e3:8.1f} {r['measured_s'] / r['predicted_s']:6.2f} "
            f"{_gib(r['predicted_bytes'])} {_gib(r['xla_bytes'])} "
            f"{r['xla_bytes'] / r['predicted_bytes']:7.2f}"
        )
    ran = [r for r in rows if "error" not in r]
    if ran:
        t = [abs(r["measured_s"] / r["predicted_s"] - 1) for r in ran]
        m = [abs(r["xla_bytes"] / r["predicted_bytes"] - 1) for r in ran]
        print(
            f"median |error| of {len(ran)} that ran: step time {statistics.median(t):.1%} "
            f"(worst {max(t):.1%}), memory {statistics.median(m):.1%} (worst {max(m):.1%})"
        )
    over = [r for r in rows if "error" in r]
    said = sum(1 for r in over if r["predicted_bytes"] > r["budget_bytes"])
    if over:
        print(f"did not fit on the device: {len(over)}, predicted over the budget: {said}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps per case")
    parser.add_argument("--batch", type=int, help="every case's batch (default: its own)")
    parser.add_argument(
        "--kernel",
        nargs="?",
        const="flash",
        choices=list(KERNELS),
        help="run attention as this Pallas TPU kernel (flash if not named), against the "
        "flash prediction",
    )
    parser.add_argument(
        "--kernel-only",
        nargs="?",
        const="flash",
        choices=list(KERNELS),
        help="time this Pallas TPU kernel alone (KERNEL_SHAPES): its fraction of the peak",
    )
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, (fields, batch, seq) in CASES.items():
            print(name, fields, f"batch {batch}, seq {seq}")
        return 0
    if jax.default_backend() == "cpu":
        sys.exit("bench_accelerator.py needs an accelerator (jax.default_backend() is 'cpu')")
    profile = profile_name()
    if args.kernel_only:
        print(f"device: {jax.devices()[0].device_kind} · jax {jax.__version__}")
        kernel_efficiency(CHIPS[profile].bfloat16, args.kernel_only)
        return 0
    rows = []
    for name in args.cases:
        rows.append(run_case(name, profile, args.steps, args.kernel, args.batch))
        print(json.dumps(rows[-1]), flush=True)
    if rows:
        report(rows, profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
