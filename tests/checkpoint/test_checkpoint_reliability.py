"""Checkpoints, round 2: saves from several threads, bytes changed in place, bad step numbers,
steps without their metadata and empty step folders.

Real Orbax checkpoints in real folders; the damage is done to the files on disk.
"""

from __future__ import annotations

import os
import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from meshplan._checkpoint.checksum import array_checksums
from meshplan._checkpoint.folder import complete_steps, read_metadata
from meshplan._checkpoint.integrity import check_step, intact_step, step_directory

# -- 1. several threads, one Checkpointer ----------------------------------------


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
@pytest.mark.slow
def test_saves_from_eight_threads_all_reach_the_disk(tmp_path, async_save):
    ckpt = meshplan.Checkpointer(tmp_path, max_to_keep=100, async_save=async_save)
    results: dict[int, object] = {}
    start = threading.Barrier(8)

    def save(step: int) -> None:
        start.wait()  # all eight call save at once
        try:
            results[step] = ckpt.save(step, {"w": jnp.full((4096,), float(step))})
        except Exception as e:  # recorded: the assertion below shows it
            results[step] = e

    threads = [threading.Thread(target=save, args=(step,)) for step in range(1, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ckpt.close()
    assert results == {step: True for step in range(1, 9)}
    assert complete_steps(tmp_path) == list(range(1, 9))
    for step in range(1, 9):
        restored = meshplan.restore(tmp_path, step=step)
        np.testing.assert_array_equal(restored.state["w"], np.full((4096,), float(step)))


def test_a_failed_save_among_threads_names_its_own_step(tmp_path):
    ckpt = meshplan.Checkpointer(tmp_path, max_to_keep=100, async_save=False)
    errors: dict[int, BaseException] = {}

    def save(step: int) -> None:
        state = {"w": jnp.full((8,), jnp.nan if step == 5 else float(step))}
        try:
            ckpt.save(step, state)
        except meshplan.CheckpointError as e:
            errors[step] = e

    threads = [threading.Thread(target=save, args=(step,)) for step in range(1, 9)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ckpt.close()
    assert list(errors) == [5]
    assert "Refusing to save step 5" in str(errors[5])
    assert complete_steps(tmp_path) == [1, 2, 3, 4, 6, 7, 8]


# -- 2. bytes changed in place ---------------------------------------------------


def _overwrite_4k_in_biggest_array_file(folder, step: int) -> None:
    data = step_directory(folder, step) / "state"
    biggest = max(data.glob("ocdbt.process_*/d/*"), key=lambda p: os.path.getsize(p))
    size = os.path.getsize(biggest)
    with open(biggest, "r+b") as f:
        f.seek(size // 2)
        f.write(np.random.default_rng(0).bytes(4096))
    assert os.path.getsize(biggest) == size  # same length


@pytest.mark.slow
def test_bytes_changed_in_place_are_named_and_skipped(tmp_path):
    # Random bits do not compress: the stored chunk is the raw bytes, so the damaged
    # chunk decodes to other numbers without any error from Orbax or TensorStore.
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        for step in (10, 20):
            bits = jax.random.bits(jax.random.key(step), (200_000,))
            ckpt.save(step, {"params": {"w": bits, "b": jnp.arange(8.0)}})
    _overwrite_4k_in_biggest_array_file(tmp_path, 20)
    where = f"'{tmp_path}' (step 20)"
    # The cheap check reads no array, so it cannot see it (documented); restore does.
    assert check_step(tmp_path, 20) is None
    with pytest.raises(meshplan.CheckpointError, match="checksum mismatch") as e:
        meshplan.restore(tmp_path)
    (problem,) = e.value.problems
    assert problem.code == "ckpt-damaged"
    assert problem.path == where
    assert problem.message == (
        f"{where}: the bytes of 1 array changed since it was saved (checksum mismatch): 'params/w'"
    )
    assert problem.fix.startswith("Restore an earlier step (step=10;")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = meshplan.restore(tmp_path, fallback=True)
    assert restored.metadata.step == 10
    assert [str(w.message) for w in caught] == [
        f"Skipped {where}: the bytes of 1 array changed since it was saved (checksum "
        f"mismatch): 'params/w'"
    ]
    expected = jax.random.bits(jax.random.key(10), (200_000,))
    np.testing.assert_array_equal(restored.state["params"]["w"], expected)


@pytest.mark.slow
def test_checksums_do_not_depend_on_the_sharding(tmp_path):
    x = jax.random.normal(jax.random.key(0), (64, 32))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sharded = jax.device_put(x, jax.NamedSharding(mesh, jax.P("data", "model")))
    one = array_checksums({"x": x})["x"]
    assert array_checksums({"x": sharded})["x"] == one
    assert array_checksums({"x": np.asarray(x)})["x"] == one
    for dtype in (jnp.bfloat16, jnp.int8, jnp.bool_, jnp.uint16):
        y = x.astype(dtype)
        assert array_checksums({"y": y}) == array_checksums({"y": np.asarray(y)})
    # One changed element, anywhere, changes it.
    for index in ((0, 0), (31, 17), (63, 31)):
        assert array_checksums({"x": x.at[index].add(1e-3)})["x"] != one
    # Saved with a checkpoint, restored onto another mesh: verified and equal.
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, {"x": meshplan.LogicallyPartitioned(sharded, ("batch", "embed"))})
    assert read_metadata(tmp_path).arrays["x"].checksum == one
    other = jax.make_mesh((4, 2), ("data", "model"))
    restored = meshplan.restore(tmp_path, other, (("batch", "model"), ("embed", "data")))
    np.testing.assert_array_equal(restored.state["x"].value, x)


# -- 6. step numbers and steps saved twice -----------------------------------------


@pytest.mark.parametrize("step", [-1, -20, "x", 2.5, None])
def test_a_step_that_cannot_be_restored_is_refused(tmp_path, step):
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(meshplan.ArgumentError, match="whole number of 0 or more") as e:
            ckpt.save(step, {"w": jnp.ones(2)})
        assert e.value.problems[0].code == "ckpt-bad-step"
    assert complete_steps(tmp_path) == []


def test_saving_a_step_again_warns_and_keeps_the_first(tmp_path):
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        assert ckpt.save(3, {"w": jnp.ones(2)})
        with pytest.warns(UserWarning, match=r"step 3 already exists .*\(ckpt.delete\(3\)\)"):
            assert ckpt.save(3, {"w": jnp.zeros(2)}) is False
    np.testing.assert_array_equal(meshplan.restore(tmp_path).state["w"], np.ones(2))


@pytest.mark.parametrize("step", ["²", "٣", "1e3", "-2"])
def test_restore_step_text_that_is_no_step_number(tmp_path, step):
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, {"w": jnp.ones(2)})
    with pytest.raises(meshplan.ArgumentError, match="step must be a whole number") as e:
        meshplan.restore(tmp_path, step=step)
    assert e.value.problems[0].code == "ckpt-bad-step"


# -- 7. a step without its metadata, an empty step folder -------------------------


def _three_steps(folder):
    with meshplan.Checkpointer(folder, async_save=False) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, {"w": jnp.full((100,), float(step))})


@pytest.mark.slow
def test_a_step_without_its_metadata_item_is_skipped_not_the_folder(tmp_path):
    _three_steps(tmp_path)
    (step_directory(tmp_path, 3) / "meshplan").rmtree()
    found = intact_step(tmp_path)
    assert found.step == 2
    (skipped,) = found.skipped
    assert skipped.code == "ckpt-damaged"
    assert skipped.path == f"'{tmp_path}' (step 3)"
    assert "has no 'meshplan' metadata item" in skipped.message
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert meshplan.restore(tmp_path, fallback=True).metadata.step == 2
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(tmp_path)
    assert e.value.problems[0].code == "ckpt-damaged"
    assert e.value.problems[0].fix.startswith("Restore an earlier step (step=2;")


def test_an_empty_step_folder_is_skipped_not_the_folder(tmp_path):
    _three_steps(tmp_path)
    os.mkdir(tmp_path / "4")
    found = intact_step(tmp_path)
    assert found.step == 3
    assert [p.path for p in found.skipped] == [f"'{tmp_path}' (step 4)"]
    assert found.skipped_steps == [4]
    assert found.skipped[0].code == "ckpt-damaged"
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(tmp_path)
    assert e.value.problems[0].code == "ckpt-damaged"
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert meshplan.restore(tmp_path, fallback=True).metadata.step == 3
    # A Checkpointer opened on it still saves (and keeps the empty folder out of the way).
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        assert ckpt.save(5, {"w": jnp.ones(100)})
    assert meshplan.restore(tmp_path, step=5).metadata.step == 5
