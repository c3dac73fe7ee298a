"""The checks of ``meshplan train`` that need no model: the flags read (:func:`read_flags`:
the mesh text against the devices, the checkpoint folder, the rules, the metrics file),
the corpus; and the library's check of the batch against the mesh and rules
(:func:`~meshplan.models.batch_fit.batch_fit`) in flags (:func:`fit_problems`).

They run before the library builds anything: on the flags and the settings decided. The
batch's records are worded after the build, with what it found: the settings go down
once, and the command line words what came back.

Each check takes the values it checks (and the flag text to name them by) and adds
its problems, in flag terms, to a :class:`Findings`;
:func:`meshplan.cli.train.prepare.prepare_run` calls them in order and raises every
problem at once.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan._errors import MeshError, MeshplanError, error_for
from meshplan._spmd.by_path import PathRules
from meshplan._spmd.pipeline import stage_axes
from meshplan._spmd.rules import LogicalRules, Rules, logical_to_mesh_axes
from meshplan.cli.devices import choose_devices, count_from_xla_flags, mesh_flag_advice
from meshplan.cli.factory import is_factory
from meshplan.cli.mesh_text import parse_mesh_shape
from meshplan.cli.names_file import INFER
from meshplan.cli.train.findings import Findings
from meshplan.cli.train.resume import Resume, check_checkpoint_dir
from meshplan.layouts import CONTEXT_EXPERT_LAYOUTS, LAYOUT_AXES, get_layout, get_names
from meshplan.models.data import ByteCorpus, DataError
from meshplan.train.device_mesh import MESH_AXES
from meshplan.train.settings import TrainSettings

if TYPE_CHECKING:
    from meshplan.cli.train.request import TrainRequest
    from meshplan.models.batch_fit import BatchFit
    from meshplan.models.transformer import TransformerConfig
    from meshplan.train.build import BuiltParts

__all__ = [
    "FlagsRead",
    "batch_shards",
    "check_metrics_file",
    "fit_problems",
    "load_corpus",
    "parse_train_mesh",
    "placement_problems",
    "read_flags",
]


def load_corpus(data: str | None, settings: TrainSettings, found: Findings) -> ByteCorpus | None:
    """The byte corpus of ``--data`` (``None``: the Python standard library), and, when the
    settings are sane, both its splits checked to hold a window of ``seq_len + 1`` bytes."""
    try:
        corpus = ByteCorpus.from_stdlib() if data is None else ByteCorpus.from_path(data)
    except MeshplanError as e:
        found.add_error(e)
        return None
    except (ValueError, OSError) as e:  # the file system's words: the message is all there is
        message = f"cannot read --data {data!r}: {type(e).__name__}: {e}"
        found.add(DataError, message, "", "data-unreadable", "--data")
        return None
    for split in ("train", "valid") if not settings.problems() else ():
        try:
            corpus.check_window(split, settings.seq_len)
        except DataError as e:
            found.add_error(e)
    return corpus


def fit_problems(
    layout: str,
    mesh_text: str,
    settings: TrainSettings,
    config: TransformerConfig | None,
    fit: BatchFit,
    given: bool,
    found: Findings,
) -> None:
    """What the library's check of the batch found (:func:`~meshplan.models.batch_fit.batch_fit`:
    the batch of tokens, ``[batch, seq_len + 1]``, against the mesh axes the rules give, its
    microbatches, and ``config`` as the pipeline the rules make), in flags: ``layout``
    (``--rules``) on ``mesh_text`` (``--mesh``). ``given``: ``--microbatches`` or
    ``--pipeline-repeats`` was passed, which a layout with no pipeline refuses rather than
    ignores."""
    _batch_problems(layout, mesh_text, settings, fit, found)
    if config is not None:
        _pipeline_problems(layout, mesh_text, settings, config, fit, given, found)


def _batch_problems(
    layout: str, mesh_text: str, settings: TrainSettings, fit: BatchFit, found: Findings
) -> None:
    """The batch's findings: the context striping, each dimension, the microbatches."""
    context, names = fit.context, fit.mesh_axes
    if fit.unstriped:
        found.add(
            MeshplanError,
            f"--seq {settings.seq_len} cannot be striped over the {context} context shards that "
            f"--rules {layout} split 'length' into (load balancing cuts a sequence into "
            f"{2 * context} equal chunks)",
            f"Use a --seq that is a multiple of {2 * context}.",
            "seq-not-striped",
        )
    for d in fit.dims:
        where = (
            f"the {d.shards} devices that --rules {layout} shard {d.name!r} over (mesh "
            f"axes {d.mesh_axes} of the {mesh_text} mesh)"
        )
        if d.missing_axes:
            found.add(
                MeshError,
                f"--rules {layout} shard {d.name!r} over mesh axis "
                f"{', '.join(map(repr, d.missing_axes))}, which the {mesh_text} mesh "
                f"{names} does not have",
                f"Map {d.name!r} to the mesh's axes {names}, e.g. ({d.name!r}, {names[0]!r}).",
                "unknown-axis",
            )
        elif d.index == 0:
            found.add(
                MeshplanError,
                f"--batch {settings.batch} does not split over {where}",
                f"Use a --batch that is a multiple of {d.shards} (e.g. {d.padded_size}), or "
                f"a mesh and rules that split 'batch' over fewer devices.",
                "indivisible",
            )
        else:
            found.add(
                MeshplanError,
                f"--seq {settings.seq_len} gives token windows of {d.size} (the model reads "
                f"{settings.seq_len} bytes and predicts the next), which do not split over "
                f"{where}",
                "Leave 'length' unsharded: ('length', None) in the rules.",
                "indivisible",
            )
    accum, shards = settings.grad_accum, fit.shards
    if fit.accum_uneven:
        found.add(
            MeshplanError,
            f"--grad-accum {accum} cuts --batch {settings.batch} into microbatches of "
            f"{settings.batch // accum}, which do not split over the {shards} devices that "
            f"--rules {layout} shard 'batch' over",
            f"Use a --batch that is a multiple of {accum * shards} (--grad-accum x {shards}), "
            f"or fewer microbatches.",
            "indivisible",
        )


def _pipeline_problems(
    layout: str,
    mesh_text: str,
    settings: TrainSettings,
    config: TransformerConfig,
    fit: BatchFit,
    given: bool,
    found: Findings,
) -> None:
    """The pipeline's findings, or a pipeline asked for that the layout does not make."""
    axes, stages = fit.stage_axes
    where = f"the {stages} stages of --rules {layout} ('stage' on {', '.join(axes)} of --mesh {mesh_text})"
    if stages <= 1:
        if given:
            found.add(
                MeshplanError,
                f"--microbatches/--pipeline-repeats set a pipeline, but --rules {layout} on "
                f"--mesh {mesh_text} gives 'stage' no mesh axis of more than one device",
                "Use --rules pipeline (or pp_fsdp, pp_tp) with --mesh PxD, or leave out "
                "--microbatches and --pipeline-repeats (--grad-accum cuts a batch without a "
                "pipeline).",
                "pipeline-unused",
            )
        return
    micro = settings.batch // settings.grad_accum
    m, v, layers = config.microbatches, config.pipeline_repeats, config.num_layers
    flags = {
        "pipeline-layers": (
            f"--layers {layers} do not split into {where} x --pipeline-repeats {v}",
            f"Use --layers that is a multiple of {stages * v} (stages x repeats), or fewer "
            f"--pipeline-repeats.",
        ),
        "pipeline-microbatches": (
            f"--microbatches {m} are fewer than {where}",
            f"Use --microbatches {stages} or more (e.g. {2 * stages}: bubble "
            f"{(stages - 1) / (2 * stages * v + stages - 1):.0%}).",
        ),
        "pipeline-batch": (
            f"--batch {settings.batch} (/ --grad-accum {settings.grad_accum}: {micro} rows a "
            f"step) does not split into --microbatches {m}",
            f"Use a --batch that is a multiple of {m * settings.grad_accum} (--microbatches x "
            f"--grad-accum), or --microbatches that divide {micro}.",
        ),
    }
    for p in fit.pipeline:
        message, fix = flags.get(p.code, (p.message, p.fix))
        found.add(MeshplanError, message, fix, p.code)
    if fit.pipeline_uneven:
        shards = fit.shards
        found.add(
            MeshplanError,
            f"--microbatches {m} cut {micro} rows into microbatches of {micro // m}, which do not "
            f"split over the {shards} devices that --rules {layout} shard 'batch' over",
            f"Use a --batch that is a multiple of {m * shards * settings.grad_accum} "
            f"(--microbatches x {shards} x --grad-accum), or fewer --microbatches.",
            "pipeline-batch",
        )


def parse_train_mesh(text: str, axes: str | None = None) -> dict[str, int]:
    """``--mesh`` (and ``--axes``) as ``{axis: size}``: ``('data', 'model')`` without ``--axes``.

    :func:`meshplan.cli.mesh_text.parse_mesh_shape` reads it; its errors are worded here
    in flags, by their codes.
    """
    try:
        return parse_mesh_shape(text, axes)
    except MeshError as e:
        code = e.problems[0].code if e.problems else ""
        n = len(str(text).lower().replace("×", "x").split("x"))
        if code == "mesh-axes-unnamed":
            names = ",".join(("data", "fsdp", "tensor", "model", "expert")[:n])
            raise error_for(
                MeshError,
                "mesh-axes",
                "--mesh",
                f"--mesh {text} has {n} axes, but the default axis names {MESH_AXES} are two",
                f"Pass --mesh DxM (e.g. 2x4), or name every axis: --mesh {text} --axes {names} "
                f"(the axes your --rules map to).",
            ) from e
        if code == "mesh-axis-names":
            given = [a.strip() for a in (axes or "").split(",") if a.strip()]
            raise error_for(
                MeshError,
                "mesh-axes",
                "--axes",
                f"--axes {axes} gives {len(set(given))} distinct names for the {n} axes of --mesh "
                f"{text}",
                "Give one distinct name per mesh axis, in order, e.g. --mesh 2x2x2 --axes "
                "data,fsdp,tensor.",
            ) from e
        raise error_for(
            MeshError,
            "mesh-text",
            "--mesh",
            f"Cannot read --mesh {text!r}: expected positive sizes separated by 'x'",
            "Write it like 2x4, 4x2 or 8 (8x1), or 2x2x2 with --axes data,fsdp,tensor.",
        ) from e


def check_metrics_file(path: str | None, found: Findings) -> None:
    """``--metrics`` names a file that can be appended to (its folder exists), checked without
    creating it."""
    if path is None:
        return
    p = Path(path)
    fix = "Pass --metrics a file path whose folder exists, e.g. --metrics run/metrics.jsonl."
    if p.is_dir():
        found.add(
            MeshplanError,
            f"--metrics {path!r} is a folder, not a file",
            fix,
            "metrics-folder",
            "--metrics",
        )
    elif p.exists() and not p.is_file() and not p.is_char_device():
        kind = "a FIFO (named pipe)" if p.is_fifo() else "a socket or special file"
        found.add(
            MeshplanError,
            f"--metrics {path!r} is {kind}, not a regular file: writing to it blocks until "
            f"something reads it, so the run would stop without a word",
            fix,
            "metrics-not-a-file",
            "--metrics",
        )
    elif p.exists():
        if not os.access(p, os.W_OK):
            found.add(
                MeshplanError,
                f"--metrics {path!r} cannot be written by this user",
                fix,
                "metrics-not-writable",
                "--metrics",
            )
    elif not p.absolute().parent.is_dir():
        found.add(
            MeshplanError,
            f"--metrics {path!r}: its folder {str(p.absolute().parent)!r} does not exist",
            fix,
            "metrics-no-folder",
            "--metrics",
        )
    elif not os.access(p.absolute().parent, os.W_OK):
        found.add(
            MeshplanError,
            f"--metrics {path!r}: its folder {str(p.absolute().parent)!r} cannot be written",
            fix,
            "metrics-not-writable",
            "--metrics",
        )


NO_STAGES: tuple[tuple[str, ...], int] = ((), 1)
"""No pipeline: ``'stage'`` on no mesh axis, one stage."""


@dataclasses.dataclass
class FlagsRead:
    """What the flags and the checkpoint say, read before the library builds anything.

    Attributes:
        shape: ``--mesh`` (and ``--axes``) as ``{axis: size}``, ``None`` when unreadable
            or larger than the devices.
        needed: The devices the mesh asks for, once read.
        ckpt_dir: The checkpoint folder (``None``: none).
        resume: The step to resume from, read from the checkpoint folder.
        rules: The rules of ``--rules`` (a built-in layout or a rules file), validated,
            with their positions; ``None`` when they cannot be had.
        mesh: The problems of ``--mesh``, ``--axes`` and ``--devices``.
        ckpt: The problems of ``--ckpt-dir`` and ``--resume``.
        metrics: The problems of ``--metrics``.
        layout: The problems of ``--rules``.
        batch_shards: The devices the rules split ``'batch'`` over on the mesh (1 without
            a mesh or rules).
        stage_axes: The mesh axes the rules give ``'stage'`` (a pipeline), and the stages
            they make (``((), 1)``: no pipeline, or no mesh or rules).
        names: The path rules of ``--names FILE`` for a ``--model pkg.module:factory``
            (:func:`meshplan.layouts.get_names`), or why the file cannot be read; ``None``
            without one (or with ``--names infer``: read from the factory's step later).
    """

    shape: dict[str, int] | None
    needed: int | None
    ckpt_dir: Path | None
    resume: Resume
    rules: Rules | None
    mesh: Findings
    ckpt: Findings
    metrics: Findings
    layout: Findings
    batch_shards: int = 1
    stage_axes: tuple[tuple[str, ...], int] = NO_STAGES
    names: PathRules | MeshplanError | None = None


def read_flags(request: TrainRequest) -> FlagsRead:
    """The flags that need nothing built: ``--metrics``; ``--mesh`` and ``--axes``
    against the devices; ``--ckpt-dir`` and the checkpoint's step to resume from; then
    ``--rules``, the layout's rules (a rules file is read here), and a factory's
    ``--names FILE``."""
    metrics, mesh, ckpt, layout = Findings(), Findings(), Findings(), Findings()
    # A factory's --names FILE is read with --rules (--names infer: from its step, later).
    names_file = request.names not in (None, INFER) and (
        request.model is not None and is_factory(request.model)
    )
    check_metrics_file(request.metrics, metrics)
    shape = needed = None
    try:
        axes = request.axes
        if axes is None and request.rules in CONTEXT_EXPERT_LAYOUTS:
            axes = ",".join(LAYOUT_AXES[request.rules])  # ('data', 'context'), ('data', 'expert')
        shape = parse_train_mesh(request.mesh, axes)
        needed = math.prod(shape.values())
        choice = request.devices
        if choice is not None:  # refused with the numbers and the fix in flag terms
            choose_devices(
                [] if choice.emulated else choice.devices,
                choice.devices if choice.emulated else [],
                needed=needed,
                mesh=request.mesh,
                xla_flags_count=count_from_xla_flags(),
            )
    except MeshplanError as e:
        shape = None
        mesh.add_error(mesh_flag_advice(e, needed))
    ckpt_dir, resume = check_checkpoint_dir(request, ckpt)
    rules = None
    try:
        rules = Rules.of(get_layout(request.rules))  # get_layout validates; Rules.of indexes
    except MeshplanError as e:
        layout.add_error(e, f"--rules {request.rules}")
    names: PathRules | MeshplanError | None = None
    if names_file and request.names is not None:
        try:
            names = get_names(request.names)
        except MeshplanError as e:  # said with the factory's problems
            names = e
    shards, stages = 1, NO_STAGES
    if shape is not None and rules is not None:  # what the rules make of the mesh's sizes
        shards, stages = batch_shards(shape, rules.pairs), stage_axes(rules.pairs, shape)
    return FlagsRead(
        shape, needed, ckpt_dir, resume, rules, mesh, ckpt, metrics, layout, shards, stages, names
    )


def placement_problems(
    layout: str, flags: FlagsRead, parts: BuiltParts, problems: Findings
) -> None:
    """Why the mesh (of ``flags.shape``) or the rules (``layout``) could not be had, in
    flags: the mesh's problem added to ``flags.mesh``, the rules' to ``problems``."""
    if parts.mesh_error is not None:
        flags.mesh.add_error(mesh_flag_advice(parts.mesh_error, flags.needed))
    if parts.rules_error is not None:
        problems.add_error(parts.rules_error, f"--rules {layout}")


def batch_shards(shape: Mapping[str, int], rules: LogicalRules) -> int:
    """How many devices the rules split ``'batch'`` over, on a mesh of ``shape``.

    Example:
        >>> from meshplan.cli.train.preflight import batch_shards
        >>> batch_shards({"data": 2, "model": 4}, (("batch", ("data", "model")),))
        8
    """
    axes = logical_to_mesh_axes(("batch",), rules)[0]
    named = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return max(math.prod(int(shape.get(a, 1)) for a in named), 1)
