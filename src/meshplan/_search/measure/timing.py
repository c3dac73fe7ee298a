"""Running a step for real under a mesh and rules, to time it (``measure=True``, the benchmark).

The state is made of zeros of the abstract state's shapes, placed as the rules
say (values do not change a step's time); the step is compiled ahead of time
under the candidate's mesh and rules, run once to warm up, then timed.

The compiled executable is what runs, never the jitted function: called
outside the ``jax.set_mesh``/``logical_axis_rules`` context it was traced in,
a jitted step is traced again without the candidate's rules, and its logical
constraints then place the activations differently. That program is not the
candidate's, and it can be ten times slower.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

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

    def __init__(self, compiled: jax.stages.Compiled, state: PyTree, batch: PyTree) -> None:
        self.compiled, self.state, self.batch = compiled, state, batch

    def run(self, n: int = 1) -> list[float]:
        """Seconds of each of ``n`` steps (each from the same state: no state grows)."""
        return [t.wall_s for t in self.run_timed(n)]

    def run_timed(self, n: int = 1) -> list[StepTime]:
        """Wall and CPU seconds of each of ``n`` steps (:class:`StepTime`)."""
        import jax

        times = []
        for _ in range(n):
            c0, t0 = time.process_time(), time.perf_counter()
            jax.block_until_ready(self.compiled(self.state, self.batch))
            times.append(StepTime(time.perf_counter() - t0, time.process_time() - c0))
        return times


def prepare_step(
    step_fn: StepFn,
    abstract_state: PyTree,
    example_batch: PyTree,
    mesh_shape: Mapping[str, int],
    rules: LogicalRules,
) -> Prepared:
    """Compiles ``step_fn`` on the first devices as a ``mesh_shape`` mesh, with zero state."""
    import jax
    import jax.numpy as jnp

    from meshplan._search.measure.hlo import compile_candidate

    compiled, shardings, batch_sh = compile_candidate(
        step_fn, abstract_state, example_batch, mesh_shape, rules
    )

    def zeros(tree: PyTree) -> PyTree:
        return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)

    state = jax.jit(lambda: zeros(abstract_state), out_shardings=shardings)()
    batch = jax.jit(lambda: zeros(example_batch), out_shardings=batch_sh)()
    jax.block_until_ready(compiled(state, batch))
    return Prepared(compiled, state, batch)
