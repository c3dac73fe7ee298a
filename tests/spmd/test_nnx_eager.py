"""Flax NNX's eager sharding under meshplan's rules: logical ``out_sharding=`` names."""

from __future__ import annotations

import jax
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
