"""A step that drops its loss (``jax.grad``, not ``value_and_grad``) is priced as XLA runs it.

XLA eliminates the code whose values nothing reads: the loss itself, and the forward
``take_along_axis`` of optax's integer-label cross-entropy, of which only the transpose
(the ``scatter-add`` into the logits' cotangent) is left. The planner prices the program
without it, and still splits that cotangent by ``vocab`` as XLA does under tensor
parallelism (it was named from the forward gather). Models written with no meshplan names,
named by :func:`meshplan.infer_names`' machinery, as a new user's are.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest

from meshplan._search.predict.infer import name_unnamed
from meshplan._search.predict.jaxpr_facts import live

VOCAB, B, S = 512, 16, 32


class _Lm(nn.Module):
    @nn.compact
    def __call__(self, ids):
        x = nn.Embed(VOCAB, 128)(ids)
        x = x + nn.Dense(128)(nn.gelu(nn.Dense(256)(nn.LayerNorm()(x))))
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def _step(returns_loss: bool):
    model, tx = _Lm(), optax.adamw(1e-3)
    ids = jax.ShapeDtypeStruct((B, S + 1), jnp.int32)
    params = jax.eval_shape(
        lambda k: model.init(k, jnp.zeros((B, S), jnp.int32)), jax.random.key(0)
    )
    state = {"params": params, "opt": jax.eval_shape(tx.init, params)}

    def loss(p, b):
        logits = model.apply(p, b[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[:, 1:]).mean()

    def step(s, b):
        value, grads = jax.value_and_grad(loss)(s["params"], b)
        updates, opt = tx.update(grads, s["opt"], s["params"])
        new = {"params": optax.apply_updates(s["params"], updates), "opt": opt}
        return (new, value) if returns_loss else new

    return state, step, ids


def test_the_loss_a_step_drops_is_not_in_the_program():
    state, step, ids = _step(returns_loss=False)
    traced = jax.make_jaxpr(step)(state, ids)
    count = lambda j, p: str(j).count(f" = {p}[")  # noqa: E731
    assert count(live(traced), "gather") == 1 < count(traced, "gather")  # the lookup's
    assert count(live(traced), "scatter-add") == count(traced, "scatter-add")  # backward
    assert len(live(traced).jaxpr.invars) == len(traced.jaxpr.invars)


@pytest.mark.parametrize("returns_loss", [True, False], ids=["value_and_grad", "grad"])
def test_the_logits_cotangent_is_named_by_vocab_whether_or_not_the_loss_is_kept(returns_loss):
    state, step, ids = _step(returns_loss)
    *_, work = name_unnamed(step, state, ids)
    logits = [names for names, shape, _, _ in work.memory.cells if shape == (B, S, VOCAB)]
    assert logits and all("vocab" in names for names in logits), logits


@pytest.mark.slow
def test_a_dropped_losss_tensor_parallel_memory_and_collectives_are_xlas():
    from xla_suite import against_xla

    state, step, ids = _step(returns_loss=False)
    _, named, named_step, work = name_unnamed(step, state, ids)
    ratio, predicted, compiled = against_xla(work, named_step, named, ids, "tp")
    assert 0.8 <= ratio <= 1.2, ratio
    assert predicted == compiled
