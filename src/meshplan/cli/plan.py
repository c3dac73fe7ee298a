"""``meshplan plan``: the sharding plan of an example model on a mesh, under a rule set."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from meshplan._errors import MeshError, MeshplanError, error_for
from meshplan._spmd.rules import LogicalRules
from meshplan.cli.devices import mesh_flag_advice, use_cpu_backend
from meshplan.cli.factory import is_factory, load_factory, model_problem
from meshplan.cli.mesh_text import parse_mesh_shape
from meshplan.cli.names_file import add_names_argument, no_names_text, notes_text, read_names
from meshplan.cli.output import print_error, say
from meshplan.cli.sizes import parse_bytes

HELP = (
    "Show where every parameter and optimizer state of an example model goes on a mesh "
    "under a rule set, and check the plan (--json, --png, --strict)."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        default="mlp",
        metavar="MODEL",
        help="mlp: the guide's MLP (logical names, default); transformer: the example "
        "Transformer (Flax Linen); transformer-nnx: the same in Flax NNX; llama: a published "
        "Llama decoder (--size 7b, 70b, llama3-8b...; with --profile, --seq, --batch, --remat); or "
        "pkg.module:factory, your function returning (model, example_batch, loss, batches) as "
        "for meshplan train, (abstract_state, step_fn, example_batch) or (linen_module, "
        "example_batch[, loss]) (see docs/layouts.md)",
    )
    parser.add_argument(
        "--mesh",
        default="2x4",
        help="mesh axis sizes, e.g. 2x4 (default), 4x2, 8 (= 8x1), or 2x2x2 with --axes",
    )
    parser.add_argument(
        "--axes",
        default=None,
        help="comma-separated mesh axis names (default data,model; a built-in layout's own "
        "axes for the pipeline, context and expert layouts, e.g. pipeline,data)",
    )
    parser.add_argument(
        "--rules",
        default=None,
        help="a built-in rule set (guide, data_parallel, fsdp, tensor_parallel, fsdp_tp), "
        "or a .py file defining RULES, or a .json file of [name, axes] pairs "
        "(default: guide for the MLP, fsdp for llama, fsdp_tp for the Transformers and "
        "factories)",
    )
    add_model_size_arguments(parser)
    add_names_argument(parser)
    parser.add_argument(
        "--profile",
        default=None,
        help="also predict the step on this hardware, without devices: its time, tokens/s, "
        "MFU and memory per device (state, activations, temporaries) against the budget; a "
        "profile name (a100, h100, h100_a3, h200, b200, tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e, cpu) or a "
        ".json file of meshplan.HardwareProfile fields",
    )
    add_attention_argument(parser, "with --profile: ")
    parser.add_argument(
        "--devices",
        type=int,
        default=None,
        help="the device count (checked against --mesh, whose sizes multiply to it)",
    )
    parser.add_argument(
        "--budget",
        type=parse_bytes,
        default=None,
        help="bytes one device may hold, e.g. 16GiB (default: the profile's memory)",
    )
    parser.add_argument(
        "--batch",
        type=int,
        default=None,
        help="global batch of a built-in model's step, with --profile (default 32)",
    )
    parser.add_argument(
        "--seq",
        type=int,
        default=None,
        help="Transformer sequence length, with --profile (default 128)",
    )
    parser.add_argument(
        "--grad-accum",
        type=int,
        default=None,
        metavar="N",
        help="the step accumulates the "
        "gradients of N microbatches of the batch, with --profile: the weights gathered and "
        "gradients reduce-scattered per microbatch, one microbatch's activations (default 1)",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="a pipeline's microbatches "
        "(--rules pipeline, pp_fsdp, pp_tp), with --profile: the schedule's bubble, the sends "
        "between stages and each stage's memory priced (at least the stages)",
    )
    parser.add_argument(
        "--pipeline-repeats",
        type=int,
        default=None,
        metavar="V",
        help="layer groups per "
        "pipeline stage (the circular schedule), with --microbatches (default 1)",
    )
    parser.add_argument(
        "--experts",
        type=int,
        metavar="E",
        help="the Transformers with a mixture-of-experts block of E experts in each layer "
        "(e.g. with --rules expert_parallel --axes data,expert: each device's experts)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead")
    parser.add_argument("--png", metavar="PATH", help="also draw the plan into a PNG")
    parser.add_argument("--full", action="store_true", help="list every leaf in the table")
    parser.add_argument(
        "--strict",
        action="store_true",
        help="also list the errors as one error message on stderr (a plan with errors "
        "exits with status 1 either way)",
    )


def load_rules(spec: str | None, model: str) -> tuple[str, Any]:
    """``(label, rules)`` from a built-in layout name or a rules file (:mod:`meshplan.layouts`).

    Example:
        >>> from meshplan.cli.plan import load_rules
        >>> load_rules(None, "mlp")
        ('guide', (('batch', 'data'), ('hidden', 'model')))
    """
    from meshplan.layouts import get_layout

    if spec is None:
        from meshplan.models.registry import EXAMPLE_MODELS

        entry = EXAMPLE_MODELS.get(model)
        spec = "fsdp_tp" if entry is None else entry.rules  # a factory: fsdp_tp
        spec = "fsdp" if model == "llama" else spec  # MaxText's default
    return spec, get_layout(spec)


def abstract_state(args: argparse.Namespace) -> tuple[str, Any]:
    """``(description, abstract TrainState)`` of the chosen model, with Adam.

    For ``transformer-nnx`` the state's ``params`` is the model's abstract
    ``nnx.State`` (its variables carry the logical names), as ``meshplan train
    --model transformer-nnx`` creates it.

    Example:
        >>> import argparse
        >>> from meshplan.cli.plan import abstract_state
        >>> what, state = abstract_state(argparse.Namespace(model="transformer-nnx", size="tiny"))
        >>> what, state.params["layers"]["mlp"]["wi"].out_sharding
        ('Transformer (tiny, Flax NNX)', ('layer', 'embed', 'mlp'))
    """
    from meshplan.cli.steps import example_of

    if is_factory(args.model):
        loaded = load_factory(args.model)
        return loaded.what, loaded.abstract_state
    built = example_of(args)
    return built.what, built.model.abstract_state()


def _prediction_problem(args: argparse.Namespace, shape: dict[str, int]) -> str | None:
    """What is wrong with ``--devices``, ``--batch``, ``--seq`` and ``--budget``, or ``None``."""
    import math

    devices = math.prod(shape.values())
    if args.devices is not None and args.devices != devices:
        return (
            f"--devices {args.devices} but --mesh {args.mesh} has {devices} devices.\nPass a "
            f"mesh whose sizes multiply to {args.devices}, or --devices {devices}."
        )
    keys = (
        "batch",
        "seq",
        "budget",
        "devices",
        "grad_accum",
        "microbatches",
        "pipeline_repeats",
        "attention",
    )
    given = [f"--{k.replace('_', '-')}" for k in keys if getattr(args, k, None)]
    if args.profile is None and [g for g in given if g != "--devices"]:
        return (
            f"{', '.join(g for g in given if g != '--devices')} size the predicted step: they "
            f"need --profile.\nPass --profile (e.g. --profile tpu_v5e), or leave them out."
        )
    if is_factory(args.model) and (args.batch or args.seq):
        return (
            "--batch and --seq size the built-in models' step; your factory's example batch "
            "sets yours.\nLeave them out."
        )
    for k in ("batch", "seq", "grad_accum", "microbatches", "pipeline_repeats"):
        v = getattr(args, k, None)
        if v is not None and v < 1:
            flag = f"--{k.replace('_', '-')}"
            return f"{flag} {v}: it must be at least 1.\nPass e.g. --batch 32 --seq 128."
    return None


def _predict(
    args: argparse.Namespace, loaded: Any, state: Any, shape: dict[str, int], rules: LogicalRules
) -> dict[str, Any]:
    """The prediction's fields (:mod:`meshplan._search.predict.report`) of the step on ``shape``:
    :func:`meshplan.predict`'s, as :func:`meshplan.search_rules` prices each row."""
    import meshplan
    from meshplan.cli.steps import step_and_batch

    if loaded is not None:
        step, batch = loaded.step_fn, loaded.example_batch
    else:
        args.batch = args.batch or 32
        args.seq = args.seq or 128
        step, batch = step_and_batch(args)
    prediction = meshplan.predict(
        state,
        step,
        batch,
        mesh=shape,
        rules=rules,
        profile=args.profile,
        memory_budget_bytes=args.budget,
        attention=getattr(args, "attention", None),
        microbatches=getattr(args, "grad_accum", None) or 1,
        pipeline_microbatches=getattr(args, "microbatches", None),
        pipeline_repeats=getattr(args, "pipeline_repeats", None) or 1,
    )
    return prediction.to_dict()


def abstract_mesh(shape: dict[str, int]) -> Any:
    """The mesh as axis names and sizes only: a plan never needs devices.

    A ``jax.sharding.AbstractMesh`` with ``Auto`` axes, so a 128x128 mesh is
    planned without emulating 16,384 devices (the plan numbers devices
    ``0..n-1`` in mesh order, as ``jax.make_mesh`` does on CPU).

    Example:
        >>> from meshplan.cli.plan import abstract_mesh
        >>> abstract_mesh({"data": 128, "model": 128})
        AbstractMesh('data': 128, 'model': 128, axis_types=(Auto, Auto))
    """
    import jax

    return jax.sharding.AbstractMesh(
        tuple(shape.values()),
        tuple(shape),
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
    )


_MLP_DEFAULTS = {"layers": 4, "depth": 1024, "scan": False}
_TRANSFORMER_DEFAULTS = {"size": "tiny"}


def add_attention_argument(parser: argparse.ArgumentParser, when: str = "") -> None:
    """``--attention``: how the step's attention is priced (``meshplan.predict``'s ``attention``)."""
    from meshplan._search.predict.profiles import ATTENTION

    parser.add_argument(
        "--attention",
        choices=ATTENTION,
        default=None,
        help=f"{when}how the step's attention runs: flash (one fused kernel, as MaxText, "
        "Megatron-LM and llm-foundry call one) or xla (as written: the scores in memory, "
        "what XLA makes of jax.nn.dot_product_attention; the default)",
    )


def add_model_size_arguments(parser: argparse.ArgumentParser) -> None:
    """``--size`` (the Transformers) and ``--layers``/``--depth``/``--scan`` (the MLP).

    Their defaults are applied by :func:`model_args_problem`, which can so tell a flag
    given for the other model (refused) from one left out.
    """
    parser.add_argument("--layers", type=int, default=None, help="MLP layers (default 4)")
    parser.add_argument("--depth", type=int, default=None, help="MLP width (default 1024)")
    parser.add_argument(
        "--scan", action="store_true", default=None, help="stack MLP layers with nn.scan"
    )
    parser.add_argument(
        "--size",
        default=None,
        help="Transformer preset (tiny, small, base; default tiny), or --model llama's published "
        "size (1b, 7b, 8b, 13b, 70b, 405b, llama2-7b, llama3-70b, maxtext-16b...; default 7b)",
    )
    parser.add_argument(
        "--remat",
        default=None,
        metavar="POLICY",
        help="--model llama's rematerialisation: none (default), full, dots, minimal, "
        "full_block (the whole layer rerun, as PyTorch's checkpoint)",
    )


def model_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--size``, ``--layers`` or ``--depth`` of ``args``, or ``None``.

    A flag of the other model is refused (it would be ignored); the chosen model's
    flags left out get their defaults, filled into ``args``.

    Example:
        >>> import argparse
        >>> from meshplan.cli.plan import model_args_problem
        >>> args = argparse.Namespace(model="mlp", layers=0, depth=None, scan=None, size=None)
        >>> print(model_args_problem(args))
        --layers 0: the MLP needs at least 1 layer.
        Pass --layers N with N >= 1 (default 4).
        >>> args = argparse.Namespace(model="mlp", layers=None, depth=None, scan=None, size="huge")
        >>> print(model_args_problem(args))
        --size is a flag of the Transformers, not of --model mlp: it would be ignored.
        Pass --model transformer (or transformer-nnx) with --size, or leave --size out.
    """
    if args.model == "llama":
        from meshplan.cli.llama_model import llama_args_problem

        return llama_args_problem(args)
    if getattr(args, "remat", None) is not None:
        return (
            f"--remat is a flag of --model llama, not of --model {args.model}: it would be "
            f"ignored.\nLeave --remat out, or pass --model llama."
        )
    problem = model_problem(args.model)
    if problem is not None:
        return problem
    if is_factory(args.model):
        given = [
            f"--{name}"
            for name in (*_MLP_DEFAULTS, *_TRANSFORMER_DEFAULTS)
            if getattr(args, name, None) is not None
        ]
        if given:
            return (
                f"{', '.join(given)} {'sizes' if len(given) == 1 else 'size'} the built-in "
                f"models, not --model {args.model}: it would be ignored.\nSize the model in "
                f"your factory, or leave {', '.join(given)} out."
            )
        return None
    from meshplan.models.registry import EXAMPLE_MODELS

    transformer = EXAMPLE_MODELS[args.model].sequence  # known: model_problem asked
    own, other = (
        (_TRANSFORMER_DEFAULTS, _MLP_DEFAULTS)
        if transformer
        else (_MLP_DEFAULTS, _TRANSFORMER_DEFAULTS)
    )
    given = [f"--{name}" for name in other if getattr(args, name, None) is not None]
    if given:
        flags = ", ".join(given)
        if transformer:
            return (
                f"{flags} {'is a flag' if len(given) == 1 else 'are flags'} of the MLP, not of "
                f"--model {args.model}: {'it' if len(given) == 1 else 'they'} would be ignored.\n"
                f"Pass --size (tiny, small) to size the Transformer, or --model mlp."
            )
        return (
            f"{flags} is a flag of the Transformers, not of --model {args.model}: it would be "
            f"ignored.\nPass --model transformer (or transformer-nnx) with --size, or leave "
            f"--size out."
        )
    for name, default in {**own, **other}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    if transformer:
        from meshplan.models.transformer import CONFIGS

        if args.size not in CONFIGS:
            names = ", ".join(CONFIGS)
            return (
                f"--size {args.size!r} is not a Transformer preset; the presets are {names}.\n"
                f"Pass --size " + " or --size ".join(CONFIGS) + "."
            )
        return None
    if args.layers < 1:
        return (
            f"--layers {args.layers}: the MLP needs at least 1 layer.\n"
            f"Pass --layers N with N >= 1 (default 4)."
        )
    if args.depth < 1:
        return (
            f"--depth {args.depth}: the MLP's width must be at least 1.\n"
            f"Pass --depth N with N >= 1 (default 1024)."
        )
    return None


MAX_PLAN_DEVICES = 2**20
"""The most devices ``meshplan plan`` lays a model out on (1,048,576)."""


def mesh_size_problem(text: str, shape: dict[str, int]) -> None:
    """Refuses a mesh of more than :data:`MAX_PLAN_DEVICES` devices, with the limit and why.

    A plan lists every device's bytes and draws the mesh device by device, so its
    time and memory grow with the device count: 4096x4096 (16.8 million devices)
    took 54 s; 10000x10000 passed 10 GB of memory with no output. The largest machines
    built have about 10**5 accelerators, so the bound leaves room above them.

    Raises:
        MeshError: code ``'mesh-too-large'``.

    Example:
        >>> import meshplan
        >>> from meshplan.cli.plan import mesh_size_problem
        >>> mesh_size_problem("1024x1024", {"data": 1024, "model": 1024})  # at the limit
        >>> try:
        ...     mesh_size_problem("10000x10000", {"data": 10000, "model": 10000})
        ... except meshplan.MeshError as e:
        ...     print(e.problems[0].code, str(e).split(":")[0])
        mesh-too-large --mesh 10000x10000 has 100,000,000 devices
    """
    devices = math.prod(shape.values())
    if devices <= MAX_PLAN_DEVICES:
        return
    raise error_for(
        MeshError,
        "mesh-too-large",
        "--mesh",
        f"--mesh {text} has {devices:,} devices: meshplan plan lays out at most "
        f"{MAX_PLAN_DEVICES:,} (2**20). A plan counts the bytes of every device, so its time "
        f"and memory grow with the device count (4096x4096 took 54 s; 10000x10000 passed "
        f"10 GB with no output), and the largest machines have about 100,000 accelerators",
        f"Pass a mesh of at most {MAX_PLAN_DEVICES:,} devices, e.g. --mesh 1024x1024.",
    )


def png_problem(path: str | None) -> None:
    """Refuses a ``--png`` path that is a folder, or whose folder is missing, before any work.

    Raises:
        MeshplanError: code ``'png-path'``.

    Example:
        >>> import meshplan, tempfile
        >>> from meshplan.cli.plan import png_problem
        >>> try:
        ...     png_problem(tempfile.gettempdir())
        ... except meshplan.MeshplanError as e:
        ...     print(e.problems[0].code)
        png-path
    """
    if path is None:
        return
    p = Path(path)
    why = None
    if p.is_dir():
        why = "is a folder"
    elif not p.absolute().parent.is_dir():
        why = f"is in a folder that does not exist ({str(p.absolute().parent)!r})"
    if why is not None:
        raise error_for(
            MeshplanError,
            "png-path",
            "--png",
            f"--png {path!r} {why}: the picture is written to a file",
            f"Pass a file path, e.g. --png {str(p / 'plan.png') if p.is_dir() else 'plan.png'}.",
        )


def _axes(args: argparse.Namespace) -> str | None:
    """``--axes``, or the axes a built-in layout is written for where it has its own
    (``pipeline,data`` for ``--rules pipeline``, ``data,context`` for ``context_parallel``...),
    as ``meshplan train`` reads them."""
    from meshplan.layouts import CONTEXT_EXPERT_LAYOUTS, LAYOUT_AXES

    if args.axes is None and args.rules in CONTEXT_EXPERT_LAYOUTS:
        return ",".join(LAYOUT_AXES[args.rules])
    return str(args.axes) if args.axes is not None else None


def run(args: argparse.Namespace) -> int:
    # Piped output (a file, a pager, a test) gets a wide table rather than 80 columns.
    out = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 180)
    err = Console(file=sys.stderr, width=None if sys.stderr.isatty() else 180)
    try:
        shape = parse_mesh_shape(args.mesh, _axes(args))
        mesh_size_problem(args.mesh, shape)
        png_problem(args.png)
    except MeshplanError as e:
        print_error(mesh_flag_advice(e), err)
        return 2
    # Planning needs no devices (an AbstractMesh and jax.eval_shape): the CPU is enough.
    use_cpu_backend()
    problem = model_args_problem(args) or _prediction_problem(args, shape)
    if problem is not None:
        print_error(problem, err)
        return 2

    import meshplan
    from meshplan._spmd.tree_check import raise_for_errors

    try:
        label, rules = load_rules(args.rules, args.model)
        names = read_names(args.names, args.model)
        loaded: Any = load_factory(args.model, names) if is_factory(args.model) else None
        if args.model == "llama":  # abstract shapes: nothing allocated
            from meshplan.cli.llama_model import llama_step_of

            args.batch = args.batch or math.prod(shape.values())  # one sequence per device
            what, state, step, batch = llama_step_of(args, args.batch)
            loaded = argparse.Namespace(step_fn=step, example_batch=batch, notes=[])
        elif loaded is not None:  # a --model factory is imported and called once
            what, state = loaded.what, loaded.abstract_state
        else:
            what, state = abstract_state(args)
        prediction = None if args.profile is None else _predict(args, loaded, state, shape, rules)
    except (meshplan.MeshplanError, OSError) as e:
        print_error(e, err)
        return 2
    plan = meshplan.explain(state, abstract_mesh(shape), rules)
    problems = plan.problems

    if args.json:
        data = {
            "model": what,
            "rules_name": label,
            "plan": plan.to_dict(),
            "problems": [p.to_dict() for p in problems],
        }
        if prediction is not None:
            data["prediction"] = prediction
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        for line in notes_text(loaded.notes if loaded is not None else []):
            say(err, line)
        unnamed = no_names_text(problems, args.model, label)
        if unnamed is not None:  # said first: the table below shows why
            say(err, ("warning: ", "bold yellow"), unnamed, soft_wrap=True)
        say(out, (what, "bold"), " · rules ", (label, "bold"))
        out.print(plan.table(full=args.full))
        if prediction is not None:
            from meshplan._search.predict.report import prediction_lines

            for line in prediction_lines(prediction):
                say(out, line)
    if args.png:
        plan.save_png(args.png, title=f"{what} · rules {label}")
        say(err if args.json else out, f"Wrote {args.png}")
    errors = [p for p in problems if p.severity == "error"]
    if args.strict:
        try:
            raise_for_errors(problems, plan.mesh)
        except meshplan.ShardingValidationError as e:
            print_error(e, err)
    return 1 if errors else 0
