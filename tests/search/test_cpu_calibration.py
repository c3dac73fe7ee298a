"""The ``cpu`` calibration's procedure (``_search/measure/cpu.py``): what it times and how it
reads the times. Its stability across processes is measured, not asserted:
``benchmarks/bench_calibration.py``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshplan._search.measure import cpu


def test_the_programs_run_interleaved_after_an_uncounted_warm_up(monkeypatch):
    monkeypatch.setattr(cpu, "_BUDGET_S", 0.0)  # the fewest rounds: no time asked for
    calls: list[str] = []
    done = jnp.zeros(())

    def kernel(name: str):
        return lambda: calls.append(name) or done

    times = cpu._rounds([kernel("a"), kernel("b"), kernel("c")], devices=8)
    assert [len(t) for t in times] == [cpu._ROUNDS] * 3
    assert calls == ["a", "b", "c"] * (cpu._WARMUP + cpu._ROUNDS)
    assert all(s >= 0 for t in times for s in t)


def test_a_kernel_runs_on_its_last_result_in_place_cycling_its_operands():
    run = jax.jit(lambda x: 1.5 - 0.5 * x, donate_argnums=0)  # ones stay ones
    first, second = jnp.ones(4), jnp.ones(4)
    kernel = cpu._Kernel(run, [first, second])
    out = kernel()
    assert first.is_deleted() and kernel.operands == [out, second] and kernel.next == 1
    kernel(), kernel()
    assert second.is_deleted() and kernel.next == 1
    np.testing.assert_array_equal(np.asarray(kernel.operands[0]), np.ones(4))


def test_a_chain_s_extra_cost_is_taken_round_by_round():
    # the second round's chain was slowed (not its single call), the third round's both
    once, many = [1.0, 1.0, 4.0], [8.0, 12.0, 11.0]
    assert cpu._per_extra(once, many, extra=7) == 1.0  # medians apart: (11 - 1) / 7
    assert cpu._median([3.0, 1.0, 100.0]) == 3.0


def test_the_per_array_latency_is_timed_on_one_all_reduce_of_many_arrays():
    """What ``array_latency_s`` measures is what the planner prices with it: one all-reduce
    XLA combined from several (the data parallel gradients' on XLA:CPU)."""
    kernel = cpu._combined(cpu._split(8), cpu._ARRAYS)
    (zeros,) = kernel.operands
    hlo = kernel.run.lower(zeros).compile().as_text()
    reduces = [line for line in hlo.splitlines() if " all-reduce(" in line]
    assert [r.split(" all-reduce(")[0].count("f32[") for r in reduces] == [cpu._ARRAYS]
    out = kernel()
    assert all(float(jnp.abs(x).sum()) == 0.0 for x in out)  # zeros stay zeros


def test_first_touch_is_a_new_output_past_the_mmap_threshold_against_a_reused_one():
    fresh, reused, nbytes = cpu._fresh_and_reused(cpu._split(2))
    assert nbytes > cpu.FRESH_BYTES  # past glibc's largest threshold: new memory each call
    (kept,) = reused.operands
    out, again = fresh(), fresh()  # its operand kept: each call a new output
    assert out.nbytes == again.nbytes == 2 * nbytes
    assert not out.is_deleted() and not again.is_deleted()
    reused()
    assert kept.is_deleted()  # written in place
    np.testing.assert_array_equal(np.asarray(reused.operands[0][:, :4]), np.ones((2, 4)))
