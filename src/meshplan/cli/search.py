"""``meshplan search``: every mesh shape and built-in layout for an example model, ranked."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from rich.console import Console

from meshplan._errors import MeshError
from meshplan.cli.devices import use_cpu_backend, use_cpu_devices
from meshplan.cli.output import print_error, say
from meshplan.cli.plan import abstract_state, add_model_size_arguments, model_args_problem

HELP = (
    "Try every mesh shape of --devices under every built-in layout for an example model, "
    "reject what does not split, and rank the rest by memory and communication "
    "(--budget, --measure, --json)."
)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(text: str) -> int:
    """``'1MiB'`` -> 1048576; ``'2GB'`` -> 2000000000; ``'4096'`` -> 4096.

    Example:
        >>> from meshplan.cli.search import parse_bytes
        >>> parse_bytes("1MiB"), parse_bytes("1.5 KiB"), parse_bytes("2GB"), parse_bytes("4096")
        (1048576, 1536, 2000000000, 4096)
    """
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read the size {text!r}: write e.g. 1MiB, 512KiB, 2GB or 4096 (bytes)"
        )
    return int(float(found.group(1)) * _UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        choices=("transformer", "transformer-nnx", "mlp"),
        default="transformer",
        help="the example Transformer (Flax Linen, default), the same in Flax NNX, or the "
        "guide's MLP",
    )
    add_model_size_arguments(parser)
    parser.add_argument("--devices", type=int, default=8, help="devices in the mesh (default 8)")
    parser.add_argument(
        "--batch", type=int, default=32, help="global batch it must divide (default 32)"
    )
    parser.add_argument(
        "--budget", type=parse_bytes, default=None, help="state bytes per device, e.g. 1MiB"
    )
    parser.add_argument(
        "--layouts",
        default=None,
        help="comma-separated built-in layouts or rules files (default: data_parallel, fsdp, "
        "tensor_parallel, fsdp_tp; and guide for the MLP)",
    )
    parser.add_argument(
        "--measure",
        action="store_true",
        help="compile the train step of the best --top-k candidates on emulated CPU devices "
        "and report their collective bytes and XLA memory",
    )
    parser.add_argument(
        "--top-k", type=int, default=3, help="candidates to measure, at least 1 (default 3)"
    )
    parser.add_argument(
        "--seq", type=int, default=128, help="Transformer sequence length for --measure"
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead")


def _step_and_batch(args: argparse.Namespace) -> tuple[Any, Any]:
    """The train step ``step(state, batch)`` (the state's Adam), and an abstract batch."""
    import jax
    import jax.numpy as jnp

    if args.model == "transformer":
        from meshplan.examples.transformer import Transformer, config_from_name, loss_fn

        model = Transformer(config_from_name(args.size))

        def step(state: Any, tokens: jax.Array) -> Any:
            return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

        return step, jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)

    if args.model == "transformer-nnx":
        from meshplan.examples.transformer import config_from_name
        from meshplan.examples.transformer_nnx import FunctionalTransformer

        functional = FunctionalTransformer(config_from_name(args.size))

        def nnx_step(state: Any, tokens: jax.Array) -> Any:
            return state.apply_gradients(grads=jax.grad(functional.loss)(state.params, tokens))

        return nnx_step, jax.ShapeDtypeStruct((args.batch, args.seq + 1), jnp.int32)

    def mlp_step(state: Any, x: jax.Array) -> Any:
        grads = jax.grad(lambda p: state.apply_fn({"params": p}, x).sum())(state.params)
        return state.apply_gradients(grads=grads)

    return mlp_step, jax.ShapeDtypeStruct((args.batch, args.depth), jnp.float32)


def run(args: argparse.Namespace) -> int:
    # Piped output (a file, a pager, a test) gets a wide table rather than 80 columns.
    out = Console(file=sys.stdout, width=None if sys.stdout.isatty() else 180)
    err = Console(file=sys.stderr, width=None if sys.stderr.isatty() else 180)
    bad = [
        f"--{flag} {value}"
        for flag, value in (("devices", args.devices), ("batch", args.batch), ("top-k", args.top_k))
        if value < 1
    ]
    if bad:
        print_error(
            f"{', '.join(bad)}: --devices, --batch and --top-k must be at least 1.\n"
            f"Pass --devices N, --batch B and --top-k K of at least 1 (defaults 8, 32 and 3).",
            err,
        )
        return 2
    problem = model_args_problem(args)
    if problem is not None:
        print_error(problem, err)
        return 2
    try:
        if args.measure:  # compiling needs the devices, emulated on the CPU
            use_cpu_devices(args.devices)
        else:  # ranking needs only the count
            use_cpu_backend()
    except MeshError as e:
        print_error(e, err)
        return 2

    import meshplan
    from meshplan._search.search import DEFAULT_LAYOUTS
    from meshplan.layouts import get_layout

    names = args.layouts.split(",") if args.layouts else list(DEFAULT_LAYOUTS)
    if args.model == "mlp" and not args.layouts:
        names.append("guide")
    try:
        layouts = {name.strip(): get_layout(name.strip()) for name in names if name.strip()}
    except (meshplan.MeshplanError, OSError) as e:
        print_error(e, err)
        return 2
    what, state = abstract_state(args)
    step, batch = _step_and_batch(args) if args.measure else (None, None)
    try:
        result = meshplan.search_layouts(
            state,
            args.devices,
            layouts,
            batch=args.batch,
            memory_budget_bytes=args.budget,
            measure=args.measure,
            step_fn=step,
            example_batch=batch,
            top_k=args.top_k,
        )
    except meshplan.MeshplanError as e:
        print_error(e, err)
        return 2
    if args.json:
        sys.stdout.write(json.dumps({"model": what, **result.to_dict()}, indent=2) + "\n")
    else:
        say(out, (what, "bold"), f" · layouts {', '.join(layouts)}")
        out.print(result)
    return 0 if result.best is not None else 1
