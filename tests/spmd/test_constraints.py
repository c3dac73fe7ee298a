"""``with_logical_constraint`` inside ``jax.jit`` on Auto and Explicit meshes, its fallbacks and
no-op cases, and ``explicit_out_sharding``."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan import RulesFallback

RULES = (("batch", "data"), ("embed", "model"))


@pytest.fixture(params=["auto", "explicit"])
def mesh(request, auto_mesh, explicit_mesh):
    return auto_mesh if request.param == "auto" else explicit_mesh


def _x(shape=(8, 16)):
    return jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)


def _trimmed(spec):
    """``spec`` as a tuple without trailing unsharded dimensions (XLA may report
    ``P('data')`` for ``P('data', None)``)."""
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _same(value, expected):
    """Whether ``value`` is sharded as ``expected`` (a ``NamedSharding`` spec)."""
    return isinstance(value.sharding, NamedSharding) and _trimmed(value.sharding.spec) == _trimmed(
        expected
    )


def _primitives(fn, *args):
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns}


CONSTRAINT_PRIMITIVES = {"sharding_constraint", "reshard"}


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (("batch", "embed"), P("data", "model")),
        (("embed", "batch"), P("model", "data")),
        (("batch", None), P("data", None)),
        ((None, "embed"), P(None, "model")),
        (P("batch", "embed"), P("data", "model")),
    ],
    ids=["batch_embed", "swapped", "batch_none", "none_embed", "partition_spec"],
)
def test_constraint_inside_jit_under_set_mesh(mesh, names, expected):
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: meshplan.with_logical_constraint(x * 2, names, RULES))(_x())
    assert _same(out, expected)
    assert out.sharding.mesh.axis_types == mesh.axis_types
    np.testing.assert_array_equal(out, _x() * 2)


def test_constraint_uses_active_rules(mesh):
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(RULES):
        out = jax.jit(lambda x: meshplan.with_logical_constraint(x + 1, ("embed", "batch")))(_x())
    assert _same(out, P("model", "data"))


def test_constraint_with_mesh_argument_needs_no_context(mesh):
    # Without a mesh context JAX needs the jit's inputs on the mesh when its axes are Explicit.
    assert meshplan.active_mesh() is None
    x = jax.device_put(_x(), NamedSharding(mesh, P()))
    out = jax.jit(
        lambda x: meshplan.with_logical_constraint(x - 1, ("batch", "embed"), RULES, mesh=mesh)
    )(x)
    assert isinstance(out.sharding, NamedSharding)
    assert _same(out, P("data", "model"))
    assert out.sharding.mesh == mesh


def test_constraint_with_auto_mesh_argument_on_single_device_input(auto_mesh):
    out = jax.jit(
        lambda x: meshplan.with_logical_constraint(x, ("embed", "batch"), RULES, mesh=auto_mesh)
    )(_x())
    assert _same(out, P("model", "data"))
    assert out.sharding.mesh == auto_mesh


def test_constraint_under_legacy_mesh_context(auto_mesh):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with auto_mesh:
            out = jax.jit(lambda x: meshplan.with_logical_constraint(x, ("batch", "embed"), RULES))(
                _x()
            )
    assert _same(out, P("data", "model"))


def test_constraint_outside_jit_reshards_eagerly(mesh):
    with jax.set_mesh(mesh):
        out = meshplan.with_logical_constraint(_x(), ("batch", "embed"), RULES)
    assert _same(out, P("data", "model"))
    np.testing.assert_array_equal(out, _x())


def test_mesh_axis_tuple_rule_shards_over_both_axes(mesh):
    rules = (("batch", ("data", "model")),)
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: meshplan.with_logical_constraint(x, ("batch", "embed"), rules))(
            _x()
        )
    assert _same(out, P(("data", "model"), None))


# --------------------------------------------------------------------------
# Fallbacks for logical names that match no rule
# --------------------------------------------------------------------------


def test_fallback_axis_is_unsharded_treats_unmatched_as_none(mesh):
    rules = (("batch", "data"),)
    with jax.set_mesh(mesh):
        out = jax.jit(
            lambda x: meshplan.with_logical_constraint(
                x, ("batch", "mystery"), rules, fallback=RulesFallback.AXIS_IS_UNSHARDED
            )
        )(_x())
    assert _same(out, P("data", None))


def test_fallback_default_is_axis_is_unsharded(mesh):
    with jax.set_mesh(mesh):
        out = jax.jit(lambda x: meshplan.with_logical_constraint(x, ("mystery", "embed"), RULES))(
            _x()
        )
    assert _same(out, P(None, "model"))


def test_fallback_raise_error_raises_naming_the_axis(mesh):
    rules = (("batch", "data"),)
    fn = jax.jit(
        lambda x: meshplan.with_logical_constraint(
            x, ("batch", "mystery"), rules, fallback=RulesFallback.RAISE_ERROR
        )
    )
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            meshplan.UnmatchedLogicalAxisError,
            match=r"(?s)\('mystery',\) has no rule.*\('mystery', None\)",
        ) as info,
    ):
        fn(_x())
    assert isinstance(info.value, ValueError)
    assert "('batch', 'mystery')" in str(info.value)


def test_fallback_raise_error_passes_when_every_name_matches(mesh):
    with jax.set_mesh(mesh):
        out = jax.jit(
            lambda x: meshplan.with_logical_constraint(
                x, ("batch", "embed"), RULES, fallback=RulesFallback.RAISE_ERROR
            )
        )(_x())
    assert _same(out, P("data", "model"))


def test_fallback_raise_error_does_not_count_a_rule_blocked_by_a_taken_axis(mesh):
    # 'embed' has a rule, but its mesh axis is taken: it is unassigned, so RAISE_ERROR raises.
    rules = (("batch", "model"), ("embed", "model"))
    with jax.set_mesh(mesh), pytest.raises(meshplan.UnmatchedLogicalAxisError, match="'embed'"):
        meshplan.with_logical_constraint(
            _x(), ("batch", "embed"), rules, fallback=RulesFallback.RAISE_ERROR
        )


def test_fallback_no_constraint_leaves_value_unconstrained(mesh):
    rules = (("batch", "data"),)

    def constrained(fallback):
        return lambda x: meshplan.with_logical_constraint(
            x * 2, ("batch", "mystery"), rules, fallback=fallback
        )

    with jax.set_mesh(mesh):
        assert (
            not _primitives(constrained(RulesFallback.NO_CONSTRAINT), _x()) & CONSTRAINT_PRIMITIVES
        )
        assert (
            _primitives(constrained(RulesFallback.AXIS_IS_UNSHARDED), _x()) & CONSTRAINT_PRIMITIVES
        )
        x = jax.device_put(_x(), NamedSharding(mesh, P(None, "model")))
        out = jax.jit(constrained(RulesFallback.NO_CONSTRAINT))(x)
    assert _same(out, P(None, "model"))  # follows the input, not ('data', None)
    np.testing.assert_array_equal(out, _x() * 2)


def test_fallback_no_constraint_still_constrains_fully_matched_values(mesh):
    with jax.set_mesh(mesh):
        out = jax.jit(
            lambda x: meshplan.with_logical_constraint(
                x, ("batch", "embed"), RULES, fallback=RulesFallback.NO_CONSTRAINT
            )
        )(_x())
    assert _same(out, P("data", "model"))


# --------------------------------------------------------------------------
# Trees
# --------------------------------------------------------------------------


def test_tree_of_specs_matches_tree_of_values(mesh):
    specs = {"a": ("batch", "embed"), "b": ("embed", None), "c": None}

    def f(tree):
        tree = jax.tree_util.tree_map(lambda v: v + 1, tree)
        return meshplan.with_logical_constraint(tree, specs, RULES)

    tree = {"a": _x(), "b": _x((16, 8)), "c": _x((4,))}
    with jax.set_mesh(mesh):
        out = jax.jit(f)(tree)
        prims = _primitives(f, tree)
    assert _same(out["a"], P("data", "model"))
    assert _same(out["b"], P("model", None))
    assert prims & CONSTRAINT_PRIMITIVES
    np.testing.assert_array_equal(out["c"], _x((4,)) + 1)


def test_one_spec_applies_to_every_value_of_a_tree(mesh):
    tree = [_x(), _x() * 3]
    with jax.set_mesh(mesh):
        out = jax.jit(lambda t: meshplan.with_logical_constraint(t, ("batch", "embed"), RULES))(
            tree
        )
    assert all(_same(o, P("data", "model")) for o in out)


def test_tree_of_partition_specs(mesh):
    specs = (P("batch", None), P(None, "embed"))
    with jax.set_mesh(mesh):
        out = jax.jit(lambda t: meshplan.with_logical_constraint(t, specs, RULES))((_x(), _x()))
    assert _same(out[0], P("data", None))
    assert _same(out[1], P(None, "model"))


# --------------------------------------------------------------------------
# No-op cases
# --------------------------------------------------------------------------


def test_no_rules_is_a_noop(mesh):
    x = _x()
    with jax.set_mesh(mesh):
        assert meshplan.with_logical_constraint(x, ("batch", "embed")) is x
        assert meshplan.with_logical_constraint(x, ("batch", "embed"), ()) is x
        assert (
            not _primitives(lambda v: meshplan.with_logical_constraint(v, ("batch", "embed")), x)
            & CONSTRAINT_PRIMITIVES
        )


def test_spec_none_is_a_noop(mesh):
    x = _x()
    with jax.set_mesh(mesh):
        assert meshplan.with_logical_constraint(x, None, RULES) is x
        assert (
            not _primitives(lambda v: meshplan.with_logical_constraint(v, None, RULES), x)
            & CONSTRAINT_PRIMITIVES
        )


def test_no_mesh_is_a_noop():
    x = _x()
    assert meshplan.active_mesh() is None
    assert meshplan.with_logical_constraint(x, ("batch", "embed"), RULES) is x
    out = jax.jit(lambda v: meshplan.with_logical_constraint(v * 2, ("batch", "embed"), RULES))(x)
    assert isinstance(out.sharding, jax.sharding.SingleDeviceSharding)  # not ('data', 'model')
    np.testing.assert_array_equal(out, x * 2)
    assert (
        not _primitives(lambda v: meshplan.with_logical_constraint(v, ("batch", "embed"), RULES), x)
        & CONSTRAINT_PRIMITIVES
    )


# --------------------------------------------------------------------------
# Explicit meshes
# --------------------------------------------------------------------------


def test_explicit_mesh_reshards_rather_than_constrains(explicit_mesh, auto_mesh):
    f = lambda x: meshplan.with_logical_constraint(x, ("batch", "embed"), RULES)  # noqa: E731
    with jax.set_mesh(explicit_mesh):
        explicit_prims = _primitives(f, _x())
    with jax.set_mesh(auto_mesh):
        auto_prims = _primitives(f, _x())
    assert "reshard" in explicit_prims and "sharding_constraint" not in explicit_prims
    assert "sharding_constraint" in auto_prims and "reshard" not in auto_prims


def test_explicit_mesh_keeps_current_sharding_for_unconstrained_dims(explicit_mesh):
    rules = (("embed", "model"),)
    with jax.set_mesh(explicit_mesh):
        x = jax.device_put(_x(), NamedSharding(explicit_mesh, P("data", None)))
        out = jax.jit(
            lambda v: meshplan.with_logical_constraint(v, (P.UNCONSTRAINED, "embed"), rules)
        )(x)
    assert _same(out, P("data", "model"))


def test_mixed_axis_types_raise_mesh_error():
    mixed = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with pytest.raises(meshplan.MeshError, match=r"(?s)mixed axis types.*all Auto or all Explicit"):
        meshplan.with_logical_constraint(_x(), ("batch", "embed"), RULES, mesh=mixed)


def test_constraint_rank_mismatch_raises(mesh):
    with (
        jax.set_mesh(mesh),
        pytest.raises(meshplan.LogicalNamesError, match=r"rank 1 \(shape \(8,\)\)"),
    ):
        meshplan.with_logical_constraint(_x((8,)), ("batch", "embed"), RULES)


def test_explicit_out_sharding_is_none_without_an_explicit_mesh(auto_mesh):
    assert meshplan.explicit_out_sharding(("batch", "embed"), RULES) is None
    with jax.set_mesh(auto_mesh):
        assert meshplan.explicit_out_sharding(("batch", "embed"), RULES) is None


def test_explicit_out_sharding_gives_the_mesh_spec_on_explicit_mesh(explicit_mesh):
    with jax.set_mesh(explicit_mesh):
        assert meshplan.explicit_out_sharding(("batch", "embed"), RULES) == P("data", "model")
        assert meshplan.explicit_out_sharding(("batch", "mystery"), RULES) == P("data", None)
        with meshplan.logical_axis_rules((("batch", "data"),)):
            assert meshplan.explicit_out_sharding(("batch", "embed")) == P("data", None)


def test_explicit_out_sharding_resolves_an_ambiguous_contraction(explicit_mesh):
    # y is sharded on its contracting dim: Explicit mode needs out_sharding to pick a layout.
    y = jax.device_put(_x((8, 16)), NamedSharding(explicit_mesh, P("data", "model")))
    w = jax.device_put(_x((16, 4)), NamedSharding(explicit_mesh, P("model", None)))

    def f(y, w):
        return jnp.dot(
            y,
            w,
            out_sharding=meshplan.explicit_out_sharding(("batch", "embed"), (("batch", "data"),)),
        )

    with jax.set_mesh(explicit_mesh):
        out = jax.jit(f)(y, w)
    assert _same(out, P("data", None))
    np.testing.assert_allclose(out, _x((8, 16)) @ _x((16, 4)), rtol=1e-5)
