"""When the search proposes the ``context`` and ``expert`` roles, and why (no devices needed).

For a grid of long-context and mixture-of-experts configurations, the step is traced once
(abstractly) and searched analytically (``meshplan.search_rules`` with a published
accelerator profile, ``compile_top=0``: nothing compiles or runs). Per row: whether the
search's best layout has a ``context`` (or ``expert``) mesh axis, the best layout with that
role and the best without it (predicted step time, memory per device), and why, from
their predictions (:func:`meshplan._search.search.roles.role_verdict`): the term of the step
(exposed communication, compute, memory traffic) by which they differ most, or that
nothing fits without (or with) the role.

Long context: a Llama-style decoder (MaxText's scale 1: 16 layers, width 2048, about
1.2B parameters), 2^20 tokens per step at sequence 2k to 128k. Mixtures of experts: the
``base`` Transformer (10 layers, width 1024, bfloat16) at 64 x 1024 tokens, dense and
with 8 or 64 experts, top-1 or top-2. 64 devices (8 hosts of 8), profile ``h100``,
meshes of at most 2 axes (so each search takes seconds).

Run: ``.venv/bin/python benchmarks/bench_roles.py [--devices 64] [--profile h100]
[--max-axes 2] [--only long|moe] [--text] [--json PATH]`` (a Markdown table; ``--text``:
plain lines with each search's wall time).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import meshplan
from meshplan._search.predict.trace import Workload, trace_workload
from meshplan._search.search.roles import RoleVerdict, role_verdict
from meshplan._text import human_bytes

TOKENS = 2**20
"""Tokens per step of the long-context rows."""


def llama_workload(seq: int) -> Workload:
    from meshplan.models.llama import llama_step, maxtext_config

    state, step, tokens = llama_step(maxtext_config(1), batch=TOKENS // seq, seq=seq)
    return trace_workload(step, state, tokens, read_constraints=True)


def moe_workload(experts: int, top_k: int, batch: int = 64, seq: int = 1024) -> Workload:
    import jax
    import jax.numpy as jnp
    import optax

    from meshplan.models.transformer import Transformer, config_from_name, loss_fn
    from meshplan.train.settings import TrainSettings
    from meshplan.train.state import abstract_train_state

    cfg = config_from_name("base", num_experts=experts, top_k=top_k, dtype="bfloat16", max_len=seq)
    model = Transformer(cfg)
    state = abstract_train_state(model, optax.adam(1e-3), TrainSettings(batch=batch, seq_len=seq))

    def step(state: Any, tokens: Any) -> Any:
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    return trace_workload(step, state, tokens, read_constraints=True)


ROWS: list[tuple[str, str, str, Callable[[], Workload]]] = [
    *(
        (
            "long",
            f"llama 1.2B, seq {s // 1024}k x {TOKENS // s}",
            "context",
            (lambda s=s: llama_workload(s)),
        )
        for s in (2048, 8192, 32768, 131072)
    ),
    ("moe", "base dense", "expert", lambda: moe_workload(0, 1)),
    *(
        ("moe", f"base MoE {e} experts top-{k}", "expert", (lambda e=e, k=k: moe_workload(e, k)))
        for e in (8, 64)
        for k in (1, 2)
    ),
]


def _row_text(v: RoleVerdict, row: Any) -> str:
    if v.kind == "absent" and row is None:
        return "-"
    if row is None or row.cost is None:
        return "none fits"
    mesh = "x".join(f"{a}{s}" for a, s in row.mesh.items() if s > 1) or "1"
    return f"{mesh} {row.cost.step_s * 1e3:.1f} ms {human_bytes(row.cost.memory_bytes)}"


def why(v: RoleVerdict) -> str:
    """The verdict in a line, from its figures: what the role saves and what it costs per
    step (ms, the best with it against the best without), and the collectives that differ
    most; or the memory that does not fit."""
    if not v.terms:
        return v.reason
    saves = [
        f"{k} {-d * 1e3:.1f} ms"
        for k, d in sorted(v.terms.items(), key=lambda kv: kv[1])
        if d < -5e-5
    ]
    costs = [
        f"{k} {d * 1e3:.1f} ms"
        for k, d in sorted(v.terms.items(), key=lambda kv: -kv[1])
        if d > 5e-5
    ]
    line = f"**{v.kind}**: saves {', '.join(saves) or 'nothing'}; costs {', '.join(costs) or 'nothing'}"
    if v.with_row is not None and v.without_row is not None:
        w, n = v.with_row.cost.comm_bytes, v.without_row.cost.comm_bytes
        kinds = sorted(set(w) | set(n), key=lambda k: -abs(w.get(k, 0) - n.get(k, 0)))[:2]
        if w.get("all-to-all") and "all-to-all" not in kinds:
            kinds.append("all-to-all")
        line += "; with/without: " + ", ".join(
            f"{k} {human_bytes(w.get(k, 0))}/{human_bytes(n.get(k, 0))}" for k in kinds
        )
    return line


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=64)
    ap.add_argument("--profile", default="h100")
    ap.add_argument("--max-axes", type=int, default=2)
    ap.add_argument("--only", choices=("long", "moe"))
    ap.add_argument("--text", action="store_true", help="plain lines, not a Markdown table")
    ap.add_argument("--json", help="write the verdicts to this file")
    args = ap.parse_args(argv)
    out: list[dict[str, Any]] = []
    if not args.text:
        print("| configuration | role | proposed | best with it | best without it | why |")
        print("|---|---|---|---|---|---|")
    for group, name, role, build in ROWS:
        if args.only and group != args.only:
            continue
        t0 = time.perf_counter()
        work = build()
        result = meshplan.search_rules(
            args.devices,
            workload=work,
            profile=args.profile,
            compile_top=0,
            max_axes=args.max_axes,
        )
        v = role_verdict(result, role)
        secs = time.perf_counter() - t0
        cells = [
            name,
            role,
            "yes" if v.proposed else "no",
            _row_text(v, v.with_row),
            _row_text(v, v.without_row),
            why(v),
        ]
        if not args.text:
            print("| " + " | ".join(cells) + " |")
        else:
            print("  ".join(cells) + f"  [{secs:.1f} s]")
        sys.stdout.flush()
        out.append({"config": name, "seconds": secs, **v.to_dict()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
