"""``meshplan search`` and ``meshplan plan --profile`` with pipelines: the rows, the verdicts,
the schedule priced, and a pipelined row's train command trained."""

from __future__ import annotations

import json
import shlex
import textwrap

import pytest

from meshplan import cli

STACK = textwrap.dedent(
    """
    import jax
    import jax.numpy as jnp
    import meshplan
    from meshplan._spmd.pipeline import stage_axes

    def stack(layers=16, width=8192, rows=4096):
        w = meshplan.LogicallyPartitioned(
            jax.ShapeDtypeStruct((layers, width, width), jnp.bfloat16), ("layer", "embed", "mlp"))

        def loss(w, x):
            x = meshplan.with_logical_constraint(x, ("batch", "embed"))
            _, stages = stage_axes()
            if stages > 1:  # the layers as a pipeline where the rules give 'stage' an axis
                schedule = meshplan.PipelineSchedule(stages, 2 * stages)
                layer = lambda w, h: jnp.tanh(h @ w)
                h = meshplan.pipeline_layers(layer, w, x, schedule, ("batch", "embed"))
            else:
                h = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0]
            return h.astype(jnp.float32).sum()

        def step(state, x):
            return jax.grad(loss)(state["w"].value, x)

        return {"w": w}, step, jax.ShapeDtypeStruct((rows, width), jnp.bfloat16)
    """
)
TRAIN_FAST = ["--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--platform", "cpu"]


@pytest.fixture
def here(tmp_path, monkeypatch):
    (tmp_path / "stackmodel.py").write_text(STACK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _json(capsys, *argv: str) -> dict:
    code = cli.main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def test_search_ranks_a_pipeline_across_two_hosts_first_and_says_why(here, capsys):
    argv = ["search", "--model", "stackmodel:stack", "--devices", "16", "--profile", "h100"]
    data = _json(capsys, *argv)
    best = data["best"]
    stages = best["mesh"]["pipeline"]  # stages across the two hosts' network
    assert best["layout"] == "pipeline" and best["mesh"] == {
        "pipeline": stages,
        "data": 16 // stages,
    }
    assert best["pipeline"]["stages"] == stages > 1 and best["pipeline"]["link"] == "slow"
    m = best["pipeline"]["microbatches"]
    assert best["pipeline"]["bubble"] == pytest.approx((stages - 1) / (m + stages - 1))
    verdict = {v["role"]: v for v in data["verdicts"]}["pipeline"]
    assert verdict["proposed"] and verdict["kind"] == "communication"
    assert verdict["with"]["schedule"].startswith(f"{stages} stages")
    assert verdict["without"]["step_s"] > best["predicted_step_s"]
    assert data["counts"]["compiled"] == 0  # a pipelined row is priced, never compiled here
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "pipelines (the layers cut into stages over 'pipeline'):" in out
    assert f"  #1 {stages}x{16 // stages} pipeline,data pipeline: {stages} stages, " in out
    assert "  pipeline: proposed (communication): pipeline pays: " in out
    assert "  expert: not proposed (absent): " in out


def test_search_says_why_not_where_no_stage_count_splits_the_layers(here, capsys):
    (here / "three.py").write_text(STACK + "\n\ndef three():\n    return stack(3, 1024, 256)\n")
    data = _json(capsys, "search", "--model", "three:three", "--devices", "8", "--profile", "h100")
    verdict = {v["role"]: v for v in data["verdicts"]}["pipeline"]
    assert (verdict["proposed"], verdict["kind"]) == (False, "absent")
    assert "no pipeline of 8 devices splits 3 layers" in verdict["reason"]
    assert all(r["pipeline"] is None for r in data["rows"])


def test_plan_profile_prices_the_pipeline_as_predict_and_the_search_do(here, capsys):
    search = _json(
        capsys, "search", "--model", "stackmodel:stack", "--devices", "16", "--profile", "h100"
    )
    row = search["best"]
    m = row["pipeline"]["microbatches"]
    argv = [
        "plan",
        "--model",
        "stackmodel:stack",
        "--rules",
        "pipeline",
        "--mesh",
        "x".join(str(n) for n in row["mesh"].values()),
        "--profile",
        "h100",
        "--microbatches",
        str(m),
    ]
    data = _json(capsys, *argv)
    pred = data["prediction"]
    assert pred["predicted_step_s"] == pytest.approx(row["predicted_step_s"], rel=1e-9)
    assert pred["memory_bytes_per_device"] == row["memory_bytes_per_device"]
    assert pred["pipeline"] == row["pipeline"]
    assert pred["comm_bytes"]["collective-permute"] == row["pipeline"]["send_bytes"] > 0
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    n = row["pipeline"]["stages"]
    assert f"pipeline {n} stages x {m} microbatches (GPipe, {m + n - 1} iterations): bubble " in out
    assert "over the slow link" in out and f"each stage holds 1/{n} of the layers" in out


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        ([], "no pipeline microbatches were given"),
        (["--microbatches", "1"], "1 microbatches are fewer than the 2 stages"),
        (["--microbatches", "3"], "a batch of 4096 does not split into 3 microbatches"),
        (["--microbatches", "4", "--grad-accum", "2"], "gradient accumulation (2 microbatches)"),
    ],
)
def test_plan_refuses_a_schedule_the_pipeline_cannot_run(here, capsys, flags, fragment):
    argv = [
        "plan",
        "--model",
        "stackmodel:stack",
        "--rules",
        "pipeline",
        "--mesh",
        "2x8",
        "--profile",
        "h100",
        *flags,
    ]
    assert cli.main(argv) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow
def test_a_pipelined_search_row_trains_with_its_printed_command(tmp_path, capsys, monkeypatch):
    import meshplan
    from meshplan.cli.search import train_command
    from meshplan.models.registry import example
    from meshplan.models.transformer import config_from_name

    monkeypatch.chdir(tmp_path)
    built = example("transformer", config_from_name("tiny"), "tiny")
    result = meshplan.search_rules(
        8,
        built.model.abstract_state(),
        built.model.step,
        built.batch(8, 16),
        profile="h100",
        layouts=["pipeline"],
        max_axes=0,
        compile_top=0,
    )
    best = result.best
    assert best.layout == "pipeline" and best.pipeline is not None
    best.write_rules("pp.json")
    command = shlex.split(train_command(best, "pp.json"))
    m = best.pipeline.schedule.microbatches
    assert command[command.index("--microbatches") + 1] == str(m)
    assert command[command.index("--axes") + 1] == "pipeline,data"
    argv = [*command[1:], "--size", "tiny", "--batch", "8", "--seq", "16", *TRAIN_FAST]
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert "final train loss" in capsys.readouterr().out
