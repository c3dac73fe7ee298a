"""``meshplan.predict``: one layout's prediction, the same as the search's row for that layout
and as ``meshplan plan --profile`` prints."""

from __future__ import annotations

import math

import pytest

import meshplan
from meshplan import cli
from meshplan.models.llama import LlamaConfig, llama_step

# A Llama decoder with MaxText's activation constraints ('activation_embed'), grouped-query
# attention and a scanned, rematerialised stack: where the search's matmul cache once reused
# another candidate's all-reduce for a reduce-scatter into a constraint's shards.
CFG = LlamaConfig(
    embed=128, heads=4, kv_heads=2, head_dim=32, mlp=256, layers=2, vocab=256, remat="full"
)


@pytest.fixture(scope="module")
def llama():
    return llama_step(CFG, batch=16, seq=64)


def test_predict_gives_every_searched_row_its_own_figures(llama):
    state, step, batch = llama
    work = meshplan.trace_workload(step, state, batch, read_constraints=True)
    result = meshplan.search_rules(8, workload=work, profile="h100", compile_top=0)
    assert len(result.ok) > 50
    splits_activations = pipelines = 0
    for row in result.ok:
        # a pipelined row: predicted with the schedule the search priced it with
        m = None if row.pipeline is None else row.pipeline.schedule.microbatches
        p = meshplan.predict(
            workload=work, mesh=row.mesh, rules=row.rules, profile="h100", pipeline_microbatches=m
        )
        assert p.cost == row.cost, f"{row.mesh_text} {row.short_rules}"
        assert (p.pipeline is None) == (row.pipeline is None)
        splits_activations += "activation_embed=" in row.short_rules
        pipelines += row.pipeline is not None
    assert splits_activations > 5  # the rows the cache priced wrong are among them
    assert pipelines > 0  # the Llama's layer stack: pipelines among the rows


def test_plan_prints_what_predict_returns(capsys):
    code = cli.main(
        [
            "plan",
            "--model",
            "transformer",
            "--size",
            "tiny",
            "--mesh",
            "2x4",
            "--rules",
            "fsdp_tp",
            "--profile",
            "tpu_v5e",
            "--batch",
            "16",
            "--seq",
            "64",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    import argparse

    from meshplan.cli.steps import example_of, step_and_batch

    args = argparse.Namespace(model="transformer", size="tiny", batch=16, seq=64)
    model_state = example_of(args).model.abstract_state()
    step, tokens = step_and_batch(args)
    p = meshplan.predict(
        model_state, step, tokens, mesh={"data": 2, "model": 4}, rules="fsdp_tp", profile="tpu_v5e"
    )
    for line in p.lines():
        assert line in printed


@pytest.mark.parametrize(
    ("mesh", "says"),
    [
        ({}, "expected axis sizes"),
        ({"data": 0}, "of size 0"),
        ({"data": 2.5}, "of size 2.5"),
        ("2x4", "mesh='2x4'"),
    ],
)
def test_a_bad_mesh_is_named(llama, mesh, says):
    state, step, batch = llama
    with pytest.raises(meshplan.ArgumentError, match=says) as info:
        meshplan.predict(state, step, batch, mesh=mesh, rules="fsdp", profile="h100")
    assert info.value.problems[0].path == "mesh"


def test_a_bad_budget_or_no_step_is_refused(llama):
    state, step, batch = llama
    with pytest.raises(meshplan.ArgumentError, match="memory_budget_bytes=nan"):
        meshplan.predict(
            state,
            step,
            batch,
            mesh={"data": 8},
            rules="fsdp",
            memory_budget_bytes=math.nan,
            profile="h100",
        )
    with pytest.raises(meshplan.ArgumentError, match="no step to trace"):
        meshplan.predict(state, mesh={"data": 8}, rules="fsdp", profile="h100")


def test_a_step_predicted_within_5_percent_of_the_budget_is_said_to_fit_only_narrowly():
    from meshplan._search.predict.cost import Cost
    from meshplan._search.predict.profiles import get_profile
    from meshplan._search.predict.report import prediction_fields, prediction_lines

    v5e = get_profile("tpu_v5e")

    def memory_line(state_gib: float) -> str:
        cost = Cost(2.0, 1.5, 0.1, 0.4, 2e14, {}, {}, int(state_gib * 2**30), 0, 10, 0, 0, 1.0)
        fields = prediction_fields(cost, 1 << 20, 256, v5e, v5e.memory_bytes)
        return prediction_lines(fields)[2]

    assert "(fits, within 5% of the budget: XLA may need more)" in memory_line(15.4)
    assert "(fits):" in memory_line(12.0)
    assert "(OVER the budget)" in memory_line(16.0)


def test_a_step_writing_new_memory_says_how_much_and_why():
    import dataclasses

    from meshplan._search.predict.cost import Cost
    from meshplan._search.predict.profiles import get_profile
    from meshplan._search.predict.report import prediction_fields, prediction_lines

    cpu = dataclasses.replace(get_profile("h100"), name="cpu", fresh_bytes=32 << 20)
    acts, temps = 30 << 20, 10 << 20
    touched = Cost(1.0, 0.5, 0.3, 0.2, 1e12, {}, {}, 0, acts, 1, temps, first_touch_s=0.25)
    lines = prediction_lines(prediction_fields(touched, 0, 8, cpu, 8 << 30))
    assert "memory traffic 300.000 ms, 250.000 ms of it writing new memory" in lines[0]
    assert lines[-1].startswith("note: the step's activations and temporaries (40.00 MiB")
    assert "reach 32.00 MiB" in lines[-1] and "a smaller batch a device" in lines[-1]
    accumulated = dataclasses.replace(touched, accumulator_bytes=8 << 20)  # priced on it too
    note = prediction_lines(prediction_fields(accumulated, 0, 8, cpu, 8 << 30))[-1]
    assert "(48.00 MiB a device, its gradient accumulator included)" in note
    plain = dataclasses.replace(touched, first_touch_s=0.0)
    assert not any(
        "new memory" in line
        for line in prediction_lines(prediction_fields(plain, 0, 8, cpu, 8 << 30))
    )
