"""Context parallelism's memory: a long sequence's training step on 1, 2, 4 and 8 context devices.

Compiles the Transformer's training step (loss and gradients) for one sequence
of ``--seq`` bytes under :data:`meshplan.layouts.context_parallel` on a
``data=1 x context=N`` mesh of emulated CPU devices, and prints XLA's own count
of each device's temporary buffers (``compiled.memory_analysis()``), its ratio
to one device, and the bytes of the collectives in the compiled step
(:func:`meshplan._search.measure.hlo.collective_bytes`): the all-gathers of keys and
values over ``context``. Nothing is run: it compiles only.

    .venv/bin/python benchmarks/bench_parallelism.py             # ~2 minutes on 2 cores
    .venv/bin/python benchmarks/bench_parallelism.py --seq 1024 --layers 2
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

import meshplan
from meshplan import layouts
from meshplan._search.measure.hlo import collective_bytes
from meshplan._text import human_bytes
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from meshplan.train.device_mesh import make_mesh


def measure(seq: int, layers: int, shards: int) -> tuple[int, dict[str, int]]:
    """Temporary bytes per device and collective bytes of the step on ``shards`` context devices."""
    config = config_from_name(
        "tiny", num_layers=layers, embed_dim=64, mlp_dim=128, num_heads=4, max_len=seq
    )
    model = Transformer(config)
    mesh = make_mesh({"data": 1, "context": shards})
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(layouts.context_parallel):
        abstract = jax.eval_shape(
            lambda: model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))["params"]
        )
        shardings = meshplan.get_sharding(abstract, mesh, strict=True)
        step = jax.jit(
            jax.value_and_grad(functools.partial(loss_fn, model=model)),
            in_shardings=(shardings, NamedSharding(mesh, PartitionSpec())),
        )
        batch = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)
        compiled = step.lower(abstract, batch).compile()
    return compiled.memory_analysis().temp_size_in_bytes, collective_bytes(compiled.as_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    parser.add_argument("--layers", type=int, default=1, help="Transformer blocks (default 1)")
    args = parser.parse_args()
    print(
        f"one sequence of {args.seq}, {args.layers} layer(s) of width 64, layout context_parallel"
    )
    print(f"{'context':>8} {'temp per device':>16} {'ratio':>6} {'all-gather bytes':>17}")
    first = None
    for shards in (1, 2, 4, 8):
        temp, moved = measure(args.seq, args.layers, shards)
        first = first or temp
        print(
            f"{shards:>8} {human_bytes(temp):>16} {temp / first:>6.2f} "
            f"{human_bytes(moved['all-gather']):>17}"
        )


if __name__ == "__main__":
    main()
