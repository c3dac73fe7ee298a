"""Running a step for real under a mesh and rules, to time it (``measure=True``, the benchmark).

The state is made of zeros of the abstract state's shapes, placed as the rules
say (values do not change a step's time); the step is compiled ahead of time
under the candidate's mesh and rules, run once to warm up, then timed. A step that
returns a new state of the state's shapes runs as a training loop runs it: the state
donated, each step's new state the next one's (the program the planner prices, whose
temporaries hold what the new state is made of: on CPU, from 32 MiB a device, new
memory every step).

The compiled executable is what runs, never the jitted function: called
outside the ``jax.set_mesh``/``logical_axis_rules`` context it was traced in,
a jitted step is traced again without the candidate's rules, and its logical
constraints then place the activations differently. That program is not the
candidate's, and it can be ten times slower.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from meshplan._spmd.rules import LogicalRules
from meshplan._types import PyTree, StepFn

if TYPE_CHECKING:
    import jax

__all__ = ["Prepared", "StepTime", "prepare_step"]


class StepTime(NamedTuple):
    """One step's seconds: ``wall_s`` by the clock, ``cpu_s`` the CPU time this process's
    threads spent on it (every emulated device's thread, summed). On a machine shared with
    other processes the wall time is what this process was given; the CPU time is the work
    itself, which another process's load barely moves."""

    wall_s: float
    cpu_s: float


class Prepared:
    """A compiled step with its placed state and batch: :meth:`run` times ``n`` steps.

    ``compiled`` is the ``jax.stages.Compiled`` that runs (its ``cost_analysis()``
    and ``as_text()`` describe the very program timed).
    """

    def __init__(
        self, compiled: jax.stages.Compiled, state: PyTree, batch: PyTree, donated: bool = False
    ) -> None:
        import jax

        self.compiled, self.state, self.batch = compiled, state, batch
        self.donated, self._boxes = donated, jax.tree.structure(state)

    def run(self, n: int = 1) -> list[float]:
        """Seconds of each of ``n`` steps (a donated state: each from the last's new state;
        else each from the same state)."""
        return [t.wall_s for t in self.run_timed(n)]

    def _take(self, out: PyTree) -> None:
        """A donated step's new state as the next step's: its arrays, in the state's boxes
        (a step may return them unboxed)."""
        import jax

        if self.donated:
            self.state = jax.tree.unflatten(self._boxes, jax.tree.leaves(out))

    def run_timed(self, n: int = 1) -> list[StepTime]:
        """Wall and CPU seconds of each of ``n`` steps (:class:`StepTime`); the new state is
        taken up outside the time."""
        import jax

        times = []
        for _ in range(n):
            c0, t0 = time.process_time(), time.perf_counter()
            out = jax.block_until_ready(self.compiled(self.state, self.batch))
            times.append(StepTime(time.perf_counter() - t0, time.process_time() - c0))
            self._take(out)
        return times


def prepare_step(
    step_fn: StepFn,
    abstract_state: PyTree,
    example_batch: PyTree,
    mesh_shape: Mapping[str, int],
    rules: LogicalRules,
) -> Prepared:
    """Compiles ``step_fn`` on the first devices as a ``mesh_shape`` mesh, with zero state;
    the state donated where the step returns a new one of its shapes (module docstring)."""
    import jax
    import jax.numpy as jnp

    from meshplan._search.measure.hlo import compile_candidate

    donated = _returns_state(step_fn, abstract_state, example_batch, mesh_shape, rules)
    compiled, shardings, batch_sh = compile_candidate(
        step_fn, abstract_state, example_batch, mesh_shape, rules, donated
    )
    if donated and not _keeps_shardings(compiled):  # its new state could not be fed back
        donated = False
        compiled, shardings, batch_sh = compile_candidate(
            step_fn, abstract_state, example_batch, mesh_shape, rules
        )

    def zeros(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)

    state = jax.jit(lambda: zeros(abstract_state), out_shardings=shardings)()
    batch = jax.jit(lambda: zeros(example_batch), out_shardings=batch_sh)()
    prepared = Prepared(compiled, state, batch, donated)
    prepared.run_timed(1)  # the warm-up
    return prepared


def _returns_state(
    step_fn: StepFn,
    abstract_state: PyTree,
    example_batch: PyTree,
    mesh_shape: Mapping[str, int],
    rules: LogicalRules,
) -> bool:
    """Whether ``step_fn`` returns a tree of the state's structure, shapes and dtypes,
    boxed or not (traced as the candidate compiles it: under its mesh and rules)."""
    import jax

    from meshplan._search.measure.hlo import candidate_shardings
    from meshplan._spmd.boxes import unbox
    from meshplan._spmd.rules import logical_axis_rules

    def shapes(tree: PyTree) -> list[tuple[object, object]]:
        return [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]

    mesh, _, _ = candidate_shardings(mesh_shape, abstract_state, example_batch, rules)
    with jax.set_mesh(mesh), logical_axis_rules(rules):
        out = jax.eval_shape(step_fn, abstract_state, example_batch)
    mine: Any = jax.tree.structure(unbox(out))
    return bool(mine == jax.tree.structure(unbox(abstract_state))) and shapes(out) == shapes(
        abstract_state
    )


def _keeps_shardings(compiled: jax.stages.Compiled) -> bool:
    """Whether ``compiled`` returns each array of its state as that array came in."""
    import jax

    ins = jax.tree.leaves(compiled.input_shardings[0][0])
    outs = jax.tree.leaves(compiled.output_shardings)
    ranks = [len(a.shape) for a in jax.tree.leaves(compiled.out_info)]
    return len(ins) == len(outs) == len(ranks) and all(
        a.is_equivalent_to(b, n) for a, b, n in zip(ins, outs, ranks, strict=True)
    )
