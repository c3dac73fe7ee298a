"""The collectives of activations a constraint shards over ``tensor`` (Megatron's sequence
parallelism), predicted against the HLO XLA compiles on 8 CPU devices."""

import re

import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan._search.measure.hlo import compile_candidate, measure_step
from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import get_profile
from meshplan._search.predict.trace import trace_workload
from meshplan.models.llama import LlamaConfig, llama_step

MESH = {"data": 2, "tensor": 4}
RULES = (
    ("batch", "data"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("activation_embed", "tensor"),
    ("embed", None),
    ("kv", None),
    ("length", None),
    ("layer", None),
)


def _result_count(hlo: str, kind: str, shape: str) -> int:
    """How many ``shape`` results the ``kind`` instructions of ``hlo`` give (tuples too)."""
    found = re.findall(rf"= (\(.*?\)|\S+) {kind}(?:-start)?\(", hlo)
    return sum(t.count(shape) for t in found)


@pytest.mark.slow
def test_partial_sums_into_a_tensor_sharded_activation_are_reduce_scattered():
    cfg = LlamaConfig(layers=2, scan=False, dtype="float32")  # no loop: each layer's own ops
    state, step, tokens = llama_step(cfg, batch=8, seq=64)
    work = trace_workload(step, state, tokens, read_constraints=True)
    cost = predict(work, MESH, RULES, get_profile("tpu_v5p"))
    compiled, _, _ = compile_candidate(step, state, tokens, MESH, RULES)
    hlo = compiled.as_text()
    # the unreduced partial sums f32[batch/data, length, embed] per device: XLA on CPU
    # all-reduces them and slices its shard (TPU and GPU reduce-scatter the same operand)
    partial = 4 * 64 * 256 * 4
    reduced = _result_count(hlo, "all-reduce", "f32[4,64,256]")
    assert reduced == 15  # per layer 2 forward, 5 backward; the head's input gradient
    assert cost.comm_bytes["reduce-scatter"] == reduced * partial
    # the other all-reduces: the weight gradients' over 'data', and over 'tensor' the
    # partial results of the norms' statistics over the split activation_embed (5 forward,
    # 5 backward) and of the softmax's over the split vocab (its max and sum, and the log-
    # softmax's backward sum of the one-hot targets' cotangent), as compiled. The planner
    # prices the first two of the softmax's: it leaves the one-hot targets unsplit (XLA
    # splits them by vocab as the log-probabilities they multiply), so that sum is whole.
    # (It priced three while it counted the loss's own sum over vocab, dead code XLA drops.)
    stats = [_result_count(hlo, "all-reduce", f"f32[4,{n}]{{") for n in (64, 63)]
    assert stats == [10, 3]
    assert cost.comm_bytes["all-reduce"] - cost.comm_by_axis["data"] == 10 * 1024 + 2 * 1008
    # the activation's shard gathered before the matmuls that need it whole
    shard = partial // MESH["tensor"]
    gathered = _result_count(hlo, "all-gather", "f32[4,64,256]") * shard
    # the embedding's gradient, scattered split as the activations are (on 'embed'), then
    # moved to the table's split (on 'vocab'): an all-to-all
    assert cost.comm_bytes["all-to-all"] == 512 * 256 * 4 // MESH["tensor"]
    assert "all-to-all(" in hlo
    predicted = cost.comm_by_axis["tensor"] - cost.comm_bytes["reduce-scatter"]
    predicted -= cost.comm_bytes["all-to-all"] + 10 * 1024 + 2 * 1008  # and the statistics'
    assert predicted == cost.comm_bytes["all-gather"]
    assert abs(predicted / gathered - 1) < 0.15


def test_an_activation_sharded_on_its_contracting_dimension_is_gathered_not_scattered():
    # x[batch, embed/tensor] @ w[embed, heads/tensor], heads narrower than embed: XLA
    # gathers x (once, for every matmul that reads it); partial sums over embed would need
    # every head's weights on each device
    x = jax.ShapeDtypeStruct((64, 512), jnp.float32)
    w = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((512, 128), jnp.float32), ("embed", "heads")
    )

    def step(state, x):
        x = meshplan.with_logical_constraint(x, ("batch", "activation_embed"))
        return (x @ state["w"].value).sum()

    work = trace_workload(step, {"w": w}, x, read_constraints=True)
    rules = (("activation_embed", "tensor"), ("heads", "tensor"))
    cost = predict(work, {"tensor": 4}, rules, get_profile("tpu_v5p"))
    assert cost.comm_bytes == {"all-gather": 64 * 512 * 4 // 4}
    compiled = measure_step(step, {"w": w}, x, {"tensor": 4}, rules)["collectives"]
    assert compiled["all-gather"] == cost.comm_bytes["all-gather"]
    assert "reduce-scatter" not in compiled
