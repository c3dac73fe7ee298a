"""``meshplan train``, round 3: never delete to recover, check before changing the folder,
SIGINT while saving (one process and the launcher), and a metrics file that stays JSON lines.

Real processes and real files: one trained folder (``gold``) per module, copied and
damaged on disk per test; signals sent to real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_train_reliability import _change_stored_values

import meshplan
from child_env import fresh_env
from meshplan._checkpoint.folder import complete_steps
from meshplan._checkpoint.integrity import step_directory
from meshplan._checkpoint.lock import LOCK_NAME
from meshplan._checkpoint.metadata import metadata_digest
from meshplan.cli import main

TINY = ["--layers", "1", "--embed", "32", "--heads", "4", "--mlp", "64", "--max-len", "64"]
FAST = ["--batch", "8", "--seq", "16", "--eval-batches", "1", *TINY]
SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"
)
_CLI = [sys.executable, "-m", "meshplan.cli"]


def _main(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, " ".join(captured.err.split())


@pytest.fixture(scope="module")
def gold(tmp_path_factory):
    """Three steps, each saved (the issue's ``gold``, shorter)."""
    folder = tmp_path_factory.mktemp("gold") / "run"
    args = ["train", *FAST, "--steps", "3", "--eval-every", "0", "--ckpt-every", "1"]
    assert main([*args, "--keep", "6", "--ckpt-dir", str(folder)]) == 0
    return folder


def _copy(gold: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    shutil.copytree(gold, folder)
    return folder


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# -- 1. LOST: a refused --resume deletes nothing ------------------------------------


@pytest.mark.slow
def test_a_resume_that_can_read_no_step_moves_and_deletes_nothing(gold, tmp_path, capsys):
    folder = _copy(gold, tmp_path)
    before = _entries(folder)
    for step in complete_steps(folder):  # every checksum record wrong, the data intact
        path = step_directory(folder, step) / "meshplan" / "metadata"
        data = json.loads(path.read_text())
        for info in data["arrays"].values():
            if "checksum" in info:
                info["checksum"] = "ws2:0000000000000000"
        data["digest"] = metadata_digest(data)  # a consistent record: only reading tells
        path.write_text(json.dumps(data))
    code, _, err = _main(["--resume", "--steps", "5", "--ckpt-dir", str(folder)], capsys)
    assert code == 2
    assert f"no step of '{folder}' can be read (nothing in it was moved or deleted)" in err
    for step in (1, 2, 3):
        assert f"'{folder}' (step {step}): the bytes of" in err
    assert _entries(folder) == before
    assert complete_steps(folder) == [1, 2, 3]


# -- 3. SILENT: --resume-step checks before it moves ----------------------------------


@pytest.mark.slow
def test_steps_are_moved_only_once_the_run_will_run_and_every_move_is_said(gold, tmp_path, capsys):
    folder = _copy(gold, tmp_path)
    base = ["--eval-every", "0", "--ckpt-every", "1", "--keep", "6", "--ckpt-dir", str(folder)]
    _change_stored_values(folder, 3)  # seen only when its arrays are read
    before = _entries(folder)

    code, _, err = _main(["--resume-step", "3", "--steps", "5", *base], capsys)
    assert code == 2 and "checksum mismatch" in err
    assert _entries(folder) == before  # nothing moved before the check
    code, out, _ = _main(["--resume-step", "2", "--steps", "2", *base], capsys)
    assert code == 0 and "nothing to train" in out
    assert _entries(folder) == before  # nor for a run that does not run

    code, out, err = _main(["--resume", "--steps", "4", *base], capsys)
    assert code == 0, err
    moved = folder / "damaged-step-3"
    assert f"note: Moved damaged step 3 of '{folder}' into '{moved}' (nothing deleted" in err
    assert "checksum mismatch" in (moved / "why.txt").read_text()
    assert complete_steps(moved) == [3]  # kept whole, still a checkpoint folder
    assert complete_steps(folder) == [1, 2, 3, 4]  # step 3 written again, by this run
    assert meshplan.restore(folder, step=3).metadata.step == 3


# -- 4. a step without checksums: restored, sampled and resumed from with a word ------


@pytest.mark.slow
def test_a_step_without_checksums_is_resumed_and_sampled_with_a_note(gold, tmp_path, capsys):
    folder = _copy(gold, tmp_path)
    path = step_directory(folder, 3) / "meshplan" / "metadata"
    data = json.loads(path.read_text())  # as an older meshplan wrote it: no digest, no sums
    data.pop("digest")
    for info in data["arrays"].values():
        info.pop("checksum", None)
    path.write_text(json.dumps(data))

    sample = subprocess.run(
        [*_CLI, "sample", "--ckpt-dir", str(folder), "--length", "4"],
        capture_output=True,
        text=True,
        timeout=180,
        env=fresh_env(PYTHONPATH=SRC),
        stdin=subprocess.DEVNULL,
    )
    assert sample.returncode == 0, sample.stderr
    assert "(step 3) was restored unverified" in " ".join(sample.stderr.split())
    assert "Traceback" not in sample.stderr

    args = ["--resume", "--steps", "4", "--eval-every", "0", "--ckpt-dir", str(folder)]
    code, out, err = _main(args, capsys)
    assert code == 0, err
    assert "(step 3) was restored unverified" in err
    assert f"resuming from step 3 of {folder}" in " ".join(out.split())
    assert complete_steps(folder) == [1, 2, 3, 4]


# -- 2. HANG: SIGINT while saving every step ------------------------------------------


def _sigint_during_save(cmd: list[str], folder: Path, log: Path, *, group: bool) -> int:
    """Starts ``cmd``; sends SIGINT (to its process group when ``group``: Ctrl-C at a
    terminal) while a save is in progress; returns its exit status."""
    with open(log, "wb") as out:  # a file, not a pipe: it cannot fill up
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=fresh_env(PYTHONPATH=SRC),
            stdin=subprocess.DEVNULL,
            start_new_session=group,
        )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            saving = folder.is_dir() and any(
                ".orbax-checkpoint-tmp" in p for p in os.listdir(folder)
            )
            if saving and len(complete_steps(folder)) >= 2:
                if group:
                    os.killpg(proc.pid, signal.SIGINT)
                else:
                    proc.send_signal(signal.SIGINT)
                return proc.wait(timeout=120)  # a swallowed SIGINT would run on: a timeout
            time.sleep(0.005)
        raise AssertionError(f"no save seen in progress: {log.read_text()[-2000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL) if group else proc.kill()
            proc.wait()


def _check_stopped_cleanly(folder: Path, text: str) -> None:
    assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
    assert "interrupted (SIGINT) at step " in text
    kept = complete_steps(folder)
    assert f"latest complete checkpoint: step {kept[-1]} " in text
    assert not (folder / LOCK_NAME).exists()  # released
    assert not [p for p in os.listdir(folder) if "tmp" in p]  # the save was finished
    assert meshplan.restore(folder).metadata.step == kept[-1]


@pytest.mark.slow
def test_sigint_while_saving_every_step_stops_the_run(tmp_path, capsys):
    folder, metrics, log = tmp_path / "run", tmp_path / "metrics.jsonl", tmp_path / "log"
    cmd = [
        *_CLI,
        "train",
        *FAST,
        "--steps",
        "100000",
        "--eval-every",
        "0",
        "--ckpt-every",
        "1",
        "--metrics",
        str(metrics),
        "--ckpt-dir",
        str(folder),
    ]
    assert _sigint_during_save(cmd, folder, log, group=False) == 130
    _check_stopped_cleanly(folder, log.read_text())

    # The metrics file: a run that stopped mid-line (simulated) is mended by the next.
    with open(metrics, "a") as f:
        f.write('{"step": 99, "lo')
    last = complete_steps(folder)[-1]
    args = ["--resume", "--steps", str(last + 1), "--eval-every", "0"]
    code, _, err = _main([*args, "--ckpt-dir", str(folder), "--metrics", str(metrics)], capsys)
    assert code == 0, err
    assert "ended in a half-written line" in err
    lines = metrics.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines][-1] == last + 1  # all JSON


@pytest.mark.slow
def test_ctrl_c_to_the_launcher_stops_every_worker_after_the_save(tmp_path):
    folder, log = tmp_path / "run", tmp_path / "log"
    cmd = [
        *_CLI,
        "train",
        "--processes",
        "2",
        *FAST,
        "--steps",
        "100000",
        "--eval-every",
        "0",
        "--ckpt-every",
        "1",
        "--ckpt-dir",
        str(folder),
    ]
    assert _sigint_during_save(cmd, folder, log, group=True) == 130
    text = log.read_text()
    assert "meshplan: SIGINT: forwarded to the 2 running workers" in text
    _check_stopped_cleanly(folder, text)
