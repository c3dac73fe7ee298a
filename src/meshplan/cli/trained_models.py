"""The models ``meshplan train`` trains by name, and which one a checkpoint holds.

Shared by ``meshplan train`` (a resume continues the checkpoint's model) and
``meshplan sample`` (it decodes the model the checkpoint holds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from meshplan.models.registry import EXAMPLE_MODELS

if TYPE_CHECKING:
    from meshplan._checkpoint.metadata import CheckpointMetadata

__all__ = ["DEFAULT_MODEL", "MODELS", "model_of"]

MODELS = {name: m.api for name, m in EXAMPLE_MODELS.items() if m.sequence}
"""The models ``meshplan train --model`` trains, and the Flax API each is written in."""

DEFAULT_MODEL = "transformer"
"""The model of a new run, and of a checkpoint that does not say (written before ``--model``)."""


def model_of(metadata: CheckpointMetadata) -> str:
    """The ``--model`` a checkpoint of ``meshplan train`` holds (``transformer`` if it does not say).

    Example:
        >>> from meshplan import CheckpointMetadata
        >>> from meshplan.cli.trained_models import model_of
        >>> nnx = CheckpointMetadata(0, {}, extra={"train": {"model": "transformer-nnx"}})
        >>> model_of(CheckpointMetadata(0, {}, extra={"train": {}})), model_of(nnx)
        ('transformer', 'transformer-nnx')
    """
    return str((metadata.extra.get("train") or {}).get("model") or DEFAULT_MODEL)
