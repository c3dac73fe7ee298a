"""``search_rules`` asked with three records (what it searches, what it prices on, what it
compiles), and with the keywords it took before them: the same search either way."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan._search.predict.pipeline import example_stack


def _rows(result):
    return [(r.mesh_text, r.short_rules, r.layout, r.cost.step_s) for r in result.ok]


def test_the_records_search_what_the_keywords_searched():
    work = example_stack()
    old = meshplan.search_rules(
        8,
        workload=work,
        profile="h100",
        memory_budget_bytes=2**30,
        max_axes=2,
        roles=("data", "fsdp"),
        compile_top=0,
    )
    new = meshplan.search_rules(
        8,
        workload=work,
        space=meshplan.SearchSpace(max_axes=2, roles=("data", "fsdp")),
        hardware=meshplan.SearchHardware("h100", 2**30),
        checks=meshplan.SearchChecks(compile_top=0),
    )
    assert _rows(new) == _rows(old) and new.budget_bytes == old.budget_bytes == 2**30
    mixed = meshplan.search_rules(
        8,
        workload=work,
        hardware=meshplan.SearchHardware("h100", 2**30),
        max_axes=2,
        roles=("data", "fsdp"),
        compile_top=0,
    )
    assert _rows(mixed) == _rows(old)


def test_a_keyword_and_the_record_that_holds_it_are_refused_together():
    with pytest.raises(meshplan.ArgumentError, match=r"got profile= and hardware=") as info:
        meshplan.search_rules(
            8, workload=example_stack(), profile="h100", hardware=meshplan.SearchHardware("h200")
        )
    (problem,) = info.value.problems
    assert (problem.code, problem.path) == ("bad-argument", "profile")
    assert "SearchHardware(profile=...)" in problem.fix


def test_an_unknown_keyword_names_the_ones_taken():
    with pytest.raises(meshplan.ArgumentError, match=r"unexpected keyword 'budget'") as info:
        meshplan.search_rules(8, workload=example_stack(), budget=2**30)  # type: ignore[call-arg]
    assert "memory_budget_bytes" in info.value.problems[0].fix


def test_a_step_less_search_takes_the_records_too():
    w = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((1024, 64), jnp.float32), ("embed", "mlp")
    )
    result = meshplan.search_rules(
        8, {"w": w}, space=meshplan.SearchSpace(layouts=["fsdp", "data_parallel"])
    )
    assert result.ranked_by == "static" and result.best.layout == "fsdp"
