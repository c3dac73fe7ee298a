"""``meshplan train``: train the example byte-level Transformer on a mesh, with resumable checkpoints.

``--model transformer`` (the default) is the Flax Linen model, ``--model
transformer-nnx`` the same model in Flax NNX; their checkpoints are interchangeable.

The recipe (model, loss, data) is wired into the model-agnostic
:class:`meshplan.train.trainer.Trainer` by :mod:`meshplan.cli.train_request`.

It runs on the machine's accelerators when JAX finds any, else on ``--devices``
emulated CPU devices (``--platform cpu`` asks for those); the header says which.

Checks every input before any work (one bullet per problem, then the fix),
shows the plan's per-device memory, then a progress bar with the loss and
tokens per second, validation losses as they come, and a final summary with
the step time, tokens/s, MFU and the devices' peak memory.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import json
import os
import signal
import threading
import time
import warnings
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from meshplan.cli.devices import PLATFORMS, select_platform
from meshplan.cli.output import print_error, say, text

if TYPE_CHECKING:
    from meshplan.cli.devices import DeviceChoice
    from meshplan.cli.train_request import PreparedRun, TrainRequest
    from meshplan.train.flops import MeshPeak
    from meshplan.train.records import TrainResult
    from meshplan.train.trainer import Trainer

from meshplan.cli.train_flags import (
    CODE_ADVICE,
    MODEL_FLAGS,
    SETTINGS,
    SETTINGS_FLAGS,
    in_flags,
    no_mfu_why,
)

HELP = (
    "Train the byte-level Transformer on a device mesh, with checkpoints that resume on any mesh."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("run")
    run.add_argument(
        "--mesh",
        default="2x4",
        metavar="DxM",
        help="mesh sizes (default 2x4), e.g. 8 (= 8x1), or 2x2x2 with --axes",
    )
    run.add_argument(
        "--axes",
        default=None,
        metavar="A,B,..",
        help="comma-separated mesh axis names, one per --mesh size, e.g. data,fsdp,tensor as "
        "meshplan search prints them (default data,model)",
    )
    run.add_argument(
        "--rules",
        default="fsdp_tp",
        metavar="LAYOUT",
        help="data_parallel, fsdp, tensor_parallel, fsdp_tp, or a .py/.json rules file "
        "(default fsdp_tp)",
    )
    run.add_argument(
        "--devices",
        type=int,
        default=8,
        metavar="N",
        help="emulated CPU devices, when the run is on the CPU: of this process, or with "
        "--processes of all (default 8)",
    )
    run.add_argument(
        "--platform",
        choices=PLATFORMS,
        default="auto",
        help="auto: the machine's accelerators when JAX finds any, else emulated CPU devices; "
        "cpu: emulated CPU devices; gpu, tpu: those, or an error (default auto)",
    )
    run.add_argument(
        "--sync-every-step",
        action="store_true",
        help="debug: wait for every step's loss before the next (the host no longer runs ahead "
        "of the device)",
    )
    run.add_argument("--data", metavar="PATH", help="text folder or file (default: the stdlib)")
    run.add_argument("--ckpt-dir", metavar="DIR", help="checkpoint folder (default: none)")
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest intact checkpoint in --ckpt-dir (damaged newer steps are "
        "named and skipped), on this mesh and layout",
    )
    run.add_argument(
        "--resume-step",
        type=int,
        metavar="N",
        help="continue from step N of --ckpt-dir (implies --resume); later steps are moved "
        "into DIR/old-branch-after-step-N (kept, never resumed)",
    )
    run.add_argument(
        "--metrics",
        metavar="FILE",
        help="append each step's loss, step_time_s, tokens_per_s and mfu, and each validation "
        "loss, to FILE as JSON lines (process 0)",
    )
    procs = parser.add_argument_group(
        "several processes (a mesh over every device of every process)"
    )
    procs.add_argument(
        "--processes",
        type=int,
        metavar="N",
        help="run N worker processes on this machine, over loopback, sharing --devices",
    )
    procs.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address (on each host)"
    )
    procs.add_argument("--num-processes", type=int, metavar="N", help="processes in the run")
    procs.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
    procs.add_argument(
        "--init-timeout",
        type=float,
        metavar="SECONDS",
        help="how long processes wait for each other to join, then all stop (default 300, as JAX)",
    )
    train = parser.add_argument_group(
        "training (when resuming, omitted values come from the checkpoint)"
    )
    for setting in SETTINGS:
        train.add_argument(
            setting.flag, type=setting.kind, metavar=setting.metavar, help=setting.help
        )
    model = parser.add_argument_group(
        "model (default: the checkpoint's model and config when resuming, else transformer, tiny)"
    )
    model.add_argument(
        "--model",
        help="the byte-level Transformer in Flax Linen (transformer) or Flax NNX "
        "(transformer-nnx): the same parameters and names; or a model of your own, "
        "pkg.module:factory (docs/training.md#your-own-model)",
    )
    model.add_argument(
        "--size",
        dest="config",
        choices=("tiny", "small", "base"),
        help="preset model size, as in plan and search (base: 126M parameters for one GPU, "
        "with batch 32 x 1024)",
    )
    # The flag's earlier name, still read so that older commands run; not shown.
    model.add_argument(
        "--config", dest="config", choices=("tiny", "small", "base"), help=argparse.SUPPRESS
    )
    for flag, about in (
        ("--layers", "Transformer blocks"),
        ("--heads", "attention heads"),
        ("--embed", "model width"),
        ("--mlp", "MLP hidden width"),
        ("--max-len", "longest sequence"),
    ):
        model.add_argument(flag, type=int, metavar="N", help=about)
    model.add_argument("--positions", choices=("rope", "learned"), help="position encoding")
    model.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        help="compute dtype; parameters, optimizer state, logits and loss stay float32",
    )
    model.add_argument(
        "--no-scan",
        dest="scan_layers",
        action="store_false",
        default=None,
        help="stack blocks with a for-loop instead of nn.scan",
    )
    model.add_argument(
        "--remat",
        nargs="?",
        const="full",
        default=None,
        choices=("none", "full", "dots-saveable"),
        help="rematerialise block activations: full (the default of a bare --remat) keeps each "
        "block's input only, dots-saveable its matrix products too, none keeps everything",
    )
    model.add_argument(
        "--experts",
        type=int,
        metavar="E",
        help="a mixture-of-experts feed-forward block of E experts in every layer (default 0: "
        "the dense MLP); with --rules expert_parallel or fsdp_ep on a data x expert mesh",
    )
    model.add_argument(
        "--top-k", type=int, metavar="K", help="experts each token is routed to (default 2)"
    )
    model.add_argument(
        "--capacity-factor",
        type=float,
        metavar="C",
        help="slots of an expert per sequence, in multiples of its fair share (default 1.25); "
        "choices beyond are dropped and counted",
    )


def _request(args: argparse.Namespace, devices: DeviceChoice | None = None) -> TrainRequest:
    from meshplan.cli.train_request import TrainRequest

    overrides = {field: getattr(args, dest) for dest, field in MODEL_FLAGS.items()}
    overrides["scan_layers"] = args.scan_layers
    if args.remat is not None:
        overrides["remat"] = args.remat != "none"
        if args.remat != "none":
            overrides["remat_policy"] = args.remat.replace("-", "_")
    settings = {field: getattr(args, dest) for dest, field in SETTINGS_FLAGS.items()}
    return TrainRequest(
        mesh=args.mesh,
        axes=getattr(args, "axes", None),
        rules=args.rules,
        config=args.config,
        overrides={k: v for k, v in overrides.items() if v is not None},
        data=args.data,
        ckpt_dir=args.ckpt_dir,
        resume=args.resume,
        resume_step=args.resume_step,
        metrics=args.metrics,
        settings={k: v for k, v in settings.items() if v is not None},
        model=getattr(args, "model", None),
        devices=devices,
        sync_every_step=bool(getattr(args, "sync_every_step", False)),
    )


def _header(console: Console, prepared: PreparedRun, devices: Any, peak: MeshPeak) -> None:
    from meshplan._text import human_bytes
    from meshplan.cli.train_request import MODELS

    trainer, config, kind, corpus = (
        prepared.trainer,
        prepared.config,
        prepared.model,
        prepared.corpus,
    )
    assert config is not None and corpus is not None  # the built-in Transformer's run
    s = trainer.settings
    summary = trainer.plan_summary()
    mesh = "x".join(str(v) for v in summary["mesh"].values())
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
            + f", lr {s.lr:g}, seed {s.seed}",
        ],
        [
            f"data: {corpus.source} ({len(corpus.train):,} train / {len(corpus.valid):,} "
            f"valid bytes)"
        ],
        [
            devices.describe() + f"; compute dtype {config.dtype}, parameters and AdamW "
            f"state float32; {_flop_text(trainer.flops_per_step or 0)} a step"
        ],
        [f"MFU against: {peak.label}" if peak.flops else f"no MFU: {no_mfu_why(peak)}"],
    ]
    if trainer.resume_from is not None:
        meta = trainer.resume_from
        saved_mesh = "x".join(str(v) for v in meta.mesh_shape.values()) or "?"
        saved_by = int(meta.extra.get("processes") or 1)
        lines.append(
            [
                f"resuming from step {meta.step} of {trainer.ckpt_dir} (saved on {saved_mesh} "
                f"with {meta.extra.get('layout') or 'its rules'}"
                f"{f' by {saved_by} processes' if saved_by > 1 else ''}) onto {mesh} with "
                f"{summary['layout']}"
            ]
        )
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


def _own_header(console: Console, prepared: PreparedRun, devices: Any) -> None:
    """The header of a ``--model pkg.module:factory`` run: the model, the mesh, the batches."""
    trainer, own = prepared.trainer, prepared.trainable
    assert own is not None
    s = trainer.settings
    summary = trainer.plan_summary()
    mesh = "x".join(str(v) for v in summary["mesh"].values())
    import jax

    shapes = ", ".join(str(tuple(x.shape)) for x in jax.tree.leaves(own.example_batch))
    lines: list[list[Any]] = [
        [
            ("meshplan train", "bold"),
            f": {own.name} ({own.api}) from --model {prepared.model} "
            f"({summary['parameters']:,} parameters)",
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
        lines.append([f"resuming from step {trainer.resume_from.step} of {trainer.ckpt_dir}"])
    for line in lines:
        say(console, *line, soft_wrap=True)


def _flop_text(flops: float) -> str:
    """``2.9e13`` -> ``'29.0 TFLOP'``.

    Example:
        >>> from meshplan.cli.train import _flop_text
        >>> _flop_text(2.897e13), _flop_text(1.9e8), _flop_text(12)
        ('29.0 TFLOP', '190.0 MFLOP', '12 FLOP')
    """
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if flops >= scale:
            return f"{flops / scale:,.1f} {unit}"
    return f"{flops:,.0f} FLOP"


def _peak_memory(devices: Any) -> int | None:
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


def _summary(
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
    memory = _peak_memory(devices)
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


class _MetricsLog(contextlib.AbstractContextManager["_MetricsLog", None]):
    """Appends each record to ``path`` as one JSON line; does nothing without a path.

    A write that fails (a full disk) ends the run with a meshplan error naming the
    file, the step and the cause (the checkpoints saved so far are kept).
    """

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._file: Any = None

    def __enter__(self) -> _MetricsLog:
        path = self.path
        if path is not None:
            try:
                # Not blocking: a FIFO nobody reads (refused up front) cannot hang the run.
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
                os.set_blocking(fd, True)
                self._file = open(fd, "a", buffering=1)
            except OSError as e:
                raise self._failed(e, "opening it") from e
        return self

    def _failed(self, e: OSError, when: str) -> Exception:
        from meshplan._errors import MeshplanError, error_for

        cause = (
            f"{os.strerror(e.errno)} ({errno.errorcode.get(e.errno, e.errno)})"
            if e.errno
            else str(e)
        )
        return error_for(
            MeshplanError, "metrics-write-failed", "--metrics",
            f"--metrics {self.path!r}: {when} failed: {cause}",
            "Free space on its disk or pass --metrics a file elsewhere, then continue with "
            "--resume (the checkpoints saved so far are kept).",
        )  # fmt: skip

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


def _console(main: bool) -> Console:
    if not main:
        return Console(quiet=True)  # process 0 speaks for a multi-process run
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


def run(args: argparse.Namespace) -> int:
    from meshplan._errors import MeshplanError

    if args.processes is not None:
        from meshplan.cli.train_processes import launch_workers

        return launch_workers(args)
    try:
        select_platform(args.platform, args.devices)
        from meshplan.cli.train_processes import join_if_asked

        group = join_if_asked(args)
        from meshplan.cli.devices import found_devices

        devices = found_devices(args.platform)
    except MeshplanError as e:
        print_error(e)
        return 2
    import jax

    from meshplan.cli.factory import is_factory
    from meshplan.cli.train_factory import prepare_factory_run
    from meshplan.cli.train_request import DamagedStep, prepare_run

    console = _console(jax.process_index() == 0)
    request = _request(args, devices)
    while True:
        try:
            if request.model is not None and is_factory(request.model):
                prepared = prepare_factory_run(request)
            else:
                prepared = prepare_run(request)
            trainer = prepared.trainer
        except MeshplanError as e:
            print_error(e)  # every problem, then the fixes in flag terms
            return 2
        try:
            with warnings.catch_warnings():  # its note is printed below, once
                warnings.simplefilter("ignore", UserWarning)
                trainer.open()  # the checkpoint folder's lock: a second writer is refused here
            resumed = trainer.resume_from
            if resumed is not None and resumed.step < trainer.settings.steps:
                trainer.start()  # reads the arrays and verifies their checksums
        except MeshplanError as e:
            _close(trainer)
            problem = e.problems[0] if len(e.problems) == 1 else None
            if (
                problem is not None
                and problem.code == "ckpt-damaged"
                and trainer.resume_from is not None
                and request.resume_step is None
            ):
                # Bytes changed in place (seen only when read): take the step before it.
                damaged = DamagedStep(trainer.resume_from.step, problem)
                request = dataclasses.replace(request, damaged=(*request.damaged, damaged))
                continue
            print_error(_for_the_command_line(e))
            return 2
        break
    done = trainer.resume_from.step if trainer.resume_from is not None else None
    if done is not None and done >= trainer.settings.steps:
        failed = _close(trainer)
        whose = " (the checkpoint's setting)" if args.steps is None else ""
        say(
            console,
            f"note: nothing to train: {trainer.ckpt_dir} is at step {done} and --steps is "
            f"{trainer.settings.steps}{whose}. Pass --steps N with N above {done} to train further.",
        )
        if failed is not None:
            print_error(_for_the_command_line(failed))
            return 1
        return 0
    if group is not None:
        say(
            console,
            f"processes: {group.num_processes} (coordinator {group.coordinator}), "
            f"{jax.local_device_count()} devices each; this is process 0's output",
        )
    if jax.process_index() != 0:
        say(
            Console(stderr=True),
            f"process {jax.process_index()} of {jax.process_count()}: training; process 0 "
            f"prints the progress and the summary",
        )
    else:
        for note in trainer.notes:
            say(Console(stderr=True), ("note: ", "bold"), in_flags(note), soft_wrap=True)
    peak = prepared.peak
    own = prepared.trainable is not None  # --model pkg.module:factory
    if own:
        from meshplan.train.flops import MeshPeak

        peak = MeshPeak(None, None, "no FLOP count for a model of your own")
        units = ("examples/s", "")
        _own_header(console, prepared, devices)
    else:
        assert peak is not None  # the request names the devices
        units = ("tokens/s", " nats/byte")
        _header(console, prepared, devices, peak)

    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TaskID,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    progress = Progress(
        TextColumn("[bold]train[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[tps]} " + ("examples/s" if own else "tok/s")),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    task: TaskID | None = None

    log = _MetricsLog(args.metrics if jax.process_index() == 0 else None)

    stop = _StopOnSigterm()

    timed = [0.0, 0.0]  # tokens and seconds of the timed steps: the summary's tokens/s too

    def on_step(record: Any) -> None:  # a StepRecord, while the device runs the next step
        assert task is not None  # added before the run starts
        if record.step_time_s and record.tokens_per_s:
            timed[0] += record.tokens_per_s * record.step_time_s
            timed[1] += record.step_time_s
        progress.update(
            task,
            completed=record.step,
            loss=f"{record.loss:.3f}",
            tps=f"{timed[0] / timed[1]:,.0f}" if timed[1] else "-",
        )
        log(record.to_dict())
        stop.check(record.step)

    def on_eval(step: int, loss: float) -> None:
        say(progress.console, f"step {step:>5}  valid loss {loss:.3f}{units[1]}")
        log({"step": step, "valid_loss": loss})

    started = time.perf_counter()  # the bar's clock: the summary's time is the same
    try:
        with stop, progress, log:
            stop.check()
            task = progress.add_task(
                "train",
                total=trainer.settings.steps,
                completed=trainer.resume_from.step if trainer.resume_from else 0,
                loss="-",
                tps="-",
            )
            result = trainer.run(on_step=on_step, on_eval=on_eval)
            trainer.close()  # the last save reaches the disk (or its failure is raised)
    except (KeyboardInterrupt, _Terminated) as e:
        failed = _close(trainer)  # the save in progress completes: it is the latest checkpoint
        last = trainer.latest_saved
        how = "stopped by SIGTERM" if isinstance(e, _Terminated) else "interrupted"
        message = f"{how} at step {trainer.step}; " + (
            f"latest complete checkpoint: step {last} (resume with --resume --ckpt-dir "
            f"{trainer.ckpt_dir})"
            if last is not None
            else "no checkpoint saved"
        )
        if isinstance(e, _Terminated):
            print_error(message + ".")
        else:
            say(console, message)
        if failed is not None:
            print_error(_for_the_command_line(failed))
        return 143 if isinstance(e, _Terminated) else 130
    except MeshplanError as e:
        _close(trainer)  # the lock is released; a failure already raised is not raised twice
        print_error(_for_the_command_line(e, trainer.settings.lr, getattr(args, "_argv", None)))
        return 1
    except BaseException:
        _close(trainer)  # any other error: let the save in progress reach the disk first
        raise
    _summary(console, trainer, result, devices, peak, time.perf_counter() - started, units)
    if jax.process_index() != 0:
        say(
            Console(stderr=True),
            f"process {jax.process_index()} of {jax.process_count()}: done at step {trainer.step}",
        )
    return 0


def _close(trainer: Trainer) -> Exception | None:
    """Closes the trainer's checkpoints; the error it raises (a save that failed), if any."""
    from meshplan._errors import MeshplanError

    try:
        trainer.close()
    except MeshplanError as e:
        return e
    return None


def _again(argv: list[str] | None, drop: dict[str, bool], add: list[str]) -> str:
    """``meshplan train`` with the user's own flags, less ``drop`` (flag: takes a value), plus ``add``.

    Example:
        >>> from meshplan.cli.train import _again
        >>> _again(["train", "--resume", "--lr", "1e6", "--steps", "35", "--ckpt-dir", "r"],
        ...        {"--resume": False, "--lr": True}, ["--resume-step", "20", "--lr", "1e5"])
        'meshplan train --steps 35 --ckpt-dir r --resume-step 20 --lr 1e5'
    """
    tokens = list(argv or [])
    if tokens[:1] == ["train"]:
        tokens = tokens[1:]
    kept: list[str] = []
    skip = False
    for token in tokens:
        if skip:
            skip = False
            continue
        name = token.split("=", 1)[0]
        if name in drop:
            skip = drop[name] and "=" not in token
            continue
        kept.append(token)
    return " ".join(["meshplan", "train", *kept, *add])


def _for_the_command_line(
    error: Exception, lr: float | None = None, argv: list[str] | None = None
) -> str:
    """The error's message with its fix in flag terms (the library's name API calls)."""
    from meshplan.train.records import Diverged

    if isinstance(error, Diverged):
        problem = error.problems[0]
        lower = "--lr <smaller>" if lr is None else f"--lr {lr / 10:g}"
        now = "" if lr is None else f" (this run's is {lr:g})"
        if error.resume_at is not None and error.ckpt_dir is not None:
            again = _again(
                argv,
                {"--resume": False, "--resume-step": True, "--lr": True},
                ["--resume-step", str(error.resume_at), *lower.split()],
            )
            if "--ckpt-dir" not in again:
                again += f" --ckpt-dir {error.ckpt_dir}"
            fix = f"Lower --lr{now} and resume from step {error.resume_at}: {again}."
        else:
            fix = f"Lower --lr{now} and train again, e.g. with {lower}."
        return f"{problem.message}.\n{fix}"
    problems = getattr(error, "problems", None) or []
    if len(problems) == 1 and problems[0].code in CODE_ADVICE:
        problem = problems[0]
        fix = CODE_ADVICE[problem.code]
        if problem.code == "ckpt-write-failed":
            fix = f"{problem.fix} Then continue with --resume (from the last complete step)."
        return f"{problem.message}.\n{fix}"
    return str(error)


class _Terminated(Exception):
    """SIGTERM arrived: the run stops at the end of the current step."""


class _StopOnSigterm(contextlib.AbstractContextManager["_StopOnSigterm", None]):
    """While active, SIGTERM asks the run to stop after the current step.

    One process: a second SIGTERM stops it at once. Several processes (``--processes
    N``, whose launcher forwards the signal, or one per host): a SIGTERM to any of
    them stops all of them after the same step
    (:class:`~meshplan.train.distributed.StopVote`), so that they finish the save in
    progress together and the folder's lock is released. Only in the main thread.
    """

    def __init__(self) -> None:
        from meshplan.train.distributed import StopVote

        self.enabled = threading.current_thread() is threading.main_thread()
        self.vote = StopVote()
        self._previous: Any = None

    @property
    def asked(self) -> bool:
        return self.vote.asked

    def _handler(self, signum: int, frame: Any) -> None:
        if self.vote.asked and self.vote.processes == 1:
            raise _Terminated
        self.vote.ask()

    def check(self, step: int | None = None) -> None:
        """Raises :class:`_Terminated` when the run stops now (after ``step``, when given)."""
        if step is None:
            if self.vote.processes == 1 and self.vote.asked:
                raise _Terminated
            return
        if self.vote.after(step):
            raise _Terminated

    def __enter__(self) -> _StopOnSigterm:
        if self.enabled:
            self._previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            signal.signal(signal.SIGTERM, self._previous)
