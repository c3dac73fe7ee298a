"""``meshplan train``, round 3: a factory's batches and loss checked up front, NaN told apart
(the data, the start, a divergence), and flags that ended in raw Python errors.

Real runs of ``meshplan train`` on factories written to a file and imported as a user's.
"""

from __future__ import annotations

import textwrap

import pytest

from meshplan.cli import main

FACTORIES = textwrap.dedent(
    """
    import numpy as np, jax.numpy as jnp, optax
    from meshplan.examples import own_model

    def _with(batches_of):
        model, batch, loss, batches = own_model.linen_classifier()
        return model, batch, loss, lambda split, i: batches_of(*batches(split, i), split, i)

    def small_batches():
        return _with(lambda x, y, s, i: (x[:4], y[:4]))

    def float_labels():
        return _with(lambda x, y, s, i: (x, y.astype(np.float32)))

    def strings():
        return _with(lambda x, y, s, i: (x, np.array([str(v) for v in y])))

    def wrong_shape():
        return _with(lambda x, y, s, i: (x.reshape(x.shape[0], -1), y))

    def vector_loss():
        model, batch, _, batches = own_model.linen_classifier()
        loss = lambda logits, b: optax.softmax_cross_entropy_with_integer_labels(logits, b[1])
        return model, batch, loss, batches

    def nan_start():
        model, batch, _, batches = own_model.linen_classifier()
        return model, batch, lambda logits, b: jnp.mean(logits) * jnp.nan, batches

    def _nan_at_2(x, y, split, i):
        if split == "train" and i == 2:
            x = x.copy()
            x[0, 0, 0] = np.nan
        return x, y

    def nan_batch():
        return _with(_nan_at_2)
    """
)
RUN = ["--mesh", "8", "--rules", "data_parallel", "--eval-every", "0"]


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "bad_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "bad_factories"


def _train(args: list[str], capsys) -> tuple[int, str]:
    code = main(["train", *args])
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert "Traceback" not in text
    return code, text


@pytest.mark.parametrize(
    ("name", "expected", "fix"),
    [
        (
            "small_batches",
            "batches('train', 0), batch[0], has shape (4, 4, 4), the example "
            "batch's (16, 4, 4): 4 rows where the example has 16",
            "Return batches of shape",
        ),
        (
            "float_labels",
            "batch[1], has dtype float32, the example batch's int32 (integer "
            "labels or ids given as floats?)",
            "Return int32 arrays there",
        ),
        ("strings", "batch[1], holds str", "Encode them as numbers"),
        (
            "wrong_shape",
            "batch[0], has shape (16, 16), the example batch's (16, 4, 4)",
            "Return batches of shape (16, 4, 4)",
        ),
        (
            "vector_loss",
            "the loss returns an array of shape (16,) and dtype float32, not one floating number",
            "jnp.mean(per_example_losses)",
        ),
    ],
)
def test_factory_batches_and_loss_are_checked_before_any_work(
    factories, capsys, name, expected, fix
):
    code, text = _train(["--model", f"{factories}:{name}", *RUN, "--steps", "2"], capsys)
    assert code == 2
    assert expected in text and fix in text


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "expected", "not_said"),
    [
        (
            "nan_start",
            "Training stopped at step 1: its training loss is nan, and it is not "
            "finite from the run's first step",
            "--resume-step",
        ),
        (
            "nan_batch",
            "Training stopped at step 3: its training loss is nan, and its batch "
            "holds NaN or infinite values: batch[0] (1 of 256 values)",
            "--resume-step",
        ),
    ],
)
def test_a_nan_loss_names_the_data_or_the_start_not_the_learning_rate(
    factories, tmp_path, capsys, name, expected, not_said
):
    ckpt = ["--ckpt-every", "1", "--ckpt-dir", str(tmp_path / "run")]
    code, text = _train(["--model", f"{factories}:{name}", *RUN, "--steps", "4", *ckpt], capsys)
    assert code == 1
    assert expected in text
    assert "the learning rate is not the cause" in text
    assert not_said not in text and "Lower --lr" not in text


TINY = ["--layers", "1", "--embed", "32", "--heads", "4", "--mlp", "64", "--batch", "8"]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--capacity-factor", "inf"], "capacity_factor must be a finite number above 0, got inf"),
        (
            [
                "--capacity-factor",
                "1e30",
                "--experts",
                "4",
                "--rules",
                "expert_parallel",
                "--axes",
                "data,expert",
            ],
            "capacity_factor must be at most num_experts=4, got 1e+30",
        ),
    ],
)
def test_a_capacity_factor_that_overflows_is_refused(capsys, flags, expected):
    code, text = _train([*TINY, "--steps", "2", *flags], capsys)
    assert code == 2 and expected in text


@pytest.mark.slow
def test_a_million_byte_sequence_reaches_the_memory_refusal(tmp_path, capsys):
    data = tmp_path / "big.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 260_000)  # 11.4 MB
    flags = ["--seq", "1000000", "--max-len", "1000000", "--data", str(data)]
    code, text = _train([*TINY, "--steps", "2", *flags], capsys)
    assert code == 2
    assert "--batch 8 needs about" in text and "per device" in text
    assert "Unable to allocate" not in text


# -- what a new user missed: --remat shown, experts without --experts, the resume line --


@pytest.mark.slow
def test_remat_and_a_dense_model_under_an_expert_layout_are_said(capsys):
    flags = ["--seq", "16", "--eval-batches", "1", "--eval-every", "0", "--remat"]
    code, text = _train(
        [*TINY, "--steps", "1", *flags, "--rules", "expert_parallel", "--axes", "data,expert"],
        capsys,
    )
    assert code == 0, text
    assert "note: --rules expert_parallel places experts" in text
    assert "(--experts 0): it trains the dense MLP" in text
    assert "batch 8 x 16 bytes, remat full, lr" in text  # the header
    assert "│ remat │ full (block activations recomputed)" in text  # the summary


@pytest.mark.slow
def test_resuming_a_model_of_your_own_names_the_layouts(tmp_path, capsys):
    model = ["--model", "meshplan.examples.own_model:linen_classifier"]
    run = [*model, "--mesh", "2x4", "--rules", "fsdp", "--eval-every", "0"]
    ckpt = ["--ckpt-dir", str(tmp_path / "run")]
    assert _train([*run, "--steps", "1", *ckpt], capsys)[0] == 0
    code, text = _train(
        [*model, "--mesh", "8", "--rules", "data_parallel", "--resume", "--steps", "2", *ckpt],
        capsys,
    )
    assert code == 0, text
    line = text.split("resuming from step 1 of ", 1)[1][:300]
    assert line.startswith(f"{tmp_path / 'run'} (saved on 2x4 with fsdp) onto 8"), line
    assert " with data_parallel" in line
