"""A catalogue of bad inputs: each raises a meshplan error that names the path, axis or
size involved and says how to fix it.

Every case is ``(make the error, exception type, fragments)``: the fragments are
regular expressions that must all occur in the message; the first ones name
what is wrong (path, axis, size), the last one the fix.
"""

from __future__ import annotations

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan.testing import assert_plan_matches
from trees import logical, mesh_box

INIT = nn.initializers.lecun_normal()
MESH = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
MIXED = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Explicit))


def _scan_without_partition_name():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            w = self.param("w", meshplan.with_partitioning(INIT, (None, "model")), (4, 4))
            return x @ w, None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=2
            )
            return scanned()(x, None)[0]

    Stack().init(jax.random.key(0), jnp.ones((2, 4)))


def _unbox_under_legacy_mesh(names):
    box = meshplan.Partitioned(jnp.ones((8, 8)), names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with MESH:
            return jax.jit(lambda b: b.unbox())(box)


def _missing_snapshot(tmp: str):
    plan = meshplan.explain({"w": mesh_box(8, names=("model",))}, MESH)
    assert_plan_matches(plan, f"{tmp}/nowhere/plan.json", update=False)


CATALOGUE = {
    # -- names ----------------------------------------------------------------
    "bare string names on a box": (
        lambda: meshplan.Partitioned(jnp.ones((4,)), "model"),
        meshplan.LogicalNamesError,
        [r"bare string 'model'", r"Write \('model',\) for a 1-D array"],
    ),
    "bare string names to logical_to_mesh_axes": (
        lambda: meshplan.logical_to_mesh_axes("embed", (("embed", "data"),)),
        meshplan.LogicalNamesError,
        [r"array_dim_names", r"bare string 'embed'", r"Write \('embed',\)"],
    ),
    "bare string names to with_logical_partitioning": (
        lambda: meshplan.with_logical_partitioning(INIT, "embed"),
        meshplan.LogicalNamesError,
        [r"with_logical_partitioning names", r"'embed'", r"Write \('embed',\)"],
    ),
    "with_partitioning(names, fn) swapped": (
        lambda: meshplan.with_partitioning((None, "model"), INIT),
        meshplan.ArgumentError,
        [
            r"swapped",
            r"fn=\(None, 'model'\) is not callable",
            r"Call with_partitioning\(initializer, names\)",
        ],
    ),
    "with_logical_partitioning(names, fn) swapped": (
        lambda: meshplan.with_logical_partitioning(("embed", "mlp"), INIT),
        meshplan.ArgumentError,
        [r"swapped", r"\('embed', 'mlp'\)", r"with_logical_partitioning\(initializer, names\)"],
    ),
    "an initializer that is not callable": (
        lambda: meshplan.with_partitioning(3, (None,)),
        meshplan.ArgumentError,
        [r"got 3", r"Pass an initializer"],
    ),
    "names=None on a box": (
        lambda: meshplan.Partitioned(jnp.ones((2, 2)), None),
        meshplan.LogicalNamesError,
        [r"got names=None", r"give \(None,\) \* value\.ndim"],
    ),
    "names=None to with_partitioning": (
        lambda: meshplan.with_partitioning(INIT, None),
        meshplan.LogicalNamesError,
        [r"with_partitioning", r"names=None", r"\(None,\) \* value\.ndim"],
    ),
    "a name that is not a string": (
        lambda: meshplan.Partitioned(jnp.ones((2, 2)), (None, 3)),
        meshplan.LogicalNamesError,
        [r"\(None, 3\)", r"\[3\]", r"Each entry must be a name"],
    ),
    "a logical name used twice in one array": (
        lambda: meshplan.logical_to_mesh_axes(("embed", "embed"), (("embed", "data"),)),
        meshplan.LogicalNamesError,
        [r"\('embed',\) occur more than once", r"give the other dimension its own name"],
    ),
    # -- rules ----------------------------------------------------------------
    "rules given as a dict": (
        lambda: meshplan.logical_to_mesh_axes(("batch",), {"batch": "data"}),
        meshplan.RulesError,
        [r"got a dict: \{'batch': 'data'\}", r"tuple\(rules\.items\(\)\)"],
    ),
    "rules given as one flat pair": (
        lambda: meshplan.logical_to_mesh_axes(("batch",), ("batch", "data")),
        meshplan.RulesError,
        [r"single flat pair: \('batch', 'data'\)", r"Wrap it .*\(\('batch', 'data'\),\)"],
    ),
    "rules given as a string": (
        lambda: meshplan.set_logical_axis_rules("batch"),
        meshplan.RulesError,
        [r"got str: 'batch'", r"sequence of pairs"],
    ),
    "a rule that is not a pair": (
        lambda: meshplan.logical_to_mesh_axes(("batch",), (("batch",), ("embed", "model"))),
        meshplan.RulesError,
        [
            r"rules\[0\]: \('batch',\) is not a \(name, mesh_axes\) pair",
            r"e\.g\. \(\('batch', 'data'\)",
        ],
    ),
    "a rule whose name is not a string": (
        lambda: meshplan.logical_to_mesh_axes(("batch",), ((1, "data"),)),
        meshplan.RulesError,
        [r"rules\[0\]: \(1, 'data'\)", r"must be a string, got int", r"sequence of pairs"],
    ),
    "a rule whose mesh axes are not names": (
        lambda: meshplan.logical_to_mesh_axes(("batch",), (("batch", 3),)),
        meshplan.RulesError,
        [r"rules\[0\]: \('batch', 3\)", r"got 3", r"sequence of pairs"],
    ),
    "a dict of rules in a rules context": (
        lambda: meshplan.logical_axis_rules({"batch": "data"}).__enter__(),
        meshplan.RulesError,
        [r"got a dict", r"tuple\(rules\.items\(\)\)"],
    ),
    # -- shardings ------------------------------------------------------------
    "get_sharding on logical boxes with no rules": (
        lambda: meshplan.get_sharding({"w": logical(8, 8, names=("embed", "hidden"))}, MESH),
        meshplan.LogicalNamesError,
        [
            r"\* w: ",
            r"names are logical",
            r"meshplan\.logical_to_mesh_sharding\(.*logical_axis_rules",
        ],
    ),
    "get_sharding on a mesh axis the mesh lacks": (
        lambda: meshplan.get_sharding({"w": mesh_box(8, 8, names=("modle", None))}, MESH),
        meshplan.MeshError,
        [
            r"\* w: ",
            r"mesh axis 'modle', which the mesh \{'data': 2, 'model': 4\} does not have",
            r"Did you mean 'model'\? Use the mesh's axis names \('data', 'model'\)",
        ],
    ),
    "get_sharding with names longer than the rank": (
        lambda: meshplan.get_sharding({"w": mesh_box(8, 8, names=("model", None, None))}, MESH),
        meshplan.LogicalNamesError,
        [r"\* w: ", r"array of rank 2 \(shape \(8, 8\)\)", r"at most one name"],
    ),
    "get_sharding with one mesh axis on two dimensions": (
        lambda: meshplan.get_sharding({"w": mesh_box(8, 8, names=("model", "model"))}, MESH),
        meshplan.MeshError,
        [r"\* w: ", r"mesh axis 'model' is used by dims 0 and 1", r"at most one dimension"],
    ),
    "replace_boxed with a value of another rank": (
        lambda: meshplan.replace_boxed(
            {"w": meshplan.Partitioned(jnp.ones((2, 2)), ("data", None))}, {"w": jnp.ones((2,))}
        ),
        meshplan.LogicalNamesError,
        [
            r"w: a value of shape \(2,\) \(rank 1\)",
            r"\('data', None\) \(rank 2\)",
            r"structure and ranks of meshplan\.unbox\(tree\)",
        ],
    ),
    "replace_boxed with boxed updates": (
        lambda: meshplan.replace_boxed(
            {"w": meshplan.Partitioned(jnp.ones((2, 2)), ("data", None))},
            {"w": meshplan.Partitioned(jnp.zeros((2, 2)), ("data", None))},
        ),
        meshplan.LogicalNamesError,
        [r"w: the update is itself a box", r"meshplan\.unbox\(updates\)"],
    ),
    "remove_axis that add_axis did not add": (
        lambda: meshplan.Partitioned(jnp.ones((2, 2)), ("data", None)).remove_axis(
            1, {meshplan.PARTITION_NAME: "layer"}
        ),
        meshplan.LogicalNamesError,
        [r"axis 1 named 'layer'", r"holds None", r"undo the add_axis"],
    ),
    "nn.scan without a partition name": (
        _scan_without_partition_name,
        meshplan.PartitioningUnspecifiedError,
        [r"\(None, 'model'\)", r"metadata_params=\{\}", r"meshplan\.PARTITION_NAME: 'layer'"],
    ),
    # -- constraints ----------------------------------------------------------
    "a logical name with no rule under RAISE_ERROR": (
        lambda: meshplan.with_logical_constraint(
            jnp.ones((8, 8)),
            ("batch", "mlp"),
            (("batch", "data"),),
            mesh=MESH,
            fallback=meshplan.RulesFallback.RAISE_ERROR,
        ),
        meshplan.UnmatchedLogicalAxisError,
        [r"\('mlp',\) has no rule", r"\('mlp', None\)", r"RulesFallback\.AXIS_IS_UNSHARDED"],
    ),
    "a constraint with more names than dimensions": (
        lambda: jax.jit(
            lambda x: meshplan.with_logical_constraint(
                x, ("batch", None, None), (("batch", "data"),), mesh=MESH
            )
        )(jnp.ones((8, 8))),
        meshplan.LogicalNamesError,
        [r"3 axis names", r"rank 2 \(shape \(8, 8\)\)", r"one name \(or None\) per dimension"],
    ),
    "a constraint on a mesh with mixed axis types": (
        lambda: meshplan.Partitioned(jnp.ones((8, 8)), ("data", None), mesh=MIXED).unbox(),
        meshplan.MeshError,
        [r"mixed axis types", r"'model': Explicit", r"all Auto or all Explicit"],
    ),
    "unbox under `with mesh:` naming an axis the mesh lacks": (
        lambda: _unbox_under_legacy_mesh(("modle", None)),
        meshplan.MeshError,
        [
            r"names=\('modle', None\), shape=\(8, 8\)",
            r"mesh axis 'modle', which",
            r"\('data', 'model'\)",
        ],
    ),
    # -- check(strict=True) and strict= ----------------------------------------
    "strict: a size that does not divide": (
        lambda: meshplan.check(
            {"params": {"w": logical(8, 6, names=("embed", "mlp"))}},
            MESH,
            (("mlp", "model"),),
            strict=True,
        ),
        meshplan.ShardingValidationError,
        [
            r"shape \{'data': 2, 'model': 4\}",
            r"params/w: dim 1 \('mlp'\) of size 6",
            r"Pad dim 1 to 8 \(the nearest multiple of 4\)",
        ],
    ),
    "strict: names of the wrong rank": (
        lambda: meshplan.check(
            {"params": {"w": mesh_box(8, names=("model", None))}}, MESH, strict=True
        ),
        meshplan.ShardingValidationError,
        [r"params/w: 2 axis names", r"rank 1", r"one name \(or None\) per dimension"],
    ),
    "strict: a mesh axis the mesh lacks": (
        lambda: meshplan.check({"params": {"w": mesh_box(8, names=("modle",))}}, MESH, strict=True),
        meshplan.ShardingValidationError,
        [r"params/w: dim 0 names mesh axis 'modle'", r"Did you mean 'model'\?"],
    ),
    "strict: one mesh axis on two dimensions": (
        lambda: meshplan.check(
            {"params": {"w": mesh_box(8, 8, names=(("data", "model"), "model"))}},
            MESH,
            strict=True,
        ),
        meshplan.ShardingValidationError,
        [r"params/w: mesh axis 'model' is used by dims 0 and 1", r"at most one dimension"],
    ),
    "strict: a rule naming a mesh axis the mesh lacks": (
        lambda: meshplan.check(
            {"params": {"w": logical(8, names=("mlp",))}}, MESH, (("mlp", "tensor"),), strict=True
        ),
        meshplan.ShardingValidationError,
        [
            r"rules\[0\]: rule 0 \('mlp', 'tensor'\) names mesh axis 'tensor'",
            r"places 1 leaf: params/w",
            r"Use the mesh's axis names",
        ],
    ),
    "strict: rules that are not pairs": (
        lambda: meshplan.check(
            {"params": {"w": logical(8, names=("mlp",))}},
            MESH,
            (("mlp", "model"), "embed"),
            strict=True,
        ),
        meshplan.ShardingValidationError,
        [r"rules\[1\]: 'embed' is not a \(name, mesh_axes\) pair", r"sequence of pairs, e\.g\."],
    ),
    "strict: logical names and no rules": (
        lambda: meshplan.check({"params": {"w": logical(8, names=("mlp",))}}, MESH, strict=True),
        meshplan.ShardingValidationError,
        [r"params/w", r"no rules are given or active", r"logical_axis_rules\(rules\)"],
    ),
    "get_sharding(strict=True): a size that does not divide": (
        lambda: meshplan.get_sharding(
            {"w": mesh_box(6, 8, names=("model", None))}, MESH, strict=True
        ),
        meshplan.ShardingValidationError,
        [r"\* w: dim 0 of size 6 does not divide by 4", r"Pad dim 0 to 8"],
    ),
    "logical_to_mesh_sharding(strict=True): a rule naming a missing axis": (
        lambda: meshplan.logical_to_mesh_sharding(
            {"w": P("embed")}, MESH, (("embed", "fsdp"),), strict=True
        ),
        meshplan.ShardingValidationError,
        [r"rules\[0\].*'fsdp'", r"places 1 leaf: w", r"\('data', 'model'\)"],
    ),
    # -- explain and snapshots -------------------------------------------------
    "explain given something that is not a mesh": (
        lambda: meshplan.explain({}, "2x4"),
        meshplan.MeshError,
        [r"got str: '2x4'", r"jax\.make_mesh\(\(2, 4\), \('data', 'model'\)\)"],
    ),
    "explain given a mesh axis of size 0": (
        lambda: meshplan.explain({}, {"data": 0}),
        meshplan.MeshError,
        [r"\{'data': 0\}", r"positive integer sizes", r"\{'data': 2, 'model': 4\}"],
    ),
    "a plan snapshot that does not exist yet": (
        lambda: _missing_snapshot("/tmp/meshplan-missing-snapshot"),
        AssertionError,
        [r"nowhere/plan\.json", r"MESHPLAN_UPDATE_SNAPSHOTS=1"],
    ),
}


def test_catalogue_is_large_enough():
    assert len(CATALOGUE) >= 30


@pytest.mark.parametrize("case", list(CATALOGUE), ids=list(CATALOGUE))
@pytest.mark.slow
def test_bad_input_is_reported_with_its_fix(case):
    make, error, fragments = CATALOGUE[case]
    with pytest.raises(error) as info:
        make()
    message = str(info.value)
    for fragment in fragments:
        assert re.search(fragment, message, flags=re.S), f"{fragment!r} not in:\n{message}"
    if error is not AssertionError:
        assert isinstance(info.value, meshplan.MeshplanError)
        assert "\n" in message  # what is wrong, then how to fix it


def test_every_meshplan_error_is_also_a_builtin_error():
    errors = [getattr(meshplan, n) for n in meshplan.__all__ if n.endswith("Error")]
    assert meshplan.MeshplanError in errors
    for error in errors:
        assert issubclass(error, meshplan.MeshplanError)
        if error is not meshplan.MeshplanError:
            assert issubclass(error, ValueError | TypeError), error


# -- silent cases of the Flax API that meshplan makes visible -----------------


def test_legacy_mesh_context_applies_the_box_constraint():
    out = _unbox_under_legacy_mesh((None, "model"))
    assert out.sharding.spec == P(None, "model")


def test_legacy_mesh_context_applies_logical_constraints():
    rules = (("batch", "data"), ("hidden", "model"))
    box = meshplan.LogicallyPartitioned(jnp.ones((8, 8)), ("batch", "hidden"), rules=rules)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with MESH:
            unboxed = jax.jit(lambda b: b.unbox() * 2)(box)
            constrained = jax.jit(
                lambda x: meshplan.with_logical_constraint(x * 2, ("batch", None), rules)
            )(jnp.ones((8, 8)))
    assert unboxed.sharding.spec == P("data", "model")
    assert constrained.sharding.is_equivalent_to(NamedSharding(MESH, P("data", None)), 2)


def test_get_sharding_on_logical_boxes_uses_the_active_rules():
    tree = {"w": logical(8, 8, names=("embed", "hidden"))}
    with meshplan.logical_axis_rules((("hidden", "model"),)):
        assert meshplan.get_sharding(tree, MESH)["w"].spec == P(None, "model")


def test_a_name_without_rule_is_reported_not_silently_replicated():
    tree = {"params": {"w": logical(1024, 1024, names=("embed", "hidden"))}}
    problems = meshplan.check(tree, MESH, (("hidden", "model"),))
    (warning,) = [p for p in problems if p.code == "no-rule"]
    assert "'embed' is placed by no rule" in warning.message and "replicated" in warning.message


def _constrain_unmatched():
    with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        meshplan.with_logical_constraint(
            jnp.ones((8, 4)),
            ("batch", "embed"),
            rules=(("batch", "data"),),
            fallback=meshplan.RulesFallback.RAISE_ERROR,
        )


@pytest.mark.parametrize(
    ("call", "error", "code"),
    [
        (lambda: meshplan.explain({}, 42, ()), meshplan.MeshError, "not-a-mesh"),
        (lambda: meshplan.explain({}, {"data": 0}, ()), meshplan.MeshError, "bad-mesh-axes"),
        (
            lambda: meshplan.logical_to_mesh_sharding(jax.sharding.PartitionSpec(), None, ()),
            meshplan.MeshError,
            "no-mesh",
        ),
        (lambda: _constrain_unmatched(), meshplan.UnmatchedLogicalAxisError, "unmatched-name"),
    ],
    ids=["not-a-mesh", "bad-mesh-axes", "no-mesh", "unmatched-name"],
)
def test_a_single_bad_input_carries_its_code(call, error, code):
    with pytest.raises(error) as info:
        call()
    assert [p.code for p in info.value.problems] == [code]
