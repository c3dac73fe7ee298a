"""One prepare step for every model source of ``meshplan train`` (cli/train/prepare.py): the
built-in Transformer and a ``--model pkg.module:factory`` get the same checks, the memory
check too, and every problem the command line collects carries its own code."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import jax
import pytest

import meshplan
from meshplan.cli.factory import load_factory
from meshplan.cli.train import ModelSource, TrainRequest, prepare_run
from meshplan.cli.train.builtin_source import BuiltInSource
from meshplan.cli.train.factory_source import FactorySource
from meshplan.cli.train.findings import Findings
from meshplan.cli.train.prepare import source_for
from meshplan.layouts import get_layout
from meshplan.train import memory
from meshplan.train.device_mesh import make_mesh
from meshplan.train.memory import step_memory
from meshplan.train.settings import TrainSettings, make_optimizer

CLI = Path(meshplan.__file__).parent / "cli"
LINEN = "meshplan.examples.own_model:linen_classifier"
GPT2 = "meshplan.examples.third_party:gpt2"


def _problems(request: TrainRequest) -> list[meshplan.Problem]:
    with pytest.raises(meshplan.MeshplanError, match="meshplan train cannot start") as e:
        prepare_run(request)
    return list(e.value.problems)


def _budget(monkeypatch, spec: str, mesh: dict[str, int], rules: str, half: bool) -> int:
    """A device that holds the step of half the factory's batch (``half``), or its state and
    half of the rest of its step."""
    trainable = load_factory(spec).trainable
    settings = TrainSettings()
    abstract = trainable.model.abstract_state(make_optimizer(settings))
    batch = trainable.example_batch
    if half:
        rows = jax.tree.leaves(batch)[0].shape[0] // 2
        batch = jax.tree.map(lambda x: jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype), batch)
    cost = step_memory(trainable.model, abstract, batch, make_mesh(mesh), get_layout(rules))
    limit = (
        cost.memory_bytes
        if half
        else cost.state_bytes + (cost.memory_bytes - cost.state_bytes) // 2
    )
    monkeypatch.setattr(memory, "device_memory", lambda mesh: (limit, "a small test device"))
    return limit


def test_each_source_is_one_class_of_the_protocol():
    assert isinstance(source_for(TrainRequest(), None), BuiltInSource)
    assert isinstance(source_for(TrainRequest(model=LINEN), None), FactorySource)
    wanted = {n for n, v in vars(ModelSource).items() if inspect.isfunction(v) and n[0] != "_"}
    for source in (BuiltInSource, FactorySource):
        assert wanted <= {n for n, v in vars(source).items() if inspect.isfunction(v)}


@pytest.mark.parametrize(
    ("spec", "mesh", "rules"),
    [(LINEN, "2x4", "fsdp"), pytest.param(GPT2, "2x4", "data_parallel", marks=pytest.mark.slow)],
)
def test_a_factory_whose_step_does_not_fit_gets_the_built_in_model_s_memory_advice(
    monkeypatch, spec, mesh, rules
):
    sizes = dict(zip(("data", "model"), map(int, mesh.split("x")), strict=True))
    _budget(monkeypatch, spec, sizes, rules, half=spec != GPT2)
    [problem] = _problems(TrainRequest(model=spec, mesh=mesh, rules=rules))
    assert problem.code == "out-of-memory"
    assert f"a batch of --model {spec} (" in problem.message
    assert "per device (" in problem.message and "plan --profile predicts" in problem.message
    assert "but a device has about" in problem.message
    assert "(a small test device)" in problem.message
    rows = load_factory(spec).trainable.example_batch[0].shape[0]
    if spec == GPT2:  # 8 rows on 8 devices: one each, and even one does not fit
        assert problem.fix.startswith("Not one of the examples fits beside the state")
    else:
        largest = int(problem.fix.split("Return batches of ")[1].split()[0])
        assert rows // 2 <= largest < rows  # the step of half the batch fits
        assert "--grad-accum 2 (the same batch in microbatches" in problem.fix  # 2 rows a device
        assert "split 'batch' over more devices" in problem.fix
    # The built-in Transformer on the same small device: the same code, the same advice's form.
    [builtin] = _problems(TrainRequest(mesh=mesh, rules=rules, config="tiny"))
    assert builtin.code == "out-of-memory"
    assert builtin.message.split(" needs about ")[0] == "--batch 32"
    assert builtin.fix.startswith("Use --batch ") or builtin.fix.startswith("The state alone")


def test_a_factory_whose_state_alone_does_not_fit_is_told_to_split_it(monkeypatch):
    monkeypatch.setattr(memory, "device_memory", lambda mesh: (1, "a one-byte device"))
    [problem] = _problems(TrainRequest(model=LINEN, mesh="2x4", rules="fsdp"))
    assert problem.code == "out-of-memory"
    assert problem.fix.startswith("The state alone does not fit")


def test_a_factory_that_fits_trains_on_the_same_prepare_step():
    prepared = prepare_run(
        TrainRequest(model=LINEN, mesh="2x4", rules="fsdp", settings={"steps": 1})
    )
    assert isinstance(prepared.source, FactorySource)
    assert prepared.trainable is not None and prepared.corpus is None
    assert prepared.source.units == ("examples/s", "")


def test_findings_take_no_default_code():
    assert inspect.signature(Findings.add).parameters["code"].default is inspect.Parameter.empty


def _added_codes() -> list[tuple[str, int, str | None]]:
    """Every ``x.add(ErrorClass, message, fix, code, ...)`` call under cli/: its code, when a
    literal (``None`` when computed, e.g. a library problem's ``p.code``)."""
    found = []
    for path in sorted(CLI.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add"
                and node.args
                and ast.unparse(node.args[0]).endswith("Error")
            ):
                continue
            code = node.args[3] if len(node.args) > 3 else None
            code = code or next((k.value for k in node.keywords if k.arg == "code"), None)
            assert code is not None, f"{path.name}:{node.lineno} adds a problem without a code"
            literal = code.value if isinstance(code, ast.Constant) else None
            found.append((path.name, node.lineno, literal))
    return found


def test_every_problem_the_command_line_collects_carries_its_own_code():
    added = _added_codes()
    assert len(added) >= 40  # every collected problem of cli/train/ (37 before, 26 as "train")
    assert [(f, line) for f, line, code in added if code in ("train", "", "error")] == []


def test_bad_requests_give_problems_with_codes_and_flags():
    problems = _problems(
        TrainRequest(
            mesh="2x4",
            rules="fsdp_tp",
            settings={"steps": 0, "lr": -1.0},
            metrics="/no/such/folder/metrics.jsonl",
            resume=True,
            overrides={"num_layers": 0},
        )
    )
    codes = {p.code: p.path for p in problems}
    assert codes["setting-invalid"] in ("--steps", "--lr")
    assert codes["metrics-no-folder"] == "--metrics"
    assert codes["resume-without-ckpt-dir"] == "--resume"
    assert "model-config" in codes
    assert all(p.code not in ("train", "") for p in problems)


def test_the_library_finds_a_state_with_no_names_and_the_factory_source_only_words_it():
    from meshplan.train.build import build_parts

    unnamed = "meshplan.examples.third_party:jax_mlp"  # plain JAX: its arrays carry no names
    parts = {
        spec: build_parts(
            TrainSettings(),
            {"data": 2, "model": 4},
            None,
            "fsdp",
            load_factory(spec, None).trainable.model,
        )
        for spec in (unnamed, LINEN)
    }
    assert parts[unnamed].unnamed.code == "no-names" and parts[LINEN].unnamed is None
    source, request = FactorySource(unnamed), TrainRequest(model=unnamed, rules="fsdp")
    said = source.notes(request, parts[unnamed], ["resumed"])
    assert said[0].startswith(f"No array of --model {unnamed} carries a logical name")
    assert said[-1] == "resumed"
    assert source.notes(request, parts[LINEN], ["resumed"]) == ["resumed"]  # nothing to say
