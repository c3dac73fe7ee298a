"""Byte-level text data that every machine has: the Python standard library's own source.

The corpus is read as bytes (a vocabulary of 256) and split into train and
validation *by file*, deterministically: a file goes to validation when the
SHA-1 of its relative path falls in the validation fraction, so the same
files land on the same side on every run and every machine with the same
Python. Batches are windows at offsets drawn from ``(seed, step)`` alone, so
a run resumed at step ``k`` sees exactly the batches it would have seen, and
:func:`shard_batch` places them on a mesh with
``jax.make_array_from_process_local_data`` (each process passes its own rows).

Example:
    >>> from meshplan.models.data import ByteCorpus
    >>> corpus = ByteCorpus.from_stdlib(max_bytes=200_000)
    >>> batch = corpus.batch_at("train", step=0, seed=0, batch=4, seq_len=32)
    >>> batch.shape, batch.dtype.name
    ((4, 33), 'int32')
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

import meshplan
from meshplan._errors import error_for
from meshplan._spmd.rules import LogicalRules

__all__ = ["BATCH_NAMES", "ByteCorpus", "DataError", "shard_batch"]

BATCH_NAMES = ("batch", None)
"""The logical names of a batch of token sequences, ``int32[batch, length]``.

The positions stay whole: a window holds ``seq_len + 1`` tokens (the last one
only predicted), which a split of ``length`` would rarely divide, and the
model splits its activations along ``length`` itself when the rules say so
(context parallelism, :mod:`meshplan.models.context`). The tokens are a
negligible part of the memory."""

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "node_modules"}
_SPLITS = ("train", "valid")


class DataError(meshplan.MeshplanError, ValueError):
    """A data path with no text, a split too short for the sequence length, or a
    batch that cannot be split over the mesh."""


def _hash_fraction(relpath: str) -> float:
    """A number in [0, 1) fixed by the file's relative path (POSIX separators)."""
    digest = hashlib.sha1(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _is_text(data: bytes) -> bool:
    """No NUL byte and valid UTF-8 in the first 8 KiB (cut at a character boundary)."""
    head = data[:8192]
    if b"\0" in head:
        return False
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start >= len(head) - 3  # a multi-byte character cut at the end
    return True


def _walk(root: Path, suffixes: tuple[str, ...] | None) -> tuple[list[Path], int]:
    """The regular files under ``root`` (symbolic links to them included), and how many
    other entries (FIFOs, sockets, devices, broken links) were skipped: opening a FIFO
    would wait for a writer forever."""
    files = []
    skipped = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            if suffixes is None or name.endswith(suffixes):
                path = Path(dirpath) / name
                if path.is_file():
                    files.append(path)
                else:
                    skipped += 1
    return files, skipped


@dataclasses.dataclass(frozen=True)
class ByteCorpus:
    """Train and validation bytes of a text corpus.

    Attributes:
        train: The training bytes, ``uint8[n_train]`` (files joined by newlines).
        valid: The validation bytes, ``uint8[n_valid]``.
        source: Where the bytes came from (a path).
        train_files: Relative paths of the training files.
        valid_files: Relative paths of the validation files.
    """

    train: np.ndarray
    valid: np.ndarray
    source: str
    train_files: tuple[str, ...] = ()
    valid_files: tuple[str, ...] = ()

    # -- construction -------------------------------------------------------

    @classmethod
    def from_stdlib(
        cls, max_bytes: int | None = 8_000_000, valid_fraction: float = 0.1
    ) -> ByteCorpus:
        """The ``.py`` files of the running Python's standard library.

        Files are taken in the order of the hash of their path (a fixed,
        well-mixed sample) until ``max_bytes`` are read; ``site-packages`` is
        left out.

        Example:
            >>> from meshplan.models.data import ByteCorpus
            >>> corpus = ByteCorpus.from_stdlib(max_bytes=100_000)
            >>> set(corpus.train_files).isdisjoint(corpus.valid_files)
            True

        Args:
            max_bytes: Stop reading after about this many bytes (``None``: all).
            valid_fraction: Share of files (by hash of path) for validation.
        """
        root = Path(sysconfig.get_paths()["stdlib"])
        files, skipped = _walk(root, (".py",))
        return cls._from_files(root, files, max_bytes, valid_fraction, skipped)

    @classmethod
    def from_path(
        cls, path: str | os.PathLike[str], max_bytes: int | None = None, valid_fraction: float = 0.1
    ) -> ByteCorpus:
        """Every text file under a folder, or one text file.

        Binary files (a NUL byte or invalid UTF-8 near the start), hidden
        files, and entries that are not regular files (FIFOs, sockets, devices,
        broken links: reading a FIFO would wait forever) are skipped. A single file, or a folder whose files all fall on
        one side of the split, is split by bytes instead: the last
        ``valid_fraction`` of the bytes is validation.

        Example:
            >>> import os, tempfile
            >>> from meshplan.models.data import ByteCorpus
            >>> folder = tempfile.mkdtemp()
            >>> with open(os.path.join(folder, "a.txt"), "w") as f:
            ...     _ = f.write("hello world\\n" * 10)
            >>> os.mkfifo(os.path.join(folder, "pipe.txt"))  # skipped, never opened
            >>> ByteCorpus.from_path(folder).train_files
            ('a.txt',)
            >>> import shutil; shutil.rmtree(folder)

        Raises:
            DataError: the path does not exist, is neither a folder nor a regular
                file, or holds no text.
        """
        root = Path(path)
        if not root.exists():
            raise error_for(
                DataError,
                "data-missing",
                os.fspath(path),
                f"Data path {os.fspath(path)!r} does not exist",
                "Give a folder of text files or a text file (or ByteCorpus.from_stdlib() for the "
                "Python standard library).",
            )
        if not root.is_file() and not root.is_dir():
            raise DataError(
                f"Data path {os.fspath(path)!r} is neither a folder nor a regular file (a FIFO, "
                f"a socket or a device: reading it could wait forever).\n"
                f"Give a folder of text files or a text file."
            )
        files, skipped = ([root], 0) if root.is_file() else _walk(root, None)
        return cls._from_files(root, files, max_bytes, valid_fraction, skipped)

    @classmethod
    def _from_files(
        cls,
        root: Path,
        files: Iterable[Path],
        max_bytes: int | None,
        valid_fraction: float,
        skipped: int = 0,
    ) -> ByteCorpus:
        if not 0.0 < valid_fraction < 1.0:
            raise ValueError(f"valid_fraction must be in (0, 1), got {valid_fraction}.")
        base = root.parent if root.is_file() else root
        # The split is fixed by one hash of the path, the reading order by another, so
        # that a byte budget takes a well-mixed sample of files on both sides.
        entries = sorted(
            (_hash_fraction("order:" + rel), _hash_fraction(rel), rel, p)
            for p in files
            for rel in [p.relative_to(base).as_posix()]
        )
        budget = {
            "train": None if max_bytes is None else max_bytes * (1.0 - valid_fraction),
            "valid": None if max_bytes is None else max_bytes * valid_fraction,
        }
        chunks: dict[str, list[bytes]] = {"train": [], "valid": []}
        names: dict[str, list[str]] = {"train": [], "valid": []}
        read = {"train": 0, "valid": 0}

        def full(side: str) -> bool:
            limit = budget[side]
            return limit is not None and read[side] >= limit

        for _, h, rel, p in entries:
            split = "valid" if h < valid_fraction else "train"
            if full(split):
                if all(full(s) for s in _SPLITS):
                    break
                continue
            try:
                data = p.read_bytes()
            except OSError:
                continue
            if not data or not _is_text(data):
                continue
            chunks[split].append(data)
            names[split].append(rel)
            read[split] += len(data) + 1
        if not chunks["train"] and not chunks["valid"]:
            py = " ending in .py" if root == Path(sysconfig.get_paths()["stdlib"]) else ""
            others = (
                f" ({skipped} {'entry' if skipped == 1 else 'entries'} that are not regular "
                f"files, such as FIFOs, skipped)"
                if skipped
                else ""
            )
            raise DataError(
                f"No text found under {os.fspath(root)!r}: no readable, non-empty text "
                f"file{py}{others}.\n"
                f"Give a folder containing text files (.py, .txt, .md, ...) or a text file."
            )
        if not chunks["train"] or not chunks["valid"]:  # one file, or all on one side
            joined = np.frombuffer(b"\n".join(chunks["train"] + chunks["valid"]), np.uint8)
            cut = int(len(joined) * (1.0 - valid_fraction))
            all_names = tuple(names["train"] + names["valid"])
            return cls(joined[:cut].copy(), joined[cut:].copy(), os.fspath(root), all_names, ())
        return cls(
            np.frombuffer(b"\n".join(chunks["train"]), np.uint8).copy(),
            np.frombuffer(b"\n".join(chunks["valid"]), np.uint8).copy(),
            os.fspath(root),
            tuple(names["train"]),
            tuple(names["valid"]),
        )

    # -- batches ------------------------------------------------------------

    def split(self, name: str) -> np.ndarray:
        """The bytes of ``'train'`` or ``'valid'``."""
        if name not in _SPLITS:
            raise ValueError(f"split must be 'train' or 'valid', got {name!r}.")
        return self.train if name == "train" else self.valid

    def check_window(self, split: str, seq_len: int) -> np.ndarray:
        """The bytes of ``split``; raises unless they hold one window of ``seq_len + 1``.

        Example:
            >>> import numpy as np
            >>> from meshplan.models.data import ByteCorpus, DataError
            >>> corpus = ByteCorpus(np.zeros(100, np.uint8), np.zeros(20, np.uint8), "x")
            >>> try:
            ...     corpus.check_window("valid", 32)
            ... except DataError as e:
            ...     print(str(e).splitlines()[0])
            The valid split of 'x' has 20 bytes, fewer than one window of seq_len + 1 = 33.

        Raises:
            DataError: the split is shorter than ``seq_len + 1`` bytes.
        """
        data = self.split(split)
        window = seq_len + 1
        if len(data) < window:
            raise error_for(
                DataError,
                "data-too-short",
                split,
                f"The {split} split of {self.source!r} has {len(data)} bytes, fewer than one "
                f"window of seq_len + 1 = {window}",
                "Use a shorter sequence length (seq_len) or more text.",
            )
        return data

    def batch_at(self, split: str, step: int, seed: int, batch: int, seq_len: int) -> np.ndarray:
        """The batch of ``step``: ``int32[batch, seq_len + 1]`` windows of the split.

        The offsets depend only on ``(seed, split, step)``, so any process, and a
        run resumed at ``step``, computes the same batch.

        Example:
            >>> import numpy as np
            >>> from meshplan.models.data import ByteCorpus
            >>> corpus = ByteCorpus.from_stdlib(max_bytes=100_000)
            >>> a = corpus.batch_at("train", 7, seed=1, batch=2, seq_len=16)
            >>> bool(np.array_equal(a, corpus.batch_at("train", 7, seed=1, batch=2, seq_len=16)))
            True

        Raises:
            DataError: the split is shorter than ``seq_len + 1`` bytes.
        """
        data = self.check_window(split, seq_len)
        window = seq_len + 1
        rng = np.random.default_rng([seed, _SPLITS.index(split), step])
        starts = rng.integers(0, len(data) - window + 1, size=batch)
        windows: np.ndarray = data[starts[:, None] + np.arange(window)].astype(np.int32)
        return windows

    def __repr__(self) -> str:
        return (
            f"ByteCorpus(source={self.source!r}, train={len(self.train):,} bytes in "
            f"{len(self.train_files)} files, valid={len(self.valid):,} bytes in "
            f"{len(self.valid_files)} files)"
        )


def shard_batch(tokens: np.ndarray, mesh: jax.sharding.Mesh, rules: LogicalRules) -> jax.Array:
    """Places a global batch ``[batch, length]`` on ``mesh`` as :data:`BATCH_NAMES`.

    Every process passes the same global batch (:meth:`ByteCorpus.batch_at` is
    deterministic); each keeps the rows and columns its devices hold and hands
    them to ``jax.make_array_from_process_local_data`` (one process puts the
    whole batch with ``jax.device_put``). The batch is checked against the mesh
    and rules once per shape (every step's batch is alike).

    Example:
        >>> import jax, numpy as np
        >>> from meshplan.models.data import shard_batch
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> x = shard_batch(np.zeros((8, 5), np.int32), mesh, (("batch", "data"),))
        >>> x.sharding.spec
        P('data', None)

    Raises:
        DataError: the batch size (or length) does not divide by the number of
            devices it is split over.
    """
    sharding = _batch_sharding(tokens.shape, mesh, _hashable(rules))
    if sharding.is_fully_addressable:  # one process: the batched host-to-devices copy
        put: jax.Array = jax.device_put(tokens, sharding)
        return put
    index_map = sharding.devices_indices_map(tokens.shape)
    indices = [index_map[device] for device in sharding.addressable_devices]
    local = []
    for dim in range(tokens.ndim):
        starts = [idx[dim].start or 0 for idx in indices]
        stops = [tokens.shape[dim] if idx[dim].stop is None else idx[dim].stop for idx in indices]
        local.append(slice(min(starts), max(stops)))
    placed: jax.Array = jax.make_array_from_process_local_data(
        sharding, tokens[tuple(local)], tokens.shape
    )
    return placed


def _hashable(rules: LogicalRules) -> tuple[tuple[str, object], ...]:
    return tuple((name, tuple(a) if isinstance(a, list) else a) for name, a in rules)


@functools.lru_cache(maxsize=64)
def _batch_sharding(
    shape: tuple[int, ...], mesh: jax.sharding.Mesh, rules: LogicalRules
) -> NamedSharding:
    """The sharding of a batch of ``shape`` (checked once per shape: every step's batch is alike)."""
    errors = [
        p
        for p in meshplan.validate("batch", shape, BATCH_NAMES, mesh, rules)
        if p.severity == "error"
    ]
    if errors:
        error = meshplan.MeshError if errors[0].code == "unknown-axis" else DataError
        lines = "\n".join(f"  * {p.message}" for p in errors)
        fixes = " ".join(dict.fromkeys(p.fix for p in errors))
        raise error(
            f"A batch of {shape[0]} windows of {shape[1]} tokens cannot be split "
            f"over the mesh {dict(mesh.shape)} ({mesh.size} devices) with these rules:\n{lines}\n"
            f"{fixes}",
            errors,
        )
    return NamedSharding(mesh, meshplan.logical_to_mesh_axes(BATCH_NAMES, rules))
