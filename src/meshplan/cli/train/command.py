"""``meshplan train``: train the example byte-level Transformer on a mesh, with resumable checkpoints.

``--model transformer`` (the default) is the Flax Linen model, ``--model
transformer-nnx`` the same model in Flax NNX; their checkpoints are interchangeable.

The recipe (model, loss, data) is wired into the model-agnostic
:class:`meshplan.train.trainer.Trainer` by :mod:`meshplan.cli.train.request`.

It runs on the machine's accelerators when JAX finds any, else on ``--devices``
emulated CPU devices (``--platform cpu`` asks for those); the header says which.

Checks every input before any work (one bullet per problem, then the fix),
shows the plan's per-device memory, then a progress bar with the loss and
tokens per second, validation losses as they come, and a final summary with
the step time, tokens/s, MFU and the devices' peak memory.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import time
import warnings
from typing import TYPE_CHECKING

from rich.console import Console

from meshplan.cli.devices import PLATFORMS, select_platform
from meshplan.cli.names_file import add_names_argument, refuse_names
from meshplan.cli.output import print_error, say
from meshplan.cli.train.flags import MODEL_FLAGS, SETTINGS, SETTINGS_FLAGS, error_in_flags, in_flags

if TYPE_CHECKING:
    from meshplan.cli.devices import DeviceChoice
    from meshplan.cli.train.request import TrainRequest
    from meshplan.train.trainer import Trainer

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
    add_names_argument(model)
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
    model.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="microbatches of a pipeline (--rules "
        "pipeline, pp_fsdp, pp_tp): the bubble is (stages - 1) / (M x repeats + stages - 1)",
    )
    model.add_argument(
        "--pipeline-repeats",
        type=int,
        metavar="V",
        help="layer groups each pipeline stage holds "
        "(default 1: GPipe; more: the circular schedule, a smaller bubble)",
    )


def _request(args: argparse.Namespace, devices: DeviceChoice | None = None) -> TrainRequest:
    from meshplan.cli.train.request import TrainRequest

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
        names=getattr(args, "names", None),
    )


def checked_request(args: argparse.Namespace, devices: DeviceChoice | None = None) -> TrainRequest:
    """The run ``meshplan train`` is asked for, after its first check: a names file is
    refused for a built-in model, which carries its own names. Then ``prepare_run`` checks
    the rest before anything compiles.

    Example:
        >>> from meshplan.cli import build_parser
        >>> args = build_parser().parse_args(["train", "--rules", "fsdp", "--steps", "5"])
        >>> request = checked_request(args)
        >>> request.rules, request.settings["steps"]
        ('fsdp', 5)
    """
    request = _request(args, devices)
    refuse_names(request.names, request.model)
    return request


def _console(main: bool) -> Console:
    if not main:
        return Console(quiet=True)  # process 0 speaks for a multi-process run
    console = Console()
    return console if console.is_terminal else Console(width=max(console.width, 120))


def run(args: argparse.Namespace) -> int:
    from meshplan._errors import MeshplanError

    if args.processes is not None:
        from meshplan.cli.train.processes import launch_workers

        return launch_workers(args)
    try:
        select_platform(args.platform, args.devices)
        from meshplan.cli.train.processes import join_if_asked

        group = join_if_asked(args)
        from meshplan.cli.devices import found_devices

        devices = found_devices(args.platform)
    except MeshplanError as e:
        print_error(e)
        return 2
    import jax

    from meshplan._checkpoint.lock import StaleLockWarning
    from meshplan.cli.train.display import MetricsLog, summary
    from meshplan.cli.train.prepare import prepare_run
    from meshplan.cli.train.processes import StopOnSigterm, Terminated
    from meshplan.cli.train.request import DamagedStep
    from meshplan.train.records import StepRecord

    console = _console(jax.process_index() == 0)
    try:
        request = checked_request(args, devices)
    except MeshplanError as e:
        print_error(e)
        return 2
    while True:
        try:
            prepared = prepare_run(request)  # every model source: one prepare step
            # What the library summed up of the layout with its build (the header's plan
            # per device): data, which the header only words.
            trainer = prepared.trainer
            plan = prepared.plan
        except MeshplanError as e:
            print_error(e)  # every problem, then the fixes in flag terms
            return 2
        try:
            # One call into the trainer: it opens the checkpoint folder (its lock: a second
            # writer is refused here), and, resuming, reads the arrays and verifies their
            # checksums; a fresh state is made by the run, after the header.
            with warnings.catch_warnings():  # a stale lock's note is printed below, once
                warnings.simplefilter("ignore", StaleLockWarning)
                resumed = trainer.resume_from
                if resumed is not None and resumed.step < trainer.settings.steps:
                    trainer.start()
                else:
                    trainer.open()
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
            print_error(error_in_flags(e))
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
            print_error(error_in_flags(failed))
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
    source = prepared.source
    rate, per = source.units  # ("tokens/s", " nats/byte") for the built-in Transformer
    source.header(console, trainer, plan, devices, peak)

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
        TextColumn("{task.fields[tps]} " + rate.replace("tokens/s", "tok/s")),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )
    task: TaskID | None = None

    log = MetricsLog(args.metrics if jax.process_index() == 0 else None)

    stop = StopOnSigterm()

    timed = [0.0, 0.0]  # tokens and seconds of the timed steps: the summary's tokens/s too

    def on_step(record: StepRecord) -> None:  # while the device runs the next step
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
        say(progress.console, f"step {step:>5}  valid loss {loss:.3f}{per}")
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
    except (KeyboardInterrupt, Terminated) as e:
        failed = _close(trainer)  # the save in progress completes: it is the latest checkpoint
        last = trainer.latest_saved
        sigterm = isinstance(e, Terminated) and e.signum == signal.SIGTERM
        how = "stopped by SIGTERM" if sigterm else "interrupted (SIGINT)"
        message = f"{how} at step {trainer.step}; " + (
            f"latest complete checkpoint: step {last} (resume with --resume --ckpt-dir "
            f"{trainer.ckpt_dir})"
            if last is not None
            else "no checkpoint saved"
        )
        if sigterm:
            print_error(message + ".")
        else:
            say(console, message)
        if failed is not None:
            print_error(error_in_flags(failed))
        return 143 if sigterm else 130
    except MeshplanError as e:
        _close(trainer)  # the lock is released; a failure already raised is not raised twice
        print_error(error_in_flags(e, trainer.settings.lr, getattr(args, "_argv", None)))
        return 1
    except BaseException:
        _close(trainer)  # any other error: let the save in progress reach the disk first
        raise
    summary(console, trainer, result, devices, peak, time.perf_counter() - started, (rate, per))
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
