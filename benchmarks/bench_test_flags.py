"""Compile time of a small train step under the test session's XLA flags and XLA's defaults.

The root ``conftest.py`` compiles the suite's programs at LLVM's lowest optimisation level
with XLA's older LLVM fusion emitters. This prints, for each setting, the median over
``--rounds`` fresh processes (interleaved) of compiling a 2-layer NNX Transformer's train
step under fsdp_tp on 8 emulated CPU devices, with the compiled step's temporaries and
collectives, which must not change; and the ratios to XLA's defaults.

    .venv/bin/python benchmarks/bench_test_flags.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "xla defaults": "",
    "-O0": "--xla_backend_optimization_level=0",
    "-O0, llvm fusion emitters (tests)": (
        "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    ),
}

CHILD = """
import collections, json, re, time
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
import meshplan
from meshplan import layouts
from meshplan.models.transformer import config_from_name
from meshplan.models.transformer_nnx import FunctionalTransformer
from meshplan.models.workflow import make_mesh

config = config_from_name("tiny", num_layers=2, embed_dim=32, mlp_dim=64, max_len=32)
model, tx, mesh = FunctionalTransformer(config), optax.adam(1e-2), make_mesh((2, 4))
batch_sharding = NamedSharding(mesh, P("data", None))
batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=batch_sharding)
with jax.set_mesh(mesh), meshplan.logical_axis_rules(layouts.fsdp_tp):
    state = model.abstract_state()
    shardings = meshplan.get_sharding(state, mesh)
    opt_shardings = meshplan.get_sharding(jax.eval_shape(tx.init, state), mesh)

    def step(state, opt_state, batch):
        loss, grads = jax.value_and_grad(model.loss)(state, batch)
        updates, opt_state = tx.update(grads, opt_state, state)
        return optax.apply_updates(state, updates), opt_state, loss

    jitted = jax.jit(step, in_shardings=(shardings, opt_shardings, batch_sharding))
    lowered = jitted.lower(state, jax.eval_shape(tx.init, state), batch)
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
text = compiled.as_text()
kinds = collections.Counter(
    re.findall(r"(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)\\(", text)
)
print(json.dumps({"seconds": seconds, "temp": compiled.memory_analysis().temp_size_in_bytes,
                  "collectives": dict(sorted(kinds.items()))}))
"""


def _once(flags: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())
    env.update(JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false")
    done = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, object]]] = {name: [] for name in SETTINGS}
    for _ in range(args.rounds):
        for name, flags in SETTINGS.items():
            runs[name].append(_once(flags))
    medians = {
        name: statistics.median(float(str(r["seconds"])) for r in rows)
        for name, rows in runs.items()
    }
    base = medians["xla defaults"]
    for name, rows in runs.items():
        median = medians[name]
        print(
            f"{name:34s} compile {median:5.2f} s (x{median / base:.2f}), "
            f"temporaries {rows[0]['temp']} B, collectives {rows[0]['collectives']}"
        )


if __name__ == "__main__":
    main()
