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
    assert result["upward_calls"] == 0  # `show` is called by `run`, not from below


LOOP = """
    class Loop:
        def __init__(self, steps):
            self.steps = steps

    class Box:
        def replace(self, **kw):
            pass
"""


def _measure(tmp_path, cli):
    """The measure of a toy tree: ``cli`` as ``meshplan/cli/train.py`` over :data:`LOOP`."""
    files = {
        "meshplan/__init__.py": "",
        "meshplan/cli/__init__.py": "",
        "meshplan/train/__init__.py": "",
        "meshplan/cli/train.py": "from meshplan.train.loop import Loop\n" + textwrap.dedent(cli),
        "meshplan/train/loop.py": textwrap.dedent(LOOP),
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return _load().measure(tmp_path)


def test_an_else_branch_follows_what_came_before_its_if_not_the_other_branch(tmp_path):
    result = _measure(
        tmp_path,
        """
        def run(args):
            if args.own:
                loop = Loop(args.steps)
            else:
                prepare(args)

        def prepare(args):
            pass
    """,
    )
    assert result["path"] == [
        "meshplan.cli.train:run",
        "meshplan.train.loop:Loop.__init__",
        "meshplan.cli.train:prepare",
    ]
    assert result["back_steps"] == 0  # one run goes into Loop or into prepare, not both


def test_going_on_after_a_call_into_the_bottom_layer_is_not_a_back_step(tmp_path):
    (tmp_path / "meshplan" / "_errors").mkdir(parents=True)
    (tmp_path / "meshplan" / "_errors" / "__init__.py").write_text(
        "def error_for(flag):\n    pass\n"
    )
    result = _measure(
        tmp_path,
        """
        from meshplan._errors import error_for

        def run(args):
            error_for(args.steps)
            show(args)
            loop = Loop(args.steps)
            error_for(args.lr)
            decide(args)

        def show(args):
            pass

        def decide(args):
            pass
    """,
    )
    assert result["path"] == [
        "meshplan.cli.train:run",
        "meshplan._errors:error_for",
        "meshplan.cli.train:show",
        "meshplan.train.loop:Loop.__init__",
        "meshplan.cli.train:decide",
    ]
    # `show` after the bottom is not a back-step; `decide`, after Loop (through the bottom), is.
    assert result["back"] == {"meshplan.cli.train:decide": "meshplan.train.loop:Loop.__init__"}
    assert (result["back_steps"], result["back_steps_counting_bottom"]) == (1, 2)


def test_arguments_run_before_the_call_and_a_str_method_is_not_the_package_s(tmp_path):
    result = _measure(
        tmp_path,
        """
        def run(args):
            name = args.name.replace("-", "_")  # a str's, not Box.replace
            Loop(args.steps, count(args.steps))

        def count(steps):
            return steps
    """,
    )
    assert result["path"] == [
        "meshplan.cli.train:run",
        "meshplan.cli.train:count",  # Python runs it before Loop(...)
        "meshplan.train.loop:Loop.__init__",
    ]
    assert result["back_steps"] == 0


def test_the_settings_reach_the_checks_and_the_trainer():
    result = _load().measure(ROOT / "src")
    path = result["path"]
    assert path[0] == "meshplan.cli.train.command:run"
    for stop in (
        "meshplan.cli.train.prepare:prepare_run",
        "meshplan.cli.train.memory_advice:memory_problem",
        "meshplan.train.trainer:Trainer.__init__",
        "meshplan.train.trainer:Trainer.run",
    ):
        assert stop in path
    assert result["back_steps"] < result["stops"]
    assert result["upward_calls"] == 0  # the library never calls back up into the command line
    # The trainer decides what the settings say against the checkpoint's (a changed
    # validation) before it builds the state: not after, going back up to the settings.
    assert "meshplan.train.records:valid_changed_note" in path
    assert "meshplan.train.records:valid_changed_note" not in result["back"]
    # --rules is read with the other flags, before the library builds anything; the step's
    # memory is the library's check (build_parts), which the command line only words.
    assert path.index("meshplan.layouts:get_layout") < path.index(
        "meshplan.train.build:build_parts"
    )
    assert "meshplan.cli.train.memory_advice:memory_problem" not in result["back"]
    # A factory's --names file is read with --rules, before the factory is imported; the
    # header's plan is the library's summary, taken with the trainer: the header words it.
    assert path.index("meshplan.layouts:get_names") < path.index(
        "meshplan.cli.factory:load_factory"
    )
    # The plan per device is the library's, summed up with its build: the command does not
    # ask the trainer for it again (explain's walk is not on the settings' path).
    assert "meshplan.train.trainer:Trainer.plan_summary" not in path
    # 10 before the header's pipeline, remat and resume lines and the NaN diagnosis (18
    # after them). Issue 31's one prepare step (cli/train/prepare.py, both model sources
    # counted: the walk follows ModelSource's methods into each class) brought it to 16: the
    # command's own lines said before the library's summary, the corpus checked where it is
    # read, the batch's devices read with the flags. Issue 31 item 7 brought it to 13: the
    # pipeline's stages and a factory's --names file read with the other flags, the
    # library's finding of an unnamed state kept in BuiltParts, and the plan summary taken
    # as data with the trainer (the header only words it). Its redesign brought it to 8: the
    # plan per device summed up with the library's build (explain's walk and the shard-size
    # fallback off the path), the checkpoint layer moving the later steps aside and wording
    # its notes (Checkpointer.branch_from), and the trainer reading a checkpoint straight
    # into its state's shardings (restore_into: no _spmd walk before the read's records).
    # Its second round brought it to 6: the batch, its microbatches and the pipeline checked
    # by one library call (models.batch_fit), whose records the command line words with
    # the build's findings (not two checks of its own, each calling into the library); one
    # call into the trainer before the header (start when resuming, else open), and a
    # fresh state that does not open the folder after it is made.
    # The 6: found_devices, source_for, placement_problems, Trainer.start, _close,
    # error_in_flags.
    assert "meshplan.models.batch_fit:batch_fit" in path
    assert path.index("meshplan.models.batch_fit:batch_fit") < path.index(
        "meshplan.train.build:build_parts"
    )
    assert "meshplan.train.state:init_fn" not in result["back"]
    assert result["back_steps"] <= 6
