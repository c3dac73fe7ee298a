"""The typed parts a :class:`~meshplan.train.trainer.Trainer` is built from.

:class:`Placement` (mesh and rules), :class:`Checkpoints` (where a run saves and what
it resumes) and :class:`Measures` (FLOPs and peak, for MFU), and how the older
one-keyword-per-field form of ``Trainer(...)`` maps onto them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jax.sharding import Mesh

from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._spmd.rules import LogicalRules
from meshplan.train.model import TrainModel

__all__ = ["Checkpoints", "Measures", "Placement", "group_parts"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a run's state lives: the mesh, the layout's logical axis rules, and its name.

    Attributes:
        mesh: The mesh.
        rules: The layout's logical axis rules.
        layout_name: The layout's name, stored with every checkpoint.
    """

    mesh: Mesh
    rules: LogicalRules
    layout_name: str = ""


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """Where a run saves, what it resumes, and what every checkpoint records.

    Attributes:
        ckpt_dir: Where to save checkpoints (``None``: no checkpoints).
        resume_from: The checkpoint to resume from (in ``ckpt_dir``).
        discard_steps: Steps of ``ckpt_dir`` after ``resume_from`` that cannot be
            read (damaged): moved aside, never deleted, once the resumed state has
            been read (each into ``damaged-step-<N>``, its reason in ``why.txt``), so
            that this run writes its own.
        discard_why: Why each of ``discard_steps`` cannot be read (step to sentence).
        max_to_keep: The latest checkpoints kept (default ``settings.keep``); the
            one with the best validation loss is never deleted.
        config: The model's config, stored with every checkpoint (``None``:
            none), e.g. for a command that rebuilds the model from it.
        record: Values stored beside the settings in every checkpoint's
            ``extra["train"]`` (``meshplan train`` records its data path and model).
    """

    ckpt_dir: Path | None = None
    resume_from: CheckpointMetadata | None = None
    discard_steps: tuple[int, ...] = ()
    discard_why: Mapping[int, str] = dataclasses.field(default_factory=dict)
    max_to_keep: int | None = None
    config: Mapping[str, object] | None = None
    record: Mapping[str, object] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Measures:
    """What a run measures and how: the FLOPs of a step and the devices' peak, for MFU.

    Attributes:
        flops_per_step: The model FLOPs of one training step (forward and
            backward); ``None``: unknown.
        peak_flops_per_s: What the mesh's devices can do together; ``None``: unknown.
        sync_every_step: Read each step's loss as soon as it is dispatched (the
            host waits for every step; for measuring what the overlap gains).
    """

    flops_per_step: float | None = None
    peak_flops_per_s: float | None = None
    sync_every_step: bool = False


_MODEL_FIELDS = ("loss", "example_input", "has_aux")
_PLACEMENT_FIELDS = tuple(f.name for f in dataclasses.fields(Placement))
_CHECKPOINT_FIELDS = tuple(f.name for f in dataclasses.fields(Checkpoints))
_MEASURE_FIELDS = tuple(f.name for f in dataclasses.fields(Measures))


def group_parts(
    model: object,
    placement: Placement | None,
    checkpoints: Checkpoints | None,
    measures: Measures | None,
    separate: dict[str, object],
) -> tuple[TrainModel, Placement, Checkpoints, Measures]:
    """The typed groups, from themselves or from their fields given one by one (the older
    keywords: ``Trainer(model=module, loss=..., mesh=..., rules=..., ckpt_dir=...)``)."""
    known = {*_MODEL_FIELDS, *_PLACEMENT_FIELDS, *_CHECKPOINT_FIELDS, *_MEASURE_FIELDS}
    unknown = sorted(set(separate) - known)
    if unknown:
        raise TypeError(f"Trainer() got unexpected keyword arguments: {', '.join(unknown)}")

    def pick(names: tuple[str, ...], group: object, kind: str) -> dict[str, Any]:
        given = {n: separate[n] for n in names if n in separate}
        if given and group is not None:
            raise TypeError(f"Trainer(): pass {kind}=... or {', '.join(given)}, not both")
        return given

    if not isinstance(model, TrainModel):
        fields = pick(_MODEL_FIELDS, None, "model")
        if "loss" not in fields:
            raise TypeError("Trainer needs a TrainModel, or a model and its loss=")
        model = TrainModel(model, **fields)
    else:
        pick(_MODEL_FIELDS, model, "model")
    fields = pick(_PLACEMENT_FIELDS, placement, "placement")
    if placement is None:
        if "mesh" not in fields or "rules" not in fields:
            raise TypeError("Trainer needs a Placement, or mesh= and rules=")
        placement = Placement(**fields)
    fields = pick(_CHECKPOINT_FIELDS, checkpoints, "checkpoints")
    if "discard_steps" in fields:
        fields["discard_steps"] = tuple(fields["discard_steps"])
    if fields.get("record") is None:
        fields.pop("record", None)
    checkpoints = checkpoints if checkpoints is not None else Checkpoints(**fields)
    fields = pick(_MEASURE_FIELDS, measures, "measures")
    measures = measures if measures is not None else Measures(**fields)
    return model, placement, checkpoints, measures
