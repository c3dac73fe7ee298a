"""The names of the trees and functions that flow through the command line.

A model's state, a batch and a loss's inputs are JAX pytrees, which have no static type;
the names say which is which where ``Any`` would not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

__all__ = ["Batches", "InitFn", "LossFn", "PyTree", "StepFn"]

PyTree: TypeAlias = Any
"""A tree of arrays (a state, a batch, parameters): JAX's pytrees have no static type."""

StepFn: TypeAlias = Callable[[PyTree, PyTree], PyTree]
"""``step(state, batch) -> state``: one train step."""

InitFn: TypeAlias = Callable[[PyTree], PyTree]
"""``init(key) -> params``."""

LossFn: TypeAlias = Callable[[PyTree, PyTree], PyTree]
"""``loss(params_or_outputs, batch) -> scalar`` (or ``(scalar, metrics)``)."""

Batches: TypeAlias = Callable[[str, int], PyTree]
"""``batches(split, index) -> batch``."""
