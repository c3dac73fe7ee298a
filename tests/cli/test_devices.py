"""Which devices a command runs on (meshplan.cli.devices.choose_devices), with fake device lists:
an accelerator present or not, the CPU asked for, too few devices for the mesh."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import meshplan
from meshplan.cli.devices import DeviceChoice, choose_devices, found_devices


def _devices(platform: str, kind: str, count: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(platform=platform, device_kind=kind, id=i) for i in range(count)]


GPUS = _devices("gpu", "NVIDIA H200", 1)
TPUS = _devices("tpu", "TPU v5 lite", 4)
CPUS = _devices("cpu", "cpu", 8)


def test_an_accelerator_present_is_used():
    choice = choose_devices(GPUS, CPUS)
    assert choice == DeviceChoice(tuple(GPUS), "gpu", "NVIDIA H200", False, "found")
    assert choice.describe() == "devices: 1 NVIDIA H200 (platform gpu)"
    assert choose_devices(TPUS, CPUS, needed=4, mesh="2x2").describe() == (
        "devices: 4 TPU v5 lite (platform tpu)"
    )
    assert choose_devices(GPUS, CPUS, platform="gpu").platform == "gpu"


def test_no_accelerator_emulates_cpu_devices():
    choice = choose_devices([], CPUS, needed=8, mesh="2x4")
    assert choice.emulated and choice.platform == "cpu" and choice.count == 8
    assert choice.describe() == (
        "devices: no accelerator found, so 8 emulated CPU devices (platform cpu)"
    )
    limited = choose_devices([], CPUS, jax_platforms="cpu")
    assert "JAX_PLATFORMS=cpu leaves accelerators out" in limited.describe()


def test_the_cpu_asked_for_is_used_even_with_an_accelerator():
    choice = choose_devices(GPUS, CPUS, platform="cpu", needed=8, mesh="2x4")
    assert choice.emulated and choice.devices == tuple(CPUS)
    assert "--platform cpu asks for the CPU" in choice.describe()


def test_an_accelerator_asked_for_but_absent_is_refused():
    with pytest.raises(meshplan.MeshError) as e:
        choose_devices([], CPUS, platform="gpu")
    message = str(e.value)
    assert (
        "--platform gpu: JAX found no GPU on this machine (it sees only 8 CPU devices)" in message
    )
    assert "pip install 'jax[cuda12]'" in message and "--platform cpu" in message
    with pytest.raises(meshplan.MeshError, match=r"JAX found no TPU .*it sees 1 gpu device"):
        choose_devices(GPUS, CPUS, platform="tpu")
    with pytest.raises(meshplan.MeshError, match="--platform 'ipu' is not one of auto, cpu"):
        choose_devices(GPUS, CPUS, platform="ipu")


def test_too_few_devices_are_refused_with_the_numbers_and_the_fix():
    with pytest.raises(meshplan.MeshError) as e:
        choose_devices(GPUS, CPUS, needed=8, mesh="2x4")
    assert str(e.value) == (
        "The mesh 2x4 needs 8 devices, but there are only 1 (NVIDIA H200, platform gpu).\n"
        "Use a smaller mesh: at most 1 devices (e.g. --mesh 1x1), or pass --platform cpu "
        "--devices 8 to emulate 8 CPU devices."
    )
    with pytest.raises(meshplan.MeshError) as e:
        choose_devices([], CPUS, needed=16, mesh="2x8")
    assert "The mesh 2x8 needs 16 devices, but there are only 8 (emulated CPU devices)" in str(
        e.value
    )
    assert "Use a smaller mesh, or pass --devices 16" in str(e.value)
    with pytest.raises(meshplan.MeshError, match="Pass --platform cpu to run on 8 emulated"):
        choose_devices(GPUS, CPUS, needed=8)  # meshplan demo: its own 2x4 mesh


def test_found_devices_on_this_machine_are_the_test_suites_cpu_devices():
    choice = found_devices()  # the test suite sets JAX_PLATFORMS=cpu and 8 CPU devices
    assert choice.emulated and choice.count == 8
    assert choice.describe().startswith("devices: JAX_PLATFORMS=cpu leaves accelerators out, so 8")


@pytest.mark.slow
def test_train_says_what_it_runs_on(tmp_path, capsys):
    from meshplan.cli import main

    args = [
        "train",
        "--steps",
        "3",
        "--batch",
        "8",
        "--seq",
        "16",
        "--layers",
        "1",
        "--embed",
        "32",
        "--mlp",
        "64",
        "--max-len",
        "64",
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--data",
        __file__,
    ]
    assert main([*args, "--platform", "cpu", "--mesh", "2x4"]) == 0
    out = capsys.readouterr().out
    assert "devices: --platform cpu asks for the CPU, so 8 emulated CPU devices (platform cpu)" in (
        " ".join(out.split())
    )
    assert main([*args, "--mesh", "4x4"]) == 2
    err = capsys.readouterr().err
    # (the test session's XLA_FLAGS set the count, so the fix names them)
    assert "The mesh 4x4 needs 16 devices, but there are only 8 (emulated CPU devices" in err


def test_when_xla_flags_set_the_count_the_fix_names_xla_flags_not_devices():
    with pytest.raises(meshplan.MeshError) as e:
        choose_devices([], CPUS, needed=16, mesh="2x8", xla_flags_count=True)
    message = str(e.value)
    assert "only 8 (emulated CPU devices, set by XLA_FLAGS)" in message
    assert "Use a mesh of 8 devices (e.g. --mesh 2x4)" in message and "--devices" not in message
