"""The planner's inputs are checked in one place: profiles (built, from JSON, by name) and the
arguments of the searches and of predict, each problem naming the field, the value and the fix."""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import pytest

import meshplan

H100 = meshplan.get_profile("h100").to_dict()


def _step(state, x):
    return jax.grad(lambda w: ((x @ w) ** 2).mean())(state["w"].value)


STATE = {
    "w": meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((64, 64), jnp.float32), ("embed", "mlp")
    )
}
BATCH = jax.ShapeDtypeStruct((16, 64), jnp.float32)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("peak_flops", math.nan, "peak_flops is nan: not a finite number"),
        ("memory_bandwidth", math.inf, "memory_bandwidth is inf: not a finite number"),
        ("overlap", 5, "overlap is 5: out of range"),
        ("matmul_efficiency", 0, "matmul_efficiency is 0: out of range"),
        ("matmul_efficiency", 1.5, "matmul_efficiency is 1.5: out of range"),
        ("domain_devices", 0, "domain_devices is 0: out of range"),
        ("domain_devices", 2.5, "domain_devices is 2.5: not a whole number"),
        ("memory_bytes", "lots", "memory_bytes is 'lots': a str, not a number"),
        ("latency_s", -1e-6, "latency_s is -1e-06: out of range"),
        ("fused_attention", 1, "fused_attention is 1: expected true or false"),
        ("name", "", "name is '': expected a non-empty text"),
    ],
)
def test_a_bad_figure_is_refused_alike_by_the_constructor_and_json(tmp_path, field, value, says):
    with pytest.raises(meshplan.ArgumentError, match=f"profile.{field}: {_re(says)}") as built:
        meshplan.HardwareProfile(**{**H100, field: value})
    assert [(p.code, p.path) for p in built.value.problems] == [
        ("profile-field", f"profile.{field}")
    ]
    assert built.value.problems[0].fix  # the expected form, with an example
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**H100, field: value}))  # NaN and Infinity as JSON writes them
    with pytest.raises(meshplan.ArgumentError, match=_re(says)) as loaded:
        meshplan.load_profile(str(path))
    assert [p.path for p in loaded.value.problems] == [f"{path}.{field}"]


def _re(text: str) -> str:
    import re

    return re.escape(text)


def test_json_accepts_whole_number_floats_and_suggests_the_nearest_field(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({**H100, "memory_bytes": 94e9, "domain_devices": 8.0}))
    profile = meshplan.load_profile(path)  # a pathlib.Path too
    assert (profile.memory_bytes, profile.domain_devices) == (94_000_000_000, 8)
    assert isinstance(profile.memory_bytes, int)
    data = {**H100, "overlapp": 0.5}
    del data["overlap"]
    path.write_text(json.dumps(data))
    with pytest.raises(meshplan.ArgumentError, match=r"did you mean 'overlap'\?") as info:
        meshplan.load_profile(str(path))
    assert "Rename it 'overlap'" in info.value.problems[0].fix


def test_every_problem_of_a_profile_is_raised_at_once():
    with pytest.raises(meshplan.ArgumentError) as info:
        meshplan.HardwareProfile(**{**H100, "overlap": 5, "peak_flops": math.nan, "latency_s": -1})
    assert {p.path for p in info.value.problems} == {
        "profile.overlap",
        "profile.peak_flops",
        "profile.latency_s",
    }


@pytest.mark.parametrize(
    ("call", "path", "says"),
    [
        (lambda: meshplan.get_profile(None), "profile", "profile is None (NoneType)"),
        (lambda: meshplan.get_profile(3), "profile", "profile is 3 (int)"),
        (lambda: meshplan.get_profile("h100", 0), "devices", "devices=0 is less than 1"),
        (lambda: meshplan.load_profile({"name": "x"}), "path", "got a dict"),
        (lambda: meshplan.search_rules("8", STATE, _step, BATCH), "devices", "devices='8' (str)"),
        (lambda: meshplan.search_rules(8.5, STATE, _step, BATCH), "devices", "devices=8.5 (float)"),
        (lambda: meshplan.search_rules(0, STATE, _step, BATCH), "devices", "devices=0 is less"),
        (lambda: meshplan.search_rules(True, STATE, _step, BATCH), "devices", "devices=True"),
        (
            lambda: meshplan.search_rules(8, STATE, _step, BATCH, memory_budget_bytes=-1),
            "memory_budget_bytes",
            "memory_budget_bytes=-1",
        ),
        (
            lambda: meshplan.search_rules(8, STATE, _step, BATCH, memory_budget_bytes=math.nan),
            "memory_budget_bytes",
            "memory_budget_bytes=nan",
        ),
        (
            lambda: meshplan.search_rules(8, STATE, _step, BATCH, memory_budget_bytes="lots"),
            "memory_budget_bytes",
            "memory_budget_bytes='lots'",
        ),
        (
            lambda: meshplan.search_rules(8, STATE, _step, BATCH, roles=["bogus"]),
            "roles",
            "'bogus' is not a role",
        ),
        (
            lambda: meshplan.search_rules(8, STATE, _step, BATCH, roles="data"),
            "roles",
            "a str, not a list of roles",
        ),
        (lambda: meshplan.search_rules(8, STATE, _step, BATCH, max_axes=-1), "max_axes", "-1"),
        (lambda: meshplan.search_rules(8, STATE, _step, BATCH, max_axes=2.0), "max_axes", "2.0"),
        (
            lambda: meshplan.search_rules(8, STATE, _step, BATCH, compile_top=-1),
            "compile_top",
            "compile_top=-1 is less than 0",
        ),
        (lambda: meshplan.search_rules(8, STATE, _step, BATCH, names="embed"), "names", "names="),
        (
            lambda: meshplan.search_rules(8, STATE, max_axes=0),
            "max_axes",
            "without a step searches only the layouts",
        ),
        (lambda: meshplan.search_rules(8, STATE, roles=["data"]), "roles", "would be ignored"),
        (lambda: meshplan.search_layouts(STATE, "8"), "devices", "devices='8'"),
        (lambda: meshplan.search_layouts(STATE, 8, batch=0), "batch", "batch=0 is less than 1"),
        (
            lambda: meshplan.search_layouts(STATE, 8, memory_budget_bytes=-1),
            "memory_budget_bytes",
            "memory_budget_bytes=-1",
        ),
    ],
)
def test_a_bad_argument_is_named_with_its_value_and_fix(call, path, says):
    with pytest.raises(meshplan.ArgumentError, match=_re(says)) as info:
        call()
    assert info.value.problems[0].path == path
    assert info.value.problems[0].fix


def test_a_whole_number_budget_is_used_and_max_axes_0_searches_the_layouts_only():
    result = meshplan.search_rules(
        8,
        STATE,
        _step,
        BATCH,
        profile="h100",
        compile_top=0,
        max_axes=0,
        memory_budget_bytes=16e9,
    )
    assert result.budget_bytes == 16 * 10**9 and isinstance(result.budget_bytes, int)
    assert {r.layout for r in result.ok} <= set(meshplan.layouts.LAYOUTS)


def test_a_profile_replaced_with_a_bad_figure_is_refused():
    with pytest.raises(meshplan.ArgumentError, match="overlap is 2"):
        dataclasses.replace(meshplan.get_profile("h100"), overlap=2)
