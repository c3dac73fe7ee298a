"""meshplan.check: every problem at once, with path, message and fix; strict mode."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._plan.render.table import to_text
from meshplan.models.mlp import LOGICAL_RULES, LogicalMLP, init_fn
from trees import logical, mesh_box, sds

MESH = {"data": 2, "model": 4}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


# Each case: a tree and rules with exactly one problem of interest, and what the
# problem must say: (severity, code, path, fragments of message + fix).
CASES = {
    "indivisible": (
        {"params": {"w": logical(1000, 6, names=("embed", "hidden"))}},
        (("embed", "data"), ("hidden", "model")),
        (
            "error",
            "indivisible",
            "params/w",
            ["dim 1 ('hidden') of size 6", "by 4", "Pad dim 1 to 8"],
        ),
    ),
    "indivisible-tuple": (
        {"params": {"w": logical(12, names=("embed",))}},
        (("embed", ("data", "model")),),
        (
            "error",
            "indivisible",
            "params/w",
            ["size 12 does not divide by 8", "'data'×'model' of sizes 2×4", "Pad dim 0 to 16"],
        ),
    ),
    "rank": (
        {"params": {"w": mesh_box(8, 8, names=("model", None, None))}},
        (),
        (
            "error",
            "rank",
            "params/w",
            ["3 axis names", "rank 2", "(8, 8)", "at most one name (or None) per dimension"],
        ),
    ),
    "unknown-mesh-axis": (
        {"params": {"w": mesh_box(8, 8, names=("modle", None))}},
        (),
        (
            "error",
            "unknown-axis",
            "params/w",
            ["'modle'", "{'data': 2, 'model': 4}", "Did you mean 'model'?"],
        ),
    ),
    "axis-on-two-dims": (
        {"params": {"w": mesh_box(8, 8, names=(("data", "model"), "model"))}},
        (),
        (
            "error",
            "duplicate-axis",
            "params/w",
            ["mesh axis 'model' is used by dims 0 and 1", "at most one dimension"],
        ),
    ),
    "rule-not-a-pair": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        (("hidden", "model"), ("embed",)),
        (
            "error",
            "bad-rule",
            "rules[1]",
            ["('embed',) is not a (name, mesh_axes) pair", "sequence of pairs, e.g."],
        ),
    ),
    "rules-a-dict": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        {"hidden": "model"},
        ("error", "bad-rule", "rules", ["got a dict", "tuple(rules.items())"]),
    ),
    "rules-a-flat-pair": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        ("hidden", "model"),
        ("error", "bad-rule", "rules", ["single flat pair", "(('hidden', 'model'),)"]),
    ),
    "rule-unknown-mesh-axis": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        (("embed", "data"), ("hidden", "modle")),
        (
            "error",
            "rule-unknown-axis",
            "rules[1]",
            [
                "('hidden', 'modle')",
                "names mesh axis 'modle'",
                "places 1 leaf: params/w",
                "Did you mean 'model'?",
            ],
        ),
    ),
    "no-rules-at-all": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        (),
        (
            "error",
            "no-rules",
            "params/w",
            ["no rules are given or active", "logical_axis_rules(rules)"],
        ),
    ),
    "name-without-rule": (
        {
            "params": {
                "w": logical(8, 8, names=("embed", "hidden")),
                "v": logical(8, names=("hidden",)),
            }
        },
        (("embed", "data"), ("mlp", "model")),
        (
            "warning",
            "no-rule",
            "params/v",
            ["'hidden' is placed by no rule", "replicated in 2 leaves", "Add a rule for 'hidden'"],
        ),
    ),
    "name-whose-rules-were-skipped": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        (("embed", "model"), ("hidden", "model")),
        (
            "warning",
            "no-rule",
            "params/w",
            ["'hidden' is placed by no rule (rule 1 named it but was skipped)"],
        ),
    ),
    "dead-rule": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        (("embed", "data"), ("hidden", "model"), ("vocab", "model")),
        (
            "warning",
            "dead-rule",
            "rules[2]",
            [
                "('vocab', 'model') is never used",
                "no array dimension is named 'vocab'",
                "for activations",
            ],
        ),
    ),
    "shadowed-rule": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        (("embed", "data"), ("hidden", "model"), ("embed", "model")),
        (
            "warning",
            "dead-rule",
            "rules[2]",
            [
                "('embed', 'model') is never used",
                "named 'embed' in 1 leaf (params/w) and was skipped each time",
            ],
        ),
    ),
    "idle-mesh-axis": (
        {"params": {"w": logical(8, 8, names=("embed", "hidden"))}},
        (("embed", None), ("hidden", "model")),
        (
            "warning",
            "idle-axis",
            "mesh/data",
            ["'data' (size 2) shards no array", "same bytes", "('embed', 'data')"],
        ),
    ),
    "large-replicated": (
        {
            "params": {
                "w": mesh_box(1024, 512, names=(None, None)),
                "b": mesh_box(4, names=("model",)),
            }
        },
        (),
        (
            "warning",
            "replicated",
            "params/w",
            [
                "2.00 MiB array (1024, 512) float32 is fully replicated",
                "each of the 8 devices",
                "Name a mesh axis",
            ],
        ),
    ),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_check_finds(case):
    tree, rules, (severity, code, path, fragments) = CASES[case]
    problems = meshplan.check(tree, MESH, rules)
    found = [p for p in problems if p.code == code]
    assert found, f"no {code!r} problem in {problems}"
    problem = found[0]
    assert (problem.severity, problem.path) == (severity, path)
    text = f"{problem.message}. {problem.fix}"
    for fragment in fragments:
        assert fragment in text


def test_a_clean_plan_has_no_problems(mesh):
    tree = {"params": {"w": logical(8, 8, names=("embed", "hidden"))}, "step": sds()}
    assert meshplan.check(tree, mesh, (("embed", "data"), ("hidden", "model"))) == []


def test_errors_come_before_warnings():
    tree = {"params": {"a": logical(6, 8, names=("x", "y")), "b": logical(8, names=("z",))}}
    problems = meshplan.check(tree, MESH, (("x", "model"), ("unused", "data")))
    severities = [p.severity for p in problems]
    assert severities == sorted(severities)  # 'error' < 'warning'
    assert {p.code for p in problems} == {"indivisible", "no-rule", "dead-rule", "idle-axis"}


def test_each_failing_leaf_is_listed():
    tree = {"params": {f"w{i}": logical(6, names=("x",)) for i in range(3)}}
    problems = meshplan.check(tree, MESH, (("x", "model"),))
    assert [p.path for p in problems if p.code == "indivisible"] == [
        "params/w0",
        "params/w1",
        "params/w2",
    ]


def test_replicated_threshold():
    tree = {"params": {"w": mesh_box(64, 64, names=(None, None))}}  # 16 KiB
    assert not [p for p in meshplan.check(tree, MESH) if p.code == "replicated"]
    low = meshplan.check(tree, MESH, replicated_threshold_bytes=16 * 1024)
    assert [p.path for p in low if p.code == "replicated"] == ["params/w"]


def test_mesh_of_one_device_replicates_nothing_worth_reporting():
    tree = {"params": {"w": mesh_box(2048, 2048, names=(None, None))}}
    assert meshplan.check(tree, {"data": 1}) == []


def test_guide_plan_warnings(mesh):
    state = jax.eval_shape(
        functools.partial(init_fn, model=LogicalMLP(2, 64, False), optimizer=optax.adam(1e-3)),
        jax.random.key(0),
        sds(8, 64),
    )
    problems = meshplan.check(state, mesh, LOGICAL_RULES)
    assert [(p.severity, p.code, p.path) for p in problems] == [
        ("warning", "no-rule", "params/LogicalDotReluDot_0/Dense_0/kernel"),
        # 'batch' names activations only, and 'data' splits the batch alone: information,
        # not warnings (they would show on every data-parallel model).
        ("info", "dead-rule", "rules[0]"),
        ("info", "idle-axis", "mesh/data"),
    ]


def test_plan_problems_equal_check(mesh):
    tree = {"params": {"w": logical(6, 8, names=("x", "y"))}}
    rules = (("x", "model"),)
    assert meshplan.explain(tree, mesh, rules).problems == meshplan.check(tree, mesh, rules)


def test_problem_str_and_dict():
    (problem,) = [
        p
        for p in meshplan.check({"w": logical(6, names=("x",))}, MESH, (("x", "model"),))
        if p.code == "indivisible"
    ]
    assert str(problem).startswith("error: w: dim 0 ('x') of size 6 does not divide by 4")
    assert problem.to_dict() == {
        "severity": "error",
        "code": "indivisible",
        "path": "w",
        "message": problem.message,
        "fix": problem.fix,
    }


# ---------------------------------------------------------------------------
# strict
# ---------------------------------------------------------------------------


def test_strict_raises_one_error_listing_every_path(mesh):
    tree = {
        "params": {
            "a": logical(6, 8, names=("x", "y")),
            "b": mesh_box(8, 8, names=("modle", None)),
            "c": logical(8, names=("y",)),
        }
    }
    with pytest.raises(meshplan.ShardingValidationError) as info:
        meshplan.check(tree, mesh, (("x", "model"), ("y", "dta")), strict=True)
    message = str(info.value)
    first, *rest = message.splitlines()
    assert first == (
        "The sharding plan has 3 errors. The mesh has shape {'data': 2, 'model': 4}, "
        "axis names ('data', 'model') (8 devices):"
    )
    bullets = [line for line in rest if line.startswith("  * ")]
    assert [b.split(":")[0] for b in bullets] == ["  * params/a", "  * params/b", "  * rules[1]"]
    fix_at = rest.index("To fix:")
    assert fix_at > max(rest.index(b) for b in bullets)
    assert "Pad dim 0 to 8" in message and "Did you mean 'model'?" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, meshplan.MeshplanError)
    assert {p.path for p in info.value.problems} >= {"params/a", "params/b", "rules[1]"}


def test_strict_ignores_warnings(mesh):
    tree = {"params": {"w": logical(8, 8, names=("embed", "hidden"))}}
    problems = meshplan.check(tree, mesh, (("hidden", "model"), ("vocab", None)), strict=True)
    assert {p.severity for p in problems} == {"warning"}


def test_strict_message_is_capped_for_huge_trees():
    tree = {"params": {f"w{i:03d}": logical(6, names=("x",)) for i in range(100)}}
    with pytest.raises(meshplan.ShardingValidationError, match=r"and 60 more \(meshplan\.check"):
        meshplan.check(tree, MESH, (("x", "model"),), strict=True)


def test_get_sharding_strict(mesh):
    tree = {"params": {"w": mesh_box(6, 8, names=("model", None))}}
    assert meshplan.get_sharding(tree, mesh)["params"]["w"].spec == P("model", None)  # Flax: fine
    with pytest.raises(meshplan.ShardingValidationError, match=r"params/w: dim 0 .* size 6"):
        meshplan.get_sharding(tree, mesh, strict=True)


def test_get_sharding_strict_uses_active_rules(mesh):
    tree = {"params": {"w": logical(8, 8, names=("embed", "hidden"))}}
    with meshplan.logical_axis_rules((("hidden", "model"),)):
        out = meshplan.get_sharding(tree, mesh, strict=True)
    assert out["params"]["w"].spec == P(None, "model")
    with pytest.raises(meshplan.ShardingValidationError, match="no rules are given or active"):
        meshplan.get_sharding(tree, mesh, strict=True)


def test_logical_to_mesh_sharding_strict(mesh):
    specs = {"w": P("embed", "hidden"), "step": P()}
    rules = (("embed", "data"), ("hidden", "modle"))
    with pytest.raises(
        meshplan.ShardingValidationError, match=r"rules\[1\].*'modle'.*places 1 leaf: w"
    ):
        meshplan.logical_to_mesh_sharding(specs, mesh, rules, strict=True)
    good = meshplan.logical_to_mesh_sharding(specs, mesh, (("hidden", "model"),), strict=True)
    assert good["w"].spec == P(None, "model")


def test_logical_to_mesh_sharding_strict_lists_every_bad_rule(mesh):
    with pytest.raises(meshplan.ShardingValidationError) as info:
        meshplan.logical_to_mesh_sharding(
            {"w": P("embed")}, mesh, (("embed",), ("x", 3), ("embed", "data")), strict=True
        )
    assert "rules[0]" in str(info.value) and "rules[1]" in str(info.value)


def test_an_unused_rule_to_none_is_not_a_dead_rule():
    tree = {"params": {"w": logical(8, 8, names=("embed", "hidden"))}}
    rules = (("embed", "data"), ("hidden", "model"), ("length", None), ("vocab", "model"))
    dead = [p.path for p in meshplan.check(tree, MESH, rules) if p.code == "dead-rule"]
    assert dead == ["rules[3]"]


def test_an_abstract_mesh_is_a_warning_naming_the_fix():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    tree = {"w": meshplan.Partitioned(jax.ShapeDtypeStruct((8, 8), jnp.float32), ("data", None))}
    (problem,) = [p for p in meshplan.check(tree, mesh.abstract_mesh) if p.code == "abstract-mesh"]
    assert problem.severity == "warning" and problem.path == "mesh"
    assert "jax.set_mesh" in problem.fix and "concrete" in problem.fix
    assert not [p for p in meshplan.check(tree, mesh) if p.code == "abstract-mesh"]
    # What the warning is about: on the abstract mesh, jit outside set_mesh fails; inside, works.
    shardings = meshplan.get_sharding(tree, mesh.abstract_mesh)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda: jnp.zeros((8, 8)), out_shardings=shardings["w"])()
    assert out.sharding.spec == P("data", None)


def test_fewer_names_than_dimensions_are_information_not_errors():
    tree = {
        "w": meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((8, 4, 2), jnp.float32), ("embed",))
    }
    problems = meshplan.check(tree, MESH, (("embed", "data"),), strict=True)  # does not raise
    (info,) = [p for p in problems if p.code == "padded-names"]
    assert info.severity == "info" and info.path == "w"
    assert "trailing 2 dimensions are unsharded" in info.message
    assert problems[-1] is info  # information comes after errors and warnings


def test_check_warns_where_flax_nnx_would_place_a_variable_differently():
    from flax import nnx

    w = nnx.Param(jnp.ones((4, 8)), out_sharding=("embed", "hidden"), eager_sharding=False)
    rules = (("embed", "data"), ("embed", "model"), ("hidden", "data"), ("hidden", "model"))
    problems = meshplan.check(nnx.state(nnx.Dict(w=w)), MESH, rules)
    (problem,) = [p for p in problems if p.code == "flax-placement"]
    assert problem.severity == "warning" and problem.path == "w"
    assert "P('model', 'model')" in problem.message and "P('data', 'model')" in problem.message


@pytest.mark.parametrize(
    "shape, fragment",
    [
        ((-64, 128), "dim 0 has size -64: a size is a whole number of 0 or more"),
        ((64, float("nan")), "dim 1 has size nan"),
        ((2.5, 4), "dim 0 has size 2.5"),
        ((2**62, 128), "has 5.9e+20 elements, more than 2**56"),
    ],
    ids=["negative", "nan", "fraction", "2**62"],
)
def test_a_shape_that_is_no_shape_is_a_problem_not_a_crash(shape, fragment):
    rules = (("embed", "data"), ("mlp", "model"))
    [problem] = meshplan.validate("params/w", shape, ("embed", "mlp"), MESH, rules)
    assert (problem.code, problem.path, problem.severity) == ("bad-shape", "params/w", "error")
    assert fragment in problem.message and problem.fix


def test_a_negative_dim_in_a_tree_is_reported_and_counts_no_bytes():
    w = jax.ShapeDtypeStruct((-64, 128), jnp.float32)  # JAX accepts it abstractly
    tree = {"params": {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}}
    rules = (("embed", "data"), ("mlp", "model"))
    plan = meshplan.explain(tree, MESH, rules)
    assert [(p.code, p.path) for p in plan.problems] == [("bad-shape", "params/w")]
    assert plan.totals["all"].max_device_bytes == 0  # not -4096
    with pytest.raises(meshplan.ShardingValidationError, match="dim 0 has size -64"):
        meshplan.check(tree, MESH, rules, strict=True)


def test_a_tree_with_no_names_under_rules_says_so_first_and_only_once():
    tree = {"params": {"wte": sds(4096, 256), "h": {"w": sds(256, 1024)}, "b": sds(1024)}}
    rules = meshplan.layouts.get_layout("fsdp")
    problems = meshplan.check(tree, MESH, rules)
    assert [p.code for p in problems] == ["no-names"]  # no idle axis, no per-array replication
    [problem] = problems
    assert problem.severity == "warning"
    assert problem.message.startswith("no array carries a logical name: the rules place nothing")
    assert "all 3 arrays" in problem.message and "5.00 MiB" in problem.message
    assert "name_by_path" in problem.fix and "infer_names" in problem.fix
    assert "Map a logical name" not in str(meshplan.explain(tree, MESH, rules).problems)
    # without rules nothing claims to place it: the replicated arrays are said as before
    assert {p.code for p in meshplan.check(tree, MESH)} == {"replicated"}
    # one named array: the usual advice, per axis and per name
    tree["params"]["wte"] = logical(4096, 256, names=("vocab", "embed"))
    codes = [p.code for p in meshplan.check(tree, MESH, (("embed", "data"),))]
    assert "no-names" not in codes and "idle-axis" in codes


def test_the_table_of_a_plan_with_nothing_named_says_so_under_its_title():
    tree = {"params": {"w": sds(4096, 256)}}
    text = to_text(meshplan.explain(tree, MESH, meshplan.layouts.get_layout("fsdp")).table())
    title, first = text.splitlines()[:2]
    assert title.startswith("Sharding plan on")
    assert first.startswith("! no array carries a logical name: the rules place nothing")
