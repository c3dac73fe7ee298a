"""``meshplan sample``: generate text from a checkpoint, with no training code.

The checkpoint is restored with :func:`meshplan.restore` onto one device (no
target tree), and the model is re-created from the config stored beside the
arrays: the Flax Linen Transformer, or the Flax NNX one for a checkpoint of
``meshplan train --model transformer-nnx`` (its parameters go back into the
model's ``nnx.State``). Generation is byte by byte: greedy at temperature 0,
else sampled, decoding with a key/value cache (:mod:`meshplan.models.decode`):
the prompt is read once, then each byte is one step of one token.
``--no-kv-cache`` runs the whole window through the model for every byte
instead; ``--compare-cache`` runs both, and reports the tokens per second of
each and whether they gave the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from rich.console import Console

from meshplan.cli.output import print_error, say

HELP = "Generate text from a `meshplan train` checkpoint (greedy, or sampled with a temperature)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ckpt-dir", required=True, metavar="DIR", help="checkpoint folder of `meshplan train`"
    )
    parser.add_argument("--prompt", default="def ", help='text to continue (default "def ")')
    parser.add_argument(
        "--length", type=int, default=300, metavar="N", help="bytes to generate (default 300)"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.5,
        metavar="T",
        help="0 picks the likeliest byte (greedy); higher samples more freely (default 0.5)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, metavar="S", help="sampling seed (default 0)"
    )
    parser.add_argument("--step", type=int, metavar="N", help="checkpoint step (default: latest)")
    parser.add_argument(
        "--no-kv-cache",
        dest="kv_cache",
        action="store_false",
        help="read the whole window again for every byte, instead of decoding with a key/value "
        "cache",
    )
    parser.add_argument(
        "--compare-cache",
        action="store_true",
        help="decode with and without the key/value cache: tokens/s of each, and whether the "
        "bytes are the same",
    )
    parser.add_argument(
        "--platform",
        choices=("auto", "cpu", "gpu", "tpu"),
        default="auto",
        help="auto: the machine's first accelerator when JAX finds one, else the CPU; "
        "cpu: the CPU (default auto)",
    )


def context_window(max_len: int, window: int | None = None) -> int:
    """The most bytes the model sees to predict the next: ``window``, at most ``max_len``.

    Example:
        >>> from meshplan.cli.sample import context_window
        >>> context_window(64), context_window(64, window=32), context_window(64, window=128)
        (64, 32, 64)
    """
    return min(window or max_len, max_len)


def settings_problem(length: int, temperature: float) -> str | None:
    """What is wrong with ``length`` and ``temperature``, or ``None``.

    The length must be ``>= 0``; the temperature finite and ``>= 0`` (NaN would
    sample from NaN probabilities: bytes of nothing).

    Example:
        >>> from meshplan.cli.sample import settings_problem
        >>> print(settings_problem(300, float("nan")))
        --temperature nan: the temperature must be a finite number >= 0.
        Pass --temperature 0 for the likeliest byte, or e.g. --temperature 0.5 to sample.
        >>> settings_problem(300, 0.0) is None
        True
    """
    if length < 0:
        return (
            f"--length {length}: the number of bytes to generate must be >= 0.\n"
            f"Pass --length N >= 0 (default 300)."
        )
    if not math.isfinite(temperature) or temperature < 0:
        return (
            f"--temperature {temperature}: the temperature must be a finite number >= 0.\n"
            f"Pass --temperature 0 for the likeliest byte, or e.g. --temperature 0.5 to sample."
        )
    return None


def prompt_bytes(prompt: str) -> bytes:
    """The bytes of ``prompt`` as given on the command line, even if they are not UTF-8.

    Python reads undecodable command-line bytes as lone surrogates
    (``surrogateescape``); this turns them back into the bytes typed.

    Example:
        >>> from meshplan.cli.sample import prompt_bytes
        >>> prompt_bytes("def "), prompt_bytes("\\udcff\\udcfe abc"), prompt_bytes("é")
        (b'def ', b'\\xff\\xfe abc', b'\\xc3\\xa9')
    """
    return prompt.encode("utf-8", errors="surrogateescape")


def generate(
    model: Any,
    params: Any,
    prompt: bytes,
    length: int,
    temperature: float = 0.0,
    seed: int = 0,
    window: int | None = None,
    times: list[float] | None = None,
) -> bytes:
    """Continues ``prompt`` by ``length`` bytes with ``model`` and unboxed ``params``.

    Each byte is predicted from the last ``window`` bytes at most (default the
    model's ``max_len``; pass the training sequence length, the longest context
    the model has learned; :func:`context_window`), so a longer prompt is read
    from its last ``window`` bytes only (``meshplan sample`` says so), padded to a fixed shape so that one compiled
    forward pass serves every position (the model is causal, so the padding
    after the last byte does not matter). ``times``, when given, receives the
    seconds each byte took (the first compiles).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan.models.transformer import Transformer, config_from_name
        >>> from meshplan.cli.sample import generate
        >>> model = Transformer(config_from_name("tiny", num_layers=1, embed_dim=16,
        ...                                      mlp_dim=16, max_len=16))
        >>> shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 16), jnp.int32))
        >>> params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype),
        ...                       meshplan.unbox(shapes["params"]))  # an untrained model
        >>> list(generate(model, params, b"def ", 5))  # equal logits: greedy picks byte 0
        [0, 0, 0, 0, 0]
    """
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np

    from meshplan.models.decode import choose_byte

    problem = settings_problem(length, temperature)
    if problem is not None:
        raise ValueError(problem)
    longest = context_window(model.config.max_len, window)
    window = min(longest, max(len(prompt), 1) + length)
    tokens = list(prompt) or [ord("\n")]

    @jax.jit
    def next_logits(params: Any, x: jax.Array, position: jax.Array) -> jax.Array:
        logits = model.apply({"params": params}, x)
        # (jax types this jitted function's result as Any)
        row: jax.Array = jax.lax.dynamic_index_in_dim(logits[0], position, keepdims=False)
        return row

    key = jax.random.key(seed)
    out = bytearray()
    for _ in range(length):
        began = time.perf_counter()
        context = tokens[-window:]
        x = np.zeros((1, window), np.int32)
        x[0, : len(context)] = context
        logits = next_logits(params, jnp.asarray(x), len(context) - 1)
        byte, key = choose_byte(logits, temperature, key)
        tokens.append(byte)
        out.append(byte)
        if times is not None:
            times.append(time.perf_counter() - began)
    return bytes(out)


class NnxModel:
    """What :func:`generate` calls, for the Flax NNX Transformer: ``config`` and ``apply``.

    ``apply({"params": state}, tokens)`` runs
    :meth:`~meshplan.models.transformer_nnx.FunctionalTransformer.apply` on the
    ``nnx.State`` ``state`` (see :meth:`params_of`).
    """

    def __init__(self, config: Any) -> None:
        from meshplan.models.transformer_nnx import FunctionalTransformer

        self.functional = FunctionalTransformer(config)
        self.config = config

    def apply(self, variables: dict[str, Any], tokens: Any) -> Any:
        return self.functional.apply(variables["params"], tokens)

    def params_of(self, restored: Any) -> Any:
        """The model's ``nnx.State`` with the parameters of ``restored`` (a :class:`meshplan.Restored`)."""
        import meshplan

        abstract = self.functional.abstract_state()
        params = meshplan.Restored(
            restored.state["params"],
            dataclasses.replace(
                restored.metadata,
                arrays={
                    key.removeprefix("params/"): info
                    for key, info in restored.metadata.arrays.items()
                    if key.startswith("params/")
                },
            ),
        )
        return params.into(abstract)


def _damaged_fix(folder: str, step: int | None, problem: Any) -> str:
    """The fix of a damaged ``step`` (``None``: the latest) in flag terms: the newest intact
    earlier step, as ``--step N``."""
    from meshplan._checkpoint.folder import latest_step
    from meshplan._checkpoint.integrity import intact_step

    try:
        found = intact_step(folder, before=latest_step(folder) if step is None else step)
    except Exception:  # the folder itself is unreadable: the library's fix stands
        return str(problem.fix)
    if found.step is None:
        return "No earlier step can be read: sample from another --ckpt-dir."
    return (
        f"Sample from an earlier step: --step {found.step} is the newest one before it that "
        f"passes the cheap check (its arrays are verified when read)."
    )


def _decode(
    console: Console, args: argparse.Namespace, model: Any, params: Any, prompt: bytes, seq_len: Any
) -> bytes:
    """The bytes generated, with the key/value cache or without (``--compare-cache``: both)."""
    import statistics

    from meshplan.models.decode import greedy_cached

    def cached(times: list[float] | None = None) -> bytes:
        from flax import nnx

        tree = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
        return greedy_cached(
            model.config, tree, prompt, args.length, seq_len, args.temperature, args.seed, times
        )

    def plain(times: list[float] | None = None) -> bytes:
        return generate(
            model, params, prompt, args.length, args.temperature, args.seed, seq_len, times
        )

    if not getattr(args, "compare_cache", False):
        return cached() if getattr(args, "kv_cache", True) else plain()
    rates, texts = {}, {}
    for name, decode in (("with the key/value cache", cached), ("without", plain)):
        times: list[float] = []
        texts[name] = decode(times)
        steady = times[2:] or times  # the first two bytes compile (the prompt, then one byte)
        rates[name] = 1.0 / max(statistics.median(steady), 1e-9)
    same = texts["with the key/value cache"] == texts["without"]
    say(
        console,
        (
            "; ".join(f"{name}: {rate:,.1f} tokens/s" for name, rate in rates.items())
            + f" (median per byte, compiling left out); the same bytes: {'yes' if same else 'no'}",
            "dim",
        ),
    )
    return texts["with the key/value cache"]


def run(args: argparse.Namespace) -> int:
    console = Console()
    problem = settings_problem(args.length, args.temperature)
    if problem is not None:
        print_error(problem)
        return 2
    import os

    import meshplan
    from meshplan.cli.devices import found_devices

    platform = getattr(args, "platform", "auto")
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"  # before JAX starts
    try:
        devices = found_devices(platform)
        restored = meshplan.restore(args.ckpt_dir, mesh=None, step=args.step)
        state, metadata = restored
        from meshplan.cli.trained_models import MODELS, model_of
        from meshplan.models.transformer import Transformer, TransformerConfig

        held = model_of(metadata)
        if held not in MODELS:
            raise meshplan.CheckpointError(
                f"The checkpoint in {args.ckpt_dir!r} (step {metadata.step}) holds --model "
                f"{held}, not the byte-level Transformer that meshplan sample decodes.\nSample "
                f"from a checkpoint of --model {' or --model '.join(MODELS)}; restore this one "
                f"with meshplan.restore and run your model on its parameters."
            )
        if metadata.config is None or "params" not in state:
            raise meshplan.CheckpointError(
                f"The checkpoint in {args.ckpt_dir!r} (step {metadata.step}) has no model config "
                f"or no params.\nSample from a checkpoint written by `meshplan train`."
            )
        kind = model_of(metadata)
        config = TransformerConfig.from_dict(metadata.config)
        model: Any
        api = MODELS.get(kind)  # the registry's: which Flax API wrote the checkpoint
        if api == "Flax NNX":
            model = NnxModel(config)
            params = model.params_of(restored)
        elif api == "Flax Linen":
            model = Transformer(config)
            params = meshplan.unbox(state["params"])
        else:
            raise meshplan.CheckpointError(
                f"The checkpoint in {args.ckpt_dir!r} (step {metadata.step}) holds --model "
                f"{kind!r}, which this meshplan does not know (it samples {', '.join(MODELS)}).\n"
                f"Upgrade meshplan to sample from it."
            )
        prompt = prompt_bytes(args.prompt)
        say(
            console,
            (
                f"step {metadata.step} of {args.ckpt_dir}; "
                f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}; "
                f"{devices.describe()}, sampling on the first",
                "dim",
            ),
        )
        seq_len = (metadata.extra.get("train") or {}).get("seq_len")
        window = context_window(model.config.max_len, seq_len)
        if len(prompt) > window:
            say(
                Console(stderr=True),
                f"note: the prompt is {len(prompt)} bytes, longer than the model's context of "
                f"{window} bytes (the training --seq): it continues from the last {window} "
                f"bytes only.",
                soft_wrap=True,
            )
        text = _decode(console, args, model, params, prompt, seq_len)
    except (meshplan.MeshplanError, ValueError) as e:
        problems = getattr(e, "problems", None) or []
        if len(problems) == 1 and problems[0].code == "ckpt-damaged":
            print_error(
                f"{problems[0].message}.\n{_damaged_fix(args.ckpt_dir, args.step, problems[0])}"
            )
        else:
            print_error(e)
        return 2
    # Bytes that are not UTF-8 (in the prompt or generated) print as U+FFFD.
    shown = prompt.decode("utf-8", errors="replace")
    say(console, (shown, "bold"), text.decode("utf-8", errors="replace"), soft_wrap=True)
    return 0
