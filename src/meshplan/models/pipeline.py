"""The Transformer's blocks as a pipeline: when the rules give ``'stage'`` a mesh axis.

A layout that maps ``'stage'`` (and the stored ``'layer'`` stack) to a mesh axis
(:data:`meshplan.layouts.pipeline`) makes the scanned blocks of
:class:`~meshplan.models.transformer.Transformer` (and of its Flax NNX twin)
run as a pipeline of as many stages as that axis has devices, with the config's
``microbatches`` and ``pipeline_repeats`` (:class:`meshplan.PipelineSchedule`).
The parameters stay the unsplit ``('layer', ...)`` stack that ``nn.scan`` makes,
so a checkpoint does not depend on the pipeline: it restores onto any layout.
The embedding, the final norm and the head run outside the pipeline, on the
whole batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax

from meshplan import MeshError, PipelineSchedule, pipeline_layers
from meshplan._errors import Problem, error_from_problems
from meshplan._spmd.pipeline import stage_axes


class TransformerConfig(Protocol):
    """What a pipeline reads of :class:`meshplan.models.transformer.TransformerConfig`."""

    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def scan_layers(self) -> bool: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def pipeline_repeats(self) -> int: ...


__all__ = ["pipeline_problems", "pipeline_schedule", "pipelined_blocks"]

EMBED_NAMES = ("batch", "length", "embed")


def pipeline_problems(
    cfg: TransformerConfig, stages: int, batch: int | None = None
) -> list[Problem]:
    """What stops ``cfg`` from running as a pipeline of ``stages`` stages on ``batch`` rows.

    Example:
        >>> from meshplan.models.pipeline import pipeline_problems
        >>> from meshplan.models.transformer import config_from_name
        >>> cfg = config_from_name("tiny", num_layers=6, microbatches=8)
        >>> [(p.code, p.message) for p in pipeline_problems(cfg, stages=4)]
        [('pipeline-layers', '6 layers do not split into 4 stages x 1 repeats (4 groups of equal size)')]
    """
    schedule = PipelineSchedule(stages, cfg.microbatches, cfg.pipeline_repeats)
    found = schedule.problems(cfg.num_layers, batch)
    if not cfg.scan_layers:
        found.append(
            Problem(
                "error",
                "scan_layers",
                "a pipeline splits the scanned 'layer' stack, and "
                "scan_layers=False makes a Python loop of separate layers",
                "Use scan_layers=True, or rules that give 'stage' no mesh axis.",
                "pipeline-scan",
            )
        )
    if cfg.num_experts:
        found.append(
            Problem(
                "error",
                "num_experts",
                f"a mixture of experts ({cfg.num_experts} experts) does not "
                "run in a pipeline yet (its routing statistics are not carried between stages)",
                "Use a dense model (num_experts=0), or rules that give 'stage' no mesh axis.",
                "pipeline-moe",
            )
        )
    return found


def pipeline_schedule(cfg: TransformerConfig, batch: int) -> PipelineSchedule | None:
    """The schedule the active rules and mesh ask for; ``None`` when ``'stage'`` has no axis.

    Raises:
        MeshError: the config or the batch cannot run as that pipeline (every problem).
    """
    _, stages = stage_axes()
    if stages <= 1:
        return None
    problems = pipeline_problems(cfg, stages, batch)
    if problems:
        raise error_from_problems(MeshError, f"Cannot run a pipeline of {stages} stages:", problems)
    return PipelineSchedule(stages, cfg.microbatches, cfg.pipeline_repeats)


def pipelined_blocks(
    schedule: PipelineSchedule,
    layer: Callable[[object, jax.Array], jax.Array],
    layers: object,
    x: jax.Array,
) -> jax.Array:
    """``x[batch, length, embed]`` through the stacked blocks ``layers``, as ``schedule`` says.

    ``layer(layer_params, x) -> x`` runs one block (rematerialised, if the model is).
    """
    out = pipeline_layers(layer, layers, x, schedule, EMBED_NAMES)
    assert isinstance(out, jax.Array)
    return out
