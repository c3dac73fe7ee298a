"""models.batch_fit: a step's token batch, its microbatches and the pipeline against a mesh and
rules, in one call, as records (nothing built, nothing traced)."""

import pytest

from meshplan._spmd.rules import Rules
from meshplan.layouts import get_layout
from meshplan.models.batch_fit import batch_fit
from meshplan.models.transformer import config_from_name
from meshplan.train.settings import TrainSettings


def _codes(fit):
    return [(p.code, p.path) for p in fit.problems]


def test_a_batch_that_splits_fits_and_says_over_how_many_devices():
    rules = Rules.of(get_layout("fsdp_tp"))
    fit = batch_fit(
        config_from_name("tiny"), TrainSettings(batch=8), {"data": 2, "model": 4}, rules
    )
    assert fit.fits and fit.problems == []
    assert (fit.shards, fit.context, fit.stage_axes) == (2, 1, ((), 1))


def test_each_finding_is_a_typed_field_and_a_problem_with_its_code():
    # 'batch' on an axis the mesh lacks, and --grad-accum's microbatches over 'data'.
    missing = batch_fit(None, TrainSettings(batch=8), {"x": 2}, Rules.of([("batch", "data")]))
    (d,) = missing.dims
    assert (d.name, d.missing_axes, missing.mesh_axes) == ("batch", ("data",), ("x",))
    assert _codes(missing) == [("unknown-axis", "batch")]
    accum = batch_fit(
        None, TrainSettings(batch=8, grad_accum=4), {"data": 4}, Rules.of([("batch", "data")])
    )
    assert accum.accum_uneven and accum.shards == 4  # microbatches of 2 over 4 devices
    assert _codes(accum) == [("indivisible", "grad_accum")]
    # Context parallelism: 'length' in 4 pieces, a sequence of 36 is not 8 equal chunks.
    context = Rules.of([("batch", "data"), ("length", "context")])
    striped = batch_fit(
        None, TrainSettings(batch=2, seq_len=36), {"data": 2, "context": 4}, context
    )
    assert (striped.context, striped.unstriped) == (4, True)
    assert _codes(striped) == [("seq-not-striped", "length")]


@pytest.mark.parametrize(
    ("layers", "microbatches", "batch", "found"),
    [
        (5, 4, 8, [("pipeline-layers", "layers")]),
        (4, 1, 8, [("pipeline-microbatches", "microbatches")]),
        # 8 rows in 4 microbatches of 2, over the 2 devices of 'data': fits; 4 over 2 devices
        # of 'data' in 4 microbatches of 1 row does not.
        (4, 4, 8, []),
        (4, 4, 4, [("pipeline-batch", "microbatches")]),
    ],
)
def test_the_pipeline_is_checked_with_the_batch(layers, microbatches, batch, found):
    rules = Rules.of(get_layout("pp_fsdp"))
    config = config_from_name("tiny", num_layers=layers, microbatches=microbatches)
    shape = {"pipeline": 2, "data": 2}
    fit = batch_fit(config, TrainSettings(batch=batch), shape, rules, (("pipeline",), 2))
    assert _codes(fit) == found
    assert fit.pipeline_uneven == (found == [("pipeline-batch", "microbatches")])
