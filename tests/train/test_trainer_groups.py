"""Trainer takes typed groups (model, batches, settings, placement, checkpoints, measures)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from meshplan.models.registry import example
from meshplan.models.transformer import config_from_name
from meshplan.train.device_mesh import make_mesh
from meshplan.train.parts import Checkpoints, Measures, Placement
from meshplan.train.settings import TrainSettings
from meshplan.train.trainer import Trainer

SETTINGS = TrainSettings(steps=1, batch=8, seq_len=16)


def _parts():
    built = example("transformer", config_from_name("tiny", num_layers=1)).model
    tokens = jax.ShapeDtypeStruct((1, 16), jnp.int32)
    mesh = make_mesh({"data": 2, "model": 4})
    return dataclasses.replace(built, example_input=tokens), mesh


def _no_batches(split, index):
    raise AssertionError("not called")


def test_groups_and_separate_keywords_build_the_same_trainer():
    model, mesh = _parts()
    grouped = Trainer(
        model,
        _no_batches,
        SETTINGS,
        Placement(mesh, (("batch", "data"),), "dp"),
        Checkpoints(discard_steps=(3,), record={"data": None}),
        Measures(flops_per_step=10.0, peak_flops_per_s=100.0),
        notes=["hello"],
    )
    separate = Trainer(
        model=model.model,
        loss=model.loss,
        example_input=model.example_input,
        batches=_no_batches,
        settings=SETTINGS,
        mesh=mesh,
        rules=(("batch", "data"),),
        layout_name="dp",
        discard_steps=[3],
        record={"data": None},
        flops_per_step=10.0,
        peak_flops_per_s=100.0,
    )
    for t in (grouped, separate):
        assert (t.layout_name, t.discard_steps, t.record, t.ckpt_dir) == (
            "dp",
            (3,),
            {"data": None},
            None,
        )
        assert t.mfu(0.05) == pytest.approx(10.0 / 0.05 / 100.0)
    assert grouped.notes == ["hello"] and separate.notes == []
    shapes = [jax.tree.map(lambda x: x.shape, t.abstract.params) for t in (grouped, separate)]
    assert shapes[0] == shapes[1]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"mesh": None}, "pass placement=... or mesh, not both"),
        ({"lr": 1.0}, "unexpected keyword arguments: lr"),
    ],
)
def test_a_group_and_its_fields_together_are_refused(extra, match):
    model, mesh = _parts()
    with pytest.raises(TypeError, match=match):
        Trainer(model, _no_batches, SETTINGS, Placement(mesh, ()), **extra)


def test_the_trainer_takes_typed_parts():
    import typing

    import optax

    hints = typing.get_type_hints(Trainer.__init__)
    assert hints["tx"] == optax.GradientTransformation | None
    assert hints["placement"] == Placement | None
    assert hints["checkpoints"] == Checkpoints | None
    assert hints["measures"] == Measures | None
