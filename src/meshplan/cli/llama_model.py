"""``--model llama --size 7b``: published decoders for ``meshplan plan`` and ``meshplan search``.

The sizes are :data:`meshplan.models.llama.LLAMA_SIZES` (MaxText's and Meta's published
configurations), built as abstract shapes (``jax.eval_shape``): a 405B model is planned
without allocating it. ``--seq`` (default 2048, MaxText's ``max_target_length``),
``--batch`` (global; default one sequence per device) and ``--remat`` (``none``, ``full``,
``dots``, ``minimal``, ``full_block``: :data:`meshplan.models.llama.REMATS`) size the step.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["llama_args_problem", "llama_step_of"]


DEFAULTS = {"size": "7b", "seq": 2048, "remat": "none"}


def llama_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--size``, ``--seq`` and ``--remat`` for ``--model llama``, or
    ``None`` (their defaults filled into ``args``); the MLP's and the experts' flags are refused.

    Example:
        >>> import argparse
        >>> from meshplan.cli.llama_model import llama_args_problem
        >>> args = argparse.Namespace(model="llama", size="7B", seq=None, remat=None)
        >>> print(llama_args_problem(args))
        --size '7B' is not a Llama size; the sizes are 1b, 7b, 8b, 13b, 70b, 405b, llama2-1b, llama2-7b, llama2-13b, llama2-70b, llama3-8b, llama3-70b, llama3.1-405b, maxtext-16b, maxtext-32b, maxtext-64b, maxtext-128b.
        Pass e.g. --size 7b (Llama 2 7B) or --size llama3-8b.
    """
    from meshplan.models.llama import _SHORT, LLAMA_SIZES, REMATS

    other = [f"--{k}" for k in ("layers", "depth", "scan", "experts") if getattr(args, k, None)]
    if other:
        return (
            f"{', '.join(other)} {'is a flag' if len(other) == 1 else 'are flags'} of the other "
            f"built-in models, not of --model llama: it would be ignored.\nSize the decoder with "
            f"--size (e.g. 7b), --seq, --batch and --remat."
        )
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.size not in _SHORT and args.size not in LLAMA_SIZES:
        names = ", ".join([*_SHORT, *LLAMA_SIZES])
        return (
            f"--size {args.size!r} is not a Llama size; the sizes are {names}.\nPass e.g. "
            f"--size 7b (Llama 2 7B) or --size llama3-8b."
        )
    if args.remat not in REMATS:
        return (
            f"--remat {args.remat!r} is not a policy of the Llama decoder; the policies are "
            f"{', '.join(REMATS)}.\nPass e.g. --remat full (recompute each layer)."
        )
    return None


def llama_step_of(
    args: argparse.Namespace, batch: int, **overrides: Any
) -> tuple[str, Any, Any, Any]:
    """``(what, abstract_state, step_fn, example_batch)`` of ``--model llama`` (AdamW), for a
    global ``batch`` of ``args.seq`` tokens; ``overrides``: :class:`LlamaConfig` fields (a
    ``remat`` other than ``--remat``'s, to re-price a change).

    Example:
        >>> import argparse
        >>> from meshplan.cli.llama_model import llama_step_of
        >>> args = argparse.Namespace(model="llama", size="70b", seq=4096, remat="full")
        >>> what, state, step, tokens = llama_step_of(args, 512)
        >>> what, tokens.shape, state.params["layers"]["wi"].value.shape
        ('Llama 2 70B (llama2-70b, 69.0B parameters; seq 4096, remat full)', (512, 4096), (80, 8192, 28672))
    """
    from meshplan.models.llama import LLAMA_SIZES, llama_size, llama_step

    name, cfg = llama_size(args.size, remat=overrides.pop("remat", args.remat), **overrides)
    state, step, tokens = llama_step(cfg, batch, args.seq)
    what = (
        f"{LLAMA_SIZES[name][0]} ({name}, {cfg.params() / 1e9:.1f}B parameters; seq {args.seq}, "
        f"remat {cfg.remat})"
    )
    return what, state, step, tokens
