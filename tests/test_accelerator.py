"""Checks that need an accelerator (marked ``accelerator``; skipped without one).

``benchmarks/accelerator_check.sh`` runs them on a GPU machine with
``JAX_PLATFORMS=`` (empty: every platform), since the test suite's conftest
otherwise sets ``JAX_PLATFORMS=cpu``. Without pytest there,
``python tests/test_accelerator.py`` runs them too.
"""

from __future__ import annotations

import tempfile

import jax
import jax.numpy as jnp

try:
    import pytest
except ImportError:  # run as a script: python tests/test_accelerator.py
    pytest = None  # type: ignore[assignment]


def _on_accelerator() -> bool:
    return jax.default_backend() != "cpu"


def _marks(test):  # type: ignore[no-untyped-def]
    if pytest is None:
        return test
    test = pytest.mark.accelerator(test)
    return pytest.mark.skipif(not _on_accelerator(), reason="no accelerator")(test)


@_marks
def test_device_selection_picks_the_accelerator():
    from meshplan.cli.devices import found_devices
    from meshplan.train.flops import mesh_peak

    choice = found_devices()
    device = jax.devices()[0]
    assert not choice.emulated and choice.platform == device.platform != "cpu"
    assert choice.kind == device.device_kind and choice.count == jax.device_count()
    peak = mesh_peak(choice.platform, choice.kind, 1, "bfloat16")
    print(choice.describe(), "|", peak.label or peak.why)


@_marks
def test_a_bfloat16_step_keeps_float32_parameters_and_optimizer_state():
    from meshplan.cli.devices import found_devices
    from meshplan.cli.train import TrainRequest, prepare

    with tempfile.TemporaryDirectory() as folder:
        trainer = prepare(
            TrainRequest(
                mesh="1x1",
                overrides={"dtype": "bfloat16", "num_layers": 2},
                settings={
                    "steps": 3,
                    "batch": 8,
                    "seq_len": 128,
                    "eval_every": 0,
                    "eval_batches": 1,
                },
                ckpt_dir=folder + "/run",
                devices=found_devices(),
            )
        )
        result = trainer.run()
        trainer.close()
    assert trainer.config["dtype"] == "bfloat16"
    dtypes = {x.dtype for x in jax.tree.leaves(trainer.state.params)}
    dtypes |= {x.dtype for x in jax.tree.leaves(trainer.state.opt_state) if x.ndim}
    assert dtypes == {jnp.dtype("float32")}, dtypes
    assert all(jnp.isfinite(v) for v in result.losses.values())
    assert result.losses[3] < 6.0
    assert all(d.platform != "cpu" for d in trainer.mesh.devices.flat)


@_marks
def test_memory_stats_report_the_peak():
    device = jax.devices()[0]
    x = jnp.ones((1024, 1024), jnp.float32)
    (x @ x).block_until_ready()
    stats = device.memory_stats()
    assert stats and stats["peak_bytes_in_use"] >= 4 * 1024 * 1024, stats
    assert stats["bytes_limit"] > stats["peak_bytes_in_use"]


if __name__ == "__main__":
    import sys

    if not _on_accelerator():
        print("no accelerator: nothing to check")
        sys.exit(0)
    failed = 0
    for name, test in list(globals().items()):
        if name.startswith("test_"):
            try:
                test()
                print(f"ok    {name}")
            except Exception as e:  # report every check, then fail
                failed += 1
                print(f"FAIL  {name}: {type(e).__name__}: {e}")
    sys.exit(1 if failed else 0)
