"""The search proposes the context and expert roles where they pay, and says why not elsewhere.

Analytic searches (a published profile, nothing compiled) over small meshes of 2 axes: a
sequence too long for one device's memory without context parallelism, a mixture of many
experts, and the controls (a short sequence, a dense model)."""

from __future__ import annotations

import functools
import typing

import jax
import jax.numpy as jnp
import optax
import pytest

import meshplan
from meshplan._search.predict.cost import Cost, predict
from meshplan._search.predict.profiles import get_profile
from meshplan._search.predict.reshard import reshard_collectives
from meshplan._search.predict.trace import trace_workload
from meshplan._search.search.result import SearchResult, SearchRow
from meshplan._search.search.roles import Term, VerdictKind, role_verdict
from meshplan.models.llama import LlamaConfig, llama_step
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from meshplan.train.settings import TrainSettings
from meshplan.train.state import abstract_train_state

H100 = get_profile("h100")
LLAMA = LlamaConfig(embed=512, heads=8, kv_heads=8, head_dim=64, mlp=2048, layers=4, vocab=1024)


@functools.cache
def _long(seq: int):
    state, step, tokens = llama_step(LLAMA, batch=4, seq=seq)
    return trace_workload(step, state, tokens, read_constraints=True)


@functools.cache
def _moe(experts: int):
    cfg = config_from_name("small", num_experts=experts, top_k=2, dtype="bfloat16", max_len=256)
    model = Transformer(cfg)
    state = abstract_train_state(model, optax.adam(1e-3), TrainSettings(batch=32, seq_len=256))

    def step(state, tokens):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    tokens = jax.ShapeDtypeStruct((32, 257), jnp.int32)
    return trace_workload(step, state, tokens, read_constraints=True)


def _search(work, devices=16, budget=None, max_axes=2):
    return meshplan.search_rules(
        devices,
        workload=work,
        profile="h100",
        attention="flash",  # long sequences: a flash kernel's attention, as they are run
        compile_top=0,
        max_axes=max_axes,
        memory_budget_bytes=budget,
    )


def test_the_trace_reads_length_and_the_experts_names_from_the_models_constraints():
    assert "length" in _long(1024).names
    moe = _moe(16)
    assert {"length", "expert", "expert_batch", "capacity"} <= set(moe.names)
    # the dispatch: tokens move from batch-split to expert-split
    assert any(after[:2] == ("expert", "expert_batch") for _, after, _, _ in moe.reshards)


def test_a_state_with_more_names_than_a_mesh_may_have_axes_is_traced():
    """The trace's mesh has an axis per name, and jax.make_mesh takes 32 at most (CLIP's
    two towers, named by infer_names: 13 names, 40 axes with the layouts' and MaxText's)."""
    names = [f"dim_{i}" for i in range(2, 22)]
    state = {
        n: meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((8, i + 2), jnp.float32), (None, n))
        for i, n in enumerate(names)
    }

    def step(s, x):
        return jax.grad(lambda s: sum((x @ w.value).sum() for w in s.values()))(s)

    work = trace_workload(
        step, state, jax.ShapeDtypeStruct((4, 8), jnp.float32), read_constraints=True
    )
    assert set(names) <= set(work.names)


def test_reading_the_constraints_leaves_the_memory_predicted_as_without_them():
    # A constraint is its input's buffer, and so is a residual a scan passes through it.
    state, step, tokens = llama_step(LLAMA, batch=8, seq=256)
    mesh, rules = {"data": 8}, (("batch", "data"),)
    plain, named = (
        predict(trace_workload(step, state, tokens, read_constraints=r), mesh, rules, H100)
        for r in (False, True)
    )
    assert named.memory_bytes == plain.memory_bytes
    assert named.flops_per_device == plain.flops_per_device


@pytest.mark.slow
def test_a_sequence_too_long_for_a_device_is_given_a_context_axis():
    # 4 sequences of 64k tokens on 16 devices: the batch splits 4 ways at most
    work = _long(65536)
    roomy = role_verdict(_search(work, budget=80 * 2**30), "context")
    assert roomy.proposed  # the fastest, with room to spare
    # On two axes, tensor parallelism with the activations between layers sharded over
    # tensor (activation_embed: Megatron's sequence parallelism) divides them as finely.
    assert roomy.min_memory_with < 1.05 * roomy.min_memory_without
    # On one axis of 16, only a context axis divides the 4 sequences' activations 16 ways:
    # under a budget between the two, it is proposed and the reason is memory.
    one = role_verdict(_search(work, budget=80 * 2**30, max_axes=1), "context")
    assert one.min_memory_with < one.min_memory_without
    budget = (one.min_memory_with + one.min_memory_without) // 2
    v = role_verdict(_search(work, budget=budget, max_axes=1), "context")
    assert v.proposed and v.kind == "memory" and v.without_row is None
    assert v.with_row.cost.memory_bytes <= budget < v.min_memory_without


@pytest.mark.slow
def test_a_short_sequence_is_not_split_by_context_and_the_reason_is_a_figure():
    v = role_verdict(_search(_long(1024)), "context")
    assert not v.proposed
    assert v.without_row is not None and v.with_row is not None
    assert v.with_row.cost.step_s >= v.without_row.cost.step_s * 0.97
    assert v.terms[v.kind] == max(v.terms.values()) > 0  # the term context adds most


@pytest.mark.slow
def test_many_experts_are_split_over_an_expert_axis_with_all_to_alls():
    """64 experts on 32 devices. (On 64, the expert row leaves its 8-device 'tensor' axis
    idle in the expert layers, whose combine XLA then moves onto it, collective-permutes
    priced since session 16 and compiled on 8 devices: 3 a layer; that row no longer pays.)"""
    v = role_verdict(_search(_moe(64), devices=32), "expert")
    assert v.proposed
    assert v.with_row.cost.comm_bytes.get("all-to-all", 0) > 0
    assert v.with_row.cost.step_s < v.without_row.cost.step_s
    assert v.terms[v.kind] == min(v.terms.values()) < 0  # the term the expert axis saves most


def test_a_dense_model_has_no_expert_axis_and_says_so():
    v = role_verdict(_search(_moe(0)), "expert")
    assert (v.proposed, v.kind, v.with_row) == (False, "absent", None)


def _row(mesh, step_s, memory, status="ok"):
    cost = Cost(
        step_s, step_s / 2, step_s / 8, step_s / 4, 1e12, {"all-to-all": 1 << 20}, {}, memory, 0, 1
    )
    return SearchRow(mesh, (("batch", "data"),), status=status, cost=cost)


def test_a_verdict_is_typed_records_read_from_the_rows():
    """The kind is one of :data:`VerdictKind`, the terms are :data:`Term`s, the rows are the
    result's own: no text is read back."""
    with_, without = _row({"data": 2, "expert": 2}, 1.0, 100), _row({"data": 4}, 2.0, 300)
    v = role_verdict(SearchResult([with_, without], 4, budget_bytes=1000), "expert")
    assert v.proposed and (v.with_row, v.without_row) == (with_, without)
    assert v.kind in typing.get_args(VerdictKind) and v.kind in typing.get_args(Term)
    assert tuple(v.terms) == typing.get_args(Term) and v.terms[v.kind] == min(v.terms.values())
    assert (v.min_memory_with, v.min_memory_without) == (100, 300)
    # Nothing without the role is ok (the row without it was pruned): the reason is memory.
    without.status = "pruned"
    v = role_verdict(SearchResult([with_, without], 4, budget_bytes=200), "expert")
    assert (v.kind, v.without_row, v.terms) == ("memory", None, {})
    assert v.to_dict()["without"] is None and v.to_dict()["with"]["memory_bytes"] == 100


@pytest.mark.parametrize(
    ("before", "after", "expected"),
    [
        ([(), ("data", "expert"), ()], [("expert",), ("data",), ()], [("all-to-all", ("expert",))]),
        ([("data",), ()], [("data",), ("tensor",)], []),  # a local slice
        ([("data",), ("tensor",)], [("data",), ()], [("all-gather", ("tensor",))]),
    ],
)
def test_a_reshard_is_an_all_to_all_where_an_axis_changes_dimension(before, after, expected):
    assert reshard_collectives(before, after) == expected
