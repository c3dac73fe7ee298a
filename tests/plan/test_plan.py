"""meshplan.explain: per-leaf records, rule traces, exact bytes per device, rendering."""

from __future__ import annotations

import functools
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AbstractMesh, AxisType
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan.models.mlp import LOGICAL_RULES, MLP, LogicalMLP, init_fn

F32 = jnp.float32


def sds(*shape: int, dtype=F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def logical(*shape: int, names, dtype=F32, rules=None) -> meshplan.LogicallyPartitioned:
    return meshplan.LogicallyPartitioned(sds(*shape, dtype=dtype), names, rules=rules)


def mesh_box(*shape: int, names, dtype=F32) -> meshplan.Partitioned:
    return meshplan.Partitioned(sds(*shape, dtype=dtype), names)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


@functools.cache
def guide_state(logical_names: bool, scan: bool = False):
    model = LogicalMLP(4, 64, scan) if logical_names else MLP(4, 64, scan)
    return jax.eval_shape(
        functools.partial(init_fn, model=model, optimizer=optax.adam(1e-3)),
        jax.random.key(0),
        sds(8, 64),
    )


# ---------------------------------------------------------------------------
# Totals checked by hand
# ---------------------------------------------------------------------------


def test_sharded_leaf_bytes_per_device_by_hand(mesh):
    # (8, 4) float32 = 128 B, rows over model=4: each device holds (2, 4) = 32 B,
    # and the 2 devices along 'data' hold the same piece.
    plan = meshplan.explain({"w": mesh_box(8, 4, names=("model", None))}, mesh)
    leaf = plan["w"]
    assert leaf.shard_shape == (2, 4)
    assert leaf.bytes == 128
    assert leaf.bytes_per_device == 32
    assert leaf.replication == 2
    total = plan.totals["all"]
    assert total.device_bytes == (32,) * 8
    assert (total.bytes, total.max_device_bytes, total.ideal_bytes) == (128, 32, 16)
    assert total.efficiency == 0.5


def test_fully_sharded_leaf_reaches_the_ideal(mesh):
    # (16, 8) bf16 = 256 B over data=2 (rows) x model=4 (cols): (8, 2) bf16 = 32 B each.
    plan = meshplan.explain(
        {"w": mesh_box(16, 8, names=("data", "model"), dtype=jnp.bfloat16)}, mesh
    )
    leaf = plan["w"]
    assert (leaf.shard_shape, leaf.bytes_per_device, leaf.replication) == ((8, 2), 32, 1)
    assert plan.totals["all"].max_device_bytes == plan.totals["all"].ideal_bytes == 32


def test_uneven_shards_counted_exactly_per_device(mesh):
    # 10 float32 over model=4: pieces of 3, 3, 3 and 1 elements -> 12, 12, 12, 4 bytes,
    # repeated along 'data' (mesh order: data-major).
    plan = meshplan.explain({"v": mesh_box(10, names=("model",))}, mesh)
    leaf = plan["v"]
    assert leaf.uneven
    assert leaf.shard_shape == (3,)
    assert leaf.bytes_per_device == 12
    assert plan.totals["all"].device_bytes == (12, 12, 12, 4, 12, 12, 12, 4)
    assert plan.totals["all"].max_device_bytes == 12
    assert plan.totals["all"].ideal_bytes == 5  # ceil(40 / 8)
    assert leaf.dims[0].padded_size == 12


def test_uneven_two_dims_bytes_per_device(mesh):
    # (3, 6) int8 over data=2 (rows: 2, 1) x model=4 (cols: 2, 2, 2, 0).
    plan = meshplan.explain({"m": mesh_box(3, 6, names=("data", "model"), dtype=jnp.int8)}, mesh)
    expected = [r * c for r in (2, 1) for c in (2, 2, 2, 0)]
    assert plan.totals["all"].device_bytes == tuple(expected)
    assert plan["m"].bytes_per_device == 4


def test_totals_split_by_group_by_hand(mesh):
    tree = {
        "params": {"w": mesh_box(8, 8, names=(None, "model"))},  # 256 B -> 64 B per device
        "opt_state": ({"mu": {"w": mesh_box(8, 8, names=(None, "model"))}},),
        "step": sds(dtype=jnp.int32),  # 4 B on every device
    }
    plan = meshplan.explain(tree, mesh)
    assert {leaf.path: leaf.group for leaf in plan} == {
        "params/w": "params",
        "opt_state/0/mu/w": "optimizer",
        "step": "other",
    }
    t = plan.totals
    assert (t["params"].bytes, t["params"].max_device_bytes, t["params"].ideal_bytes) == (
        256,
        64,
        32,
    )
    assert (t["optimizer"].bytes, t["optimizer"].max_device_bytes) == (256, 64)
    assert (t["other"].bytes, t["other"].max_device_bytes, t["other"].ideal_bytes) == (4, 4, 1)
    assert (t["all"].bytes, t["all"].max_device_bytes, t["all"].leaves) == (516, 132, 3)


def test_guide_train_state_totals(mesh):
    # 8 kernels of 64x64 float32 (16 KiB), split 4 ways; Adam doubles them; step + count.
    plan = meshplan.explain(guide_state(False), mesh)
    t = plan.totals
    assert t["params"].leaves == 8 and t["params"].max_device_bytes == 8 * 4096
    assert t["optimizer"].leaves == 17 and t["optimizer"].max_device_bytes == 16 * 4096 + 4
    assert t["other"].max_device_bytes == 4
    assert t["all"].max_device_bytes == 24 * 4096 + 8


# ---------------------------------------------------------------------------
# Paths, kinds and specs
# ---------------------------------------------------------------------------


def test_train_state_paths(mesh):
    plan = meshplan.explain(guide_state(False), mesh)
    paths = [leaf.path for leaf in plan]
    assert "params/DotReluDot_0/Dense_0/kernel" in paths
    assert "params/DotReluDot_3/W2" in paths
    assert "opt_state/0/mu/DotReluDot_0/Dense_0/kernel" in paths
    assert "opt_state/0/nu/DotReluDot_2/W2" in paths
    assert "opt_state/0/count" in paths and "step" in paths
    assert plan.skipped_leaves == 0  # apply_fn and tx are static fields of TrainState


@pytest.mark.parametrize("logical_names", [False, True], ids=["mesh-axis boxes", "logical boxes"])
def test_plan_specs_equal_get_sharding(mesh, logical_names):
    state = guide_state(logical_names)
    with meshplan.logical_axis_rules(LOGICAL_RULES):
        plan = meshplan.explain(state, mesh)
        shardings = meshplan.get_sharding(state, mesh)
    flat = jax.tree_util.tree_leaves(shardings)
    assert [leaf.spec for leaf in plan] == [s.spec for s in flat]


def test_guide_specs(mesh):
    plan = meshplan.explain(guide_state(True), mesh, LOGICAL_RULES)
    assert plan["params/LogicalDotReluDot_0/Dense_0/kernel"].spec == P(None, "model")
    assert plan["params/LogicalDotReluDot_0/W2"].spec == P("model", None)
    assert plan["opt_state/0/mu/LogicalDotReluDot_1/W2"].spec == P("model", None)
    assert plan["step"].spec == P()
    assert plan["params/LogicalDotReluDot_0/Dense_0/kernel"].names == ("embed", "hidden")


def test_scanned_layer_axis_is_named_and_replicated(mesh):
    plan = meshplan.explain(guide_state(True, scan=True), mesh, LOGICAL_RULES)
    leaf = plan["params/ScanLogicalDotReluDot_0/Dense_0/kernel"]
    assert leaf.names == ("layer", "embed", "hidden")
    assert leaf.spec == P(None, None, "model")
    assert [d.status for d in leaf.dims] == ["no-rule", "no-rule", "rule"]


def test_kinds_of_leaves(mesh):
    tree = {
        "logical": logical(8, 8, names=("embed", "hidden")),
        "mesh": mesh_box(8, 8, names=("data", None)),
        "array": jnp.zeros((8, 8)),
        "abstract": sds(8, 8),
        "scalar": 1.0,
        "name": "adam",
    }
    plan = meshplan.explain(tree, mesh, (("hidden", "model"),))
    assert {leaf.path: leaf.kind for leaf in plan} == {
        "abstract": "unboxed",
        "array": "unboxed",
        "logical": "logical",
        "mesh": "mesh",
    }
    assert plan.skipped_leaves == 2
    assert plan["array"].spec == P(None, None) and plan["array"].replication == 8


def test_mesh_axis_boxes_ignore_rules(mesh):
    plan = meshplan.explain(
        {"w": mesh_box(8, 8, names=("model", None))}, mesh, (("model", "data"),)
    )
    assert plan["w"].spec == P("model", None)
    assert plan["w"].dims[0].status == "mesh"


def test_box_rules_take_precedence(mesh):
    own = logical(8, 8, names=("embed", None), rules=(("embed", "data"),))
    plan = meshplan.explain(
        {"own": own, "shared": logical(8, 8, names=("embed", None))}, mesh, (("embed", "model"),)
    )
    assert plan["own"].spec == P("data", None)
    assert plan["shared"].spec == P("model", None)


def test_active_rules_are_used_when_none_given(mesh):
    tree = {"w": logical(8, 8, names=("embed", "hidden"))}
    with meshplan.logical_axis_rules((("hidden", "model"),)):
        assert meshplan.explain(tree, mesh)["w"].spec == P(None, "model")
    assert meshplan.explain(tree, mesh)["w"].spec == P(None, None)


def test_flax_boxes_are_understood(mesh):
    tree = {
        "p": nn.Partitioned(sds(8, 8), (None, "model")),
        "l": nn.LogicallyPartitioned(sds(8, 8), ("embed", "hidden")),
    }
    plan = meshplan.explain(tree, mesh, (("hidden", "model"),))
    assert plan["p"].kind == "mesh" and plan["p"].spec == P(None, "model")
    assert plan["l"].kind == "logical" and plan["l"].spec == P(None, "model")


@pytest.mark.slow
def test_concrete_boxed_params(mesh):
    variables = LogicalMLP(2, 16, False).init(jax.random.key(0), jnp.ones((8, 16)))
    plan = meshplan.explain(variables, mesh, LOGICAL_RULES)
    leaf = plan["params/LogicalDotReluDot_0/Dense_0/kernel"]
    assert (leaf.shape, leaf.dtype, leaf.bytes_per_device) == ((16, 16), "float32", 256)


@pytest.mark.parametrize(
    "make_mesh",
    [
        lambda: jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2),
        lambda: jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2),
        lambda: AbstractMesh((2, 4), ("data", "model")),
        lambda: {"data": 2, "model": 4},
    ],
    ids=["auto", "explicit", "abstract", "mapping"],
)
def test_any_kind_of_mesh_gives_the_same_plan(make_mesh):
    state = guide_state(True)
    reference = meshplan.explain(state, {"data": 2, "model": 4}, LOGICAL_RULES).to_dict()
    data = meshplan.explain(state, make_mesh(), LOGICAL_RULES).to_dict()
    for d in (data, reference):
        d["mesh"].pop("device_ids")
    assert data == reference


def test_device_ids_come_from_the_mesh():
    devices = np.array(jax.devices()[:8])[::-1].reshape(2, 4)
    mesh = jax.sharding.Mesh(devices, ("data", "model"))
    plan = meshplan.explain({}, mesh)
    assert plan.mesh.device_ids == tuple(d.id for d in devices.flat)


# ---------------------------------------------------------------------------
# Why: which rule placed each dimension, which were skipped
# ---------------------------------------------------------------------------


def test_reference_example_trace():
    rules = (("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z"))
    tree = {"a": logical(4, 4, 4, 4, names=("batch", "length", "heads", "features"))}
    plan = meshplan.explain(tree, {"X": 2, "Y": 2, "Z": 2}, rules)
    batch, length, heads, features = plan["a"].dims
    assert plan["a"].spec == P("X", None, "Y", None)
    assert (batch.status, batch.rule_index, batch.mesh_axes) == ("rule", 0, ("X",))
    assert [(s.rule_index, s.reason) for s in batch.skipped] == [(3, "dimension already assigned")]
    assert (length.status, length.skipped) == ("no-rule", ())
    assert (heads.rule_index, heads.mesh_axes) == (2, ("Y",))
    assert features.status == "no-rule"
    (skip,) = features.skipped
    assert (skip.rule_index, skip.reason, skip.taken_by) == (1, "mesh axis taken", (0,))
    assert "rule 1 ('features', 'X') skipped (mesh axis already used by dim 0)" in features.why
    assert "replicated" in features.why
    assert length.why == "no rule for 'length': replicated"


@pytest.mark.parametrize(
    ("names", "rules", "mesh_shape", "dim", "expected"),
    [
        (("a", "b"), (("a", "X"), ("b", ("X", "Y"))), {"X": 2, "Y": 2}, 1, "tuple partly taken"),
        (("a", "b"), (("a", "X"), ("b", "X")), {"X": 2}, 1, "mesh axis already used by dim 0"),
        (("a",), (("a", "X"),), {"X": 1, "Y": 8}, 0, "mesh axis 'X' has size 1, so not split"),
        (("a",), (), {"X": 2}, 0, "no rule for 'a': replicated"),
        (("a",), (("a", "X"),), {"X": 3}, 0, "size 4 does not divide by 3"),
        (("a",), (("a", None),), {"X": 2}, 0, "rule 0 ('a', None): kept whole"),
        (("a",), (("a", ("X", "Y")),), {"X": 2, "Y": 2}, 0, "split 4 ways"),
    ],
    ids=[
        "tuple-partly-taken",
        "axis-taken",
        "axis-of-size-1",
        "no-rule",
        "indivisible",
        "rule-to-none",
        "tuple-placed",
    ],
)
def test_why_explains_each_outcome(names, rules, mesh_shape, dim, expected):
    tree = {"x": logical(*([4] * len(names)), names=names)}
    leaf = meshplan.explain(tree, mesh_shape, rules)["x"]
    assert expected in leaf.dims[dim].why
    assert expected in leaf.why


def test_tuple_rule_shards_over_the_product(mesh):
    plan = meshplan.explain({"x": logical(16, names=("a",))}, mesh, (("a", ("data", "model")),))
    leaf = plan["x"]
    assert leaf.spec == P(("data", "model"))
    assert (leaf.dims[0].shards, leaf.shard_shape, leaf.replication) == (8, (2,), 1)


# ---------------------------------------------------------------------------
# Serialisation and rendering
# ---------------------------------------------------------------------------


def test_to_dict_schema(mesh):
    plan = meshplan.explain(guide_state(True), mesh, LOGICAL_RULES)
    data = json.loads(plan.to_json())
    assert data == plan.to_dict()
    assert data["schema"] == "meshplan.plan/1"
    assert data["mesh"]["shape"] == {"data": 2, "model": 4}
    assert data["rules"] == [["batch", "data"], ["hidden", "model"]]
    assert set(data["totals"]) == {"all", "params", "optimizer", "other"}
    kernel = next(x for x in data["leaves"] if x["path"].endswith("0/Dense_0/kernel"))
    assert set(kernel) == {
        "path",
        "group",
        "kind",
        "shape",
        "dtype",
        "names",
        "spec",
        "shard_shape",
        "bytes",
        "bytes_per_device",
        "replication",
        "uneven",
        "dims",
    }
    assert kernel["spec"] == [None, "model"]
    assert kernel["names"] == ["embed", "hidden"]
    assert kernel["dims"][1]["rule"] == 1 and kernel["dims"][1]["mesh_axes"] == ["model"]
    assert kernel["dims"][0]["status"] == "no-rule"


def test_tuple_entries_serialise_as_lists(mesh):
    plan = meshplan.explain({"x": mesh_box(16, 4, names=(("data", "model"), None))}, mesh)
    assert plan.to_dict()["leaves"][0]["spec"] == [["data", "model"], None]


def test_str_shows_a_table(mesh):
    text = str(meshplan.explain(guide_state(True), mesh, LOGICAL_RULES))
    assert "params/LogicalDotReluDot_0/Dense_0/kernel" in text
    assert "P(None, 'model')" in text
    assert "fullest device" in text and "optimizer" in text
    assert "no rule: embed" in text


def test_long_trees_are_summarised(mesh):
    tree = {f"w{i:03d}": mesh_box(8, i + 1, names=("model", None)) for i in range(100)}
    plan = meshplan.explain(tree, mesh)
    short = str(plan)
    assert "w099" in short and "w000" not in short  # the largest are kept
    assert "76 smaller leaves" in short and "plan.table(full=True)" in short
    from meshplan._plan.render.table import to_text

    full = to_text(plan.table(full=True))
    assert all(f"w{i:03d}" in full for i in range(100))


def test_repr_is_one_line(mesh):
    plan = meshplan.explain({"w": mesh_box(8, 4, names=("model", None))}, mesh)
    assert repr(plan) == (
        "<Plan of 1 leaf on data=2 × model=4 (8 devices): 128 B in all, 32 B on the fullest device>"
    )


def test_rich_console_renders_narrow_and_wide(mesh):
    from rich.console import Console

    plan = meshplan.explain(guide_state(True), mesh, LOGICAL_RULES)
    texts = {}
    for width in (80, 200):
        console = Console(width=width, record=True, color_system=None)
        console.print(plan)
        texts[width] = console.export_text()
        assert "P(None, 'model')" in texts[width]
        assert max(len(line) for line in texts[width].splitlines()) <= width
    assert "logical names" in texts[200] and "logical names" not in texts[80]


def test_save_png_headless(mesh, tmp_path):
    plan = meshplan.explain(guide_state(True), mesh, LOGICAL_RULES)
    path = tmp_path / "sub" / "plan.png"
    plan.save_png(path)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000


def test_save_png_of_uneven_and_replicated_leaves(tmp_path):
    tree = {"params": {"e": logical(10, 6, names=("vocab", "embed")), "r": sds(64, 64)}}
    plan = meshplan.explain(tree, {"x": 3, "y": 2, "z": 2}, (("vocab", "x"),))
    plan.save_png(tmp_path / "p.png", top=2, title="uneven")
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_unknown_path_suggests_the_nearest(mesh):
    plan = meshplan.explain(guide_state(False), mesh)
    with pytest.raises(KeyError, match=r"params/DotReluDot_0/Dense_0/kernel"):
        plan["params/DotReluDot_0/Dense0/kernel"]


def test_plan_is_iterable_and_sized(mesh):
    plan = meshplan.explain(guide_state(False), mesh)
    assert len(plan) == len(list(plan)) == 26


def test_user_text_in_the_table_is_printed_literally_not_as_rich_markup():
    from meshplan._plan.render.table import to_text

    w = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((8, 6), jnp.float32), ("[red]embed", "mlp")
    )
    plan = meshplan.explain({"[bold]w": w}, {"data": 2, "model": 4}, (("mlp", "data"),))
    text = to_text(plan.table(full=True))
    assert "[bold]w" in text
    assert "no rule: [red]embed" in text


def test_a_pod_sized_plan_draws_its_png(tmp_path):
    """16,384 devices are drawn as images, not a patch per device (that took minutes)."""
    w = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((1024, 512), jnp.float32), ("embed", "mlp")
    )
    plan = meshplan.explain(
        {"w": w}, {"data": 128, "model": 128}, (("embed", "data"), ("mlp", "model"))
    )
    plan.save_png(tmp_path / "pod.png")
    assert (tmp_path / "pod.png").stat().st_size > 10_000
