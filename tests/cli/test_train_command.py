"""``meshplan train`` and ``meshplan sample`` end to end at the tiniest size, bad input, and a
run killed with SIGKILL in the middle of writing a checkpoint."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import meshplan
from meshplan.cli import main

TINY = ["--layers", "1", "--embed", "32", "--mlp", "64", "--max-len", "64"]
_CLI = [sys.executable, "-m", "meshplan.cli"]
FAST = ["--batch", "8", "--seq", "16", "--eval-batches", "2"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 4-step run on 2x4 with fsdp_tp, checkpointed every 2 steps."""
    folder = tmp_path_factory.mktemp("cli") / "run"
    args = ["train", "--steps", "4", "--eval-every", "2", "--ckpt-every", "2", *FAST, *TINY]
    return folder, args


@pytest.mark.slow
def test_train_resume_on_another_mesh_then_sample(trained, capsys):
    folder, args = trained
    assert main([*args, "--ckpt-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "on a 2x4 mesh ('data', 'model') with layout fsdp_tp" in out
    assert "Plan per device" in out and "parameters + AdamW state" in out
    for step in (0, 2, 4):
        assert f"step {step:>5}  valid loss" in out
    assert "4/4" in out  # the progress bar's last state
    assert "best valid loss" in out and "(latest step 4)" in out
    assert sorted(p.name for p in folder.iterdir()) == ["2", "4"]

    resume = ["train", "--resume", "--mesh", "4x2", "--rules", "data_parallel", "--steps", "6"]
    assert main([*resume, "--ckpt-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert f"resuming from step 4 of {folder} (saved on 2x4 with fsdp_tp) onto 4x2" in out
    assert "batch 8 x 16 bytes" in out  # the stored settings, not the defaults
    assert "steps            │ 4 -> 6" in out
    assert meshplan.restore(folder).metadata.step == 6

    assert main(["sample", "--ckpt-dir", str(folder), "--length", "12", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "step 6 of" in out and "greedy" in out
    assert out.splitlines()[-1].startswith("def ")
    sampled = ["sample", "--ckpt-dir", str(folder), "--length", "8", "--temperature", "1.0"]
    assert main(sampled) == 0


def _bad(args: list[str], capsys) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    assert captured.err.startswith("error: ")
    return captured.err


@pytest.mark.parametrize(
    ("extra", "expected", "fix"),
    [
        (["--rules", "zero3"], "Unknown layout 'zero3'", "Pick one of those"),
        (
            ["--rules", "data_parallel", "--batch", "12"],
            "--batch 12 does not split over the 8 devices",
            "multiple of 8 (e.g. 16)",
        ),
        (
            ["--mesh", "2x8"],
            "needs 16 devices, but there are only 8",
            re.compile("Use a (smaller mesh|mesh of 8 devices)"),
        ),
        (["--mesh", "two"], "Cannot read --mesh 'two'", "Write it like 2x4, 4x2 or 8"),
        (["--seq", "100"], "--seq 100 exceeds the model's max_len=64", "Use --seq 64 or less"),
        (["--eval-every", "-5"], "--eval-every must be 0 or more, got -5", "Pass --eval-every 0"),
        (["--ckpt-every", "-1"], "--ckpt-every must be 0 or more, got -1", "Pass --ckpt-every 0"),
    ],
    ids=["rules", "batch", "mesh-size", "mesh-text", "seq", "eval-every", "ckpt-every"],
)
def test_bad_input_is_refused_before_any_work(tmp_path, capsys, extra, expected, fix):
    folder = tmp_path / "run"
    err = _bad(["train", *FAST, *TINY, "--ckpt-dir", str(folder), *extra], capsys)
    assert "meshplan train cannot start:\n  * " in err
    assert expected in err
    # The mesh-size fix names --devices, or XLA_FLAGS when the count came from the
    # environment (as in this suite) and no earlier in-process command set it.
    assert fix.search(err) if isinstance(fix, re.Pattern) else fix in err
    assert not folder.exists()  # nothing was started


def test_rules_that_shard_the_batch_over_a_missing_mesh_axis(tmp_path, capsys):
    rules = tmp_path / "rules.json"
    rules.write_text('[["batch", "dp"], ["embed", "data"], ["mlp", "model"]]')
    err = _bad(["train", *FAST, *TINY, "--rules", str(rules)], capsys)
    assert "meshplan train cannot start:\n  * " in err
    assert "shard 'batch' over mesh axis 'dp'" in err
    assert "Map 'batch' to the mesh's axes" in err


def test_data_path_with_no_text(tmp_path, capsys):
    empty = tmp_path / "texts"
    empty.mkdir()
    (empty / "image.bin").write_bytes(b"\x00\xff" * 64)
    err = _bad(["train", *FAST, *TINY, "--data", str(empty)], capsys)
    assert f"No text found under '{empty}'" in err
    assert "Give a folder containing text files" in err


def test_resume_from_empty_or_foreign_folder(tmp_path, capsys):
    err = _bad(["train", "--resume", "--ckpt-dir", str(tmp_path)], capsys)
    assert f"'{tmp_path}' is not a meshplan checkpoint: it is empty" in err
    (tmp_path / "model.safetensors").write_bytes(b"x")
    err = _bad(["train", "--resume", "--ckpt-dir", str(tmp_path)], capsys)
    assert "holds no step folders, only: model.safetensors" in err
    err = _bad(["sample", "--ckpt-dir", str(tmp_path)], capsys)
    assert "is not a meshplan checkpoint" in err
    err = _bad(["train", "--resume"], capsys)
    assert "--resume needs the checkpoint folder" in err


@pytest.mark.slow
def test_resume_with_a_config_of_other_shapes(trained, tmp_path, capsys):
    folder, args = trained
    if not folder.exists():
        assert main([*args, "--ckpt-dir", str(folder)]) == 0
        capsys.readouterr()
    err = _bad(["train", "--resume", "--ckpt-dir", str(folder), "--embed", "64"], capsys)
    assert "model config embed_dim: the checkpoint has 32, this run asks for 64" in err
    assert "do not fit the model, e.g. params/embed: checkpoint shape (256, 32), this model" in err
    assert "Resume with the checkpoint's config" in err
    err = _bad(["train", "--resume", "--ckpt-dir", str(folder), "--size", "small"], capsys)
    assert "model config num_layers: the checkpoint has 1, this run asks for 6" in err
    assert "do not fit the model" in err


@pytest.mark.slow
def test_sample_says_when_the_prompt_is_longer_than_the_context(trained, capsys):
    folder, args = trained
    if not folder.exists():
        assert main([*args, "--ckpt-dir", str(folder)]) == 0
    capsys.readouterr()
    base = ["sample", "--ckpt-dir", str(folder), "--length", "2", "--temperature", "0"]
    assert main([*base, "--prompt", "x" * 16]) == 0  # exactly the context (--seq 16)
    assert "note:" not in capsys.readouterr().err
    assert main([*base, "--prompt", "x" * 20]) == 0
    err = capsys.readouterr().err
    assert "note: the prompt is 20 bytes, longer than the model's context of 16 bytes" in err
    assert "it continues from the last 16 bytes only" in err


@pytest.mark.slow
def test_errors_exit_nonzero_without_traceback_in_a_real_process(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshplan.cli",
            "train",
            "--rules",
            "nope",
            "--data",
            "/nonexistent",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "Unknown layout 'nope'" in proc.stderr
    assert "Data path '/nonexistent' does not exist" in proc.stderr


# ---------------------------------------------------------------------------
# SIGKILL while a checkpoint is being written
# ---------------------------------------------------------------------------


def _complete(folder: Path) -> list[int]:
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit())


def _in_progress(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".orbax-checkpoint-tmp" in p.name]


def _kill_during_save(folder: Path) -> tuple[list[int], list[str]]:
    """Starts a run saving every step; SIGKILLs it while a save is in progress."""
    cmd = [*_CLI, "train", "--steps", "400", "--eval-every", "0"]
    cmd += ["--ckpt-every", "1", "--ckpt-dir", str(folder), "--mesh", "2x4", *FAST, *TINY]
    log = folder.parent / f"{folder.name}.stderr"  # a file, not a pipe: it cannot fill up
    with open(log, "wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if folder.is_dir() and len(_complete(folder)) >= 2 and _in_progress(folder):
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
                return _complete(folder), _in_progress(folder)
            time.sleep(0.001)
        raise AssertionError(f"no save seen in progress; stderr: {log.read_text()[-2000:]!r}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigkill_during_a_save_resumes_from_the_last_complete_checkpoint(tmp_path):
    for attempt in range(3):  # the save may finish between seeing it and the kill landing
        folder = tmp_path / f"run{attempt}"
        complete, partial = _kill_during_save(folder)
        if partial:
            break
    assert partial, "the run was never killed while a save was in progress"
    last = complete[-1]
    # The partial step is not a checkpoint; the last complete one restores.
    assert meshplan.restore(folder).metadata.step == last

    target = last + 2
    proc = subprocess.run(
        [*_CLI, "train", "--resume", "--ckpt-dir", str(folder), "--steps", str(target)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from step {last} of {folder}" in proc.stdout
    assert f"{last} -> {target}" in proc.stdout
    assert not _in_progress(folder)  # the leftover was cleaned up
    resumed = meshplan.restore(folder)
    assert resumed.metadata.step == target

    # Nothing else was lost: the same as a run that was never interrupted.
    from meshplan.cli.train import TrainRequest, prepare

    settings = {"steps": target, "batch": 8, "seq_len": 16, "eval_every": 0, "eval_batches": 2}
    overrides = {"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "max_len": 64}
    trainer = prepare(TrainRequest(mesh="2x4", overrides=overrides, settings=settings))
    trainer.run()
    from meshplan._checkpoint.tree import flatten_state

    arrays = resumed.arrays()
    for key, (value, _) in flatten_state(trainer.state).items():
        np.testing.assert_allclose(np.asarray(arrays[key]), np.asarray(value), rtol=1e-5, atol=1e-7)


# ---------------------------------------------------------------------------
# --model transformer-nnx: the Flax NNX Transformer
# ---------------------------------------------------------------------------

NNX = ["--model", "transformer-nnx"]


def _losses(path: Path) -> dict[int, float]:
    """Training losses by step, from a --metrics file."""
    import json

    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.fixture(scope="module")
def nnx_run(tmp_path_factory):
    """6 steps of the NNX Transformer on 2x4 with fsdp_tp, saved at steps 2, 4 and 6."""
    root = tmp_path_factory.mktemp("nnx")
    folder, metrics = root / "run", root / "metrics.jsonl"
    args = ["train", *NNX, "--steps", "6", "--eval-every", "2", "--ckpt-every", "2", *FAST, *TINY]
    assert main([*args, "--ckpt-dir", str(folder), "--metrics", str(metrics)]) == 0
    return folder, _losses(metrics)


@pytest.mark.slow
def test_nnx_trains_and_records_its_model(nnx_run, capsys):
    folder, losses = nnx_run
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(4.0 < loss < 6.0 for loss in losses.values())  # about log(256) at the start
    restored = meshplan.restore(folder)
    assert restored.metadata.extra["train"]["model"] == "transformer-nnx"
    wi = restored.metadata.arrays["params/layers/mlp/wi"]
    assert wi.names == ("layer", "embed", "mlp") and wi.logical


@pytest.mark.slow
def test_nnx_resumes_onto_another_mesh_and_layout_with_the_same_losses(nnx_run, tmp_path, capsys):
    import shutil

    folder, reference = nnx_run
    run, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    shutil.copytree(folder, run)
    shutil.rmtree(run / "6")
    capsys.readouterr()
    resume = ["train", "--resume", "--mesh", "4x2", "--rules", "tensor_parallel", "--steps", "6"]
    assert main([*resume, "--ckpt-dir", str(run), "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert "Transformer (Flax NNX) of 1 layer" in out  # the stored model, without --model
    assert f"resuming from step 4 of {run} (saved on 2x4 with fsdp_tp) onto 4x2" in out
    losses = _losses(metrics)
    assert sorted(losses) == [5, 6]
    for step in (5, 6):  # the uninterrupted run's losses, on another mesh and layout
        assert abs(losses[step] - reference[step]) < 1e-4, (step, losses[step], reference[step])
    assert meshplan.restore(run).metadata.extra["train"]["model"] == "transformer-nnx"


@pytest.mark.slow
def test_nnx_sample(nnx_run, capsys):
    folder, _ = nnx_run
    capsys.readouterr()
    greedy = ["sample", "--ckpt-dir", str(folder), "--length", "12", "--temperature", "0"]
    assert main(greedy) == 0
    out = capsys.readouterr().out
    assert "step 6 of" in out and out.splitlines()[-1].startswith("def ")
    assert main(greedy) == 0
    assert capsys.readouterr().out == out  # greedy: the same bytes again
    assert main(["sample", "--ckpt-dir", str(folder), "--length", "8", "--step", "4"]) == 0
    assert "step 4 of" in capsys.readouterr().out


@pytest.mark.slow
def test_a_linen_checkpoint_continues_as_nnx_with_the_linen_losses(tmp_path, capsys):
    import shutil

    linen, nnx = tmp_path / "linen", tmp_path / "nnx"
    base = ["train", "--eval-every", "0", "--ckpt-every", "2", *FAST, *TINY]
    assert main([*base, "--steps", "2", "--ckpt-dir", str(linen)]) == 0  # no --model: Linen
    assert meshplan.restore(linen).metadata.extra["train"]["model"] == "transformer"
    shutil.copytree(linen, nnx)
    capsys.readouterr()
    more = ["train", "--resume", "--steps", "4"]
    assert main([*more, "--ckpt-dir", str(linen), "--metrics", str(tmp_path / "l.jsonl")]) == 0
    assert main([*more, *NNX, "--ckpt-dir", str(nnx), "--metrics", str(tmp_path / "n.jsonl")]) == 0
    captured = capsys.readouterr()
    assert (
        "holds --model transformer (Flax Linen); this run continues it as --model "
        "transformer-nnx (Flax NNX)" in captured.err
    )
    want, got = _losses(tmp_path / "l.jsonl"), _losses(tmp_path / "n.jsonl")
    assert sorted(got) == sorted(want) == [3, 4]
    for step in (3, 4):
        assert abs(got[step] - want[step]) < 1e-4, (step, got[step], want[step])
    assert meshplan.restore(nnx).metadata.extra["train"]["model"] == "transformer-nnx"

    # Arrays that differ: refused, naming both models and the config field.
    err = _bad(
        [
            "train",
            "--resume",
            "--model",
            "transformer",
            "--no-scan",
            "--steps",
            "6",
            "--ckpt-dir",
            str(nnx),
        ],
        capsys,
    )
    assert (
        "the checkpoint holds --model transformer-nnx (Flax NNX), this run asks for "
        "--model transformer (Flax Linen)" in err
    )
    assert "model config scan_layers: the checkpoint has True, this run asks for False" in err
    assert "leave out --model, --size and the model size flags" in err


def test_a_checkpoint_from_before_model_was_recorded_holds_the_linen_model(trained, capsys):
    from meshplan.cli.train import TrainRequest, prepare
    from meshplan.cli.trained_models import model_of

    folder, args = trained
    if not folder.exists():
        assert main([*args, "--ckpt-dir", str(folder)]) == 0
        capsys.readouterr()
    meta = meshplan.restore(folder).metadata
    meta.extra["train"].pop("model", None)  # as an older meshplan wrote it
    assert model_of(meta) == "transformer"
    with pytest.raises(meshplan.MeshplanError, match="unknown --model 'gpt'"):
        prepare(TrainRequest(model="gpt", overrides={"num_layers": 1}))


@pytest.mark.slow
def test_nnx_over_two_processes(nnx_run, tmp_path):
    _, reference = nnx_run
    run, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    proc = subprocess.run(
        [
            *_CLI,
            "train",
            *NNX,
            "--processes",
            "2",
            "--steps",
            "2",
            "--eval-every",
            "0",
            *FAST,
            *TINY,
            "--ckpt-dir",
            str(run),
            "--metrics",
            str(metrics),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "meshplan train: 2 processes on this machine, 4 CPU devices each" in proc.stdout
    assert proc.stdout.count("Transformer (Flax NNX) of 1 layer") == 1  # process 0 speaks
    losses = _losses(metrics)
    for step in (1, 2):  # two processes of 4 devices: the losses of one process of 8
        assert abs(losses[step] - reference[step]) < 1e-4, (step, losses[step], reference[step])
    restored = meshplan.restore(run)
    assert restored.metadata.extra["train"]["model"] == "transformer-nnx"
    assert restored.metadata.extra["processes"] == 2
