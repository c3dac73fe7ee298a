"""One table per training setting: its flag, its help and its fix (cli/train_flags.py)."""

import argparse
import dataclasses

import pytest

from meshplan.cli import train
from meshplan.cli.train.flags import SETTINGS, SETTINGS_FLAGS, setting_fix, setting_flag
from meshplan.train.settings import TrainSettings


def test_every_training_setting_has_one_row():
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    assert {s.field for s in SETTINGS} == fields
    assert len({s.dest for s in SETTINGS}) == len(SETTINGS)
    assert {s.dest: s.field for s in SETTINGS} == SETTINGS_FLAGS


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.field)
def test_the_parser_reads_each_setting_from_its_row(setting):
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    value = "3" if setting.kind is int else "0.5"
    args = parser.parse_args([setting.flag, value])
    assert getattr(args, setting.dest) == setting.kind(value)
    assert setting_flag(setting.field) == setting.flag


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"steps": 0}, "steps"),
        ({"seq_len": 0}, "seq_len"),
        ({"lr": float("nan")}, "lr"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"batch": 32, "grad_accum": 5}, "grad_accum"),
    ],
)
def test_a_refused_setting_gets_the_fix_of_its_row(values, field):
    [(name, _)] = TrainSettings(**values).problems()
    assert name == field
    fix = setting_fix(name)
    assert setting_flag(field) in fix and fix.startswith("Pass ")


def _notes():
    from meshplan._checkpoint.branch import set_aside_note
    from meshplan.train.records import valid_changed_note

    changes = {"seq_len": (16, 32), "eval_batches": (2, 3), "data": ("stdlib", "t.txt")}
    return [
        (
            valid_changed_note(4, changes),
            "(--seq 32 instead of 16; --eval-batches 3 instead of 2; --data t.txt instead of "
            "stdlib)",
        ),
        (
            set_aside_note([3, 4], "run", 2, "run/old"),
            "neither this run nor a later --resume mixes them in",
        ),
        ("A plain note.", "A plain note."),
    ]


@pytest.mark.parametrize(("note", "expected"), _notes())
def test_the_trainer_notes_are_worded_in_flags_from_their_code(note, expected):
    from meshplan.cli.train.flags import in_flags

    assert expected in in_flags(note)
    assert "--" not in str(note)  # the library's own words name no flag


def test_a_peak_unknown_for_the_dtype_is_advised_in_flags():
    from meshplan.cli.train.flags import no_mfu_why
    from meshplan.train.flops import mesh_peak

    peak = mesh_peak("tpu", "TPU v4", 4, "float32")
    assert no_mfu_why(peak) == f"{peak.why}; train with --dtype bfloat16 for MFU"
    unknown = mesh_peak("gpu", "Mystery", 1, "float32")
    assert no_mfu_why(unknown) == unknown.why  # nothing to advise
