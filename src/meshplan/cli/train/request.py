"""What the user asked ``meshplan train`` for: the flags read once into a :class:`TrainRequest`.

``None`` in a field means "the checkpoint's value when resuming, else the default":
:func:`meshplan.cli.train.prepare.prepare_run` decides every setting from it, the
checkpoint and the model source, in one place.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from meshplan.cli.train.resume import DamagedStep

if TYPE_CHECKING:
    from meshplan.cli.devices import DeviceChoice

__all__ = ["DamagedStep", "TrainRequest"]


@dataclasses.dataclass
class TrainRequest:
    """What the user asked for; ``None`` means "the stored value when resuming, else the default".

    Attributes:
        mesh: ``"2x4"``-style mesh axis sizes (``"2x2x2"`` with ``axes``).
        axes: ``"data,fsdp,tensor"``: the mesh axis names, one per size; ``None``:
            the axes the built-in layout is written for (``('data', 'model')``;
            ``('data', 'context')`` for ``context_parallel`` and ``fsdp_cp``,
            ``('data', 'expert')`` for ``expert_parallel`` and ``fsdp_ep``).
        rules: A built-in layout name (:mod:`meshplan.layouts`) or a rules file.
        config: A preset name (``tiny``, ``small``); ``None`` resumes with the
            stored config, or uses ``tiny``.
        overrides: Model config fields to replace (``{"num_layers": 4}``).
        data: A folder or file of text; ``None`` uses the Python standard library.
        ckpt_dir: Where to save checkpoints (``None``: no checkpoints).
        resume: Continue from the newest intact checkpoint in ``ckpt_dir``
            (newer damaged ones are named and skipped).
        resume_step: Continue from this step of ``ckpt_dir`` (implies ``resume``).
        metrics: The file each loss is appended to (``--metrics``), checked here.
        settings: :class:`TrainSettings` fields the user gave.
        model: ``transformer`` (Flax Linen) or ``transformer-nnx`` (Flax NNX);
            ``None`` resumes with the checkpoint's, or uses ``transformer``.
        devices: The devices to build the mesh on
            (:func:`meshplan.cli.devices.found_devices`); ``None``: JAX's default devices.
        sync_every_step: Read every step's loss at once (``--sync-every-step``, for
            measuring what overlapping the host and the device gains).
        damaged: Steps already found damaged when their arrays were read (a
            checksum mismatch, which the cheap check cannot see), each with its
            ``'ckpt-damaged'`` problem: ``resume`` takes the newest intact step before them.
        names: ``--names FILE``: path rules naming a factory's arrays (``None``: the
            checkpoint's, when resuming one trained with them).
    """

    mesh: str = "2x4"
    rules: str = "fsdp_tp"
    axes: str | None = None
    config: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: str | None = None
    ckpt_dir: str | None = None
    resume: bool = False
    resume_step: int | None = None
    metrics: str | None = None
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    model: str | None = None
    devices: DeviceChoice | None = None
    sync_every_step: bool = False
    damaged: tuple[DamagedStep, ...] = ()
    names: str | None = None
