"""Where a ``meshplan train`` run's model and batches come from: the :class:`ModelSource` protocol.

:func:`meshplan.cli.train.prepare.prepare_run` is one skeleton for every source: the
flags read, the settings decided, the model, the checks that need nothing built, the
library's build (with the memory of a step), what the build found, then the batches
and the measures. A source says what differs: what it refuses, its model, its example
and memory batches, its batches and its measures. Two are built in:
:class:`~meshplan.cli.train.builtin_source.BuiltInSource` (the byte-level Transformer
on a byte corpus, ``--model transformer`` or ``transformer-nnx``) and
:class:`~meshplan.cli.train.factory_source.FactorySource` (``--model
pkg.module:factory``). A third source is one more class with the methods of
:class:`ModelSource`, picked in :func:`~meshplan.cli.train.prepare.source_for`.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

from meshplan._errors import MeshError, Problem
from meshplan._types import PyTree
from meshplan.cli.train.findings import Findings

if TYPE_CHECKING:
    from jax.sharding import Mesh
    from rich.console import Console

    from meshplan._checkpoint.metadata import CheckpointMetadata
    from meshplan._spmd.rules import LogicalRules
    from meshplan.cli.devices import DeviceChoice
    from meshplan.cli.train.memory_advice import BatchWords
    from meshplan.cli.train.preflight import FlagsRead
    from meshplan.cli.train.request import TrainRequest
    from meshplan.train.build import BuiltParts
    from meshplan.train.flops import MeshPeak
    from meshplan.train.model import TrainModel
    from meshplan.train.settings import TrainSettings
    from meshplan.train.state import PlanSummary
    from meshplan.train.trainer import Batches, Trainer

__all__ = ["Found", "ModelSource", "uneven_problems"]


@dataclasses.dataclass
class Found:
    """What a source found, by kind, in the order a user reads them (:meth:`ordered`).

    Attributes:
        refused: Flags and checkpoints this source does not take (``--layers`` for a
            factory's model, a checkpoint of another model).
        settings: The settings decided, refused (``--steps 0``).
        config: The model's config (sizes that do not fit together).
        model: ``--model`` itself (a name nobody knows).
        batch: The batch against the mesh and rules (said once the mesh is made).
        data: The data the batches come from.
        state: What the library's build found (the checkpoint's arrays, the layout
            against the parameters, a factory's batches and loss).
    """

    refused: Findings = dataclasses.field(default_factory=Findings)
    settings: Findings = dataclasses.field(default_factory=Findings)
    config: Findings = dataclasses.field(default_factory=Findings)
    model: Findings = dataclasses.field(default_factory=Findings)
    batch: Findings = dataclasses.field(default_factory=Findings)
    data: Findings = dataclasses.field(default_factory=Findings)
    state: Findings = dataclasses.field(default_factory=Findings)

    def ordered(self, flags: FlagsRead, mesh_made: bool = True) -> Findings:
        """Every problem: the placement, the checkpoint, the settings, the metrics file,
        then the model's (the batch's only once the mesh is made)."""
        batch = self.batch if mesh_made else Findings()
        placement = (flags.layout, flags.mesh, flags.ckpt)
        model = (self.config, self.model, batch, self.data, self.state)
        return Findings.joined(*placement, self.refused, self.settings, flags.metrics, *model)


class ModelSource(Protocol):
    """Where a run's model and batches come from, and what the command says of them.

    :func:`~meshplan.cli.train.prepare.prepare_run` calls these in this order; each
    adds the problems it finds to ``found`` (every one raised at once, before any array
    is created). A third source (say, a model from a registry of one's own) is one class
    with these methods, picked in :func:`~meshplan.cli.train.prepare.source_for`:

    .. code-block:: python

        class MySource:
            spec, units = "my-model", ("examples/s", "")
            def given(self, request, stored, found): return dict(request.settings)
            def model(self, request, stored, settings, found): return TrainModel(...)
            def check(self, request, flags, settings, found): pass
            def example_batch(self, settings): return None
            def memory_batch(self, settings): return jax.ShapeDtypeStruct(...)
            def memory_words(self, settings): return BatchWords("--batch 8", ...)
            def built(self, request, parts, stored, settings, found): pass
            def batches(self, settings, mesh, rules): return lambda split, i: ...
            def peak(self, request, settings, mesh): return None
            def flops(self, settings): return None
            def config(self): return None
            def record(self): return {"model": self.spec}
            def notes(self, request, parts, resumed): return []
            def header(self, console, trainer, plan, devices, peak): ...

    Attributes:
        spec: ``--model`` as the checkpoints record it.
        units: The rate and the loss's unit in the progress bar and the summary
            (``("tokens/s", " nats/byte")``).
    """

    spec: str
    units: tuple[str, str]

    def given(
        self, request: TrainRequest, stored: CheckpointMetadata | None, found: Found
    ) -> dict[str, Any]:
        """What it refuses of the request (to ``found.refused``, ``found.model``), and the
        settings the flags give, as :class:`TrainSettings` fields (its own overrides in)."""
        ...

    def preset(self, request: TrainRequest) -> dict[str, Any]:
        """Settings of a preset size (``--size base``), under the checkpoint's and the flags'."""
        ...

    def model(
        self,
        request: TrainRequest,
        stored: CheckpointMetadata | None,
        settings: TrainSettings,
        found: Found,
    ) -> TrainModel | None:
        """The model to train (``None``: it cannot be had, said in ``found``)."""
        ...

    def check(
        self, request: TrainRequest, flags: FlagsRead, settings: TrainSettings, found: Found
    ) -> None:
        """What needs nothing built: the batch against the mesh's sizes and the rules (the
        library's records, kept and worded in flags with what the build found, :meth:`built`)."""
        ...

    def example_batch(self, settings: TrainSettings) -> PyTree | None:
        """A batch (``ShapeDtypeStruct``\\ s) the library checks against the layout, or ``None``."""
        ...

    def memory_batch(self, settings: TrainSettings) -> PyTree | None:
        """What a device holds of a step's batch at a time (one microbatch), for the memory check
        (``None``: nothing to trace, e.g. a batch that :meth:`check` found does not fit)."""
        ...

    def memory_words(self, settings: TrainSettings) -> BatchWords:
        """How the memory advice names this source's batch and what makes it smaller."""
        ...

    def built(
        self,
        request: TrainRequest,
        parts: BuiltParts,
        stored: CheckpointMetadata | None,
        settings: TrainSettings,
        found: Found,
    ) -> None:
        """What the library found, in flags: its build (to ``found.state``), and what
        :meth:`check` kept of the batch (to ``found.batch``)."""
        ...

    def batches(self, settings: TrainSettings, mesh: Mesh, rules: LogicalRules) -> Batches:
        """``batches(split, index)``, placed on the mesh."""
        ...

    def flops(self, settings: TrainSettings) -> float | None:
        """The model FLOPs of one step (``None``: unknown: no MFU)."""
        ...

    def peak(self, request: TrainRequest, settings: TrainSettings, mesh: Mesh) -> MeshPeak:
        """The devices' peak MFU is measured against, or why there is none."""
        ...

    def config(self) -> dict[str, Any] | None:
        """The model's config, as the checkpoints store it (``None``: none)."""
        ...

    def record(self) -> dict[str, Any]:
        """What the checkpoints record of the model (``{"model": spec, ...}``)."""
        ...

    def notes(self, request: TrainRequest, parts: BuiltParts, resumed: list[str]) -> list[str]:
        """What to say before the run, from what the library built and found (``parts``),
        with the resume's notes (``resumed``) in place."""
        ...

    def header(
        self,
        console: Console,
        trainer: Trainer,
        plan: PlanSummary,
        devices: DeviceChoice,
        peak: MeshPeak,
    ) -> None:
        """What is trained on which mesh, with the library's ``plan`` per device, said
        before the first step."""
        ...


_SHOWN = 6
"""Parameters the layout cannot split shown in full; the rest are listed by path."""


def uneven_problems(request: TrainRequest, uneven: list[Problem], found: Findings) -> None:
    """The parameters the layout cannot split evenly on the mesh
    (:attr:`~meshplan.train.build.BuiltParts.uneven`), in flags."""
    fix = (
        "Pick a layout that leaves that dimension whole (e.g. data_parallel), a mesh "
        "whose axes divide it, or model sizes that are multiples of the mesh axes."
    )
    where = f"--rules {request.rules} on the {request.mesh} mesh"
    for p in uneven[:_SHOWN]:
        found.add(MeshError, f"{where}: {p.path}: {p.message}", fix, p.code, "--rules")
    if len(uneven) > _SHOWN:
        rest = ", ".join(dict.fromkeys(p.path for p in uneven[_SHOWN:]))
        found.add(
            MeshError,
            f"and {len(uneven) - _SHOWN} more parameters with a dimension that does not "
            f"split: {rest}",
            fix,
            "indivisible",
            "--rules",
        )
