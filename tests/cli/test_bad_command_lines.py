"""Bad command lines that used to give a traceback, a hang or a silent wrong result (issue 8).

Each gives one ``error: ...`` line naming the value and the fix, before any work, or a
correct result.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

import meshplan
from child_env import fresh_env
from meshplan import cli
from meshplan.cli.app import build_parser
from meshplan.cli.devices import MAX_CPU_DEVICES, check_device_count, use_cpu_devices

_CLI = [sys.executable, "-m", "meshplan.cli"]
_FLAG = "--xla_force_host_platform_device_count"


def _fresh_env(**extra: str) -> dict[str, str]:
    """The environment of a fresh process that sets its own device count."""
    return fresh_env("JAX_PLATFORMS", **extra)


def _refused(args: list[str], capsys) -> str:
    """Runs ``meshplan ARGS`` in this process; it must exit 2 with one error and no traceback."""
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


# -- abbreviations -----------------------------------------------------------------


def _long_options() -> list[tuple[str, str, str]]:
    """``(command, option, abbreviation)`` for every long option of every command."""
    found = []
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for command, sub in commands.choices.items():
        options = {o for action in sub._actions for o in action.option_strings}
        for option in sorted(options):
            short = option[:-1]
            if option.startswith("--") and len(short) > 3 and short not in options:
                found.append((command, option, short))
    return found


@pytest.mark.parametrize(("command", "option", "short"), _long_options())
def test_no_option_is_taken_from_an_abbreviation(capsys, command, option, short):
    required = ["--ckpt-dir", "x"] if command == "sample" and option != "--ckpt-dir" else []
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([command, *required, short, "1"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        f"unrecognized arguments: {short}" in err
        or f"the following arguments are required: {option}" in err
    ), err


def test_train_step_is_not_steps(capsys):
    # `--step 15` used to run 15 steps (an abbreviation of --steps).
    with pytest.raises(SystemExit):
        cli.main(["train", "--step", "15"])
    assert "unrecognized arguments: --step 15" in capsys.readouterr().err


# -- emulated device counts ----------------------------------------------------------


@pytest.mark.parametrize("count", [0, -3, MAX_CPU_DEVICES + 1, 100_000])
def test_device_counts_out_of_range_are_refused(count):
    with pytest.raises(meshplan.MeshError) as info:
        check_device_count(count)
    message = str(info.value)
    assert message.startswith(f"--devices {count}: ")
    assert f"Pass --devices N with N from 1 to {MAX_CPU_DEVICES}" in message or (
        f"Pass --devices {MAX_CPU_DEVICES} or fewer" in message and "takes longer" in message
    )


def test_use_cpu_devices_sets_xla_flags_once(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    use_cpu_devices(16)
    assert os.environ["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {_FLAG}=16"
    assert os.environ["JAX_PLATFORMS"] == "cpu"
    use_cpu_devices(16)  # asked again: the same flags
    assert os.environ["XLA_FLAGS"].count(_FLAG) == 1


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (f"{_FLAG}=4", "XLA_FLAGS already asks for 4 emulated CPU devices"),
        (f"{_FLAG}=lots", "XLA_FLAGS already asks for 'lots' emulated CPU devices"),
    ],
)
def test_xla_flags_forcing_another_count_are_named(monkeypatch, flags, fragment):
    monkeypatch.setenv("XLA_FLAGS", flags)
    with pytest.raises(meshplan.MeshError) as info:
        use_cpu_devices(8)
    message = str(info.value)
    assert fragment in message and "but --devices asks for 8" in message
    assert f"Remove {_FLAG} from XLA_FLAGS" in message and "or set it to 8" in message
    assert os.environ["XLA_FLAGS"] == flags  # untouched


def test_train_refuses_bad_device_counts_before_jax_starts(capsys):
    # (in this process JAX runs with the test suite's 8 devices, set by XLA_FLAGS)
    assert "--devices 0: the number of emulated CPU devices must be at least 1" in _refused(
        ["train", "--devices", "0"], capsys
    )
    started = time.monotonic()
    err = _refused(["train", "--devices", "100000", "--mesh", "8"], capsys)
    assert time.monotonic() - started < 5
    assert f"meshplan emulates at most {MAX_CPU_DEVICES} CPU devices" in err
    err = _refused(["train", "--devices", "4"], capsys)
    assert "XLA_FLAGS already asks for 8 emulated CPU devices" in err
    assert "but --devices asks for 4" in err and "or pass --devices 8" in err


@pytest.mark.slow
def test_xla_flags_that_force_another_count_in_a_fresh_process():
    proc = subprocess.run(
        [*_CLI, "train", "--devices", "8", "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=_fresh_env(XLA_FLAGS=f"{_FLAG}=4"),
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error: XLA_FLAGS already asks for 4 emulated CPU devices")
    assert "Traceback" not in proc.stderr


# -- plan and search -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["--model", "transformer", "--size", "huge"],
            ["--size 'huge' is not a Transformer preset", "Pass --size tiny or --size small"],
        ),
        (
            ["--model", "mlp", "--depth", "0"],
            ["--depth 0: the MLP's width must be at least 1", "--depth N"],
        ),
        (
            ["--model", "mlp", "--layers", "-1"],
            ["--layers -1: the MLP needs at least 1 layer", "--layers N"],
        ),
    ],
    ids=["size", "depth", "layers"],
)
@pytest.mark.parametrize("command", ["plan", "search"])
def test_model_flags_out_of_range(capsys, command, args, fragments):
    err = _refused([command, *args], capsys)
    assert all(fragment in err for fragment in fragments), err


@pytest.mark.parametrize("top_k", ["-3", "0"])
def test_search_refuses_a_top_k_below_1(capsys, top_k):
    # --top-k -3 used to measure 11 of 14 candidates (a slice [:-3]).
    err = _refused(["search", "--measure", "--top-k", top_k], capsys)
    assert f"--top-k {top_k}: --devices, --batch and --top-k must be at least 1" in err


def test_search_measure_refuses_too_many_devices(capsys):
    err = _refused(["search", "--measure", "--devices", "100000"], capsys)
    assert "meshplan emulates at most" in err


# -- sample --------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_sample_refuses_a_temperature_that_is_not_finite_and_non_negative(tmp_path, capsys, value):
    # nan used to print NUL bytes with exit 0. Refused before the checkpoint is read.
    args = ["sample", "--ckpt-dir", str(tmp_path / "none"), "--temperature", value]
    err = _refused(args, capsys)
    assert f"--temperature {float(value)}: the temperature must be a finite number >= 0" in err


def test_sample_refuses_a_negative_length(tmp_path, capsys):
    err = _refused(["sample", "--ckpt-dir", str(tmp_path), "--length", "-2"], capsys)
    assert "--length -2: the number of bytes to generate must be >= 0" in err


@pytest.fixture(scope="module")
def untrained_checkpoint(tmp_path_factory):
    """A checkpoint of a tiny untrained Transformer, as `meshplan sample` reads it."""
    import jax
    import jax.numpy as jnp

    from meshplan.models.transformer import Transformer, config_from_name

    config = config_from_name("tiny", num_layers=1, embed_dim=16, mlp_dim=16, max_len=16)
    params = Transformer(config).init(jax.random.key(0), jnp.zeros((1, 16), jnp.int32))["params"]
    folder = tmp_path_factory.mktemp("sample") / "run"
    with meshplan.Checkpointer(folder, async_save=False) as checkpointer:
        checkpointer.save(1, {"params": params}, config=config.to_dict())
    return folder


@pytest.mark.slow
def test_sample_takes_a_prompt_that_is_not_utf8(untrained_checkpoint):
    # Bytes from the command line that are not UTF-8 used to raise UnicodeEncodeError.
    args = [os.fsencode(a) for a in [*_CLI, "sample", "--ckpt-dir", str(untrained_checkpoint)]]
    proc = subprocess.run(
        [*args, b"--prompt", b"\xff\xfe abc", b"--length", b"3", b"--temperature", b"0"],
        capture_output=True,
        timeout=120,
        check=False,
        env=_fresh_env(),
    )
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    last = proc.stdout.decode("utf-8").splitlines()[-1]
    assert last.startswith("\ufffd\ufffd abc")  # the prompt as typed, then 3 bytes
    # A terminal that cannot show them (ASCII output) gets '?' in their place, not a traceback.
    ascii_out = subprocess.run(
        [*args, b"--prompt", b"\xff\xfe abc", b"--length", b"3", b"--temperature", b"0"],
        capture_output=True,
        timeout=120,
        check=False,
        env={**_fresh_env(), "PYTHONIOENCODING": "ascii"},
    )
    assert ascii_out.returncode == 0, ascii_out.stderr.decode(errors="replace")
    assert ascii_out.stdout.decode("ascii").splitlines()[-1].startswith("?? abc")


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["plan", "--size", "huge"], "--size is a flag of the Transformers, not of --model mlp"),
        (["plan", "--model", "transformer", "--layers", "-1"], "--layers is a flag of the MLP"),
        (
            ["search", "--model", "transformer", "--depth", "8", "--scan"],
            "--depth, --scan are flags",
        ),
    ],
)
def test_a_flag_of_the_other_model_is_refused_not_ignored(argv, fragment, capsys):
    from meshplan.cli import main

    assert main(argv) == 2
    assert fragment in capsys.readouterr().err


def test_an_unknown_option_shows_the_commands_usage_and_the_nearest_options(capsys):
    from meshplan.cli import main

    with pytest.raises(SystemExit) as info:
        main(["train", "--resume", "--step", "15"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: meshplan train")
    assert "unrecognized arguments: --step 15 (did you mean --steps or --resume-step?)" in err


@pytest.mark.slow
def test_when_xla_flags_set_the_device_count_the_advice_does_not_loop(tmp_path):
    """XLA_FLAGS forces 4 devices: each message's fix must work, not point back to --devices 8."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    env.pop("JAX_PLATFORMS", None)

    def train(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "meshplan.cli", "train", "--platform", "cpu", *flags],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
        )

    first = train("--devices", "8")
    assert (
        first.returncode == 2
        and "pass --devices 4 with a mesh of 4 devices (e.g. --mesh 2x2)" in first.stderr
    )
    second = train("--devices", "4")
    assert second.returncode == 2
    assert "Use a mesh of 4 devices (e.g. --mesh 2x2)" in second.stderr
    assert "--devices 8" not in second.stderr
