"""meshplan.restore and Checkpointer: any mesh, no target tree, bit-identical arrays."""

from __future__ import annotations

import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._checkpoint.folder import latest_step, read_metadata
from meshplan._checkpoint.restore import restore_into
from meshplan._checkpoint.tree import flatten_state
from meshplan.layouts import data_parallel, fsdp, fsdp_tp, tensor_parallel
from meshplan.models.transformer import Transformer, config_from_name
from meshplan.train.device_mesh import make_mesh
from meshplan.train.settings import TrainSettings, make_optimizer
from meshplan.train.state import abstract_train_state, state_shardings

CONFIG = config_from_name("tiny", num_layers=2, embed_dim=32, mlp_dim=64, num_heads=4, max_len=32)
SETTINGS = TrainSettings(seq_len=16, seed=3)
restore_module = importlib.import_module("meshplan._checkpoint.restore")


def _state(mesh, rules):
    """A TrainState of the tiny Transformer with non-trivial optimizer moments."""
    model = Transformer(CONFIG)
    tx = make_optimizer(SETTINGS)
    abstract = abstract_train_state(model, tx, SETTINGS)
    shardings = state_shardings(abstract, mesh, rules)

    def init(key):
        params = model.init(key, jnp.zeros((1, 16), jnp.int32))["params"]
        from flax.training import train_state

        state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
        grads = jax.tree.map(lambda p: jnp.sin(p) * 1e-2, state.params)
        return state.apply_gradients(grads=grads)

    with jax.set_mesh(mesh), meshplan.logical_axis_rules(rules):
        state = jax.jit(init, out_shardings=shardings)(jax.random.key(0))
    return state, abstract


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint saved from a 2x4 mesh with fsdp_tp, at step 7."""
    folder = tmp_path_factory.mktemp("ckpt")
    mesh = make_mesh((2, 4))
    state, abstract = _state(mesh, fsdp_tp)
    with meshplan.Checkpointer(folder) as ckpt:
        assert ckpt.save(7, state, rules=fsdp_tp, config=CONFIG.to_dict(), extra={"note": "hello"})
    raw = {k: np.asarray(v) for k, (v, _) in flatten_state(state).items()}
    return folder, raw, abstract


@pytest.mark.parametrize(
    ("shape", "rules"),
    [
        ((2, 4), fsdp_tp),
        ((4, 2), data_parallel),
        ((4, 2), fsdp_tp),
        ((8, 1), fsdp),
        ((2, 4), tensor_parallel),
        (None, None),  # one device, the saved rules
    ],
    ids=["2x4-fsdp_tp", "4x2-data_parallel", "4x2-fsdp_tp", "8x1-fsdp", "2x4-tp", "1-device"],
)
@pytest.mark.slow
def test_restore_onto_any_mesh_is_bit_identical(saved, shape, rules):
    folder, raw, _ = saved
    mesh = None if shape is None else make_mesh(shape)
    state, meta = meshplan.restore(folder, mesh, rules)
    restored = meshplan.Restored(state, meta).arrays()
    assert restored.keys() == raw.keys()
    for key, value in restored.items():
        assert value.dtype == raw[key].dtype, key
        np.testing.assert_array_equal(np.asarray(value), raw[key], err_msg=key)
        want_rules = rules if rules is not None else fsdp_tp
        names = meta.arrays[key].names
        want = P() if names is None else meshplan.logical_to_mesh_axes(names, want_rules)
        assert value.sharding.spec == want, key
        if mesh is None:
            assert len(value.sharding.device_set) == 1
        else:
            assert value.sharding.mesh == mesh


@pytest.mark.slow
def test_restore_reboxes_with_saved_logical_names(saved):
    folder, _, _ = saved
    state, meta = meshplan.restore(folder, make_mesh((4, 2)), data_parallel)
    kernel = state["params"]["layers"]["mlp"]["wi"]
    assert isinstance(kernel, meshplan.LogicallyPartitioned)
    assert kernel.names == ("layer", "embed", "mlp")
    assert kernel.value.shape == (2, 32, 64)
    # Adam's moments keep their parameter's names; counters are plain arrays.
    flat = meshplan.Restored(state, meta).arrays()
    mu_key = next(k for k in flat if k.endswith("mu/layers/mlp/wi"))
    assert meta.arrays[mu_key].names == ("layer", "embed", "mlp")
    assert isinstance(state["step"], jax.Array)
    assert int(state["step"]) == 1


def test_metadata_holds_everything_needed_without_model_code(saved):
    folder, raw, _ = saved
    meta = read_metadata(folder)
    assert meta.step == 7
    assert meta.config == CONFIG.to_dict()
    assert meta.rules == fsdp_tp
    assert meta.mesh_shape == {"data": 2, "model": 4}
    assert meta.axis_names == ("data", "model")
    assert meta.meshplan_version == meshplan.__version__
    assert meta.extra == {"note": "hello"}
    assert set(meta.arrays) == set(raw)
    info = meta.arrays["params/embed"]
    assert (info.shape, info.dtype, info.names) == ((256, 32), "float32", ("vocab", "embed"))
    # The JSON on disk is plain and readable.
    data = json.loads((folder / "7" / "meshplan" / "metadata").read_text())
    assert data["format"] == "meshplan-checkpoint"
    assert data["arrays"]["params/embed"]["names"] == ["vocab", "embed"]


def test_into_fills_an_abstract_train_state(saved):
    folder, raw, abstract = saved
    mesh = make_mesh((4, 2))
    restored = meshplan.restore(folder, mesh, data_parallel)
    state = restored.into(abstract)
    assert type(state) is type(abstract)
    for key, (value, box) in flatten_state(state).items():
        np.testing.assert_array_equal(np.asarray(value), raw[key], err_msg=key)
        abstract_box = flatten_state(abstract)[key][1]
        assert (box is None) == (abstract_box is None)
        if box is not None:
            assert box.names == abstract_box.names


def test_into_rejects_a_different_model(saved):
    folder, _, _ = saved
    other = Transformer(
        config_from_name("tiny", num_layers=3, embed_dim=32, mlp_dim=64, max_len=32)
    )
    abstract = abstract_train_state(other, make_optimizer(SETTINGS), SETTINGS)
    restored = meshplan.restore(folder)
    with pytest.raises(meshplan.CheckpointError) as e:
        restored.into(abstract)
    message = str(e.value)
    assert "params/layers/mlp/wi: checkpoint shape (2, 32, 64), this model (3, 32, 64)" in message
    assert "  * " in message
    assert message.splitlines()[-1].startswith("Use the model config the checkpoint was saved")
    assert {p.code for p in e.value.problems} == {"checkpoint-mismatch"}
    assert "params/layers/mlp/wi" in {p.path for p in e.value.problems}


def test_restore_into_reads_straight_into_the_given_shardings(saved):
    folder, raw, abstract = saved  # saved with fsdp_tp on 2x4
    mesh = make_mesh((4, 2))
    shardings = state_shardings(abstract, mesh, data_parallel)
    state = restore_into(folder, abstract, shardings, 7)
    assert type(state) is type(abstract)
    for (key, (value, _)), sharding in zip(
        flatten_state(state).items(), jax.tree.leaves(shardings), strict=True
    ):
        assert value.sharding == sharding, key  # where the caller's layout puts it
        np.testing.assert_array_equal(np.asarray(value), raw[key], err_msg=key)


def test_restore_into_refuses_a_different_model_before_reading(saved, monkeypatch):
    folder, _, _ = saved
    other = Transformer(
        config_from_name("tiny", num_layers=3, embed_dim=32, mlp_dim=64, max_len=32)
    )
    abstract = abstract_train_state(other, make_optimizer(SETTINGS), SETTINGS)
    shardings = state_shardings(abstract, make_mesh((2, 4)), fsdp_tp)
    monkeypatch.setattr(restore_module, "_read", None)  # reading it would fail otherwise
    with pytest.raises(meshplan.CheckpointError, match="does not fit this state") as e:
        restore_into(folder, abstract, shardings, 7)
    assert {p.code for p in e.value.problems} == {"checkpoint-mismatch"}
    assert "params/layers/mlp/wi" in {p.path for p in e.value.problems}


def test_restore_into_without_a_sharding_for_an_array_names_it_before_reading(tmp_path):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tree = {"w": jnp.ones((2, 4)), "b": jnp.ones(4)}
    with meshplan.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(1, tree)
    only_w = {"w": NamedSharding(make_mesh((2, 4)), P())}
    with pytest.raises(meshplan.CheckpointError, match="no sharding for 1 array") as e:
        restore_into(tmp_path / "ckpt", tree, only_w, 1)
    assert [(p.code, p.path) for p in e.value.problems] == [("ckpt-no-sharding", "b")]


def test_a_mismatch_is_a_record_with_a_code_and_the_array_path():
    state = {"w": jnp.ones((2, 4)), "b": jnp.ones(4)}
    restored = meshplan.Restored(state, meshplan.CheckpointMetadata.describe(0, state))
    with pytest.raises(meshplan.CheckpointError) as e:
        restored.into({"w": jax.ShapeDtypeStruct((2, 8), jnp.float32)})
    found = [(p.code, p.path, p.message) for p in e.value.problems]
    assert found == [
        ("checkpoint-mismatch", "w", "checkpoint shape (2, 4), this model (2, 8)"),
        ("checkpoint-mismatch", "b", "shape (4,) is in the checkpoint but not in this model"),
    ]
    assert "  * w: checkpoint shape (2, 4), this model (2, 8)" in str(e.value)


def test_mesh_that_cannot_split_an_array_is_a_clear_error(saved):
    folder, _, _ = saved
    mesh = make_mesh((2, 4))
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(folder, make_mesh((1, 8)), (("heads", "model"),))  # 4 heads over 8
    message = str(e.value)
    assert (
        "params/layers/attention/query: dim 2 ('heads') of size 4 does not divide by 8" in message
    )
    assert "(mesh axis 'model' of size 8)" in message
    problems = {(p.path, p.code) for p in e.value.problems}  # the validator's, structured
    assert ("params/layers/attention/query", "indivisible") in problems
    with pytest.raises(meshplan.CheckpointError, match=r"rules\[0\] on mesh axis 'tensor'") as e:
        meshplan.restore(folder, mesh, (("heads", "tensor"),))
    assert {p.code for p in e.value.problems} == {"unknown-axis"}


@pytest.mark.slow
def test_steps_rotation_and_incomplete_steps(tmp_path):
    tree = {"w": meshplan.LogicallyPartitioned(jnp.arange(8.0), ("embed",)), "n": jnp.int32(1)}
    with meshplan.Checkpointer(tmp_path, max_to_keep=2) as ckpt:
        for step in (1, 2, 3):
            assert ckpt.save(step, tree, rules=())
        ckpt.wait()
        assert ckpt.all_steps() == [2, 3]
        with pytest.warns(UserWarning, match="step 3 already exists"):
            assert not ckpt.save(3, tree)  # an existing step is not overwritten
    # A save killed midway leaves a tmp folder; it is never restored.
    (tmp_path / "4.orbax-checkpoint-tmp").mkdir()
    assert latest_step(tmp_path) == 3
    assert meshplan.restore(tmp_path).metadata.step == 3
    assert meshplan.restore(tmp_path, step=2).metadata.step == 2
    with pytest.raises(meshplan.CheckpointError, match=r"no complete checkpoint at step=4"):
        meshplan.restore(tmp_path, step=4)
    # Opening the folder again removes the leftover.
    meshplan.Checkpointer(tmp_path).close()
    assert not (tmp_path / "4.orbax-checkpoint-tmp").exists()


@pytest.mark.slow
def test_mesh_axis_boxes_and_plain_arrays_round_trip(tmp_path):
    mesh = make_mesh((2, 4))
    w = jax.device_put(
        jnp.arange(32.0).reshape(4, 8), jax.sharding.NamedSharding(mesh, P(None, "model"))
    )
    tree = {"w": meshplan.Partitioned(w, (None, "model")), "b": jnp.ones(3)}
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(0, tree)
    state, meta = meshplan.restore(tmp_path, make_mesh((4, 2)))
    assert isinstance(state["w"], meshplan.Partitioned)
    assert not isinstance(state["w"], meshplan.LogicallyPartitioned)
    assert state["w"].value.sharding.spec == P(None, "model")
    assert state["b"].sharding.spec == P()
    np.testing.assert_array_equal(state["w"].value, np.arange(32.0).reshape(4, 8))
    assert meta.rules == ()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: p / "missing", "it does not exist"),
        (lambda p: p, "it is empty"),
        (
            lambda p: (p / "notes.txt").write_text("hi") and p,
            "holds no step folders, only: notes.txt",
        ),
        (
            lambda p: (p / "3.orbax-checkpoint-tmp").mkdir() or p,
            "holds only incomplete steps ['3.orbax-checkpoint-tmp']",
        ),
    ],
    ids=["missing", "empty", "junk", "incomplete-only"],
)
def test_not_a_checkpoint_is_a_clear_error(tmp_path, make, expected):
    folder = make(tmp_path)
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(folder)
    message = str(e.value)
    assert expected in message
    # A library error gives an API-level fix, not command-line flags.
    assert "meshplan.Checkpointer" in message.splitlines()[-1]
    assert "--" not in message


@pytest.mark.parametrize("composite", [True, False], ids=["state-item", "default-item"])
def test_plain_orbax_checkpoint_is_not_a_meshplan_checkpoint(tmp_path, composite):
    import orbax.checkpoint as ocp

    args = ocp.args.StandardSave({"a": jnp.ones(2)})
    with ocp.CheckpointManager(tmp_path) as manager:
        manager.save(5, args=ocp.args.Composite(state=args) if composite else args)
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(tmp_path)
    message = str(e.value)
    assert f"'{tmp_path}' (step 5) is not a meshplan checkpoint" in message
    assert "has no 'meshplan' metadata item" in message
    assert "--" not in message


def test_damaged_metadata_is_a_clear_error(tmp_path):
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, {"w": jnp.ones(2)})
        ckpt.save(2, {"w": jnp.ones(2)})
    meta_file = tmp_path / "2" / "meshplan" / "metadata"
    data = json.loads(meta_file.read_text())
    del data["arrays"]
    del data["digest"]  # with it, the digest mismatch is found first (test_checkpoint_integrity)
    meta_file.write_text(json.dumps(data))
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(tmp_path)
    message = str(e.value)
    assert (
        f"'{tmp_path}' (step 2): its meshplan metadata is damaged (KeyError: 'arrays')" in message
    )
    assert message.splitlines()[-1] == (
        "Restore an earlier step (step=1; steps before it: [1]), or "
        "restore(path, fallback=True) for the newest intact one."
    )
    assert e.value.problems[0].code == "ckpt-damaged"


def _saved_step(folder, step=3):
    with meshplan.Checkpointer(folder, async_save=False) as ckpt:
        ckpt.save(step, {"w": meshplan.LogicallyPartitioned(jnp.arange(4.0), ("embed",))})


def test_steps_are_the_ones_orbax_finalized(tmp_path):
    """A step counts once Orbax's finalize logic says so, not by its folder's name."""
    import shutil

    _saved_step(tmp_path, 3)
    # A full copy of a step that was never finalized (a save killed before its rename
    # or commit marker), and a digit-named folder that is not an Orbax step name.
    shutil.copytree(tmp_path / "3", tmp_path / "8.orbax-checkpoint-tmp-1700000000")
    shutil.copytree(tmp_path / "3", tmp_path / "0042")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert latest_step(tmp_path) == 3
    assert read_metadata(tmp_path).step == 3
    assert meshplan.restore(tmp_path).metadata.step == 3
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(tmp_path, step=8)
    message = str(e.value)
    assert f"'{tmp_path}' has no complete checkpoint at step=8" in message
    assert "(its save stopped midway: '8.orbax-checkpoint-tmp-1700000000')" in message
    assert "it has steps [3]" in message
    assert message.splitlines()[-1] == "Pass one of those steps, or step=None for the latest."
    with pytest.raises(meshplan.CheckpointError, match=r"no complete checkpoint at step=42;"):
        read_metadata(tmp_path, step=42)
    # Reading writes nothing: no Orbax metadata, no missing folder created.
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert latest_step(tmp_path / "missing") is None
    assert not (tmp_path / "missing").exists()
    # A new Checkpointer removes the unfinished step (Orbax names it), not the others.
    meshplan.Checkpointer(tmp_path).close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0042", "3"]


def test_latest_step_and_restore_go_through_the_checkpoint_manager(tmp_path, monkeypatch):
    import orbax.checkpoint as ocp

    _saved_step(tmp_path, 3)
    calls = []

    class Recording(ocp.CheckpointManager):
        def all_steps(self, *args, **kwargs):
            calls.append("all_steps")
            return super().all_steps(*args, **kwargs)

        def latest_step(self):
            calls.append("latest_step")
            return super().latest_step()

        def restore(self, step, *args, **kwargs):
            items = sorted(kwargs["args"].keys())
            calls.append(f"restore({step}, {items})")
            return super().restore(step, *args, **kwargs)

    monkeypatch.setattr(ocp, "CheckpointManager", Recording)
    assert latest_step(tmp_path) == 3
    assert calls == ["latest_step"]
    calls.clear()
    state, _ = meshplan.restore(str(tmp_path))
    assert calls == ["all_steps", "restore(3, ['meshplan'])", "restore(3, ['state'])"]
    np.testing.assert_array_equal(state["w"].value, np.arange(4.0))


def test_paths_orbax_accepts(tmp_path, monkeypatch):
    from etils import epath

    _saved_step(tmp_path / "run", 2)
    assert meshplan.restore(epath.Path(tmp_path / "run")).metadata.step == 2
    monkeypatch.chdir(tmp_path)
    assert meshplan.restore("run").metadata.step == 2  # relative paths are made absolute
    assert latest_step("run") == 2
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(meshplan.CheckpointError) as e:
        read_metadata("notes.txt")
    assert str(e.value).startswith(f"'{tmp_path}/notes.txt' is a file, not a checkpoint folder.")


def test_restore_without_a_mesh_uses_one_device_with_auto_axes(tmp_path):
    from jax.sharding import AxisType

    _saved_step(tmp_path, 1)
    state, _ = meshplan.restore(tmp_path)
    mesh = state["w"].value.sharding.mesh
    assert dict(mesh.shape) == {"data": 1, "model": 1}  # no mesh saved: the default names
    assert mesh.axis_types == (AxisType.Auto, AxisType.Auto)
    assert mesh.devices.flat[0] == jax.devices()[0]


def test_checkpoint_errors_carry_a_code_for_callers_to_act_on(tmp_path, saved):
    folder, _, _ = saved
    cases = [
        (lambda: meshplan.restore(tmp_path / "nowhere"), "ckpt-missing"),
        (lambda: meshplan.restore(folder, step=12345), "ckpt-no-such-step"),
    ]
    (tmp_path / "empty").mkdir()
    cases.append((lambda: meshplan.restore(tmp_path / "empty"), "ckpt-no-steps"))
    for call, code in cases:
        with pytest.raises(meshplan.CheckpointError) as info:
            call()
        (problem,) = info.value.problems
        assert problem.code == code
        assert problem.fix and "--" not in problem.fix  # API-level advice, no CLI flags
