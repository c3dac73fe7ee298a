"""Whether a step's batch of tokens fits a mesh and a layout: one check, its findings as records.

The byte-level Transformer reads a batch of token windows ``[batch, seq_len + 1]``
(:data:`~meshplan.models.data.BATCH_NAMES`) and carries activations ``('batch', 'length')``;
``grad_accum`` cuts a step's batch into microbatches, and a layout that gives ``'stage'`` a
mesh axis runs the blocks as a pipeline (:mod:`meshplan.models.pipeline`). :func:`batch_fit`
checks all of it against the mesh's axis sizes and the rules, before anything is built,
and says what it found in a :class:`BatchFit`: typed fields a caller words in its own terms
(``meshplan train`` in flags, after the library's build), and :attr:`BatchFit.problems`,
the same findings as :class:`~meshplan._errors.Problem` records with their codes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from meshplan._errors import Problem
from meshplan._spmd.mesh_info import mesh_info
from meshplan._spmd.rules import Rules
from meshplan._spmd.validate import DimCheck, check_leaf
from meshplan.models.data import BATCH_NAMES
from meshplan.models.pipeline import TransformerConfig, pipeline_problems
from meshplan.train.settings import TrainSettings

__all__ = ["BatchFit", "batch_fit"]


@dataclasses.dataclass(frozen=True)
class BatchFit:
    """What :func:`batch_fit` found; :attr:`fits` when nothing.

    Attributes:
        mesh_axes: The mesh's axis names, in order.
        shards: The devices the rules split ``'batch'`` over (1: not split, or on a mesh
            axis the mesh lacks).
        context: The pieces the rules split the activations' ``'length'`` into (context
            parallelism; 1: not split).
        unstriped: ``'length'`` is split into ``context`` pieces, but a sequence of
            ``seq_len`` does not cut into ``2 x context`` equal chunks (load balancing).
        dims: The dimensions that do not fit, in order: a token batch's dimension or the
            activations' ``'length'``, each on a mesh axis the mesh lacks
            (:attr:`~meshplan._spmd.validate.DimCheck.missing_axes`) or of a size the
            devices it is split over do not divide.
        accum_uneven: ``grad_accum`` cuts the batch into microbatches that do not split
            over the ``shards`` devices.
        stage_axes: The mesh axes of ``'stage'`` and the stages they make (``((), 1)``: no
            pipeline).
        pipeline: What stops the model from running as that pipeline
            (:func:`~meshplan.models.pipeline.pipeline_problems`); empty without one.
        pipeline_uneven: The pipeline's microbatches do not split over the ``shards``
            devices (checked when the pipeline has no other problem).
    """

    mesh_axes: tuple[str, ...]
    shards: int
    context: int
    unstriped: bool
    dims: tuple[DimCheck, ...]
    accum_uneven: bool
    stage_axes: tuple[tuple[str, ...], int]
    pipeline: tuple[Problem, ...]
    pipeline_uneven: bool

    @property
    def fits(self) -> bool:
        """Nothing is wrong: the batch, its microbatches and the pipeline fit."""
        return not self.problems

    @property
    def problems(self) -> list[Problem]:
        """Every finding as a :class:`~meshplan._errors.Problem` (its code and path), in order."""
        found = []
        if self.unstriped:
            found.append(
                _problem(
                    "seq-not-striped",
                    "length",
                    f"a sequence does not cut into the {2 * self.context} equal chunks of "
                    f"{self.context} context shards",
                    f"Use a sequence length that is a multiple of {2 * self.context}.",
                )
            )
        for d in self.dims:
            if d.missing_axes:
                axes = ", ".join(map(repr, d.missing_axes))
                found.append(
                    _problem(
                        "unknown-axis",
                        str(d.name),
                        f"{d.name!r} is on mesh axis {axes}, which the mesh "
                        f"{self.mesh_axes} does not have",
                        f"Map {d.name!r} to one of the mesh's axes {self.mesh_axes} in the "
                        "rules, or to None.",
                    )
                )
            else:
                found.append(
                    _problem(
                        "indivisible",
                        str(d.name),
                        f"{d.name!r} of size {d.size} does not split over {d.shards} devices",
                        f"Use a size that is a multiple of {d.shards} (e.g. {d.padded_size}).",
                    )
                )
        if self.accum_uneven:
            found.append(
                _problem(
                    "indivisible",
                    "grad_accum",
                    f"the microbatches do not split over the {self.shards} devices of 'batch'",
                    f"Use a batch that is a multiple of grad_accum x {self.shards}.",
                )
            )
        found += self.pipeline
        if self.pipeline_uneven:
            found.append(
                _problem(
                    "pipeline-batch",
                    "microbatches",
                    f"the pipeline's microbatches do not split over the {self.shards} devices "
                    "of 'batch'",
                    f"Use a batch that is a multiple of microbatches x {self.shards} x grad_accum.",
                )
            )
        return found


def _problem(code: str, path: str, message: str, fix: str) -> Problem:
    return Problem("error", path, message, fix, code)


def batch_fit(
    config: TransformerConfig | None,
    settings: TrainSettings,
    shape: Mapping[str, int],
    rules: Rules,
    stage_axes: tuple[tuple[str, ...], int] = ((), 1),
) -> BatchFit:
    """Checks a step's token batch of ``settings`` (``batch``, ``seq_len``, ``grad_accum``) on a
    mesh of ``shape`` under ``rules``, and ``config`` (``None``: not known) as a pipeline on the
    ``stage_axes`` the rules give ``'stage'`` (:func:`meshplan._spmd.pipeline.stage_axes`).

    Example:
        >>> from meshplan._spmd.rules import Rules
        >>> from meshplan.models.batch_fit import batch_fit
        >>> from meshplan.train.settings import TrainSettings
        >>> fit = batch_fit(None, TrainSettings(batch=6), {"data": 4}, Rules.of([("batch", "data")]))
        >>> fit.fits, fit.shards, [(p.code, p.path) for p in fit.problems]
        (False, 4, [('indivisible', 'batch')])
    """
    axes, stages = stage_axes
    micro = settings.batch // settings.grad_accum
    pipeline = (
        tuple(pipeline_problems(config, stages, micro)) if config is not None and stages > 1 else ()
    )
    mesh = mesh_info(shape)
    tokens = check_leaf(
        "logical",
        BATCH_NAMES,
        (settings.batch, settings.seq_len + 1),
        rules.pairs,
        rules.positions,
        mesh,
    )
    activations = check_leaf(
        "logical",
        ("batch", "length"),
        (settings.batch, settings.seq_len),
        rules.pairs,
        rules.positions,
        mesh,
    )
    context = int(activations.dims[1].shards)
    checked = [*tokens.dims, *(d for d in activations.dims[1:] if d.missing_axes)]
    first = tokens.dims[0]
    shards = 1 if first.missing_axes else max(int(first.shards), 1)
    accum = settings.grad_accum
    split = accum > 1 and not settings.batch % accum
    uneven = (
        config is not None
        and stages > 1
        and not pipeline
        and (micro // config.microbatches) % shards
    )
    return BatchFit(
        mesh_axes=tuple(shape),
        shards=shards,
        context=context,
        unstriped=context > 1 and bool(settings.seq_len % (2 * context)),
        dims=tuple(d for d in checked if d.missing_axes or not d.divides),
        accum_uneven=split and bool((settings.batch // accum) % shards),
        stage_axes=(axes, stages),
        pipeline=pipeline,
        pipeline_uneven=bool(uneven),
    )
