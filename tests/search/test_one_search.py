"""One search: ``search_layouts`` and ``search_rules`` share one row and one result type, one
error for too few devices, and write nothing unless asked."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

import meshplan
import meshplan.layouts
from meshplan._search.search.result import PRUNE_REASONS, SearchRow
from meshplan._search.search.rule_search import example_search


def _case() -> tuple[dict, object, jax.ShapeDtypeStruct]:
    w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
    state = {"params": {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}}

    def step(s, x):
        return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["params"]["w"].value)

    return state, step, jax.ShapeDtypeStruct((32, 256), jnp.float32)


def test_both_searches_return_one_result_type_of_one_row_type():
    state, step, x = _case()
    by_bytes = meshplan.search_layouts(state, 4, batch=32)
    by_time = meshplan.search_rules(4, state, step, x, profile="h100", compile_top=0)
    assert type(by_bytes) is type(by_time) is meshplan.SearchResult
    assert meshplan.RuleSearchResult is meshplan.SearchResult
    assert {type(r) for r in [*by_bytes.rows, *by_time.rows]} == {SearchRow}
    assert (by_bytes.ranked_by, by_time.ranked_by) == ("static", "predicted")
    # The same questions have answers on both: ranked rows, the best, a row by name, counts.
    for result in (by_bytes, by_time):
        assert [r.rank for r in result.ok] == list(range(1, len(result.ok) + 1))
        assert result.best is result.ok[0]
        assert result.row("2x2", "fsdp").layout == "fsdp"
    assert by_bytes.counts["enumerated"] == len(by_bytes.rows) == 12  # 4 layouts x 3 shapes
    assert by_time.counts["enumerated"] > len(by_time.rows)  # symmetric generated ones dropped


def test_both_searches_give_rows_as_the_same_plain_data():
    state, step, x = _case()
    by_bytes = meshplan.search_layouts(state, 4, batch=32).to_dict()
    by_time = meshplan.search_rules(4, state, step, x, profile="h100", compile_top=0).to_dict()
    json.dumps([by_bytes, by_time])  # plain JSON
    assert set(by_bytes) == set(by_time)
    # One row type: a static row has every field a predicted one has, but the prediction's
    # figures against the profile (tokens/s, MFU, memory by kind).
    assert set(by_bytes["best"]) < set(by_time["best"])
    assert {"predicted_step_s", "comm", "bytes_per_device"} <= set(by_bytes["best"])
    assert by_bytes["best"]["predicted_step_s"] is None and by_time["best"]["comm"] is None
    assert by_bytes["best"]["bytes_per_device"] > 0 and by_time["best"]["predicted_step_s"] > 0


def test_search_rules_without_generated_axes_searches_only_the_layouts():
    state, step, x = _case()
    result = meshplan.search_rules(
        4,
        state,
        step,
        x,
        profile="h100",
        compile_top=0,
        layouts=["fsdp", "tensor_parallel"],
        max_axes=0,
    )
    assert {r.layout for r in result.rows} == {"fsdp", "tensor_parallel"}
    assert {r.mesh_text for r in result.rows} <= {"1x4", "2x2", "4x1"}


@pytest.mark.parametrize(
    "search",
    [
        lambda state, step, x: meshplan.search_layouts(
            state, 4096, measure=True, step_fn=step, example_batch=x
        ),
        lambda state, step, x: meshplan.search_rules(4096, state, step, x, measure=True),
    ],
    ids=["search_layouts", "search_rules"],
)
def test_too_few_devices_to_measure_is_one_error(search):
    state, step, x = _case()
    with pytest.raises(meshplan.MeshError, match="needs 4096 devices; JAX has 8") as info:
        search(state, step, x)
    assert info.value.problems[0].code == "too-few-devices"
    assert "xla_force_host_platform_device_count=4096" in str(info.value)


def test_a_search_writes_nothing_and_a_row_writes_its_rules_when_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = example_search()
    assert not hasattr(result, "train_command") and not hasattr(result.best, "train_command")
    assert not list(tmp_path.iterdir())
    result.best.write_rules(str(tmp_path / "best.json"))
    assert [p.name for p in tmp_path.iterdir()] == ["best.json"]
    rules = meshplan.layouts.get_layout(str(tmp_path / "best.json"))
    assert rules == tuple(result.best.rules)


def test_the_shared_example_search_runs_once_per_process():
    assert example_search() is example_search()
    assert example_search().best.layout == "tensor_parallel"


def test_search_layouts_is_search_rules_without_a_step():
    state, _, _ = _case()
    by_layouts = meshplan.search_layouts(state, 4, batch=32, memory_budget_bytes=200_000)
    by_rules = meshplan.search_rules(
        4,
        state,
        layouts=["data_parallel", "fsdp", "tensor_parallel", "fsdp_tp"],
        batch=32,
        memory_budget_bytes=200_000,
    )
    assert by_rules.ranked_by == "static" and by_rules.profile is None
    by_layouts_data, by_rules_data = by_layouts.to_dict(), by_rules.to_dict()
    for data in (by_layouts_data, by_rules_data):
        data.pop("seconds")
    assert by_layouts_data == by_rules_data


def test_the_one_search_ranks_both_ways_and_never_on_its_own_elsewhere():
    import inspect

    import meshplan._search.search.layout_search as step_less

    # search_layouts holds no ranking, no candidates and no checks of its own.
    source = inspect.getsource(step_less)
    for own in ("sorted(", ".sort(", "_static_key", "layout_candidates", "explain(", "validate("):
        assert own not in source


def test_a_static_search_with_a_step_traces_nothing(monkeypatch):
    import meshplan._search.search.rule_search as rule_search

    def no_trace(*args, **kwargs):
        raise AssertionError("the static ranking traced the step")

    monkeypatch.setattr(rule_search, "trace_workload", no_trace)
    state, step, x = _case()
    result = meshplan.search_rules(4, state, step, x, ranked_by="static", compile_top=0)
    assert result.ranked_by == "static" and result.batch == 32
    assert result.best is not None and result.best.cost is None


def test_search_rules_refuses_a_batch_other_than_its_example_batch():
    state, step, x = _case()
    with pytest.raises(meshplan.ArgumentError, match="batch=16") as info:
        meshplan.search_rules(4, state, step, x, batch=16, compile_top=0)
    assert info.value.problems[0].code == "bad-batch"


def test_a_static_search_needs_a_state():
    with pytest.raises(meshplan.ArgumentError) as info:
        meshplan.search_rules(4, ranked_by="static")
    assert info.value.problems[0].code == "missing-argument"


def test_why_a_row_was_dropped_is_a_record_not_text_to_parse():
    state, step, x = _case()
    by_bytes = meshplan.search_layouts(state, 4, batch=6)
    by_time = meshplan.search_rules(4, state, step, x, profile="h100", compile_top=0)
    for result in (by_bytes, by_time):
        assert {r.pruned_by for r in result.ok} == {None}
        dropped = [r for r in result.rows if r.status != "ok"]
        assert dropped and all(r.pruned_by in PRUNE_REASONS for r in dropped)
        assert sum(result.counts["pruned"].values()) >= len(dropped)
        assert result.to_dict()["rows"][-1]["pruned_by"] == dropped[-1].pruned_by
    assert {r.pruned_by for r in by_bytes.rows if r.status != "ok"} == {"batch"}


def test_a_static_search_refuses_what_the_predicted_one_refuses():
    state, step, x = _case()
    with pytest.raises(meshplan.ArgumentError, match="no step to trace"):
        meshplan.search_rules(4, state, ranked_by="predicted")
    with pytest.raises(meshplan.ArgumentError, match="runs the step") as info:
        meshplan.search_rules(4, state, measure=True)
    assert info.value.problems[0].code == "missing-argument"
    with pytest.raises(meshplan.MeshError) as info:
        meshplan.search_rules(4096, state, step, x, ranked_by="static", measure=True)
    assert info.value.problems[0].code == "too-few-devices"
