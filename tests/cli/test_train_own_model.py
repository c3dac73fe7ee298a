"""``meshplan train --model pkg.module:factory``: a user's own model, Linen or NNX, with a
tuple batch ``(images, labels)``, trained, checkpointed and resumed; bad factories refused."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan.cli import main

LINEN = "meshplan.examples.own_model:linen_classifier"
NNX = "meshplan.examples.own_model:nnx_classifier"
RUN = ["--mesh", "2x4", "--rules", "fsdp", "--lr", "1e-2", "--eval-batches", "2"]


def _train(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, captured.err


def _losses(metrics) -> dict[int, float]:
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize(("factory", "api"), [(LINEN, "Flax Linen"), (NNX, "Flax NNX")])
def test_a_model_of_your_own_trains_saves_and_resumes(tmp_path, capsys, factory, api):
    folder, metrics = tmp_path / "run", tmp_path / "metrics.jsonl"
    args = ["--model", factory, *RUN, "--ckpt-dir", str(folder), "--metrics", str(metrics)]
    code, out, err = _train([*args, "--steps", "40", "--eval-every", "20"], capsys)
    assert code == 0, out + err
    assert f"({api}) from --model {factory} (640 parameters)" in out
    assert "batch (16, 4, 4), (16,)" in out and "examples/s" in out
    losses = _losses(metrics)
    assert max(losses) == 40
    assert np.mean([losses[s] for s in range(36, 41)]) < 0.8 * losses[1]  # it learns
    assert meshplan.restore(folder).metadata.step == 40
    code, out, err = _train([*args, "--resume", "--steps", "50", "--eval-every", "0"], capsys)
    assert code == 0, out + err
    assert f"resuming from step 40 of {folder}" in out
    assert max(_losses(metrics)) == 50
    assert meshplan.restore(folder).metadata.step == 50


@pytest.mark.slow
def test_its_parameters_are_placed_by_the_layout_and_sample_refuses_it(tmp_path, capsys):
    folder = tmp_path / "run"
    code, out, err = _train(
        ["--model", LINEN, *RUN, "--steps", "2", "--eval-every", "0", "--ckpt-dir", str(folder)],
        capsys,
    )
    assert code == 0, out + err
    state, _ = meshplan.restore(folder)
    assert state["params"]["w1"].names == ("embed", "mlp")  # its logical names, kept
    mesh = meshplan.train.device_mesh.make_mesh({"data": 2, "model": 4})
    state, _ = meshplan.restore(folder, mesh, meshplan.layouts.fsdp)
    assert state["params"]["w1"].value.sharding.spec == P(("data", "model"), None)
    assert main(["sample", "--ckpt-dir", str(folder), "--prompt", "x"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"holds --model {LINEN}, not the byte-level Transformer that meshplan sample" in err


@pytest.mark.slow
def test_resuming_needs_the_factory_and_the_same_model(tmp_path, capsys):
    folder = tmp_path / "run"
    base = [*RUN, "--eval-every", "0", "--ckpt-dir", str(folder)]
    assert _train(["--model", NNX, *base, "--steps", "2"], capsys)[0] == 0
    code, _, err = _train([*base, "--resume", "--steps", "4"], capsys)
    assert code == 2
    assert f"the checkpoint holds a model of your own, --model {NNX}" in err
    assert f"Pass --model {NNX} to resume it" in err
    code, _, err = _train(["--model", LINEN, *base, "--resume", "--steps", "4"], capsys)
    assert code == 2
    assert f"the checkpoint holds --model {NNX}, this run asks for --model {LINEN}" in err


def test_flags_of_the_built_in_transformer_are_refused_all_at_once(capsys):
    code, _, err = _train(
        ["--model", LINEN, *RUN, "--seq", "32", "--layers", "2", "--batch", "8", "--data", "."],
        capsys,
    )
    assert code == 2
    assert f"--layers sets the built-in Transformer, not --model {LINEN}" in err
    assert "--seq sets the built-in Transformer's sequence" in err
    assert f"--batch 8, but the batches of --model {LINEN} hold 16" in err
    assert "--data reads text for the built-in Transformer" in err
    assert err.count("\n  * ") == 4  # one error, every problem a bullet


FACTORIES = textwrap.dedent(
    """
    import itertools
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from meshplan.examples import own_model

    def plan_form():  # what plan and search take, without batches
        model, batch, loss, _ = own_model.linen_classifier()
        return model, batch, loss

    def finite():  # an iterable that runs out
        model, batch, loss, _ = own_model.linen_classifier()
        return model, batch, loss, [own_model.make_batch(0, i) for i in range(4)]

    class WithState(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(16, 4, rngs=rngs)
            self.count = nnx.BatchStat(jnp.zeros(()))

        def __call__(self, x):
            return self.linear(x.reshape((x.shape[0], -1)))

    def nnx_with_state():
        _, batch, loss, batches = own_model.linen_classifier()
        return WithState, batch, loss, batches

    def no_batches():
        model, batch, loss, _ = own_model.linen_classifier()
        return model, batch, loss, 3
    """
)


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "my_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)  # a factory is imported from the current folder
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_factories"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("plan_form", "gives no batches to train on"),
        ("nnx_with_state", "state holds variables that are not nnx.Param: count."),
        ("no_batches", "the batches (fourth value) are a int, neither a function"),
    ],
)
def test_a_factory_that_cannot_train_is_refused_with_the_form_to_return(
    factories, capsys, name, expected
):
    code, _, err = _train(["--model", f"{factories}:{name}", *RUN, "--steps", "2"], capsys)
    assert code == 2
    assert expected in " ".join(err.split())


@pytest.mark.slow
def test_an_iterable_that_runs_out_ends_the_run_with_its_step(factories, capsys):
    code, out, err = _train(
        ["--model", f"{factories}:finite", *RUN, "--steps", "10", "--eval-every", "0"], capsys
    )
    assert code != 0
    assert "the batches ran out at train batch" in " ".join((out + err).split())


@pytest.mark.slow
@pytest.mark.parametrize("factory", [LINEN, NNX])
def test_the_same_factory_serves_plan_and_search(capsys, factory):
    assert main(["plan", "--model", factory, "--rules", "fsdp", "--mesh", "2x4"]) == 0
    out = capsys.readouterr().out
    assert "embed, mlp" in out and "mlp, vocab" in out
    assert main(["search", "--model", factory, "--devices", "8", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["rows"], found
