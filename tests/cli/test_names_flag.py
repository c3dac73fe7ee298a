"""``--names FILE`` of ``meshplan plan|search|train``: a factory's model written without names,
named by path; and what the commands say first of a model that carries no names."""

from __future__ import annotations

import json

import jax
import pytest
from jax.sharding import PartitionSpec as P

import meshplan
from meshplan._text import path_text
from meshplan.cli import main
from meshplan.examples.third_party import EQUINOX_NAMES, JAX_NAMES

MLP = "meshplan.examples.third_party:jax_mlp"
EQX = "meshplan.examples.third_party:equinox_mlp"


def _names_file(tmp_path, pairs, name="names.json"):
    path = tmp_path / name
    path.write_text(json.dumps([[p, None if n is None else list(n)] for p, n in pairs]))
    return str(path)


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    return code, captured.out, " ".join(captured.err.split())


def test_plan_of_an_unnamed_factory_says_first_that_nothing_is_named(capsys):
    code, out, err = _run(capsys, "plan", "--model", MLP, "--rules", "fsdp")
    assert code == 0
    assert err.startswith(
        f"warning: No array of --model {MLP} carries a logical name: the rules fsdp place "
        f"nothing, every array is replicated. Pass --names FILE"
    )
    assert "Map a logical name" not in out + err
    code, out, _ = _run(capsys, "plan", "--model", MLP, "--rules", "fsdp", "--json")
    assert [p["code"] for p in json.loads(out)["problems"]] == ["no-names"]


def test_plan_with_names_places_every_parameter_and_its_optimizer_copies(tmp_path, capsys):
    names = _names_file(tmp_path, JAX_NAMES)
    code, out, err = _run(capsys, "plan", "--model", MLP, "--names", names, "--json")
    assert code == 0 and "--names" not in err  # every pattern matched, every array named
    data = json.loads(out)
    leaves = {leaf["path"]: leaf for leaf in data["plan"]["leaves"]}
    assert leaves["params/w1"]["names"] == ["embed", "mlp"]
    assert leaves["opt_state/0/mu/w1"]["names"] == ["embed", "mlp"]  # Adam's copy
    assert "no-names" not in {p["code"] for p in data["problems"]}


def test_names_no_pattern_matches_are_said_once(tmp_path, capsys):
    names = _names_file(tmp_path, [(r"params/w1", ("embed", "mlp")), (r"params/typo", None)])
    code, _, err = _run(capsys, "plan", "--model", MLP, "--names", names)
    assert code == 0
    assert err.count("--names: 3 arrays that no pattern matches stay unnamed") == 1
    assert "params/b1, params/b2, params/w2; 1 pattern matched no array: 'params/typo'" in err


def test_search_says_the_same_names_warnings_as_plan(tmp_path, capsys):
    names = _names_file(tmp_path, [(r"params/w1", ("embed", "mlp")), (r"params/typo", None)])
    argv = ["--model", MLP, "--names", names, "--devices", "4", "--profile", "h100"]
    _, _, plan_err = _run(capsys, "plan", *argv[:4], "--mesh", "2x2")
    code, _, err = _run(capsys, "search", *argv, "--rows", "1")
    assert code == 0
    said = "--names: 3 arrays that no pattern matches stay unnamed"
    assert err.count(said) == plan_err.count(said) == 1
    assert "1 pattern matched no array: 'params/typo'" in err
    code, out, err = _run(capsys, "search", *argv, "--json")  # stdout stays JSON
    assert code == 0 and json.loads(out)["best"] is not None and err.count(said) == 1


def test_a_bad_names_file_is_one_error_naming_each_pair(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([["params/w1", "embed"], ["(", ["mlp"]]]))
    code, _, err = _run(capsys, "plan", "--model", MLP, "--names", str(bad))
    assert code == 2
    assert f"error: Cannot read names from {str(bad)!r}" in err
    assert "path_rules[0]: the names of pattern 'params/w1'" in err
    assert "path_rules[1]: the pattern '(' is not a regular expression" in err
    names = _names_file(tmp_path, [(r"params/w1", ("embed",))])
    code, _, err = _run(capsys, "plan", "--model", MLP, "--names", names)
    assert code == 2
    assert "params/w1: path_rules[0] ('params/w1') gives 1 name ('embed',) to an array of " in err


@pytest.mark.parametrize("command", ["plan", "train"])
def test_names_for_a_built_in_model_is_refused(tmp_path, capsys, command):
    names = _names_file(tmp_path, JAX_NAMES)
    code, _, err = _run(capsys, command, "--model", "transformer", "--names", names)
    assert code == 2
    assert "--model transformer carries its own names. Leave out --names" in err


@pytest.mark.slow
def test_train_with_names_keeps_them_in_its_checkpoint(tmp_path, capsys):
    folder = tmp_path / "run"
    names = _names_file(tmp_path, EQUINOX_NAMES)
    code, out, err = _run(
        capsys,
        "train",
        "--model",
        EQX,
        "--eval-every",
        "0",
        "--eval-batches",
        "1",
        "--names",
        names,
        "--steps",
        "2",
        "--ckpt-dir",
        str(folder),
    )
    assert code == 0, out + err
    assert "carries a logical name" not in err and "--names" not in err
    mesh = meshplan.train.device_mesh.make_mesh({"data": 4, "model": 2})
    state, metadata = meshplan.restore(folder, mesh, meshplan.layouts.fsdp_tp)
    # the path rules, for a resume without --names (tests/examples/test_third_party.py)
    assert metadata.extra["train"]["names"][0] == ["params/MLP/layers/0/weight", ["mlp", "embed"]]
    kernel = state["params"]["MLP"]["layers"]["0"]["weight"]
    assert kernel.names == ("mlp", "embed")
    assert kernel.value.sharding.spec == P("model", "data")
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: hasattr(x, "names"))[0]
    [mu] = [leaf for path, leaf in leaves if path_text(path).endswith("mu/MLP/layers/0/weight")]
    assert mu.names == ("mlp", "embed")  # AdamW's copy of it too


@pytest.mark.slow
def test_train_of_an_unnamed_factory_says_so_first_and_search_passes_names_on(tmp_path, capsys):
    code, out, err = _run(
        capsys, "train", "--model", MLP, "--steps", "1", "--eval-every", "0", "--eval-batches", "1"
    )
    assert code == 0, out + err
    assert err.startswith(f"note: No array of --model {MLP} carries a logical name")
    names = _names_file(tmp_path, JAX_NAMES)
    code, out, err = _run(
        capsys, "search", "--model", MLP, "--names", names, "--devices", "8", "--json"
    )
    assert code == 0, out + err
    data = json.loads(out)
    assert f"--model {MLP} --names {names}" in data["train_command"]


FORMS = """
import flax.linen as nn
import jax, jax.numpy as jnp

class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(8)(x)))

def linen():
    return Mlp(), jnp.zeros((16, 4))

def step_form():
    state = {"w": jax.ShapeDtypeStruct((4, 8), jnp.float32)}
    def step(state, x):  # written for plain arrays
        return {"w": state["w"] - 0.1 * jnp.mean(x @ state["w"])}
    return state, step, jax.ShapeDtypeStruct((16, 4), jnp.float32)
"""


def test_names_on_the_linen_and_step_forms_of_plan_and_search(tmp_path, monkeypatch):
    from meshplan.cli.factory import load_factory

    (tmp_path / "unnamed_forms.py").write_text(FORMS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    linen = load_factory(
        "unnamed_forms:linen",
        [
            (r"params/Dense_0/kernel", ("embed", "mlp")),
            (r"params/Dense_1/kernel", ("mlp", "embed")),
            (r".*/bias", None),
        ],
    )
    plan = meshplan.explain(linen.abstract_state, {"data": 2, "model": 4}, meshplan.layouts.fsdp)
    assert plan["params/Dense_0/kernel"].names == ("embed", "mlp")
    assert plan["opt_state/0/mu/Dense_1/kernel"].names == ("mlp", "embed")
    jax.eval_shape(linen.step_fn, linen.abstract_state, linen.example_batch)  # the step runs
    stepped = load_factory("unnamed_forms:step_form", [(r"w", ("embed", "mlp"))])
    assert stepped.abstract_state["w"].names == ("embed", "mlp")
    after = jax.eval_shape(stepped.step_fn, stepped.abstract_state, stepped.example_batch)
    assert after["w"].shape == (4, 8)  # the step was given the state unboxed


def test_train_reads_a_names_file_with_the_flags_and_refuses_a_missing_one_with_them(tmp_path):
    from meshplan.cli.train import TrainRequest, prepare_run
    from meshplan.cli.train.preflight import read_flags

    names = _names_file(tmp_path, EQUINOX_NAMES)
    flags = read_flags(TrainRequest(model=EQX, names=names, mesh="2x4", rules="fsdp"))
    assert flags.names == meshplan.layouts.get_names(names)  # read with --rules, once
    assert read_flags(TrainRequest(model=EQX, names="infer")).names is None  # from its step
    missing = str(tmp_path / "missing.json")
    with pytest.raises(meshplan.MeshplanError, match="meshplan train cannot start") as e:
        prepare_run(TrainRequest(model=EQX, names=missing, mesh="2x4", rules="nope"))
    codes = {p.code for p in e.value.problems}
    assert "unknown-layout" in codes  # every problem together: the layout's and the file's
    assert any(missing in p.message for p in e.value.problems)
