"""The step-less search: :func:`search_layouts`, the one search without a step.

:func:`search_layouts` is :func:`meshplan.search_rules` with ``ranked_by='static'``:
given layouts (no generated rules, nothing traced) over every shape of ``axis_names``,
each rejected with the reason or sized and ranked by memory per device
(:mod:`meshplan._search.search.static`); it returns the same :class:`SearchResult` of
:class:`SearchRow`, ``ranked_by`` ``'static'``. With a step,
``search_rules(..., layouts=..., max_axes=0)`` searches the same layouts by predicted step
time. ``measure=True`` compiles a step for the first ``top_k`` and records its HLO
collectives and XLA ``memory_analysis()``; among those, measured bytes rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from meshplan._errors import ArgumentError, error_for
from meshplan._search.predict.inputs import check_search_args, whole_number
from meshplan._search.search.candidates import mesh_shapes
from meshplan._search.search.result import SearchResult, SearchRow, require_devices
from meshplan._search.search.rule_search import search_rules
from meshplan._spmd.rules import LogicalRules

__all__ = ["SearchResult", "SearchRow", "mesh_shapes", "search_layouts"]

DEFAULT_LAYOUTS = ("data_parallel", "fsdp", "tensor_parallel", "fsdp_tp")
"""The canned layouts of :mod:`meshplan.layouts` that ``search_layouts`` tries by default."""


def search_layouts(
    abstract_state: Any,
    devices: int,
    layouts: Mapping[str, LogicalRules] | Sequence[str] | None = None,
    *,
    axis_names: tuple[str, ...] = ("data", "model"),
    batch: int | None = None,
    memory_budget_bytes: int | None = None,
    measure: bool = False,
    step_fn: Callable[[Any, Any], Any] | None = None,
    example_batch: Any = None,
    top_k: int = 3,
) -> SearchResult:
    """The step-less search: given layouts over every mesh shape, ranked by bytes.

    :func:`meshplan.search_rules` with ``ranked_by='static'``, restricted to ``layouts``
    and the shapes of ``axis_names``, for a state without a step: nothing is traced, so
    the ranking is static (within the budget, state bytes per device, idle axes, then the
    bytes moved: :mod:`meshplan._search.search.static`). Rejects, with the reason, what
    :func:`meshplan.check` or the ``batch`` rejects. It returns the same
    :class:`SearchResult` of :class:`SearchRow` as ``search_rules``, ``ranked_by``
    ``'static'``. With a step, ``search_rules(devices, state, step, batch, layouts=...,
    max_axes=0)`` searches the same layouts by predicted step time.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = jax.ShapeDtypeStruct((1024, 6), jnp.float32)
        >>> tree = {"params": {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}}
        >>> result = meshplan.search_layouts(tree, 4, batch=8)
        >>> print(result.best)
        1x4 fsdp (6.00 KiB/device, comm est. 30.00 KiB/step)
        >>> print(result.row("1x4", "tensor_parallel").reason)
        params/w: dim 1 ('mlp') of size 6 does not divide by 4 (mesh axis 'model' of size 4)
        >>> result.row("2x2", "tensor_parallel").comm
        {'all-gather': 0, 'gradient-reduce': 12288, 'activations': None}
        >>> data = result.to_dict()
        >>> data["schema"], data["best"]["mesh_text"], len(data["rows"]), data["rows"][-1]["status"]
        ('meshplan.search/1', '1x4', 12, 'rejected')

    Args:
        abstract_state: What :func:`meshplan.explain` takes (``jax.eval_shape`` of init).
        devices: How many devices the mesh has.
        layouts: ``{name: rules}``, or names of built-in layouts (``meshplan.layouts``);
            ``None``: the four canned layouts (``DEFAULT_LAYOUTS``).
        axis_names: The mesh axis names the rules use.
        batch: Global batch size (default: ``example_batch``'s, else unchecked).
        memory_budget_bytes: State bytes one device may hold.
        measure: Compile ``step_fn`` for the first ``top_k`` (needs ``devices`` devices).
        step_fn: ``step_fn(state, batch)``; each batch array's first dim is ``'batch'``.
        example_batch: The batch: a ``ShapeDtypeStruct``, an array, or a tree.
        top_k: How many candidates to measure.

    Raises:
        ArgumentError: ``measure`` without ``step_fn`` or ``example_batch``.
        MeshError: ``measure`` with fewer JAX devices than ``devices`` (code
            ``'too-few-devices'``, as :func:`meshplan.search_rules` raises).
    """
    check_search_args(
        devices=devices, budget=memory_budget_bytes, batch=batch, where="search_layouts"
    )
    if whole_number(top_k) is None or top_k < 1 or isinstance(top_k, float):
        raise error_for(
            ArgumentError,
            "bad-top-k",
            "top_k",
            f"search_layouts requires a positive top_k, got {top_k=}",
            "Pass top_k=1 or more.",
        )
    if measure and (step_fn is None or example_batch is None):
        raise error_for(
            ArgumentError,
            "missing-argument",
            "step_fn",
            "measure=True compiles a step, and step_fn= or example_batch= is missing",
            "Pass step_fn= and example_batch=.",
        )
    if measure:
        require_devices(devices, "measuring")
    return search_rules(
        devices,
        abstract_state,
        step_fn if measure else None,
        example_batch,
        layouts=DEFAULT_LAYOUTS if layouts is None else layouts,
        ranked_by="static",
        axis_names=axis_names,
        batch=batch,
        memory_budget_bytes=memory_budget_bytes,
        compile_top=top_k if measure else 0,
    )
