"""How to train, apart from the model, mesh and layout: the settings and the optimizer.

The learning-rate schedule depends on the step only, so a run stopped and
resumed, with batches that depend on ``(seed, step)`` only (as ``meshplan
train``'s do), sees exactly the batches and updates of one that never stopped.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import optax

__all__ = ["TrainSettings", "make_optimizer"]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How to train, apart from the model, mesh and layout.

    These are stored with every checkpoint, and a resumed run takes the stored
    values for any the user does not give again.

    Attributes:
        steps: The step to train up to (a resumed run continues to it).
        batch: Sequences per step (global, over all devices).
        seq_len: Tokens per sequence the model reads (``meshplan train``: bytes; its
            batches hold ``seq_len + 1``, the last one predicted).
        lr: Peak learning rate of AdamW.
        warmup: Steps of linear warm-up to ``lr``, constant after.
        weight_decay: AdamW's decoupled weight decay.
        seed: Seed of the initial parameters and of the batches.
        eval_every: Evaluate every this many steps (0: only at the end).
        eval_batches: Validation batches per evaluation.
        ckpt_every: Save a checkpoint every this many steps (and at the end).
        keep: The latest checkpoints kept (the one with the best validation
            loss is kept as well, whatever this says).
        clip: Gradients are clipped to this global norm.
        grad_accum: Microbatches per step: the batch of ``batch`` sequences is
            cut into this many, their gradients accumulated, one update made
            (the same update, with the activation memory of one microbatch).
    """

    steps: int = 300
    batch: int = 32
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100
    keep: int = 3
    clip: float = 1.0
    grad_accum: int = 1

    def problems(self) -> list[tuple[str, str]]:
        """What is wrong with these settings: ``(field, why)`` pairs; ``[]`` when none.

        Counts must be whole numbers in range, rates finite numbers in range
        (a NaN or an infinite learning rate trains to NaN without an error).

        Example:
            >>> from meshplan.train.settings import TrainSettings
            >>> TrainSettings(lr=float("nan"), warmup=-5).problems()
            [('lr', 'must be a finite number above 0, got nan'), ('warmup', 'must be 0 or more, got -5')]
        """
        found: list[tuple[str, str]] = []
        for field in dataclasses.fields(self):
            name, value = field.name, getattr(self, field.name)
            kind = _LIMITS[name]
            if kind in ("count", "index") and (not _is_int(value) or value < (kind == "count")):
                at_least = "a whole number of 1 or more" if kind == "count" else "0 or more"
                found.append((name, f"must be {at_least}, got {value!r}"))
            elif name == "seed" and value >= 2**63:  # JAX's PRNG keys take a 64-bit seed
                found.append((name, f"must be below 2**63 (a 64-bit seed), got {value!r}"))
            elif kind in ("rate", "weight"):
                ok = _is_number(value) and math.isfinite(value)
                ok = ok and (value > 0 if kind == "rate" else value >= 0)
                if not ok:
                    bound = "above 0" if kind == "rate" else "of 0 or more"
                    found.append((name, f"must be a finite number {bound}, got {_show(value)}"))
        accum = self.grad_accum
        if _is_int(accum) and accum >= 1 and _is_int(self.batch) and self.batch % accum:
            found.append(
                ("grad_accum", f"{accum} microbatches do not divide a batch of {self.batch}")
            )
        return found

    def to_dict(self) -> dict[str, object]:
        """A JSON-able dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSettings:
        """Settings from :meth:`to_dict` (unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


_LIMITS = {
    "steps": "count",
    "batch": "count",
    "seq_len": "count",
    "lr": "rate",
    "warmup": "index",
    "weight_decay": "weight",
    "seed": "index",
    "eval_every": "index",
    "eval_batches": "count",
    "ckpt_every": "index",
    "keep": "count",
    "clip": "rate",
    "grad_accum": "count",
}
"""What each setting may be: a count (>= 1), an index (>= 0), a rate (finite, > 0), a weight
(finite, >= 0)."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _show(value: object) -> str:
    return f"{value:g}" if _is_number(value) else repr(value)


def make_optimizer(settings: TrainSettings) -> optax.GradientTransformation:
    """Gradient clipping at norm ``settings.clip`` (default 1), then AdamW with linear warm-up to a constant rate.

    The schedule depends on the step only (not on ``steps``), so stopping and
    resuming never changes an update.

    Example:
        >>> from meshplan.train.settings import TrainSettings, make_optimizer
        >>> tx = make_optimizer(TrainSettings(lr=1e-3, warmup=10))
        >>> type(tx).__name__
        'GradientTransformationExtraArgs'
    """
    warmup = max(settings.warmup, 1)
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, settings.lr, warmup), optax.constant_schedule(settings.lr)],
        [warmup],
    )
    return optax.chain(
        optax.clip_by_global_norm(settings.clip),
        optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=settings.weight_decay),
    )
