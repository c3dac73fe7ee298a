"""meshplan.name_by_path: logical names given by path regex, on every kind of tree people have;
meshplan.layouts.get_names: the same path rules read from a .json or .py file."""

from __future__ import annotations

import json
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import meshplan
import meshplan.layouts
from trees import logical, sds

MESH = {"data": 2, "model": 4}
RULES = (("embed", "data"), ("mlp", "model"), ("vocab", "model"))


class Mlp(nn.Module):
    """A Linen MLP written without meshplan: no names anywhere."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(8)(nn.relu(nn.Dense(16)(x)))


MLP_NAMES = [
    (r"params/Dense_0/kernel", ("embed", "mlp")),
    (r"params/Dense_1/kernel", ("mlp", "embed")),
    (r"params/Dense_\d+/bias", (None,)),
]


def _quiet(tree, rules):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning expected
        return meshplan.name_by_path(tree, rules)


def test_plain_dict_arrays_are_boxed_first_match_wins_in_full():
    params = {"a": {"kernel": jnp.zeros((4, 8))}, "ab": {"kernel": jnp.zeros((8, 4))}}
    named = _quiet(params, [(r"a/kernel", ("embed", "mlp")), (r"a.*/kernel", ("mlp", "embed"))])
    assert isinstance(named["a"]["kernel"], meshplan.LogicallyPartitioned)
    assert named["a"]["kernel"].names == ("embed", "mlp")  # the first pattern wins
    assert named["ab"]["kernel"].names == ("mlp", "embed")  # 'a/kernel' is matched in full only
    assert named["a"]["kernel"].value is params["a"]["kernel"]


def test_rank_mismatches_are_all_raised_once_with_path_names_and_shape():
    params = {"k": jnp.zeros((4, 8)), "b": jnp.zeros(8), "e": jnp.zeros((2, 3, 4))}
    with pytest.raises(meshplan.LogicalNamesError, match=r"Cannot name arrays by path") as info:
        meshplan.name_by_path(params, [(r"k|e", ("embed", "mlp")), (r"b", ("embed", "mlp"))])
    assert [(p.code, p.path) for p in info.value.problems] == [
        ("path-names-rank", "b"),
        ("path-names-rank", "e"),
    ]
    message = str(info.value)
    assert "e: path_rules[0] ('k|e') gives 2 names ('embed', 'mlp')" in message
    assert "shape (2, 3, 4) (rank 3)" in message and "shape (8,) (rank 1)" in message


def test_bad_pairs_patterns_and_names_are_listed_together():
    bad = [("(", ("embed",)), (".*", "embed"), ("x",), (3, ("a",)), (".*", ("a", "a"))]
    with pytest.raises(meshplan.LogicalNamesError, match=r"path_rules\[0\].*not a regular") as info:
        meshplan.name_by_path({"w": jnp.zeros(2)}, bad)
    assert [p.path for p in info.value.problems] == [f"path_rules[{i}]" for i in range(5)]
    assert {p.code for p in info.value.problems} == {"path-rule"}
    with pytest.raises(meshplan.LogicalNamesError, match=r"not a sequence of pairs"):
        meshplan.name_by_path({"w": jnp.zeros(2)}, {".*": ("embed",)})


def test_unmatched_arrays_and_unused_patterns_in_one_warning():
    params = {"k": jnp.zeros((4, 8)), "b": jnp.zeros(8), "c": jnp.zeros(8), "step": 3}
    with pytest.warns(meshplan.UnnamedLeavesWarning, match=r"2 arrays .* b, c.*'typo'") as record:
        named = meshplan.name_by_path(params, [(r"k", ("embed", "mlp")), (r"typo", ("mlp",))])
    [warning] = record
    assert warning.message.paths == ("b", "c") and warning.message.unused == ("typo",)
    assert named["step"] == 3 and named["b"] is params["b"]
    # names=None leaves an array alone on purpose: no warning
    _quiet(params, [(r"k", ("embed", "mlp")), (r"b|c", None)])


def test_linen_variables_become_a_plan_with_logical_names():
    x = jnp.ones((2, 4))
    variables = Mlp().init(jax.random.key(0), x)
    named = _quiet(variables, MLP_NAMES)
    plan = meshplan.explain(named, MESH, RULES)
    assert plan["params/Dense_0/kernel"].spec == P("data", "model")
    assert plan["params/Dense_1/kernel"].spec == P("model", "data")
    assert {leaf.kind for leaf in plan.leaves} == {"logical"}
    # the boxed tree is what Linen's apply takes once unboxed
    out = Mlp().apply(meshplan.unbox(named), x)
    assert out.shape == (2, 8)


def test_abstract_trees_named_inside_eval_shape():
    def init(key):
        return meshplan.name_by_path(Mlp().init(key, jnp.ones((2, 4))), MLP_NAMES)

    abstract = jax.eval_shape(init, jax.random.key(0))
    box = abstract["params"]["Dense_0"]["kernel"]
    assert isinstance(box.value, jax.ShapeDtypeStruct) and box.names == ("embed", "mlp")
    specs = meshplan.get_partition_spec(abstract)
    assert specs["params"]["Dense_1"]["kernel"] == P("mlp", "embed")


def test_already_boxed_arrays_are_overridden_where_matched_and_kept_elsewhere():
    tree = {"w": logical(4, 8, names=("a", "b")), "v": logical(8, names=("b",))}
    named = _quiet(tree, [(r"w", ("embed", "mlp")), (r"v", None)])
    assert named["w"].names == ("embed", "mlp") and named["w"].value is tree["w"].value
    with pytest.warns(meshplan.UnnamedLeavesWarning, match=r"1 pattern matched no array"):
        kept = meshplan.name_by_path(tree, [(r"w", ("embed", "mlp")), (r"none", None)])
    assert kept["v"] is tree["v"]  # named already: kept, and not listed as unnamed
    mesh_boxed = {"w": meshplan.Partitioned(sds(4, 8), ("data", None))}
    assert type(_quiet(mesh_boxed, [("w", ("embed", "mlp"))])["w"]) is meshplan.LogicallyPartitioned


def test_nnx_state_variables_get_out_sharding():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 16, rngs=rngs)
            self.down = nnx.Linear(16, 4, rngs=rngs)

    model = Model(nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    names = [(r"up/kernel", ("embed", "mlp")), (r"down/kernel", ("mlp", "embed")), (r".*", None)]
    named = _quiet(state, names)
    assert named["up"]["kernel"].get_metadata()["out_sharding"] == ("embed", "mlp")
    plan = meshplan.explain(named, MESH, RULES)
    assert plan["up/kernel"].spec == P("data", "model")
    assert plan["down/bias"].kind == "unboxed"
    merged = nnx.merge(graphdef, named)  # still a state NNX merges
    assert merged.up.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")


@pytest.mark.slow  # imports transformers and initialises real weights (~5-12 s)
def test_hugging_face_gpt2_params_named_and_planned():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=128, n_positions=64)
    params = transformers.FlaxGPT2LMHeadModel(config, seed=0).params
    names = [
        (r".*/wte/embedding", ("vocab", "embed")),
        (r".*/wpe/embedding", (None, "embed")),
        (r".*/c_attn/kernel", ("mlp", "embed")),  # Conv1D kernels are (out, in)
        (r".*/c_fc/kernel", ("mlp", "embed")),
        (r".*/c_proj/kernel", ("embed", "mlp")),
        (r".*/(c_attn|c_fc)/bias", ("mlp",)),
        (r".*", None),  # norms and the other biases: replicated on purpose
    ]
    named = _quiet(params, names)
    plan = meshplan.explain(named, MESH, RULES)
    assert plan["transformer/h/1/mlp/c_fc/kernel"].spec == P("model", "data")
    assert plan["transformer/wte/embedding"].spec == P("model", "data")
    assert sum(leaf.kind == "logical" for leaf in plan.leaves) == 14  # 6 a layer, 2 tables
    assert meshplan.check(named, MESH, RULES) == []


def test_names_file_json_and_python(tmp_path):
    pairs = [[".*/kernel", ["embed", "mlp"]], [".*/bias", None]]
    (tmp_path / "names.json").write_text(json.dumps(pairs))
    (tmp_path / "names.py").write_text(
        "NAMES = [(r'.*/kernel', ('embed', 'mlp')), ('.*/bias', None)]\n"
    )
    expected = ((".*/kernel", ("embed", "mlp")), (".*/bias", None))
    assert meshplan.layouts.get_names(tmp_path / "names.json") == expected
    assert meshplan.layouts.get_names(str(tmp_path / "names.py")) == expected


def test_names_file_errors_name_the_file_and_each_pair(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([[".*", "embed"], ["(", ["a"]]]))
    with pytest.raises(meshplan.LogicalNamesError, match=r"bad.json.*\n.*path_rules\[0\]") as info:
        meshplan.layouts.get_names(bad)
    assert [p.path for p in info.value.problems] == ["path_rules[0]", "path_rules[1]"]
    (tmp_path / "broken.json").write_text("[[")
    with pytest.raises(meshplan.LogicalNamesError, match=r"not valid JSON .* line 1"):
        meshplan.layouts.get_names(tmp_path / "broken.json")
    (tmp_path / "none.py").write_text("RULES = []\n")
    with pytest.raises(meshplan.LogicalNamesError, match=r"defines neither NAMES nor names"):
        meshplan.layouts.get_names(tmp_path / "none.py")
    with pytest.raises(meshplan.LogicalNamesError, match=r"no such file") as info:
        meshplan.layouts.get_names(tmp_path / "missing.json")
    assert info.value.problems[0].code == "names-file"
