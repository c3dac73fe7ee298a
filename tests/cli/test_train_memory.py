"""meshplan train's memory check is the planner's model: the library finds a step that does not
fit (train/memory.py), the command line words it (cli/train_memory.py)."""

import dataclasses

import jax
import jax.numpy as jnp

from meshplan.cli.train.memory_advice import BatchWords, memory_problem
from meshplan.layouts import get_layout
from meshplan.models.registry import example
from meshplan.models.transformer import config_from_name
from meshplan.train import memory
from meshplan.train.device_mesh import make_mesh
from meshplan.train.memory import device_memory, memory_shortfall, step_memory
from meshplan.train.settings import TrainSettings, make_optimizer
from meshplan.train.state import abstract_train_state


def _run(batch):
    settings = TrainSettings(batch=batch, seq_len=16)
    model = example("transformer", config_from_name("tiny", num_layers=1)).model
    model = dataclasses.replace(model, example_input=jax.ShapeDtypeStruct((1, 16), jnp.int32))
    abstract = abstract_train_state(model.model, make_optimizer(settings), settings)
    return model, abstract, settings, make_mesh({"data": 2, "model": 4}), get_layout("fsdp_tp")


def _check(model, abstract, settings, mesh, rules):
    """What meshplan train says of a step of ``settings.batch`` sequences split over 2 devices."""
    tokens = jax.ShapeDtypeStruct((settings.batch, settings.seq_len + 1), jnp.int32)
    shortfall = memory_shortfall(model, abstract, tokens, mesh, rules)
    words = BatchWords(
        f"--batch {settings.batch}",
        f"sequences of {settings.seq_len} bytes",
        "Use --batch {largest} or less",
        "a shorter --seq, --remat",
    )
    return None if shortfall is None else memory_problem(shortfall, settings, 2, words)


def test_a_step_that_fits_passes_and_one_that_does_not_names_a_batch_that_does(monkeypatch):
    # A fixed device (the host's available memory moves while other processes run).
    monkeypatch.setattr(memory, "device_memory", lambda mesh: (1 << 30, "a test device"))
    model, abstract, settings, mesh, rules = _run(8)
    assert _check(model, abstract, settings, mesh, rules) is None
    model, abstract, settings, mesh, rules = _run(1 << 22)
    problem = _check(model, abstract, settings, mesh, rules)
    assert problem is not None and problem.code == "out-of-memory"
    assert "--batch 4194304 needs about" in problem.message
    assert "but a device has about 1.00 GiB (a test device)" in problem.message
    largest = int(problem.fix.split("Use --batch ")[1].split()[0])
    assert 0 < largest < 1 << 22 and largest % 2 == 0
    fits = dataclasses.replace(settings, batch=largest)
    assert _check(model, abstract, fits, mesh, rules) is None


def test_the_prediction_grows_with_the_batch_and_keeps_the_state():
    model, abstract, _, mesh, rules = _run(8)
    small, large = (
        step_memory(model, abstract, jax.ShapeDtypeStruct((b, 17), jnp.int32), mesh, rules)
        for b in (8, 64)
    )
    assert small.state_bytes == large.state_bytes > 0
    assert large.memory_bytes > small.memory_bytes
    assert device_memory(mesh) is not None  # emulated CPU devices share the host's memory


def test_a_step_that_traces_only_at_its_own_batch_still_gets_its_advice(monkeypatch):
    # The largest batch is found by predicting the step at other batches; a step that
    # reshapes its batch to a fixed size cannot be traced there: the shortfall comes
    # without it (the advice estimates it from the one step), not as a crash.
    import flax.linen as nn
    import optax

    from meshplan.train.model import TrainModel

    net = nn.Dense(64)

    def loss(params, x):
        return jnp.mean(net.apply({"params": params}, x.reshape(256, 64)) ** 2)

    x = jax.ShapeDtypeStruct((256, 64), jnp.float32)
    model = TrainModel(net, loss, x)
    monkeypatch.setattr(memory, "device_memory", lambda mesh: (1000, "a tiny device"))
    mesh = make_mesh({"data": 2, "model": 4})
    found = memory_shortfall(model, model.abstract_state(optax.sgd(0.1)), x, mesh, ())
    assert found is not None and found.need > found.limit == 1000 and found.fits is None
