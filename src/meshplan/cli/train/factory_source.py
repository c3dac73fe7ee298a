"""``meshplan train --model pkg.module:factory``: a user's own model, trained on its own batches.

The factory's four-value form (:mod:`meshplan.cli.factory`) gives the model, an
example batch, the loss and the batches; :class:`FactorySource` is its
:class:`~meshplan.cli.train.source.ModelSource`: the run is checked like the built-in
Transformer's, by the same :func:`~meshplan.cli.train.prepare.prepare_run` (rules,
mesh, checkpoint folder, settings, the layout against every parameter and batch
array, the memory of a step), then trained by the same :class:`Trainer`, with the
same checkpoints. A resumed run imports the factory again and checks that the
checkpoint's arrays fit its state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from numpy.typing import ArrayLike

from meshplan._checkpoint.metadata import CheckpointMetadata
from meshplan._errors import ArgumentError, CheckpointError, MeshplanError
from meshplan._spmd.by_path import PathRules
from meshplan._spmd.rules import LogicalRules, logical_to_mesh_axes
from meshplan._types import PyTree
from meshplan.cli.factory import IterableBatches, Trainable, load_factory
from meshplan.cli.names_file import no_names_text, notes_text, read_names
from meshplan.cli.train.display import own_header
from meshplan.cli.train.factory_checks import factory_problems
from meshplan.cli.train.findings import Findings
from meshplan.cli.train.flags import MODEL_FLAGS
from meshplan.cli.train.flags import flag as model_flag
from meshplan.cli.train.memory_advice import BatchWords
from meshplan.cli.train.source import Found, uneven_problems
from meshplan.cli.trained_models import model_of
from meshplan.train.flops import MeshPeak
from meshplan.train.model import TrainModel
from meshplan.train.settings import TrainSettings

if TYPE_CHECKING:
    from rich.console import Console

    from meshplan.cli.devices import DeviceChoice
    from meshplan.cli.train.preflight import FlagsRead
    from meshplan.cli.train.request import TrainRequest
    from meshplan.train.build import BuiltParts
    from meshplan.train.state import PlanSummary
    from meshplan.train.trainer import Batches, Trainer

__all__ = ["FactorySource", "batch_placer", "place_batch"]


def place_batch(batch: PyTree, mesh: Mesh, rules: LogicalRules) -> PyTree:
    """A global host batch on ``mesh``: every array's first dimension is ``'batch'``.

    Every process passes the same global batch; each device gets its slice.

    Example:
        >>> import jax, numpy as np
        >>> from meshplan.cli.train.factory_source import place_batch
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> images, labels = place_batch((np.zeros((8, 3, 3)), np.zeros(8, np.int32)), mesh,
        ...                              (("batch", "data"),))
        >>> images.sharding.spec, labels.sharding.spec
        (P('data', None, None), P('data',))
    """

    return batch_placer(mesh, rules)(batch)


def batch_placer(mesh: Mesh, rules: LogicalRules) -> Callable[[PyTree], PyTree]:
    """:func:`place_batch` for every step's batch: each rank's sharding is resolved once."""
    shardings: dict[int, NamedSharding] = {}

    def put(x: ArrayLike) -> jax.Array:
        x = np.asarray(x)
        if x.ndim not in shardings:
            spec = logical_to_mesh_axes(("batch",) + (None,) * (x.ndim - 1), rules)
            shardings[x.ndim] = NamedSharding(mesh, spec)
        sharding = shardings[x.ndim]
        if sharding.is_fully_addressable:  # one process: the batched host-to-devices copy
            put: jax.Array = jax.device_put(x, sharding)
            return put
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

    def place(batch: PyTree) -> PyTree:
        return jax.tree.map(put, batch)

    return place


@dataclasses.dataclass
class FactorySource:
    """A ``--model pkg.module:factory`` model: a :class:`~meshplan.cli.train.source.ModelSource`.

    Attributes:
        spec: ``--model`` (``pkg.module:factory``).
        trainable: What the factory gave (``None`` until :meth:`given`, or when it cannot
            train: said in the problems).
        names: The path rules that name its arrays (``--names``, else the checkpoint's).
        names_file: ``--names FILE`` as read with the other flags
            (:attr:`~meshplan.cli.train.preflight.FlagsRead.names`): its rules, or why it
            cannot be read (``None``: no file, or ``--names infer``).
        loaded_notes: What naming it by path warned of.
    """

    spec: str
    names_file: PathRules | MeshplanError | None = None
    units: tuple[str, str] = ("examples/s", "")
    trainable: Trainable | None = None
    names: PathRules | None = None
    loaded_notes: list[str] = dataclasses.field(default_factory=list)

    def given(
        self, request: TrainRequest, stored: CheckpointMetadata | None, found: Found
    ) -> dict[str, Any]:
        """The factory imported and called; the flags of the built-in Transformer refused;
        ``--batch`` is the rows of the factory's batches."""
        spec, refused = self.spec, found.refused
        if stored is not None and model_of(stored) != spec:
            refused.add(
                CheckpointError,
                f"the checkpoint holds --model {model_of(stored)}, this run asks for --model "
                f"{spec}",
                f"Resume with --model {model_of(stored)}, or train into a new --ckpt-dir.",
                "ckpt-other-model",
                "--model",
            )
        _refuse_transformer_flags(request, spec, refused)
        self._load(request, stored, refused)
        given: dict[str, Any] = dict(request.settings)
        if "seq_len" in given:  # the Transformer's sequence: a factory's batches give the shapes
            refused.add(
                ArgumentError,
                f"--seq sets the built-in Transformer's sequence, not --model {spec}",
                "Leave out --seq: the factory's batches give the shapes.",
                "factory-seq",
                "--seq",
            )
        if self.trainable is None:
            return given
        rows = jax.tree.leaves(self.trainable.example_batch)[0].shape[0]
        if "batch" in given and given["batch"] != rows:
            refused.add(
                ArgumentError,
                f"--batch {given['batch']}, but the batches of --model {spec} hold {rows}",
                f"Leave out --batch (it is {rows}), or change the factory's batches.",
                "factory-batch-size",
                "--batch",
            )
        return {**given, "batch": rows, "seq_len": 1}

    def _load(
        self, request: TrainRequest, stored: CheckpointMetadata | None, found: Findings
    ) -> None:
        """Imports the factory (named by ``--names``, else by the checkpoint's path rules)."""
        spec = self.spec
        stored_names = None if stored is None else (stored.extra.get("train") or {}).get("names")
        try:
            if isinstance(self.names_file, MeshplanError):
                raise self.names_file  # the file of --names, read with the flags
            if self.names_file is not None:
                self.names = self.names_file
            elif request.names is not None:  # --names infer: from the factory's step
                self.names = read_names(request.names, spec)
            elif stored_names:  # trained with --names: the checkpoint keeps the rules
                self.names = tuple((p, None if n is None else tuple(n)) for p, n in stored_names)
            loaded = load_factory(spec, self.names)
        except MeshplanError as e:
            found.add_error(e)
            return
        self.trainable = loaded.trainable
        self.loaded_notes = notes_text(loaded.notes)
        if self.trainable is None:
            found.add(
                ArgumentError,
                f"--model {spec} gives no batches to train on (its factory returns the form "
                f"plan and search take)",
                "Return (model, example_batch, loss, batches) from the factory: batches is "
                "batches(split, index) -> batch, or an iterable of batches.",
                "factory-no-batches",
                "--model",
            )

    def preset(self, request: TrainRequest) -> dict[str, Any]:
        return {}  # --size is the built-in Transformer's, refused above

    def model(
        self,
        request: TrainRequest,
        stored: CheckpointMetadata | None,
        settings: TrainSettings,
        found: Found,
    ) -> TrainModel | None:
        return None if self.trainable is None else self.trainable.model

    def check(
        self, request: TrainRequest, flags: FlagsRead, settings: TrainSettings, found: Found
    ) -> None:
        """The factory's first batches against its example batch, and its loss on the
        example batch, before anything is built (its parameters traced, nothing run)."""
        own = self.trainable
        if own is None or settings.problems():
            return
        try:
            params = own.model.abstract_state().params
        except Exception:  # the build says what creating the state raised
            return
        factory_problems(self.spec, own, params, settings.eval_batches, found.state)

    def example_batch(self, settings: TrainSettings) -> PyTree | None:
        return None if self.trainable is None else self.trainable.example_batch

    def memory_batch(self, settings: TrainSettings) -> PyTree:
        assert self.trainable is not None  # else refused
        micro = max(settings.batch // settings.grad_accum, 1)  # a device holds one at a time
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((micro, *x.shape[1:]), x.dtype),
            self.trainable.example_batch,
        )

    def memory_words(self, settings: TrainSettings) -> BatchWords:
        accum = settings.grad_accum
        return BatchWords(
            f"a batch of --model {self.spec} ({settings.batch} examples"
            + (f" in {accum} microbatches)" if accum > 1 else ")"),
            "examples",
            "Return batches of {largest} examples or fewer from the factory",
            "--grad-accum {accum} (the same batch in microbatches that fit, one update)",
        )

    def built(
        self,
        request: TrainRequest,
        parts: BuiltParts,
        stored: CheckpointMetadata | None,
        settings: TrainSettings,
        found: Found,
    ) -> None:
        """What creating the state raised, the checkpoint's arrays that do not fit it, the
        parameters and batch arrays the layout cannot split."""
        spec, state = self.spec, found.state
        if self.trainable is not None and parts.state_error is not None:
            raised = parts.state_error
            state.add(
                ArgumentError,
                f"--model {spec}: creating the {self.trainable.name}'s state with the optimizer "
                f"(--lr {settings.lr:g}) raised {type(raised).__name__}: {raised}",
                "Check that the factory's model initialises on its example batch (the first "
                "item of a tuple batch) and that its parameters are arrays.",
                "factory-init",
                "--model",
            )
        if stored is not None and parts.mismatch:
            mismatch = parts.mismatch
            state.add(
                CheckpointError,
                f"{len(mismatch)} arrays differ between the checkpoint (step {stored.step}) "
                f"and the model --model {spec} builds now, e.g. {mismatch[0].path}: "
                f"{mismatch[0].message}",
                "Resume with the factory the checkpoint was trained with, or train into a new "
                "--ckpt-dir.",
                "checkpoint-mismatch",
                "--ckpt-dir",
            )
        uneven_problems(request, parts.uneven, state)
        for p in parts.batch:
            state.add(MeshplanError, f"{p.path}: {p.message}", p.fix, p.code, "--rules")

    def batches(self, settings: TrainSettings, mesh: Mesh, rules: LogicalRules) -> Batches:
        assert self.trainable is not None  # else refused
        source = self.trainable.batches
        if isinstance(source, IterableBatches):
            source.hold_out(settings.eval_batches)  # the first batches are the validation set
        place = batch_placer(mesh, rules)

        def batches(split: str, index: int) -> PyTree:
            return place(source(split, index))

        return batches

    def flops(self, settings: TrainSettings) -> float | None:
        return None  # meshplan has no FLOP count for a model of your own

    def peak(self, request: TrainRequest, settings: TrainSettings, mesh: Mesh) -> MeshPeak:
        return MeshPeak(None, None, "no FLOP count for a model of your own")

    def config(self) -> dict[str, Any] | None:
        return None

    def record(self) -> dict[str, Any]:
        """The factory, and the path rules that named it (a resumed run without ``--names``
        names it the same way)."""
        if self.names is None:
            return {"model": self.spec}
        pairs = [[p, None if n is None else list(n)] for p, n in self.names]
        return {"model": self.spec, "names": pairs}

    def notes(self, request: TrainRequest, parts: BuiltParts, resumed: list[str]) -> list[str]:
        """An unnamed model first (it trains every array replicated), then the naming's notes."""
        notes = list(self.loaded_notes)
        if parts.unnamed is not None:  # the library's finding, in flags
            notes.insert(0, no_names_text([parts.unnamed], self.spec, str(request.rules)) or "")
        return [*notes, *resumed]

    def header(
        self,
        console: Console,
        trainer: Trainer,
        plan: PlanSummary,
        devices: DeviceChoice,
        peak: MeshPeak,
    ) -> None:
        assert self.trainable is not None  # else refused
        own_header(console, trainer, plan, self.trainable, self.spec, devices)


def _refuse_transformer_flags(request: TrainRequest, spec: str, found: Findings) -> None:
    """``--size``, the size flags and ``--data`` are the built-in Transformer's."""
    dests = {field: dest for dest, field in MODEL_FLAGS.items()}
    for flag in (["--size"] if request.config else []) + [
        model_flag(dests.get(name, name)) for name in request.overrides
    ]:
        found.add(
            ArgumentError,
            f"{flag} sets the built-in Transformer, not --model {spec}",
            f"Leave out {flag}: the factory builds the model.",
            "factory-transformer-flag",
            flag,
        )
    if request.data is not None:
        found.add(
            ArgumentError,
            f"--data reads text for the built-in Transformer; --model {spec} brings its "
            f"own batches",
            "Leave out --data: the factory's fourth value gives the batches.",
            "factory-data",
            "--data",
        )
