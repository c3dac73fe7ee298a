"""A matmul by a weight larger than its activation is made where the weight lies.

Under FSDP (``batch`` and ``embed`` on one mesh axis), a plain MLP's hidden layer ``x @ w``
with ``w`` split on its output units is made in ``w``'s split: XLA gathers ``x`` whole
(f32[64,256]) rather than ``w``, and keeps the hidden layer there into the next
projection, whose partial sums it all-reduces (f32[64,512]). The weights' gradients are
then made in their own split, with no all-reduce of their own. Models written with no
meshplan names, named by :func:`meshplan.infer_names`' machinery, as a new user's are.
"""

from __future__ import annotations

import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from meshplan._search.predict.infer import name_unnamed
from meshplan._search.predict.trace import Carried

SIZES = (256, 512, 512, 10)


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _mlp_step(weight_first: bool):
    """A plain-JAX MLP (ReLU) and its SGD step: ``x @ w`` or, as Equinox writes it,
    ``jax.vmap(lambda x: w @ x)`` (the weight on the matmul's left)."""
    sds = jax.ShapeDtypeStruct
    shapes = itertools.pairwise(SIZES)
    params = [
        {"w": sds((b, a) if weight_first else (a, b), jnp.float32), "b": sds((b,), jnp.float32)}
        for a, b in shapes
    ]

    def layer(p, x):
        if weight_first:
            return jax.vmap(lambda row: p["w"] @ row)(x) + p["b"]
        return x @ p["w"] + p["b"]

    def forward(ps, x):
        for i, p in enumerate(ps):
            x = layer(p, x)
            x = jax.nn.relu(x) if i < len(ps) - 1 else x
        return x

    def step(ps, batch):
        grads = jax.grad(lambda q: _xent(forward(q, batch["x"]), batch["y"]))(ps)
        return jax.tree.map(lambda a, g: a - 1e-3 * g, ps, grads)

    batch = {"x": sds((64, SIZES[0]), jnp.float32), "y": sds((64,), jnp.int32)}
    return params, step, batch


@pytest.mark.parametrize("weight_first", [False, True], ids=["x@w", "w@x"])
def test_a_hidden_layer_is_made_in_its_larger_weights_split(weight_first):
    params, step, batch = _mlp_step(weight_first)
    *_, work = name_unnamed(step, params, batch)
    first = next(d for d in work.dots if d.out_names and d not in work.backward_dots)
    assert any(isinstance(n, Carried) and "embed" in n.by for n in first.out_names)


@pytest.mark.slow
@pytest.mark.parametrize("weight_first", [False, True], ids=["x@w", "w@x"])
def test_an_mlps_fsdp_memory_and_collectives_are_xlas(weight_first):
    """0.90 and 0.98 of XLA's temporaries, kinds as compiled (7.90 and 2.23 when the hidden
    layers were split by the batch: every weight gradient all-reduced whole, an all-to-all
    XLA does not make)."""
    from xla_suite import against_xla

    params, step, batch = _mlp_step(weight_first)
    _, named, named_step, work = name_unnamed(step, params, batch)
    ratio, predicted, compiled = against_xla(work, named_step, named, batch, "fsdp")
    assert 0.8 <= ratio <= 1.2, ratio
    assert predicted == compiled


def test_a_weight_smaller_than_its_activation_leaves_the_batch_split():
    """The same MLP at a batch of 4096: ``x`` is larger than every weight, so the layers
    stay split by the batch (the weights gathered, as FSDP is usually drawn)."""
    params, step, _ = _mlp_step(False)
    sds = jax.ShapeDtypeStruct
    batch = {"x": sds((4096, SIZES[0]), jnp.float32), "y": sds((4096,), jnp.int32)}
    *_, work = name_unnamed(step, params, batch)
    assert not any(isinstance(n, Carried) for d in work.dots for n in d.out_names or ())


class _MnistCnn(nn.Module):
    """Flax's own MNIST example's CNN (``examples/mnist/train.py``), 16 classes."""

    @nn.compact
    def __call__(self, x):
        for features in (32, 64):
            x = nn.avg_pool(nn.relu(nn.Conv(features, (3, 3))(x)), (2, 2), strides=(2, 2))
        x = nn.relu(nn.Dense(256)(x.reshape((x.shape[0], -1))))
        return nn.Dense(16)(x)


@pytest.mark.slow
def test_flaxs_mnist_cnn_under_fsdp_is_priced_as_xla_compiles_it():
    """Its flattened features (f32[32,3136]) times a larger weight: the hidden layer is made
    in the weight's split, and so is its cotangent, from the head's backward (no all-to-all
    back to the batch). 0.81 of XLA's temporaries, kinds as compiled (3.37, and an
    all-to-all XLA does not make, before)."""
    from xla_suite import against_xla

    tx = optax.sgd(1e-3)
    sds = jax.ShapeDtypeStruct
    model = _MnistCnn()
    params = jax.eval_shape(lambda k: model.init(k, jnp.zeros((1, 28, 28, 1))), jax.random.key(0))
    state = {"params": params, "opt": jax.eval_shape(tx.init, params)}

    def step(s, b):
        loss = lambda p: _xent(model.apply(p, b["x"]), b["y"])  # noqa: E731
        updates, opt = tx.update(jax.grad(loss)(s["params"]), s["opt"], s["params"])
        return {"params": optax.apply_updates(s["params"], updates), "opt": opt}

    batch = {"x": sds((32, 28, 28, 1), jnp.float32), "y": sds((32,), jnp.int32)}
    _, named, named_step, work = name_unnamed(step, state, batch)
    ratio, predicted, compiled = against_xla(work, named_step, named, batch, "fsdp")
    assert 0.8 <= ratio <= 1.2, ratio
    assert predicted == compiled


class _Lstm(nn.Module):
    """An LSTM over an embedding, mean-pooled into a classifier (Flax's ``nn.RNN`` of the
    ``OptimizedLSTMCell``, whose four gate kernels are concatenated before one matmul)."""

    @nn.compact
    def __call__(self, ids):
        x = nn.RNN(nn.OptimizedLSTMCell(128))(nn.Embed(1000, 128)(ids))
        return nn.Dense(16)(x.mean(1))


def _lstm_step():
    model, sds = _Lstm(), jax.ShapeDtypeStruct
    ids = sds((16, 32), jnp.int32)
    params = jax.eval_shape(
        lambda k: model.init(k, jnp.zeros(ids.shape, ids.dtype)), jax.random.key(0)
    )

    def step(ps, batch):
        loss = lambda q: _xent(model.apply(q, batch["x"]), batch["y"])  # noqa: E731
        return jax.tree.map(lambda a, g: a - 1e-3 * g, ps, jax.grad(loss)(ps))

    return params, step, {"x": ids, "y": sds((16,), jnp.int32)}


def test_an_lstms_rows_cotangent_is_made_in_the_tables_split():
    """Only the input projection reads the lookup's rows, its weight split as the table is:
    its backward gathers the gates' cotangent and makes the rows' there, so no all-to-all
    precedes the scatter into the table's gradient (one was predicted before)."""
    from meshplan._search.predict.cost import predict
    from xla_suite import CPU_LIKE, LAYOUTS

    params, step, batch = _lstm_step()
    *_, work = name_unnamed(step, params, batch)
    cost = predict(work, *LAYOUTS["fsdp"], CPU_LIKE)
    assert not cost.comm_bytes.get("all-to-all"), cost.comm_bytes


@pytest.mark.slow
def test_an_lstms_fsdp_memory_and_collectives_are_xlas():
    from xla_suite import against_xla

    params, step, batch = _lstm_step()
    _, named, named_step, work = name_unnamed(step, params, batch)
    ratio, predicted, compiled = against_xla(work, named_step, named, batch, "fsdp")
    assert 0.8 <= ratio <= 1.2, ratio
    assert predicted == compiled
