"""The pipeline's bubble on 8 emulated CPU devices: counted and timed.

Counted: :func:`meshplan.pipeline_layers` carries each microbatch's tag with its
activation; the tags each stage held at each iteration (``with_activity=True``) give the
iterations where a stage worked on a real microbatch. Timed: with the microbatch's size
fixed, every iteration is the same work (an idle stage computes on a placeholder, as
MaxText's loop does), so a step takes ``a * iterations + b``; the fitted ``a`` is one
iteration's time, and ``(p - 1) * a / t`` the share of a step's time spent in the bubble.
Both are set against the schedule's ``(p - 1) / (M v + p - 1)``.

Run: ``.venv/bin/python benchmarks/bench_pipeline.py`` (a few minutes on 2 cores);
``--one-device``: the stages vmapped on one device, no mesh (an accelerator's check:
``benchmarks/accelerator_check.sh``); ``--quick``: two microbatch counts, GPipe only.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

import meshplan
from meshplan import PipelineSchedule, pipeline_layers
from meshplan.train.device_mesh import make_mesh

RULES = (("batch", "data"), ("stage", "pipeline"), ("layer", "pipeline"), ("embed", None))
STAGES, ROWS, WIDTH, LAYERS = 4, 16, 256, 8


def _layer(w, x):
    return jnp.tanh(x @ w)


def measure(
    microbatches: int, repeats: int, runs: int = 7, one_device: bool = False
) -> tuple[float, float]:
    """``(fastest seconds of a forward+backward step, counted idle fraction)``: the fastest
    of ``runs``, the least disturbed by other work on a shared machine."""
    schedule = PipelineSchedule(STAGES, microbatches, repeats)
    w = jax.random.normal(jax.random.key(0), (LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)
    x = jax.random.normal(jax.random.key(1), (ROWS * microbatches, WIDTH))
    names = ("batch", "embed")
    with contextlib.ExitStack() as stack:
        if not one_device:
            mesh = make_mesh({"pipeline": STAGES, "data": 2})
            stack.enter_context(jax.set_mesh(mesh))
            stack.enter_context(meshplan.logical_axis_rules(RULES))
            w = jax.device_put(w, jax.NamedSharding(mesh, jax.P("pipeline")))

        def loss(w, x):
            return pipeline_layers(_layer, w, x, schedule, names).sum()

        step = jax.jit(jax.grad(loss))
        held = jax.jit(
            lambda w, x: pipeline_layers(_layer, w, x, schedule, names, with_activity=True)[1]
        )(w, x)
        jax.block_until_ready(step(w, x))
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            jax.block_until_ready(step(w, x))
            times.append(time.perf_counter() - t0)
    return min(times), float((np.asarray(held) < 0).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one-device", action="store_true", help="no mesh: stages vmapped")
    parser.add_argument("--quick", action="store_true", help="M of 4 and 16, GPipe only")
    args = parser.parse_args()
    where = "vmapped on one device" if args.one_device else "on a 4x2 mesh"
    print(
        f"{STAGES} stages {where}, microbatches of {ROWS} rows, {LAYERS} layers of "
        f"{WIDTH}; {jax.devices()[0].device_kind}"
    )
    for repeats in (1,) if args.quick else (1, 2):
        ms = [4, 16] if args.quick else [4, 8, 16, 32]
        results = {m: measure(m, repeats, one_device=args.one_device) for m in ms}
        iters = np.array([m * repeats + STAGES - 1 for m in ms], float)
        secs = np.array([results[m][0] for m in ms])
        a, b = np.polyfit(iters, secs, 1)
        print(
            f"repeats {repeats}: one iteration {a * 1e3:.2f} ms (fit of step time against "
            f"iterations; intercept {b * 1e3:.1f} ms)"
        )
        print(f"{'M':>4} {'iters':>6} {'step ms':>8} {'schedule':>9} {'counted':>8} {'timed':>7}")
        for m, it in zip(ms, iters, strict=True):
            t, idle = results[m]
            formula = PipelineSchedule(STAGES, m, repeats).bubble
            print(
                f"{m:>4} {int(it):>6} {t * 1e3:>8.1f} {formula:>9.1%} {idle:>8.1%} "
                f"{(STAGES - 1) * a / t:>7.1%}"
            )


if __name__ == "__main__":
    main()
