"""``meshplan train --rules pipeline``: bad pipelines refused before any work, and a pipelined
checkpoint resumed onto a layout without a pipeline and back, with the uninterrupted losses."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import meshplan
from meshplan.cli import main

TINY = ["--embed", "32", "--mlp", "64", "--max-len", "64"]
FAST = ["--batch", "8", "--seq", "16", "--eval-batches", "2"]


def _bad(args: list[str], capsys) -> str:
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return captured.err


@pytest.mark.parametrize(
    ("extra", "expected", "fix"),
    [
        (
            ["--layers", "6", "--microbatches", "4"],
            "--layers 6 do not split into the 4 stages of --rules pipeline ('stage' on pipeline "
            "of --mesh 4x2) x --pipeline-repeats 1",
            "Use --layers that is a multiple of 4 (stages x repeats)",
        ),
        (
            ["--layers", "8", "--microbatches", "4", "--pipeline-repeats", "3"],
            "x --pipeline-repeats 3",
            "a multiple of 12",
        ),
        (
            ["--layers", "4", "--microbatches", "2"],
            "--microbatches 2 are fewer than the 4 stages",
            "Use --microbatches 4 or more",
        ),
        (
            ["--layers", "4", "--microbatches", "8", "--grad-accum", "4"],
            "--batch 8 (/ --grad-accum 4: 2 rows a step) does not split into --microbatches 8",
            "a multiple of 32 (--microbatches x --grad-accum)",
        ),
        (
            ["--layers", "4", "--microbatches", "8"],
            "--microbatches 8 cut 8 rows into microbatches of 1, which do not split over the 2 "
            "devices",
            "a multiple of 16 (--microbatches x 2 x --grad-accum)",
        ),
        (
            ["--layers", "4", "--microbatches", "4", "--rules", "fsdp", "--mesh", "2x4"],
            "--rules fsdp on --mesh 2x4 gives 'stage' no mesh axis",
            "Use --rules pipeline",
        ),
    ],
    ids=["layers", "repeats", "microbatches", "batch", "data-shards", "no-pipeline"],
)
def test_a_bad_pipeline_is_refused_before_any_work(tmp_path, capsys, extra, expected, fix):
    folder = tmp_path / "run"
    args = ["train", "--rules", "pipeline", "--mesh", "4x2", *FAST, *TINY, *extra]
    err = _bad([*args, "--ckpt-dir", str(folder)], capsys)
    assert "meshplan train cannot start:\n  * " in err
    assert expected in " ".join(err.split()), err
    assert fix in " ".join(err.split()), err
    assert not folder.exists()  # nothing was started


def _losses(path: Path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _train(folder: Path, metrics: Path, *args: str) -> None:
    assert main(["train", "--ckpt-dir", str(folder), "--metrics", str(metrics), *args]) == 0


@pytest.mark.slow
def test_a_pipelined_checkpoint_resumes_without_a_pipeline_and_back(tmp_path, capsys):
    """Checkpoints hold the unsplit ('layer', ...) stack: any layout restores them; the
    pipeline composes with gradient accumulation (the same losses)."""
    first, metrics = tmp_path / "piped", tmp_path / "piped.jsonl"
    common = ["--eval-every", "0", "--ckpt-every", "2", *FAST, "--batch", "16"]
    _train(
        first,
        metrics,
        "--rules",
        "pipeline",
        "--mesh",
        "4x2",
        "--microbatches",
        "4",
        "--layers",
        "4",
        "--steps",
        "6",
        *TINY,
        *common,
    )
    reference = _losses(metrics)
    out = capsys.readouterr().out
    assert "pipeline: 4 stages (pipeline) x 1 layer group of 1 layers, 4 microbatches: " in out
    assert "bubble 43% of a step" in out  # (4 - 1) / (4 + 4 - 1)
    stored = meshplan.restore(first).metadata.arrays["params/layers/mlp/wi"]
    assert stored.names == ("layer", "embed", "mlp")
    assert meshplan.restore(first).metadata.step == 6

    plain, plain_metrics = tmp_path / "plain", tmp_path / "plain.jsonl"
    shutil.copytree(first, plain)
    for step in ("4", "6"):
        shutil.rmtree(plain / step)
    _train(plain, plain_metrics, "--resume", "--rules", "fsdp", "--mesh", "2x4", "--steps", "4")
    out = capsys.readouterr().out
    assert "(saved on 4x2 with pipeline) onto 2x4" in out
    assert "pipeline: " not in out  # fsdp: no pipeline, the stored microbatches unused
    back, back_metrics = tmp_path / "back", tmp_path / "back.jsonl"
    shutil.copytree(plain, back)
    # and with gradient accumulation: each accumulated half cut into the 4 microbatches
    _train(
        back,
        back_metrics,
        "--resume",
        "--rules",
        "pipeline",
        "--mesh",
        "4x2",
        "--steps",
        "6",
        "--grad-accum",
        "2",
    )
    losses = {**_losses(plain_metrics), **_losses(back_metrics)}
    assert sorted(losses) == [3, 4, 5, 6]
    for step, loss in losses.items():  # the uninterrupted pipelined run's, step by step
        assert abs(loss - reference[step]) < 1e-4, (step, loss, reference[step])
