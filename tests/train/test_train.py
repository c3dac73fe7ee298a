"""The training loop: loss falls, resuming (on the same or another mesh) changes nothing,
and bad input is refused before any work, all problems at once."""

from __future__ import annotations

import numpy as np
import pytest

import meshplan
from meshplan.cli.mesh_text import parse_mesh
from meshplan.cli.train import TrainRequest, prepare
from meshplan.train.settings import TrainSettings

# The tiniest model that still learns: one block of width 32.
TINY = {"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "num_heads": 4, "max_len": 64}
FAST = {"batch": 8, "seq_len": 32, "eval_every": 0, "eval_batches": 2, "ckpt_every": 4, "lr": 1e-2}


def _request(tmp_path=None, **kw) -> TrainRequest:
    settings = {**FAST, **kw.pop("settings", {})}
    return TrainRequest(
        config=kw.pop("config", "tiny"),
        overrides=kw.pop("overrides", TINY),
        settings=settings,
        ckpt_dir=None if tmp_path is None else str(tmp_path),
        **kw,
    )


def _params(trainer) -> dict[str, np.ndarray]:
    from meshplan._checkpoint.tree import flatten_state

    return {k: np.asarray(v) for k, (v, _) in flatten_state(trainer.state.params).items()}


@pytest.mark.slow
def test_loss_decreases_on_the_tiniest_config():
    trainer = prepare(_request(settings={"steps": 30, "eval_every": 30}))
    result = trainer.run()
    assert result.start_step == 0 and result.end_step == 30
    assert sorted(result.evals) == [0, 30]
    assert result.evals[30] < result.evals[0] - 1.0, result.evals
    assert np.mean([result.losses[s] for s in range(26, 31)]) < result.losses[1] - 1.0
    assert result.best_valid == (30, result.evals[30])
    assert result.tokens_per_second > 0


@pytest.mark.slow
def test_eval_every_zero_evaluates_only_at_the_end():
    result = prepare(_request(settings={"steps": 3, "eval_every": 0})).run()
    assert sorted(result.evals) == [3]


@pytest.fixture(scope="module")
def one_stretch():
    """8 steps without stopping, on 2x4 with fsdp_tp."""
    trainer = prepare(_request(settings={"steps": 8}, mesh="2x4", rules="fsdp_tp"))
    result = trainer.run()
    return result, _params(trainer)


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    """The first 4 of those steps, saved."""
    folder = tmp_path_factory.mktemp("half")
    trainer = prepare(_request(folder, settings={"steps": 4}, mesh="2x4", rules="fsdp_tp"))
    result = trainer.run()
    trainer.close()
    assert result.saved_steps == [4]
    return folder, result


def _resume(folder, tmp_path, mesh, rules):
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(folder, copy)
    # Only --steps is given again: batch, seq, lr, seed and the config come from the checkpoint.
    request = TrainRequest(
        mesh=mesh, rules=rules, ckpt_dir=str(copy), resume=True, settings={"steps": 8}
    )
    trainer = prepare(request)
    assert trainer.settings == TrainSettings(**{**FAST, "steps": 8})
    result = trainer.run()
    trainer.close()
    return trainer, result


@pytest.mark.slow
def test_resume_equals_one_stretch(one_stretch, first_half, tmp_path):
    full, full_params = one_stretch
    folder, half = first_half
    for step in range(1, 5):
        assert half.losses[step] == full.losses[step]
    trainer, resumed = _resume(folder, tmp_path, "2x4", "fsdp_tp")
    assert resumed.start_step == 4 and resumed.end_step == 8
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for step in range(5, 9):
        np.testing.assert_allclose(resumed.losses[step], full.losses[step], rtol=1e-6)
    for key, value in _params(trainer).items():
        np.testing.assert_allclose(value, full_params[key], rtol=1e-5, atol=1e-7, err_msg=key)
    assert int(trainer.state.step) == 8


@pytest.mark.parametrize(("mesh", "rules"), [("4x2", "data_parallel"), ("1x1", "tensor_parallel")])
@pytest.mark.slow
def test_resume_across_mesh_and_layout_change(one_stretch, first_half, tmp_path, mesh, rules):
    full, full_params = one_stretch
    folder, _ = first_half
    trainer, resumed = _resume(folder, tmp_path, mesh, rules)
    assert resumed.start_step == 4
    assert dict(trainer.mesh.shape) == dict(zip(("data", "model"), parse_mesh(mesh), strict=True))
    for step in range(5, 9):
        np.testing.assert_allclose(resumed.losses[step], full.losses[step], rtol=1e-4)
    for key, value in _params(trainer).items():
        np.testing.assert_allclose(value, full_params[key], rtol=1e-3, atol=1e-5, err_msg=key)
    # The new run's checkpoint records the new layout.
    meta = meshplan.restore(trainer.ckpt_dir).metadata
    assert meta.step == 8
    assert meta.extra["layout"] == rules
    assert tuple(meta.mesh_shape.values()) == parse_mesh(mesh)


# ---------------------------------------------------------------------------
# Bad input: refused by prepare(), before any array exists
# ---------------------------------------------------------------------------


def _problems(request: TrainRequest) -> str:
    with pytest.raises(meshplan.MeshplanError) as e:
        prepare(request)
    message = str(e.value)
    assert message.startswith("meshplan train cannot start:\n  * ")
    return message


def test_unknown_rules():
    message = _problems(_request(rules="zero3"))
    assert "Unknown layout 'zero3'" in message
    assert "data_parallel, fsdp, tensor_parallel, fsdp_tp" in message


def test_batch_the_mesh_does_not_divide():
    message = _problems(_request(settings={"batch": 12}, rules="data_parallel"))
    assert "--batch 12 does not split over the 8 devices" in message
    assert "Use a --batch that is a multiple of 8 (e.g. 16)" in message


def test_mesh_larger_than_the_devices():
    message = _problems(_request(mesh="4x4"))
    assert "The mesh 4x4 needs 16 devices, but there are only 8" in message


def test_model_the_layout_cannot_split():
    overrides = {**TINY, "num_heads": 2, "embed_dim": 32}
    message = _problems(_request(overrides=overrides, mesh="1x8", rules="tensor_parallel"))
    assert "dim 2 ('heads') of size 2 does not divide by 8 (mesh axis 'model' of size 8)" in message


@pytest.mark.parametrize("kind", ["empty-folder", "binary-file", "missing"])
def test_data_path_with_no_text(tmp_path, kind):
    path = tmp_path / "data"
    if kind == "empty-folder":
        path.mkdir()
    elif kind == "binary-file":
        path.write_bytes(b"\0\1\2" * 100)
    message = _problems(_request(data=str(path)))
    assert str(path) in message
    assert "does not exist" in message if kind == "missing" else "No text found" in message


def test_resume_from_empty_or_foreign_folder(tmp_path):
    message = _problems(_request(tmp_path, resume=True))
    assert "is not a meshplan checkpoint: it is empty" in message
    (tmp_path / "weights.bin").write_bytes(b"x")
    message = _problems(_request(tmp_path, resume=True))
    assert "holds no step folders, only: weights.bin" in message


@pytest.mark.slow
def test_resume_with_other_shapes(first_half, tmp_path):
    folder, _ = first_half
    overrides = {**TINY, "mlp_dim": 128}
    message = _problems(_request(folder, resume=True, overrides=overrides))
    assert "  * model config mlp_dim: the checkpoint has 64, this run asks for 128\n" in message
    assert "(step 4, " in message
    assert (
        "arrays) and this model: they do not fit the model, e.g. params/layers/mlp/wi: " in message
    )
    assert "checkpoint shape (1, 32, 64), this model (1, 32, 128)" in message
    assert "Resume with the checkpoint's config: leave out --size" in message


def test_fresh_run_into_a_used_folder(first_half):
    folder, _ = first_half
    message = _problems(_request(folder))
    assert "already holds checkpoints (latest step 4)" in message
    assert "Pass --resume" in message


def test_all_problems_are_reported_together(tmp_path):
    message = _problems(
        _request(rules="nope", mesh="3", data=str(tmp_path / "nothing"), settings={"batch": 5})
    )
    bullets = [line for line in message.splitlines() if line.startswith("  * ")]
    assert len(bullets) == 2  # the layout and the data; batch needs a valid layout to check
    assert "Unknown layout 'nope'" in bullets[0]
    assert "does not exist" in bullets[1]


def test_every_parameter_the_layout_cannot_split_is_named(tmp_path):
    rules = tmp_path / "rules.json"
    rules.write_text('[["batch", "data"], ["embed", "model"]]')
    overrides = {**TINY, "embed_dim": 36, "num_heads": 2}
    message = _problems(_request(overrides=overrides, mesh="1x8", rules=str(rules)))
    bullets = [line for line in message.splitlines() if line.startswith("  * ")]
    shown = [b for b in bullets if "does not divide by 8 (mesh axis 'model' of size 8)" in b]
    assert len(shown) == 6
    more = bullets[-1]
    assert (
        more.startswith("  * and ")
        and "more parameters with a dimension that does not split: params/" in more
    )
    count = int(more.split()[2])
    assert len(more.split(": ", 1)[1].split(", ")) == count  # each one named, none dropped


def test_rules_that_shard_the_length_need_a_sequence_they_can_stripe(tmp_path):
    """Sharding 'length' is context parallelism: the sequence must cut into 2N chunks."""
    rules = tmp_path / "rules.json"
    rules.write_text('[["batch", "data"], ["length", "model"]]')
    message = _problems(_request(rules=str(rules), settings={"seq_len": 20}))
    assert "--seq 20 cannot be striped over the 4 context shards that --rules" in message
    assert "Use a --seq that is a multiple of 8." in message
    rules.write_text('[["batch", "data"], ["length", "seq"]]')
    message = _problems(_request(rules=str(rules)))
    assert "shard 'length' over mesh axis 'seq', which the 2x4 mesh" in message


def test_data_shorter_than_one_window_is_refused_before_any_work(tmp_path):
    text = tmp_path / "short.txt"
    text.write_text("x = 1\n" * 30)  # 180 bytes: the validation split holds 18
    message = _problems(_request(data=str(text)))
    assert f"The valid split of '{text}' has 18 bytes, fewer than one window" in message
    assert "seq_len + 1 = 33" in message
    assert "Use a shorter sequence length (--seq) or more text." in message


def test_checkpoint_problems_get_flag_level_advice_from_their_code(tmp_path):
    """The library says 'pass step=...'; the command line says what to do with its flags."""
    message = _problems(_request(tmp_path / "nowhere", resume=True))
    assert "does not exist" in message
    assert "Check --ckpt-dir, or start without --resume" in message
    assert "meshplan.Checkpointer(path).save" not in message  # the library's API-level fix


# ---------------------------------------------------------------------------
# Faults in the library: a diverging run, nonsense settings
# ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_diverging_run_raises_diverged_and_saves_no_bad_step(tmp_path):
    from meshplan._checkpoint.folder import complete_steps
    from meshplan.train.records import Diverged

    settings = {"steps": 40, "ckpt_every": 2, "eval_every": 2, "lr": 1e6, "warmup": 0}
    trainer = prepare(_request(tmp_path, settings=settings))
    with pytest.raises(Diverged) as e:
        trainer.run()
    trainer.close()
    error = e.value
    assert error.problems[0].code == "train-not-finite"
    assert error.last_good is not None and error.last_good < error.step
    assert f"Training diverged at step {error.step}: " in str(error)
    assert f"The last good checkpoint is step {error.last_good} of '{tmp_path}'" in str(error)
    assert complete_steps(tmp_path)[-1] == error.last_good
    assert trainer.best_saved is not None and trainer.best_saved[0] in trainer.saved_on_disk


def test_settings_problems_name_each_bad_value():
    bad = TrainSettings(lr=float("inf"), weight_decay=float("nan"), warmup=-1, keep=0, clip=-2.0)
    assert [name for name, _ in bad.problems()] == ["lr", "warmup", "weight_decay", "keep", "clip"]
    assert TrainSettings().problems() == []
    message = _problems(_request(settings={"lr": float("nan"), "warmup": -5}))
    assert "--lr must be a finite number above 0, got nan" in message
    assert "Pass --warmup 0 (no warm-up) or a positive number of steps." in message
    assert "(only at the end)" not in message


def test_bad_rules_in_a_file_are_named_with_the_file(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text('[["batch", ["data", "data"]]]')
    message = _problems(_request(rules=str(path)))
    assert f"--rules {path}: rules[0]: ('batch', ('data', 'data')): the mesh axis 'data'" in message
