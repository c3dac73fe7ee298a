"""How fast are ``meshplan.explain`` and ``meshplan.check`` on a large abstract TrainState?

Builds an abstract ``TrainState`` (``jax.eval_shape``) with Adam over 4,000
logically boxed parameters: 12,000 array leaves (params, ``mu``, ``nu``) plus
``step`` and ``count``. Reports microseconds per leaf for ``explain`` and
``check`` next to a bare ``jax.tree.map`` over the same tree (the floor: any
walk of the tree costs that much), as ratios of medians measured in one run.

    .venv/bin/python benchmarks/bench_plan.py            # default 12,000 leaves
    .venv/bin/python benchmarks/bench_plan.py --params 400 --repeats 5
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import optax
from flax.training import train_state

import meshplan

RULES = (("batch", "data"), ("embed", "data"), ("mlp", "model"), ("heads", "model"))
_NAMES = [("embed", "mlp"), ("mlp", "embed"), ("embed", "heads", "kv"), ("mlp",)]
_SHAPES = [(256, 1024), (1024, 256), (256, 8, 32), (1024,)]


def abstract_state(n_params: int) -> Any:
    """An abstract TrainState with ``n_params`` boxed parameters (and Adam's mu, nu)."""

    def init() -> train_state.TrainState:
        params = {}
        for i in range(n_params):
            k = i % len(_NAMES)
            params.setdefault(f"layer_{i // len(_NAMES)}", {})[f"w{k}"] = (
                meshplan.LogicallyPartitioned(jnp.zeros(_SHAPES[k], jnp.float32), _NAMES[k])
            )
        return train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-3))

    return jax.eval_shape(init)


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall time of ``fn``, with the garbage collector off while timing (as ``timeit``).

    With it on, a full collection of the ~145k objects JAX and Flax keep alive lands in
    whichever run happens to cross its threshold, and moves a median by 3x between runs.
    """
    fn()  # warm up
    times = []
    for _ in range(repeats):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4000, help="boxed parameters (x3 leaves)")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per measurement")
    args = parser.parse_args()

    mesh = jax.make_mesh((2, 4), ("data", "model"))
    state = abstract_state(args.params)
    leaves = len(jax.tree.leaves(state))

    floor = median_seconds(lambda: jax.tree.map(lambda x: x, state), args.repeats)
    explain = median_seconds(lambda: meshplan.explain(state, mesh, RULES), args.repeats)
    check = median_seconds(lambda: meshplan.check(state, mesh, RULES), args.repeats)
    get_sharding = median_seconds(
        lambda: meshplan.logical_to_mesh_sharding(meshplan.get_partition_spec(state), mesh, RULES),
        args.repeats,
    )

    print(f"abstract TrainState: {leaves:,} array leaves; mesh 2x4; median of {args.repeats} runs")
    print(f"{'':34}{'µs/leaf':>9}{'x floor':>9}")
    for name, seconds in (
        ("jax.tree.map(identity) (floor)", floor),
        ("meshplan.explain", explain),
        ("meshplan.check", check),
        ("logical_to_mesh_sharding (ref.)", get_sharding),
    ):
        print(f"{name:34}{seconds / leaves * 1e6:9.2f}{seconds / floor:9.2f}")


if __name__ == "__main__":
    main()
