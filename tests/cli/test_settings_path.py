"""benchmarks/settings_path.py follows meshplan train's settings and counts the back-steps."""

import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location(
        "settings_path", ROOT / "benchmarks" / "settings_path.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_toy_tree_going_down_and_back_up_counts_one_back_step(tmp_path):
    files = {
        "meshplan/__init__.py": "",
        "meshplan/cli/__init__.py": "",
        "meshplan/train/__init__.py": "",
        "meshplan/cli/train.py": """
            from meshplan.train.loop import Loop

            def run(args):
                loop = Loop(args.steps)
                loop.go()
                show(loop)
                ignored(3)

            def show(loop):
                pass

            def ignored(n):
                pass
        """,
        "meshplan/train/loop.py": """
            class Loop:
                def __init__(self, steps):
                    self.steps = steps

                def go(self):
                    pass
        """,
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    result = _load().measure(tmp_path)
    assert result["path"] == [
        "meshplan.cli.train:run",
        "meshplan.train.loop:Loop.__init__",
        "meshplan.train.loop:Loop.go",
        "meshplan.cli.train:show",
    ]
    assert (result["stops"], result["modules"], result["back_steps"]) == (4, 2, 1)


def test_the_settings_reach_the_checks_and_the_trainer():
    result = _load().measure(ROOT / "src")
    path = result["path"]
    assert path[0] == "meshplan.cli.train:run"
    for stop in (
        "meshplan.cli.train_request:prepare_run",
        "meshplan.cli.train_memory:memory_problem",
        "meshplan.train.trainer:Trainer.__init__",
        "meshplan.train.trainer:Trainer.run",
    ):
        assert stop in path
    assert 0 < result["back_steps"] < result["stops"]
