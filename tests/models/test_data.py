"""The byte corpus: split by file, deterministic batches, and batches placed on a mesh."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding

import meshplan
import meshplan.layouts
from meshplan.models.data import ByteCorpus, DataError, shard_batch


@pytest.fixture(scope="module")
def corpus() -> ByteCorpus:
    return ByteCorpus.from_stdlib(max_bytes=400_000)


@pytest.fixture(scope="module")
def mesh() -> Mesh:
    return Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))


def test_stdlib_corpus_is_python_bytes_split_by_file(corpus):
    assert corpus.train.dtype == np.uint8 and corpus.valid.dtype == np.uint8
    assert len(corpus.train) > 200_000 and len(corpus.valid) > 10_000
    assert corpus.train_files and corpus.valid_files
    assert set(corpus.train_files).isdisjoint(corpus.valid_files)
    assert all(name.endswith(".py") for name in corpus.train_files + corpus.valid_files)
    assert b"def " in corpus.train.tobytes() and b"import " in corpus.valid.tobytes()


def test_the_split_is_the_same_on_every_load(corpus):
    again = ByteCorpus.from_stdlib(max_bytes=400_000)
    assert again.train_files == corpus.train_files
    assert np.array_equal(again.valid, corpus.valid)


def test_a_file_stays_on_its_side_whatever_the_byte_budget(corpus):
    bigger = ByteCorpus.from_stdlib(max_bytes=1_000_000)
    assert set(corpus.train_files) <= set(bigger.train_files)
    assert set(corpus.valid_files) <= set(bigger.valid_files)


def test_batches_depend_only_on_split_step_and_seed(corpus):
    a = corpus.batch_at("train", 12, seed=3, batch=4, seq_len=32)
    assert a.shape == (4, 33) and a.dtype == np.int32
    assert np.array_equal(a, corpus.batch_at("train", 12, seed=3, batch=4, seq_len=32))
    for other in [
        corpus.batch_at("train", 13, seed=3, batch=4, seq_len=32),
        corpus.batch_at("train", 12, seed=4, batch=4, seq_len=32),
        corpus.batch_at("valid", 12, seed=3, batch=4, seq_len=32),
    ]:
        assert not np.array_equal(a, other)


def test_batch_rows_are_windows_of_their_split(corpus):
    text = corpus.valid.tobytes()
    for row in corpus.batch_at("valid", 0, seed=0, batch=3, seq_len=64):
        assert row.astype(np.uint8).tobytes() in text


def test_from_path_reads_text_files_of_a_folder_and_skips_binary(tmp_path):
    for i in range(30):
        (tmp_path / f"f{i}.txt").write_text(f"line {i}\n" * 20)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (tmp_path / ".hidden").write_text("secret\n" * 100)
    corpus = ByteCorpus.from_path(tmp_path)
    names = set(corpus.train_files) | set(corpus.valid_files)
    assert names == {f"f{i}.txt" for i in range(30)}
    assert b"\0" not in corpus.train.tobytes() + corpus.valid.tobytes()


def test_from_path_skips_fifos_and_other_entries_that_are_not_regular_files(tmp_path):
    # Opening a FIFO waits for a writer forever: it must never be read.
    (tmp_path / "a.txt").write_text("some text\n" * 50)
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "dangling.txt").symlink_to(tmp_path / "gone.txt")
    (tmp_path / "link.txt").symlink_to(tmp_path / "a.txt")  # a link to a file is read
    corpus = ByteCorpus.from_path(tmp_path)
    assert set(corpus.train_files) | set(corpus.valid_files) == {"a.txt", "link.txt"}


def test_a_folder_of_fifos_only_says_how_many_were_skipped(tmp_path):
    os.mkfifo(tmp_path / "one")
    os.mkfifo(tmp_path / "two")
    with pytest.raises(DataError, match=r"2 entries that are not regular files, such as FIFOs"):
        ByteCorpus.from_path(tmp_path)


def test_a_fifo_as_the_data_path_is_a_clear_error(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(DataError, match="neither a folder nor a regular file") as info:
        ByteCorpus.from_path(tmp_path / "pipe")
    assert str(tmp_path / "pipe") in str(info.value)


def test_from_path_splits_a_single_file_by_bytes(tmp_path):
    path = tmp_path / "one.py"
    path.write_text("x = 1\n" * 1000)
    corpus = ByteCorpus.from_path(path)
    assert len(corpus.valid) == pytest.approx(0.1 * 6000, abs=2)
    assert corpus.train.tobytes() + corpus.valid.tobytes() == path.read_bytes()


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p / "nowhere", "does not exist"),
        (lambda p: p, "No text found"),
        (lambda p: (p / "img.png").write_bytes(b"\x89PNG\0\0") and p, "No text found"),
    ],
    ids=["missing", "empty-folder", "only-binary"],
)
def test_a_data_path_without_text_is_a_clear_error(tmp_path, setup, message):
    path = setup(tmp_path) or tmp_path
    with pytest.raises(DataError, match=message) as info:
        ByteCorpus.from_path(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, meshplan.MeshplanError)


def test_a_split_shorter_than_one_window_is_a_clear_error(tmp_path):
    (tmp_path / "a.txt").write_text("tiny")
    corpus = ByteCorpus.from_path(tmp_path)
    with pytest.raises(DataError, match="fewer than one window"):
        corpus.batch_at("train", 0, seed=0, batch=2, seq_len=128)


@pytest.mark.parametrize("layout", ["data_parallel", "fsdp", "tensor_parallel", "fsdp_tp"])
def test_shard_batch_places_rows_where_the_layout_says(corpus, mesh, layout):
    rules = meshplan.layouts.get_layout(layout)
    tokens = corpus.batch_at("train", 0, seed=0, batch=16, seq_len=8)
    placed = shard_batch(tokens, mesh, rules)
    spec = meshplan.logical_to_mesh_axes(("batch", "length"), rules)
    assert placed.sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert np.array_equal(np.asarray(placed), tokens)


def test_shard_batch_works_on_an_explicit_mesh(corpus):
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    placed = shard_batch(np.zeros((8, 9), np.int32), mesh, meshplan.layouts.fsdp_tp)
    assert placed.sharding.spec == meshplan.logical_to_mesh_axes(
        ("batch", "length"), meshplan.layouts.fsdp_tp
    )


def test_a_batch_that_does_not_divide_over_the_mesh_is_a_clear_error(mesh):
    with pytest.raises(DataError, match=r"batch of 12 .*\(8 devices\)") as info:
        shard_batch(np.zeros((12, 9), np.int32), mesh, meshplan.layouts.data_parallel)
    assert "multiple of 8" in str(info.value)
    assert [(p.path, p.code) for p in info.value.problems] == [("batch", "indivisible")]


def test_rules_naming_an_axis_the_mesh_lacks_is_a_clear_error():
    mesh = Mesh(np.array(jax.devices()), ("devices",))
    with pytest.raises(meshplan.MeshError, match="mesh axis 'data', which the mesh"):
        shard_batch(np.zeros((8, 9), np.int32), mesh, meshplan.layouts.tensor_parallel)
