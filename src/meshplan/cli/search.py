"""``meshplan search``: meshes and logical rules for a model, ranked by predicted step time.

:func:`meshplan.search_rules` does the work: the built-in layouts and generated
meshes of 1 to 3 axes (``data``, ``fsdp``, ``tensor``) with rules, pruned by
the validator, symmetry and ``--budget``, priced by a hardware ``--profile``,
the first ``--top-k`` compiled (when this process has the devices) and, with
``--measure``, run. Nothing needs the devices otherwise: ``--devices 16384``
is planned on axis sizes alone. The best choice is printed as a ``meshplan
train`` command (:func:`train_command`: the command line is the CLI's, not the
library's); its rules are written to a JSON file only with ``--rules-out``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshplan._errors import MeshError, MeshplanError
from meshplan._text import human_seconds
from meshplan.cli.devices import PLATFORMS, use_cpu_backend
from meshplan.cli.factory import is_factory, load_factory
from meshplan.cli.inferred import (
    add_names_out_argument,
    names_flag,
    names_json,
    names_lines,
    write_names,
)
from meshplan.cli.names_file import INFER, add_names_argument, notes_text, read_names
from meshplan.cli.output import print_error, say
from meshplan.cli.plan import add_attention_argument, add_model_size_arguments, model_args_problem
from meshplan.cli.sizes import parse_bytes
from meshplan.cli.steps import example_of

HELP = (
    "Search meshes of --devices and logical rules for a model (built-in or --model "
    "pkg.module:factory), rank them by predicted step time under a hardware --profile, and "
    "print the best as a meshplan train command (--budget, --measure, --json)."
)

PROFILES = (
    "cpu",
    "a100",
    "h100",
    "h100_a3",
    "h200",
    "b200",
    "tpu_v4",
    "tpu_v5e",
    "tpu_v5p",
    "tpu_v6e",
)
ROLES = ("data", "fsdp", "tensor", "context", "expert")


def parse_profile(text: str) -> str:
    """``--profile``: a profile's name or a ``.json`` file of ``meshplan.HardwareProfile`` fields.

    Example:
        >>> from meshplan.cli.search import parse_profile
        >>> parse_profile("tpu_v5e"), parse_profile("mine.json")
        ('tpu_v5e', 'mine.json')
        >>> parse_profile("tpu")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --profile 'tpu' is not a profile: give one of cpu, a100, h100, h100_a3, h200, b200, tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e, or a .json file of HardwareProfile fields
    """
    if text in PROFILES or text.endswith(".json"):
        return text
    raise argparse.ArgumentTypeError(
        f"--profile {text!r} is not a profile: give one of {', '.join(PROFILES)}, or a .json "
        f"file of HardwareProfile fields"
    )


def parse_axes(text: str) -> dict[str, str]:
    """``--axes``: the roles the search uses and the names of their mesh axes.

    Each item is a role (``data``, ``fsdp``, ``tensor``, ``context``, ``expert``) or
    ``role=name``.

    Example:
        >>> from meshplan.cli.search import parse_axes
        >>> parse_axes("data,tensor"), parse_axes("data=dp,fsdp,tensor=tp")
        ({'data': 'data', 'tensor': 'tensor'}, {'data': 'dp', 'fsdp': 'fsdp', 'tensor': 'tp'})
        >>> parse_axes("model")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: --axes 'model': 'model' is not a role (data, fsdp, tensor, context, expert); write a role, or role=name to name its mesh axis, e.g. --axes data=dp,tensor=model
    """
    out: dict[str, str] = {}
    for item in (i.strip() for i in str(text).split(",")):
        if not item:
            continue
        role, _, name = (s.strip() for s in item.partition("="))
        if role not in ROLES:
            raise argparse.ArgumentTypeError(
                f"--axes {text!r}: {role!r} is not a role ({', '.join(ROLES)}); write a role, or "
                f"role=name to name its mesh axis, e.g. --axes data=dp,tensor=model"
            )
        if role in out or (name or role) in out.values() or not re.fullmatch(r"\w+", name or role):
            raise argparse.ArgumentTypeError(
                f"--axes {text!r}: each role once, each name once and a word (letters, digits, _)"
            )
        out[role] = name or role
    if not out:
        raise argparse.ArgumentTypeError("--axes is empty: give e.g. --axes data,fsdp,tensor")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="transformer",
        metavar="MODEL",
        help="transformer: the example Transformer (Flax Linen, default); transformer-nnx: the "
        "same in Flax NNX; mlp: the guide's MLP; llama: a published Llama decoder (--size 7b, "
        "70b, llama3-8b...; --seq default 2048, --batch default one sequence per device, "
        "--remat); or pkg.module:factory, your function returning "
        "(model, example_batch, loss, batches) as for meshplan train, (abstract_state, step_fn, "
        "example_batch) or (linen_module, example_batch[, loss])",
    )
    add_model_size_arguments(parser)
    add_names_argument(parser)
    parser.add_argument(
        "--devices",
        type=int,
        default=8,
        help="devices in the mesh, any number: searched on axis sizes alone (default 8)",
    )
    parser.add_argument(
        "--batch", type=int, default=None, help="global batch of the built-in models (default 32)"
    )
    parser.add_argument(
        "--seq", type=int, default=None, help="Transformer sequence length (default 128)"
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=1,
        metavar="N",
        help="the step accumulates the "
        "gradients of N microbatches of the batch: priced with the weights gathered and "
        "gradients reduce-scattered per microbatch, one microbatch's activations (default 1)",
    )
    parser.add_argument(
        "--profile",
        type=parse_profile,
        default="cpu",
        help="hardware the step time is predicted for: cpu (measured on this machine, default), "
        "a100, h100, h100_a3, h200, b200, tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e (published figures), or a "
        ".json file of meshplan.HardwareProfile fields",
    )
    add_attention_argument(parser)
    parser.add_argument(
        "--budget",
        type=parse_bytes,
        default=None,
        help="bytes one device may hold, e.g. 16GiB (default: the profile's memory)",
    )
    parser.add_argument(
        "--axes",
        type=parse_axes,
        default=None,
        help="roles of the searched mesh axes, and their names: e.g. data,tensor or "
        "data=dp,fsdp,tensor=tp (default data,fsdp,tensor)",
    )
    parser.add_argument(
        "--layouts",
        default=None,
        help="comma-separated built-in layouts or rules files always tried on (data, model) "
        "meshes, the pipeline layouts (pipeline, pp_fsdp, pp_tp) on pipeline x data meshes "
        "(default: every built-in layout; the pipelines where the model has a layer stack)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=3,
        help="candidates compiled to refine the prediction (when this process has the "
        "devices) and, with --measure, run (default 3)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="run the best --top-k for real on --devices devices and rank them by measured time",
    )
    parser.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="auto",
        help="devices --measure runs on: auto (accelerators, else emulated CPU devices), cpu, "
        "gpu, tpu",
    )
    parser.add_argument(
        "--rules-out",
        metavar="PATH",
        default=None,
        help="write the best choice's rules (JSON, with every name the model uses) here; "
        "nothing is written without it",
    )
    add_names_out_argument(parser)
    parser.add_argument("--rows", type=int, default=10, help="ranked rows shown (default 10)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead")


MAX_SEARCH_DEVICES = 16384
"""The most devices ``meshplan search`` searches (2**14): beyond, a search runs for many minutes."""


def devices_problem(devices: int | None) -> str | None:
    """Why ``--devices`` is too many to search, with the limit and the reason, or ``None``.

    The search lists every factorisation of the device count into 1 to 3 mesh axes
    (by trial division) and prices every rule set on each; both grow with the count:
    on a loaded 2-core machine 256 devices took 38 s, 4096 took 89 s, 65,536 ran past
    300 s, and 1,048,576 or the prime 1,000,000,007 gave no output in 150 s.

    Example:
        >>> from meshplan.cli.search import devices_problem
        >>> devices_problem(4096) is None
        True
        >>> print(devices_problem(1_000_000_007).splitlines()[0])
        --devices 1000000007 is more than meshplan search searches: at most 16,384 (2**14).
    """
    if devices is None or devices <= MAX_SEARCH_DEVICES:
        return None
    return (
        f"--devices {devices} is more than meshplan search searches: at most "
        f"{MAX_SEARCH_DEVICES:,} (2**14).\nThe search factorises the device count into 1 to 3 "
        f"mesh axes and prices every rule set on each mesh shape, and both grow with the "
        f"count (on 2 loaded cores 4096 devices took 89 s, 65,536 ran past 300 s; 1,048,576 "
        f"gave no output in 150 s).\nSearch at most {MAX_SEARCH_DEVICES:,} devices (e.g. --devices "
        f"{_smaller(devices)}), or call meshplan.search_rules yourself with the patience it "
        f"takes."
    )


def _smaller(devices: int) -> int:
    """The largest power of two up to :data:`MAX_SEARCH_DEVICES` (a count with many shapes)."""
    return min(MAX_SEARCH_DEVICES, 1 << (devices.bit_length() - 1))


def _flags_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the numbers and the model's flags, or ``None`` (fills defaults)."""
    least = {
        "devices": 1,
        "batch": 1,
        "seq": 1,
        "rows": 1,
        "top-k": 1 if args.measure else 0,
        "grad-accum": 1,
    }
    values = {
        "devices": args.devices,
        "batch": args.batch,
        "seq": args.seq,
        "rows": args.rows,
        "top-k": args.top_k,
        "grad-accum": args.grad_accum,
    }
    bad = [f"--{k} {v}" for k, v in values.items() if v is not None and v < least[k]]
    if bad:
        return (
            f"{', '.join(bad)}: --devices, --batch and --top-k must be at least 1 (--seq and "
            f"--rows too; --top-k may be 0 without --measure: nothing compiled).\nPass e.g. "
            f"--devices 8 --batch 32 --seq 128 --top-k 3."
        )
    # (--measure needs the devices themselves: their own limit is checked, and said, first.)
    too_many = None if args.measure else devices_problem(args.devices)
    if too_many is not None:
        return too_many
    problem = model_args_problem(args)
    if problem is not None:
        return problem
    if is_factory(args.model):
        own: dict[str, int] = {}
    elif args.model == "llama":
        own = {"batch": args.devices, "seq": args.seq}
    else:
        from meshplan.models.registry import EXAMPLE_MODELS

        sequence = EXAMPLE_MODELS[args.model].sequence  # known: model_args_problem asked
        own = {"batch": 32, "seq": 128} if sequence else {"batch": 32}
    given = [f"--{k}" for k in ("batch", "seq") if k not in own and getattr(args, k) is not None]
    if given:
        flags = " and ".join(given)
        where = "your factory's example batch" if is_factory(args.model) else "the MLP's --depth"
        return (
            f"{flags} {'is' if len(given) == 1 else 'are'} not used with --model {args.model} "
            f"({where} sets the batch): it would be ignored.\nLeave {flags} out, or size the "
            f"batch in {'your factory' if is_factory(args.model) else 'a Transformer model'}."
        )
    for k, v in own.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return None


def _rename(result: Any, names: dict[str, str]) -> None:
    """Name the searched rows' mesh axes as ``--axes`` asks (role -> name)."""
    if all(k == v for k, v in names.items()):
        return

    def axes(a: Any) -> Any:
        if isinstance(a, tuple):
            return tuple(names.get(x, x) for x in a)
        return names.get(a, a) if isinstance(a, str) else a

    for row in result.rows:
        if row.layout == "searched":
            row.mesh = {names.get(a, a): s for a, s in row.mesh.items()}
            row.rules = tuple((n, axes(a)) for n, a in row.rules)


def train_command(row: Any, rules_path: str = "rules.json") -> str:
    """The ``meshplan train`` command of a search row, its rules read from ``rules_path``.

    Example:
        >>> from meshplan._search.search.result import SearchRow
        >>> from meshplan.cli.search import train_command
        >>> train_command(SearchRow({"data": 2, "tensor": 4}, (("mlp", "tensor"),)), "r.json")
        'meshplan train --mesh 2x4 --axes data,tensor --rules r.json'

        A pipelined row's command carries its microbatches (``--microbatches``).
    """
    command = f"meshplan train --mesh {row.mesh_text} --axes {row.axes_text} --rules {rules_path}"
    if row.pipeline is not None:  # the schedule the row was priced with
        command += f" --microbatches {row.pipeline.schedule.microbatches}"
    return command


def _train_command(
    args: argparse.Namespace, result: Any, trainable: bool
) -> tuple[str | None, Path | None]:
    """Writes the best row's rules (only with ``--rules-out``); its ``meshplan train`` command
    for a model ``meshplan train`` trains (naming ``rules.json`` when nothing was written)."""
    best = result.best
    if best is None:
        return None, None
    path = Path(args.rules_out) if args.rules_out else None
    if path is not None:
        if path.parent != Path(""):
            path.parent.mkdir(parents=True, exist_ok=True)
        best.write_rules(str(path))
    command = train_command(best, str(path or "rules.json"))
    if not trainable:
        return None, path
    names = names_flag(args, result, write_names(args, result))
    extra = ["--model", args.model] + (["--names", names] if names else [])
    if not is_factory(args.model):  # a factory's own batches set the batch and the sequence
        extra += ["--size", args.size, "--batch", str(args.batch), "--seq", str(args.seq)]
    return f"{command} {' '.join(extra)}", path


def _groups(rows: list[Any]) -> list[list[Any]]:
    """Rows of one layout (a built-in one, or the same generated rules) on mesh shapes of the
    same axes with the same prediction (step time, memory, collectives, measured time), in
    rank order: shown as one row listing the shapes."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for r in rows:
        c = r.cost
        rules = r.short_rules if r.layout == "searched" else ""  # a built-in's, on any shape
        key = (
            r.layout,
            r.axes_text,
            rules,
            r.measured_s,
            c.step_s,
            c.memory_bytes,
            tuple(sorted(c.comm_bytes.items())),
        )
        groups.setdefault(key, []).append(r)
    return list(groups.values())


def _shown(result: Any, rows: int) -> list[list[Any]]:
    """The groups of rows the table shows (:func:`_groups`), the first ``rows``."""
    return _groups([r for r in result.ok if r.cost is not None])[:rows]


def _table(result: Any, groups: list[list[Any]]) -> Table:
    from meshplan._search.predict.report import prediction_fields
    from meshplan._text import human_bytes

    ok = [g[0] for g in groups]
    measured_any = any(r.measured_s is not None for r in ok)
    # A pipeline's sends between stages are listed under the table, with its schedule.
    kinds = sorted(
        {k for r in ok if r.cost and r.pipeline is None for k, v in r.cost.comm_bytes.items() if v}
    )
    table = Table(box=None, header_style="bold", pad_edge=False)
    unit = f"{result.tokens_unit}/s"
    columns = [
        ("#", "right"),
        ("mesh", "left"),
        ("axes", "left"),
        ("predicted", "right"),
        ("measured", "right"),
        (unit, "right"),
        ("MFU", "right"),
    ]
    if measured_any:  # the measured figures beside the predicted ones, each labelled
        columns += [(f"measured {unit}", "right"), ("measured MFU", "right")]
    columns += [
        ("state", "right"),
        ("activations", "right"),
        ("temporaries", "right"),
        ("memory/device", "right"),
    ]
    for name, justify in columns:
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for kind in kinds:
        table.add_column(kind, justify="right")
    table.add_column("rules (what splits)")
    table.add_column("layout")
    for group in groups:
        r, c = group[0], group[0].cost
        measured = "-" if r.measured_s is None else f"{r.measured_s * 1e3:.3f} ms"
        f = prediction_fields(
            c,
            result.tokens,
            result.devices,
            result.profile,
            result.budget_bytes,
            result.tokens_unit,
        )
        tps = "-" if f["tokens_per_s"] is None else f"{f['tokens_per_s']:,.0f}"
        mfu = "-" if f["mfu"] is None else f"{f['mfu']:.1%}"
        cells = [
            str(r.rank),
            ", ".join(g.mesh_text for g in group),
            r.axes_text,
            human_seconds(c.step_s),
            measured,
            tps,
            mfu,
        ]
        if measured_any:
            m = r.measured_s
            cells += [
                "-" if not m or not result.tokens else f"{result.tokens / m:,.0f}",
                "-" if not m else f"{c.flops_per_device / (m * result.profile.peak_flops):.1%}",
            ]
        table.add_row(
            *cells,
            human_bytes(c.state_bytes),
            human_bytes(c.activation_bytes),
            human_bytes(c.temporary_bytes + c.batch_bytes),
            f"{human_bytes(c.memory_bytes)} / {human_bytes(result.budget_bytes)}",
            *[human_bytes(c.comm_bytes.get(k, 0)) for k in kinds],
            r.short_rules,
            r.layout if r.layout != "searched" else "",
        )
    return table


def _tie_lines(result: Any, groups: list[list[Any]]) -> list[str]:
    """A line for each tie among the rows the table shows: rows predicted within 3% of each
    other, ordered by a fixed order, not by time (a faster row may follow a slower one)."""
    from meshplan._search.search.rule_search import TIE, ties

    if result.ranked_by != "predicted" or any(r.measured_s is not None for r in result.ok):
        return []
    shown = {g[0].rank for g in groups}
    lines = []
    for group in ties(result.ok):
        ranks = [k for k in group if k in shown]
        if len(ranks) > 1:
            listed = ", ".join(f"#{k}" for k in ranks[:-1]) + f" and #{ranks[-1]}"
            lines.append(
                f"tie: {listed} predicted within {TIE:.0%} (closer than the model tells "
                "apart): built-in layouts first, then fewer mesh axes, smaller waited-on "
                "groups, less memory"
            )
    return lines


def _schedule_lines(groups: list[list[Any]]) -> list[str]:
    """The schedule of each pipelined row the table shows: stages, microbatches, bubble and
    the sends between stages."""
    shown = [g[0] for g in groups]
    return [
        f"  #{r.rank} {r.mesh_text} {r.axes_text} {r.layout}: {r.schedule_text}"
        for r in shown
        if r.pipeline is not None
    ]


def _verdict_lines(result: Any) -> list[str]:
    """One line per role (``context``, ``expert``, ``pipeline``): proposed or not, and why."""
    from meshplan._search.search.verdicts import search_verdicts

    return [
        f"  {v.role}: {'proposed' if v.proposed else 'not proposed'} ({v.kind}): {v.reason}"
        for v in search_verdicts(result)
    ]


def _counts_line(result: Any, top_k: int) -> str:
    counts = result.counts
    pruned = ", ".join(f"{k} {v}" for k, v in counts["pruned"].items() if v) or "none"
    line = (
        f"candidates: enumerated {counts['enumerated']}; pruned {pruned}; scored "
        f"{counts['scored']}; compiled {counts['compiled']}; measured {counts['measured']} "
        f"({result.seconds:.1f} s)"
    )
    if top_k and not counts["compiled"] and result.ok:
        import jax

        line += (
            f"\nnot compiled: the {result.devices}-device mesh needs that many devices and this "
            f"process has {jax.device_count()}; --measure finds or emulates them"
        )
    return line


def _load(args: argparse.Namespace) -> tuple[str, Any, Any, Any, bool, list[str]]:
    """``(what, abstract_state, step_fn, example_batch, trainable, notes)`` of ``--model``:
    ``trainable`` when ``meshplan train`` trains it (the example Transformers, and a factory
    of the four-value form); ``notes``: what naming by ``--names`` warned of (the arrays no
    pattern matches, the patterns that match none), as ``meshplan plan`` says them."""
    if is_factory(args.model):
        names = None if args.names == INFER else read_names(args.names, args.model)
        loaded = load_factory(args.model, names)  # with no names: search_rules infers them
        return (
            loaded.what,
            loaded.abstract_state,
            loaded.step_fn,
            loaded.example_batch,
            loaded.trainable is not None,
            list(loaded.notes),
        )
    if args.model == "llama":
        from meshplan.cli.llama_model import llama_step_of

        return (*llama_step_of(args, args.batch), False, [])
    from meshplan.models.registry import EXAMPLE_MODELS

    built = example_of(args)
    return (
        built.what,
        built.model.abstract_state(),
        built.model.step,
        built.batch(args.batch, getattr(args, "seq", None) or 0),
        EXAMPLE_MODELS[args.model].sequence,  # meshplan train trains the sequence models
        [],
    )


def run(args: argparse.Namespace) -> int:
    # Piped output (a file, a pager, a test) gets a wide table rather than 80 columns.
    out = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 180)
    err = Console(file=sys.stderr, width=None if sys.stderr.isatty() else 180)
    problem = _flags_problem(args)
    if problem is not None:
        print_error(problem, err)
        return 2
    try:
        if args.measure:  # running needs the devices: the accelerators, or emulated CPUs
            from meshplan.cli.devices import found_devices, select_platform

            select_platform(args.platform, args.devices)
            choice = found_devices(args.platform, needed=args.devices)
            say(err, choice.describe())
        else:  # searching needs only the count
            use_cpu_backend()
        if args.devices >= 1024 and not args.json:  # never silent for a minute or more
            say(
                err,
                f"searching {args.devices} devices: every mesh shape of 1 to 3 axes and "
                f"its rule sets; this takes a minute or more",
            )
    except MeshError as e:
        print_error(e, err)
        return 2

    import meshplan
    from meshplan.layouts import get_layout

    try:
        layouts = None
        if args.layouts:
            names = [n.strip() for n in args.layouts.split(",") if n.strip()]
            layouts = {name: get_layout(name) for name in names}
        what, state, step, batch, trainable, notes = _load(args)
        for line in notes_text(notes):  # said first, as meshplan plan says them
            say(err, line)
        roles = tuple(args.axes) if args.axes else ROLES
        result = meshplan.search_rules(
            args.devices,
            state,
            step,
            batch,
            profile=args.profile,
            memory_budget_bytes=args.budget,
            attention=args.attention,
            layouts=layouts,
            roles=roles,
            compile_top=args.top_k,
            measure=args.measure,
            measure_top=args.top_k,
            microbatches=args.grad_accum,
        )
        advice = None
        if result.best is None:  # nothing fits: the closest, and what would make it fit
            work = meshplan.trace_workload(step, state, batch, read_constraints=True)
            advice = _advice(args, result, work, state)
        if args.axes:
            _rename(result, args.axes)
        command, path = _train_command(args, result, trainable)
    except (MeshplanError, OSError) as e:
        print_error(e, err)
        return 2
    if args.json:
        data = {
            "model": what,
            **result.to_dict(),
            "rules_file": None if path is None else str(path),
            "train_command": command,
        }
        from meshplan._search.search.verdicts import search_verdicts

        data["verdicts"] = [v.to_dict() for v in search_verdicts(result)]
        if result.path_rules is not None:  # names inferred from the step
            data["path_rules"] = names_json(result)
        if advice is not None:
            data["closest"] = advice[0]
            data["fit_changes"] = [{"flag": f, "fits": ok, **d} for f, ok, _, d in advice[2]]
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
        return 0 if result.best is not None else 1
    _print(out, args, what, result, command, path, advice)
    return 0 if result.best is not None else 1


Advice = tuple[dict[str, Any] | None, str | None, list[tuple[str, bool, str, dict[str, Any]]]]
"""The closest candidate (data, text) and each change tried: ``(flag, fits, line, data)``."""


def _advice(args: argparse.Namespace, result: Any, work: Any, state: Any) -> Advice:
    """When nothing fits: the closest candidate and the changes that would make it fit, each
    re-priced (:mod:`meshplan.cli.fit_advice`)."""
    from meshplan.cli.fit_advice import closest, fit_changes, row_text

    row = closest(result, work)
    if row is None:
        return None, None, []
    step_of: Any = None
    if args.model == "llama":
        from meshplan.cli.llama_model import llama_step_of

        def step_of(batch: int = args.batch, remat: str = args.remat) -> tuple[Any, Any, Any]:
            return llama_step_of(args, batch, remat=remat)[1:]

    elif not is_factory(args.model):
        built = example_of(args)

        def step_of(batch: int = args.batch, remat: str | None = None) -> tuple[Any, Any, Any]:
            return state, built.model.step, built.batch(batch, getattr(args, "seq", None) or 0)

    changes = fit_changes(args, result, row, work, step_of)
    return row.to_dict(result), row_text(row), changes


def _print(
    out: Console,
    args: argparse.Namespace,
    what: str,
    result: Any,
    command: str | None,
    path: Path | None,
    advice: Advice | None = None,
) -> None:
    from meshplan._text import human_bytes

    batch = f", batch {result.batch}" if result.batch else ""
    say(
        out,
        (what, "bold"),
        f" · {result.devices} devices · profile {result.profile.name}"
        f"{' (flash attention)' if result.profile.fused_attention else ''} · budget "
        f"{human_bytes(result.budget_bytes)}/device{batch}",
    )
    if result.ok:
        groups = _shown(result, args.rows)
        out.print(_table(result, groups))
        for line in _tie_lines(result, groups):
            say(out, line)
        schedules = _schedule_lines(groups)
        if schedules:
            say(out, ("pipelines", "bold"), " (the layers cut into stages over 'pipeline'):")
            for line in schedules:
                say(out, line)
    rejected = sorted(  # the reasons that teach something first; symmetric ones last
        (r for r in result.rows if r.status == "pruned"),
        key=lambda r: r.pruned_by == "symmetric",
    )
    if rejected:
        shown = rejected[:8]
        say(out, ("rejected", "bold"), f" ({len(rejected)}, {len(shown)} shown):")
        for r in shown:
            name = f" {r.layout}" if r.layout != "searched" else f" {r.short_rules}"
            say(out, f"  {r.mesh_text} {r.axes_text}{name}: {r.reason}")
        if len(rejected) > len(shown):
            say(out, f"  … and {len(rejected) - len(shown)} more (--json lists them all)")
    say(out, _counts_line(result, args.top_k))
    if result.ok:
        say(out, ("roles", "bold"), " (why the best uses them or not):")
        for line in _verdict_lines(result):
            say(out, line, soft_wrap=True)  # one line each, however long
    best = result.best
    if best is None:
        say(out, ("best: none", "bold"), " (no candidate passes and fits the budget)")
        if advice is not None and advice[1] is not None:
            say(out, ("closest: ", "bold"), advice[1])
            say(
                out,
                "what would make it fit (its rules searched again on every mesh shape of "
                "its axes, re-priced):",
            )
            for flag, _, line, _ in advice[2]:
                say(out, f"  {flag}: {line}")
        return
    assert best.cost is not None
    say(
        out,
        ("best: ", "bold"),
        f"{best.mesh_text} {best.axes_text} {best.short_rules} · predicted "
        f"{human_seconds(best.cost.step_s)}/step, {human_bytes(best.cost.memory_bytes)}/device",
    )
    written = Path(args.names_out) if args.names_out and result.path_rules is not None else None
    for line in names_lines(result, written):
        say(out, line)
    if path is None:
        say(out, "rules not written: pass --rules-out PATH to write them (JSON)")
        path = Path("rules.json")
        train_it = "train it, after --rules-out rules.json:  "
    else:
        say(out, f"rules written to {path}")
        train_it = "train it:  "
    if command is not None:
        say(out, train_it, (command, "bold"))
    else:
        say(
            out,
            f"meshplan train trains the example Transformers only: use these rules with your "
            f"own loop, meshplan.layouts.get_layout({str(path)!r}) on a mesh "
            f"{best.mesh_text} of axes ({best.axes_text}).",
        )
