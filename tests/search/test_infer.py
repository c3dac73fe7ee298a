"""infer_names: logical names read from a step's dataflow, on plain JAX and Equinox code."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import optax
import pytest

import meshplan

B, L, E, H, D, M, V = 4, 16, 64, 4, 16, 256, 128


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def names(rules, path):
    """The names the first rule matching ``path`` gives (as name_by_path reads them)."""
    return next(n for p, n in rules if re.fullmatch(p, path))


def grad_step(loss):
    return lambda s, x: jax.grad(loss)(s, x)


def attention(q, k, v):
    scores = jnp.einsum("blhd,bmhd->bhlm", q, k)
    return jnp.einsum("bhlm,bmhd->blhd", jax.nn.softmax(scores, axis=-1), v)


def test_a_fused_qkv_kernel_split_into_heads_is_named_heads():
    state = {"qkv": sds(E, 3 * H * D), "out": sds(H * D, E)}

    def loss(s, x):
        qkv = (x @ s["qkv"]).reshape(B, L, 3, H, D)
        y = attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]).reshape(B, L, H * D)
        return ((x + y @ s["out"]) ** 2).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, L, E))
    assert names(rules, "qkv") == ("embed", "heads")
    assert names(rules, "out") == ("heads", "embed")


def test_a_fused_qkv_kernel_split_heads_first_is_heads_not_grouped_query():
    """Bloom's fused kernel: [heads, 3 x kv], split in three; heads x (3 x kv), not a
    grouped query's kv_heads x group."""
    state = {"qkv": sds(E, H * 3 * D), "out": sds(H * D, E)}

    def loss(s, x):
        q, k, v = jnp.split((x @ s["qkv"]).reshape(B, L, H, 3 * D), 3, axis=-1)
        y = attention(q, k, v).reshape(B, L, H * D)
        return ((x + y @ s["out"]) ** 2).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, L, E))
    assert names(rules, "qkv") == ("embed", "heads")
    assert names(rules, "out") == ("heads", "embed")
    assert "kv_heads" not in rules.names_of()


def test_an_einsum_over_heads_names_heads_and_kv():
    state = {k: sds(E, H, D) for k in ("q", "k", "v")} | {"o": sds(H, D, E)}

    def loss(s, x):
        q, k, v = (jnp.einsum("ble,ehd->blhd", x, s[n]) for n in "qkv")
        return ((x + jnp.einsum("blhd,hde->ble", attention(q, k, v), s["o"])) ** 2).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, L, E))
    assert [names(rules, n) for n in "qkvo"] == [("embed", "heads", "kv")] * 3 + [
        ("heads", "kv", "embed")
    ]


def test_a_transposed_kernel_is_named_through_the_transpose():
    state = {"up": sds(M, E), "down": sds(E, M)}  # stored [out, in], as Equinox and GPT-2 do

    def loss(s, x):
        return ((x + jax.nn.gelu(x @ s["up"].T) @ s["down"].T) ** 2).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, E))
    assert names(rules, "up") == ("mlp", "embed")
    assert names(rules, "down") == ("embed", "mlp")


def test_biases_and_norm_scales_share_their_class_names():
    state = {"scale": sds(E), "up": sds(E, M), "b_up": sds(M), "down": sds(M, E), "b_down": sds(E)}

    def loss(s, x):
        h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True)) * s["scale"]
        return ((x + jax.nn.relu(h @ s["up"] + s["b_up"]) @ s["down"] + s["b_down"]) ** 2).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, E))
    assert names(rules, "b_up") == ("mlp",)
    assert names(rules, "scale") == names(rules, "b_down") == ("embed",)


def test_dimensions_of_size_one_are_unnamed():
    state = {"gain": sds(1, E), "w": sds(E, E)}

    def loss(s, x):
        return ((x * s["gain"]) @ s["w"] + x).sum()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, E))
    assert names(rules, "gain") == (None, "embed")


def test_a_square_kernel_in_the_residual_stream_names_embed_once():
    """BERT's MLM head transform: a name names one dimension of an array
    (name_by_path rejects ('embed', 'embed'))."""
    state = {"w": sds(E, E), "scale": sds(E)}

    def loss(s, x):
        return ((x + x @ s["w"]) * s["scale"]).sum()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, E))
    assert names(rules, "w") == ("embed", None)
    assert meshplan.name_by_path(state, rules)["w"].names == ("embed", None)


def test_a_second_towers_residual_stream_and_mlp_are_embed_and_mlp():
    """CLIP's vision tower, Whisper's encoder: no lookup names their stream; a norm
    reduces it and a weight contracts it."""
    state = {"table": sds(V, E), "up": sds(E, M), "down": sds(M, E), "patch": sds(12, 32)}
    state |= {"v_up": sds(32, 96), "v_down": sds(96, 32), "proj": sds(32, E)}

    def loss(s, batch):
        tokens, pixels = batch
        t = s["table"][tokens]
        t = t + jax.nn.relu(t @ s["up"]) @ s["down"]
        v = pixels @ s["patch"]
        v = v * jax.lax.rsqrt((v * v).mean(-1, keepdims=True))
        v = v + jax.nn.relu(v @ s["v_up"]) @ s["v_down"]
        return (t.mean(1) * (v.mean(1) @ s["proj"])).sum()

    batch = (sds(B, L, dtype=jnp.int32), sds(B, 9, 12))
    rules = meshplan.infer_names(grad_step(loss), state, batch)
    assert names(rules, "v_up") == ("embed", "mlp")
    assert names(rules, "v_down") == ("mlp", "embed")
    assert names(rules, "patch") == ("dim_12", "embed")
    assert names(rules, "up") == ("embed", "mlp")


def test_a_norm_over_the_mlp_hidden_leaves_it_mlp():
    """A norm reduces a residual stream, and may reduce an MLP's hidden too (the suite's
    GELU MLP: Dense, LayerNorm, GELU, Dense)."""
    state = {"up": sds(E, M), "down": sds(M, E)}

    def loss(s, x):
        h = x @ s["up"]
        h = h * jax.lax.rsqrt((h * h).mean(-1, keepdims=True))
        return ((x + jax.nn.gelu(h) @ s["down"]) ** 2).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, E))
    assert names(rules, "up") == ("embed", "mlp")


def test_a_scanned_stack_is_layer_and_a_token_lookup_is_vocab():
    state = {"table": sds(V, E), "up": sds(3, E, M), "down": sds(3, M, E)}

    def loss(s, tokens):
        x = jnp.take(s["table"], tokens, axis=0)

        def layer(x, w):
            return x + jax.nn.relu(x @ w[0]) @ w[1], None

        x, _ = jax.lax.scan(layer, x, (s["up"], s["down"]))
        logits = x @ s["table"].T  # a tied head
        return -(jax.nn.log_softmax(logits) * jax.nn.one_hot(tokens, V)).sum()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, L, dtype=jnp.int32))
    assert names(rules, "table") == ("vocab", "embed")
    assert names(rules, "up") == ("layer", "embed", "mlp")
    assert names(rules, "down") == ("layer", "mlp", "embed")


def test_a_position_table_indexed_by_counted_token_ids_is_not_vocab():
    """RoBERTa's positions: a cumsum of the ids' padding mask, from the token ids alone."""
    state = {"table": sds(V, E), "positions": sds(L + 2, E)}

    def loss(s, tokens):
        mask = (tokens != 1).astype(jnp.int32)
        x = s["table"][tokens] + s["positions"][jnp.cumsum(mask, axis=1) * mask + 1]
        return (x @ s["table"].T).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, L, dtype=jnp.int32))
    assert names(rules, "table") == ("vocab", "embed")
    assert names(rules, "positions") == (f"dim_{L + 2}", "embed")


def test_an_untied_head_under_an_integer_label_loss_is_vocab():
    """optax's integer-label loss picks the logits by the token ids (take_along_axis)."""
    state = {"table": sds(V, E), "head": sds(E, V)}

    def loss(s, tokens):
        logits = jnp.take(s["table"], tokens, axis=0) @ s["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, L, dtype=jnp.int32))
    assert names(rules, "head") == ("embed", "vocab")


def test_grouped_query_attention_names_kv_heads():
    kv_heads = 2
    state = {"q": sds(E, H * D), "kv": sds(E, 2 * kv_heads * D), "o": sds(H * D, E)}

    def loss(s, x):
        q = (x @ s["q"]).reshape(B, L, H, D)
        k, v = jnp.split((x @ s["kv"]).reshape(B, L, 2 * kv_heads, D), 2, axis=2)
        k, v = (jnp.repeat(t, H // kv_heads, axis=2) for t in (k, v))
        y = attention(q, k, v).reshape(B, L, H * D)
        return ((x + y @ s["o"]) ** 2).mean()

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, L, E))
    assert names(rules, "q") == ("embed", "heads")
    assert names(rules, "o") == ("heads", "embed")
    assert names(rules, "kv")[0] == "embed"


def test_calls_of_one_cached_function_do_not_join_their_arrays():
    """JAX caches a jitted helper's jaxpr: its calls on two arrays of one shape share the
    body's variables, and must not make their dimensions one."""
    state = {"a": sds(E, E), "b": sds(E, E)}
    act = jax.jit(lambda t: t * jax.nn.sigmoid(t))

    def loss(s, x):
        h = act(x @ s["a"])  # h's features: a's output
        return (act(x) @ s["b"] + h.sum()).sum()  # act(x)'s: the input's

    rules = meshplan.infer_names(grad_step(loss), state, sds(B, E))
    a_in, a_out = names(rules, "a")
    assert a_in != a_out
    assert names(rules, "b")[0] == a_in


def test_equinox_modules_are_named_through_their_linear_layers():
    eqx = pytest.importorskip("equinox")

    class Block(eqx.Module):
        norm: eqx.nn.LayerNorm
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.norm = eqx.nn.LayerNorm(E)
            self.qkv = eqx.nn.Linear(E, 3 * H * D, key=k[0])
            self.out = eqx.nn.Linear(H * D, E, key=k[1])
            self.up = eqx.nn.Linear(E, M, key=k[2])
            self.down = eqx.nn.Linear(M, E, key=k[3])

        def __call__(self, x):  # x: [length, embed], vmapped over the batch
            q, k, v = jnp.split(jax.vmap(self.qkv)(jax.vmap(self.norm)(x)), 3, axis=-1)
            q, k, v = (t.reshape(L, H, D) for t in (q, k, v))
            scores = jnp.einsum("lhd,mhd->hlm", q, k)
            y = jnp.einsum("hlm,mhd->lhd", jax.nn.softmax(scores, -1), v).reshape(L, H * D)
            x = x + jax.vmap(self.out)(y)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(x)))

    model = jax.eval_shape(Block, jax.random.key(0))

    def step(model, x):
        return jax.grad(lambda m: (jax.vmap(m)(x) ** 2).mean())(model)

    rules = meshplan.infer_names(step, model, sds(B, L, E))
    assert names(rules, "qkv/weight") == ("heads", "embed")  # Linear's weight: [out, in]
    assert names(rules, "qkv/bias") == ("heads",)
    assert names(rules, "out/weight") == ("embed", "heads")
    assert names(rules, "up/weight") == ("mlp", "embed")
    assert names(rules, "norm/weight") == names(rules, "down/bias") == ("embed",)
    named = meshplan.name_by_path(model, rules)
    assert named.up.weight.names == ("mlp", "embed")


def test_an_equinox_embedding_under_vmap_is_vocab_and_embed():
    """``eqx.nn.Embedding`` indexes ``weight[x]`` per token: under ``jax.vmap`` a gather of
    ``(1, features)`` slices whose row dimension is kept, of size 1, not collapsed (its rows
    were named ``dim_<vocab>`` then, and the head's ``vocab`` alone)."""
    eqx = pytest.importorskip("equinox")

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        head: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key)
            self.embed = eqx.nn.Embedding(V, E, key=k[0])
            self.head = eqx.nn.Linear(E, V, key=k[1])

        def __call__(self, ids):  # ids: [length], vmapped over the batch
            return jax.vmap(self.head)(jnp.tanh(jax.vmap(self.embed)(ids)))

    model = jax.eval_shape(Model, jax.random.key(0))

    def step(model, ids):
        loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(  # noqa: E731
            jax.vmap(m)(ids), ids
        ).mean()
        return jax.grad(loss)(model)

    rules = meshplan.infer_names(step, model, sds(B, L, dtype=jnp.int32))
    assert names(rules, "embed/weight") == ("vocab", "embed")
    assert names(rules, "head/weight") == ("vocab", "embed")


def test_rules_match_the_optimizer_copies_and_write_layer_indices_as_patterns():
    from flax.training import train_state

    params = {"layers": [{"up": sds(E, M), "down": sds(M, E)} for _ in range(3)]}
    state = jax.eval_shape(
        lambda p: train_state.TrainState.create(apply_fn=None, params=p, tx=optax.adam(1e-3)),
        params,
    )

    def step(state, x):
        def loss(p):
            h = x
            for layer in p["layers"]:
                h = h + jax.nn.relu(h @ layer["up"]) @ layer["down"]
            return (h**2).mean()

        return state.apply_gradients(grads=jax.grad(loss)(state.params))

    rules = meshplan.infer_names(step, state, sds(B, E))
    assert (r"(?:.*/)?layers/\d+/up", ("embed", "mlp")) in list(rules)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every array matched: no UnnamedLeavesWarning
        named = meshplan.name_by_path(state, rules)
    assert named.opt_state[0].mu["layers"][2]["down"].names == ("mlp", "embed")
    assert named.step.shape == ()  # the step count: left alone (a None rule)


def test_text_lists_each_name_with_its_size_and_role():
    state = {"table": sds(V, E), "up": sds(E, M), "down": sds(M, E)}

    def loss(s, tokens):
        x = s["table"][tokens]
        return ((x + jax.nn.relu(x @ s["up"]) @ s["down"]) ** 2).mean()

    inferred = meshplan.infer_names(grad_step(loss), state, sds(B, L, dtype=jnp.int32))
    classes = {c.name: c for c in inferred.classes}
    assert (classes["mlp"].size, classes["vocab"].size, classes["embed"].arrays) == (M, V, 3)
    text = inferred.text()
    assert re.search(r"vocab\s+128\s+vocabulary", text)
    assert re.search(r"mlp\s+256\s+MLP hidden", text)


def test_search_rules_names_an_unnamed_model_and_returns_its_path_rules():
    state = {"up": sds(1024, 4096), "down": sds(4096, 1024)}

    def step(s, x):
        return jax.grad(lambda s: ((x + jax.nn.relu(x @ s["up"]) @ s["down"]) ** 2).mean())(s)

    result = meshplan.search_rules(8, state, step, sds(64, 1024), profile="h100", compile_top=0)
    assert list(result.path_rules) == [("down", ("mlp", "embed")), ("up", ("embed", "mlp"))]
    assert {n for n, _ in result.best.rules} >= {"embed", "mlp", "batch"}
    named = meshplan.search_rules(  # the names passed back: the step reads plain arrays
        8,
        meshplan.name_by_path(state, result.path_rules),
        lambda s, x: step(meshplan.unbox(s), x),
        sds(64, 1024),
        profile="h100",
        compile_top=0,
    )
    assert named.path_rules is None
    assert named.best.cost.step_s == result.best.cost.step_s


def test_flax_nnx_states_are_named_by_their_variables_paths():
    from flax import nnx

    class Mlp(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(E, M, rngs=rngs)
            self.down = nnx.Linear(M, E, rngs=rngs)

        def __call__(self, x):
            return x + self.down(jax.nn.relu(self.up(x)))

    graphdef, state = nnx.split(nnx.eval_shape(lambda: Mlp(nnx.Rngs(0))))

    def step(state, x):
        return jax.grad(lambda s: (nnx.merge(graphdef, s)(x) ** 2).mean())(state)

    rules = meshplan.infer_names(step, state, sds(B, E))
    assert list(rules) == [
        ("down/bias", ("embed",)),
        ("down/kernel", ("mlp", "embed")),
        ("up/bias", ("mlp",)),
        ("up/kernel", ("embed", "mlp")),
    ]
    named = meshplan.name_by_path(state, rules)
    plan = meshplan.explain(named, {"data": 2, "model": 4}, meshplan.layouts.fsdp_tp)
    assert not [p for p in plan.problems if p.severity == "error"]


_SAME_SIZES = """
import jax, jax.numpy as jnp, meshplan
state = {"w": jax.ShapeDtypeStruct((48, 48), jnp.float32),
         "v": jax.ShapeDtypeStruct((48, 48, 48), jnp.float32)}
def step(s, x):
    return jax.grad(lambda p: jnp.tanh(x @ p["w"]).sum() + (p["v"] ** 2).sum())(s)
print(list(meshplan.infer_names(step, state, jax.ShapeDtypeStruct((8, 48), jnp.float32))))
"""


@pytest.mark.slow
def test_the_names_of_same_sized_classes_do_not_change_from_one_process_to_the_next():
    # An array's unnamed classes of one size are numbered in the order of its dimensions
    # (they followed a set's order, which Python's hash seed changes).
    import os
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    found = set()
    for seed in "123456":  # the old order matched this one in about a third of processes
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": src}
        run = subprocess.run(
            [sys.executable, "-c", _SAME_SIZES], env=env, capture_output=True, text=True
        )
        found.add(run.stdout.strip().splitlines()[-1])
    assert found == {"[('v', ('dim_48_0', 'dim_48_1', 'dim_48_2')), ('w', ('embed', 'dim_48_3'))]"}
