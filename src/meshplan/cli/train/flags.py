"""The flags of ``meshplan train`` that name training settings and model fields, in one table.

Each training setting is one :class:`Setting`: its ``argparse`` destination, the
:class:`~meshplan.train.settings.TrainSettings` field it sets, its type, help and
the flag-level fix when the setting is refused. The parser
(:mod:`meshplan.cli.train`) is built from :data:`SETTINGS`, the checks
(:mod:`meshplan.cli.train.request`) read their fixes from it, and the launcher
(:mod:`meshplan.cli.train.processes`) passes the same flags on to each worker.
:data:`CODE_ADVICE` is the flag-level advice for the library's problem codes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshplan.train.flops import MeshPeak

__all__ = [
    "CODE_ADVICE",
    "MODEL_FLAGS",
    "SETTINGS",
    "SETTINGS_FLAGS",
    "Setting",
    "again_command",
    "error_in_flags",
    "flag",
    "in_flags",
    "no_mfu_why",
    "setting_fix",
    "setting_flag",
]


@dataclasses.dataclass(frozen=True)
class Setting:
    """One training setting of ``meshplan train``: its flag, its field, its help and its fix.

    Attributes:
        dest: The ``argparse`` destination (``eval_every``; the flag is :attr:`flag`).
        field: The :class:`~meshplan.train.settings.TrainSettings` field it sets.
        kind: ``int`` or ``float``.
        metavar: The value's name in ``--help``.
        help: What it does, with its default.
        fix: What to pass instead when :meth:`TrainSettings.problems` refuses it.
    """

    dest: str
    field: str
    kind: type
    metavar: str
    help: str
    fix: str

    @property
    def flag(self) -> str:
        return flag(self.dest)


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "steps", "steps", int, "N", "train up to step N (default 300)", "Pass --steps 1 or more."
    ),
    Setting(
        "batch",
        "batch",
        int,
        "B",
        "sequences per step (default 32)",
        "Pass --batch 1 or more (a multiple of the devices 'batch' is split over).",
    ),
    Setting(
        "seq", "seq_len", int, "L", "bytes per sequence (default 128)", "Pass --seq 1 or more."
    ),
    Setting(
        "lr",
        "lr",
        float,
        "LR",
        "peak learning rate (default 3e-3)",
        "Pass a finite learning rate above 0, e.g. --lr 3e-3.",
    ),
    Setting(
        "warmup",
        "warmup",
        int,
        "N",
        "warm-up steps (default 30)",
        "Pass --warmup 0 (no warm-up) or a positive number of steps.",
    ),
    Setting(
        "weight_decay",
        "weight_decay",
        float,
        "WD",
        "AdamW weight decay (default 0.01)",
        "Pass a finite --weight-decay of 0 or more, e.g. --weight-decay 0.01.",
    ),
    Setting(
        "seed",
        "seed",
        int,
        "S",
        "seed of the initial parameters and the batches (default 0)",
        "Pass --seed 0 or another whole number from 0 to 2**63 - 1.",
    ),
    Setting(
        "eval_every",
        "eval_every",
        int,
        "E",
        "evaluate every E steps; 0: at the end (default 50)",
        "Pass --eval-every 0 (only at the end) or a positive number of steps.",
    ),
    Setting(
        "eval_batches",
        "eval_batches",
        int,
        "N",
        "validation batches per evaluation (default 4)",
        "Pass --eval-batches 1 or more.",
    ),
    Setting(
        "ckpt_every",
        "ckpt_every",
        int,
        "K",
        "checkpoint every K steps and at the end (default 100)",
        "Pass --ckpt-every 0 (only at the end) or a positive number of steps.",
    ),
    Setting(
        "keep",
        "keep",
        int,
        "N",
        "latest checkpoints kept, besides the best valid one (default 3)",
        "Pass --keep 1 or more (the best checkpoint is kept as well).",
    ),
    Setting(
        "clip",
        "clip",
        float,
        "NORM",
        "clip gradients to this global norm (default 1.0)",
        "Pass a finite gradient norm above 0, e.g. --clip 1.0.",
    ),
    Setting(
        "grad_accum",
        "grad_accum",
        int,
        "N",
        "microbatches per step: gradients of N slices "
        "of the batch accumulated, one update (default 1)",
        "Pass a --grad-accum that divides --batch, e.g. --grad-accum 2 with --batch 32.",
    ),
)
"""Every training setting of ``meshplan train``, in ``--help`` order."""

SETTINGS_FLAGS = {s.dest: s.field for s in SETTINGS}
"""``argparse`` destination -> :class:`meshplan.train.settings.TrainSettings` field."""

_BY_FIELD = {s.field: s for s in SETTINGS}

MODEL_FLAGS = {
    # flag dest -> TransformerConfig field
    "layers": "num_layers",
    "heads": "num_heads",
    "embed": "embed_dim",
    "mlp": "mlp_dim",
    "max_len": "max_len",
    "positions": "positions",
    "dtype": "dtype",
    "experts": "num_experts",
    "top_k": "top_k",
    "capacity_factor": "capacity_factor",
    "microbatches": "microbatches",
    "pipeline_repeats": "pipeline_repeats",
}
"""``argparse`` destination -> field of the example Transformer's config."""


def flag(dest: str) -> str:
    """The command-line flag of an ``argparse`` destination.

    Example:
        >>> from meshplan.cli.train.flags import flag
        >>> flag("eval_every"), flag("config")
        ('--eval-every', '--size')
    """
    if dest == "config":  # the preset is --size on every command (--config: its old name)
        return "--size"
    return "--" + dest.replace("_", "-")


def setting_flag(field: str) -> str:
    """The flag of a :class:`~meshplan.train.settings.TrainSettings` field.

    Example:
        >>> from meshplan.cli.train.flags import setting_flag
        >>> setting_flag("seq_len"), setting_flag("grad_accum")
        ('--seq', '--grad-accum')
    """
    found = _BY_FIELD.get(field)
    return found.flag if found is not None else flag(field)


def setting_fix(field: str) -> str:
    """The flag-level fix of a refused :class:`~meshplan.train.settings.TrainSettings` field.

    Example:
        >>> from meshplan.cli.train.flags import setting_fix
        >>> setting_fix("seq_len")
        'Pass --seq 1 or more.'
    """
    found = _BY_FIELD.get(field)
    return found.fix if found is not None else f"Pass a valid {setting_flag(field)}."


CODE_ADVICE = {
    "ckpt-missing": "Check --ckpt-dir, or start without --resume to train into it.",
    "ckpt-not-a-folder": "Pass a folder as --ckpt-dir.",
    "ckpt-no-steps": "Pass the --ckpt-dir of an earlier run, or start without --resume.",
    "ckpt-incomplete": "Its first save never finished: start again without --resume.",
    "ckpt-not-meshplan": "Pass the --ckpt-dir of a meshplan train run.",
    "ckpt-no-such-step": (
        "Pass one of those steps as --resume-step, or leave it out for the newest intact one."
    ),
    "ckpt-bad-step": "Pass --resume-step a step number, e.g. --resume-step 20.",
    "ckpt-damaged": (
        "Resume from an earlier step with --resume-step N (or --resume alone, which takes the "
        "newest intact step), or train into a new --ckpt-dir."
    ),
    "ckpt-newer-format": "Upgrade meshplan to resume this run.",
    "ckpt-locked": (
        "Wait for that run to finish or stop it, or pass another --ckpt-dir. If that process "
        "is gone (e.g. on another host), delete the lock file."
    ),
    "ckpt-not-writable": (
        "Make --ckpt-dir writable by this user, or pass a --ckpt-dir on another disk or folder."
    ),
    "ckpt-write-failed": (
        "Free space or fix the folder's permissions, then continue with --resume (from the "
        "last complete step), or pass another --ckpt-dir."
    ),
    "ckpt-not-finite": (
        "The run diverged: lower --lr and resume from the last good step with --resume-step N."
    ),
    "data-missing": (
        "Give a folder of text files or a text file (or leave --data out to use the Python "
        "standard library)."
    ),
    "data-too-short": "Use a shorter sequence length (--seq) or more text.",
    "peak-unknown-dtype": "train with --dtype bfloat16 for MFU",
}
"""Flag-level advice for the library's problem codes (its own fixes name API calls)."""


def no_mfu_why(peak: MeshPeak) -> str | None:
    """Why a run has no MFU (``peak.why``), with its fix in flags.

    Example:
        >>> from meshplan.cli.train.flags import no_mfu_why
        >>> from meshplan.train.flops import mesh_peak
        >>> no_mfu_why(mesh_peak("tpu", "TPU v4", 4, "float32")).split("; ")[-1]
        'train with --dtype bfloat16 for MFU'
    """
    if peak.why is None or not peak.fix:
        return peak.why
    return f"{peak.why}; {CODE_ADVICE.get(peak.code or '', peak.fix)}"


def in_flags(note: str) -> str:
    """One of the trainer's notes, in flags where it names a setting or resuming.

    Example:
        >>> from meshplan.cli.train.flags import in_flags
        >>> from meshplan.train.records import Note
        >>> note = Note("Changed: {changed}.", "valid-setting-changed",
        ...             {"step": 4, "changes": {"seq_len": (16, 32)}}, {"changed": "seq_len 32"})
        >>> note, in_flags(note)
        ('Changed: seq_len 32.', 'Changed: --seq 32 instead of 16.')
    """
    from meshplan.train.records import Note

    if not isinstance(note, Note):
        return note
    if note.code == "valid-setting-changed":
        changed = "; ".join(
            f"{setting_flag(name)} {now} instead of {was}"
            for name, (was, now) in note.fields["changes"].items()
        )
        return note.template.replace("{changed}", changed)
    if note.code == "steps-set-aside":
        return note.template.replace("{resume}", "--resume")
    return note


def again_command(argv: list[str] | None, drop: dict[str, bool], add: list[str]) -> str:
    """``meshplan train`` with the user's own flags, less ``drop`` (flag: takes a value), plus ``add``.

    Example:
        >>> from meshplan.cli.train.flags import again_command
        >>> again_command(["train", "--resume", "--lr", "1e6", "--steps", "35", "--ckpt-dir", "r"],
        ...               {"--resume": False, "--lr": True}, ["--resume-step", "20", "--lr", "1e5"])
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


def error_in_flags(error: Exception, lr: float | None = None, argv: list[str] | None = None) -> str:
    """The error's message with its fix in flag terms (the library's name API calls).

    A :class:`~meshplan.train.records.Diverged` run is told to lower ``--lr`` and, with a
    checkpoint, the command that resumes it (``argv``: the user's own flags); an error of one
    problem whose code :data:`CODE_ADVICE` knows gets that advice.
    """
    from meshplan.train.records import Diverged

    if isinstance(error, Diverged) and error.cause != "diverged":
        return str(error)  # the data or the start: no --lr advice, no resume into it
    if isinstance(error, Diverged):
        problem = error.problems[0]
        lower = "--lr <smaller>" if lr is None else f"--lr {lr / 10:g}"
        now = "" if lr is None else f" (this run's is {lr:g})"
        if error.resume_at is not None and error.ckpt_dir is not None:
            command = again_command(
                argv,
                {"--resume": False, "--resume-step": True, "--lr": True},
                ["--resume-step", str(error.resume_at), *lower.split()],
            )
            if "--ckpt-dir" not in command:
                command += f" --ckpt-dir {error.ckpt_dir}"
            fix = f"Lower --lr{now} and resume from step {error.resume_at}: {command}."
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
