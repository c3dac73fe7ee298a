"""Model FLOPs per step against XLA's count, the base config's size, the peaks table, MFU."""

from __future__ import annotations

import jax
import pytest

from meshplan.cli.train import TrainRequest, prepare
from meshplan.models.transformer import CONFIGS, parameter_count, train_flops
from meshplan.train.flops import PEAKS, measure_cpu_peak, mesh_peak, peak_of


def _xla_flops(trainer) -> float:
    trainer.start()
    batch = trainer.batches("train", 0)
    trainer._compile(batch)
    with trainer.active():
        cost = trainer._train_step.lower(trainer.state, batch).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["flops"])


@pytest.mark.parametrize(
    ("embed", "mlp", "seq"), [(256, 1024, 64), (128, 512, 128)], ids=["mlp-heavy", "attention"]
)
@pytest.mark.slow
def test_model_flops_match_xla_cost_analysis_within_10_percent(embed, mlp, seq):
    # Blocks unrolled (no nn.scan): XLA's cost analysis counts a while loop's body once.
    over = {
        "num_layers": 2,
        "embed_dim": embed,
        "mlp_dim": mlp,
        "num_heads": 4,
        "max_len": seq,
        "scan_layers": False,
    }
    trainer = prepare(
        TrainRequest(
            mesh="1x1",
            rules="data_parallel",
            overrides=over,
            settings={"batch": 8, "seq_len": seq, "eval_every": 0},
        )
    )
    ours = train_flops(CONFIGS["tiny"].__class__(**{**CONFIGS["tiny"].to_dict(), **over}), 8, seq)
    assert trainer.flops_per_step == ours
    xla = _xla_flops(trainer)
    assert abs(ours / xla - 1) < 0.10, (ours, xla)


def test_base_config_has_100_to_150_million_parameters():
    config = CONFIGS["base"]
    shapes = jax.eval_shape(
        lambda: (
            __import__("meshplan.models.transformer", fromlist=["Transformer"])
            .Transformer(config)
            .init(jax.random.key(0), jax.numpy.zeros((1, 16), jax.numpy.int32))
        )
    )
    counted = sum(x.size for x in jax.tree.leaves(shapes))
    assert counted == parameter_count(config) == 126_396_416
    assert 100e6 <= counted <= 150e6
    assert config.head_dim == 64


def test_base_brings_a_batch_that_keeps_a_gpu_busy():
    from meshplan.cli.train.builtin_source import BuiltInSource
    from meshplan.cli.train.findings import Findings
    from meshplan.cli.train.prepare import resolve_settings

    def settings_of(request):
        return resolve_settings(request, None, Findings(), preset=BuiltInSource().preset(request))

    settings = settings_of(TrainRequest(config="base"))
    assert (settings.batch, settings.seq_len) == (32, 1024)
    given = settings_of(TrainRequest(config="base", settings={"batch": 8}))
    assert given.batch == 8  # what the user gives wins


def test_every_peak_has_a_source_and_the_common_kinds_match():
    assert all(p.source and p.bfloat16 > 0 for p in PEAKS)
    kinds = {
        "NVIDIA H100 80GB HBM3": "NVIDIA H100 SXM",
        "NVIDIA H100 PCIe": "NVIDIA H100 PCIe",
        "NVIDIA H200": "NVIDIA H200",
        "NVIDIA A100-SXM4-80GB": "NVIDIA A100",
        "TPU v4": "TPU v4",
        "TPU v5 lite": "TPU v5e",
        "TPU v5p": "TPU v5p",
        "TPU v5": "TPU v5p",
        "TPU v6 lite": "TPU v6e (Trillium)",
    }
    for kind, name in kinds.items():
        assert peak_of(kind) is not None and peak_of(kind).name == name, kind
    assert peak_of("NVIDIA GeForce RTX 3090") is None


def test_mfu_is_left_out_for_an_unknown_device_and_says_why():
    peak = mesh_peak("gpu", "Mystery Accelerator", 2, "bfloat16")
    assert peak.flops is None and peak.why.startswith("no peak FLOP/s is known for Mystery")
    tpu32 = mesh_peak("tpu", "TPU v4", 4, "float32")
    assert tpu32.flops is None and tpu32.why.startswith("TPU v4 publishes no float32 peak")
    assert (tpu32.code, tpu32.device, tpu32.dtype) == ("peak-unknown-dtype", "TPU v4", "float32")
    assert "dtype='bfloat16'" in tpu32.fix  # the command line says it in flags


def test_the_cpu_peak_is_measured_and_labelled():
    measured = measure_cpu_peak("float32")
    assert 1e8 < measured < 1e14
    peak = mesh_peak("cpu", "cpu", 8, "float32")
    assert peak.flops == measured and "measured CPU peak" in peak.label
    assert "not a hardware figure" in peak.label


@pytest.mark.slow
def test_a_run_reports_mfu_step_times_and_tokens_per_second():
    trainer = prepare(
        TrainRequest(
            mesh="2x4",
            overrides={"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "max_len": 64},
            settings={"steps": 6, "batch": 8, "seq_len": 32, "eval_every": 0, "eval_batches": 1},
        )
    )
    trainer.peak_flops_per_s = 1e9
    records = []
    result = trainer.run(on_step=records.append)
    assert [r.step for r in records] == [1, 2, 3, 4, 5, 6]
    assert records[0].step_time_s is None  # the step that compiled
    timed = records[1:]
    assert all(r.step_time_s > 0 and r.tokens_per_s > 0 and r.mfu > 0 for r in timed)
    assert timed[0].mfu == pytest.approx(trainer.flops_per_step / timed[0].step_time_s / 1e9)
    assert sorted(result.step_times) == [2, 3, 4, 5, 6]
    assert result.mfu == pytest.approx(trainer.flops_per_step / result.step_time_s / 1e9)
    assert set(records[1].to_dict()) == {"step", "loss", "step_time_s", "tokens_per_s", "mfu"}
