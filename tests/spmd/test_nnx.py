"""Flax NNX: meshplan reads NNX variables' sharding metadata with Linen's rule semantics."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._spmd.nnx_check import nnx_problems

# The guide's logical rules, and the rules on which Flax NNX and Linen disagree.
RULES = (("batch", "data"), ("hidden", "model"), ("embed", None))
CLASH = (("embed", "data"), ("embed", "model"), ("hidden", "data"), ("hidden", "model"))
MESH = {"data": 2, "model": 4}


class DotReluDot(nnx.Module):
    """The guide's layer, in logical names, with an activation constraint in logical names."""

    def __init__(self, depth: int, rngs: nnx.Rngs, kernel_init=None, w2_metadata=None):
        init_fn = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            kernel_init=kernel_init or nnx.with_partitioning(init_fn, ("embed", "hidden")),
            use_bias=False,
            rngs=rngs,
        )
        metadata = {"out_sharding": ("hidden", "embed")} if w2_metadata is None else w2_metadata
        self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), **metadata)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = jax.nn.relu(self.dot1(x))
        y = meshplan.with_logical_constraint(y, ("batch", "hidden"))
        return jnp.dot(y, self.w2[...])


class MultiDotReluDot(nnx.Module):
    def __init__(self, depth: int, num_layers: int, rngs: nnx.Rngs, partition="layers"):
        @nnx.vmap(transform_metadata={nnx.PARTITION_NAME: partition})
        def create_sublayers(r):
            return DotReluDot(depth, r)

        self.layers = create_sublayers(rngs.split(num_layers))

    def __call__(self, x: jax.Array) -> jax.Array:
        x, _ = jax.lax.scan(lambda x, layer: (layer(x), None), x, self.layers)
        return x


def abstract(make):
    """``nnx.eval_shape`` of ``make`` without Flax's eager sharding (no mesh needed)."""
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(make)


@pytest.fixture(scope="module")
def state():
    return nnx.state(abstract(lambda: MultiDotReluDot(64, 2, nnx.Rngs(0))))


def same(array, spec, mesh):
    """Whether ``array`` is placed as ``spec`` says (trailing ``None``s do not matter)."""
    return array.sharding.is_equivalent_to(NamedSharding(mesh, spec), array.ndim)


def values(tree):
    """``{path: value}`` of the variables of an NNX state (values of specs or shardings)."""
    out = {}
    for path, var in nnx.to_flat_state(tree):
        out["/".join(str(p) for p in path)] = var.get_value()
    return out


# -- item 1: every function that takes a tree takes an NNX state -------------------------


def test_no_rules_names_are_mesh_axes_as_in_flax_nnx():
    with nnx.use_eager_sharding(False):
        layer = nnx.Linear(
            4,
            8,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")),
            rngs=nnx.Rngs(0),
        )
    ours = meshplan.get_partition_spec(nnx.state(layer))
    theirs = nnx.get_partition_spec(nnx.state(layer))
    assert values(ours) == values(theirs) == {"bias": P(), "kernel": P(None, "model")}


def test_get_partition_spec_mirrors_the_state(state):
    with meshplan.logical_axis_rules(RULES):
        specs = meshplan.get_partition_spec(state)
    assert isinstance(specs, nnx.State)
    assert isinstance(specs["layers"]["w2"], nnx.Param)
    assert specs["layers"]["w2"].out_sharding == ("layers", "hidden", "embed")  # metadata kept
    # 'layers' (the vmap axis) has no rule: unsharded, as Linen leaves unmatched names.
    assert values(specs) == {
        "layers/dot1/kernel": P(None, None, "model"),
        "layers/w2": P(None, "model", None),
    }


def test_a_module_is_accepted_too():
    model = abstract(lambda: DotReluDot(16, nnx.Rngs(0)))
    with meshplan.logical_axis_rules(RULES):
        specs = meshplan.get_partition_spec(model)
    assert specs.w2.get_value() == P("model", None)


def test_partition_name_is_in_the_specs_and_the_plan(state, auto_mesh):
    rules = (("layers", "data"), *RULES)
    with meshplan.logical_axis_rules(rules):
        specs = meshplan.get_partition_spec(state)
        plan = meshplan.explain(state, auto_mesh)
    assert values(specs)["layers/w2"] == P("data", "model", None)
    leaf = plan["layers/w2"]
    assert leaf.spec == P("data", "model", None)
    assert leaf.shard_shape == (1, 16, 64)


@pytest.mark.slow
def test_the_abstract_path_creates_a_sharded_model(auto_mesh):
    def create():
        with nnx.use_eager_sharding(False):
            return nnx.state(MultiDotReluDot(64, 2, nnx.Rngs(0)))

    with meshplan.logical_axis_rules(RULES):
        shardings = meshplan.get_sharding(
            nnx.state(abstract(lambda: MultiDotReluDot(64, 2, nnx.Rngs(0)))), auto_mesh, strict=True
        )
        created = jax.jit(create, out_shardings=shardings)()
    kernel = created["layers"]["dot1"]["kernel"].get_value()
    assert same(kernel, P(None, None, "model"), auto_mesh)
    assert same(created["layers"]["w2"].get_value(), P(None, "model", None), auto_mesh)
    # the shardings drop into with_sharding_constraint and nnx.update as well
    constrained = jax.jit(lambda s: jax.lax.with_sharding_constraint(s, shardings))(created)
    assert same(constrained["layers"]["w2"].get_value(), P(None, "model", None), auto_mesh)
    model = abstract(lambda: MultiDotReluDot(64, 2, nnx.Rngs(0)))
    nnx.update(model, created)
    assert same(model.layers.w2.get_value(), P(None, "model", None), auto_mesh)


def test_logical_to_mesh_takes_flax_specs_and_states(state, auto_mesh):
    flax_specs = nnx.get_partition_spec(state)  # no Flax rules: the logical names as specs
    assert values(flax_specs)["layers/w2"] == P("layers", "hidden", "embed")
    from_specs = meshplan.logical_to_mesh(flax_specs, RULES)
    from_state = meshplan.logical_to_mesh(state, RULES)
    assert values(from_specs) == values(from_state)
    assert values(from_state)["layers/dot1/kernel"] == P(None, None, "model")
    shardings = meshplan.logical_to_mesh_sharding(state, auto_mesh, RULES, strict=True)
    assert values(shardings)["layers/w2"] == NamedSharding(auto_mesh, P(None, "model", None))


def test_explain_and_check_under_active_rules(state, auto_mesh):
    with meshplan.logical_axis_rules(RULES):
        plan = meshplan.explain(state, auto_mesh)
        problems = meshplan.check(state, auto_mesh)
    assert [leaf.path for leaf in plan.leaves] == ["layers/dot1/kernel", "layers/w2"]
    assert plan["layers/dot1/kernel"].names == ("layers", "embed", "hidden")
    assert not [p for p in problems if p.severity == "error"]


def test_explain_and_search_with_rules_given(state, auto_mesh):
    plan = meshplan.explain(state, auto_mesh, RULES)
    assert plan["layers/w2"].spec == P(None, "model", None)
    result = meshplan.search_layouts(state, 8, layouts=("tensor_parallel",))
    assert result.rows


def test_local_sharding_rules_come_before_the_active_ones():
    w = nnx.Param(
        jnp.ones((8, 16)),
        out_sharding=("embed", "hidden"),
        sharding_rules=(("embed", "data"),),
        eager_sharding=False,
    )
    state = nnx.state(nnx.Dict(w=w))
    with meshplan.logical_axis_rules((("hidden", "model"),)):
        assert values(meshplan.get_partition_spec(state)) == {"w": P("data", "model")}
    # the variable's own rules alone make its names logical
    assert values(meshplan.get_partition_spec(state)) == {"w": P("data", None)}


def test_older_metadata_names_are_read():
    with pytest.warns(DeprecationWarning):
        w = nnx.Param(jnp.ones((8, 16)), sharding=("embed", "hidden"), eager_sharding=False)
    state = nnx.state(nnx.Dict(w=w))
    with meshplan.logical_axis_rules(RULES):
        assert values(meshplan.get_partition_spec(state)) == {"w": P(None, "model")}


def test_tuples_none_and_unconstrained_resolve():
    w = nnx.Param(
        jnp.ones((8, 16, 4)),
        out_sharding=(("data", "model"), None, P.UNCONSTRAINED),
        eager_sharding=False,
    )
    v = nnx.Param(jnp.ones((8, 16)), out_sharding=("batch", "embed"), eager_sharding=False)
    state = nnx.state(nnx.Dict(w=w, v=v))
    rules = (("batch", ("data", "model")), ("embed", "model"))
    with meshplan.logical_axis_rules(rules):
        got = values(meshplan.get_partition_spec(state))
    assert got["w"] == P(("data", "model"), None, P.UNCONSTRAINED)
    assert got["v"] == P(("data", "model"), None)  # 'model' once per array


# -- item 3: creating a sharded model under Flax's eager sharding --------------------------


@pytest.mark.parametrize("mesh_name", ["auto_mesh", "explicit_mesh"])
def test_with_nnx_partitioning_places_by_meshplans_rules_at_creation(mesh_name, request):
    mesh = request.getfixturevalue(mesh_name)
    init = meshplan.with_nnx_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(CLASH):
        layer = nnx.Linear(16, 32, kernel_init=init, rngs=nnx.Rngs(0))
        theirs = nnx.get_partition_spec(nnx.state(layer))
        ours = meshplan.get_partition_spec(nnx.state(layer))
    assert layer.kernel.get_value().sharding.spec == P("data", "model")
    assert layer.kernel.out_sharding == ("embed", "hidden")  # the logical names stay
    assert values(theirs)["kernel"] == values(ours)["kernel"] == P("data", "model")


def test_nnx_sharding_metadata_for_a_param(auto_mesh):
    with jax.set_mesh(auto_mesh):
        w = nnx.Param(jnp.ones((8, 16)), **meshplan.nnx_sharding(("embed", "hidden"), CLASH))
    assert w.get_value().sharding.spec == P("data", "model")


def test_check_hook_reports_where_flax_would_place_otherwise():
    w = nnx.Param(jnp.ones((8, 16)), out_sharding=("embed", "hidden"), eager_sharding=False)
    u = nnx.Param(jnp.ones((8, 16)), out_sharding=("batch", "model"), eager_sharding=False)
    state = nnx.state(nnx.Dict(w=w, u=u))
    problems = nnx_problems(state, CLASH)
    assert [(p.severity, p.code, p.path) for p in problems] == [
        ("warning", "flax-placement", "u"),
        ("warning", "flax-placement", "w"),
    ]
    by_path = {p.path: p.message for p in problems}
    assert "P('model', 'model')" in by_path["w"] and "P('data', 'model')" in by_path["w"]
    # 'model' matches no rule: Flax keeps it as a mesh axis, Linen leaves it unsharded
    assert "P('batch', 'model')" in by_path["u"] and "P(None, None)" in by_path["u"]
    # with meshplan's resolution handed to Flax, the two agree
    fixed = nnx.Param(
        jnp.ones((8, 16)), eager_sharding=False, **meshplan.nnx_sharding(("embed", "hidden"), CLASH)
    )
    assert nnx_problems(nnx.state(nnx.Dict(w=fixed)), CLASH) == []


# -- item 4: constraints inside NNX modules -------------------------------------------------


@pytest.mark.parametrize("mesh_name", ["auto_mesh", "explicit_mesh"])
@pytest.mark.parametrize("jit", [jax.jit, nnx.jit])
@pytest.mark.slow
def test_with_logical_constraint_inside_nnx_modules(mesh_name, jit, request):
    mesh = request.getfixturevalue(mesh_name)
    init = meshplan.with_nnx_partitioning(nnx.initializers.lecun_normal(), ("embed", "hidden"))
    rules = (("batch", "data"), ("hidden", "model"))
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        x = jax.device_put(jnp.ones((8, 16)), NamedSharding(mesh, P("data", None)))
        seen = {}

        class Probe(DotReluDot):
            def __call__(self, x):
                y = jax.nn.relu(self.dot1(x))
                y = meshplan.with_logical_constraint(y, ("batch", "hidden"))
                seen["spec"] = jax.typeof(y).sharding.spec if mesh_name == "explicit_mesh" else None
                return y

        w2 = meshplan.nnx_sharding(("hidden", "embed"))  # Flax's eager sharding, our rules
        probe = Probe(16, nnx.Rngs(0), kernel_init=init, w2_metadata=w2)
        assert same(probe.w2.get_value(), P("model", None), mesh)
        y = jit(lambda m, x: m(x))(probe, x)
    assert same(y, P("data", "model"), mesh)
    if mesh_name == "explicit_mesh":
        assert seen["spec"] == P("data", "model")


# -- item 8: bad input names the variable's path ---------------------------------------------


def test_more_names_than_dims_names_the_path():
    w = nnx.Param(jnp.ones((8,)), out_sharding=("embed", "hidden"), eager_sharding=False)
    state = nnx.state(nnx.Dict(block=nnx.Dict(w=w)))
    with pytest.raises(meshplan.LogicalNamesError) as e:
        meshplan.get_partition_spec(state)
    assert "block/w" in str(e.value) and e.value.problems[0].code == "rank"
    assert e.value.problems[0].path == "block/w"
    with meshplan.logical_axis_rules(RULES):
        [problem] = [p for p in meshplan.check(state, MESH) if p.severity == "error"]
    assert (problem.code, problem.path) == ("rank", "block/w")


def test_fewer_names_are_fine_and_trailing_dims_unsharded():
    w = nnx.Param(jnp.ones((8, 16)), out_sharding=("data",), eager_sharding=False)
    assert values(meshplan.get_partition_spec(nnx.state(nnx.Dict(w=w)))) == {"w": P("data")}


@pytest.mark.parametrize("rules", [None, RULES])
def test_a_names_entry_that_is_not_a_name_names_the_path(rules, auto_mesh):
    w = nnx.Param(jnp.ones((8, 16)), out_sharding=("embed", 3), eager_sharding=False)
    state = nnx.state(nnx.Dict(w=w))
    with meshplan.logical_axis_rules(rules or ()):
        with pytest.raises(meshplan.LogicalNamesError) as e:
            meshplan.get_partition_spec(state)
        assert e.value.problems[0].path == "w" and "3" in str(e.value)
        with pytest.raises(meshplan.ShardingValidationError) as e2:
            meshplan.get_sharding(state, auto_mesh, strict=True)
    assert next((p.code, p.path) for p in e2.value.problems if p.severity == "error") == (
        "names",
        "w",
    )


def test_rules_naming_a_mesh_axis_the_mesh_lacks(state, auto_mesh):
    rules = (("hidden", "tensor"),)
    with meshplan.logical_axis_rules(rules):
        with pytest.raises(meshplan.ShardingValidationError) as e:
            meshplan.get_sharding(state, auto_mesh, strict=True)
        with pytest.raises(meshplan.MeshError) as e2:
            meshplan.get_sharding(state, auto_mesh)
    [problem] = [p for p in e.value.problems if p.severity == "error"]
    assert (problem.code, problem.path) == ("rule-unknown-axis", "rules[0]")
    assert "layers/dot1/kernel, layers/w2" in problem.message
    assert "layers/dot1/kernel" in str(e2.value)


def test_missing_partition_name_is_reported_with_the_path():
    # Flax 0.12 skips the metadata when transform_metadata lacks PARTITION_NAME: the
    # names stay one short, one dimension off.
    @nnx.vmap(transform_metadata={})
    def create(r):
        return DotReluDot(16, r)

    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: create(nnx.Rngs(0).split(2)))
    problems = nnx_problems(nnx.state(model), RULES)
    assert {(p.code, p.path) for p in problems} >= {
        ("unnamed-transform-axis", "dot1/kernel"),
        ("unnamed-transform-axis", "w2"),
    }
    assert "PARTITION_NAME" in problems[0].fix


def test_strict_shardings_of_a_good_state_do_not_raise(state, auto_mesh):
    with meshplan.logical_axis_rules(RULES):
        meshplan.get_sharding(state, auto_mesh, strict=True)
    mesh_names = abstract(
        lambda: DotReluDot(
            16,
            nnx.Rngs(0),
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, "model")),
            w2_metadata={"out_sharding": ("model", None)},
        )
    )
    shardings = meshplan.get_sharding(nnx.state(mesh_names), auto_mesh, strict=True)
    assert values(shardings)["w2"].spec == P("model", None)


@pytest.mark.slow
def test_an_nnx_state_round_trips_through_a_checkpoint_with_its_names(tmp_path, auto_mesh):
    w = nnx.Param(
        jnp.arange(128.0).reshape(8, 16), out_sharding=("embed", "mlp"), eager_sharding=False
    )
    state = nnx.state(nnx.Dict(w=w))
    rules = (("embed", "data"), ("mlp", "model"))
    with meshplan.Checkpointer(tmp_path) as ckpt:
        ckpt.save(0, state, rules=rules)
    restored = meshplan.restore(tmp_path, auto_mesh, rules)
    assert restored.metadata.arrays["w"].names == ("embed", "mlp")  # the variable's path, its names
    assert restored.state["w"].value.sharding.spec == P("data", "model")
    back = restored.into(state)  # an nnx.State again, variables keep their metadata
    assert isinstance(back["w"], nnx.Variable)
    assert back["w"].get_metadata()["out_sharding"] == ("embed", "mlp")
    np.testing.assert_array_equal(
        np.asarray(back["w"].get_value()), np.arange(128.0).reshape(8, 16)
    )
