"""Running a step for real under a mesh and rules, to time it (``measure=True``, the benchmark).

The state is made of zeros of the abstract state's shapes, placed as the rules
say (values do not change a step's time); the step is jitted with those
shardings, compiled, run once to warm up, then timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["Prepared", "prepare_step"]


class Prepared:
    """A compiled step with its placed state and batch: :meth:`run` times ``n`` steps."""

    def __init__(self, fn: Any, state: Any, batch: Any) -> None:
        self.fn, self.state, self.batch = fn, state, batch

    def run(self, n: int = 1) -> list[float]:
        """Seconds of each of ``n`` steps (each from the same state: no state grows)."""
        import jax

        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            jax.block_until_ready(self.fn(self.state, self.batch))
            times.append(time.perf_counter() - t0)
        return times


def prepare_step(
    step_fn: Callable[[Any, Any], Any],
    abstract_state: Any,
    example_batch: Any,
    mesh_shape: Mapping[str, int],
    rules: Any,
) -> Prepared:
    """Compiles ``step_fn`` on the first devices as a ``mesh_shape`` mesh, with zero state."""
    import jax
    import jax.numpy as jnp

    from meshplan._search.hlo import candidate_shardings
    from meshplan._spmd.rules import logical_axis_rules

    mesh, shardings, batch_sh = candidate_shardings(
        mesh_shape, abstract_state, example_batch, rules
    )
    with jax.set_mesh(mesh), logical_axis_rules(rules):

        def zeros(tree: Any) -> Any:
            return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), tree)

        state = jax.jit(lambda: zeros(abstract_state), out_shardings=shardings)()
        batch = jax.jit(lambda: zeros(example_batch), out_shardings=batch_sh)()

        def step(state: Any, batch: Any) -> Any:
            return step_fn(state, batch)

        fn = jax.jit(step, in_shardings=(shardings, batch_sh), out_shardings=None)
        jax.block_until_ready(fn(state, batch))
    return Prepared(fn, state, batch)
