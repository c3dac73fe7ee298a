"""Built-in layouts: they cover the vocabulary, place each parameter where their docstrings
say, and user rule files load or fail with a message naming the file."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import meshplan
import meshplan.layouts as layouts
from meshplan.models.transformer import AXIS_NAMES, Transformer, TransformerConfig

P = PartitionSpec
CONFIG = TransformerConfig(num_layers=2, num_heads=4, embed_dim=32, mlp_dim=64, max_len=16)
BUILT_IN = ["data_parallel", "fsdp", "tensor_parallel", "fsdp_tp"]
DM = ("data", "model")


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), DM)


@pytest.fixture(scope="module")
def abstract_params():
    model = Transformer(CONFIG)
    return jax.eval_shape(
        lambda: model.init(jax.random.key(0), np.zeros((8, 16), np.int32))["params"]
    )


def mesh_spec(abstract_params, path: tuple[str, ...], rules) -> PartitionSpec:
    box = abstract_params
    for key in path:
        box = box[key]
    return meshplan.logical_to_mesh_axes(box.names, rules)


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_built_in_layout_covers_the_whole_vocabulary(name):
    rules = layouts.get_layout(name)
    assert {logical for logical, _ in rules} == set(AXIS_NAMES)
    assert rules[0][0] == "batch"  # batch claims its mesh axes before embed can


# What each docstring promises, parameter by parameter.
PROMISES = [
    # data_parallel: batch over all devices, parameters replicated.
    ("data_parallel", ("layers", "mlp", "wi"), P(None, None, None)),
    ("data_parallel", ("embed",), P(None, None)),
    ("data_parallel", ("head",), P(None, None)),
    # fsdp: every parameter's embed dimension over all devices.
    ("fsdp", ("layers", "mlp", "wi"), P(None, DM, None)),
    ("fsdp", ("layers", "mlp", "wo"), P(None, None, DM)),
    ("fsdp", ("layers", "attention", "query"), P(None, DM, None, None)),
    ("fsdp", ("embed",), P(None, DM)),
    ("fsdp", ("final_norm", "scale"), P(DM)),
    # tensor_parallel: heads, mlp and vocab over model; embed whole.
    ("tensor_parallel", ("layers", "mlp", "wi"), P(None, None, "model")),
    ("tensor_parallel", ("layers", "attention", "out"), P(None, "model", None, None)),
    ("tensor_parallel", ("layers", "attention", "key"), P(None, None, "model", None)),
    ("tensor_parallel", ("head",), P(None, "model")),
    ("tensor_parallel", ("final_norm", "scale"), P(None)),
    # fsdp_tp: embed over data, heads/mlp/vocab over model.
    ("fsdp_tp", ("layers", "mlp", "wi"), P(None, "data", "model")),
    ("fsdp_tp", ("layers", "attention", "out"), P(None, "model", None, "data")),
    ("fsdp_tp", ("embed",), P("model", "data")),
    ("fsdp_tp", ("final_norm", "scale"), P("data")),
]


@pytest.mark.parametrize(("name", "path", "expected"), PROMISES)
def test_layout_places_parameters_as_its_docstring_promises(abstract_params, name, path, expected):
    assert mesh_spec(abstract_params, path, layouts.get_layout(name)) == expected


ACTIVATIONS = [
    ("data_parallel", P(DM, None, None)),
    ("fsdp", P(DM, None, None)),
    ("tensor_parallel", P("data", None, None)),
    ("fsdp_tp", P("data", None, None)),
]


@pytest.mark.parametrize(("name", "expected"), ACTIVATIONS)
def test_activations_split_by_batch_and_keep_embed_whole(name, expected):
    rules = layouts.get_layout(name)
    assert meshplan.logical_to_mesh_axes(("batch", "length", "embed"), rules) == expected


# Share of the parameter bytes on one device, relative to one full copy: (low, high).
# tensor_parallel keeps the norms whole; fsdp_tp splits them over data only.
SHARE = {
    "data_parallel": (1.0, 1.0),
    "fsdp": (1 / 8, 1 / 8),
    "tensor_parallel": (1 / 4, 1 / 4 * 1.1),
    "fsdp_tp": (1 / 8, 1 / 8 * 1.1),
}
# Device 0's shard of layers/mlp/wi, a (layer=2, embed=32, mlp=64) array.
LOCAL_WI = {
    "data_parallel": (2, 32, 64),
    "fsdp": (2, 4, 64),
    "tensor_parallel": (2, 32, 16),
    "fsdp_tp": (2, 16, 16),
}


@pytest.mark.parametrize("name", BUILT_IN)
@pytest.mark.slow
def test_initialised_shards_have_the_promised_size_on_device_0(mesh, abstract_params, name):
    rules = layouts.get_layout(name)
    shardings = meshplan.logical_to_mesh_sharding(
        meshplan.get_partition_spec(abstract_params), mesh, rules
    )
    model = Transformer(CONFIG)
    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        params = jax.jit(
            lambda: model.init(jax.random.key(0), np.zeros((8, 16), np.int32))["params"],
            out_shardings=shardings,
        )()
    arrays = jax.tree.leaves(meshplan.unbox(params))
    total = sum(a.nbytes for a in arrays)
    device0 = jax.devices()[0]
    on_device0 = sum(
        s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device0
    )
    wi = params["layers"]["mlp"]["wi"].value
    local_wi = next(s.data.shape for s in wi.addressable_shards if s.device == device0)
    low, high = SHARE[name]
    assert total * low <= on_device0 <= total * high
    assert local_wi == LOCAL_WI[name]


def test_list_layouts_gives_every_layout_with_a_one_line_description():
    listed = layouts.list_layouts()
    assert [name for name, _ in listed] == list(layouts.ALL_LAYOUTS)
    for name, description in listed:
        assert description and "\n" not in description, name
    docs = dict(listed)
    assert "replicated" in docs["data_parallel"]
    assert "Megatron" in docs["tensor_parallel"]


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_layout_docstring_says_when_to_pick_it(name):
    assert "Pick it" in layouts.describe_layout(name)


def test_describe_layout_of_an_unknown_name_lists_the_built_in_ones():
    # It used to return "" for any name it did not know.
    with pytest.raises(meshplan.RulesError, match="Unknown layout 'zero3'") as info:
        layouts.describe_layout("zero3")
    assert all(name in str(info.value) for name in layouts.LAYOUTS)


@pytest.mark.parametrize("name", ["zero3", "nope.txt"])
def test_a_layout_that_cannot_be_had_carries_its_code(name, tmp_path):
    # callers give their own advice by the code, never by the message's text
    (tmp_path / "nope.txt").write_text("")
    expected = "unknown-layout" if name == "zero3" else "rules-file"
    with pytest.raises(meshplan.RulesError) as info:
        layouts.get_layout(name if name == "zero3" else str(tmp_path / name))
    assert [p.code for p in info.value.problems] == [expected]
    assert str(info.value).count("\n") == 1  # the message, then the fix on its own line


def test_guide_layout_is_the_guides_rules():
    assert layouts.get_layout("guide") == (("batch", "data"), ("hidden", "model"))


def test_rules_load_from_a_json_file(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text(json.dumps([["batch", "data"], ["embed", ["data", "model"]], ["mlp", None]]))
    assert layouts.get_layout(path) == (
        ("batch", "data"),
        ("embed", ("data", "model")),
        ("mlp", None),
    )


@pytest.mark.parametrize("key", ["RULES", "rules"])
def test_rules_load_from_a_python_file(tmp_path, key):
    path = tmp_path / "my_rules.py"
    path.write_text(f"{key} = [('batch', 'data'), ('mlp', ['model'])]\n")
    assert layouts.get_layout(str(path)) == (("batch", "data"), ("mlp", ("model",)))


def test_unknown_layout_lists_the_built_in_names():
    with pytest.raises(meshplan.RulesError, match="Unknown layout 'zero3'") as info:
        layouts.get_layout("zero3")
    for name in layouts.LAYOUTS:
        assert name in str(info.value)


BAD_FILES = [
    ("missing.json", None, "no such file"),
    ("bad.json", "[['batch', 'data']", "not valid JSON"),
    ("dict.json", '{"batch": "data"}', "not a list"),
    ("pair.json", '[["batch"]]', r"rules\[0\]: \[\"batch\"\] is not a \[name, axes\] pair"),
    (
        "twice.json",
        '[["mlp", "model"], ["batch", ["data", "data"]]]',
        r"rules\[1\]: .*'data' is named twice",
    ),
    ("twice.py", "RULES = [('batch', ('data', 'data'))]\n", r"rules\[0\]: .*'data' is named twice"),
    ("exit0.py", "raise SystemExit(0)\n", r"called exit \(SystemExit with code 0\)"),
    ("exit.py", "import sys\nsys.exit('bye')\n", r"called exit \(SystemExit with code 'bye'\)"),
    ("base.py", "raise GeneratorExit('x')\n", "GeneratorExit: x"),
    ("axes.json", '[["batch", 3]]', "not a string, a list of strings or null"),
    ("none.py", "x = 1\n", "neither RULES nor rules"),
    ("boom.py", "raise RuntimeError('oops')\n", "RuntimeError: oops"),
    ("invalid.py", "RULES = [('batch', 3)]\n", "mesh axes must be"),
    ("rules.yaml", "batch: data\n", "must end in .py or .json"),
]


@pytest.mark.parametrize(("filename", "content", "message"), BAD_FILES)
def test_bad_rule_files_name_the_file_and_the_problem(tmp_path, filename, content, message):
    path = tmp_path / filename
    if content is not None:
        path.write_text(content)
    with pytest.raises(meshplan.RulesError, match=message) as info:
        layouts.get_layout(str(path))
    assert filename in str(info.value)


def test_a_mesh_axis_named_twice_in_a_rules_file_is_a_bad_rule(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text('[["mlp", "model"], ["batch", ["data", "data"]]]')
    with pytest.raises(meshplan.RulesError) as info:
        layouts.get_layout(str(path))
    message = str(info.value)
    assert message.startswith(f"Cannot read rules from {str(path)!r}")
    assert "e.g. ('batch', 'data')." in message
    assert [(p.path, p.code) for p in info.value.problems] == [("rules[1]", "bad-rule")]


def test_a_rules_file_that_exits_does_not_end_the_caller(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("raise SystemExit(0)\n")
    with pytest.raises(meshplan.RulesError, match="Remove the exit"):
        layouts.get_layout(str(path))
    path.write_text("raise KeyboardInterrupt\n")  # ctrl-C still stops everything
    with pytest.raises(KeyboardInterrupt):
        layouts.get_layout(str(path))
