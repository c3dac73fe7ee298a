"""meshplan vs Flax's own SPMD utilities, on the same large abstract TrainState.

Run: python benchmarks/bench_core.py [--layers N] [--repeats N] [--steps N]

Part 1 times the tree utilities (get_partition_spec, get_sharding,
logical_to_mesh_sharding) and 100k logical_to_mesh_axes calls, meshplan and
Flax alternating, and prints the median of each and the ratio meshplan/flax
(target <= 1.0). Part 2 lowers and compiles the guide's train step from
meshplan's annotations and from Flax's, compares the optimized HLO (after
normalising names and metadata) and its collectives, and prints the step-time
ratio. Everything runs on 8 emulated CPU devices (set here, before JAX loads).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse
import functools
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._search.measure.hlo import COLLECTIVES
from meshplan.models import mlp

RULES = (
    ("batch", "data"),
    ("layer", None),
    ("vocab", "model"),
    ("embed", None),
    ("hidden", "model"),
    ("heads", "model"),
    ("kv", None),
)

# (name, shape, device-axis names, logical names) of one synthetic layer's parameters.
LAYER_PARAMS = [
    ("wq", (256, 8, 32), (None, "model", None), ("embed", "heads", "kv")),
    ("wo", (8, 32, 256), ("model", None, None), ("heads", "kv", "embed")),
    ("w1", (256, 1024), (None, "model"), ("embed", "hidden")),
    ("w2", (1024, 256), ("model", None), ("hidden", "embed")),
    ("b1", (1024,), ("model",), ("hidden",)),
    ("scale", (256,), (None,), ("embed",)),
]


def _noop_apply(*args: Any, **kwargs: Any) -> None:  # the TrainState's apply_fn
    return None


def build_state(impl: str, logical: bool, layers: int) -> train_state.TrainState:
    """An abstract TrainState (ShapeDtypeStruct values, Adam state) with boxed params."""
    if impl == "meshplan":
        box = meshplan.LogicallyPartitioned if logical else meshplan.Partitioned
    else:
        box = nn.LogicallyPartitioned if logical else nn.Partitioned
    params = {
        f"layer_{i}": {
            name: box(jax.ShapeDtypeStruct(shape, jnp.float32), lnames if logical else names)
            for name, shape, names, lnames in LAYER_PARAMS
        }
        for i in range(layers)
    }
    params["embedding"] = box(
        jax.ShapeDtypeStruct((32000, 256), jnp.float32),
        ("vocab", "embed") if logical else ("model", None),
    )

    def create(p: Any) -> train_state.TrainState:
        return train_state.TrainState.create(apply_fn=_noop_apply, params=p, tx=optax.adam(1e-3))

    return jax.eval_shape(create, params)


def timeit(fn: Callable[[], Any], number: int = 1) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def compare(
    ours: Callable[[], Any], theirs: Callable[[], Any], repeats: int
) -> tuple[float, float]:
    """Medians (seconds) of ``ours`` and ``theirs``, run alternately after one warm-up each."""
    ours(), theirs()
    a, b = [], []
    for i in range(repeats):
        if i % 2:
            b.append(timeit(theirs))
            a.append(timeit(ours))
        else:
            a.append(timeit(ours))
            b.append(timeit(theirs))
    return statistics.median(a), statistics.median(b)


def leaves_equal(x: Any, y: Any) -> bool:
    is_leaf = lambda v: v is None or isinstance(v, P | NamedSharding)  # noqa: E731
    fx = jax.tree_util.tree_flatten_with_path(x, is_leaf=is_leaf)[0]
    fy = jax.tree_util.tree_flatten_with_path(y, is_leaf=is_leaf)[0]
    return [(jax.tree_util.keystr(p), v) for p, v in fx] == [
        (jax.tree_util.keystr(p), v) for p, v in fy
    ]


# --------------------------------------------------------------------------
# Part 1: tree utilities
# --------------------------------------------------------------------------


def bench_utilities(mesh: Mesh, layers: int, repeats: int) -> list[tuple[str, float, float, bool]]:
    ours_state, theirs_state = (
        build_state("meshplan", False, layers),
        build_state("flax", False, layers),
    )
    ours_logical, theirs_logical = (
        build_state("meshplan", True, layers),
        build_state("flax", True, layers),
    )
    n_leaves = len(jax.tree_util.tree_leaves(ours_state))
    print(f"abstract TrainState: {layers} layers, {n_leaves} leaves ({n_leaves - 2} boxed)\n")

    rows = []

    def row(
        name: str, ours: Callable[[], Any], theirs: Callable[[], Any], n: int = repeats
    ) -> None:
        same = leaves_equal(ours(), theirs())
        t_ours, t_theirs = compare(ours, theirs, n)
        rows.append((name, t_ours, t_theirs, same))

    row(
        "get_partition_spec(state)",
        lambda: meshplan.get_partition_spec(ours_state),
        lambda: nn.get_partition_spec(theirs_state),
    )
    row(
        "get_sharding(state, mesh)",
        lambda: meshplan.get_sharding(ours_state, mesh),
        lambda: nn.get_sharding(theirs_state, mesh),
    )
    ours_specs = meshplan.get_partition_spec(ours_logical)
    theirs_specs = nn.get_partition_spec(theirs_logical)
    row(
        "logical_to_mesh_sharding(specs)",
        lambda: meshplan.logical_to_mesh_sharding(ours_specs, mesh, RULES),
        lambda: nn.logical_to_mesh_sharding(theirs_specs, mesh, RULES),
    )

    # 100k calls over the names of the model's arrays (a realistic, repeating workload).
    names = [lnames for _, _, _, lnames in LAYER_PARAMS] + [
        ("batch", "length", "embed"),
        ("batch", "length", "heads", "kv"),
        ("batch", "length", "hidden"),
        ("layer", "embed", "hidden"),
        ("vocab", "embed"),
        ("batch", "length", "vocab"),
    ]
    calls = [names[i % len(names)] for i in range(100_000)]

    def many(fn: Callable[..., Any], calls: list[tuple[str, ...]]) -> Callable[[], list[Any]]:
        return lambda: [fn(n, RULES) for n in calls]

    row(
        "100k logical_to_mesh_axes (12 arrays)",
        many(meshplan.logical_to_mesh_axes, calls),
        many(nn.logical_to_mesh_axes, calls),
        max(3, repeats // 2),
    )
    # Every call a new array: no cache can help.
    distinct = [(f"x{i}", "embed", "hidden", "batch") for i in range(100_000)]
    row(
        "100k logical_to_mesh_axes (all distinct)",
        many(meshplan.logical_to_mesh_axes, distinct),
        many(nn.logical_to_mesh_axes, distinct),
        max(3, repeats // 2),
    )
    return rows


# --------------------------------------------------------------------------
# Part 2: the compiled train step, meshplan's annotations vs Flax's
# --------------------------------------------------------------------------


class DotReluDot(nn.Module):
    """The guide's DotReluDot written with Flax's own utilities (flax_reference.py).

    Same class name as meshplan's, so the parameter paths, hence the init values, match."""

    depth: int
    dense_init: Callable[..., Any] = nn.initializers.xavier_normal()

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, None]:
        y = nn.Dense(
            self.depth,
            kernel_init=nn.with_partitioning(self.dense_init, (None, "model")),
            use_bias=False,
        )(x)
        y = jax.nn.relu(y)
        y = jax.lax.with_sharding_constraint(y, P("data", "model"))
        w2 = self.param(
            "W2", nn.with_partitioning(self.dense_init, ("model", None)), (self.depth, x.shape[-1])
        )
        z = jnp.dot(y, w2)
        z = jax.lax.with_sharding_constraint(z, P("data", None))
        return z, None


class GuideMLP(nn.Module):
    num_layers: int
    depth: int
    use_scan: bool

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.use_scan:
            x, _ = nn.scan(
                DotReluDot,
                length=self.num_layers,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                metadata_params={nn.PARTITION_NAME: None},
            )(self.depth)(x)
        else:
            for _ in range(self.num_layers):
                x, _ = DotReluDot(self.depth)(x)
        return x


def normalise_hlo(text: str) -> str:
    """HLO text without metadata, names and numbering: what the program does, not its labels."""
    kept, skipping = [], False
    for line in text.splitlines():  # drop the source tables (file and function names)
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            skipping = True
        elif skipping and not line.strip():
            skipping = False
        elif not skipping:
            kept.append(line)
    text = "\n".join(kept)
    text = re.sub(r",?\s*metadata=\{[^}]*\}", "", text)
    text = re.sub(r",?\s*op_name=\"[^\"]*\"", "", text)
    text = re.sub(r"^HloModule \S+", "HloModule m", text, flags=re.M)
    text = re.sub(r"\"[^\"]*\.py\"", '"file"', text)
    mapping: dict[str, str] = {}

    def rename(match: re.Match[str]) -> str:
        return mapping.setdefault(match.group(0), f"%v{len(mapping)}")

    text = re.sub(r"%[\w.\-]+", rename, text)
    # Computation names (fused_computation.3, region_0.12, ...) appear without '%' too.
    comps: dict[str, str] = {}

    def rename_comp(match: re.Match[str]) -> str:
        return comps.setdefault(match.group(0), f"c{len(comps)}")

    return re.sub(r"\b[A-Za-z_][\w\-]*\.\d+(?:\.clone)?\b", rename_comp, text)


def collectives(text: str) -> Counter[str]:
    """``op shape`` for every collective in the optimized HLO (start/done pairs counted once)."""
    found: Counter[str] = Counter()
    for line in text.splitlines():
        m = re.search(r"=\s*(\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(", line)
        if m:
            found[f"{m.group(2)} {m.group(1)}"] += 1
    return found


def build_step(
    impl: str, mesh: Mesh, use_scan: bool, depth: int, layers: int
) -> tuple[Any, Any, Any]:
    model = (
        mlp.MLP(layers, depth, use_scan)
        if impl == "meshplan"
        else GuideMLP(layers, depth, use_scan)
    )
    optimizer = optax.adam(1e-3)
    x_sharding = NamedSharding(mesh, P("data", None))
    x = jax.device_put(jnp.ones((8, depth)), x_sharding)
    init = functools.partial(mlp.init_fn, model=model, optimizer=optimizer)
    abstract = jax.eval_shape(init, jax.random.key(0), x)
    if impl == "meshplan":
        state_sharding = meshplan.get_sharding(abstract, mesh)
    else:
        state_sharding = nn.get_sharding(abstract, mesh)
    state = jax.jit(init, out_shardings=state_sharding)(jax.random.key(0), x)
    step = mlp.make_train_step(model, state_sharding, x_sharding)
    return step, state, x


def bench_train_step(mesh: Mesh, depth: int, layers: int, steps: int) -> None:
    for use_scan in (False, True):
        label = "scan" if use_scan else "loop"
        with jax.set_mesh(mesh):
            ours_step, ours_state, x = build_step("meshplan", mesh, use_scan, depth, layers)
            theirs_step, theirs_state, _ = build_step("flax", mesh, use_scan, depth, layers)
            ours_step = ours_step.lower(ours_state, x).compile()
            theirs_step = theirs_step.lower(theirs_state, x).compile()
            ours_hlo, theirs_hlo = ours_step.as_text(), theirs_step.as_text()
            same_program = normalise_hlo(ours_hlo) == normalise_hlo(theirs_hlo)
            ours_coll, theirs_coll = collectives(ours_hlo), collectives(theirs_hlo)

            # Same initial values (same init, same key): the results must agree too.
            ours_new = jax.block_until_ready(ours_step(ours_state, x))
            theirs_new = jax.block_until_ready(theirs_step(theirs_state, x))
            same_values = all(
                np.allclose(a, b, rtol=1e-5, atol=1e-6)
                for a, b in zip(
                    jax.tree_util.tree_leaves(ours_new),
                    jax.tree_util.tree_leaves(theirs_new),
                    strict=True,
                )
            )

            def run(step: Any, state: Any, x: jax.Array = x) -> Callable[[], Any]:
                return lambda: jax.block_until_ready(step(state, x))

            t_ours, t_theirs = compare(
                run(ours_step, ours_state), run(theirs_step, theirs_state), steps
            )

        print(f"train step ({label}, {layers} layers, depth {depth}, batch 8, 2x4 mesh):")
        print(f"  same optimized HLO after normalising names/metadata: {same_program}")
        print(f"  same collectives (op, shape, count): {ours_coll == theirs_coll}")
        for op, count in sorted(ours_coll.items()):
            print(f"    {count:3d} x {op}")
        if ours_coll != theirs_coll:
            print("  flax's collectives:")
            for op, count in sorted(theirs_coll.items()):
                print(f"    {count:3d} x {op}")
        print(f"  same updated state values: {same_values}")
        print(f"  step time ratio meshplan/flax (median of {steps}): {t_ours / t_theirs:.3f}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=400, help="layers of the synthetic state")
    parser.add_argument("--repeats", type=int, default=7, help="repeats per utility timing")
    parser.add_argument("--steps", type=int, default=21, help="timed train steps per program")
    parser.add_argument("--depth", type=int, default=1024, help="the guide model's depth")
    args = parser.parse_args()

    print(f"meshplan {meshplan.__version__}, jax {jax.__version__}, {jax.device_count()} devices")
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))

    rows = bench_utilities(mesh, args.layers, args.repeats)
    width = max(len(r[0]) for r in rows)
    print(f"{'operation':<{width}}  {'meshplan ms':>11}  {'flax ms':>9}  {'ratio':>6}  same result")
    for name, t_ours, t_theirs, same in rows:
        print(
            f"{name:<{width}}  {t_ours * 1e3:11.2f}  {t_theirs * 1e3:9.2f}  "
            f"{t_ours / t_theirs:6.3f}  {same}"
        )
    worst = max(t_ours / t_theirs for _, t_ours, t_theirs, _ in rows)
    print(
        f"(median of {args.repeats} runs, 100k rows {max(3, args.repeats // 2)}; ratio = meshplan/flax, target <= 1.0; worst {worst:.3f})\n"
    )

    bench_train_step(mesh, args.depth, 4, args.steps)


if __name__ == "__main__":
    main()
