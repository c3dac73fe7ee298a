"""One table per training setting: its flag, its help and its fix (cli/train_flags.py)."""

import argparse
import dataclasses

import pytest

from meshplan.cli import train
from meshplan.cli.train_flags import SETTINGS, SETTINGS_FLAGS, setting_fix, setting_flag
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
