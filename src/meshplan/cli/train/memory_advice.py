"""A ``meshplan train`` step that does not fit in a device, worded in flags.

The library finds it (:func:`meshplan.train.memory.memory_shortfall`: the planner's
memory model, :mod:`meshplan._search.predict.memory`, against what a device holds), when it
builds the run's parts (:func:`meshplan.train.build.build_parts`), before any array is
created; this module says it with the numbers and a flag-level fix, for every model
source: the source names its batch (:class:`BatchWords`), the advice is the same.
"""

from __future__ import annotations

import dataclasses
import math

from meshplan._errors import Problem
from meshplan._text import human_bytes
from meshplan.train.memory import MemoryShortfall
from meshplan.train.settings import TrainSettings

__all__ = ["BatchWords", "memory_problem"]


@dataclasses.dataclass(frozen=True)
class BatchWords:
    """How a model source's batch is named in the memory advice.

    Attributes:
        given: The batch as the user gave it (``--batch 64``).
        rows: What one row of it is, plural (``sequences of 128 bytes``, ``examples``).
        fewer: The fix for a smaller batch, ``{largest}`` the largest that fits
            (``Use --batch {largest} or less``).
        also: Other ways to a smaller step, after the batch's (``a shorter --seq, --remat``);
            ``{accum}``: the fewest ``--grad-accum`` microbatches that fit.
    """

    given: str
    rows: str
    fewer: str
    also: str


def memory_problem(
    shortfall: MemoryShortfall, settings: TrainSettings, batch_shards: int, words: BatchWords
) -> Problem:
    """The step that does not fit (code ``'out-of-memory'``), with the largest batch that does.

    The step of one microbatch (``batch / grad_accum`` rows) is what a device holds at a
    time; ``batch_shards`` devices share it (:attr:`~meshplan.cli.train.preflight.FlagsRead.batch_shards`).

    Example:
        >>> from meshplan.cli.train.memory_advice import BatchWords, memory_problem
        >>> from meshplan.train.memory import MemoryShortfall
        >>> from meshplan.train.settings import TrainSettings
        >>> short = MemoryShortfall(need=5 << 30, state=1 << 30, limit=2 << 30, source="a GPU")
        >>> words = BatchWords("--batch 64", "sequences of 256 bytes", "Use --batch {largest} "
        ...                    "or less", "a shorter --seq")
        >>> problem = memory_problem(short, TrainSettings(batch=64, seq_len=256), 2, words)
        >>> problem.code, problem.fix.split(" (")[0]
        ('out-of-memory', 'Use --batch 16 or less')
    """
    shards = batch_shards
    need, state, limit = shortfall.need, shortfall.state, shortfall.limit
    micro = max(settings.batch // settings.grad_accum, 1)
    rest = need - state  # activations, gradients, temporaries and the batch: they grow with it
    rows = math.ceil(micro / shards)
    if shortfall.fits is not None:  # predicted and checked (train.memory.largest_batch)
        room = shortfall.fits // shards
    else:  # the state fixed, the rest in proportion to the rows
        room = max(limit - state, 0) // max(rest // max(rows, 1), 1)
    largest = room * shards * settings.grad_accum
    accum = next(
        (
            k
            for k in range(settings.grad_accum, settings.batch + 1)
            if not settings.batch % k and math.ceil(settings.batch // k / shards) <= room
        ),
        settings.batch,
    )
    fix = (
        f"{words.fewer.format(largest=largest)} (each device holds about {room:,} "
        f"{words.rows} besides the state), {words.also.format(accum=accum)}, or a mesh and "
        f"layout that split "
        f"'batch' over more devices."
        if room >= 1
        else "The state alone does not fit: use a smaller model, or a layout that splits it "
        "over more devices (fsdp, fsdp_tp)."
        if state >= limit
        else f"Not one of the {words.rows} fits beside the state on a device: use a smaller "
        f"model, or a layout that splits the state over more devices (fsdp, fsdp_tp), leaving "
        f"room for the activations."
    )
    return Problem(
        "error",
        "",
        f"{words.given} needs about {human_bytes(need)} per device "
        f"({human_bytes(state)} of parameters and AdamW state, and about {human_bytes(rest)} "
        f"of activations for its {rows:,} {words.rows}, with "
        f"the gradients and the step's temporaries, as meshplan plan --profile predicts "
        f"them), but a device has about {human_bytes(limit)} ({shortfall.source})",
        fix,
        shortfall.code,
    )
