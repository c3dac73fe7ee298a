"""What ``meshplan train`` costs beyond a bare training loop of the same model.

Run: python benchmarks/bench_train_overhead.py [--case tiny|small|own ...] [--cli]

Each case trains one model three ways, on the same mesh, with the same
optimizer (:func:`meshplan.train.settings.make_optimizer`:
``optax.chain(clip_by_global_norm(1.0), adamw)``) and the same batches:

* ``bare``: the loop a user writes from the guide: the state made by
  ``jax.jit(init, out_shardings=...)``, one ``jax.jit`` step (value_and_grad,
  ``apply_gradients``, the state donated), a fresh host batch put on the mesh
  with ``jax.device_put`` each step, and the loss of the step before read
  (``float``) after the next one is dispatched;
* ``trainer``: :class:`meshplan.train.trainer.Trainer` (``run``), built by the
  command's own :func:`~meshplan.cli.train.prepare.prepare_run` (the built-in
  Transformer and ``--model pkg.module:factory`` alike);
* ``cli`` (with ``--cli``): ``meshplan train`` end to end in a process of its
  own, against the bare loop in a process of its own, both alternating.

A step's time is the interval between the reads of two consecutive losses:
what ``meshplan train``'s summary and ``--metrics`` report. The arms alternate
(``bare, trainer, trainer, bare, ...``) so that a load that comes and goes (the
machine is shared) falls on both; each round's medians give a ratio, and the
ratio printed is the median over rounds, with the range of the rounds (the
noise). Target: ratio <= 1.03.

The cases: ``tiny`` is the issue's row (the ``tiny`` Transformer, ``--rules
data_parallel --mesh 8 --seq 128 --batch 32``); ``small`` a Transformer whose
step takes a few milliseconds (1 layer, width 64, batch 8 x 32); ``own`` the
factory ``meshplan.examples.own_model:linen_classifier`` (``--model``), whose
step is shorter still. On emulated CPU devices (8 by default, set here before
JAX loads) or, with ``--platform gpu``, the machine's accelerator.
"""

from __future__ import annotations

import argparse
import os
import sys

if "--platform" not in sys.argv or "cpu" in sys.argv:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

OWN = "meshplan.examples.own_model:linen_classifier"

CASES: dict[str, list[str]] = {
    "tiny": ["--size", "tiny", "--batch", "32", "--seq", "128"],
    "small": [
        "--size",
        "tiny",
        "--layers",
        "1",
        "--embed",
        "64",
        "--heads",
        "2",
        "--mlp",
        "128",
        "--batch",
        "8",
        "--seq",
        "32",
    ],
    "own": ["--model", OWN],
}
"""The ``meshplan train`` flags of each case (with ``--rules data_parallel --mesh N``)."""


def _request(case: str, mesh: str, steps: int, devices: Any = None) -> Any:
    """The :class:`TrainRequest` of ``case`` (its flags read by the command's own parser)."""
    from meshplan.cli.app import build_parser
    from meshplan.cli.train.command import _request as request_of

    argv = ["train", "--rules", "data_parallel", "--mesh", mesh, *CASES[case]]
    argv += ["--steps", str(steps), "--eval-every", "0", "--eval-batches", "1"]
    return request_of(build_parser().parse_args(argv), devices)


def _prepared(case: str, mesh: str, steps: int) -> Any:
    from meshplan.cli.train import prepare_run

    return prepare_run(_request(case, mesh, steps))  # every model source: one prepare step


@dataclasses.dataclass
class Bare:
    """The bare loop of a prepared run: its own state, step and host batches."""

    step: Callable[[Any, Any], tuple[Any, jax.Array]]
    host_batch: Callable[[int], Any]
    shardings: Any
    state: Any
    mesh: Any
    rules: Any
    index: int = 0

    def run(self, n: int) -> list[float]:
        """``n`` steps; the interval between consecutive loss reads, in seconds."""
        from meshplan import logical_axis_rules

        times: list[float] = []
        pending: jax.Array | None = None
        last: float | None = None
        with jax.set_mesh(self.mesh), logical_axis_rules(self.rules):
            for _ in range(n):
                batch = jax.device_put(self.host_batch(self.index), self.shardings)
                self.state, loss = self.step(self.state, batch)
                self.index += 1
                if pending is not None:
                    float(pending)
                    now = time.perf_counter()
                    if last is not None:
                        times.append(now - last)
                    last = now
                pending = loss
            assert pending is not None
            float(pending)
            if last is not None:
                times.append(time.perf_counter() - last)
        return times


def bare_loop(prepared: Any) -> Bare:
    """The guide's loop for the model, optimizer, mesh and batches of ``prepared``."""
    import optax

    import meshplan
    from meshplan import logical_axis_rules
    from meshplan.train.settings import make_optimizer
    from meshplan.train.state import init_fn

    trainer = prepared.trainer
    s = trainer.settings
    tx = make_optimizer(s)  # optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(...))
    assert isinstance(tx, optax.GradientTransformation)
    mesh, rules = trainer.mesh, trainer.rules
    loss_fn, has_aux = trainer.loss, trainer.has_aux

    def step(state: Any, batch: Any) -> tuple[Any, jax.Array]:
        out, grads = jax.value_and_grad(loss_fn, has_aux=has_aux)(state.params, batch)
        return state.apply_gradients(grads=grads), out[0] if has_aux else out

    if prepared.corpus is not None:  # the built-in Transformer: windows of the byte corpus
        corpus = prepared.corpus

        def host_batch(i: int) -> Any:
            return corpus.batch_at("train", i, s.seed, s.batch, s.seq_len)

        batch_spec: Any = NamedSharding(mesh, PartitionSpec("data"))
    else:  # a factory's batches(split, index)
        source = prepared.trainable.batches

        def host_batch(i: int) -> Any:
            return jax.tree.map(np.asarray, source("train", i))

        batch_spec = jax.tree.map(
            lambda x: NamedSharding(mesh, PartitionSpec("data")), host_batch(0)
        )
    init = init_fn(trainer.model, tx, trainer.example_input)
    shardings = meshplan.logical_to_mesh_sharding(
        meshplan.get_partition_spec(jax.eval_shape(init, jax.random.key(s.seed))), mesh, rules
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        state = jax.jit(init, out_shardings=shardings)(jax.random.key(s.seed))
    jitted = jax.jit(
        step,
        in_shardings=(shardings, batch_spec),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    return Bare(jitted, host_batch, batch_spec, state, mesh, rules)


def trainer_steps(trainer: Any, n: int) -> list[float]:
    """``n`` more steps of ``trainer.run``: its timed steps, in seconds."""
    trainer.settings = dataclasses.replace(trainer.settings, steps=trainer.step + n)
    return list(trainer.run().step_times.values())


@dataclasses.dataclass
class Rounds:
    """The step times of each arm, per round."""

    bare: list[list[float]] = dataclasses.field(default_factory=list)
    other: list[list[float]] = dataclasses.field(default_factory=list)

    def line(self, case: str, what: str) -> str:
        ratios = [
            statistics.median(o) / statistics.median(b)
            for o, b in zip(self.other, self.bare, strict=True)
        ]
        bare = [t for r in self.bare for t in r]
        other = [t for r in self.other for t in r]
        b, o = statistics.median(bare), statistics.median(other)
        b10, o10 = np.percentile(bare, 10), np.percentile(other, 10)
        spread = np.percentile(ratios, [25, 75])
        return (
            f"{case:<6} {what:<8} median step: bare {b * 1e3:8.2f} ms, {what} {o * 1e3:8.2f} ms, "
            f"ratio {o / b:.3f}; 10th percentile: {b10 * 1e3:.2f} / {o10 * 1e3:.2f} ms, ratio "
            f"{o10 / b10:.3f}; rounds' ratios: median {statistics.median(ratios):.3f}, "
            f"quartiles {spread[0]:.3f}-{spread[1]:.3f} ({len(ratios)} rounds, "
            f"{len(bare)} + {len(other)} steps)"
        )


def in_process(case: str, mesh: str, steps: int, rounds: int) -> Rounds:
    """Trainer against the bare loop in this process, alternating; both compiled first."""
    prepared = _prepared(case, mesh, 2)
    trainer = prepared.trainer
    bare = bare_loop(prepared)
    trainer.run()  # compiles the steps
    bare.run(3)
    out = Rounds()
    for r in range(rounds):
        arms = [("bare", bare.run), ("other", lambda n: trainer_steps(trainer, n))]
        for name, arm in arms if r % 2 == 0 else arms[::-1]:
            getattr(out, name).append(arm(steps))
    return out


def _cli_arm(case: str, mesh: str, steps: int, platform: str) -> float:
    """``meshplan train`` in a process of its own: the median of its timed steps."""
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        argv = [sys.executable, "-m", "meshplan.cli", "train", "--rules", "data_parallel"]
        argv += ["--mesh", mesh, *CASES[case], "--steps", str(steps), "--eval-every", "0"]
        argv += ["--eval-batches", "1", "--metrics", str(metrics), "--platform", platform]
        subprocess.run(argv, check=True, capture_output=True, text=True)
        rows = [json.loads(x) for x in metrics.read_text().splitlines() if x]
        return statistics.median(r["step_time_s"] for r in rows if r.get("step_time_s"))


def _bare_arm(case: str, mesh: str, steps: int, platform: str) -> float:
    """The bare loop in a process of its own: the median of its steps."""
    argv = [sys.executable, __file__, "--bare-only", "--case", case, "--mesh", mesh]
    argv += ["--steps", str(steps), "--platform", platform]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def end_to_end(case: str, mesh: str, steps: int, rounds: int, platform: str) -> Rounds:
    out = Rounds()
    for r in range(rounds):
        arms = [("bare", _bare_arm), ("other", _cli_arm)]
        for name, arm in arms if r % 2 == 0 else arms[::-1]:
            getattr(out, name).append([arm(case, mesh, steps, platform)])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=tuple(CASES), help="(repeatable)")
    parser.add_argument("--mesh", default=None, help="default: 8 on the CPU, 1 on a GPU")
    parser.add_argument("--steps", type=int, default=8, help="steps of each arm in a round")
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the arms, alternating")
    parser.add_argument("--cli", action="store_true", help="also meshplan train end to end")
    parser.add_argument("--cli-rounds", type=int, default=2)
    parser.add_argument("--cli-steps", type=int, default=60, help="steps of each end-to-end run")
    parser.add_argument("--platform", default="cpu", choices=("cpu", "gpu", "tpu"))
    parser.add_argument("--bare-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    mesh = args.mesh or ("8" if args.platform == "cpu" else str(jax.device_count()))
    cases = args.case or ["tiny", "small", "own"]
    if args.bare_only:
        bare = bare_loop(_prepared(cases[0], mesh, 2))
        bare.run(3)
        print(statistics.median(bare.run(args.steps)))
        return 0
    d = jax.devices()[0]
    print(
        f"jax {jax.__version__}: {jax.device_count()} x {d.device_kind}; mesh {mesh}, "
        f"--rules data_parallel; {args.steps} steps an arm, {args.rounds} rounds alternating; "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}"
    )
    for case in cases:
        print(in_process(case, mesh, args.steps, args.rounds).line(case, "trainer"), flush=True)
        if args.cli:
            rounds = end_to_end(case, mesh, args.cli_steps, args.cli_rounds, args.platform)
            print(rounds.line(case, "cli"), flush=True)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
