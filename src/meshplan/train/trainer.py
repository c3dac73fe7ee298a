"""The training loop behind ``meshplan train``: sharded state, jitted steps, resumable runs.

:class:`Trainer` takes everything specific to a model as arguments: the Flax
model, its loss, where batches come from, and the settings. It knows no
model, data set or command-line flag; ``meshplan train`` wires in its
byte-level Transformer recipe (:mod:`meshplan.cli.train.request`).

The recipe is the guide's:

1. ``jax.eval_shape`` of the init function gives the abstract ``TrainState``
   (boxes holding ``ShapeDtypeStruct``\\ s);
2. :func:`meshplan.logical_to_mesh_sharding` of its logical specs gives the
   state's shardings under the chosen layout;
3. ``jax.jit(init, out_shardings=...)`` creates every array where it belongs,
   or :func:`meshplan._checkpoint.restore.restore_into` reads a checkpoint straight into
   those shardings;
4. a jitted train step donates the old state and returns the new one with the
   same shardings; batches arrive already placed on the mesh (e.g. with
   ``jax.make_array_from_process_local_data``), and the steps take their
   shardings.

The host does not wait for the device without need: each step is dispatched,
the next batch is prepared and placed while it runs, and a step's loss is
read (the one sync) only after the next step is dispatched, so the device
always has work queued. The divergence check therefore trails by a step; a
step is never saved before its loss was read and found finite (and the
checkpoint library refuses non-finite states anyway). ``sync_every_step``
reads each loss at once instead (the slower way, to measure the difference).

A step costs the host no more than a bare jitted loop does
(``benchmarks/bench_train_overhead.py``): the step is compiled ahead of time
once per distinct batch (shapes, dtypes, shardings) over the state's flat list
of arrays, so a step neither rebuilds the state's tree of boxes nor looks up a
jit cache nor enters the mesh context; :attr:`state` builds the tree when read.
The loss (and metrics) start their copy to the host at dispatch and are read
together, one ``jax.device_get``.

When batches are a function of (split, index) and the learning-rate schedule
of the step only, as in ``meshplan train``, a run resumed from a checkpoint
(on any mesh, with any layout) sees exactly the batches and updates of an
uninterrupted one.

The parts, one concern each: :mod:`meshplan.train.device_mesh` (meshes),
:mod:`meshplan.train.settings` (settings and optimizer),
:mod:`meshplan.train.state` (the sharded state), :mod:`meshplan.train.parts` (what a
:class:`Trainer` is built from), :mod:`meshplan.train.records` (what a run reports),
and this module (the loop).
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from meshplan._checkpoint.checkpointer import Checkpointer
from meshplan._checkpoint.metadata import UnverifiedWarning
from meshplan._checkpoint.restore import restore_into
from meshplan._errors import CheckpointError
from meshplan._spmd.explicit import explicit_mesh_error, is_sharding_type_error
from meshplan._spmd.rules import logical_axis_rules
from meshplan._types import Batch, PyTree
from meshplan.train.diagnosis import NanCause, nan_cause
from meshplan.train.model import TrainModel
from meshplan.train.parts import Checkpoints, Measures, Placement, group_parts
from meshplan.train.records import (
    Diverged,
    StepRecord,
    TrainResult,
    sane_step,
    valid_changed_note,
    valid_changes,
    valid_setting,
)
from meshplan.train.settings import TrainSettings, make_optimizer
from meshplan.train.state import (
    PlanSummary,
    abstract_train_state,
    init_fn,
    plan_summary,
    sequence_input,
    state_shardings,
)

__all__ = ["Batches", "Loss", "Trainer"]

Loss = Callable[[PyTree, Batch], jax.Array]
"""``loss(params, batch) -> scalar``: the loss to minimise (``params``: the model's
``params`` collection, boxed, or its ``nnx.State``; ``batch``: what :data:`Batches` gives)."""

Batches = Callable[[str, int], Batch]
"""``batches(split, index) -> batch``: batch number ``index`` of ``split``
(``"train"``: the batch of step ``index``; ``"valid"``: the ``index``-th fixed
validation batch), as ``jax.Array``\\ s already placed on the mesh."""


def _fold(x: jax.Array, accum: int) -> jax.Array:
    """``x[batch, ...]`` as ``[batch / accum, accum, ...]``: row ``r`` at ``(r // accum, r % accum)``.

    Each device keeps the rows it holds (the first dimension stays split as
    the batch was), so microbatch ``i``, ``[:, i]``, needs no communication.
    """
    return x.reshape(x.shape[0] // accum, accum, *x.shape[1:])


class Trainer:
    """A training run: a model, its loss and batches, on a mesh under a layout.

    Build it (``meshplan train`` builds it with
    :func:`meshplan.cli.train.request.prepare`, which checks the request
    first), then :meth:`run` (or :meth:`start` and :meth:`train_step`; :meth:`open` first
    takes the checkpoint folder's lock before any work, as :meth:`run` does).

    Args:
        model: The :class:`~meshplan.train.model.TrainModel`: the Flax Linen
            model (or ``init_params(key) -> params`` callable, e.g. the ``init`` of
            a functional Flax NNX model), its ``loss(params, batch)``
            (:data:`Loss`), the example input of ``init`` (default
            :func:`meshplan.train.state.sequence_input`) and ``has_aux`` (the loss
            returns ``(loss, metrics)``, reported with each step).
        batches: ``batches(split, index) -> batch`` (:data:`Batches`), placed
            on the mesh.
        settings: The :class:`TrainSettings`.
        placement: The :class:`Placement`: mesh, rules and layout name.
        checkpoints: The :class:`Checkpoints`: folder, resume point, what is
            recorded (default: no checkpoints).
        measures: The :class:`Measures` (default: no MFU, the host runs ahead).
        tx: The optimizer (default :func:`meshplan.train.settings.make_optimizer`).
        abstract: ``jax.eval_shape`` of the state, when already traced.
        shardings: The state's ``NamedSharding``\\ s under the layout, when already had
            (:attr:`meshplan.train.build.BuiltParts.shardings`).
        notes: Sentences for the user known before the run (:attr:`notes`).
        **separate: The fields of ``model`` (``loss``, ``example_input``,
            ``has_aux``, with ``model`` the Flax model itself), of ``placement``, of
            ``checkpoints`` and of ``measures`` one by one, instead of the groups.

    With ``settings.grad_accum = N`` a step's batch is cut into ``N``
    microbatches (rows ``i, i + N, i + 2N, ...`` are microbatch ``i``: each
    device keeps its own rows), their gradients summed by a ``jax.lax.scan``
    and averaged: the update of the whole batch, with the activations of one
    microbatch alive at a time.

    Attributes:
        notes: Sentences for the user about the checkpoint folder (a stale lock
            taken over, damaged steps and later steps moved aside), filled by
            :meth:`open` and :meth:`start`.
        set_aside: ``(steps, folder)``: the later steps of an old branch that
            :meth:`start` moved aside, or ``None``.
        saved_on_disk: The complete steps in ``ckpt_dir`` when :meth:`close`
            ran (``[]`` before).
        latest_saved: The latest of them, or ``None``.
        best_saved: ``(step, valid_loss)`` of the best checkpoint among them
            (never deleted by the keep policy), or ``None``.
        step: The current step (host-side counter).
        state: The sharded ``TrainState`` (after :meth:`start`).
        shardings: The state's ``NamedSharding``\\ s.
    """

    def __init__(
        self,
        model: TrainModel | nn.Module | Callable[[jax.Array], PyTree] | None = None,
        batches: Batches | None = None,
        settings: TrainSettings | None = None,
        placement: Placement | None = None,
        checkpoints: Checkpoints | None = None,
        measures: Measures | None = None,
        *,
        tx: optax.GradientTransformation | None = None,
        abstract: PyTree = None,
        shardings: PyTree = None,
        notes: Sequence[str] = (),
        **separate: object,
    ) -> None:
        model, placement, checkpoints, measures = group_parts(
            model, placement, checkpoints, measures, separate
        )
        if batches is None or settings is None:
            raise TypeError("Trainer needs batches and settings")
        self.train_model = model
        self.model = model.model
        self.has_aux = model.has_aux
        self.loss = model.loss
        self.batches = batches
        self.settings = settings
        self.placement = placement
        self.mesh = placement.mesh
        self.rules = placement.rules
        self.example_input = (
            sequence_input(settings) if model.example_input is None else model.example_input
        )
        self.checkpoints = checkpoints
        self.config = None if checkpoints.config is None else dict(checkpoints.config)
        self.record = dict(checkpoints.record)
        self.ckpt_dir = checkpoints.ckpt_dir
        self.resume_from = checkpoints.resume_from
        self.layout_name = placement.layout_name
        self.notes: list[str] = list(notes)
        keep = checkpoints.max_to_keep
        self.max_to_keep = settings.keep if keep is None else keep
        self.discard_steps = tuple(int(s) for s in checkpoints.discard_steps)
        self.discard_why = {int(k): str(v) for k, v in checkpoints.discard_why.items()}
        self.measures = measures
        self.flops_per_step = measures.flops_per_step
        self.peak_flops_per_s = measures.peak_flops_per_s
        self.sync_every_step = measures.sync_every_step
        self.best_saved: tuple[int, float] | None = None
        self.latest_saved: int | None = None
        self.saved_on_disk: list[int] = []
        self.losses_seen: dict[int, float] = {}
        self._start_step = 0
        self.set_aside: tuple[list[int], str] | None = None
        self._last_eval: tuple[int, float] | None = None
        # What the settings decide (against the checkpoint's) first, then what is built.
        self.best_valid: tuple[int, float] | None = None
        self.valid_setting = valid_setting(settings.to_dict(), self.record.get("data"))
        resume_from = self.resume_from
        if resume_from is not None:
            best = resume_from.extra.get("best_valid")
            self.best_valid = (int(best[0]), float(best[1])) if best else None
            stored = dict(resume_from.extra.get("train") or {})
            before = valid_setting(stored, stored.get("data"))
            if stored and before != self.valid_setting:
                changes = valid_changes(stored, settings.to_dict(), self.record.get("data"))
                self.best_valid = None
                self.notes.append(valid_changed_note(resume_from.step, changes))
        # A caller that has built both to check a request passes them: not traced twice.
        self.tx = make_optimizer(settings) if tx is None else tx
        self.abstract = (
            abstract_train_state(self.model, self.tx, settings, self.example_input)
            if abstract is None
            else abstract
        )
        self.shardings = (
            state_shardings(self.abstract, self.mesh, self.rules)
            if shardings is None
            else shardings
        )
        # The state between steps: its arrays as a flat list (the steps take and give
        # that list, so a step unflattens nothing in Python), the tree built on access.
        self._state: PyTree = None
        self._leaves: list[jax.Array] | None = None
        self._treedef: Any = None
        self.step = 0
        self._checkpointer: Checkpointer | None = None
        self._opened = False  # open() ran (close() does not undo it: a closed folder stays shut)
        self._train_step: Callable[[PyTree, Batch], tuple[PyTree, jax.Array, PyTree]] | None = None
        self._eval_step: Callable[[PyTree, Batch], jax.Array] | None = None
        # The step over flat leaves, jitted, and its executables by batch signature.
        self._flat_step: Any = None
        self._executables: dict[object, object] = {}
        self._valid_batches: list[Batch] | None = None
        self._step_metrics: dict[int, PyTree] = {}

    @property
    def state(self) -> PyTree:
        """The sharded ``TrainState`` (``None`` before :meth:`start`)."""
        if self._state is None and self._leaves is not None:
            self._state = jax.tree.unflatten(self._treedef, self._leaves)
        return self._state

    @state.setter
    def state(self, value: PyTree) -> None:
        self._state, self._leaves = value, None

    # -- context ---------------------------------------------------------------

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The mesh and rules in effect while tracing and running the steps."""
        with jax.set_mesh(self.mesh), logical_axis_rules(self.rules):
            yield

    # -- summaries -------------------------------------------------------------

    def plan_summary(self) -> PlanSummary:
        """Parameter count and per-device bytes of the parameters and of the whole state.

        From :func:`meshplan.explain` (see :func:`meshplan.train.state.plan_summary`).
        """
        return plan_summary(self.abstract, self.shardings, self.mesh, self.rules, self.layout_name)

    # -- state -----------------------------------------------------------------

    def open(self) -> None:
        """Opens the checkpoint folder for writing: checks it, takes its lock (no-op without one).

        Call it before any work to fail early (:meth:`run` calls it first; :meth:`start`
        when it resumes, before reading; :meth:`save` when it was never called). It changes
        no step: the steps after ``resume_from`` are dealt with by :meth:`start`,
        once the state to resume has been read and verified.

        Raises:
            CheckpointError: ``'ckpt-not-writable'``, ``'ckpt-not-a-folder'``,
                ``'ckpt-locked'`` (another live run writes there).
        """
        if self.ckpt_dir is None or self._checkpointer is not None:
            return
        self._opened = True
        ckpt = Checkpointer(self.ckpt_dir, max_to_keep=self.max_to_keep)
        self._checkpointer = ckpt
        if ckpt.note:
            self.notes.append(ckpt.note)

    def start(self) -> None:
        """Creates the sharded state: read from the checkpoint being resumed, or fresh.

        Resuming, it opens the checkpoint folder first (:meth:`open`: its lock, before
        anything is read), reads the state and verifies it; only then are the steps after
        it moved aside (never deleted; damaged ones each into ``damaged-step-<N>`` with the
        reason, the rest into ``old-branch-after-step-<resume step>``:
        :meth:`Checkpointer.branch_from`, whose notes join :attr:`notes`), so a step that
        cannot be read changes nothing in the folder. A fresh state needs nothing of the
        folder: it is made where the layout puts it, and the folder is opened by
        :meth:`open` (which :meth:`run` calls first, and :meth:`save` when nobody did).
        Nothing is compiled yet.
        """
        if self.resume_from is not None:
            assert self.ckpt_dir is not None  # resume_from is a checkpoint in ckpt_dir
            self.open()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", UnverifiedWarning)
                # Straight into the state's shardings (the layout's, had once): no name
                # of the checkpoint is mapped through the rules again.
                state = restore_into(
                    self.ckpt_dir, self.abstract, self.shardings, self.resume_from.step
                )
            for w in caught:  # an unverified step is said with the notes; others as they were
                if issubclass(w.category, UnverifiedWarning):
                    self.notes.append(str(w.message))
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            self.state = state
            self.step = int(self.resume_from.step)
            # Only now, the state read and verified, the later steps go out of the way (never
            # deleted); the checkpoint layer says every move, one note each.
            assert self._checkpointer is not None  # opened above: resume_from is in ckpt_dir
            damaged = {
                s: self.discard_why.get(s, "it failed verification") for s in self.discard_steps
            }
            moved = self._checkpointer.branch_from(self.step, damaged, str(self.ckpt_dir))
            self.notes.extend(moved.notes)
            self.set_aside = moved.set_aside
        else:
            init = init_fn(self.model, self.tx, self.example_input)
            with self.active():
                self.state = jax.jit(init, out_shardings=self.shardings)(
                    jax.random.key(self.settings.seed)
                )
            self.step = 0

    def _compile(self, batch: PyTree) -> None:
        """Jits the steps for batches placed like ``batch``."""
        batch_shardings = jax.tree.map(lambda x: x.sharding, batch)
        value_and_grad = jax.value_and_grad(self._loss_and_metrics, has_aux=True)
        accum = self.settings.grad_accum

        def gradients(params: PyTree, batch: PyTree) -> PyTree:
            (value, metrics), grads = value_and_grad(params, batch)
            return value, metrics, grads

        def train_step(state: PyTree, batch: PyTree) -> tuple[PyTree, jax.Array, PyTree]:
            if accum == 1:
                value, metrics, grads = gradients(state.params, batch)
                return state.apply_gradients(grads=grads), value, metrics
            micro = jax.tree.map(lambda x: jnp.swapaxes(_fold(x, accum), 0, 1), batch)
            first = jax.tree.map(lambda x: x[0], micro)
            shapes = jax.eval_shape(gradients, state.params, first)
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            def add(total: PyTree, microbatch: Batch) -> tuple[PyTree, None]:
                part = gradients(state.params, microbatch)
                return jax.tree.map(jnp.add, total, part), None

            total, _ = jax.lax.scan(add, zeros, micro)
            value, metrics, grads = jax.tree.map(lambda x: x / accum, total)
            return state.apply_gradients(grads=grads), value, metrics

        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._train_step = jax.jit(
            train_step,
            in_shardings=(self.shardings, batch_shardings),
            out_shardings=(self.shardings, replicated, replicated),
            donate_argnums=(0,),
        )
        treedef: Any = jax.tree.structure(self.abstract)
        self._treedef = treedef
        flat_shardings = jax.tree.leaves(self.shardings)  # (boxes hold one array each)
        assert len(flat_shardings) == treedef.num_leaves, (len(flat_shardings), treedef)

        def flat_step(
            leaves: list[jax.Array], batch: PyTree
        ) -> tuple[list[jax.Array], jax.Array, PyTree]:
            state, value, metrics = train_step(jax.tree.unflatten(treedef, leaves), batch)
            return treedef.flatten_up_to(state), value, metrics

        self._flat_step = jax.jit(
            flat_step,
            out_shardings=(flat_shardings, replicated, replicated),
            donate_argnums=(0,),
        )
        self._eval_step = jax.jit(
            lambda params, batch: self._loss_and_metrics(params, batch)[0],
            in_shardings=(self.shardings.params, batch_shardings),
            out_shardings=replicated,
        )

    def _loss_and_metrics(self, params: PyTree, batch: PyTree) -> tuple[jax.Array, PyTree]:
        try:  # traced once per compile: no cost per step
            out = self.loss(params, batch)
        except Exception as e:  # code written for Auto meshes, on Explicit axes
            if is_sharding_type_error(e):
                raise explicit_mesh_error(e, "the model's loss") from e
            raise
        return (out[0], out[1]) if self.has_aux else (out, {})

    def train_step(self, batch: PyTree = None) -> jax.Array:
        """Runs one step on the batch of the current step; returns its loss (not synced).

        ``batch`` is that batch when the caller has fetched it already (prefetched).
        """
        if batch is None:
            batch = self.batches("train", self.step)
        leaves = self._leaves
        if leaves is None:  # set, or read from a checkpoint: flattened once
            if self._train_step is None:
                self._compile(batch)
            leaves = self._treedef.flatten_up_to(self._state)
        step = self._executable(leaves, batch)
        new_leaves, loss, metrics = step(leaves, batch)
        self._leaves, self._state = new_leaves, None  # the old arrays were donated to the step
        loss.copy_to_host_async()  # read a step later (run): no wait for the transfer then
        self.step += 1
        if metrics:
            for value in metrics.values():
                value.copy_to_host_async()
            self._step_metrics[self.step] = metrics
        out: jax.Array = loss
        return out

    def _executable(self, leaves: list[jax.Array], batch: PyTree) -> PyTree:
        """The compiled step for batches shaped and placed like ``batch``.

        Compiled ahead of time, once per distinct batch (shapes, dtypes and
        shardings of its arrays): a step never compiles or looks up a cache
        keyed by the state's thousands of leaves, nor enters the mesh context.
        """
        flat, tree = jax.tree.flatten(batch)
        key = (tree, *((x.shape, x.dtype, getattr(x, "sharding", None)) for x in flat))
        found = self._executables.get(key)
        if found is None:
            if self._train_step is None:
                self._compile(batch)
            with self.active():
                found = self._flat_step.lower(leaves, batch).compile()
            self._executables[key] = found
        return found

    def evaluate(self) -> float:
        """Mean loss over ``settings.eval_batches`` fixed validation batches."""
        if self._valid_batches is None:
            self._valid_batches = [
                self.batches("valid", i) for i in range(self.settings.eval_batches)
            ]
        if self._eval_step is None:
            self._compile(self._valid_batches[0])
        assert self._eval_step is not None  # set by _compile
        with self.active():
            losses = [self._eval_step(self.state.params, b) for b in self._valid_batches]
        value = float(np.mean([float(x) for x in losses]))
        self._last_eval = (self.step, value)
        if not math.isfinite(value):
            self._diverged(f"its validation loss is {value}", "valid_loss")
        if self.best_valid is None or value < self.best_valid[1]:
            self.best_valid = (self.step, value)
        return value

    def _diverged(self, what: str, path: str, step: int | None = None) -> NoReturn:
        """Raises :class:`Diverged` for ``step`` (default the current one), once the save in
        progress is done."""
        last_good = best = resume_at = None
        why = ""
        cause = self._nan_cause(self.step if step is None else step, path)
        if self._checkpointer is not None:
            self._checkpointer.wait()  # the step being written counts (or its failure is raised)
            saved = self._checkpointer.all_steps()
            last_good = saved[-1] if saved else None
            best = self._checkpointer.best(self.valid_setting)
            resume_at, why = sane_step(saved, self.losses_seen, best, self._start_step)
        raise Diverged(
            self.step if step is None else step,
            what,
            path,
            last_good,
            best,
            self.ckpt_dir,
            resume_at,
            why,
            *(() if cause is None else cause),
        )

    def _nan_cause(self, step: int, path: str) -> NanCause | None:
        """Why the loss at ``step`` is not finite (its batches looked at again); ``None``
        when it is not a loss (the state)."""
        if path == "valid_loss":
            cause = nan_cause(step, self._start_step, self._valid_batches)
            if cause.kind == "diverged" and step == self._start_step:
                return NanCause("start", "it is not finite before any update")
            return cause if cause.kind == "data" else None
        if path != "loss":
            return None
        try:
            batch = self.batches("train", step - 1)
        except Exception:  # e.g. an iterable that cannot go back: the data is not looked at
            batch = None
        return nan_cause(step, self._start_step, batch)

    def save(self) -> bool:
        """Starts an asynchronous save of the current step; ``False`` if not saving.

        The validation loss of this step (when evaluated) goes with it, so the
        best checkpoint is never deleted.

        Raises:
            Diverged: the state is not finite (nothing is saved).
            CheckpointError: ``'ckpt-write-failed'``: this or the previous save failed.
        """
        if not self._opened:  # a fresh state made by start() alone: the folder opens here
            self.open()
        if self._checkpointer is None:
            return False
        extra = {
            "train": {**self.settings.to_dict(), **self.record},
            "layout": self.layout_name,
            "processes": jax.process_count(),
            "best_valid": list(self.best_valid) if self.best_valid else None,
        }
        metrics = None
        if self._last_eval is not None and self._last_eval[0] == self.step:
            metrics = {"valid_loss": self._last_eval[1]}
        try:
            return self._checkpointer.save(
                self.step,
                self.state,
                rules=self.rules,
                mesh=self.mesh,
                config=self.config,
                extra=extra,
                metrics=metrics,
                best_group=self.valid_setting,
            )
        except CheckpointError as e:
            problem = e.problems[0] if e.problems else None
            if problem is None or problem.code != "ckpt-not-finite":
                raise
            self._diverged(
                f"its state holds NaN or infinite values ({problem.message})", problem.path
            )

    def close(self) -> None:
        """Waits for the last save to reach the disk, then releases the folder.

        Records :attr:`saved_on_disk`, :attr:`latest_saved` and
        :attr:`best_saved` (steps that exist) first. Idempotent.

        Raises:
            CheckpointError: ``'ckpt-write-failed'``: the last save failed (and
                no earlier call said so). The folder's lock is released and no
                thread is left running either way.
        """
        ckpt, self._checkpointer = self._checkpointer, None
        if ckpt is None:
            return
        try:
            try:
                ckpt.wait()  # a failure is raised here (and close() does not raise it again)
            finally:
                with contextlib.suppress(Exception):
                    self.saved_on_disk = ckpt.all_steps()
                    self.latest_saved = self.saved_on_disk[-1] if self.saved_on_disk else None
                    self.best_saved = ckpt.best(self.valid_setting)
        finally:
            ckpt.close()

    # -- the loop --------------------------------------------------------------

    def mfu(self, step_time_s: float | None) -> float | None:
        """Model FLOPs utilisation of a step of ``step_time_s`` seconds, or ``None`` if unknown."""
        if not step_time_s or not self.flops_per_step or not self.peak_flops_per_s:
            return None
        return self.flops_per_step / step_time_s / self.peak_flops_per_s

    def run(
        self,
        on_step: Callable[[StepRecord], None] | None = None,
        on_eval: Callable[[int, float], None] | None = None,
        on_save: Callable[[int], None] | None = None,
    ) -> TrainResult:
        """Trains from :attr:`step` up to ``settings.steps``, evaluating and saving on schedule.

        Step ``k + 1`` is dispatched, and its batch placed, before the loss of
        step ``k`` is read (unless ``sync_every_step``); ``on_step`` runs then,
        while the device works. Before an evaluation or a save every loss is read.

        Args:
            on_step: Called with each step's :class:`StepRecord`, at most a step late.
            on_eval: Called after each evaluation with ``(step, valid_loss)``.
            on_save: Called when a checkpoint save starts, with its step.

        Returns:
            A :class:`TrainResult`.

        Raises:
            Diverged: a step's loss, the validation loss or the state to save is
                not finite (nothing of that step is saved).
        """
        s = self.settings
        if not self._opened:  # the folder's lock first: a second writer is refused before any work
            self.open()
        if self.state is None:
            self.start()
        result = TrainResult(start_step=self.step, end_step=self.step)
        self._start_step = self.step
        if self.resume_from is None and self.step == 0 and s.eval_every:  # 0: only at the end
            result.evals[0] = self.evaluate()
            if on_eval:
                on_eval(0, result.evals[0])
        t0 = time.perf_counter()
        tokens_per_step = s.batch * s.seq_len
        # The end of the step before the one read next; None: that step is not timed
        # (it compiled, or an evaluation or a save came between).
        since: float | None = None
        pending: tuple[int, jax.Array] | None = None

        def read(step: int, loss_array: jax.Array) -> None:
            nonlocal since
            found = self._step_metrics.pop(step, None)
            # Waits for that step (the next one is queued already); copied to the host
            # as soon as it was done (train_step), with its metrics: one read.
            value, read_metrics = jax.device_get((loss_array, found))
            loss = float(value)
            done = time.perf_counter()
            if not math.isfinite(loss):
                self._diverged(f"its training loss is {loss}", "loss", step)
            seconds = None if since is None else done - since
            since = done
            metrics = (
                None if read_metrics is None else {k: float(v) for k, v in read_metrics.items()}
            )
            if metrics is not None:
                result.metrics[step] = metrics
            record = StepRecord(step, loss, metrics=metrics)
            if seconds is not None:
                result.step_times[step] = seconds
                record = StepRecord(
                    step,
                    loss,
                    seconds,
                    tokens_per_step / max(seconds, 1e-12),
                    self.mfu(seconds),
                    metrics,
                )
            result.losses[step] = loss
            self.losses_seen[step] = loss
            if on_step:
                on_step(record)

        batch = self.batches("train", self.step) if self.step < s.steps else None
        while self.step < s.steps:
            loss = self.train_step(batch)
            step = self.step
            last = step == s.steps
            evaluate = bool(s.eval_every and step % s.eval_every == 0) or last
            save = bool(s.ckpt_every and step % s.ckpt_every == 0) or last
            if self.sync_every_step or evaluate or save:
                if pending is not None:
                    read(*pending)
                    pending = None
                read(step, loss)
                if evaluate or save:
                    if evaluate:
                        result.evals[step] = self.evaluate()
                        if on_eval:
                            on_eval(step, result.evals[step])
                    if save and self.save():
                        result.saved_steps.append(step)
                        if on_save:
                            on_save(step)
                    since = None  # the next step's time would count the evaluation or save
                batch = None if last else self.batches("train", step)
            else:
                batch = self.batches("train", step)  # placed while the step runs
                if pending is not None:
                    read(*pending)
                pending = (step, loss)
        if pending is not None:  # (not reached: the last step is read above)
            read(*pending)
        result.seconds = time.perf_counter() - t0
        result.end_step = self.step
        result.best_valid = self.best_valid
        timed = list(result.step_times.values())
        if timed:
            result.tokens_per_second = len(timed) * tokens_per_step / max(sum(timed), 1e-12)
            result.step_time_s = float(np.median(timed))
            result.mfu = self.mfu(result.step_time_s)
        return result
