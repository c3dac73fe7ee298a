"""Docs that cannot rot: every code block of README.md and docs/*.md runs as written.

One test per page runs the page's blocks in order, in one namespace, in a fresh
working folder:

* ``python`` blocks are executed; a ``python`` block that starts with ``>>>`` is
  a doctest (ELLIPSIS, NORMALIZE_WHITESPACE) whose output is compared;
* ``json`` blocks must parse;
* ``console``/``bash``/``sh`` blocks: each ``meshplan ...`` command must parse
  (``meshplan.cli.build_parser``), and then

  - cheap commands run as written (``python -m meshplan.cli``, CPU devices) and
    must succeed; their shown output is illustrative;
  - a command whose shown output starts with ``error:`` must exit with status 2
    and print the lines shown (only the first when the checkpoint it reads was
    made small, below);
  - training (hundreds of steps, several processes) runs at the tiniest size
    instead (2 steps of a 1-layer model, one process), so that the blocks after
    it find the checkpoint they need; a training command with no output shown and
    no ``--ckpt-dir`` is checked as ``meshplan train`` checks it before it compiles
    (:func:`prepared_here`); ``search --measure``, ``demo`` and commands for several
    hosts are only parsed;

  ``make X`` must be a target (``make -n X``), ``.venv/bin/python script.py`` a
  script that exists;
* ``text`` and unlabelled blocks are output, not run; an unlabelled block that
  looks like a command fails, so a command cannot hide from the runner.

Paths under ``/tmp/`` and ``/shared/`` in blocks (``/tmp/run``) go to a folder of
the test session instead; ``/tmp/empty`` is an empty folder. A block is skipped
only after an explicit ``<!-- not run: reason -->`` line. A failure names the page,
the line and the block's first line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import importlib
import io
import json
import math
import re
import subprocess
import sys
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

import pytest

from child_env import fresh_env
from docblocks import SHELL, Block, Command, blocks_of, commands_of

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
TOGETHER = {"docs/training.md": "README.md"}
"""Pages run in one test after the page named, in its session: the README's quick start is
the training page's first commands, trained once (each page's shown output checked)."""
RUNS = [
    "+".join([p, *(k for k, v in TOGETHER.items() if v == p)]) for p in PAGES if p not in TOGETHER
]
assert sorted(p for run in RUNS for p in run.split("+")) == sorted(PAGES), (RUNS, PAGES)
LANGS = {"python", "json", "text", "", *SHELL}
MAX_NOT_RUN = 2  # blocks skipped by a marker, in all pages together: keep them rare

# Training at the tiniest size, what replaces a doc's long run: see tests/cli/test_train_command.py.
FAST = ["--batch", "8", "--seq", "16", "--eval-every", "0", "--eval-batches", "1"]
TINY = ["--layers", "1", "--embed", "32", "--mlp", "64", "--max-len", "64"]
MULTI = {"--processes": 1, "--coordinator": 1, "--num-processes": 1, "--process-id": 1}
DOC_PATH = re.compile(r"(?<![\w.])/(?:tmp|shared)/[\w.-]+")


@dataclasses.dataclass
class Session:
    """What the pages share: a folder standing for /tmp, and the small runs made so far."""

    root: Path
    runs: dict[tuple[str, ...], str] = dataclasses.field(default_factory=dict)  # -> printed
    steps: dict[str, int] = dataclasses.field(default_factory=dict)  # small checkpoints
    # Folders of commands shown with several processes, made here by one.
    one_for_many: set[str] = dataclasses.field(default_factory=set)

    def map(self, text: str) -> str:
        """``text`` with the docs' absolute paths (``/tmp/run``) moved under :attr:`root`."""
        return DOC_PATH.sub(
            lambda m: str(self.root / m.group(0).strip("/").replace("/", "-")), text
        )


@pytest.fixture(scope="module")
def session(tmp_path_factory) -> Session:
    root = tmp_path_factory.mktemp("docs")
    (root / "tmp-empty").mkdir()
    return Session(root)


def cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``meshplan ARGS`` in a fresh process of this Python, on CPU devices.

    As a reader's shell runs them: without the test session's XLA_FLAGS (the command sets
    its own from --devices, and its messages differ when the user's XLA_FLAGS set the count).
    """
    env = fresh_env(JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-m", "meshplan.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


SESSION_DEVICES = 8  # the test session's emulated CPU devices (the root conftest.py)


def checkable_here(args: list[str]) -> bool:
    """Whether :func:`prepared_here` sees what ``meshplan train ARGS`` would see in a fresh
    process: this session's 8 CPU devices (the command's default ``--devices`` on a machine
    without an accelerator) and a model importable from here (a module of the reader's
    folder is not). Any mesh: one of fewer devices or more is the command's check to allow
    or refuse, here as there.

    Example:
        >>> checkable_here(["train", "--mesh", "1x1"])
        True
        >>> checkable_here(["train", "--platform", "cpu", "--devices", "8", "--mesh", "2x4"])
        True
        >>> checkable_here(["train", "--devices", "4", "--mesh", "2x2"])
        False
        >>> checkable_here(["train", "--model", "mymodels:make_model"])
        False
    """
    parsed = parses(args)
    model = parsed.model or ""
    importable = ":" not in model or model.startswith("meshplan.")
    return importable and parsed.platform in ("auto", "cpu") and parsed.devices == SESSION_DEVICES


def in_this_process(args: list[str]) -> bool:
    """Whether a small ``meshplan train ARGS`` can run in this process rather than a fresh one.

    It can when a fresh process would print what this one does: :func:`checkable_here`, a
    mesh of the session's 8 devices (or none given), and no ``--platform`` or ``--devices``
    of its own (a run's output names them). The tests of ``tests/cli`` run ``meshplan``
    this way too; it saves a process's start (about 3 s of a 10 s small run).

    Example:
        >>> in_this_process(["train", "--rules", "fsdp", "--mesh", "2x4"])
        True
        >>> in_this_process(["train", "--mesh", "1x1"])
        False
        >>> in_this_process(["train", "--rules", "pp_tp", "--mesh", "2x2x2"])
        True
    """
    # '2x4', '2x2x2', '4×2', '8': only the device count (parse_mesh_shape wants 3 axes named)
    mesh = parses(args).mesh
    if mesh is not None and math.prod(map(int, re.split("[x×]", mesh))) != SESSION_DEVICES:
        return False
    own = any(a.startswith(("--platform", "--devices")) for a in args)
    return not own and checkable_here(args)


def cli_here(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """``meshplan ARGS`` run in this process (:func:`in_this_process`), as :func:`cli` gives it:
    its warnings printed after its error output, as a fresh process prints them (once each),
    and ``sys.path`` as it was (a factory's folder is put there for its import)."""
    from meshplan.cli import main

    out, err, path = io.StringIO(), io.StringIO(), list(sys.path)
    try:
        with (
            contextlib.chdir(cwd),
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("default")  # Python's own filters, as a fresh process has
            for quiet in (
                DeprecationWarning,
                PendingDeprecationWarning,
                ImportWarning,
                ResourceWarning,
            ):
                warnings.simplefilter("ignore", quiet)
            code = main(args)
    finally:
        sys.path[:] = path
    said = "".join(
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno) for w in caught
    )
    return subprocess.CompletedProcess(
        ["meshplan", *args], code, out.getvalue(), err.getvalue() + said
    )


def prepared_here(args: list[str], cwd: Path) -> None:
    """``meshplan train ARGS`` checked in this process as the command checks it before it
    compiles anything (``prepare_run``): the flags, the model they build, the layout against
    its dimensions and the mesh, the batches, and the step's memory. A command that fails
    there fails here with the message the reader would see.

    For a command whose output the page does not show and whose checkpoint no later block
    reads: what could rot is its flags and their combination, all checked here. Each
    layout's training is the behaviour tests' (``tests/models``, ``tests/cli``); compiling
    it once more here cost about 6 s a command.
    """
    from meshplan._errors import MeshplanError
    from meshplan.cli.devices import found_devices
    from meshplan.cli.train import checked_request, prepare_run

    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(io.StringIO()):
            prepare_run(checked_request(parses(args), found_devices()))  # as run() does
    except MeshplanError as e:
        raise AssertionError(f"`meshplan {' '.join(args)}` is refused:\n{e}") from None


def test_the_pre_compile_check_fails_on_a_command_train_refuses(tmp_path):
    args = ["train", "--rules", "context_parallel", "--mesh", "2x4", "--seq", "20", *TINY]
    with pytest.raises(AssertionError, match="--seq 20 cannot be striped over the 4 context"):
        prepared_here(args, tmp_path)
    prepared_here(
        ["train", "--rules", "context_parallel", "--mesh", "2x4", "--seq", "32"], tmp_path
    )


def _shown(result: subprocess.CompletedProcess[str]) -> str:
    out, err = result.stdout[-3000:], result.stderr[-3000:]
    return f"exit status {result.returncode}\nstdout:\n{out}\nstderr:\n{err}"


def _words(text: str) -> str:
    return " ".join(text.split())


def parses(args: list[str]) -> Any:
    """The arguments as ``meshplan``'s parser reads them; fails with argparse's message."""
    from meshplan.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(args)
    except SystemExit:
        raise AssertionError(
            f"`meshplan {' '.join(args)}` does not parse:\n{err.getvalue()}"
        ) from None


NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")
MACHINE_ROWS = ("devices", "step time", "tokens/s", "MFU", "peak memory")
"""Summary rows whose values depend on the machine and on a step being timed: by label."""


def skeleton(line: str) -> tuple[str, str]:
    """A line of ``meshplan train``'s output as (kind, shape): numbers ``#``, paths ``<path>``.

    A summary row's kind is its label; any other line's is its shape. Two outputs of the
    same command at different sizes and on different days have the same skeletons.

    Example:
        >>> skeleton("│ time   │ 355.7 s (wall clock) │")
        ('row time', 'time | # s (wall clock)')
        >>> skeleton("│ tokens/s │ 1,656 (over the timed steps) │")
        ('row tokens/s', 'tokens/s | # (over the timed steps)')
        >>> skeleton("data: /tmp/x.py (1,024 train / 12 valid bytes)")
        ('data: ', 'data: ')
        >>> skeleton("│         │ 25.6 GFLOP/s on this host │")
        ('continued', 'continued')
    """
    text = re.sub(r"[┏┓┗┛┡┩└┘┌┐├┤┬┴┼┳┻╇━─]+", " ", line)
    parts = [c.strip() for c in re.split(r"[│┃]", text)]
    if "│" in line and len(parts) > 2 and not parts[1]:
        return "continued", "continued"  # a row's value wrapped onto the next line
    cells = [c for c in parts if c]
    words = []
    for word in " | ".join(cells).split():
        path = "/" in word and (word[0] in "/<~." or word.count("/") > 1)  # not tok/s, nats/byte
        words.append("<path>" if path else word)
    shape = NUMBER.sub("#", " ".join(words))
    shape = re.sub(r"# ?[kKMGTP]i?(B|FLOP)\b", r"# \1", shape)  # 12.38 KiB and 5.26 MiB alike
    shape = re.sub(r"# (\w+?)s\b", r"# \1", shape)  # 1 layer, 2 layers
    is_row = len(cells) >= 2 and "│" in line
    label = re.match(r"(devices|MFU against|data): ", shape)  # what follows is the machine's
    if label:
        return label.group(0), label.group(0)
    return (f"row {cells[0]}" if is_row else shape), shape


def check_shown_output(shown: list[str], printed: str, args: list[str]) -> None:
    """Every line shown after a training command has a line of that shape in a real run's
    output, and every line of the real run is shown (``...`` abridges, evaluations and the
    progress bar aside): the docs cannot fall behind what ``meshplan train`` prints."""
    real = [skeleton(line) for line in printed.splitlines() if line.strip()]
    kinds, shapes = {k for k, _ in real}, {s for _, s in real}
    where = f"`meshplan {' '.join(args)}`"
    for line in shown:
        if not line.strip() or "..." in line or line.lstrip().startswith("train "):
            continue
        kind, shape = skeleton(line)
        if kind == "continued":
            continue
        if kind in {f"row {r}" for r in MACHINE_ROWS}:
            assert kind in kinds, f"{where}: shown, but never printed: {line!r}\n{printed}"
        else:
            assert shape in shapes, (
                f"{where}: shown, but not printed in that shape: {line!r}\nprinted:\n{printed}"
            )
    shown_kinds = {skeleton(line)[0] for line in shown if line.strip()}
    abridged = any("..." in line for line in shown)
    for kind, _ in real:
        if kind.startswith(("step # valid loss", "train ", "continued")) or abridged:
            continue
        assert kind in shown_kinds, f"{where}: printed, but not shown: {kind!r}"


def small_run(args: list[str], session: Session, cwd: Path, shown: list[str] = ()) -> None:
    """Trains as ``args`` ask, at the tiniest size and in one process: 2 steps per command."""
    many = any(arg in MULTI for arg in args)
    if tuple(args) in session.runs:  # the same command on an earlier page: its checkpoint is
        if shown and not many and parses(args).ckpt_dir not in session.one_for_many:  # there
            check_shown_output(shown, session.runs[tuple(args)], args)  # (output as printed)
        return
    small: list[str] = []
    skip = 0
    for arg in args:
        if skip:
            skip -= 1
        elif arg in MULTI:
            skip = MULTI[arg]
        elif arg.startswith("--devices"):
            skip = 0 if "=" in arg else 1
        else:
            small.append(arg)
    parsed = parses(small)
    folder = parsed.ckpt_dir
    step = session.steps.get(folder, 0) + 2 if parsed.resume else 2
    if parsed.model and ":" in parsed.model:  # a factory: its model and batches are small
        small += ["--eval-every", "0", "--eval-batches", "1", "--steps", str(step)]
    elif getattr(parsed, "microbatches", None) and not parsed.resume:
        # a pipeline: the page's --layers and --batch fit its stages, so they win over TINY's
        small = [small[0], *FAST, *TINY, *small[1:], "--steps", str(step)]
        small += ["--data", str(Path(__file__))]
    else:
        small += [*FAST, "--steps", str(step)]
        if not parsed.resume:
            small += [*TINY, "--data", str(Path(__file__))]
    if not shown and folder is None and not many and checkable_here(args):
        prepared_here(small, cwd)  # nothing of it shown or read later: checked, not compiled
        return
    result = (cli_here if in_this_process(args) else cli)(small, cwd)
    failed = f"the small run `meshplan {' '.join(small)}` failed:\n"
    assert result.returncode == 0, failed + _shown(result)
    if many and folder:
        session.one_for_many.add(folder)
    if shown and not many and folder not in session.one_for_many:  # run as it was shown
        check_shown_output(shown, result.stdout + result.stderr, args)
    session.runs[tuple(args)] = result.stdout + result.stderr
    if folder:
        session.steps[folder] = step


def run_meshplan(command: Command, args: list[str], session: Session, cwd: Path) -> None:
    parsed = parses(args)
    output = [session.map(line) for line in command.output]
    if output and output[0].startswith("error:"):
        result = cli(args, cwd)
        should = f"`meshplan {' '.join(args)}` should fail with status 2:\n"
        assert result.returncode == 2, should + _shown(result)
        printed = _words(result.stdout + result.stderr)
        small = any(arg in session.steps for arg in args)
        for line in output[:1] if small else output:
            words = _words(line).removesuffix(".")  # a line's last full stop is no rot
            assert words in printed, f"not printed: {line!r}\n" + _shown(result)
    elif parsed.command == "train":
        if parsed.coordinator is None:
            small_run(args, session, cwd, output)
    elif parsed.command == "demo" or (parsed.command == "search" and parsed.measure):
        pass  # parsed above; `make demo` and tests/search/test_search_layouts.py run them
    elif parsed.command in ("plan", "search") and output:
        result = cli(args, cwd)
        status = 1 if parsed.command == "search" and any("best: none" in s for s in output) else 0
        assert result.returncode == status, f"`meshplan {' '.join(args)}`:\n" + _shown(result)
        check_planner_output(output, result.stdout + result.stderr, args)
    else:
        result = cli(args, cwd)
        assert result.returncode == 0, f"`meshplan {' '.join(args)}` failed:\n" + _shown(result)


def _planner_line(line: str) -> str:
    """A line of ``meshplan plan``/``search`` output as compared: spaces collapsed, and the
    search's own wall time (``(6.9 s)``) left out: the figures are a published profile's,
    the same on every machine.

    Example:
        >>> _planner_line("candidates: enumerated 951;  scored 176 (6.9 s)")
        'candidates: enumerated 951; scored 176 (# s)'
    """
    return re.sub(r"\(\d+(\.\d+)? s\)$", "(# s)", _words(line))


def check_planner_output(shown: list[str], printed: str, args: list[str]) -> None:
    """Every line shown after a ``meshplan plan``/``search`` command (``...`` abridges) is a
    line it prints, figures included, in the order shown: the docs cannot fall behind the
    planner (docs/plan.md, docs/layouts.md, README.md; a published profile, never ``cpu``)."""
    where = f"`meshplan {' '.join(args)}`"
    assert "--profile" in args and "cpu" not in args, f"{where}: show a published profile"
    real = [_planner_line(line) for line in printed.splitlines() if line.strip()]
    at = 0
    for line in shown:
        if not line.strip() or line.strip() in ("...", "…"):
            continue
        want = _planner_line(line)
        assert want in real[at:], (
            f"{where}: shown, but not printed (in this order): {line!r}\nprinted:\n{printed}"
        )
        at = real.index(want, at) + 1


def run_shell(block: Block, session: Session, cwd: Path) -> None:
    for command in commands_of(block):
        argv = [session.map(arg) for arg in command.argv]
        try:
            if argv[0] == "meshplan":
                run_meshplan(command, argv[1:], session, cwd)
            elif argv[0] == "make":
                targets = argv[1:]
                done = subprocess.run(
                    ["make", "-n", *targets], cwd=ROOT, capture_output=True, text=True
                )
                assert done.returncode == 0, f"not a make target: {targets}\n{done.stderr}"
            elif argv[0].endswith("/python") and len(argv) >= 2 and argv[1].endswith(".py"):
                script = ROOT / argv[1]
                assert script.is_file(), f"no script {argv[1]}"
                source = script.read_text()
                compile(source, str(script), "exec")
                # a benchmark is not run here: each option the page gives must be the script's
                unknown = [
                    a.split("=")[0]
                    for a in argv[2:]
                    if a.startswith("--")
                    if f'"{a.split("=")[0]}"' not in source
                ]
                assert not unknown, f"{argv[1]} has no option {unknown}"
            else:
                raise AssertionError("tests/test_docs.py does not know how to check this command")
        except Exception as e:
            raise AssertionError(
                f"{block.page}:{command.line}: `{' '.join(command.argv)}`: {e}"
            ) from None


def run_doctest(block: Block, namespace: dict[str, Any], session: Session) -> None:
    parser = doctest.DocTestParser()
    test = parser.get_doctest(
        session.map(block.text), namespace, block.where, str(ROOT / block.page), block.line - 1
    )
    report = io.StringIO()
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    runner.run(test, out=report.write, clear_globs=False)
    assert not runner.failures, report.getvalue()


def run_python(block: Block, namespace: dict[str, Any], session: Session) -> None:
    # Padded so that a traceback gives the line in the Markdown page.
    code = "\n" * (block.line - 1) + session.map(block.text)
    exec(compile(code, str(ROOT / block.page), "exec"), namespace)


def looks_like_a_command(block: Block) -> bool:
    lines = [line.strip() for line in block.text.splitlines()]
    if any(line.startswith("$ ") for line in lines):
        return True
    starts = ("meshplan ", "make ", ".venv/bin/", "python ")
    return block.lang == "" and any(line.startswith(starts) for line in lines)


def run_block(block: Block, namespace: dict[str, Any], session: Session, cwd: Path) -> None:
    assert block.lang in LANGS, f"unknown block language {block.lang!r}: use one of {LANGS}"
    if block.lang == "python":
        (run_doctest if block.is_doctest else run_python)(block, namespace, session)
    elif block.lang == "json":
        json.loads(block.text)
    elif block.lang in SHELL:
        run_shell(block, session, cwd)
    else:
        assert not looks_like_a_command(block), (
            "this block looks like a command: label it ```console (with $ prompts) or "
            "```bash so that it runs, or ```text if it is not one"
        )


def page_blocks(page: str) -> list[Block]:
    return blocks_of((ROOT / page).read_text(), page)


@pytest.mark.parametrize("pages", RUNS)
@pytest.mark.slow
def test_blocks_run(pages, session, tmp_path, monkeypatch):
    """Every block of the page, in order, in one namespace, in a fresh folder (pages joined
    by ``+``: one after the other, each in its own namespace and folder)."""
    for page in pages.split("+"):
        cwd = tmp_path / re.sub(r"\W", "_", page)
        cwd.mkdir()
        monkeypatch.chdir(cwd)
        # A real module, as dataclasses (and so Flax modules) look their class's module up.
        module = types.ModuleType("docs_" + re.sub(r"\W", "_", page))
        monkeypatch.setitem(sys.modules, module.__name__, module)
        for block in page_blocks(page):
            if not block.not_run:
                _run_or_fail(block, module.__dict__, session, cwd)


def _run_or_fail(block: Block, namespace: dict[str, Any], session: Session, cwd: Path) -> None:
    failure = None
    try:
        run_block(block, namespace, session, cwd)
    except AssertionError as e:
        failure = str(e)
    except Exception:
        failure = traceback.format_exc()
    if failure is not None:
        pytest.fail(f"{block.where} failed:\n{failure}", pytrace=False)


def test_blocks_skipped_only_by_marker_and_rarely():
    skipped = [b.where + ": " + str(b.not_run) for p in PAGES for b in page_blocks(p) if b.not_run]
    assert len(skipped) <= MAX_NOT_RUN, "too many blocks are not run:\n" + "\n".join(skipped)


PROSE_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")
NAME = re.compile(r"`(meshplan(?:\.\w+)+)(?![\w/])")
REPO_PATH = re.compile(r"`((?:src|tests|benchmarks|docs)/[\w/.*-]+)`")


def _prose(page: str) -> str:
    return PROSE_FENCE.sub("", (ROOT / page).read_text())


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES)
def test_links_and_names_exist(page):
    """Relative links, `meshplan.x.y` names and `src/...` paths in the prose all exist."""
    text = _prose(page)
    base = (ROOT / page).parent
    missing = []
    for target in LINK.findall(text):
        path = target.split("#")[0]
        if path and "://" not in path and not (base / path).exists():
            missing.append(f"link {target}")
    missing += [f"name {name}" for name in NAME.findall(text) if not _resolves(name)]
    for path in REPO_PATH.findall(text):
        if not list(ROOT.glob(path)):
            missing.append(f"path {path}")
    assert not missing, f"{page} names what does not exist: {missing}"


def test_readme_links_every_page():
    readme = (ROOT / "README.md").read_text()
    unlinked = [p for p in PAGES[1:] if f"]({p})" not in readme]
    assert not unlinked, f"README.md's docs list lacks {unlinked}"


def test_a_stale_planner_output_in_the_docs_fails():
    printed = "header\npredicted step 0.039 ms on 8 h100\nbest: 1x8 (6.9 s)\n"
    args = ["search", "--profile", "h100"]
    check_planner_output(
        ["...", "predicted step 0.039 ms on 8 h100", "best: 1x8 (1.0 s)"], printed, args
    )
    with pytest.raises(AssertionError, match="shown, but not printed"):
        check_planner_output(["predicted step 0.079 ms on 8 h100"], printed, args)
    with pytest.raises(AssertionError, match="in this order"):
        check_planner_output(["best: 1x8 (1.0 s)", "header"], printed, args)
