"""One table of chips: the planner's profiles and MFU's peaks read the same figures."""

from __future__ import annotations

import dataclasses

import pytest

import meshplan
from meshplan._search.measure.cpu import cpu_devices
from meshplan._search.predict.chips import CHIPS, chip_of
from meshplan._search.predict.profiles import BACKENDS, PROFILES, calibrate_cpu
from meshplan.train.flops import PEAKS, measure_cpu_peak, mesh_peak, peak_of

# Each published profile and the chip it is built from.
CHIP_OF_PROFILE = {
    "a100": "a100",
    "h100": "h100",
    "h100_a3": "h100",
    "h200": "h200",
    "b200": "b200",
    "tpu_v4": "tpu_v4",
    "tpu_v5e": "tpu_v5e",
    "tpu_v5p": "tpu_v5p",
    "tpu_v6e": "tpu_v6e",
}


def test_every_profile_takes_its_chips_figures_and_mfu_reads_the_same_chips():
    assert set(CHIP_OF_PROFILE) == set(PROFILES)
    for name, profile in PROFILES.items():
        chip = CHIPS[CHIP_OF_PROFILE[name]]
        figures = (profile.peak_flops, profile.memory_bytes, profile.memory_bandwidth)
        usable = chip.usable_bytes or chip.memory_bytes
        assert figures == (chip.bfloat16, usable, chip.memory_bandwidth), name
        assert profile.fast_bandwidth == chip.link_bandwidth, name
        assert peak_of(chip.name) is chip  # MFU finds the very entry by its maker's name
    assert tuple(CHIPS.values()) == PEAKS
    h200 = mesh_peak("gpu", "NVIDIA H200", 8, "bfloat16")
    assert h200.flops == 8 * PROFILES["h200"].peak_flops


def test_the_b200_has_a_peak_for_mfu_and_the_pcie_h100_is_not_taken_for_the_sxm():
    assert chip_of("NVIDIA B200").name == "NVIDIA B200"
    assert mesh_peak("gpu", "NVIDIA B200", 8, "float32").flops == 8 * 1100e12
    assert chip_of("NVIDIA H100 PCIe").bfloat16 < chip_of("NVIDIA H100 80GB HBM3").bfloat16


def test_a_profile_is_built_with_keywords_only():
    with pytest.raises(TypeError, match="positional"):
        meshplan.HardwareProfile("x", 1e12, 8e9, 1e12, 1e11, 1e10, 8, 1e-5)
    mine = meshplan.HardwareProfile(
        name="mine",
        peak_flops=1e12,
        memory_bytes=8 * 10**9,
        memory_bandwidth=1e12,
        fast_bandwidth=1e11,
        slow_bandwidth=1e10,
        domain_devices=8,
        latency_s=1e-5,
    )
    assert mine.slow_latency_s == 1e-5 and not mine.fused_attention


def test_each_profile_does_what_its_backend_does():
    backend_of = {name: "tpu" if name.startswith("tpu") else "gpu" for name in PROFILES}
    for name, profile in PROFILES.items():
        for field, value in BACKENDS[backend_of[name]].items():
            assert getattr(profile, field) == value, (name, field)
    cpu = calibrate_cpu(8)
    assert {f: getattr(cpu, f) for f in BACKENDS["cpu"]} == BACKENDS["cpu"]
    assert dataclasses.asdict(cpu)["fused_attention"] is False


def test_mfu_on_cpu_reads_the_cpu_profiles_measurement():
    n = len(cpu_devices(64))
    assert measure_cpu_peak("float32") == n * calibrate_cpu(n).peak_flops
    peak = mesh_peak("cpu", "cpu", 2, "float32")
    assert peak.flops == n * calibrate_cpu(n).peak_flops


def test_a_tpu_budget_is_what_jax_lets_a_program_use_not_the_datasheets_memory():
    v5e = PROFILES["tpu_v5e"]
    assert v5e.memory_bytes == 16_909_336_064 < CHIPS["tpu_v5e"].memory_bytes == 16 * 2**30
    assert PROFILES["h100"].memory_bytes == CHIPS["h100"].memory_bytes  # not measured
