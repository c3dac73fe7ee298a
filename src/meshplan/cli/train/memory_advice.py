"""A ``meshplan train`` step that does not fit in a device, worded in flags.

The library finds it (:func:`meshplan.train.memory.memory_shortfall`: the planner's
memory model, :mod:`meshplan._search.predict.memory`, against what a device holds), when it
builds the run's parts (:func:`meshplan.train.build.build_parts`), before any array is
created; this module says it with the numbers and a flag-level fix.
"""

from __future__ import annotations

import math

from meshplan._errors import Problem
from meshplan._text import human_bytes
from meshplan.train.memory import MemoryShortfall
from meshplan.train.settings import TrainSettings

__all__ = ["memory_problem"]


def memory_problem(
    shortfall: MemoryShortfall, settings: TrainSettings, batch_shards: int, remat: bool
) -> Problem:
    """The step that does not fit (code ``'out-of-memory'``), with the largest ``--batch`` that does.

    The step of one microbatch (``batch / grad_accum`` sequences of ``seq_len + 1``
    tokens) is what a device holds at a time; ``batch_shards`` devices share it.

    Example:
        >>> from meshplan.cli.train.memory_advice import memory_problem
        >>> from meshplan.train.memory import MemoryShortfall
        >>> from meshplan.train.settings import TrainSettings
        >>> short = MemoryShortfall(need=5 << 30, state=1 << 30, limit=2 << 30, source="a GPU")
        >>> problem = memory_problem(short, TrainSettings(batch=64, seq_len=256), 2, True)
        >>> problem.code, problem.fix.split(" (")[0]
        ('out-of-memory', 'Use --batch 16 or less')
    """
    need, state, limit = shortfall.need, shortfall.state, shortfall.limit
    micro = max(settings.batch // settings.grad_accum, 1)
    rest = need - state  # activations, gradients, temporaries and the batch: they grow with it
    sequences = math.ceil(micro / batch_shards)
    per_sequence = max(rest // max(sequences, 1), 1)
    room = max(limit - state, 0) // per_sequence
    largest = room * batch_shards * settings.grad_accum
    fix = (
        f"Use --batch {largest} or less (each device holds about {room:,} sequences of "
        f"{settings.seq_len} bytes besides the state), a shorter --seq"
        f"{'' if remat else ', --remat'}, or a mesh and layout that split 'batch' over "
        f"more devices."
        if room >= 1
        else "The state alone does not fit: use a smaller model, or a layout that splits it "
        "over more devices (fsdp, fsdp_tp)."
    )
    return Problem(
        "error",
        "",
        f"--batch {settings.batch} needs about {human_bytes(need)} per device "
        f"({human_bytes(state)} of parameters and AdamW state, and about {human_bytes(rest)} "
        f"of activations for its {sequences:,} sequences of {settings.seq_len} bytes, with "
        f"the gradients and the step's temporaries, as meshplan plan --profile predicts "
        f"them), but a device has about {human_bytes(limit)} ({shortfall.source})",
        fix,
        shortfall.code,
    )
