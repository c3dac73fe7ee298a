"""``meshplan train``, ``sample``, ``plan`` and ``search``, round 2: bytes changed in place,
branches after ``--resume-step``, the launcher and SIGTERM, bounded work, and clear ends.

Real processes and real files: checkpoints written by ``meshplan train``, damaged on disk,
read back by new processes; signals sent to real launchers; ``/dev/full`` as a full disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import meshplan
from child_env import fresh_env
from meshplan._checkpoint.folder import complete_steps
from meshplan._checkpoint.integrity import step_directory
from meshplan._checkpoint.lock import LOCK_NAME
from meshplan.cli import main
from meshplan.train.records import sane_step

TINY = ["--layers", "1", "--embed", "32", "--mlp", "64", "--max-len", "64"]
FAST = ["--batch", "8", "--seq", "16", "--eval-batches", "2", *TINY]
SRC = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src"
)
_CLI = [sys.executable, "-m", "meshplan.cli"]


def _env(**extra: str) -> dict[str, str]:
    return fresh_env(PYTHONPATH=SRC, **extra)


def _cli(*args: str, timeout: float = 180, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
        stdin=subprocess.DEVNULL,
    )


def _main(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def _change_stored_values(folder: Path, step: int, key: str = "params.embed") -> None:
    """Writes other numbers into one stored array of ``step``, through its own format.

    What a damaged byte looks like once decoded: the files still parse, the array
    reads without error, its values differ. (Raw bytes overwritten in place are the
    library test's case: tests/checkpoint/test_checkpoint_reliability.py.)
    """
    import tensorstore as ts

    kv = {"driver": "ocdbt", "base": f"file://{step_directory(folder, step)}/state/"}
    array = ts.open({"driver": "zarr", "kvstore": {**kv, "path": f"{key}/"}}).result()
    array[0, :8].write(np.full(8, 7.0, np.float32)).result()


# -- 2. bytes changed in place: --resume skips the step, sample and restore refuse it --


@pytest.mark.slow
def test_a_step_whose_bytes_changed_is_skipped_by_resume_and_refused_by_sample(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "0", "--ckpt-every", "2", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "4", *base], capsys)[0] == 0
    _change_stored_values(folder, 4)
    where = f"'{folder}' (step 4)"
    damage = f"{where}: the bytes of 1 array changed since it was saved (checksum mismatch)"

    with pytest.raises(meshplan.CheckpointError, match="checksum mismatch") as e:
        meshplan.restore(folder)
    assert e.value.problems[0].code == "ckpt-damaged"

    sample = _cli("sample", "--ckpt-dir", str(folder), "--length", "8")
    assert sample.returncode == 2, sample.stdout + sample.stderr
    assert f"error: {damage}: 'params/embed'." in sample.stderr
    assert "--step 2 is the newest one before it" in sample.stderr
    assert "\x00" not in sample.stdout and "Traceback" not in sample.stderr

    code, _, err = _main(["--resume-step", "4", "--steps", "6", *base], capsys)
    assert code == 2
    assert damage in err and "--resume-step N" in err

    code, out, err = _main(["--resume", "--steps", "6", *base], capsys)
    assert code == 0, err
    assert f"note: Skipping damaged step: {damage}: 'params/embed'" in err
    assert "note: Resuming from step 2, the newest step that can be read." in err
    moved = folder / "damaged-step-4"
    assert f"note: Moved damaged step 4 of '{folder}' into '{moved}'" in " ".join(err.split())
    assert complete_steps(moved) == [4]  # kept, with why
    assert "(step 4)" in (moved / "why.txt").read_text()
    assert f"resuming from step 2 of {folder}" in out
    assert complete_steps(folder) == [2, 4, 6]
    assert meshplan.restore(folder, step=4).metadata.step == 4  # rewritten, verified


# -- 3. --resume-step: the old branch is set aside, never resumed into --------------


@pytest.mark.slow
def test_resuming_an_earlier_step_sets_the_later_steps_aside(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "0", "--ckpt-every", "1", "--keep", "10", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "4", *base], capsys)[0] == 0
    old = {s: meshplan.restore(folder, step=s).arrays() for s in (3, 4)}

    # Another branch from step 2 (another learning rate), up to step 3.
    code, _, err = _main(["--resume-step", "2", "--steps", "3", "--lr", "1e-2", *base], capsys)
    assert code == 0, err
    aside = folder / "old-branch-after-step-2"
    assert f"note: Steps 3, 4 of '{folder}' came after step 2" in err
    assert f"moved into '{aside}' (nothing deleted)" in " ".join(err.split())
    assert "neither this run nor a later --resume mixes them in" in " ".join(err.split())
    assert complete_steps(folder) == [1, 2, 3]
    assert complete_steps(aside) == [3, 4]  # the old branch, whole, still restorable
    for step in (3, 4):
        kept = meshplan.restore(aside, step=step).arrays()
        for key, value in old[step].items():
            np.testing.assert_array_equal(np.asarray(kept[key]), np.asarray(value), err_msg=key)
    new3 = meshplan.restore(folder, step=3).arrays()["params/embed"]
    assert not np.array_equal(np.asarray(new3), np.asarray(old[3]["params/embed"]))

    # A later --resume continues the new branch, not the old step 4.
    code, out, err = _main(["--resume", "--steps", "4", *base], capsys)
    assert code == 0, err
    assert f"resuming from step 3 of {folder}" in out
    assert complete_steps(folder) == [1, 2, 3, 4]
    assert complete_steps(aside) == [3, 4]
    assert not (folder / LOCK_NAME).exists()


# -- 5. SIGTERM to the launcher of --processes N ------------------------------------


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_worker_after_the_save(tmp_path):
    folder, metrics, log = tmp_path / "run", tmp_path / "metrics.jsonl", tmp_path / "log"
    args = [
        *_CLI,
        "train",
        "--processes",
        "2",
        "--steps",
        "100000",
        "--eval-every",
        "0",
        "--ckpt-every",
        "3",
        *FAST,
        "--metrics",
        str(metrics),
        "--ckpt-dir",
        str(folder),
    ]
    with open(log, "wb") as out:  # a file, not a pipe: it cannot fill up
        launcher = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=_env())
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and launcher.poll() is None:
            if metrics.exists() and '"step": 4,' in metrics.read_text():
                break  # step 3 is saved or being saved
            time.sleep(0.2)
        assert launcher.poll() is None, log.read_text()
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:  # its workers die with it (PR_SET_PDEATHSIG)
            launcher.kill()
            launcher.wait()
    text = log.read_text()
    assert code == 143, text
    assert "meshplan: SIGTERM: forwarded to the 2 running workers" in text
    assert "error: stopped by SIGTERM at step " in text
    assert "Traceback" not in text
    assert not (folder / LOCK_NAME).exists()  # released by process 0
    kept = complete_steps(folder)
    assert kept and f"latest complete checkpoint: step {kept[-1]}" in text
    assert meshplan.restore(folder).metadata.step == kept[-1]


# -- 6, 8. refused up front, with the value and the fix -------------------------------


@pytest.mark.parametrize(
    "flags, expected, fix",
    [
        (
            ["--ckpt-dir", ""],
            "--ckpt-dir '' is empty: the run would save nothing",
            "or leave --ckpt-dir out",
        ),
        (
            ["--ckpt-dir", "gs://bucket/run"],
            "--ckpt-dir 'gs://bucket/run' is a gs:// URL",
            "Train into a local folder",
        ),
        (
            ["--seed", str(2**63)],
            f"--seed must be below 2**63 (a 64-bit seed), got {2**63}",
            "from 0 to 2**63 - 1",
        ),
    ],
    ids=["empty-ckpt-dir", "gs-url", "seed-2**63"],
)
def test_settings_that_would_end_badly_are_refused_up_front(tmp_path, capsys, flags, expected, fix):
    os.chdir(tmp_path)  # nothing may be created here ('./gs:')
    code, _, err = _main([*FAST, "--steps", "2", *flags], capsys)
    assert code == 2
    assert expected in err and fix in " ".join(err.split())
    assert os.listdir(tmp_path) == []


def test_metrics_pointing_at_a_fifo_is_refused(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, _, err = _main([*FAST, "--steps", "2", "--metrics", str(fifo)], capsys)
    assert code == 2
    assert f"--metrics '{fifo}' is a FIFO (named pipe), not a regular file" in err


@pytest.mark.slow
def test_metrics_on_a_full_disk_ends_the_run_with_one_error(tmp_path):
    folder = tmp_path / "run"
    result = _cli(
        "train",
        *FAST,
        "--steps",
        "50",
        "--eval-every",
        "0",
        "--ckpt-every",
        "1",
        "--metrics",
        "/dev/full",
        "--ckpt-dir",
        str(folder),
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    # --eval-every 0 evaluates only at the end: the first record is step 1's.
    assert (
        "error: --metrics '/dev/full': writing the record of step 1 failed: No space left on device (ENOSPC)"
        in result.stderr
    )
    assert "then continue with --resume" in result.stderr
    assert not (folder / LOCK_NAME).exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, env, expected",
    [
        (
            ["plan", "--mesh", "10000x10000"],
            {},
            "--mesh 10000x10000 has 100,000,000 devices: "
            "meshplan plan lays out at most 1,048,576 (2**20)",
        ),
        (["plan", "--mesh", "100000x100000"], {}, "has 10,000,000,000 devices"),
        (
            ["search", "--devices", "1048576"],
            {},
            "--devices 1048576 is more than meshplan search searches: at most 16,384 (2**14)",
        ),
        (["search", "--devices", "1000000007"], {}, "Search at most 16,384 devices"),
        (
            ["train", "--steps", "1"],
            {"JAX_PLATFORMS": "tpu"},
            "error: JAX could not start the devices JAX_PLATFORMS='tpu' asks for: ",
        ),
        (
            ["sample", "--ckpt-dir", "/nonexistent"],
            {"JAX_PLATFORMS": "cuda"},
            "error: JAX could not start the devices JAX_PLATFORMS='cuda' asks for: ",
        ),
        (["plan", "--png", "/tmp"], {}, "error: --png '/tmp' is a folder"),
    ],
    ids=["plan-1e8", "plan-1e10", "search-2**20", "search-prime", "tpu", "cuda", "png-folder"],
)
@pytest.mark.slow
def test_what_used_to_hang_or_end_cryptically_ends_at_once_with_a_meshplan_error(
    args, env, expected
):
    start = time.monotonic()
    result = _cli(*args, timeout=120, **env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert time.monotonic() - start < 60
    assert expected in " ".join(result.stderr.split())
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) <= 4


@pytest.mark.slow
def test_closed_or_full_stdout_ends_with_a_message(tmp_path):
    closed = subprocess.run(  # `meshplan plan >&-`
        ["sh", "-c", 'exec "$@" >&-', "sh", *_CLI, "plan"],
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert closed.returncode == 2
    assert "error: meshplan: standard output is closed" in closed.stderr
    assert "Traceback" not in closed.stderr
    with open("/dev/full", "w") as full:  # a disk that is always full
        result = subprocess.run(
            [*_CLI, "plan"],
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            timeout=120,
        )
    assert result.returncode == 1
    assert "error: meshplan: writing its output failed: No space left on device" in result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


# -- 6. resuming with another validation setting ---------------------------------------


@pytest.mark.slow
def test_resuming_with_another_seq_says_so_and_keeps_each_settings_best(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "2", "--ckpt-every", "2", "--keep", "1", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "4", *base], capsys)[0] == 0
    first = meshplan.Checkpointer(folder)
    first_best = first.best()
    first.close()
    assert first_best is not None
    code, out, err = _main(["--resume", "--steps", "8", "--seq", "32", *base], capsys)
    assert code == 0, err
    joined = " ".join(err.split())
    assert (
        "note: This run validates otherwise than step 4 of the checkpoint (--seq 32 instead of 16)"
        in joined
    )
    assert "the best step is kept per validation setting" in joined
    steps = complete_steps(folder)
    # --keep 1: the latest step, this setting's best, and the first setting's best.
    assert first_best[0] in steps
    assert 8 in steps
    from meshplan.train.records import valid_setting

    ckpt = meshplan.Checkpointer(folder)
    try:
        data = meshplan.restore(folder).metadata.extra["train"]["data"]
        now = ckpt.best(
            valid_setting({"seq_len": 32, "batch": 8, "eval_batches": 2, "seed": 0}, data)
        )
        assert now is not None and now[0] > 4  # chosen among this run's validations only
        assert (
            ckpt.best(
                valid_setting({"seq_len": 16, "batch": 8, "eval_batches": 2, "seed": 0}, data)
            )
            == first_best
        )
    finally:
        ckpt.close()
    assert (
        f"best valid loss  │ {now[1]:.3f}" in out or f"{now[1]:.3f} nats/byte (step {now[0]}" in out
    )


# -- 7. a step without its metadata item, an empty step folder --------------------------


@pytest.mark.slow
def test_a_step_without_metadata_and_an_empty_step_folder_are_skipped(tmp_path, capsys):
    folder = tmp_path / "run"
    base = ["--eval-every", "0", "--ckpt-every", "2", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "4", *base], capsys)[0] == 0
    (step_directory(folder, 4) / "meshplan").rmtree()
    os.mkdir(folder / "6")
    sample = _cli("sample", "--ckpt-dir", str(folder), "--length", "8")
    assert sample.returncode == 2
    assert "--step 2 is the newest one before it" in sample.stderr
    assert "not a meshplan checkpoint" not in sample.stderr
    code, out, err = _main(["--resume", "--steps", "6", *base], capsys)
    assert code == 0, err
    joined = " ".join(err.split())
    assert f"note: Skipping damaged step: '{folder}' (step 6)" in joined
    assert (
        f"note: Skipping damaged step: '{folder}' (step 4) has no 'meshplan' metadata item"
        in joined
    )
    assert f"resuming from step 2 of {folder}" in out
    assert complete_steps(folder) == [2, 4, 6]


# -- 9. the divergence fix points at a sane step ----------------------------------------


@pytest.mark.parametrize(
    "saved, losses, best, start, expected",
    [
        ([2, 4], {1: 5.0, 2: 4.5, 3: 4.2, 4: 4.0}, None, 0, (4, "")),
        (
            [2, 4, 6],
            {1: 5.0, 2: 4.0, 3: 3.9, 4: 3.8, 5: 9.0, 6: 3.4e13},
            None,
            0,
            (
                2,
                "the last saved step whose state then gave a training loss at or below the "
                "running median (3.9 at step 3, median 4); passed over: step 6 (3.4e+13 at step "
                "6), step 4 (9 at step 5)",
            ),
        ),
        (
            [10, 12],
            {12: 50.0, 13: 3.4e13},
            None,
            10,
            (
                10,
                "the step this run started from (its loss was not seen climbing); passed over: "
                "step 12 (3.4e+13 at step 13)",
            ),
        ),
        (
            [11, 12],
            {11: 1.0, 12: 3.4e13, 13: 3.5e13},
            (11, 2.0),
            10,
            (
                11,
                "the best by validation loss (2); passed over: step 12 (3.5e+13 at step 13), "
                "step 11 (3.4e+13 at step 12)",
            ),
        ),
    ],
    ids=["all-sane", "climbing", "the-start", "best"],
)
def test_the_step_to_resume_a_diverged_run_from(saved, losses, best, start, expected):
    assert sane_step(saved, losses, best, start) == expected


@pytest.mark.slow
def test_a_diverged_run_names_the_last_step_whose_loss_was_sane(tmp_path, capsys):
    folder, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    base = ["--eval-every", "0", "--ckpt-every", "1", "--keep", "100", "--ckpt-dir", str(folder)]
    assert _main([*FAST, "--steps", "2", *base], capsys)[0] == 0
    # The loss climbs for steps (5e6, 2e9, ... 3.6e14) before a state holds NaN.
    code, _, err = _main(
        [
            "--resume",
            "--lr",
            "1e3",
            "--warmup",
            "0",
            "--clip",
            "1e9",
            "--steps",
            "40",
            "--metrics",
            str(metrics),
            *base,
        ],
        capsys,
    )
    assert code == 1
    first = err.splitlines()[0]
    assert first.startswith("error: Training diverged at step ")
    fix = err[err.index("meshplan train ") :].strip().rstrip(".")
    resume_at = int(fix.split("--resume-step ")[1].split()[0])
    losses = {
        r["step"]: r["loss"]
        for r in map(json.loads, metrics.read_text().splitlines())
        if "loss" in r
    }
    saved = complete_steps(folder)
    assert resume_at in saved

    def running_median(step: int) -> float:
        return float(np.median([v for k, v in losses.items() if k <= step]))

    # Its state then gave a loss at or below the running median ...
    assert losses[resume_at + 1] <= running_median(resume_at + 1)
    # ... and every later saved step's did not (they are named as passed over).
    later = [s for s in saved if s > resume_at]
    assert later, "the run should have saved steps while its loss climbed"
    joined = " ".join(err.split())
    assert f"Resume from step {resume_at}: " in joined
    for s in later:
        measured = s + 1 if s + 1 in losses else s
        assert losses[measured] > running_median(measured), s
        assert f"step {s} (" in joined
