"""``meshplan plan``: table, JSON, PNG, rule files, and --strict exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from child_env import fresh_env
from meshplan import cli
from meshplan.cli.mesh_text import parse_mesh_shape


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``python -m meshplan.cli plan ...`` in a fresh process (its own device count)."""
    env = fresh_env("JAX_PLATFORMS")
    env["COLUMNS"] = "200"
    return subprocess.run(
        [sys.executable, "-m", "meshplan.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


@pytest.mark.slow
def test_plan_with_png_from_a_fresh_process(tmp_path):
    png = tmp_path / "plan.png"
    result = run_cli("--mesh", "2x4", "--rules", "guide", "--png", str(png))
    assert result.returncode == 0, result.stderr
    assert "params/LogicalDotReluDot_0/Dense_0/kernel" in result.stdout
    assert "P(None, 'model')" in result.stdout
    assert "fullest device" in result.stdout
    assert f"Wrote {png}" in result.stdout
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


@pytest.mark.slow
def test_a_large_mesh_is_planned_without_emulating_its_devices():
    # 128x128 used to emulate 16,384 CPU devices and sit in garbage collection for minutes;
    # a plan needs only the axis sizes (an AbstractMesh). About 1.5 s on 2 cores.
    started = time.monotonic()
    result = run_cli("--mesh", "128x128", "--model", "transformer", "--json", timeout=120)
    elapsed = time.monotonic() - started
    data = json.loads(result.stdout)
    errors = [p for p in data["problems"] if p["severity"] == "error"]  # 128 does not divide
    assert errors and result.returncode == 1, result.stderr
    assert "emulated" not in result.stderr
    mesh = data["plan"]["mesh"]
    assert mesh["shape"] == {"data": 128, "model": 128}
    assert mesh["device_ids"] == list(range(128 * 128))
    assert elapsed < 30, f"planning 128x128 took {elapsed:.1f} s"


def test_png_of_a_mesh_larger_than_the_devices_here(tmp_path, capsys):
    png = tmp_path / "plan.png"
    argv = ["plan", "--mesh", "4x4", "--depth", "64", "--layers", "1", "--png", str(png)]
    assert cli.main(argv) == 0  # this process has 8 devices; the mesh needs none
    assert "data=4 × model=4 (16 devices)" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_strict_errors_exit_non_zero_listing_the_problems():
    # 1024 does not divide by 3: every hidden dimension is an error.
    result = run_cli("--mesh", "2x3", "--depth", "1024", "--layers", "1", "--strict")
    assert result.returncode == 1
    assert "The sharding plan has 6 errors" in result.stderr
    assert "{'data': 2, 'model': 3}" in result.stderr
    assert (
        "params/LogicalDotReluDot_0/Dense_0/kernel: dim 1 ('hidden') of size 1024" in result.stderr
    )
    assert "Pad dim 1 to 1026" in result.stderr


@pytest.mark.parametrize("flags", [[], ["--json"]])
def test_a_plan_with_errors_exits_one_without_strict(capsys, flags):
    code = cli.main(["plan", "--mesh", "2x3", "--depth", "1024", "--layers", "1", *flags])
    assert code == 1
    out = capsys.readouterr().out
    assert ("6 errors" in out) if not flags else (json.loads(out)["problems"])


def test_json_output(capsys):
    assert cli.main(["plan", "--json", "--depth", "64", "--layers", "2"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rules_name"] == "guide"
    assert data["plan"]["schema"] == "meshplan.plan/1"
    assert data["plan"]["mesh"]["shape"] == {"data": 2, "model": 4}
    specs = {leaf["path"]: leaf["spec"] for leaf in data["plan"]["leaves"]}
    assert specs["params/LogicalDotReluDot_1/W2"] == ["model", None]
    assert {p["code"] for p in data["problems"]} == {"no-rule", "dead-rule", "idle-axis"}


def test_strict_without_errors_exits_zero(capsys):
    assert cli.main(["plan", "--strict", "--depth", "64", "--layers", "1"]) == 0
    assert "0 errors" in capsys.readouterr().out


@pytest.mark.parametrize("suffix", [".json", ".py"])
def test_rules_from_a_file(tmp_path, capsys, suffix):
    path = tmp_path / f"rules{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps([["embed", "data"], ["hidden", "model"]]))
    else:
        path.write_text("RULES = (('embed', 'data'), ('hidden', 'model'))\n")
    assert cli.main(["plan", "--json", "--depth", "64", "--layers", "1", "--rules", str(path)]) == 0
    data = json.loads(capsys.readouterr().out)
    kernel = next(x for x in data["plan"]["leaves"] if x["path"].endswith("Dense_0/kernel"))
    assert kernel["spec"] == ["data", "model"]
    assert data["problems"] == []


def test_strict_with_a_bad_rule_file(tmp_path, capsys):
    path = tmp_path / "typo.json"
    path.write_text(json.dumps([["embed", "data"], ["hidden", "modle"]]))
    code = cli.main(["plan", "--strict", "--depth", "64", "--layers", "1", "--rules", str(path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "rules[1]: rule 1 ('hidden', 'modle') names mesh axis 'modle'" in captured.err
    assert "Did you mean 'model'?" in captured.err


@pytest.mark.parametrize("command", [["plan", "--rules"], ["search", "--layouts"]])
def test_errors_are_printed_literally_not_as_markup(tmp_path, capsys, command):
    # rich reads "[name, axes]" as a markup tag: the fix used to print as "Write a list of  pairs".
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"batch": "data"}))
    assert cli.main([*command, str(path)]) == 2
    err = capsys.readouterr().err
    assert "the top level is a JSON dict, not a list." in err
    assert 'Write a list of [name, axes] pairs, e.g. [["batch", "data"], ["mlp", "model"]' in err
    assert "Write a list of  pairs" not in err


def test_output_prints_every_piece_literally(capsys):
    from rich.console import Console

    from meshplan.cli.output import print_error, say

    say(Console(), ("[bold]", "bold"), " [name, axes] [/] [red]x[/red]")
    print_error("Pass [name, axes]; [dim]", Console(stderr=True))
    captured = capsys.readouterr()
    assert captured.out == "[bold] [name, axes] [/] [red]x[/red]\n"
    assert captured.err == "error: Pass [name, axes]; [dim]\n"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--mesh", "2by4"], "Cannot read the mesh '2by4'"),
        (["--mesh", "2x2x2"], "Name them with --axes"),
        (["--mesh", "2x4", "--axes", "data"], "one distinct name per axis"),
        (["--rules", "no_such_layout"], "no_such_layout"),
    ],
)
def test_bad_command_lines_exit_2(capsys, args, fragment):
    assert cli.main(["plan", *args]) == 2
    assert fragment in capsys.readouterr().err


def test_three_axis_mesh(capsys):
    code = cli.main(
        [
            "plan",
            "--json",
            "--mesh",
            "2x2x2",
            "--axes",
            "data,fsdp,model",
            "--depth",
            "64",
            "--layers",
            "1",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["mesh"]["shape"] == {"data": 2, "fsdp": 2, "model": 2}


def test_transformer_plan(capsys):
    # The Transformer example always exists: a failing import must fail here, not skip.
    assert cli.main(["plan", "--model", "transformer", "--rules", "fsdp_tp", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"].startswith("Transformer")
    assert data["plan"]["totals"]["params"]["leaves"] > 0
    specs = {leaf["path"]: leaf["spec"] for leaf in data["plan"]["leaves"]}
    assert specs["params/layers/mlp/wi"] == [None, "data", "model"]  # fsdp_tp's promise
    assert not [p for p in data["problems"] if p["severity"] == "error"]


def test_parse_mesh_defaults():
    assert parse_mesh_shape("2x4", None) == {"data": 2, "model": 4}
    assert parse_mesh_shape("8", None) == {"data": 8, "model": 1}
    assert parse_mesh_shape("4×2", None) == {"data": 4, "model": 2}


def _json_of(capsys, *args: str) -> dict:
    assert cli.main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_nnx_transformer_plan_matches_the_linen_one(capsys):
    """The NNX Transformer has the Linen one's parameters and names: the same plan."""

    def json_of(*args: str) -> dict:
        return _json_of(capsys, *args)

    linen = json_of("plan", "--rules", "fsdp_tp", "--model", "transformer")
    nnx = json_of("plan", "--rules", "fsdp_tp", "--model", "transformer-nnx")
    assert nnx.pop("model") == "Transformer (tiny, Flax NNX)"
    assert linen.pop("model") == "Transformer (tiny)"
    assert nnx == linen
    plan = json_of("plan", "--model", "transformer-nnx")  # fsdp_tp by default, as the Linen one
    specs = {leaf["path"]: leaf["spec"] for leaf in plan["plan"]["leaves"]}
    assert plan["rules_name"] == "fsdp_tp"
    assert specs["params/layers/mlp/wi"] == [None, "data", "model"]
    assert specs["opt_state/0/mu/layers/mlp/wi"] == [None, "data", "model"]


@pytest.mark.slow
def test_nnx_transformer_search_matches_the_linen_one(capsys, tmp_path, monkeypatch):
    """The same names, the same ranking (a published profile, no compile: prediction only)."""
    monkeypatch.chdir(tmp_path)  # search writes the best rules file here
    command = ["search", "--profile", "h100", "--top-k", "0"]
    linen = _json_of(capsys, *command, "--model", "transformer")
    nnx = _json_of(capsys, *command, "--model", "transformer-nnx")

    # The same candidates with the same verdicts and the same best; the predicted times differ
    # a little (the two step functions trace to slightly different programs), so candidates
    # near a tie (within 3%) may swap places further down.
    def key(r):
        return json.dumps([r["mesh_shape"], r["axis_names"], r["rules"], r["status"]])

    assert sorted(map(key, nnx["rows"])) == sorted(map(key, linen["rows"]))
    assert key(nnx["best"]) == key(linen["best"])
    assert nnx["counts"] == linen["counts"]
    times = {key(r): r.get("predicted_step_s") for r in linen["rows"]}
    for a in nnx["rows"]:
        b = times[key(a)]
        if a.get("predicted_step_s") and b:
            assert abs(a["predicted_step_s"] / b - 1) < 0.05
