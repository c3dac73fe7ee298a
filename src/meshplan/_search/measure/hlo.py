"""Collectives in compiled HLO: the bytes each device sends into them per run.

Used by :func:`meshplan.search_layouts` (``measure=True``, through
:func:`measure_step`) and by ``benchmarks/bench_layouts.py``. The parser reads the text of
``jax.jit(f).lower(...).compile().as_text()``: it is a best-effort reading of
XLA's HLO text format, not an XLA API.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from meshplan._errors import MeshplanError, error_for
from meshplan._spmd.rules import LogicalRules
from meshplan._types import PyTree, StepFn

if TYPE_CHECKING:
    import jax

__all__ = [
    "COLLECTIVES",
    "DTYPE_BYTES",
    "collective_bytes",
    "collective_counts",
    "compile_candidate",
    "measure_step",
]

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
"""The collective kinds: those counted in HLO, in the order :func:`collective_bytes` returns
them, and those the planner prices
(:func:`meshplan._search.predict.collectives.collective_time`)."""

DTYPE_BYTES = {
    **dict.fromkeys(("pred", "s8", "u8"), 1),
    **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
    **dict.fromkeys(("s32", "u32", "f32"), 4),
    **dict.fromkeys(("s64", "u64", "f64", "c64"), 8),
    "c128": 16,
}
"""Bytes per element of HLO element types."""

_HEADER = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*?)\s([a-z][a-z0-9\-]*)\(([^)]*)\)(.*)$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")


def _type_bytes(type_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype in DTYPE_BYTES:
            total += DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
    return total


def _collective_runs(hlo_text: str) -> list[tuple[str, int, int]]:
    """``(kind, operand bytes, runs)`` per collective instruction of ``hlo_text``.

    Collectives in a ``while`` body run once per trip (``known_trip_count``, e.g.
    ``nn.scan``'s layers), in computations reached through ``calls=``/``to_apply=`` as
    often as their caller. Async pairs (``all-gather-start``/``-done``) count once.
    """
    computations: dict[str, list[tuple[str, list[str], str]]] = {}
    types: dict[str, str] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            if header.group(1):
                entry = current
            continue
        if current is None:
            continue
        instr = _INSTR.match(line)
        if instr:
            name, type_text, op, args, rest = instr.groups()
            types[name] = type_text
            operands = re.findall(r"%([^\s,)]+)", args)
            computations[current].append((op, operands, rest))
    multiplier: dict[str, int] = {}

    def visit(comp: str, times: int) -> None:
        multiplier[comp] = multiplier.get(comp, 0) + times
        for op, _, rest in computations.get(comp, ()):
            if op == "while":
                found = re.search(r'known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(\d+)"', rest)
                trips = int(found.group(1)) if found else 1
                body = re.search(r"body=%([^\s,]+)", rest)
                if body:
                    visit(body.group(1), times * trips)
                continue
            for callee in re.findall(r"(?:calls|to_apply)=%([^\s,]+)", rest):
                if callee in computations:
                    visit(callee, times)

    if entry is not None:
        visit(entry, 1)
    runs = []
    for comp, instrs in computations.items():
        for op, operands, _ in instrs:
            kind = op.removesuffix("-start")
            if kind not in COLLECTIVES or op.endswith("-done"):
                continue
            nbytes = sum(_type_bytes(types.get(o, "")) for o in operands)
            runs.append((kind, nbytes, multiplier.get(comp, 0)))
    return runs


def collective_bytes(hlo_text: str) -> dict[str, int]:
    """Per-device operand bytes of the collectives one run of ``hlo_text`` executes, by kind.

    Collectives in a ``while`` body count once per trip (``known_trip_count``,
    e.g. ``nn.scan``'s layers), in computations reached through
    ``calls=``/``to_apply=`` as often as their caller. Async pairs
    (``all-gather-start``/``-done``) count once.

    Example:
        >>> from meshplan._search.measure.hlo import collective_bytes
        >>> hlo = '''
        ... ENTRY %main (p: f32[4,8]) -> f32[4,8] {
        ...   %p = f32[4,8]{1,0} parameter(0)
        ...   ROOT %ar = f32[4,8]{1,0} all-reduce(%p), replica_groups={{0,1}}, to_apply=%add
        ... }
        ... '''
        >>> collective_bytes(hlo)["all-reduce"]
        128

    Args:
        hlo_text: The text of a compiled (or lowered) HLO module.

    Returns:
        ``{kind: bytes}`` for every kind of :data:`COLLECTIVES` (0 when absent).
    """
    by_kind = dict.fromkeys(COLLECTIVES, 0)
    for kind, nbytes, times in _collective_runs(hlo_text):
        by_kind[kind] += nbytes * times
    return by_kind


def collective_counts(hlo_text: str) -> dict[str, int]:
    """How many collectives one run of ``hlo_text`` executes, by kind (a combined one, a
    tuple, once), counted as :func:`collective_bytes` counts their bytes.

    Example:
        >>> from meshplan._search.measure.hlo import collective_counts
        >>> hlo = '''
        ... ENTRY %main (p: f32[4,8]) -> (f32[4,8], f32[4,8]) {
        ...   %p = f32[4,8]{1,0} parameter(0)
        ...   ROOT %ar = (f32[4,8]{1,0}, f32[4,8]{1,0}) all-reduce(%p, %p), to_apply=%add
        ... }
        ... '''
        >>> collective_counts(hlo)["all-reduce"]
        1
    """
    by_kind = dict.fromkeys(COLLECTIVES, 0)
    for kind, _, times in _collective_runs(hlo_text):
        by_kind[kind] += times
    return by_kind


def candidate_shardings(
    mesh_shape: Mapping[str, int], state: PyTree, example_batch: PyTree, rules: LogicalRules
) -> tuple[jax.sharding.Mesh, PyTree, PyTree]:
    """A candidate's mesh on the first devices (Auto axes), its state's and batch's shardings.

    The batch's first dimension is ``'batch'``.
    """
    import jax
    from jax.sharding import AxisType, NamedSharding

    from meshplan._spmd.rules import logical_to_mesh_axes
    from meshplan._spmd.shardings import get_partition_spec, logical_to_mesh_sharding

    shape, n = tuple(mesh_shape.values()), math.prod(mesh_shape.values())
    auto = (AxisType.Auto,) * len(shape)
    mesh = jax.make_mesh(shape, tuple(mesh_shape), devices=jax.devices()[:n], axis_types=auto)
    shardings = logical_to_mesh_sharding(get_partition_spec(state), mesh, rules)
    batch_shardings = jax.tree.map(
        lambda x: NamedSharding(
            mesh, logical_to_mesh_axes(("batch",) + (None,) * (x.ndim - 1), rules)
        ),
        example_batch,
    )
    return mesh, shardings, batch_shardings


def compile_candidate(
    step_fn: StepFn,
    state: PyTree,
    example_batch: PyTree,
    mesh_shape: Mapping[str, int],
    rules: LogicalRules,
    donate: bool = False,
    compiler_options: Mapping[str, str | bool] | None = None,
) -> tuple[jax.stages.Compiled, PyTree, PyTree]:
    """``step_fn`` compiled as the candidate runs it; its state's and batch's shardings.

    Traced and compiled under the candidate's mesh and rules, the executable is the
    candidate's program: a jitted step called outside that context would be traced
    again without the rules. Shared by :func:`measure_step` and the search's timing,
    so both compile a candidate the same way. ``state`` and ``example_batch`` may be
    abstract. ``donate``: the state is donated (the new state takes its buffers), as
    :class:`meshplan.Trainer` runs a step; ``compiler_options``: XLA's, for this compile.
    """
    import jax

    from meshplan._spmd.rules import logical_axis_rules

    mesh, shardings, batch_shardings = candidate_shardings(mesh_shape, state, example_batch, rules)
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        # A new function each time: JAX's trace cache does not know the active rules,
        # so reusing step_fn would reuse constraints traced under another layout.
        def step(state: PyTree, batch: PyTree) -> PyTree:
            return step_fn(state, batch)

        donated = (0,) if donate else ()
        jitted = jax.jit(step, in_shardings=(shardings, batch_shardings), donate_argnums=donated)
        compiled = jitted.lower(state, example_batch).compile(dict(compiler_options or {}) or None)
    return compiled, shardings, batch_shardings


def measure_step(
    step_fn: StepFn,
    state: PyTree,
    example_batch: PyTree,
    mesh_shape: Mapping[str, int],
    rules: LogicalRules,
    donate: bool = False,
    compiler_options: Mapping[str, str | bool] | None = None,
) -> dict[str, object]:
    """Compiles ``step_fn(state, batch)`` under ``rules`` and reports what XLA says of it.

    The mesh has ``mesh_shape``'s axes (Auto, on the first devices); the state
    is sharded by its logical names, every batch array by ``('batch', None, ...)``.
    Nothing runs: ``state`` and ``example_batch`` may be abstract. ``donate`` and
    ``compiler_options``: as :func:`compile_candidate` compiles it.

    Returns:
        ``collectives`` (bytes by kind, non-zero ones), ``collective_bytes``
        (their sum), ``xla_argument_bytes`` and ``xla_temp_bytes`` (of
        ``memory_analysis()``, ``None`` when the backend gives none) and
        ``compile_seconds``.

    Raises:
        MeshplanError: the backend gives no HLO text for the compiled step.
    """
    t0 = time.perf_counter()
    compiled, _, _ = compile_candidate(
        step_fn, state, example_batch, mesh_shape, rules, donate, compiler_options
    )
    seconds = time.perf_counter() - t0
    hlo_text = compiled.as_text()
    if hlo_text is None:  # JAX: "None if unavailable, e.g. based on backend"
        raise error_for(
            MeshplanError,
            "no-hlo-text",
            "step",
            f"XLA gave no HLO text for the step compiled on the mesh {dict(mesh_shape)}, so "
            f"its collectives cannot be counted",
            "Search without measure=True: the static estimate still ranks the layouts.",
        )
    kinds = collective_bytes(hlo_text)
    memory = compiled.memory_analysis()
    return {
        "collectives": {k: v for k, v in kinds.items() if v},
        "collective_bytes": sum(kinds.values()),
        "xla_argument_bytes": getattr(memory, "argument_size_in_bytes", None),
        "xla_temp_bytes": getattr(memory, "temp_size_in_bytes", None),
        "compile_seconds": round(seconds, 2),
    }
