"""``--model llama --size ...``: published decoders planned and searched from the command line;
when nothing fits, the closest candidate and each change re-priced; rows collapsed; measured
columns labelled."""

from __future__ import annotations

import io
import json

import pytest

from meshplan import cli
from meshplan._search.predict.cost import Cost
from meshplan._search.predict.profiles import get_profile
from meshplan._search.search.result import SearchResult, SearchRow
from meshplan.cli.search import _groups, _shown, _table


def test_plan_prices_llama_7b_on_256_v5e_chips_without_allocating_it(capsys):
    argv = ["plan", "--model", "llama", "--size", "7b", "--mesh", "1x256", "--profile", "tpu_v5e"]
    assert cli.main([*argv, "--json"]) == 0  # the plan has no errors; the step is over budget
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "Llama 2 7B (llama2-7b, 6.7B parameters; seq 2048, remat none)"
    assert data["rules_name"] == "fsdp"  # MaxText's default
    prediction = data["prediction"]
    assert not prediction["fits"]  # one sequence of 2048 per chip: the activations
    assert prediction["attention"] == "xla"  # the scores in memory, as XLA runs it
    assert round(prediction["memory_bytes_per_device"] / 2**30, 2) == 40.71
    assert cli.main([*argv, "--attention", "flash", "--json"]) == 0  # as MaxText runs it
    flash = json.loads(capsys.readouterr().out)["prediction"]
    assert round(flash["memory_bytes_per_device"] / 2**30, 2) == 16.43
    assert flash["predicted_step_s"] < prediction["predicted_step_s"]


@pytest.mark.slow
def test_search_names_the_closest_candidate_and_what_makes_it_fit(capsys):
    argv = [
        "search",
        "--model",
        "llama",
        "--size",
        "1b",
        "--devices",
        "8",
        "--seq",
        "512",
        "--profile",
        "tpu_v5e",
        "--budget",
        "2GiB",
        "--top-k",
        "0",
        "--json",
    ]
    assert cli.main(argv) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["best"] is None and data["closest"]["memory_bytes_per_device"] > 2 << 30
    changes = {c["flag"]: c for c in data["fit_changes"]}
    full = changes["--remat full"]  # re-priced: the same rules, every mesh of their axes
    assert full["fits"] and full["row"]["memory_bytes_per_device"] <= 2 << 30
    assert not changes["--remat minimal"]["fits"]
    assert list(changes)[:2] == ["--remat minimal", "--remat full"]  # stops at the first fit
    assert all(
        c["fits"] or c["row"] is None or c["row"]["memory_bytes_per_device"] > 2 << 30
        for c in data["fit_changes"]
    )


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model", "llama", "--size", "7B"], "--size '7B' is not a Llama size"),
        (["--model", "llama", "--remat", "some"], "--remat 'some' is not a policy"),
        (["--model", "llama", "--layers", "2"], "--layers is a flag of the other built-in"),
        (["--model", "transformer", "--remat", "full"], "--remat is a flag of --model llama"),
    ],
)
@pytest.mark.parametrize("command", ["plan", "search"])
def test_bad_llama_flags_exit_2(capsys, command, args, fragment):
    assert cli.main([command, *args]) == 2
    assert fragment in capsys.readouterr().err


def _row(mesh, layout="fsdp", step=1.0, measured=None, rank=1):
    cost = Cost(step, step, 0.0, 0.0, 1e12, {"all-gather": 8}, {}, 1 << 20, 1 << 20, 1)
    row = SearchRow(mesh, (("batch", tuple(mesh)),), layout, cost=cost, rank=rank)
    row.measured_s = measured
    return row


def test_rows_of_one_layout_with_one_prediction_collapse_into_one_listing_their_meshes():
    rows = [
        _row({"data": 1, "model": 8}),
        _row({"data": 2, "model": 4}, rank=2),
        _row({"data": 4, "model": 2}, step=2.0, rank=3),
        _row({"data": 8, "model": 1}, rank=4),
    ]
    groups = _groups(rows)
    assert [[r.mesh_text for r in g] for g in groups] == [["1x8", "2x4", "8x1"], ["4x2"]]
    result = SearchResult(rows, 8, get_profile("h100"), 80 << 30, tokens=1024)
    text = _render(_table(result, _shown(result, 10)))
    assert "1x8, 2x4, 8x1" in text and "4x2" in text


def test_measured_rows_get_measured_throughput_and_mfu_columns():
    rows = [_row({"data": 8}, step=1.0, measured=2.0), _row({"data": 4, "model": 2}, rank=2)]
    result = SearchResult(rows, 8, get_profile("h100"), 80 << 30, tokens=1000)
    text = _render(_table(result, _shown(result, 10)))
    header = text.splitlines()[0]
    assert "measured tokens/s" in header and "measured MFU" in header
    first = text.splitlines()[1]
    assert "1,000 " in first and "500 " in first  # predicted 1,000 tokens/s; measured 500


def _render(table):
    from rich.console import Console

    console = Console(width=400, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()
