"""A model of your own for ``meshplan train --model pkg.module:factory``: the template to copy.

Each factory returns ``(model, example_batch, loss, batches)``
(:mod:`meshplan.cli.factory`), the form ``plan``, ``search`` and ``train`` all
take. The model here is a small classifier of 4x4 "images" into 4 classes with
logical names on every parameter (``embed``, ``mlp``, ``vocab``), so that any
built-in layout places it; the batches are tuples ``(images, labels)``, made up
so that the classes can be learned (the label is the largest of 4 fixed
projections of the image).

``linen_classifier`` is the Flax Linen model with ``batches(split, index)``;
``nnx_classifier`` the same model in Flax NNX, with an iterable of batches.

Example:
    >>> from meshplan.examples.own_model import linen_classifier
    >>> model, (images, labels), loss, batches = linen_classifier()
    >>> images.shape, labels.shape, batches("train", 3)[0].shape
    ((16, 4, 4), (16,), (16, 4, 4))
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import meshplan

__all__ = ["Classifier", "NNXClassifier", "linen_classifier", "nnx_classifier"]

BATCH, SIDE, HIDDEN, CLASSES = 16, 4, 32, 4

Batch = tuple[np.ndarray, np.ndarray]


def make_batch(seed: int, index: int) -> Batch:
    """Batch ``index`` of the stream ``seed``: ``(images[16, 4, 4], labels[16])``."""
    projections = np.random.default_rng(0).normal(size=(SIDE * SIDE, CLASSES))
    rng = np.random.default_rng([seed, index])
    images = rng.normal(size=(BATCH, SIDE, SIDE)).astype(np.float32)
    labels = (images.reshape(BATCH, -1) @ projections).argmax(-1).astype(np.int32)
    return images, labels


def cross_entropy(logits: jax.Array, batch: Batch) -> jax.Array:
    """The mean cross-entropy of ``logits`` against the batch's labels."""
    _, labels = batch
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def _example() -> Batch:
    return np.zeros((BATCH, SIDE, SIDE), np.float32), np.zeros((BATCH,), np.int32)


class Classifier(nn.Module):
    """Flattened image -> hidden ReLU layer -> class logits, with logical names."""

    @nn.compact
    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.reshape((images.shape[0], -1))
        init = nn.initializers.lecun_normal()
        w1 = self.param(
            "w1",
            meshplan.with_logical_partitioning(init, ("embed", "mlp")),
            (SIDE**2, HIDDEN),
            unbox=True,  # flax's default, spelled out: its stubs then type the value
        )
        w2 = self.param(
            "w2",
            meshplan.with_logical_partitioning(init, ("mlp", "vocab")),
            (HIDDEN, CLASSES),
            unbox=True,
        )
        return jnp.asarray(nn.relu(x @ w1) @ w2)


def linen_classifier() -> tuple[
    nn.Module, Batch, Callable[..., object], Callable[[str, int], Batch]
]:
    """The Linen classifier, an example batch, its loss and ``batches(split, index)``."""

    def batches(split: str, index: int) -> Batch:
        return make_batch(1 if split == "train" else 2, index)

    return Classifier(), _example(), cross_entropy, batches


class NNXClassifier(nnx.Module):
    """The same classifier in Flax NNX, with the same logical names."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.hidden = nnx.Linear(
            SIDE**2,
            HIDDEN,
            use_bias=False,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            rngs=rngs,
        )
        self.out = nnx.Linear(
            HIDDEN,
            CLASSES,
            use_bias=False,
            kernel_init=nnx.with_partitioning(init, ("mlp", "vocab")),
            rngs=rngs,
        )

    def __call__(self, images: jax.Array) -> jax.Array:
        x = images.reshape((images.shape[0], -1))
        return jnp.asarray(self.out(nnx.relu(self.hidden(x))))


def nnx_classifier() -> tuple[
    Callable[[nnx.Rngs], nnx.Module], Batch, Callable[..., object], Iterator[Batch]
]:
    """``make(rngs)`` of the NNX classifier, an example batch, its loss, and an endless
    iterable of batches (``meshplan train`` holds its first ``--eval-batches`` out for
    validation)."""
    stream = (make_batch(3, i) for i in itertools.count())
    return NNXClassifier, _example(), cross_entropy, stream
