"""The built-in models from their flags, for ``meshplan plan`` and ``meshplan search``.

A model is chosen by name in one place, :mod:`meshplan.models.registry`; this
module only reads its config from the flags (``--size``, ``--experts``; the MLP's
``--layers``, ``--depth``, ``--scan``).
"""

from __future__ import annotations

import argparse
from typing import Any

from meshplan.models.registry import Example

__all__ = ["example_of", "step_and_batch"]


def example_of(args: argparse.Namespace) -> Example:
    """The built-in ``--model`` of ``args`` (:data:`meshplan.models.registry.EXAMPLE_MODELS`).

    Example:
        >>> import argparse
        >>> from meshplan.cli.steps import example_of
        >>> example_of(argparse.Namespace(model="transformer-nnx", size="tiny")).what
        'Transformer (tiny, Flax NNX)'

    A ``--seq`` longer than the preset's ``max_len`` plans that step: the presets'
    rotary positions have no parameters, so only the accepted length grows.
    """
    from meshplan.models.registry import EXAMPLE_MODELS, MLPConfig, example

    if not EXAMPLE_MODELS[args.model].sequence:  # the guide's MLP
        return example(args.model, MLPConfig(args.layers, args.depth, bool(args.scan)))
    from meshplan.models.transformer import CONFIGS, config_from_name

    overrides: dict[str, Any] = {"num_experts": getattr(args, "experts", None) or 0}
    seq = getattr(args, "seq", None) or 0
    if seq > CONFIGS[args.size].max_len and CONFIGS[args.size].positions == "rope":
        # rotary positions have no parameters: a longer sequence changes the step, not the state
        overrides["max_len"] = seq
    return example(args.model, config_from_name(args.size, **overrides), args.size)


def step_and_batch(args: argparse.Namespace) -> tuple[Any, Any]:
    """The train step ``step(state, batch)`` of a built-in ``--model`` (the state's Adam),
    and an abstract batch of ``args.batch`` (x ``args.seq`` + 1 tokens for the Transformers).

    Example:
        >>> import argparse
        >>> from meshplan.cli.steps import step_and_batch
        >>> _, batch = step_and_batch(argparse.Namespace(model="transformer", size="tiny", batch=4, seq=16))
        >>> batch.shape
        (4, 17)
    """
    built = example_of(args)
    return built.model.step, built.batch(args.batch, getattr(args, "seq", None) or 0)
