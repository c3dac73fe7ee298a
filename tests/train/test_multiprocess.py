"""``meshplan train`` over several real processes: ``jax.distributed`` over loopback, Gloo
collectives between CPU processes, checkpoints written by all of them.

Two worker processes of 4 emulated CPU devices each make the same 2x4 mesh as
one process of 8 devices, so they must compute the same losses; a checkpoint
written by two processes restores in one and the other way round; and a worker
that dies stops the run with a message instead of leaving the others waiting.
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

import numpy as np
import pytest

import meshplan
from meshplan.cli import main
from meshplan.cli.train import TrainRequest, prepare
from meshplan.cli.train.launch import free_port, worker_env

TINY = ["--layers", "1", "--embed", "32", "--mlp", "64", "--max-len", "64"]
FAST = ["--batch", "8", "--seq", "16", "--eval-batches", "2", "--eval-every", "2"]
_TRAIN = [sys.executable, "-m", "meshplan.cli", "train"]
OVERRIDES = {"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "max_len": 64}
SETTINGS = {"batch": 8, "seq_len": 16, "eval_batches": 2, "eval_every": 2, "ckpt_every": 2}


def _metrics(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    """Train and validation losses by step, from a --metrics file."""
    losses, evals = {}, {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record:
            losses[record["step"]] = record["loss"]
        else:
            evals[record["step"]] = record["valid_loss"]
    return losses, evals


def _train(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*_TRAIN, *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """6 steps in this (single) process on 2x4 with fsdp_tp, saved at steps 2, 4 and 6."""
    folder = tmp_path_factory.mktemp("one") / "run"
    request = TrainRequest(
        mesh="2x4",
        rules="fsdp_tp",
        overrides=OVERRIDES,
        ckpt_dir=str(folder),
        settings={**SETTINGS, "steps": 6},
    )
    trainer = prepare(request)
    result = trainer.run()
    trainer.close()
    return folder, result


def _assert_close(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) < 1e-4, (step, got[step], want[step])


@pytest.mark.slow
def test_two_processes_match_one_and_their_checkpoint_resumes_in_one(one_process, tmp_path, capsys):
    folder, reference = one_process
    run, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    proc = _train(
        "--processes",
        "2",
        "--steps",
        "4",
        "--ckpt-every",
        "2",
        *FAST,
        *TINY,
        "--ckpt-dir",
        str(run),
        "--metrics",
        str(metrics),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "meshplan train: 2 processes on this machine, 4 CPU devices each" in out
    assert "processes: 2 (coordinator 127.0.0.1:" in out
    # Only process 0 prints: one header, one progress bar, one summary; no Gloo chatter.
    assert out.count("on a 2x4 mesh ('data', 'model') with layout fsdp_tp") == 1
    assert out.count("Summary") == 1 and "4/4" in out and "(latest step 4)" in out
    assert "[Gloo]" not in out + proc.stderr

    losses, evals = _metrics(metrics)
    assert sorted(losses) == [1, 2, 3, 4] and sorted(evals) == [0, 2, 4]
    _assert_close(losses, reference.losses, range(1, 5))
    _assert_close(evals, reference.evals, (0, 2, 4))

    # Saved by two processes, restored by one: the same arrays as one process saved.
    two = meshplan.restore(run)
    one = meshplan.restore(folder, step=4)
    assert two.metadata.step == 4 and two.metadata.mesh_shape == {"data": 2, "model": 4}
    for key, value in one.arrays().items():
        np.testing.assert_allclose(np.asarray(two.arrays()[key]), np.asarray(value), atol=1e-5)

    # ... and one process (this one) resumes it, with the losses of the uninterrupted run.
    resumed = tmp_path / "resumed.jsonl"
    args = ["--resume", "--ckpt-dir", str(run), "--steps", "6", "--metrics", str(resumed)]
    assert main(["train", *args]) == 0
    out = capsys.readouterr().out
    assert f"resuming from step 4 of {run} (saved on 2x4 with fsdp_tp by 2 processes)" in out
    losses, _ = _metrics(resumed)
    assert sorted(losses) == [5, 6]
    _assert_close(losses, reference.losses, (5, 6))


@pytest.mark.slow
def test_a_one_process_checkpoint_resumes_in_two(one_process, tmp_path):
    folder, reference = one_process
    run, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    shutil.copytree(folder, run)
    shutil.rmtree(run / "6")  # resume from step 4
    proc = _train(
        "--processes",
        "2",
        "--resume",
        "--ckpt-dir",
        str(run),
        "--steps",
        "6",
        "--metrics",
        str(metrics),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from step 4 of {run} (saved on 2x4 with fsdp_tp)" in proc.stdout
    assert "4 -> 6" in proc.stdout
    losses, _ = _metrics(metrics)
    assert sorted(losses) == [5, 6]
    _assert_close(losses, reference.losses, (5, 6))
    assert meshplan.restore(run).metadata.step == 6


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, with their command lines."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        cmdline = _cmdline(int(entry.name))
        if parent == pid and cmdline is not None:
            out[int(entry.name)] = cmdline
    return out


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the workers through /proc")
def test_a_killed_worker_stops_the_run_with_a_message(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    out_log, err_log = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with open(out_log, "wb") as out, open(err_log, "wb") as errs:  # files cannot fill and block
        launcher = subprocess.Popen(
            [
                *_TRAIN,
                "--processes",
                "2",
                "--steps",
                "100000",
                "--eval-every",
                "0",
                *FAST,
                *TINY,
                "--metrics",
                str(metrics),
            ],
            stdout=out,
            stderr=errs,
            stdin=subprocess.DEVNULL,
        )
    workers: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and launcher.poll() is None:
            if metrics.exists() and '"loss"' in metrics.read_text():
                break  # both workers are training
            time.sleep(0.2)
        workers = _children(launcher.pid)
        assert len(workers) == 2, workers
        victim = next(pid for pid, cmd in workers.items() if "--process-id 1" in cmd)
        os.kill(victim, signal.SIGKILL)
        launcher.wait(timeout=60)
    finally:
        if launcher.poll() is None:  # its workers die with it (PR_SET_PDEATHSIG)
            launcher.kill()
            launcher.wait()
        for pid, cmd in workers.items():  # nothing may be left behind, whatever happened
            if _cmdline(pid) == cmd:
                os.kill(pid, signal.SIGKILL)
    assert launcher.returncode != 0
    err = err_log.read_text()
    assert (
        "error: worker process 1 of 2 was killed by SIGKILL; stopped the other (process 0)" in err
    )
    assert "continue it from the latest complete checkpoint with --resume" in err
    assert not _children(launcher.pid)


# ---------------------------------------------------------------------------
# Processes that never meet: every one says so and exits, well before JAX would abort
# ---------------------------------------------------------------------------


def _alone(process_id: int, timeout: int = 5) -> subprocess.Popen[str]:
    """One process of a 2-process run whose other process never comes."""
    return subprocess.Popen(
        [
            *_TRAIN,
            "--coordinator",
            f"127.0.0.1:{free_port()}",
            "--num-processes",
            "2",
            "--process-id",
            str(process_id),
            "--devices",
            "4",
            "--init-timeout",
            str(timeout),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=worker_env(4),
    )


def _ended(proc: subprocess.Popen[str], within: float) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=within)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


@pytest.mark.slow
def test_a_process_whose_peer_never_comes_says_who_and_exits():
    start = time.monotonic()
    zero, one = _alone(0), _alone(1)  # each on its own port: each waits alone
    (code0, err0), (code1, err1) = _ended(zero, 20), _ended(one, 20)
    assert time.monotonic() - start < 20
    assert code0 == 2 and code1 == 2, (err0, err1)  # JAX's C++ abort would be 134
    assert "waiting for 1 of 2 processes (coordinator 127.0.0.1:" in err0
    assert "error: Process 1 of 2 never joined the run at the coordinator 127.0.0.1:" in err0
    assert "within 5 s" in err0 and "firewall" in err0 and "--init-timeout" in err0
    assert "waiting for the coordinator 127.0.0.1:" in err1
    assert "error: Process 1 of 2 could not meet process 0 at the coordinator" in err1
    assert "Start process 0 (--process-id 0)" in err1
    for err in (err0, err1):
        assert "Traceback" not in err and "client.h" not in err and "Terminating" not in err


@pytest.mark.slow
def test_a_jax_start_that_hangs_ends_with_our_error_not_jax_abort():
    """Process 0 (played here) lets process 1 go, then never starts JAX's service."""
    import json
    import socket
    import threading

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]

        def play_process_0() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(json.dumps({"go": True}).encode() + b"\n")
                conn.recv(1024)  # process 1 hangs up first

        threading.Thread(target=play_process_0, daemon=True).start()
        start = time.monotonic()
        proc = subprocess.Popen(
            [
                *_TRAIN,
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                "1",
                "--devices",
                "4",
                "--init-timeout",
                "4",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=worker_env(4),
        )
        code, err = _ended(proc, 25)
    assert time.monotonic() - start < 18  # JAX itself would abort at 4 + 15 s
    assert code == 2, err
    assert "error: All 2 processes met at the coordinator 127.0.0.1:" in err
    assert "jax.distributed.initialize did not finish within 4 s (this is process 1)" in err
    assert "client.h" not in err and "Traceback" not in err


# ---------------------------------------------------------------------------
# Flags that do not fit: refused before any process starts
# ---------------------------------------------------------------------------


_AS_PROCESS_1 = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--processes", "3"], "--devices 8 does not split over --processes 3"),
        (["--processes", "2", "--process-id", "1"], "--process-id are for running one process"),
        (["--processes", "2", "--process-id", "0"], "--process-id are for running one process"),
        (["--coordinator", "127.0.0.1:1"], "--num-processes is missing"),
        (
            ["--coordinator", "nohost", "--num-processes", "2", "--process-id", "2"],
            "--process-id 2 is not in 0..1",
        ),
        (["--init-timeout", "5"], "--init-timeout 5 is for a run of several processes"),
        (["--processes", "2", "--init-timeout", "0"], "--init-timeout must be a positive number"),
        (
            [*_AS_PROCESS_1, "--init-timeout", "nan"],
            "--init-timeout must be a positive number of seconds, got nan",
        ),
    ],
    ids=[
        "devices",
        "both-ways",
        "both-ways-id-0",
        "missing",
        "bad-values",
        "init-timeout-alone",
        "init-timeout-zero",
        "init-timeout-nan",
    ],
)
def test_multiprocess_flags_that_do_not_fit(capsys, args, expected):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and expected in err
    assert "Traceback" not in err


def test_workers_get_every_flag_but_the_process_ones():
    from meshplan.cli import build_parser
    from meshplan.cli.train.processes import worker_argv

    given = [
        "--mesh",
        "4x2",
        "--rules",
        "fsdp",
        "--data",
        "/d",
        "--ckpt-dir",
        "/c",
        "--resume",
        "--metrics",
        "/m",
        "--steps",
        "9",
        "--batch",
        "16",
        "--seq",
        "32",
        "--lr",
        "0.001",
        "--warmup",
        "3",
        "--weight-decay",
        "0.1",
        "--seed",
        "5",
        "--eval-every",
        "4",
        "--eval-batches",
        "3",
        "--ckpt-every",
        "2",
        "--size",
        "small",
        "--layers",
        "3",
        "--heads",
        "2",
        "--embed",
        "48",
        "--mlp",
        "96",
        "--max-len",
        "80",
        "--positions",
        "learned",
        "--dtype",
        "bfloat16",
        "--no-scan",
        "--remat",
        "--init-timeout",
        "7.5",
        "--resume-step",
        "4",
        "--keep",
        "2",
        "--clip",
        "0.5",
    ]
    parser = build_parser()
    launched = parser.parse_args(["train", *given, "--processes", "2", "--devices", "4"])
    worker = parser.parse_args(["train", *worker_argv(launched)])
    different = {
        k for k, v in vars(parser.parse_args(["train", *given])).items() if vars(worker)[k] != v
    }
    assert not different
