"""The logical names the roles of a mesh axis read: a sequence, experts, the batch with its experts."""

__all__ = ["CONTEXT_NAMES", "EXPERT_BATCH_NAMES", "EXPERT_NAMES"]

CONTEXT_NAMES = ("length", "seq", "sequence", "context", "activation_length")
"""Names of an activation's sequence dimension, which a ``context`` axis splits."""

EXPERT_NAMES = ("expert", "experts")
"""Names of a mixture of experts' expert dimension, which an ``expert`` axis splits."""

EXPERT_BATCH_NAMES = ("expert_batch",)
"""Names of the batch once tokens are with their experts: the batch's axes less ``expert``."""
