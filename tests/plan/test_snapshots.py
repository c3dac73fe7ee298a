"""Golden snapshots of the demo model's plan, and what a snapshot failure says.

Rewrite the snapshots after an intended change with
``MESHPLAN_UPDATE_SNAPSHOTS=1 .venv/bin/pytest tests/plan/test_snapshots.py``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import meshplan
from meshplan.models.mlp import LOGICAL_RULES, MLP, LogicalMLP, init_fn
from meshplan.testing import UPDATE_ENV, assert_plan_matches, diff_snapshots, snapshot

SNAPSHOTS = Path(__file__).parent / "snapshots"
MESH = {"data": 2, "model": 4}


@functools.cache
def guide_state(model_name: str):
    model = {
        "logical": LogicalMLP(4, 1024, False),
        "logical_scan": LogicalMLP(4, 1024, True),
        "mesh_axes": MLP(4, 1024, False),
    }[model_name]
    return jax.eval_shape(
        functools.partial(init_fn, model=model, optimizer=optax.adam(1e-3)),
        jax.random.key(0),
        jax.ShapeDtypeStruct((8, 1024), jnp.float32),
    )


@pytest.mark.parametrize(
    ("model_name", "snapshot_name"),
    [
        ("logical", "mlp_guide.json"),
        ("logical_scan", "mlp_guide_scan.json"),
        ("mesh_axes", "mlp_mesh_axes.json"),
    ],
)
def test_demo_model_plan_matches_snapshot(model_name, snapshot_name):
    plan = meshplan.explain(guide_state(model_name), MESH, LOGICAL_RULES)
    assert_plan_matches(plan, SNAPSHOTS / snapshot_name)


def test_changed_rule_shows_which_parameter_moved(monkeypatch):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    changed = (("batch", "data"), ("embed", "model"))  # was ('hidden', 'model')
    plan = meshplan.explain(guide_state("logical"), MESH, changed)
    with pytest.raises(AssertionError) as info:
        assert_plan_matches(plan, SNAPSHOTS / "mlp_guide.json")
    message = str(info.value)
    assert "mlp_guide.json" in message
    assert (
        "params/LogicalDotReluDot_0/Dense_0/kernel: spec P(None, 'model') -> P('model', None); "
        "shard shape (1024, 256) -> (256, 1024)"
    ) in message
    assert "params/LogicalDotReluDot_0/W2: spec P('model', None) -> P(None, 'model')" in message
    assert (
        "opt_state/0/mu/LogicalDotReluDot_3/W2: spec P('model', None) -> P(None, 'model')"
        in message
    )
    assert (
        "rules: [['batch', 'data'], ['hidden', 'model']] -> [['batch', 'data'], ['embed', 'model']]"
        in message
    )
    assert f"rerun with {UPDATE_ENV}=1" in message


def test_replicating_a_parameter_shows_the_bytes(monkeypatch, tmp_path):
    monkeypatch.delenv(UPDATE_ENV, raising=False)
    tree = {
        "params": {
            "w": meshplan.LogicallyPartitioned(
                jax.ShapeDtypeStruct((1024, 1024), jnp.float32), ("embed", "hidden")
            )
        }
    }
    path = tmp_path / "w.json"
    assert_plan_matches(meshplan.explain(tree, MESH, (("hidden", "model"),)), path, update=True)
    with pytest.raises(AssertionError) as info:
        assert_plan_matches(meshplan.explain(tree, MESH, ()), path)
    message = str(info.value)
    assert "params/w: spec P(None, 'model') -> P(None, None)" in message
    assert "bytes per device 1.00 MiB -> 4.00 MiB; replication 2 -> 8" in message
    assert "totals[all]: fullest device 1.00 MiB -> 4.00 MiB" in message


def test_added_and_removed_leaves_are_listed():
    old = {"leaves": {"a": {"spec": [None]}, "b": {"spec": ["model"]}}}
    new = {"leaves": {"b": {"spec": ["model"]}, "c": {"spec": ["data"], "shape": [4]}}}
    assert diff_snapshots(old, new) == [
        "a: removed (was P(None))",
        "c: added (P('data'), shape [4])",
    ]


def test_env_var_rewrites_the_snapshot(monkeypatch, tmp_path):
    path = tmp_path / "deep" / "plan.json"
    plan = meshplan.explain(guide_state("logical"), MESH, LOGICAL_RULES)
    monkeypatch.setenv(UPDATE_ENV, "1")
    assert_plan_matches(plan, path)
    first = path.read_text()
    assert_plan_matches(plan, path)
    assert path.read_text() == first  # stable bytes: no churn on rewrite
    monkeypatch.setenv(UPDATE_ENV, "0")
    assert_plan_matches(plan, path)  # compares, matches
    other = meshplan.explain(guide_state("logical"), {"data": 4, "model": 2}, LOGICAL_RULES)
    with pytest.raises(AssertionError, match=r"mesh: \{'data': 2, 'model': 4\} -> \{'data': 4"):
        assert_plan_matches(other, path)


def test_snapshot_file_has_one_leaf_per_line():
    text = (SNAPSHOTS / "mlp_guide.json").read_text()
    kernel = [line for line in text.splitlines() if "LogicalDotReluDot_0/Dense_0/kernel" in line]
    assert len(kernel) == 3  # params, mu, nu
    data = json.loads(text)
    assert data["schema"] == "meshplan.snapshot/1"
    assert data == json.loads(
        json.dumps(snapshot(meshplan.explain(guide_state("logical"), MESH, LOGICAL_RULES)))
    )
