"""``meshplan search`` end to end: ranked rules, the printed train command trained, factories."""

from __future__ import annotations

import json
import shlex
import textwrap

import pytest

from meshplan import cli

TINY_SEARCH = ["--size", "tiny", "--batch", "8", "--seq", "16", "--profile", "h100"]
TRAIN_FAST = ["--steps", "2", "--eval-every", "0", "--eval-batches", "1", "--platform", "cpu"]

FACTORY = textwrap.dedent(
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            up = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
            down = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
            h = nn.relu(nn.Dense(256, kernel_init=up, use_bias=False)(x))
            return nn.Dense(64, kernel_init=down, use_bias=False)(h)

    def linen():
        batch = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        return Net(), batch, lambda y, x: jnp.mean((y - x) ** 2)

    def classifier():  # a tuple batch: the module gets the images, the loss both
        images = jax.ShapeDtypeStruct((32, 64), jnp.float32)
        labels = jax.ShapeDtypeStruct((32,), jnp.int32)

        def loss(logits, batch):
            _, labels = batch
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], 1))

        return Net(), (images, labels), loss

    def trainable():  # the four-value form meshplan train takes
        import numpy as np

        def batches(split, index):
            return np.random.default_rng(index).normal(size=(32, 64)).astype(np.float32)

        model, batch, loss = linen()
        return model, batch, loss, batches

    def step():
        state, step_fn, batch = linen_step()
        return state, step_fn, batch

    def linen_step():
        import meshplan._search.search.rule_search as rs
        return rs.linen_step(Net(), jax.ShapeDtypeStruct((16, 64), jnp.float32))

    def a_number():
        return 3

    def broken():
        raise RuntimeError("no weights here")

    NOT_CALLABLE = 4
    """
)


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A fresh current folder holding a factory module ``usermodels``."""
    (tmp_path / "usermodels.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def search_json(capsys, *args: str) -> dict:
    code = cli.main(["search", *args, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


@pytest.mark.slow
def test_search_writes_no_rules_file_unless_asked(here, capsys):
    data = search_json(capsys, *TINY_SEARCH, "--top-k", "0")
    assert data["rules_file"] is None and not list(here.glob("rules*.json"))
    assert "--rules rules.json" in data["train_command"]
    assert cli.main(["search", *TINY_SEARCH, "--top-k", "0"]) == 0
    assert "rules not written: pass --rules-out" in capsys.readouterr().out
    assert not list(here.glob("rules*.json"))


@pytest.mark.slow
def test_the_printed_top_choice_trains(here, capsys):
    data = search_json(capsys, *TINY_SEARCH, "--top-k", "0", "--rules-out", "rules.json")
    best = data["best"]
    assert best["rank"] == 1 and best["predicted_step_s"] > 0
    assert best["tokens_per_s"] > 0 and best["fits"] and best["activation_bytes_per_device"] > 0
    assert data["counts"]["enumerated"] > data["counts"]["scored"] > 0
    rules_file = here / data["rules_file"]
    assert json.loads(rules_file.read_text()) == best["rules"]
    command = shlex.split(data["train_command"])
    assert command[:2] == ["meshplan", "train"] and "--axes" in command
    assert command[command.index("--mesh") + 1] == "x".join(map(str, best["mesh_shape"]))
    assert cli.main([*command[1:], *TRAIN_FAST]) == 0
    assert "final train loss" in capsys.readouterr().out


@pytest.mark.slow
def test_a_three_axis_row_trains_on_its_mesh(here, capsys):
    data = search_json(capsys, *TINY_SEARCH, "--top-k", "0")
    row = next(r for r in data["rows"] if r["status"] == "ok" and len(r["mesh_shape"]) == 3)
    (here / "r3.json").write_text(json.dumps(row["rules"]))
    mesh, axes = "x".join(map(str, row["mesh_shape"])), ",".join(row["axis_names"])
    argv = [
        "train",
        "--mesh",
        mesh,
        "--axes",
        axes,
        "--rules",
        "r3.json",
        "--size",
        "tiny",
        "--batch",
        "8",
        "--seq",
        "16",
        *TRAIN_FAST,
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert f"on a {mesh} mesh {tuple(row['axis_names'])}" in out


@pytest.mark.slow
def test_table_counts_rejections_and_the_command(here, capsys):
    assert cli.main(["search", *TINY_SEARCH, "--devices", "8", "--top-k", "0"]) == 0
    out = capsys.readouterr().out
    assert "Transformer (tiny) · 8 devices · profile h100" in out
    assert "predicted" in out and "all-reduce" in out and "memory/device" in out
    assert "1x8 data,model tensor_parallel: invalid: dim 2 ('heads') of size 4" in out
    assert "candidates: enumerated " in out and "scored" in out and "compiled 0" in out
    assert "train it, after --rules-out rules.json:  meshplan train --mesh " in out
    assert "--size tiny --batch 8 --seq 16" in out


def test_the_table_names_its_ties_where_a_faster_row_may_follow_a_slower_one(here, capsys):
    args = ["--size", "tiny", "--batch", "32", "--profile", "h100", "--devices", "8"]
    assert cli.main(["search", *args, "--rows", "4", "--top-k", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    tie = next(line for line in lines if line.startswith("tie: "))
    assert tie.startswith("tie: #2 and #3 predicted within 3% (closer than the model tells")
    rows = {line.split()[0]: line.split()[3] for line in lines if line[:1] in "23"}
    assert float(rows["2"]) > float(rows["3"])  # ordered by a fixed order, not by time


def test_rules_out_and_axes_names(here, capsys):
    data = search_json(
        capsys,
        *TINY_SEARCH,
        "--top-k",
        "0",
        "--axes",
        "data=dp,tensor=tp",
        "--rules-out",
        "out/best.json",
        "--layouts",
        "fsdp",
    )
    assert data["rules_file"] == "out/best.json" and (here / "out/best.json").exists()
    searched = [r for r in data["rows"] if r["layout"] == "searched"]
    assert searched and all(set(r["axis_names"]) <= {"dp", "tp"} for r in searched)
    assert {r["layout"] for r in data["rows"]} <= {"searched", "fsdp"}


def test_top_k_compiles_when_the_devices_are_here(here, capsys):
    data = search_json(capsys, "--model", "mlp", "--layers", "1", "--depth", "64", "--top-k", "1")
    assert data["counts"]["compiled"] == 1
    assert data["best"]["compiled"]["collective_bytes"] >= 0


@pytest.mark.slow
def test_measure_runs_the_top_candidates(here, capsys):
    data = search_json(
        capsys,
        "--model",
        "mlp",
        "--layers",
        "1",
        "--depth",
        "64",
        "--top-k",
        "2",
        "--measure",
        "--platform",
        "cpu",
    )
    assert data["counts"]["measured"] == 2
    measured = [r["measured_step_s"] for r in data["rows"][:2]]
    assert all(m is not None and m > 0 for m in measured) and measured == sorted(measured)
    assert "train_command" in data and data["train_command"] is None  # the MLP: rules only


@pytest.mark.slow
def test_a_pod_sized_search_finishes_without_devices(here, capsys):
    data = search_json(
        capsys,
        "--model",
        "mlp",
        "--layers",
        "1",
        "--depth",
        "1024",
        "--batch",
        "16384",
        "--devices",
        "16384",
        "--profile",
        "tpu_v5e",
    )
    assert data["devices"] == 16384 and data["counts"]["compiled"] == 0
    assert data["best"] is not None and data["best"]["mesh"]


@pytest.mark.parametrize(
    "factory", ["usermodels:linen", "usermodels:step", "usermodels:classifier"]
)
def test_factory_models_search_and_plan(here, capsys, factory):
    data = search_json(
        capsys, "--model", factory, "--profile", "h100", "--top-k", "0", "--rules-out", "r.json"
    )
    assert data["model"].startswith(factory) and data["best"] is not None
    assert data["train_command"] is None and (here / data["rules_file"]).exists()
    assert cli.main(["plan", "--model", factory, "--mesh", "2x4", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    specs = {leaf["path"]: leaf["spec"] for leaf in plan["plan"]["leaves"]}
    assert specs["params/Dense_0/kernel"] == ["data", "model"]  # fsdp_tp by default


def test_a_trainable_factory_gets_its_train_command(here, capsys):
    data = search_json(
        capsys,
        "--model",
        "usermodels:trainable",
        "--profile",
        "h100",
        "--top-k",
        "0",
        "--rules-out",
        "r.json",
    )
    command = shlex.split(data["train_command"])
    assert command[:2] == ["meshplan", "train"]
    assert command[command.index("--model") + 1] == "usermodels:trainable"
    assert command[command.index("--rules") + 1] == "r.json" and "--size" not in command


def test_a_factory_rules_file_plans_on_three_axes(here, capsys):
    data = search_json(capsys, "--model", "usermodels:linen", "--profile", "h100", "--top-k", "0")
    row = next(r for r in data["rows"] if r["status"] == "ok" and len(r["mesh_shape"]) >= 2)
    (here / "r.json").write_text(json.dumps(row["rules"]))
    mesh, axes = "x".join(map(str, row["mesh_shape"])), ",".join(row["axis_names"])
    argv = [
        "plan",
        "--model",
        "usermodels:linen",
        "--mesh",
        mesh,
        "--axes",
        axes,
        "--rules",
        "r.json",
        "--strict",
    ]
    assert cli.main(argv) == 0, capsys.readouterr().err


@pytest.mark.parametrize(
    ("model", "fragment"),
    [
        ("nosuchmodule:f", "no module named 'nosuchmodule'"),
        ("usermodels:missing", "has no attribute 'missing'; its functions: "),
        (
            "usermodels:NOT_CALLABLE",
            "usermodels.NOT_CALLABLE is not a function but an object of type int",
        ),
        ("usermodels:a_number", "the factory returned an object of type int"),
        ("usermodels:broken", "calling usermodels.broken() raised RuntimeError: no weights here"),
        ("gpt", "neither a built-in model (mlp, transformer, transformer-nnx) nor a factory"),
    ],
)
@pytest.mark.parametrize("command", ["search", "plan"])
def test_bad_factories_are_refused_clearly(here, capsys, command, model, fragment):
    assert cli.main([command, "--model", model]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--model", "usermodels:linen", "--batch", "8"], "--batch is not used with --model"),
        (["--model", "usermodels:linen", "--size", "tiny"], "--size sizes the built-in models"),
        (["--model", "mlp", "--seq", "16"], "--seq is not used with --model mlp"),
        (["--devices", "0"], "--devices 0"),
        (["--top-k", "-1"], "--top-k -1"),
    ],
)
def test_flags_that_would_be_ignored_or_are_out_of_range(here, capsys, args, fragment):
    assert cli.main(["search", *args]) == 2
    assert fragment in capsys.readouterr().err


def test_bad_axes_and_profile_exit_2(capsys):
    for argv in (["--axes", "model"], ["--profile", "a1000"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["search", *argv])
        assert exit_info.value.code == 2


def test_a_bad_profile_file_exits_2_naming_every_problem(here, capsys):
    (here / "bad.json").write_text(json.dumps({"name": "x", "peak_flops": -1, "extra": 1}))
    assert cli.main(["search", "--profile", "bad.json", "--top-k", "0"]) == 2
    err = capsys.readouterr().err
    assert "peak_flops is -1" in err and "unknown field 'extra'" in err
    assert "missing field 'memory_bytes'" in err


def test_plan_predicts_the_step_on_a_profile_without_devices(capsys):
    argv = [
        "plan",
        "--model",
        "transformer",
        "--mesh",
        "2x4",
        "--rules",
        "fsdp",
        "--profile",
        "tpu_v5e",
        "--devices",
        "8",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "predicted step" in out and "tokens/s" in out and "MFU" in out
    assert "state" in out and "activations" in out and "temporaries" in out
    assert cli.main([*argv, "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)["prediction"]
    assert pred["fits"] and pred["tokens_per_s"] > 0 and pred["activation_bytes_per_device"] > 0
    assert cli.main([*argv[:-1], "16"]) == 2
    assert "--devices 16 but --mesh 2x4 has 8 devices" in capsys.readouterr().err


def test_a_batch_without_token_ids_is_counted_in_examples(capsys):
    argv = [
        "plan",
        "--model",
        "meshplan.examples.own_model:linen_classifier",
        "--mesh",
        "2x4",
        "--rules",
        "fsdp",
        "--profile",
        "tpu_v5e",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "examples/s" in out and "tokens/s" not in out
    assert cli.main([*argv, "--json"]) == 0
    pred = json.loads(capsys.readouterr().out)["prediction"]
    assert pred["throughput_unit"] == "examples" and pred["tokens_per_s"] > 0
    argv = [
        "search",
        "--model",
        "meshplan.examples.own_model:linen_classifier",
        "--devices",
        "8",
        "--profile",
        "tpu_v5e",
        "--rows",
        "2",
    ]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "examples/s" in out and "tokens/s" not in out


@pytest.mark.slow
def test_cli_search_prints_the_ranked_table_and_the_best(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the best rules file is written here
    argv = ["search", "--model", "transformer", "--size", "tiny", "--devices", "8"]
    assert cli.main([*argv, "--profile", "h100", "--top-k", "0"]) == 0
    out = capsys.readouterr().out
    assert "Transformer (tiny) · 8 devices · profile h100" in out and "batch 32" in out
    assert "best: 1x8 data,model batch=model" in out  # data parallel: the tiny model is cheap
    assert "1x8 data,model tensor_parallel: invalid: dim 2 ('heads') of size 4" in out
    assert not list(tmp_path.iterdir())  # rules are written only with --rules-out


def test_cli_search_json_with_a_budget(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["search", "--size", "tiny", "--devices", "8", "--batch", "32", "--budget", "40MiB"]
    assert cli.main([*argv, "--profile", "h100", "--top-k", "0", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "Transformer (tiny)" and data["budget_bytes"] == 40 << 20
    assert data["counts"]["pruned"]["memory"] > 0
    best = data["best"]
    assert best["memory_bytes_per_device"] <= 40 << 20 and best["predicted_step_s"] > 0
    assert best["mesh_shape"] == list(best["mesh"].values())
    assert best["axis_names"] == list(best["mesh"])
    assert all(isinstance(pair, list) and len(pair) == 2 for pair in best["rules"])
    memory = [r for r in data["rows"] if r["reason"].startswith("memory:")]
    assert memory and all(r["memory_bytes_per_device"] > 40 << 20 for r in memory)


def test_cli_search_exits_1_when_nothing_fits_and_2_on_a_bad_budget(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["search", "--devices", "8", "--budget", "1KiB", "--top-k", "0"]) == 1
    assert "best: none" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())  # no rules file when nothing fits
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["search", "--budget", "lots"])
    assert exit_info.value.code == 2
    assert "cannot read the size 'lots'" in capsys.readouterr().err
