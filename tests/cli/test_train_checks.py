"""What `meshplan train` refuses before any work for the new layouts and flags, and the mesh
axes a context- or expert-parallel layout brings along."""

from __future__ import annotations

import pytest

import meshplan
from meshplan.cli.train import TrainRequest, prepare
from meshplan.train.settings import TrainSettings

TINY = {"num_layers": 1, "embed_dim": 32, "mlp_dim": 64, "max_len": 64}


def request(**fields) -> TrainRequest:
    settings = {"steps": 1, "batch": 8, "seq_len": 16, "eval_every": 0, "eval_batches": 1}
    settings.update(fields.pop("settings", {}))
    overrides = fields.pop("overrides", TINY)
    return TrainRequest(overrides=overrides, settings=settings, data=__file__, **fields)


def test_a_context_layout_names_its_mesh_axes():
    trainer = prepare(request(mesh="2x4", rules="fsdp_cp"))
    assert dict(trainer.mesh.shape) == {"data": 2, "context": 4}
    trainer = prepare(request(mesh="2x4", rules="expert_parallel"))
    assert dict(trainer.mesh.shape) == {"data": 2, "expert": 4}


def test_a_sequence_that_cannot_be_striped_is_refused():
    with pytest.raises(meshplan.MeshplanError, match="cannot be striped over the 4 context"):
        prepare(request(mesh="2x4", rules="context_parallel", settings={"seq_len": 20}))


def test_microbatches_that_do_not_split_over_the_batch_devices_are_refused():
    with pytest.raises(meshplan.MeshplanError, match="microbatches of 4, which do not split over"):
        prepare(request(mesh="8", rules="data_parallel", settings={"grad_accum": 2}))


def test_grad_accum_must_divide_the_batch():
    assert TrainSettings(batch=8, grad_accum=3).problems() == [
        ("grad_accum", "3 microbatches do not divide a batch of 8")
    ]


def test_a_bad_moe_config_is_refused_with_its_fields():
    with pytest.raises(meshplan.MeshplanError, match="top_k must be between 1 and num_experts=2"):
        prepare(
            request(
                mesh="2x4",
                rules="expert_parallel",
                overrides={**TINY, "num_experts": 2, "top_k": 3},
            )
        )
