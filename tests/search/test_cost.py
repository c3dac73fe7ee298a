"""The cost model's collective mechanisms: combining, and what cannot be combined."""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import meshplan
from meshplan._search.predict.cost import predict
from meshplan._search.predict.profiles import BACKENDS, get_profile
from meshplan._search.predict.trace import trace_workload

DEPTH = 12
WIDTH = 64
DATA = (("batch", "data"),)


def _weights(depth: int):
    w = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)
    return {f"w{i}": meshplan.LogicallyPartitioned(w, ("embed", "mlp")) for i in range(depth)}


def _unrolled(state, x):
    def loss(ws):
        h = x
        for i in range(len(ws)):
            h = jnp.tanh(h @ ws[f"w{i}"])
        return (h**2).sum()

    return jax.grad(loss)({k: v.value for k, v in state.items()})


def _scanned(state, x):
    def loss(w):
        def layer(h, wi):
            return jnp.tanh(h @ wi), None

        return (jax.lax.scan(layer, x, w)[0] ** 2).sum()

    return jax.grad(loss)(state["w"].value)


def _batch():
    return jax.ShapeDtypeStruct((16, WIDTH), jnp.float32)


def test_unrolled_layers_gradient_all_reduces_are_combined_into_one():
    work = trace_workload(_unrolled, _weights(DEPTH), _batch())
    one = trace_workload(_unrolled, _weights(1), _batch())
    profile = get_profile("h100")
    deep = predict(work, {"data": 8}, DATA, profile)
    shallow = predict(one, {"data": 8}, DATA, profile)
    assert deep.comm_bytes["all-reduce"] == DEPTH * shallow.comm_bytes["all-reduce"]
    # 12 small gradients, independent of each other: XLA's combiner makes one all-reduce.
    assert deep.collectives == shallow.collectives == 1
    assert deep.comm_total_s < 2 * shallow.comm_total_s  # one latency, not twelve


def test_scanned_layers_all_reduce_once_per_trip():
    stacked = jax.ShapeDtypeStruct((DEPTH, WIDTH, WIDTH), jnp.float32)
    state = {"w": meshplan.LogicallyPartitioned(stacked, ("layer", "embed", "mlp"))}
    work = trace_workload(_scanned, state, _batch())
    cost = predict(work, {"data": 8}, DATA, get_profile("h100"))
    # A loop's trips run one after another: their collectives cannot be combined.
    assert cost.collectives == DEPTH


@pytest.mark.parametrize("profile", ["h100", "tpu_v5e"])
def test_data_parallel_beats_tensor_parallel_for_a_small_unrolled_model(profile):
    work = trace_workload(
        _unrolled, _weights(DEPTH), jax.ShapeDtypeStruct((256, WIDTH), jnp.float32)
    )
    p = get_profile(profile)
    dp = predict(work, {"data": 8}, DATA, p)
    tp = predict(work, {"tensor": 8}, (("mlp", "tensor"),), p)
    assert dp.step_s < tp.step_s, (dp, tp)


def test_a_weight_gradient_gathers_the_activation_not_the_operand_sharded_like_the_weight():
    # dW[embed, mlp] = h[batch, activation_embed/tensor]^T @ g[batch, mlp/tensor]: both free
    # dimensions claim 'tensor'; the gradient is made in the parameter's sharding (mlp over
    # tensor), so h is gathered, not the larger g
    w = meshplan.LogicallyPartitioned(
        jax.ShapeDtypeStruct((256, 1024), jnp.float32), ("embed", "mlp")
    )
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)

    def step(state, x):
        def loss(p):
            h = meshplan.with_logical_constraint(x, ("batch", "activation_embed"))
            y = meshplan.with_logical_constraint(h @ p["w"].value, ("batch", "mlp"))
            return (y * y).sum()

        return jax.grad(loss)(state)

    work = trace_workload(step, {"w": w}, x, read_constraints=True)
    rules = (("activation_embed", "tensor"), ("mlp", "tensor"))
    cost = predict(work, {"tensor": 4}, rules, get_profile("tpu_v5p"))
    # h (64 x 256 floats) gathered: for the forward matmul and again for the gradient's
    assert cost.comm_bytes["all-gather"] == 2 * 64 * 256 * 4 // 4


def test_an_activation_read_by_several_matmuls_is_gathered_once_per_array():
    ws = {
        k: meshplan.LogicallyPartitioned(
            jax.ShapeDtypeStruct((256, 128), jnp.float32), ("embed", "heads")
        )
        for k in ("a", "b")
    }
    x = jax.ShapeDtypeStruct((64, 256), jnp.float32)

    def forward(state, x):
        h = meshplan.with_logical_constraint(x, ("batch", "activation_embed"))
        g = meshplan.with_logical_constraint(jnp.tanh(x), ("batch", "activation_embed"))
        # h read by two matmuls (one gather), g by one: two arrays gathered
        return (
            (h @ state["a"].value).sum()
            + (h @ state["b"].value).sum()
            + (g @ state["a"].value).sum()
        )

    work = trace_workload(forward, ws, x, read_constraints=True)
    rules = (("activation_embed", "tensor"), ("heads", "tensor"))
    cost = predict(work, {"tensor": 4}, rules, get_profile("tpu_v5p"))
    assert cost.comm_bytes["all-gather"] == 2 * 64 * 256 * 4 // 4


def _transformer_step(layers: int = 1):
    """The example Transformer's training step, small: one layer (no loop) by default."""
    import optax

    from meshplan.models.transformer import Transformer, config_from_name, loss_fn
    from meshplan.train.settings import TrainSettings
    from meshplan.train.state import abstract_train_state

    cfg = config_from_name("tiny", num_layers=layers, embed_dim=64, mlp_dim=128, max_len=32)
    model = Transformer(cfg)
    state = abstract_train_state(model, optax.sgd(1e-3), TrainSettings(batch=8, seq_len=16))

    def step(state, tokens):
        return state.apply_gradients(grads=jax.grad(loss_fn)(state.params, tokens, model))

    return step, state, jax.ShapeDtypeStruct((8, 17), jnp.int32)


FSDP = (("batch", "data"), ("embed", "data"))


def test_a_norm_scale_is_gathered_under_fsdp_not_under_data_parallelism():
    step, state, tokens = _transformer_step()
    work = trace_workload(step, state, tokens, read_constraints=True)
    # the layer's two layer norms and the final one read their [embed] scale and bias with
    # the activation
    reads = [(n, s, a) for n, s, _, a, *_ in work.weight_reads]
    assert reads == [(("embed",), (64,), ("batch", "length", "embed"))] * 6
    h100 = get_profile("h100")
    dp = predict(work, {"data": 8}, DATA, h100)
    fsdp = predict(work, {"data": 8}, FSDP, h100)
    without = predict(dataclasses.replace(work, weight_reads=()), {"data": 8}, FSDP, h100)
    assert "all-gather" not in dp.comm_bytes
    # each a shard of an eighth; the backward pass's gathers again on a GPU (regather)
    forward_only = sum(1 for *_, both, _ in work.weight_reads if not both)
    scales = (forward_only + 2 * (6 - forward_only)) * 64 * 4 // 8
    assert fsdp.comm_bytes["all-gather"] - without.comm_bytes["all-gather"] == scales


@pytest.mark.parametrize(
    ("combines_gathers", "collectives"),
    # one combined gather, one combined reduction; each of the 14 arrays gathered on its own
    [(True, 2), (False, 15)],
)
def test_gathers_pay_one_latency_each_where_the_backend_does_not_combine_them(
    combines_gathers, collectives
):
    step, state, tokens = _transformer_step()
    work = trace_workload(step, state, tokens, read_constraints=True)
    cpu = dataclasses.replace(get_profile("cpu"), combines_gathers=combines_gathers)
    assert predict(work, {"data": 8}, FSDP, cpu).collectives == collectives


def test_a_combined_all_reduce_pays_a_latency_per_array_where_xla_cpu_does():
    """XLA:CPU reduces a combined all-reduce's operands one by one (bench_calibration.py
    --arrays): the data-parallel gradients' one all-reduce pays for each array."""
    step, state, tokens = _transformer_step()
    work = trace_workload(step, state, tokens, read_constraints=True)
    cpu = dataclasses.replace(get_profile("h100"), combine_bytes=0, overlap=0.0, hop_latency_s=0.0)
    once = predict(work, {"data": 8}, DATA, cpu)
    each = predict(work, {"data": 8}, DATA, dataclasses.replace(cpu, array_latency_s=3e-5))
    arrays = len(jax.tree.leaves(state.params))  # the matmuls' weights and the norms'
    assert once.collectives == each.collectives == 1  # one all-reduce, as compiled
    assert each.comm_s - once.comm_s == pytest.approx((arrays - 1) * 3e-5)


def test_xla_cpu_combines_every_data_parallel_gradient_into_one_all_reduce():
    from meshplan._search.measure.hlo import compile_candidate

    step, state, tokens = _transformer_step()
    compiled, _, _ = compile_candidate(step, state, tokens, {"data": 8}, DATA)
    reduces = [ln for ln in compiled.as_text().splitlines() if " all-reduce(" in ln]
    assert len(reduces) == 1
    operands = reduces[0].split(" all-reduce(")[0].count("f32[")
    assert operands == len(jax.tree.leaves(state.params)) == 14


@pytest.mark.parametrize(("layers", "rules"), [(1, FSDP), (1, DATA), (2, FSDP), (2, DATA)])
def test_the_cpu_profile_counts_the_collectives_xla_runs_on_the_cpu(layers, rules):
    from meshplan._search.measure.hlo import collective_counts, compile_candidate

    step, state, tokens = _transformer_step(layers)
    work = trace_workload(step, state, tokens, read_constraints=True)
    cpu = get_profile("cpu")
    assert not cpu.combines_gathers  # XLA:CPU runs its all-reduce combiner only
    compiled, _, _ = compile_candidate(step, state, tokens, {"data": 8}, rules)
    runs = collective_counts(compiled.as_text())  # a loop body's once per trip
    gathers = runs["all-gather"]
    reductions = runs["all-reduce"] + runs["reduce-scatter"]
    cost = predict(work, {"data": 8}, rules, cpu)
    assert cost.collectives == gathers + reductions
    # XLA:CPU all-reduces an FSDP gradient's partial sums whole (no reduce-scatter): so does the profile
    assert runs["reduce-scatter"] == 0 and "reduce-scatter" not in cost.comm_bytes


def _norm_over_mlp_step():
    """A projection into ``mlp`` with a norm's statistics over it; logits over ``vocab``
    with their softmax."""
    w = jax.ShapeDtypeStruct((WIDTH, 4 * WIDTH), jnp.float32)
    v = jax.ShapeDtypeStruct((WIDTH, 8 * WIDTH), jnp.float32)
    state = {
        "w": meshplan.LogicallyPartitioned(w, ("embed", "mlp")),
        "v": meshplan.LogicallyPartitioned(v, ("embed", "vocab")),
    }

    def step(state, x):
        def loss(p):
            h = x @ p["w"]
            h = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt((h * h).mean(-1, keepdims=True))
            return jnp.tanh(h).sum() + jax.nn.log_softmax(x @ p["v"]).sum()

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    return step, state, jax.ShapeDtypeStruct((32, WIDTH), jnp.float32)


def test_a_reduction_over_a_split_dimension_is_all_reduced_as_compiled():
    """A norm's statistics over a split ``mlp`` and a softmax's over a split ``vocab``:
    XLA all-reduces each partial result over the axis (forward and backward), priced as
    the compiled HLO's arrays (XLA:CPU pays a latency for each); none where nothing is
    split."""
    from meshplan._search.measure.hlo import compile_candidate

    step, state, x = _norm_over_mlp_step()
    work = trace_workload(step, state, x)
    cpu = get_profile("cpu")
    split = (("mlp", "model"), ("vocab", "model"))
    for rules, mesh in ((split, {"model": 8}), ((("embed", "model"),), {"model": 8})):
        compiled, _, _ = compile_candidate(step, state, x, mesh, rules)
        reduces = [ln for ln in compiled.as_text().splitlines() if " all-reduce(" in ln]
        arrays = sum(ln.split(" all-reduce(")[1].split(")")[0].count("%") for ln in reduces)
        assert predict(work, mesh, rules, cpu).collectives == arrays


def _fused_qkv_step(pieces: int):
    """A fused q/k/v projection over split heads, its output split into ``pieces``."""
    w = jax.ShapeDtypeStruct((WIDTH, 3 * WIDTH), jnp.float32)
    state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "heads"))}

    def step(state, x):
        def loss(p):
            parts = jnp.split(x @ p["w"], pieces, axis=-1)
            return sum(jnp.tanh(q).sum() * (i + 1) for i, q in enumerate(parts))

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    return step, state, jax.ShapeDtypeStruct((32, WIDTH), jnp.float32)


@pytest.mark.parametrize("pieces", [3, 4])
def test_a_split_of_a_split_dimension_moves_its_pieces_as_compiled(pieces):
    """XLA splits each piece of a fused projection over the devices the whole was split
    over, moving parts of it between them (collective-permutes forward, all-to-alls in
    the backward's concatenation): the planner prices a permute per piece and distance,
    within half of the compiled count (3 pieces: 11 compiled, 12 priced), and none where
    nothing splits the heads."""
    from meshplan._search.measure.hlo import collective_counts, compile_candidate

    step, state, x = _fused_qkv_step(pieces)
    work = trace_workload(step, state, x)
    cpu = get_profile("cpu")
    for rules, moved in (((("heads", "model"),), True), (((("embed", "model"),), False))):
        compiled, _, _ = compile_candidate(step, state, x, {"model": 4}, rules)
        runs = collective_counts(compiled.as_text())
        cost = predict(work, {"model": 4}, rules, cpu)
        compiled_moves = runs["collective-permute"] + runs["all-to-all"]
        priced = cost.comm_bytes.get("collective-permute", 0) and cost.collectives
        assert (compiled_moves > 0) == moved == (priced > 0)
        assert 0.5 * compiled_moves <= priced <= 1.5 * compiled_moves


def test_a_shifted_slice_of_a_split_sequence_moves_its_boundary_as_compiled():
    """``h[:, 1:]`` over a split ``length``: each device's new shard reaches into the next
    device's, so XLA moves that part (a collective-permute); the slice's dropped part is
    not priced, and ``h[:, :-1]`` moves nothing (compiled: 2 permutes; priced: 1)."""
    from meshplan._search.measure.hlo import collective_counts, compile_candidate

    w = jax.ShapeDtypeStruct((WIDTH, WIDTH), jnp.float32)
    state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}

    def step(state, x):
        def loss(p):
            x_named = meshplan.with_logical_constraint(x, ("batch", "length", "embed"))
            h = jnp.tanh(x_named @ p["w"])
            return (h[:, 1:] * h[:, :-1]).sum()

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    x = jax.ShapeDtypeStruct((8, 128, WIDTH), jnp.float32)
    rules = (("length", "model"),)
    compiled, _, _ = compile_candidate(step, state, x, {"model": 4}, rules)
    permutes = collective_counts(compiled.as_text())["collective-permute"]
    work = trace_workload(step, state, x, read_constraints=True)
    cost = predict(work, {"model": 4}, rules, get_profile("cpu"))
    priced = cost.collectives - 1  # besides the weight gradient's all-reduce
    assert cost.comm_bytes["collective-permute"] > 0
    assert 0 < priced <= permutes == 2


def _in_and_out_step():
    """A projection in and a head out, each with one named dimension (``embed``)."""
    state = {
        "w_in": meshplan.LogicallyPartitioned(
            jax.ShapeDtypeStruct((32, 128), jnp.float32), (None, "embed")
        ),
        "w_out": meshplan.LogicallyPartitioned(
            jax.ShapeDtypeStruct((128, 16), jnp.float32), ("embed", None)
        ),
    }

    def step(state, x):
        def loss(p):
            x_named = meshplan.with_logical_constraint(x, ("batch", None))
            return (jnp.tanh(x_named @ p["w_in"]) @ p["w_out"]).var()

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    return step, state, jax.ShapeDtypeStruct((64, 32), jnp.float32)


@pytest.mark.parametrize(
    "mesh", [{"data": 2, "model": 4}, {"data": 2, "model": 2, "x": 2}, {"data": 4, "model": 2}]
)
def test_a_gather_beside_idle_mesh_axes_moves_its_pieces_onto_them_as_compiled(mesh):
    """FSDP (``batch`` and ``embed`` on 'data') on a mesh with axes neither operand uses:
    where those have at least as many devices as 'data', XLA moves the gathered operand's
    pieces onto them (collective-permutes) and gathers over them (2 x 4: 3 permutes
    compiled, 4 priced); where they have fewer (4 x 2), it gathers over 'data' (none)."""
    from meshplan._search.measure.hlo import collective_counts, compile_candidate

    step, state, x = _in_and_out_step()
    rules = (("batch", "data"), ("embed", "data"))
    compiled, _, _ = compile_candidate(step, state, x, mesh, rules)
    permutes = collective_counts(compiled.as_text())["collective-permute"]
    work = trace_workload(step, state, x, read_constraints=True)
    cost = predict(work, mesh, rules, get_profile("cpu"))
    priced = cost.comm_bytes.get("collective-permute", 0)
    idle = math.prod(n for a, n in mesh.items() if a != "data")
    assert (permutes > 0) == (priced > 0) == (idle >= mesh["data"])


def _lookup_step():
    """An embedding lookup (``jnp.take``) into a projection."""
    table = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    w = jax.ShapeDtypeStruct((64, 128), jnp.float32)
    state = {
        "table": meshplan.LogicallyPartitioned(table, ("vocab", "embed")),
        "w": meshplan.LogicallyPartitioned(w, ("embed", "mlp")),
    }

    def step(state, tokens):
        def loss(p):
            return jnp.tanh(jnp.take(p["table"], tokens, axis=0) @ p["w"]).var()

        return jax.grad(loss)({k: b.value for k, b in state.items()})

    return step, state, jax.ShapeDtypeStruct((16, 32), jnp.int32)


@pytest.mark.parametrize("mesh", [{"data": 2, "model": 4}, {"data": 4, "model": 2}, {"data": 8}])
def test_a_lookups_indices_are_moved_before_their_gather_as_compiled(mesh):
    """FSDP's table split on ``embed`` over the batch's axis: XLA gathers the indices whole
    to make the rows where the table lies, and permutes them first where the mesh has
    another axis (one ``s32[16 / data, 32, 1]`` permute compiled on 2 x 4 and 4 x 2, one
    priced; none on 8)."""
    from meshplan._search.measure.hlo import collective_counts, compile_candidate

    step, state, tokens = _lookup_step()
    rules = (("batch", "data"), ("embed", "data"), ("vocab", "model"), ("mlp", "model"))
    rules = tuple(r for r in rules if r[1] in mesh)
    compiled, _, _ = compile_candidate(step, state, tokens, mesh, rules)
    permutes = collective_counts(compiled.as_text())["collective-permute"]
    work = trace_workload(step, state, tokens, read_constraints=True)
    priced = predict(work, mesh, rules, get_profile("cpu")).comm_bytes.get("collective-permute")
    assert permutes == (1 if len(mesh) > 1 else 0)
    assert priced == (16 // mesh["data"] * 32 * 4 if len(mesh) > 1 else None)


def test_the_largest_group_a_waited_for_collective_meets_is_counted():
    # Two layers of `(embed, mlp)` weights, `mlp` split over `tensor`: the second reads the
    # first's output over its `embed`, so the step waits for a collective over `tensor`; the
    # weights' gradients are reduced over `data` beside the rest (not counted).
    work = trace_workload(_unrolled, _weights(2), _batch())
    tp = (("batch", "data"), ("mlp", "tensor"))
    profile = get_profile("h100")
    wide = predict(work, {"data": 2, "tensor": 4}, tp, profile)
    narrow = predict(work, {"data": 4, "tensor": 2}, tp, profile)
    data = predict(work, {"data": 8}, DATA, profile)
    assert (wide.meeting_devices, narrow.meeting_devices, data.meeting_devices) == (4, 2, 1)


def test_temporaries_from_the_fresh_threshold_on_pay_their_first_touch_once_a_step():
    # XLA:CPU's temporaries are one buffer a call; from 32 MiB a device on, glibc maps it
    # afresh each call, and the step writes it into new pages (here the threshold scaled
    # down to the small step's temporaries).
    work = trace_workload(_unrolled, _weights(4), _batch())
    h100 = get_profile("h100")
    plain = predict(work, {"data": 8}, DATA, h100)
    temps = plain.activation_bytes + plain.temporary_bytes
    fresh = dataclasses.replace(h100, fresh_bytes=temps, first_touch_s=1e-9)
    paid = predict(work, {"data": 8}, DATA, fresh)
    assert paid.first_touch_s == pytest.approx(temps * 1e-9) and plain.first_touch_s == 0.0
    assert paid.memory_s - plain.memory_s == pytest.approx(paid.first_touch_s)
    assert paid.step_s == pytest.approx(plain.step_s + paid.first_touch_s)
    below = dataclasses.replace(fresh, fresh_bytes=temps + 1)
    assert predict(work, {"data": 8}, DATA, below).first_touch_s == 0.0
    any_size = dataclasses.replace(fresh, fresh_bytes=1)
    micro = predict(work, {"data": 8}, DATA, any_size, microbatches=2)  # once a step
    held = micro.activation_bytes + micro.temporary_bytes + micro.accumulator_bytes
    assert micro.accumulator_bytes and micro.first_touch_s == pytest.approx(held * 1e-9)


class _NormedMlp(nn.Module):
    """Two residual blocks of a norm, a Dense to 256, GELU and a Dense back to 64."""

    norm: type[nn.Module]

    @nn.compact
    def __call__(self, x):
        def dense(features, names):
            init = meshplan.with_logical_partitioning(nn.initializers.lecun_normal(), names)
            return nn.Dense(features, kernel_init=init)

        for _ in range(2):
            x = x + dense(64, ("mlp", "embed"))(
                nn.gelu(dense(256, ("embed", "mlp"))(self.norm()(x)))
            )
        return x.mean(1)


@pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm])
def test_xla_cpus_default_schedule_holds_each_norms_broadcasts_until_the_backward_pass(norm):
    """Flax's norms multiply the ``rsqrt`` ([b, s, 1]) by the scale ([1, 1, d]). XLA:CPU's
    default schedule (every ``jax.jit`` on CPU, and the steps meshplan times) writes both
    out at the activation's shape in the forward pass and holds them until the backward
    reads them: the ``cpu`` backend counts them (``holds_broadcasts``). Against that
    program, donated, on 8 devices (2 x 4 tensor parallel), the planner's memory is 0.94
    (LayerNorm) and 0.87 (RMSNorm) of XLA's with them; without, 0.69 and 0.60."""
    from meshplan._search.measure.hlo import compile_candidate
    from meshplan._search.predict.step import linen_step
    from xla_suite import CPU_LIKE

    x = jax.ShapeDtypeStruct((32, 64, 64), jnp.float32)
    state, step, batch = linen_step(_NormedMlp(norm), x)
    work = trace_workload(step, state, batch, read_constraints=True)
    assert sum(work.held_broadcasts.values()) == 4  # two norms, two broadcasts each
    mesh, rules = {"data": 2, "tensor": 4}, (("batch", "data"), ("mlp", "tensor"))
    compiled, _, _ = compile_candidate(step, state, batch, mesh, rules, donate=True)
    xla = compiled.memory_analysis().temp_size_in_bytes
    held, plain = (
        predict(work, mesh, rules, dataclasses.replace(CPU_LIKE, holds_broadcasts=on))
        for on in (True, False)
    )
    assert held.activation_bytes - plain.activation_bytes == 4 * 16 * 64 * 64 * 4
    assert abs(held.activation_bytes + held.temporary_bytes - xla) <= 0.2 * xla


def test_a_matmul_pays_its_bytes_after_its_flops_where_the_backend_does_not_overlap_them():
    """The ``cpu`` backend's ``matmul_bytes_serial``: the suite's MoE contracts its experts'
    output through an intermediate twice as large under 2x4 as under 4x2, for the same
    FLOPs, and that matmul runs slower there (docs/benchmarks.md, sessions 27 and 28)."""
    from xla_suite import LAYOUTS, suite_step

    state, step, batch = suite_step("moe")
    work = trace_workload(step, state, batch, read_constraints=True)
    rules = LAYOUTS["tp"][1]
    assert BACKENDS["cpu"]["matmul_bytes_serial"] and not get_profile("h100").matmul_bytes_serial
    compute = {}
    for serial in (False, True):  # a CPU's figures (the 2-core machine's calibration)
        cpu = dict(peak_flops=30e9, matmul_efficiency=1.0, memory_bandwidth=10e9)
        profile = dataclasses.replace(get_profile("h100"), **cpu, matmul_bytes_serial=serial)
        for mesh in ({"data": 2, "tensor": 4}, {"data": 4, "tensor": 2}):
            compute[serial, mesh["data"]] = predict(work, mesh, rules, profile).compute_s
    assert compute[True, 2] > compute[False, 2] and compute[True, 4] > compute[False, 4]
    # the 2x4 intermediate's bytes hid behind its FLOPs; added, 2x4 costs more over 4x2
    excess = {s: compute[s, 2] / compute[s, 4] for s in (False, True)}
    assert excess[True] > excess[False] + 0.02, excess
