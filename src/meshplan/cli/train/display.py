"""What ``meshplan train`` shows and writes as it runs: the header, the summary, the metrics file.

:func:`header` (the built-in Transformer) and :func:`own_header` (``--model
pkg.module:factory``) say what is trained on which mesh before the first step;
:func:`summary` is the table after the last; :class:`MetricsLog` appends each
step's record to ``--metrics`` as a JSON line.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, TextIO

from rich.console import Console
from rich.table import Table

from meshplan.cli.output import say, text
from meshplan.cli.train.flags import no_mfu_why

if TYPE_CHECKING:
    from meshplan.cli.devices import DeviceChoice
    from meshplan.cli.factory import Trainable
    from meshplan.models.data import ByteCorpus
    from meshplan.models.transformer import TransformerConfig
    from meshplan.train.flops import MeshPeak
    from meshplan.train.records import TrainResult
    from meshplan.train.state import PlanSummary
    from meshplan.train.trainer import Trainer

__all__ = ["MetricsLog", "flop_text", "header", "own_header", "peak_memory", "summary"]


def header(
    console: Console,
    trainer: Trainer,
    summary: PlanSummary,
    config: TransformerConfig,
    kind: str,
    corpus: ByteCorpus,
    devices: DeviceChoice,
    peak: MeshPeak,
) -> None:
    """The header of a run of the built-in Transformer (``kind``): the model, the mesh, the
    data, the devices and the plan per device (``summary``, the library's)."""
    from meshplan._text import human_bytes
    from meshplan.cli.trained_models import MODELS

    s = trainer.settings
    # The library's summary is data, taken once with the trainer: here it is only worded.
    mesh = "x".join(str(v) for v in trainer.mesh.shape.values())
    remat, mfu = _remat_text(config), _mfu_line(peak)
    resumed = _resume_line(trainer, mesh, trainer.layout_name)
    pipeline = _pipeline_line(config, trainer)
    lines: list[list[Any]] = [
        [
            ("meshplan train", "bold"),
            f": Transformer{'' if kind == 'transformer' else f' ({MODELS.get(kind, kind)})'} of "
            f"{config.num_layers} "
            f"layer{'s' * (config.num_layers != 1)}, embed {config.embed_dim}, "
            f"{config.num_heads} heads, mlp {config.mlp_dim}"
            + (
                f" x {config.num_experts} experts (top {config.top_k}, capacity factor "
                f"{config.capacity_factor:g})"
                if config.num_experts
                else ""
            )
            + f" ({summary['parameters']:,} parameters)",
        ],
        [
            f"on a {mesh} mesh {tuple(trainer.mesh.axis_names)} with layout ",
            (str(summary["layout"]), "bold"),
            f"; batch {s.batch} x {s.seq_len} bytes"
            + (f" in {s.grad_accum} microbatches" if s.grad_accum > 1 else "")
            + remat
            + f", lr {s.lr:g}, seed {s.seed}",
        ],
        [
            f"data: {corpus.source} ({len(corpus.train):,} train / {len(corpus.valid):,} "
            f"valid bytes)"
        ],
        [
            devices.describe() + f"; compute dtype {config.dtype}, parameters and AdamW "
            f"state float32; {flop_text(trainer.flops_per_step or 0)} a step"
        ],
        [mfu],
    ]
    if pipeline:
        lines.insert(2, [pipeline])
    if resumed:
        lines.append([resumed])
    for line in lines:
        say(console, *line, soft_wrap=True)
    table = Table(title=text(f"Plan per device ({summary['source']})"), title_justify="left")
    table.add_column("state")
    table.add_column("largest per device", justify="right")
    table.add_column("all devices, one copy", justify="right")
    table.add_row(
        "parameters",
        human_bytes(summary["params_per_device"]),
        human_bytes(summary["params_total"]),
    )
    table.add_row(
        "parameters + AdamW state",
        human_bytes(summary["state_per_device"]),
        human_bytes(summary["state_total"]),
    )
    console.print(table)


def _mfu_line(peak: MeshPeak) -> str:
    """``MFU against: ...``, or why there is none, in flags."""
    return f"MFU against: {peak.label}" if peak.flops else f"no MFU: {no_mfu_why(peak)}"


def _resume_line(trainer: Trainer, mesh: str, layout: str) -> str:
    """``resuming from step N of DIR (saved on 2x4 with fsdp_tp) onto 4x2 with fsdp``, or ``''``
    for a run that does not resume."""
    meta = trainer.resume_from
    if meta is None:
        return ""
    saved_mesh = "x".join(str(v) for v in meta.mesh_shape.values()) or "?"
    saved_by = int(meta.extra.get("processes") or 1)
    return (
        f"resuming from step {meta.step} of {trainer.ckpt_dir} (saved on {saved_mesh} "
        f"with {meta.extra.get('layout') or 'its rules'}"
        f"{f' by {saved_by} processes' if saved_by > 1 else ''}) onto {mesh} with {layout}"
    )


def _remat_text(config: TransformerConfig | Mapping[str, object] | None) -> str:
    """``', remat full'`` when the model rematerialises its blocks, else ``''``."""
    fields = config if isinstance(config, Mapping) else vars(config) if config else {}
    if not fields.get("remat"):
        return ""
    policy = fields.get("remat_policy") or "full"
    return f", remat {str(policy).replace('_', '-')}"


def own_header(
    console: Console,
    trainer: Trainer,
    summary: PlanSummary,
    own: Trainable,
    spec: str,
    devices: DeviceChoice,
) -> None:
    """The header of a ``--model pkg.module:factory`` run: the model, the mesh, the batches
    and the plan per device (``summary``, the library's)."""
    s = trainer.settings
    mesh = "x".join(str(v) for v in summary["mesh"].values())
    import jax

    shapes = ", ".join(str(tuple(x.shape)) for x in jax.tree.leaves(own.example_batch))
    lines: list[list[Any]] = [
        [
            ("meshplan train", "bold"),
            f": {own.name} ({own.api}) from --model {spec} ({summary['parameters']:,} parameters)",
        ],
        [
            f"on a {mesh} mesh {tuple(trainer.mesh.axis_names)} with layout ",
            (str(summary["layout"]), "bold"),
            f"; batch {shapes}"
            + (f" in {s.grad_accum} microbatches" if s.grad_accum > 1 else "")
            + f", lr {s.lr:g}, seed {s.seed}",
        ],
        [devices.describe() + "; parameters and AdamW state float32; no MFU (no FLOP count)"],
    ]
    if trainer.resume_from is not None:
        lines.append([_resume_line(trainer, mesh, str(summary["layout"]))])
    for line in lines:
        say(console, *line, soft_wrap=True)


def flop_text(flops: float) -> str:
    """``2.9e13`` -> ``'29.0 TFLOP'``.

    Example:
        >>> from meshplan.cli.train.display import flop_text
        >>> flop_text(2.897e13), flop_text(1.9e8), flop_text(12)
        ('29.0 TFLOP', '190.0 MFLOP', '12 FLOP')
    """
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops:,.0f} FLOP"


def peak_memory(devices: DeviceChoice) -> int | None:
    """The most bytes any of ``devices`` held at once (``memory_stats()``), or ``None``."""
    peaks = []
    for device in devices.devices:
        try:
            stats = device.memory_stats()
        except Exception:  # not every backend has them
            stats = None
        if stats and stats.get("peak_bytes_in_use") is not None:
            peaks.append(int(stats["peak_bytes_in_use"]))
    return max(peaks) if peaks else None


def summary(
    console: Console,
    trainer: Trainer,
    result: TrainResult,
    devices: DeviceChoice,
    peak: MeshPeak,
    wall_s: float,
    units: tuple[str, str] = ("tokens/s", " nats/byte"),
) -> None:
    from meshplan._text import human_bytes

    rate, per = units

    table = Table(title="Summary", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value")
    table.add_row("steps", f"{result.start_step} -> {result.end_step}")
    table.add_row(
        "time", f"{wall_s:.1f} s (wall clock, as the bar: compile, evaluations and saves in)"
    )
    table.add_row("devices", devices.describe().removeprefix("devices: "))
    timed = len(result.step_times)
    table.add_row(
        "step time",
        f"{result.step_time_s * 1e3:,.1f} ms (median of {timed} timed step{'s' * (timed != 1)}; "
        f"compile, evaluations and saves left out)"
        if timed
        else "- (no step timed: the first compiles)",
    )
    table.add_row(rate, f"{result.tokens_per_second:,.0f} (over the timed steps, as the bar)")
    if result.mfu is not None:
        table.add_row("MFU", text(f"{result.mfu:.1%} (against the {peak.label})"))
    else:
        table.add_row("MFU", text(f"- ({no_mfu_why(peak)})" if peak.why else "- (no step timed)"))
    memory = peak_memory(devices)
    table.add_row(
        "peak memory",
        human_bytes(memory) + " (the fullest device, memory_stats())"
        if memory is not None
        else "- (these devices report no memory_stats())",
    )
    routed = sum(m.get("routed", 0.0) for m in result.metrics.values())
    if routed:
        dropped = sum(m.get("dropped", 0.0) for m in result.metrics.values())
        final = result.metrics[max(result.metrics)]
        table.add_row(
            "experts",
            f"{dropped / routed:.2%} of the expert choices dropped (over capacity) in "
            f"{len(result.metrics)} steps; load-balancing loss {final.get('aux_loss', 0.0):.3f} "
            f"(1 when balanced) at step {max(result.metrics)}",
        )
    remat = _remat_text(trainer.config)
    if remat:
        table.add_row("remat", remat.removeprefix(", remat ") + " (block activations recomputed)")
    if result.losses:
        last = max(result.losses)
        table.add_row("final train loss", f"{result.losses[last]:.3f}{per} (step {last})")
    if result.best_valid is not None:
        step, loss = result.best_valid
        unsaved = trainer.ckpt_dir is not None and step not in trainer.saved_on_disk
        table.add_row(
            "best valid loss",
            f"{loss:.3f}{per} (step {step}{', no checkpoint of it' if unsaved else ''})",
        )
    if trainer.ckpt_dir is not None:
        where = f"{trainer.ckpt_dir} (latest step {trainer.latest_saved}"
        best = trainer.best_saved
        if best is not None and best[0] != trainer.latest_saved:
            where += f"; best kept: step {best[0]}, valid loss {best[1]:.3f}"
        table.add_row("checkpoint", text(where + ")"))
    console.print(table)


class MetricsLog(contextlib.AbstractContextManager["MetricsLog", None]):
    """Appends each record to ``path`` as one JSON line; does nothing without a path.

    A write that fails (a full disk) ends the run with a meshplan error naming the
    file, the step and the cause (the checkpoints saved so far are kept).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._file: TextIO | None = None

    def __enter__(self) -> MetricsLog:
        path = self.path
        if path is not None:
            try:
                # Not blocking: a FIFO nobody reads (refused up front) cannot hang the run.
                flags = os.O_APPEND | os.O_CREAT | os.O_NONBLOCK
                try:  # read too: a half-written last line is found and cut
                    fd = os.open(path, os.O_RDWR | flags, 0o644)
                except PermissionError:
                    fd = os.open(path, os.O_WRONLY | flags, 0o644)
                os.set_blocking(fd, True)
                self._cut_partial_line(fd)
                self._file = open(fd, "a", buffering=1)
            except OSError as e:
                raise self._failed(e, "opening it") from e
        return self

    def _cut_partial_line(self, fd: int) -> None:
        """A last line left half-written (a run that stopped while writing it) is cut, and said."""
        from meshplan.cli.jsonl import cut_partial_line

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        try:
            cut = cut_partial_line(fd)
        except OSError:  # opened write-only: appended to as it is
            return
        if cut:
            say(
                Console(stderr=True),
                ("note: ", "bold"),
                f"--metrics {self.path!r} ended in a half-written line (the run that wrote it "
                f"stopped mid-line): cut it off, so every line stays JSON: "
                f"{cut.decode('utf-8', 'replace')[:80]!r}",
                soft_wrap=True,
            )

    def _failed(self, e: OSError, when: str) -> Exception:
        from meshplan._errors import MeshplanError, error_for

        cause = (
            f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
            if e.errno
            else str(e)
        )
        return error_for(
            MeshplanError,
            "metrics-write-failed",
            "--metrics",
            f"--metrics {self.path!r}: {when} failed: {cause}",
            "Free space on its disk or pass --metrics a file elsewhere, then continue with "
            "--resume (the checkpoints saved so far are kept).",
        )

    def __call__(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            try:
                self._file.write(json.dumps(record) + "\n")
            except OSError as e:
                file, self._file = self._file, None
                with contextlib.suppress(OSError):
                    file.close()
                raise self._failed(e, f"writing the record of step {record.get('step')}") from e

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError as e:
                self._file = None
                raise self._failed(e, "closing it") from e


def _pipeline_line(config: TransformerConfig, trainer: Trainer) -> str:
    """``pipeline: 4 stages x 1 layer group, 8 microbatches: bubble 27% of a step``, or ``''``."""
    from meshplan import PipelineSchedule
    from meshplan._spmd.pipeline import stage_axes

    axes, stages = stage_axes(trainer.rules, dict(trainer.mesh.shape))
    if stages <= 1:
        return ""
    plan = PipelineSchedule(stages, config.microbatches, config.pipeline_repeats)
    groups = f"{plan.repeats} layer group{'s' * (plan.repeats != 1)}"
    return (
        f"pipeline: {stages} stages ({', '.join(axes)}) x {groups} of "
        f"{plan.layers_per_stage(config.num_layers)} layers, {plan.microbatches} microbatches: "
        f"bubble {plan.bubble:.0%} of a step"
    )
