"""The ``meshplan`` command itself: bare, --version, and one size flag everywhere."""

from __future__ import annotations

import pytest

import meshplan
from meshplan import cli


def test_a_bare_meshplan_prints_help_and_exits_zero(capsys):
    assert cli.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: meshplan") and "train" in out and "--version" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"meshplan {meshplan.__version__}"


@pytest.mark.parametrize("command", ["plan", "search", "train"])
def test_every_command_takes_size(command):
    args = cli.build_parser().parse_args([command, "--size", "small"])
    assert (args.config if command == "train" else args.size) == "small"


def test_train_still_reads_config_without_showing_it(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["train", "--config", "base"]).config == "base"
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "--help"])
    shown = capsys.readouterr().out
    assert "--size" in shown and "--config" not in shown
