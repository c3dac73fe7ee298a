"""`--grad-accum N` on `meshplan plan` and `meshplan search`: a step of N microbatches."""

from __future__ import annotations

import json

from meshplan import cli

PLAN = [
    "plan",
    "--model",
    "transformer",
    "--size",
    "tiny",
    "--mesh",
    "8x1",
    "--rules",
    "fsdp",
    "--profile",
    "h100",
    "--batch",
    "32",
    "--json",
]


def _prediction(capsys, *flags):
    assert cli.main([*PLAN, *flags]) == 0
    return json.loads(capsys.readouterr().out)["prediction"]


def test_plan_prices_n_microbatches_with_one_microbatch_of_activations(capsys):
    one = _prediction(capsys)
    four = _prediction(capsys, "--grad-accum", "4")
    assert four["compute_s"] > 3.9 * one["compute_s"] / 4  # the same tokens, in 4 runs
    assert four["activation_bytes_per_device"] < one["activation_bytes_per_device"] / 2
    assert four["tokens_per_s"] < one["tokens_per_s"]  # the weights gathered 4 times


def test_plan_refuses_grad_accum_without_a_profile_or_that_does_not_divide(capsys):
    assert cli.main(["plan", "--model", "transformer", "--size", "tiny", "--grad-accum", "4"]) == 2
    assert "--grad-accum" in capsys.readouterr().err
    assert cli.main([*PLAN, "--grad-accum", "3"]) == 2
    assert "do not divide" in capsys.readouterr().err


def test_search_takes_grad_accum(capsys):
    argv = [
        "search",
        "--model",
        "transformer",
        "--size",
        "tiny",
        "--devices",
        "8",
        "--profile",
        "h100",
        "--top-k",
        "0",
        "--json",
    ]
    assert cli.main([*argv, "--grad-accum", "4"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["batch"] == 32 and data["best"] is not None
    assert cli.main([*argv, "--grad-accum", "0"]) == 2
    assert "--grad-accum 0" in capsys.readouterr().err
