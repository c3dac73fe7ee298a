"""The step loop's own cost: nothing compiles after the first step, and reading the loss a
step behind still stops a diverging run within one step of its first NaN."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import meshplan
from meshplan._checkpoint.folder import complete_steps
from meshplan._checkpoint.lock import read_lock
from meshplan.cli.train import TrainRequest, prepare
from meshplan.train.device_mesh import make_mesh
from meshplan.train.model import TrainModel
from meshplan.train.parts import Checkpoints, Placement
from meshplan.train.records import Diverged
from meshplan.train.settings import TrainSettings
from meshplan.train.trainer import Trainer

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # one per XLA compilation

TINY = {"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "num_heads": 4, "max_len": 64}


def _run_counting_compiles(trainer: Trainer) -> tuple[Any, list[str], dict[int, int]]:
    """Runs (and closes) ``trainer``: its result, every XLA compilation's name, and how
    many had happened when each step was reported."""
    compiles: list[str] = []
    by_step: dict[int, int] = {}

    def listen(event: str, duration: float, **kwargs: object) -> None:
        if event == COMPILE_EVENT:
            compiles.append(str(kwargs.get("fun_name", "?")))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        result = trainer.run(on_step=lambda r: by_step.__setitem__(r.step, len(compiles)))
        trainer.close()  # the last save (if any) reaches the disk
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    return result, compiles, by_step


def test_nothing_compiles_after_the_first_step_evaluations_included():
    settings = {"steps": 9, "batch": 8, "seq_len": 32, "eval_every": 3, "eval_batches": 2}
    trainer = prepare(
        TrainRequest(mesh="8", rules="data_parallel", overrides=TINY, settings=settings)
    )
    result, compiles, by_step = _run_counting_compiles(trainer)
    assert sorted(result.evals) == [0, 3, 6, 9]
    # The evaluation at step 0 and the first step compiled (one batch shape: [8, 33])...
    assert by_step[1] >= 2, compiles
    # ... and nothing after it: no step, evaluation or batch compiled anything.
    assert len(compiles) == by_step[1], compiles[by_step[1] :]
    assert by_step[9] == by_step[1]


def test_saving_every_step_compiles_once_and_never_slices(tmp_path):
    """Orbax's replica-parallel save sliced each replicated array eagerly: 64 ``jit(slice)``
    programs at the first save of this data-parallel run (issue 33). Now the first save
    compiles its checks once, and no later step or save compiles anything."""
    settings = {"steps": 4, "batch": 8, "seq_len": 32, "eval_every": 0, "ckpt_every": 1}
    request = TrainRequest(
        mesh="8", rules="data_parallel", overrides=TINY, settings=settings, ckpt_dir=str(tmp_path)
    )
    _, compiles, by_step = _run_counting_compiles(prepare(request))
    assert not [c for c in compiles if "slice" in c], compiles
    first_save = compiles[by_step[1] : by_step[2]]  # the checks of step 1's save, once each
    assert len(first_save) == len(set(first_save)) <= 3, first_save
    assert by_step[4] == by_step[2], compiles[by_step[2] :]  # steps 3-4 and their saves
    # Written by one replica per shard, the steps are whole: the last restores onto
    # another mesh, every checksum verified.
    state, meta = meshplan.restore(tmp_path, make_mesh({"data": 2, "model": 4}))
    assert meta.step == 4 and jax.tree.leaves(state)


def _poisoned_run(nan_at: int, ckpt_dir: Path | None = None) -> tuple[Trainer, list[int]]:
    """A linear model whose batch of step ``nan_at`` (1-based; 0: none) holds a NaN."""
    mesh = make_mesh({"data": 8, "model": 1})
    rules = (("batch", "data"),)
    sharding = NamedSharding(mesh, PartitionSpec("data"))

    def init_params(key: jax.Array) -> dict[str, meshplan.LogicallyPartitioned]:
        return {"w": meshplan.LogicallyPartitioned(jax.random.normal(key, (4,)), ("embed",))}

    def loss(params: dict[str, meshplan.LogicallyPartitioned], batch: jax.Array) -> jax.Array:
        return jnp.mean((batch @ params["w"].value) ** 2)

    def batches(split: str, index: int) -> jax.Array:
        x = np.ones((8, 4), np.float32)
        if split == "train" and index == nan_at - 1:
            x[0, 0] = np.nan
        return jax.device_put(x, sharding)

    trainer = Trainer(
        TrainModel(init_params, loss),
        batches,
        TrainSettings(steps=12, batch=8, eval_every=0, lr=1e-3),
        Placement(mesh, rules, "dp"),
        None if ckpt_dir is None else Checkpoints(ckpt_dir),
    )
    seen: list[int] = []
    return trainer, seen


@pytest.mark.parametrize("nan_at", [1, 5])
def test_a_nan_loss_stops_the_run_within_one_step(nan_at):
    trainer, seen = _poisoned_run(nan_at)
    with pytest.raises(Diverged, match=f"step {nan_at}.*training loss is nan") as e:
        trainer.run(on_step=lambda r: seen.append(r.step))
    assert e.value.step == nan_at
    assert trainer.step <= nan_at + 1  # at most the step after it was dispatched
    assert seen == list(range(1, nan_at))  # every finite step reported, the NaN one not


def test_a_fresh_start_makes_the_state_and_its_first_save_opens_the_folder(tmp_path):
    """start() makes a fresh state without the checkpoint folder (open() and run() take its
    lock before any work); a loop of start, train_step and save opens it at its first save."""
    folder = tmp_path / "run"
    trainer, _ = _poisoned_run(0, folder)
    trainer.start()
    assert trainer.step == 0 and trainer.state is not None
    assert read_lock(folder) is None  # nothing of the folder taken yet
    trainer.train_step()
    assert trainer.save()
    assert read_lock(folder)["pid"] == os.getpid()
    trainer.close()
    assert read_lock(folder) is None and complete_steps(folder) == [1]
    assert not trainer.save()  # closed: the folder stays shut
