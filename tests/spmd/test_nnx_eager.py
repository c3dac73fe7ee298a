"""Flax NNX's eager sharding under meshplan's rules: logical ``out_sharding=`` names."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshplan

RULES = (("embed", None), ("patch", "model"))


class Patches(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, placement: dict):
        init = nnx.initializers.lecun_normal()
        self.w = nnx.Param(init(rngs.params(), (16, 32)), **placement)


def test_logical_out_sharding_at_creation_names_meshplans_fix(explicit_mesh):
    with (  # the rules' context turns JAX's error into meshplan's as it exits
        pytest.raises(meshplan.LogicalNamesError, match=r"'embed' is not an axis") as e,
        jax.set_mesh(explicit_mesh),
        meshplan.logical_axis_rules(RULES),
    ):
        Patches(nnx.Rngs(0), {"out_sharding": ("embed", "patch")})
    assert e.value.problems[0].code == "nnx-eager-logical"
    assert "meshplan.nnx_sharding" in str(e.value)
    assert isinstance(e.value.__cause__, ValueError)  # JAX's own error stays as the cause


@pytest.mark.parametrize("mesh_kind", ["auto_mesh", "explicit_mesh"])
def test_nnx_sharding_places_the_same_variable_at_creation(mesh_kind, request):
    mesh = request.getfixturevalue(mesh_kind)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(RULES):
        model = Patches(nnx.Rngs(0), meshplan.nnx_sharding(("embed", "patch")))
    assert model.w[...].sharding.spec == P(None, "model")


def test_other_value_errors_inside_the_rules_pass_through_unchanged():
    with pytest.raises(ValueError, match=r"^unrelated$"), meshplan.logical_axis_rules(RULES):
        raise ValueError("unrelated")


class Narrow(nnx.Module):
    """A layer whose 'patch' dimension (30) the 4-way 'model' axis does not divide."""

    def __init__(self, rngs: nnx.Rngs, check_shape: bool = True):
        init = nnx.initializers.lecun_normal()
        self.proj = nnx.Linear(
            16,
            30,
            kernel_init=meshplan.with_nnx_partitioning(init, ("embed", "patch")),
            rngs=rngs,
        )
        value = init(rngs.params(), (16, 30))
        shape = value.shape if check_shape else None
        self.w = nnx.Param(value, **meshplan.nnx_sharding(("embed", "patch"), shape=shape))


@pytest.mark.parametrize("mesh_kind", ["auto_mesh", "explicit_mesh"])
def test_an_indivisible_dim_at_creation_is_meshplans_error_naming_dim_name_and_axis(
    mesh_kind, request
):
    mesh = request.getfixturevalue(mesh_kind)
    init = nnx.initializers.lecun_normal()
    with (
        pytest.raises(meshplan.ShardingValidationError, match=r"of shape \(16, 30\)") as e,
        jax.set_mesh(mesh),
        meshplan.logical_axis_rules(RULES),
    ):
        value = init(jax.random.key(0), (16, 30))
        nnx.Param(value, **meshplan.nnx_sharding(("embed", "patch"), shape=value.shape))
    [problem] = e.value.problems
    assert problem.code == "indivisible"
    assert (
        problem.message
        == "dim 1 ('patch') of size 30 does not divide by 4 (mesh axis 'model' of size 4)"
    )
    assert "('patch', None)" in problem.fix and "rules[1]" in problem.fix
    assert "('embed', 'patch')" in str(e.value)


@pytest.mark.parametrize("mesh_kind", ["auto_mesh", "explicit_mesh"])
def test_with_nnx_partitioning_checks_the_initializers_value_without_being_told_its_shape(
    mesh_kind, request
):
    mesh = request.getfixturevalue(mesh_kind)
    with (
        pytest.raises(meshplan.ShardingValidationError, match=r"with_nnx_partitioning") as e,
        jax.set_mesh(mesh),
        meshplan.logical_axis_rules(RULES),
    ):
        Narrow(nnx.Rngs(0), check_shape=False)
    assert [p.code for p in e.value.problems] == ["indivisible"]
    assert "'patch'" in e.value.problems[0].message


def test_following_the_fix_creates_the_layer_with_the_dim_whole(explicit_mesh):
    fixed = (("patch", None), *RULES)
    with jax.set_mesh(explicit_mesh), meshplan.logical_axis_rules(fixed):
        model = Narrow(nnx.Rngs(0))
    assert model.w[...].sharding.spec == P(None, None)
    assert model.proj.kernel[...].sharding.spec == P(None, None)


def test_without_a_shape_flax_placing_the_value_still_ends_in_jaxs_error(auto_mesh):
    """What ``shape=`` is for: Flax never shows ``nnx_sharding`` the value."""
    with (
        pytest.raises(ValueError, match=r"partitioned 4 times") as e,
        jax.set_mesh(auto_mesh),
        meshplan.logical_axis_rules(RULES),
    ):
        nnx.Param(jnp.ones((16, 30)), **meshplan.nnx_sharding(("embed", "patch")))
    assert not isinstance(e.value, meshplan.MeshplanError)


def test_with_eager_sharding_off_nothing_is_placed_so_nothing_is_refused(auto_mesh):
    with jax.set_mesh(auto_mesh), meshplan.logical_axis_rules(RULES), nnx.use_eager_sharding(False):
        layer = nnx.Linear(
            16,
            30,
            kernel_init=meshplan.with_nnx_partitioning(
                nnx.initializers.lecun_normal(), ("embed", "patch")
            ),
            rngs=nnx.Rngs(0),
        )
    assert layer.kernel.out_sharding == ("embed", "patch")
