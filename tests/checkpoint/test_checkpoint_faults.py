"""Checkpoints under faults: the best step is kept, NaN is never saved, failing I/O ends
promptly, damaged steps are named and skipped, and one writer holds a folder.

Real files and real processes: the I/O faults run a child Python that saves into a
tiny tmpfs (a full disk) or a read-only mount when ``mount`` is permitted (tests run
as root, where ``chmod`` denies nothing), else with the failure injected into the
filesystem calls Orbax makes; the lock tests use two processes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshplan
from child_env import fresh_env
from meshplan._checkpoint.folder import complete_steps, read_metadata
from meshplan._checkpoint.integrity import check_step, intact_step, step_directory
from meshplan._checkpoint.lock import LOCK_NAME, read_lock
from meshplan.train.device_mesh import make_mesh

SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"
)


def _run(code: str, *args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    """Runs ``code`` in a fresh Python on one CPU device; returns the result and its wall time."""
    env = fresh_env(PYTHONPATH=SRC, JAX_PLATFORMS="cpu")
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    return result, time.monotonic() - start


# -- 1. keep policy -------------------------------------------------------------


@pytest.mark.slow
def test_best_step_is_never_deleted_and_survives_reopening(tmp_path):
    tree = {"w": jnp.ones(4)}
    with meshplan.Checkpointer(tmp_path, max_to_keep=2, async_save=False) as ckpt:
        for step, loss in ((10, 3.0), (20, 1.5), (30, 2.0), (40, 2.5), (50, 2.7)):
            assert ckpt.save(step, tree, metrics={"valid_loss": loss})
        assert ckpt.all_steps() == [20, 40, 50]  # the best, then the latest two
        assert ckpt.best() == (20, 1.5)
        assert ckpt.best_step() == 20
    # A resumed run that diverges: the best step of the first run stays.
    with meshplan.Checkpointer(tmp_path, max_to_keep=2, async_save=False) as ckpt:
        assert ckpt.best() == (20, 1.5)  # read back from Orbax's metrics item
        for step in (60, 70, 80):
            assert ckpt.save(step, tree, metrics={"valid_loss": 9.0})
        ckpt.save(90, tree)  # no metrics: kept by recency only
        assert ckpt.all_steps() == [20, 80, 90]
        assert ckpt.best() == (20, 1.5)
    assert complete_steps(tmp_path) == [20, 80, 90]
    assert meshplan.restore(tmp_path, step=20).metadata.step == 20


def test_a_better_step_replaces_the_kept_best(tmp_path):
    with meshplan.Checkpointer(tmp_path, max_to_keep=1, async_save=False) as ckpt:
        for step, loss in ((1, 5.0), (2, 4.0), (3, 6.0), (4, 1.0), (5, 7.0)):
            ckpt.save(step, {"w": jnp.ones(2)}, metrics={"valid_loss": loss})
        assert ckpt.all_steps() == [4, 5]
        assert ckpt.best() == (4, 1.0)


def test_keep_best_off_and_max_mode(tmp_path):
    with meshplan.Checkpointer(
        tmp_path / "a", max_to_keep=1, keep_best=None, async_save=False
    ) as ckpt:
        for step, loss in ((1, 0.1), (2, 5.0)):
            ckpt.save(step, {"w": jnp.ones(2)}, metrics={"valid_loss": loss})
        assert ckpt.all_steps() == [2]
        assert ckpt.best() is None
    with meshplan.Checkpointer(
        tmp_path / "b", max_to_keep=1, keep_best="accuracy", best_mode="max", async_save=False
    ) as ckpt:
        for step, acc in ((1, 0.9), (2, 0.5), (3, 0.6)):
            ckpt.save(step, {"w": jnp.ones(2)}, metrics={"accuracy": acc})
        assert ckpt.all_steps() == [1, 3]
        assert ckpt.best() == (1, 0.9)
    with pytest.raises(meshplan.ArgumentError) as e:
        meshplan.Checkpointer(tmp_path / "c", max_to_keep=0)
    assert e.value.problems[0].code == "ckpt-bad-keep"


# -- 2. never a non-finite state ------------------------------------------------


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_state_is_never_saved(tmp_path, bad):
    mesh = make_mesh((2, 4))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", "model"))
    host = np.ones((8, 8), np.float32)
    host[5, 7] = bad
    state = {
        "params": {
            "good": jax.device_put(np.ones((8, 8), np.float32), sharding),
            "w": meshplan.LogicallyPartitioned(jax.device_put(host, sharding), ("embed", "mlp")),
            "half": jnp.array([1.0, bad], jnp.bfloat16),
        },
        "step": jnp.int32(3),
    }
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, {"params": {"w": jnp.ones(2)}})
        with pytest.raises(meshplan.CheckpointError) as e:
            ckpt.save(2, state)
        assert ckpt.all_steps() == [1]
    message = str(e.value)
    assert "Refusing to save step 2: NaN or infinite values in 2 arrays: params/half, params/w" in (
        message
    )
    assert "meshplan.restore(path, step=1)" in message
    (problem,) = e.value.problems
    assert (problem.code, problem.path) == ("ckpt-not-finite", "params/half")
    assert "--" not in problem.fix
    assert complete_steps(tmp_path) == [1]


def test_non_finite_metrics_are_refused_and_the_check_can_be_skipped(tmp_path):
    with meshplan.Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(meshplan.CheckpointError) as e:
            ckpt.save(1, {"w": jnp.ones(2)}, metrics={"valid_loss": float("nan")})
        assert e.value.problems[0].code == "ckpt-not-finite"
        assert e.value.problems[0].path == "metrics/valid_loss"
        assert ckpt.save(2, {"w": jnp.array([jnp.nan])}, check_finite=False)
        assert ckpt.all_steps() == [2]


# -- 3. failing I/O ends promptly ----------------------------------------------

_SAVER = """
import errno, json, os, subprocess, sys, threading, time
import jax, jax.numpy as jnp
import meshplan

folder, fault, mount_point = sys.argv[1], sys.argv[2], sys.argv[3]
ckpt = meshplan.Checkpointer(folder, max_to_keep=3)
ckpt.save(1, {"w": jnp.arange(16.0)})
ckpt.wait()
big = {"w": jax.random.normal(jax.random.key(0), (400_000,))}  # ~1.6 MB, no compression
if fault == "readonly-mount":
    subprocess.run(["mount", "-o", "remount,ro", mount_point], check=True)
elif fault == "vanished":
    import shutil
    shutil.rmtree(folder)
elif fault == "inject-background":
    # A full disk met by the JSON items, which Orbax writes in its background threads.
    from etils import epath
    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
    type(epath.Path(folder)).write_text = full
elif fault.startswith("inject-"):
    # What a full disk or a read-only folder does to the calls Orbax makes.
    code = errno.ENOSPC if fault == "inject-enospc" else errno.EACCES
    from etils import epath
    cls = type(epath.Path(folder))
    def failing(self, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(self))
    cls.mkdir = cls.write_text = cls.write_bytes = failing
start = time.monotonic()
try:
    ckpt.save(2, big)
    ckpt.wait()
    ckpt.close()
    print("NO ERROR")
except meshplan.CheckpointError as e:
    ckpt.close()  # already reported: no second error
    print(json.dumps({"code": e.problems[0].code, "message": str(e),
                      "seconds": time.monotonic() - start,
                      "threads": [t.name for t in threading.enumerate()]}))
    sys.exit(3)
"""


@pytest.mark.parametrize("fault", ["disk-full", "read-only", "vanished", "full-in-background"])
@pytest.mark.slow
def test_failed_save_ends_the_process_promptly_and_keeps_the_last_step(tmp_path, small_disk, fault):
    if fault in ("vanished", "full-in-background"):
        folder, mount = tmp_path / "run", ""
        mode = "vanished" if fault == "vanished" else "inject-background"
    elif small_disk is not None:
        folder, mount = small_disk / "run", str(small_disk)
        mode = "tiny-tmpfs" if fault == "disk-full" else "readonly-mount"
    else:
        folder, mount = tmp_path / "run", ""
        mode = "inject-enospc" if fault == "disk-full" else "inject-eacces"
    result, wall = _run(_SAVER, str(folder), mode, mount)
    assert result.returncode == 3, result.stdout + result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["code"] == "ckpt-write-failed"
    assert report["seconds"] < 10
    assert report["threads"] == ["MainThread"] or wall < 60  # no Orbax thread keeps it alive
    message = report["message"]
    assert f"Saving step 2 into '{folder}' failed:" in message
    if fault in ("disk-full", "full-in-background"):
        assert "No space left on device (ENOSPC)" in message
        assert message.splitlines()[-1].startswith("Free space on that disk")
    elif fault == "read-only":
        assert "(EROFS)" in message or "(EACCES)" in message
        assert message.splitlines()[-1].startswith("Make the folder writable")
    else:
        assert "(ENOENT)" in message
        assert "No complete step is left there" in message
    assert "Traceback" not in result.stderr  # one meshplan error, not Orbax's logs
    if fault != "vanished":
        assert "The last complete step, 1, is kept." in message
        assert complete_steps(folder) == [1]
        state, _ = meshplan.restore(folder)
        np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(16.0))
        assert not (folder / LOCK_NAME).exists() or fault == "read-only"


def test_check_writable_fails_before_any_work(tmp_path, small_disk, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.Checkpointer(tmp_path / "file" / "run")
    assert e.value.problems[0].code == "ckpt-not-a-folder"
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.Checkpointer(tmp_path / "file")
    assert e.value.problems[0].code == "ckpt-not-a-folder"
    if small_disk is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        target = small_disk / "run"
    else:
        from etils import epath

        def refuse(self, *args, **kwargs):
            raise PermissionError(13, "Permission denied", str(self))

        monkeypatch.setattr(type(epath.Path(tmp_path)), "mkdir", refuse)
        target = tmp_path / "run"
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.Checkpointer.check_writable(target)
    (problem,) = e.value.problems
    assert problem.code == "ckpt-not-writable"
    assert str(e.value).startswith(f"Cannot write checkpoints into '{target}': ")
    assert problem.fix.startswith("Make the folder writable")


# -- 4. damaged steps -----------------------------------------------------------


def _two_steps(folder):
    with meshplan.Checkpointer(folder, async_save=False) as ckpt:
        for step in (10, 20):
            w = jax.random.normal(jax.random.key(step), (2000,))
            ckpt.save(step, {"params": {"w": w, "b": jnp.arange(8.0)}})


def _truncate_biggest_array_file(folder, step):
    data = step_directory(folder, step) / "state"
    files = [p for p in data.glob("ocdbt.process_*/d/*")]
    biggest = max(files, key=lambda p: os.path.getsize(p))
    os.truncate(biggest, 100)


@pytest.mark.slow
def test_truncated_array_file_is_named_and_skipped(tmp_path):
    _two_steps(tmp_path)
    _truncate_biggest_array_file(tmp_path, 20)
    where = f"'{tmp_path}' (step 20)"
    with pytest.raises(meshplan.CheckpointError) as e:
        meshplan.restore(tmp_path)
    (problem,) = e.value.problems
    assert problem.code == "ckpt-damaged"
    assert problem.path == where
    assert f"{where}: array 'params/w' cannot be read" in str(e.value)
    assert problem.fix.startswith("Restore an earlier step (step=10;")
    # Orbax's exception (a screen of TensorStore traceback) is neither chained nor kept.
    assert e.value.__cause__ is None and e.value.__context__ is None
    # The cheap check finds it without reading arrays, and the newest intact step.
    assert check_step(tmp_path, 20).message.startswith(f"{where}: array 'params/w'")
    assert check_step(tmp_path, 10) is None
    found = intact_step(tmp_path)
    assert found.step == 10
    assert [p.path for p in found.skipped] == [where]
    assert found.skipped_steps == [20]  # the step numbers, typed: no text parsed back
    assert intact_step(tmp_path, before=10) == (None, [], [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        restored = meshplan.restore(tmp_path, fallback=True)
    assert restored.metadata.step == 10
    assert [str(w.message) for w in caught] == [
        f"Skipped {where}: array 'params/w' cannot be read"
        + str(caught[0].message).split("cannot be read", 1)[1]
    ]


@pytest.mark.slow
def test_restoring_a_damaged_step_prints_one_short_error_and_nothing_at_exit(tmp_path):
    _two_steps(tmp_path)
    _truncate_biggest_array_file(tmp_path, 20)
    uncaught, _ = _run("import sys, meshplan; meshplan.restore(sys.argv[1])", str(tmp_path))
    assert uncaught.returncode == 1
    assert "meshplan.CheckpointError" in uncaught.stderr and "ckpt-damaged" not in uncaught.stdout
    assert len(uncaught.stderr.splitlines()) < 30  # was about 150 lines of TensorStore traceback
    for _ in range(3):  # the leftover read coroutines were printed at exit in 1 run out of 5
        fell_back, _ = _run(
            "import sys, warnings, meshplan\n"
            "warnings.simplefilter('ignore')\n"
            "print(meshplan.restore(sys.argv[1], fallback=True).metadata.step)",
            str(tmp_path),
        )
        assert fell_back.returncode == 0 and fell_back.stdout.strip() == "10"
        assert "Exception ignored" not in fell_back.stderr


def test_damaged_metadata_and_every_step_damaged(tmp_path):
    _two_steps(tmp_path)
    os.remove(step_directory(tmp_path, 20) / "meshplan" / "metadata")
    with pytest.raises(meshplan.CheckpointError) as e:
        read_metadata(tmp_path)
    assert e.value.problems[0].code == "ckpt-damaged"
    assert f"'{tmp_path}' (step 20): cannot read its 'meshplan' metadata item" in str(e.value)
    assert intact_step(tmp_path).step == 10
    _truncate_biggest_array_file(tmp_path, 10)
    found = intact_step(tmp_path)
    assert found.step is None and len(found.skipped) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(meshplan.CheckpointError) as e:
            meshplan.restore(tmp_path, fallback=True)
    assert str(e.value).startswith(f"No step of '{tmp_path}' can be read:")
    assert [p.code for p in e.value.problems] == ["ckpt-damaged", "ckpt-damaged"]


def test_restore_arguments_are_checked(tmp_path):
    _two_steps(tmp_path)
    with pytest.raises(meshplan.ArgumentError) as e:
        meshplan.restore(tmp_path, mesh="2x4")
    assert e.value.problems[0].code == "ckpt-bad-mesh"
    assert "got '2x4' (str)" in str(e.value)
    assert meshplan.restore(tmp_path, step="10").metadata.step == 10
    assert read_metadata(tmp_path, step="20").step == 20
    with pytest.raises(meshplan.ArgumentError) as e:
        meshplan.restore(tmp_path, step="latest")
    assert e.value.problems[0].code == "ckpt-bad-step"


# -- 5. one writer per folder ---------------------------------------------------

_HOLDER = """
import sys, time
import meshplan
ckpt = meshplan.Checkpointer(sys.argv[1])
print("locked", flush=True)
if sys.argv[2] == "exit":
    sys.exit(0)  # never closed: released at exit
time.sleep(120)
"""


def _hold(folder, how="sleep"):
    env = fresh_env(PYTHONPATH=SRC, JAX_PLATFORMS="cpu")
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_HOLDER), str(folder), how],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert child.stdout.readline().strip() == "locked"
    return child


@pytest.mark.slow
def test_a_second_writer_is_refused_and_a_stale_lock_taken_over(tmp_path):
    child = _hold(tmp_path)
    try:
        holder = read_lock(tmp_path)
        assert holder["pid"] == child.pid and holder["host"] == socket.gethostname()
        with pytest.raises(meshplan.CheckpointError) as e:
            meshplan.Checkpointer(tmp_path)
        (problem,) = e.value.problems
        assert problem.code == "ckpt-locked"
        message = str(e.value)
        assert f"PID {child.pid} on host {socket.gethostname()!r}, started {holder['started']}" in (
            message
        )
        assert "--" not in problem.fix
        # Killed: its lock is stale, taken over with a note.
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert (tmp_path / LOCK_NAME).exists()
    with pytest.warns(UserWarning, match=rf"held by PID {child.pid} .* no longer running"):
        ckpt = meshplan.Checkpointer(tmp_path, async_save=False)
    assert f"held by PID {child.pid}" in ckpt.note
    assert read_lock(tmp_path)["pid"] == os.getpid()
    ckpt.save(1, {"w": jnp.ones(2)})
    assert ckpt.all_steps() == [1]  # the lock file is no step
    ckpt.close()
    assert not (tmp_path / LOCK_NAME).exists()
    assert complete_steps(tmp_path) == [1]


@pytest.mark.slow
def test_lock_is_released_at_exit_and_held_once_per_process(tmp_path):
    child = _hold(tmp_path, "exit")
    assert child.wait(timeout=60) == 0
    assert not (tmp_path / LOCK_NAME).exists()
    first = meshplan.Checkpointer(tmp_path)
    assert first.note is None
    with pytest.raises(meshplan.CheckpointError, match="being written by another Checkpointer"):
        meshplan.Checkpointer(tmp_path)
    first.close()
    with meshplan.Checkpointer(tmp_path):
        pass
    # A Checkpointer dropped without close() releases its lock when collected.
    dropped = meshplan.Checkpointer(tmp_path)
    del dropped
    import gc

    gc.collect()
    meshplan.Checkpointer(tmp_path).close()


@pytest.mark.parametrize(
    "message",
    [
        "Task exception was never retrieved\nfuture: <Task finished>",
        # a plain future of Orbax's writes (seen after a disk filled up mid-save)
        "Future exception was never retrieved\nfuture: <Future finished exception=ValueError()>",
        # a write still in flight as asyncio.run ends (once in a full suite: a full disk)
        "unhandled exception during asyncio.run() shutdown\ntask: <Task finished "
        "coro=<write_fragment() done> exception=FileNotFoundError()>",
        # an asyncio.gather of Orbax's writes (once in a full suite: a full disk)
        "_GatheringFuture exception was never retrieved\nfuture: <_GatheringFuture finished "
        "exception=ValueError('RESOURCE_EXHAUSTED')>",
    ],
    ids=["task", "future", "run-shutdown", "gathering-future"],
)
def test_orbax_tasks_whose_exception_nobody_awaited_are_not_logged(tmp_path, monkeypatch, message):
    """asyncio logs a collected task's (or future's) unretrieved exception with its whole
    traceback; for Orbax's writes after a failed save that is a screen of TensorStore text,
    left out."""
    import logging

    from meshplan._checkpoint.quiet import ORPHANED_TASKS

    def record_with(filename: str) -> logging.LogRecord:
        code = compile("raise ValueError('RESOURCE_EXHAUSTED')", filename, "exec")
        try:
            exec(code)
        except ValueError as e:
            error = e
        return logging.LogRecord(
            "asyncio",
            logging.ERROR,
            "base_events.py",
            1,
            message,
            None,
            (ValueError, error, error.__traceback__),
        )

    orbax_file = os.path.join("site-packages", "orbax", "checkpoint", "serialization.py")
    assert ORPHANED_TASKS.filter(record_with(orbax_file)) is False
    assert ORPHANED_TASKS.filter(record_with("mine.py")) is True
    with meshplan.Checkpointer(tmp_path):  # opening one installs the filter
        assert ORPHANED_TASKS in logging.getLogger("asyncio").filters
    # As the interpreter exits (where the tasks are often collected) the module's
    # globals may be None already: the filter still drops Orbax's.
    from meshplan._checkpoint import quiet

    monkeypatch.setattr(quiet, "_NEVER_RETRIEVED", None)
    monkeypatch.setattr(quiet, "_ORBAX_DIR", None)
    assert ORPHANED_TASKS.filter(record_with(orbax_file)) is False


@pytest.mark.slow
def test_the_leftover_filter_drops_only_orbax_coroutines(monkeypatch):
    import sys
    import types

    from meshplan._checkpoint import quiet

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    monkeypatch.setattr(quiet, "_INSTALLED", False)
    monkeypatch.setattr(quiet, "_FILTERS", set())
    monkeypatch.setattr(quiet, "_previous", None)  # restored after: the real chain stays
    quiet.drop_orbax_leftovers()

    def event(filename):
        code = compile("pass", filename, "exec")
        return types.SimpleNamespace(object=types.SimpleNamespace(cr_code=code))

    orbax = event(f"{os.sep}site-packages{os.sep}orbax{os.sep}serialization.py")
    mine = event(f"{os.sep}home{os.sep}me{os.sep}app.py")
    closed = types.SimpleNamespace(object=None, exc_value=RuntimeError("Event loop is closed"))
    for event_ in (orbax, mine, closed):
        sys.unraisablehook(event_)
    assert seen == [mine, closed]  # the closed-loop filter is off until a Checkpointer opens
    quiet.quiet_late_callbacks()  # the same one hook, one more filter
    sys.unraisablehook(closed)
    assert seen == [mine, closed]
