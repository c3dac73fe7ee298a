"""``meshplan.search_rules``: candidates and pruning, the cost model against compiled HLO,
profiles, a 16,384-device analytic search, the train command."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

import meshplan
import meshplan.layouts
import unnamed_models as um
from meshplan._search.measure.hlo import measure_step
from meshplan._search.predict.cost import Cost, predict
from meshplan._search.predict.profiles import PROFILES, calibrate_cpu, get_profile
from meshplan._search.predict.trace import trace_workload
from meshplan._search.search.candidates import generate, mesh_factorizations
from meshplan._search.search.result import SearchRow
from meshplan._search.search.rule_search import TIE, _rank
from meshplan.models.mlp import LogicalMLP, init_fn
from meshplan.models.transformer import Transformer, config_from_name, loss_fn
from meshplan.train.settings import TrainSettings
from meshplan.train.state import abstract_train_state


@functools.cache
def mlp_case(depth: int = 256, batch: int = 64):
    model = LogicalMLP(num_layers=2, depth=depth, use_scan=True)
    x = jax.ShapeDtypeStruct((batch, depth), jnp.float32)
    init = functools.partial(init_fn, model=model, optimizer=optax.adam(1e-3))
    state = jax.eval_shape(init, jax.random.key(0), x)

    def step(state, x):
        grads = jax.grad(lambda p: (state.apply_fn({"params": p}, x) ** 2).sum())(state.params)
        return state.apply_gradients(grads=grads)

    return state, step, x


@functools.cache
def tiny_case():
    model = Transformer(config_from_name("tiny"))
    state = abstract_train_state(model, optax.adam(1e-3), TrainSettings(batch=32, seq_len=128))
    tokens = jax.ShapeDtypeStruct((32, 129), jnp.int32)

    def step(state, tokens):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    return state, step, tokens


def test_mesh_factorizations_and_generated_rules():
    assert mesh_factorizations(12, 2) == [(12,), (2, 6), (3, 4), (4, 3), (6, 2)]
    cands = list(generate(8, ["embed", "mlp"], other_names=["length"]))
    meshes = {tuple(c.mesh.items()) for c in cands}
    assert (("data", 2), ("fsdp", 2), ("tensor", 2)) in meshes
    for c in cands:
        rules = dict(c.rules)
        assert c.rules[0][0] == "batch" and rules["length"] is None
        assert all(
            a in c.mesh
            for axes in rules.values()
            if axes
            for a in (axes if isinstance(axes, tuple) else (axes,))
        )
        assert "tensor" not in (rules["batch"] or ())


@pytest.mark.slow
def test_candidates_are_counted_and_pruned_with_reasons():
    state, step, tokens = tiny_case()
    result = meshplan.search_rules(8, state, step, tokens, profile="h100", compile_top=0)
    counts = result.counts
    pruned = counts["pruned"]
    assert counts["enumerated"] == counts["scored"] + sum(pruned.values()) - pruned["memory"]
    assert pruned["invalid"] > 0 and pruned["symmetric"] > 0 and pruned["idle"] > 0
    prunes = [r for r in result.rows if r.status == "pruned"]
    assert {"invalid", "idle"} <= {r.pruned_by for r in prunes}  # the kind, as a record
    assert all(r.reason.startswith(f"{r.pruned_by}: ") for r in prunes)  # the text from it
    assert all(r.pruned_by is None for r in result.ok)
    bad = next(r for r in result.rows if r.layout == "tensor_parallel" and r.mesh_text == "1x8")
    assert bad.status == "pruned" and "('heads') of size 4 does not divide by 8" in bad.reason
    # The built-ins are among the candidates; ranks are 1..n by predicted time.
    ok = result.ok
    assert [r.rank for r in ok] == list(range(1, len(ok) + 1))
    times = [r.predicted_s for r in ok]
    # Ranked by predicted time; predictions within TIE (3%) of each other are ties, broken
    # by a fixed order (so that two runs rank alike).
    assert all(a <= b * (1 + TIE) for a, b in itertools.pairwise(times))
    assert {r.layout for r in ok} >= {"data_parallel", "fsdp"}


@pytest.mark.slow
def test_a_memory_budget_prunes_and_a_batch_that_does_not_divide_is_pruned():
    state, step, tokens = tiny_case()
    result = meshplan.search_rules(
        8, state, step, tokens, profile="h100", compile_top=0, memory_budget_bytes=8 << 20
    )
    assert result.counts["pruned"]["memory"] > 0
    assert all(r.cost.memory_bytes <= 8 << 20 for r in result.ok)
    odd = jax.ShapeDtypeStruct((4, 129), jnp.int32)  # 4 sequences cannot split 8 ways
    result = meshplan.search_rules(8, state, step, odd, profile="h100", compile_top=0)
    row = next(r for r in result.rows if r.layout == "data_parallel")
    assert row.reason.startswith("batch: dim 0 ('batch') of size 4 does not divide by 8")


CASES = [
    ("mlp", "data_parallel"),
    ("mlp", "fsdp"),
    ("mlp", "guide"),
    ("tiny", "data_parallel"),
    ("tiny", "fsdp"),
    ("tiny", "tensor_parallel"),
    ("tiny", "fsdp_tp"),
]


@pytest.mark.parametrize(("model", "layout"), CASES)
@pytest.mark.slow
def test_predicted_collective_bytes_are_within_10_percent_of_the_compiled_hlo(model, layout):
    state, step, batch = mlp_case() if model == "mlp" else tiny_case()
    mesh, rules = {"data": 2, "model": 4}, meshplan.layouts.get_layout(layout)
    # XLA on CPU keeps a gathered weight for the backward pass (``regather=False``); the
    # h100 profile gathers it again, as GPUs do.
    cpu_like = dataclasses.replace(get_profile("h100"), regather=False)
    cost = predict(trace_workload(step, state, batch), mesh, rules, cpu_like)
    hlo = measure_step(step, state, batch, mesh, rules)
    predicted = sum(cost.comm_bytes.values())
    assert abs(predicted - hlo["collective_bytes"]) <= 0.1 * hlo["collective_bytes"]
    # All-reduces (gradients, tensor-parallel activations) to within 1%.
    exact = hlo["collectives"].get("all-reduce", 0)
    assert abs(cost.comm_bytes.get("all-reduce", 0) - exact) <= 0.01 * exact


def test_profiles_are_data_and_cpu_is_measured():
    for name, profile in PROFILES.items():
        assert profile.name == name and profile.source
        assert profile.fast_bandwidth >= profile.slow_bandwidth > 0
    h200 = get_profile("h200")
    assert h200.memory_bytes == 141 * 10**9 and h200.peak_flops == 989.4e12
    assert h200.axis_bandwidth({"data": 2, "tensor": 8}, "data") == 50e9  # crosses hosts
    cpu = calibrate_cpu(8)
    assert cpu is get_profile("cpu", 8)  # measured once per process
    assert cpu.peak_flops > 1e8 and cpu.memory_bandwidth > 1e7 and cpu.latency_s > 0
    with pytest.raises(meshplan.ArgumentError, match="Unknown hardware profile 'a1000'"):
        get_profile("a1000")


class Wide(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
        h = nn.Dense(4096, kernel_init=init, use_bias=False)(x)
        init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
        return nn.Dense(1024, kernel_init=init, use_bias=False)(nn.relu(h))


@pytest.mark.slow
def test_a_16384_device_search_of_a_linen_model_is_analytic():
    x = jax.ShapeDtypeStruct((16384 * 4, 1024), jnp.bfloat16)
    result = meshplan.search_rules(16384, model=Wide(), example_batch=x, profile="tpu_v5e")
    assert result.counts["compiled"] == 0 and result.counts["scored"] > 0
    best = result.best
    assert best is not None and best.predicted_s > 0
    data = json.loads(json.dumps(result.to_dict()))
    row = data["best"]
    assert row["mesh_shape"] == list(best.mesh.values()) and row["axis_names"] == list(best.mesh)
    assert row["rules"][0][0] == "batch" and row["predicted_step_s"] == best.predicted_s


def test_the_top_choice_is_written_only_when_asked(tmp_path):
    state, step, x = mlp_case()
    result = meshplan.search_rules(8, state, step, x, profile="cpu", compile_top=1)
    assert result.counts["compiled"] == 1 and result.best.compiled is not None
    path = tmp_path / "rules.json"
    assert not path.exists()  # the search writes nothing unless asked
    result.best.write_rules(str(path))
    rules = meshplan.layouts.get_layout(str(path))
    assert next(iter(rules))[0] == "batch"
    assert "best:" in str(result) and "enumerated" in str(result)


@pytest.mark.slow
def test_measure_runs_the_top_few_and_ranks_them_by_measured_time():
    state, step, x = mlp_case(depth=128, batch=32)
    result = meshplan.search_rules(
        8,
        state,
        step,
        x,
        profile="cpu",
        compile_top=0,
        measure=True,
        measure_top=2,
        measure_steps=2,
    )
    first, second = result.ok[:2]
    assert result.counts["measured"] == 2
    assert 0 < first.measured_s <= second.measured_s


def test_search_rules_needs_a_step_or_a_model():
    with pytest.raises(meshplan.ArgumentError, match="abstract_state, step_fn, example_batch") as e:
        meshplan.search_rules(8)
    assert [(p.code, p.path) for p in e.value.problems] == [("missing-argument", "step_fn")]
    with pytest.raises(meshplan.ArgumentError, match="needs example_batch=") as e:
        meshplan.search_rules(8, model=object())
    assert [(p.code, p.path) for p in e.value.problems] == [("missing-argument", "example_batch")]


@pytest.mark.slow
def test_a_timed_step_is_the_program_traced_under_the_candidates_rules():
    # Called outside the mesh and rules it was traced under, a jitted step is traced again
    # without them: the timing would measure another program (it did, up to 10x slower).
    from meshplan._search.measure.timing import prepare_step
    from meshplan._spmd.rules import get_logical_axis_rules

    state, step, x = mlp_case(depth=128, batch=32)
    seen = []

    def counted(state, x):
        seen.append(tuple(get_logical_axis_rules()))
        return step(state, x)

    rules = (("batch", "data"), ("hidden", "model"))
    prepared = prepare_step(counted, state, x, {"data": 2, "model": 4}, rules)
    traced = len(seen)  # its output's shapes, then the program compiled
    assert len(prepared.run(3)) == 3
    assert traced == len(seen) and set(seen) == {rules}  # under the candidate's rules only
    assert prepared.donated  # it returns the new state: run as a training loop runs it
    text = prepared.compiled.as_text()
    assert "all-reduce" in text  # the program timed is the sharded one


def test_a_scanned_carry_takes_the_names_its_body_gives_it():
    # The first layer's input comes from the batch ('batch', None); the body returns it
    # as ('batch', 'embed'). XLA gives the carry one sharding, so every matmul of the
    # scanned body is priced with 'embed' split, not replicated.
    state, step, x = mlp_case()
    work = trace_workload(step, state, x)
    carried = [  # x @ W1: the layer input against W1's 'embed'
        d.lhs_names
        for d in work.dots
        if d.rhs_names == ("embed", "hidden") and d.contract == ((1,), (0,))
    ]
    assert carried and all(names == ("batch", "embed") for names in carried)
    cost = predict(work, {"tensor": 8}, (("embed", "tensor"),), get_profile("h100"))
    assert cost.flops_per_device == pytest.approx(work.flops / 8)


@pytest.mark.slow
def test_a_learned_position_table_the_length_of_the_sequence_searches():
    model = Transformer(config_from_name("tiny", positions="learned", max_len=16))
    state = abstract_train_state(model, optax.adam(1e-3), TrainSettings(batch=8, seq_len=16))

    def step(state, tokens):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    tokens = jax.ShapeDtypeStruct((8, 17), jnp.int32)
    work = trace_workload(step, state, tokens)
    for dot in work.dots:  # q·kᵀ gives ('batch', 'heads', 'length', 'length'): one is dropped
        for names in (dot.lhs_names, dot.rhs_names):
            named = [n for n in names if n is not None]
            assert len(named) == len(set(named))
    result = meshplan.search_rules(8, workload=work, profile="h100", compile_top=0)
    assert result.best is not None
    first = result.best.mesh_text, result.best.rules
    again = meshplan.search_rules(8, workload=work, profile="h100", compile_top=0).best
    assert (again.mesh_text, again.rules) == first


@pytest.mark.slow
def test_a_search_prunes_and_prices_candidates_as_it_does_each_alone():
    """The search's shared checks, resolutions and matmul costs give every candidate the
    answer it gets alone: the same reason to prune it, the same prediction."""
    from meshplan._search.predict.cost import _Specs, predict_specs
    from meshplan._search.search.candidates import layout_candidates
    from meshplan._search.search.rule_search import _Checks, _prune

    state, step, tokens = tiny_case()
    work = trace_workload(step, state, tokens)
    prof = get_profile("tpu_v5e", 64)
    names = [n for n in work.param_names if n != "layer"]
    layouts = {n: meshplan.layouts.get_layout(n) for n in ("fsdp", "tensor_parallel")}
    cands = layout_candidates(64, layouts)
    cands += list(generate(64, names, other_names=[n for n in work.names if n not in names]))
    leaves = list(dict.fromkeys((n, s) for n, s, _ in work.state if n is not None))
    checks, cache, resolved = _Checks(), {}, {}
    reasons, priced = set(), 0
    for c in cands[::3]:  # a third of them: a few seconds
        alone = _prune(c, work.batch, ("batch",), leaves, ())
        specs = _Specs(c.mesh, c.rules, resolved)
        shared = _prune(c, work.batch, ("batch",), leaves, (), specs, checks)
        assert shared == alone, (c.mesh, c.rules)
        reasons.add(alone[0] if alone is not None else "ok")
        if alone is None:
            assert predict_specs(work, specs, prof, cache) == predict(work, c.mesh, c.rules, prof)
            priced += 1
    assert {"ok", "invalid", "batch"} <= reasons and priced > 10
    assert len(cache) < priced * len(work.dots)  # matmuls with the same splits priced once
    assert len(resolved) < len(cands[::3]) * len(leaves)  # arrays resolved once per rules


@pytest.mark.slow
def test_a_rules_record_answers_as_each_generated_candidate_alone():
    """A generated candidate's checks through its rules' record (found once per rules): the
    same reason to prune it and the same symmetry signature as found for it alone."""
    from meshplan._search.predict.cost import _Specs
    from meshplan._search.predict.role_names import CONTEXT_NAMES
    from meshplan._search.search.rule_record import RuleRecord, signature_key
    from meshplan._search.search.rule_search import _Checks, _prune, _signature

    state, step, tokens = tiny_case()
    work = trace_workload(step, state, tokens, read_constraints=True)
    names = [n for n in work.param_names if n != "layer"]
    cands = list(generate(64, names, other_names=[n for n in work.names if n not in names]))
    leaves = list(dict.fromkeys((n, s) for n, s, _ in work.state if n is not None))
    acts = tuple(n for n in work.names if n in CONTEXT_NAMES or n.startswith("activation_"))
    arrays = [*leaves, (acts, (0,) * len(acts))] if acts else leaves
    checks, resolved, records, places = _Checks(), {}, {}, {}
    reasons = set()
    for c in cands[1::3]:
        record = records.get(c.rules)
        if record is None:
            clean = checks.rules_clean(c.rules) and all(checks.leaf_clean(*a) for a in leaves)
            record = records[c.rules] = RuleRecord(
                c.rules, resolved, leaves, arrays, ("batch",), acts, clean, places
            )
        assert record.applies(c.mesh)
        alone = _prune(c, work.batch, ("batch",), leaves, acts)
        specs = _Specs(c.mesh, c.rules, resolved, True, record.specs, splits=True)
        assert _prune(c, work.batch, ("batch",), leaves, acts, specs, checks, record) == alone
        reasons.add(alone[0] if alone is not None else "ok")
        for hierarchical in (False, True):
            sig = _signature(c, hierarchical, arrays, ("batch",), places)
            assert signature_key(c.mesh, record.place, hierarchical) == sig
    assert {"ok", "invalid", "batch"} <= reasons
    assert len(records) < len(cands[1::3]) / 2  # found once per rules


def test_a_split_of_a_reshaped_dimension_that_does_not_divide_is_pruned_by_name():
    # A projection stored [64, 128] as ('embed', 'heads') and reshaped to 4 heads of 32
    # (as Hugging Face's attention does): its stored 128 divides by 8, its 4 heads do not.
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    state = {"wq": meshplan.LogicallyPartitioned(w, ("embed", "heads"))}

    def step(state, x):
        def loss(p):
            q = (x @ p["wq"]).reshape(x.shape[0], 4, 32)
            return jnp.einsum("bhd,bgd->bhg", q, q).sum()

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    x = jax.ShapeDtypeStruct((16, 64), jnp.float32)
    result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
    pruned = [r for r in result.rows if r.status == "pruned" and "inside the step" in r.reason]
    assert pruned and all(r.pruned_by == "invalid" for r in pruned)
    assert "'heads' has size 4 inside the step" in pruned[0].reason
    assert "does not divide by 8" in pruned[0].reason
    for r in result.ok:  # every layout that passes splits the 4 heads evenly in the step
        assert 4 % _split_in_step(r, "heads") == 0


def _split_in_step(row: SearchRow, name: str, in_step: bool = True) -> int:
    """How many ways ``row`` splits ``name`` in the step's arrays (``in_step``: over its axes
    that do not split the batch, as FSDP's do there), else in the state."""
    rules = dict(row.rules)

    def axes(n: str) -> tuple[str, ...]:
        got = rules.get(n) or ()
        return (got,) if isinstance(got, str) else tuple(got)

    batch = axes("batch") if in_step else ()
    return math.prod(row.mesh[a] for a in axes(name) if a not in batch)


def test_a_split_inside_grouped_key_value_heads_is_pruned_but_not_fsdps():
    # Keys projected [64, 64] as ('embed', 'kv_heads'), reshaped to 2 heads of 32 and
    # repeated to the queries' 4 heads (as Hugging Face's Mistral does): the projection's
    # 64 and the repeated keys' 4 heads divide by 4, the 2 heads do not.
    def box(shape: tuple[int, ...], names: tuple[str, ...]) -> meshplan.LogicallyPartitioned:
        return meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct(shape, jnp.float32), names)

    state = {"wq": box((64, 128), ("embed", "heads")), "wk": box((64, 64), ("embed", "kv_heads"))}

    def step(state, x):
        def loss(p):
            q = (x @ p["wq"]).reshape(16, 8, 4, 32)
            k = jnp.repeat((x @ p["wk"]).reshape(16, 8, 2, 32), 2, axis=2)
            return jnp.einsum("blhd,bmhd->bhlm", q, k).sum()

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    x = jax.ShapeDtypeStruct((16, 8, 64), jnp.float32)
    result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
    why = [r.reason for r in result.rows if r.status == "pruned" and "inside" in r.reason]
    assert any("'kv_heads' has size 2 inside the step" in w for w in why)
    assert all(2 % _split_in_step(r, "kv_heads") == 0 for r in result.ok)
    fsdp = [r for r in result.ok if _split_in_step(r, "kv_heads", False) > 2]
    assert fsdp  # an axis that splits the batch too leaves the heads whole in the step


@pytest.mark.slow
def test_hugging_face_llamas_two_key_value_heads_are_not_split_inside_a_head():
    # Unnamed: the search infers kv_heads from the step; its key projection is 2 heads of 16.
    state, step, tokens = um.hf_llama(64, 4, 128, 2, 512, 16, 32, kv_heads=2)
    result = meshplan.search_rules(8, state, step, tokens, profile="h100", compile_top=0)
    why = [r.reason for r in result.rows if r.status == "pruned" and "inside" in r.reason]
    assert any("'kv_heads' has size 2 inside the step" in w for w in why)
    assert all(2 % _split_in_step(r, "kv_heads") == 0 for r in result.ok)
    assert any(_split_in_step(r, "heads") == 4 for r in result.ok)  # the 4 query heads may


def test_tied_rows_rank_the_smaller_waited_for_group_first():
    def row(tensor: int, step: float) -> SearchRow:  # its all-reduces meet `tensor` devices
        cost = Cost(step, step, 0.0, 0.0, 1e12, {}, {}, 1 << 20, 1 << 20, 1, meeting_devices=tensor)
        mesh = {"data": 8 // tensor, "tensor": tensor}
        return SearchRow(mesh, (("batch", "data"),), "tensor_parallel", cost=cost)

    wide, narrow = row(4, 1.0), row(2, 1.0 + TIE / 2)  # a tie: within TIE
    assert _rank([wide, narrow]) == [narrow, wide]
    apart = row(2, 1.0 + 2 * TIE)  # not a tie: by time
    assert _rank([apart, wide]) == [wide, apart]
