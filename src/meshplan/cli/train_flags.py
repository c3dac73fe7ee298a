"""The flags of ``meshplan train`` that name training settings and model fields.

Shared by the command (:mod:`meshplan.cli.train`), which reads them into a
request, and the launcher (:mod:`meshplan.cli.train_processes`), which passes
them on to each worker process.
"""

from __future__ import annotations

__all__ = ["MODEL_FLAGS", "SETTINGS_FLAGS", "flag"]

SETTINGS_FLAGS = {
    # flag dest -> TrainSettings field
    "steps": "steps",
    "batch": "batch",
    "seq": "seq_len",
    "lr": "lr",
    "warmup": "warmup",
    "weight_decay": "weight_decay",
    "seed": "seed",
    "eval_every": "eval_every",
    "eval_batches": "eval_batches",
    "ckpt_every": "ckpt_every",
    "keep": "keep",
    "clip": "clip",
    "grad_accum": "grad_accum",
}
"""``argparse`` destination -> :class:`meshplan.train.settings.TrainSettings` field."""

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
}
"""``argparse`` destination -> field of the example Transformer's config."""


def flag(dest: str) -> str:
    """The command-line flag of an ``argparse`` destination.

    Example:
        >>> from meshplan.cli.train_flags import flag
        >>> flag("eval_every"), flag("config")
        ('--eval-every', '--size')
    """
    if dest == "config":  # the preset is --size on every command (--config: its old name)
        return "--size"
    return "--" + dest.replace("_", "-")
