"""``meshplan train`` under faults: a diverging run, a full or read-only disk, a damaged
latest step, two writers, and SIGKILL/SIGTERM at random points, then ``--resume``.

Real files and real processes: the I/O faults use a tiny tmpfs (a full disk) and a
read-only remount where ``mount`` is permitted (tests run as root, where ``chmod``
denies nothing), else the failure injected into the filesystem calls Orbax makes.
"""

from __future__ import annotations

import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import meshplan
from child_env import fresh_env
from meshplan._checkpoint.folder import complete_steps
from meshplan._checkpoint.integrity import step_directory
from meshplan._checkpoint.lock import LOCK_NAME, read_lock
from meshplan.cli import main

TINY = ["--layers", "1", "--embed", "32", "--mlp", "64", "--max-len", "64"]
FAST = ["--batch", "8", "--seq", "16", "--eval-batches", "2", *TINY]
SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"
)

# The command line, with a failure injected at the second save when asked (no mount).
_CHILD = """
import errno, os, sys
from meshplan.cli import main
if os.environ.get("MESHPLAN_TEST_INJECT"):
    from etils import epath
    import meshplan.train.trainer as trainer
    original, calls = trainer.Trainer.save, []
    code = errno.ENOSPC if os.environ["MESHPLAN_TEST_INJECT"] == "enospc" else errno.EACCES
    def save(self):
        calls.append(1)
        if len(calls) == 2:
            self._checkpointer.wait()  # step 1 is complete: the disk fails from step 2 on
            cls = type(epath.Path("/"))
            def failing(self, *args, **kwargs):
                raise OSError(code, os.strerror(code), str(self))
            cls.mkdir = cls.write_text = cls.write_bytes = failing
        return original(self)
    trainer.Trainer.save = save
sys.exit(main(sys.argv[1:]))
"""


def _env(**extra: str) -> dict[str, str]:
    return fresh_env(PYTHONPATH=SRC, **extra)


def _start(args: list[str], log: Path, **env: str) -> subprocess.Popen:
    with open(log, "wb") as out:  # a file, not a pipe: it cannot fill up
        return subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(_CHILD), "train", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(**env),
        )


def _run(args: list[str], log: Path, timeout: float = 120, **env: str) -> tuple[int, str, float]:
    start = time.monotonic()
    proc = _start(args, log, **env)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, log.read_text(), time.monotonic() - start


def _main(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


# -- a run that diverges --------------------------------------------------------


@pytest.mark.slow
def test_a_diverging_resume_keeps_the_good_steps_and_stops_with_one_error(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "5", "--ckpt-every", "5", "--keep", "1", "--ckpt-dir", str(folder)]
    code, _, _ = _main([*FAST, "--steps", "10", *base], capsys)
    assert code == 0
    best_before = meshplan.restore(folder, step=10).arrays()

    # The case: a huge learning rate on resume (losses are NaN within a few steps).
    code, _, err = _main(["--resume", "--lr", "1e6", "--steps", "40", *base], capsys)
    assert code == 1
    assert err.count("error: ") == 1
    first = err.splitlines()[0]
    assert first.startswith("error: Training diverged at step ")
    assert "is nan" in first or "NaN" in first or "is inf" in first
    assert f"The last good checkpoint is step 10 of '{folder}'" in first
    # The fix repeats this run's flags (its --steps 40 among them), so run as printed it trains.
    fix = err[err.index("meshplan train ") :].strip().rstrip(".")
    assert fix == (f"meshplan train --steps 40 {' '.join(base)} --resume-step 10 --lr 100000"), fix
    steps = complete_steps(folder)
    assert 10 in steps  # the best (and last good) step is kept, whatever --keep says
    for step in steps:
        arrays = meshplan.restore(folder, step=step).arrays()
        assert all(np.isfinite(np.asarray(a)).all() for a in arrays.values()), step
    after = meshplan.restore(folder, step=10).arrays()
    for key, value in best_before.items():
        np.testing.assert_array_equal(np.asarray(after[key]), np.asarray(value), err_msg=key)
    assert not (folder / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_resume_with_nothing_left_to_train_says_so(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "5", "--ckpt-every", "5", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "5", *base], capsys)[0] == 0
    code, out, _ = _main(["--resume", *base], capsys)
    assert code == 0
    words = " ".join(out.split())  # the note wraps where the folder's path ends
    assert "note: nothing to train:" in words and "is at step 5 and --steps is 5" in words
    assert "Pass --steps N with N above 5" in words
    assert not (folder / LOCK_NAME).exists()


@pytest.mark.slow
def test_a_resumed_run_that_gets_worse_keeps_its_best_step(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "2", "--ckpt-every", "2", "--keep", "1", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "6", "--lr", "1e-2", *base], capsys)[0] == 0
    # A learning rate large enough to make the loss worse, not NaN.
    code, out, _ = _main(["--resume", "--steps", "12", "--lr", "3", *base], capsys)
    assert code == 0, out
    steps = complete_steps(folder)
    assert steps[-1] == 12 and len(steps) <= 2
    assert len(steps) == 2  # the best of the first stretch, and the latest
    # The summary names steps that exist (its table may wrap a cell over two lines).
    summary = " ".join(out[out.index("Summary") :].replace("│", " ").split())
    assert "latest step 12;" in summary
    assert f"best kept: step {steps[0]}, valid loss" in summary
    best = int(summary.split("best valid loss ")[1].split("(step ")[1].split(")")[0])
    assert best == steps[0]


@pytest.mark.parametrize(
    ("flags", "expected", "fix"),
    [
        (["--lr", "nan"], "--lr must be a finite number above 0, got nan", "--lr 3e-3"),
        (["--lr", "inf"], "--lr must be a finite number above 0, got inf", "--lr 3e-3"),
        (["--lr", "-1"], "--lr must be a finite number above 0, got -1", "--lr 3e-3"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number of 0 or more", "0.01"),
        (["--clip", "0"], "--clip must be a finite number above 0, got 0", "--clip 1.0"),
        (["--warmup", "-5"], "--warmup must be 0 or more, got -5", "--warmup 0 (no warm-up)"),
        (["--keep", "0"], "--keep must be a whole number of 1 or more", "--keep 1 or more"),
        (["--mesh", "2x2x2"], "--mesh 2x2x2 has 3 axes", "Pass --mesh DxM"),
        (["--batch", "1048576"], "--batch 1048576 needs about", "Use --batch"),
    ],
    ids=["lr-nan", "lr-inf", "lr-neg", "wd-nan", "clip", "warmup", "keep", "mesh3", "oom"],
)
def test_nonsense_settings_are_refused_up_front(tmp_path, capsys, flags, expected, fix):
    folder = tmp_path / "run"
    start = time.monotonic()
    code, _, err = _main([*FAST, "--ckpt-dir", str(folder), *flags], capsys)
    assert code == 2
    assert err.startswith("error: meshplan train cannot start:\n  * ")
    assert expected in err
    assert fix in err.split("\n  * ")[-1]
    assert "--axes" not in err.split("\n")[1] or "meshplan plan --axes" in err
    assert not folder.exists()
    assert time.monotonic() - start < 20


def test_memory_estimate_names_the_numbers(tmp_path, capsys):
    _, _, err = _main([*FAST, "--batch", "1048576"], capsys)
    assert "per device (" in err and "of activations for its 524,288 sequences" in err
    assert "but a device has about" in err
    largest = int(err.split("Use --batch ")[1].split()[0])
    assert 0 < largest < 1048576 and largest % 2 == 0


def test_metrics_pointing_at_a_folder(tmp_path, capsys):
    code, _, err = _main([*FAST, "--steps", "1", "--metrics", str(tmp_path)], capsys)
    assert code == 2
    assert f"--metrics '{tmp_path}' is a folder, not a file" in err
    code, _, err = _main([*FAST, "--metrics", str(tmp_path / "no" / "m.jsonl")], capsys)
    assert code == 2 and "does not exist" in err


# -- failing I/O ----------------------------------------------------------------


def _remount_read_only(disk, proc, within: float = 10.0) -> None:
    """Remounts ``disk`` read-only under the running ``proc``: the kernel refuses (EBUSY)
    while a file on it is open for writing, as a save in flight is, so it is tried again."""
    deadline = time.monotonic() + within
    while True:
        done = subprocess.run(
            ["mount", "-o", "remount,ro", str(disk)], capture_output=True, text=True
        )
        if done.returncode == 0 or proc.poll() is not None:
            return
        assert time.monotonic() < deadline, f"could not remount {disk} read-only: {done.stderr}"
        time.sleep(0.005)


@pytest.mark.parametrize("fault", ["disk-full", "read-only"])
@pytest.mark.slow
def test_failing_io_ends_the_run_in_seconds_and_keeps_the_last_step(tmp_path, train_disk, fault):
    small_disk = train_disk
    args = [*FAST, "--steps", "200", "--eval-every", "0", "--ckpt-every", "1"]
    log = tmp_path / "log"
    if small_disk is None:
        folder = tmp_path / "run"
        inject = "enospc" if fault == "disk-full" else "eacces"
        code, text, wall = _run(
            [*args, "--ckpt-dir", str(folder)], log, MESHPLAN_TEST_INJECT=inject
        )
    else:
        folder = small_disk / "run"
        proc = _start([*args, "--keep", "1000", "--ckpt-dir", str(folder)], log)
        start = time.monotonic()
        try:
            if fault == "read-only":
                while proc.poll() is None and not (folder.is_dir() and complete_steps(folder)):
                    time.sleep(0.01)
                _remount_read_only(small_disk, proc)
            code = proc.wait(timeout=120)  # a 3 MiB disk fills within a few steps
        finally:
            if proc.poll() is None:
                proc.kill()
        text, wall = log.read_text(), time.monotonic() - start
    assert code == 1, text
    assert wall < 60
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, text
    assert f"into '{folder}' failed: " in errors[0]
    if fault == "disk-full":
        assert "No space left on device (ENOSPC)" in errors[0]
    else:
        assert "(EROFS)" in errors[0] or "(EACCES)" in errors[0]
    kept = complete_steps(folder)
    assert kept and f"The last complete step, {kept[-1]}, is kept" in errors[0]
    assert "Then continue with --resume" in text
    assert meshplan.restore(folder).metadata.step == kept[-1]


def test_an_unwritable_checkpoint_folder_is_refused_before_any_work(
    tmp_path, small_disk, monkeypatch, capsys
):
    if small_disk is not None:
        subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
        target = small_disk / "run"
    else:
        from etils import epath

        def refuse(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))

        monkeypatch.setattr(type(epath.Path(tmp_path)), "mkdir", refuse)
        target = tmp_path / "run"
    code, out, err = _main([*FAST, "--ckpt-dir", str(target)], capsys)
    assert code == 2
    assert f"Cannot write checkpoints into '{target}'" in err
    assert "Make --ckpt-dir writable by this user" in err
    assert "Plan per device" not in out  # nothing started
    (tmp_path / "file").write_text("x")
    code, _, err = _main([*FAST, "--ckpt-dir", str(tmp_path / "file")], capsys)
    assert code == 2 and "Pass a folder as --ckpt-dir." in err


# -- a damaged latest step ------------------------------------------------------


def _truncate_array_files(folder: Path, step: int) -> None:
    """Every data file of the step's per-process stores cut to 100 bytes. (Cutting only the
    biggest, as before, left step 4 readable in one full run of the suite: which file holds
    which array's chunks is Orbax's choice, not the test's.)"""
    data = Path(step_directory(folder, step)) / "state"
    for path in data.glob("ocdbt.process_*/d/*"):
        os.truncate(path, min(100, os.path.getsize(path)))


@pytest.mark.slow
def test_resume_falls_back_past_a_damaged_step_and_says_so(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "0", "--ckpt-every", "2", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "4", *base], capsys)[0] == 0
    _truncate_array_files(folder, 4)

    code, _, err = _main(["--resume-step", "3", "--steps", "6", *base], capsys)
    assert code == 2
    assert "has no complete checkpoint at step=3; it has steps [2, 4]" in err
    assert "Pass one of those steps as --resume-step" in err
    code, _, err = _main(["--resume-step", "4", "--steps", "6", *base], capsys)
    assert code == 2
    assert f"'{folder}' (step 4): array " in err and "cannot be read" in err
    assert "--resume-step N" in err

    code, out, err = _main(["--resume", "--steps", "6", *base], capsys)
    assert code == 0, err
    assert f"note: Skipping damaged step: '{folder}' (step 4): array " in err
    assert "note: Resuming from step 2, the newest step that can be read." in err
    moved = folder / "damaged-step-4"
    assert f"note: Moved damaged step 4 of '{folder}' into '{moved}'" in " ".join(err.split())
    assert complete_steps(moved) == [4]  # kept, with why
    assert "(step 4)" in (moved / "why.txt").read_text()
    assert f"resuming from step 2 of {folder}" in out
    assert complete_steps(folder) == [2, 4, 6]
    assert meshplan.restore(folder, step=4).metadata.step == 4  # rewritten, intact


# -- one writer -----------------------------------------------------------------


@pytest.mark.slow
def test_a_second_writer_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    folder = tmp_path / "run"
    args = [*FAST, "--eval-every", "0", "--ckpt-every", "1", "--ckpt-dir", str(folder)]
    writer = _start([*args, "--steps", "100000"], tmp_path / "log")
    try:
        deadline = time.monotonic() + 120
        while not (folder.is_dir() and complete_steps(folder) and read_lock(folder)):
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        holder = read_lock(folder)
        code, out, err = _main(["--resume", *args, "--steps", "100000"], capsys)
        assert code == 2
        assert f"is being written by another Checkpointer: PID {writer.pid} on host " in err
        assert f"started {holder['started']}" in err
        assert "pass another --ckpt-dir" in err
        assert "Plan per device" not in out
        writer.send_signal(signal.SIGKILL)  # its lock is left behind, stale
        writer.wait(timeout=30)
    finally:
        if writer.poll() is None:
            writer.kill()
            writer.wait()
    assert read_lock(folder)["pid"] == writer.pid
    last = meshplan.restore(folder).metadata.step
    code, _, err = _main(["--resume", "--steps", str(last + 1), *args], capsys)
    assert code == 0, err
    assert f"note: Took over the stale lock of '{folder}': it was held by PID {writer.pid}" in err
    assert not (folder / LOCK_NAME).exists()


# -- SIGKILL and SIGTERM at random points ---------------------------------------


@pytest.mark.slow
def test_sigkill_and_sigterm_at_random_points_then_resume_is_bit_identical(tmp_path):
    folder = tmp_path / "run"
    target = 24
    args = [*FAST, "--steps", str(target), "--eval-every", "4", "--ckpt-every", "2"]
    args += ["--keep", "2", "--ckpt-dir", str(folder)]
    rng = random.Random(8)
    stops = []
    # One of each: a third and fourth signal were the same checks again, at 25 s of CI each.
    for attempt, sig in enumerate([signal.SIGKILL, signal.SIGTERM]):
        before = complete_steps(folder)[-1] if folder.is_dir() and complete_steps(folder) else 0
        if before >= target - 2:
            break
        wanted = rng.randrange(before + 1, min(before + 8, target - 1))
        resume = ["--resume"] if before else []
        log = tmp_path / f"log{attempt}"
        proc = _start([*resume, *args], log)
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                done = complete_steps(folder) if folder.is_dir() else []
                if done and done[-1] >= wanted:
                    time.sleep(rng.uniform(0, 0.3))  # mid-step, mid-save, or between
                    proc.send_signal(sig)
                    break
                time.sleep(0.005)
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        text = log.read_text()
        stops.append((sig.name, code))
        if code == 0:
            break  # finished before the signal landed
        if sig == signal.SIGKILL:
            assert code == -signal.SIGKILL, text
        else:
            assert code == 143, text
            assert "error: stopped by SIGTERM at step " in text
            assert "Traceback" not in text
            assert not (folder / LOCK_NAME).exists()  # released on the way out
    assert any(name == "SIGTERM" and code == 143 for name, code in stops), stops
    assert sum(code != 0 for _, code in stops) >= 2, stops
    if complete_steps(folder)[-1] < target:
        code, text, _ = _run(["--resume", *args], tmp_path / "last")
        assert code == 0, text
    resumed = meshplan.restore(folder).arrays()
    assert meshplan.restore(folder).metadata.step == target

    uninterrupted = tmp_path / "once"
    code, text, _ = _run([*args[:-1], str(uninterrupted)], tmp_path / "once.log")
    assert code == 0, text
    expected = meshplan.restore(uninterrupted).arrays()
    assert sorted(resumed) == sorted(expected)
    for key, value in expected.items():
        np.testing.assert_array_equal(np.asarray(resumed[key]), np.asarray(value), err_msg=key)
