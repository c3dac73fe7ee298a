"""``meshplan search|plan`` of a model with no names: names inferred from its step, written
with ``--names-out``, read back with ``--names``; ``--names infer`` for plan and train."""

from __future__ import annotations

import json

import pytest

import meshplan
from meshplan.cli import main

MLP = "meshplan.examples.third_party:jax_mlp"


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def _search(capsys, *extra: str) -> dict:
    code, out, _ = _run(
        capsys,
        "search",
        "--model",
        MLP,
        "--devices",
        "8",
        "--profile",
        "h100",
        "--top-k",
        "0",
        "--json",
        *extra,
    )
    assert code == 0
    return json.loads(out)


def test_search_of_an_unnamed_model_writes_the_names_it_inferred_and_reads_them_back(
    capsys, tmp_path
):
    names, rules = tmp_path / "names.json", tmp_path / "rules.json"
    inferred = _search(capsys, "--names-out", str(names), "--rules-out", str(rules))
    pairs = json.loads(names.read_text())
    assert ["(?:.*/)?w1", ["dim_16", "embed"]] in pairs
    assert inferred["path_rules"] == pairs
    assert inferred["train_command"].endswith(f"--names {names}")
    again = _search(capsys, "--names", str(names))  # the names passed back: the same search
    assert "path_rules" not in again
    assert again["rows"][0]["rules"] == inferred["rows"][0]["rules"]
    assert again["rows"][0]["predicted_step_s"] == inferred["rows"][0]["predicted_step_s"]


def test_search_says_which_names_it_inferred_and_how_to_keep_them(capsys):
    code, out, _ = _run(
        capsys, "search", "--model", MLP, "--devices", "8", "--profile", "h100", "--top-k", "0"
    )
    assert code == 0
    assert "names inferred from the step (the model has none):" in out
    assert "pass --names-out PATH to write them" in out
    assert "--names infer" in out  # the train command infers them the same way


def test_plan_with_names_infer_places_the_inferred_names(capsys):
    code, out, err = _run(
        capsys, "plan", "--model", MLP, "--names", "infer", "--rules", "fsdp", "--mesh", "8"
    )
    assert code == 0
    assert "carries a logical name" not in err  # named: nothing to say first
    assert "--names" not in err  # every pattern matched, every parameter named
    assert "dim_16, embed" in out
    assert "P(None, ('data', 'model'))" in out  # fsdp splits embed over the devices


@pytest.mark.slow
def test_train_with_names_infer_keeps_the_inferred_names_for_a_resume_on_another_mesh(
    capsys, tmp_path
):
    folder = str(tmp_path / "run")
    common = ["--model", MLP, "--eval-every", "0", "--eval-batches", "1", "--ckpt-dir", folder]
    code, out, err = _run(
        capsys,
        "train",
        *common,
        "--names",
        "infer",
        "--steps",
        "2",
        "--rules",
        "fsdp",
        "--mesh",
        "8",
    )
    assert code == 0, out + err
    assert "carries a logical name" not in err and "--names" not in err
    _, metadata = meshplan.restore(folder, None)
    assert ["(?:.*/)?w1", ["dim_16", "embed"]] in metadata.extra["train"]["names"]
    code, out, err = _run(
        capsys, "train", *common, "--resume", "--steps", "3", "--rules", "fsdp", "--mesh", "2x4"
    )
    assert code == 0, out + err
    assert "resuming from step 2" in out + err
    assert "carries a logical name" not in err
