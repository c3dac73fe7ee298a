"""The architecture holds: no import cycle, one-way layers, a flat public surface.

The layer contracts themselves are import-linter's (``[tool.importlinter]`` in
pyproject.toml, run by ``make test``); this file checks what they cannot: that no
two modules import each other, even through a chain, counting imports inside
functions and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import grimp
import pytest

import meshplan

SRC = Path(meshplan.__file__).parent


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(
        "meshplan", include_external_packages=False, exclude_type_checking_imports=False
    )


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_chain():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere_counting_function_and_type_checking_imports():
    graph = _graph()
    edges = {m: set(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    assert _cycles(edges) == []


def test_lower_layers_never_import_the_meshplan_package_itself():
    graph = _graph()
    importers = sorted(
        m
        for m in graph.find_modules_that_directly_import("meshplan")
        if not m.startswith(("meshplan.examples", "meshplan.models", "meshplan.cli"))
    )
    assert importers == []


@pytest.mark.parametrize("name", sorted(meshplan.__all__))
def test_public_classes_report_the_public_module(name):
    obj = getattr(meshplan, name)
    if inspect.isclass(obj):
        assert obj.__module__ == "meshplan", f"meshplan.{name} reports {obj.__module__}"


def test_errors_print_their_public_path_in_tracebacks():
    assert repr(meshplan.MeshError("x")) == "MeshError('x')"
    assert f"{meshplan.MeshError.__module__}.{meshplan.MeshError.__qualname__}" == (
        "meshplan.MeshError"
    )


def test_the_package_init_only_re_exports():
    tree = ast.parse((SRC / "__init__.py").read_text())
    defined = [
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    ]
    assert defined == []


def test_every_module_lives_in_a_subpackage_of_one_concern():
    flat = sorted(p.name for p in SRC.glob("*.py") if p.name not in ("__init__.py", "py.typed"))
    # The bottom layer's four small modules and the two public modules; the rest is packaged.
    assert flat == [
        "_errors.py",
        "_text.py",
        "_types.py",
        "_version.py",
        "layouts.py",
        "testing.py",
    ]


def test_every_module_is_in_the_architecture_page_and_every_listed_module_exists():
    page = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    index = page.split("## Every module", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `src/meshplan/([\w/]+\.py)` \|", index, flags=re.M))
    modules = {
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    assert sorted(modules - listed) == [], "add these to docs/architecture.md's 'Every module'"
    assert sorted(listed - modules) == [], "these are listed but no longer exist"


def _module_rows() -> list[tuple[str, str]]:
    page = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    index = page.split("## Every module", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `src/meshplan/([\w/]+\.py)` \| (.*) \|$", index, flags=re.M)


def test_every_module_row_says_what_it_holds_in_path_order():
    rows = _module_rows()
    assert [path for path, what in rows if len(what.strip()) < 20] == []
    paths = [path for path, _ in rows]
    assert paths == sorted(paths), "keep 'Every module' sorted by path"


def test_every_subpackage_is_a_layer_of_the_architecture_page():
    page = (SRC.parent.parent / "docs" / "architecture.md").read_text()
    layers = page.split("## The layers", 1)[1].split("\n## ", 1)[0]
    packages = sorted(p.parent.name for p in SRC.glob("*/__init__.py"))
    assert [p for p in packages if f"`meshplan.{p}`" not in layers] == []


TESTS = Path(__file__).parent
WHOLE_PROJECT = {
    "test_architecture.py",  # this file: the layers and the module index
    "test_docs.py",  # every code block of README.md and docs/
    "test_docstrings.py",  # the docstring rule over the public API
    "test_readme.py",  # the README's quick start
    "test_accelerator.py",  # the checks that need a GPU or TPU
    "test_accelerator_check.py",  # benchmarks/accelerator_check.sh in its CPU mode
}
"""The test files about the whole project, which sit at the top of ``tests/``."""


def test_test_folders_mirror_the_subpackages():
    packages = {p.name.lstrip("_") for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    folders = {p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "__pycache__"}
    unmatched = sorted(folders - packages)
    assert not unmatched, (
        f"tests/{unmatched[0]}/ mirrors no subpackage of meshplan ({sorted(packages)}): "
        "put its tests in the folder of the subpackage they test."
    )
    loose = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in WHOLE_PROJECT)
    assert not loose, (
        f"{loose} sit at the top of tests/: move each into the folder of the subpackage it "
        "tests (tests/spmd/, tests/plan/, ...), or add it to WHOLE_PROJECT if it is about the "
        "whole project."
    )


def _cli_flags() -> set[str]:
    """Every flag of every ``meshplan`` subcommand."""
    import argparse

    from meshplan.cli.app import build_parser

    flags: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        for action in parser._actions:
            flags |= {o for o in action.option_strings if o.startswith("--")}
            if isinstance(action, argparse._SubParsersAction):
                parsers.extend(action.choices.values())
    return flags


def _texts(tree: ast.Module) -> list[tuple[int, str]]:
    """The string literals of a module that it can print (f-strings' parts too), not its docs."""
    docs = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_no_library_text_names_a_command_line_flag():
    """Library messages give API-level fixes; ``meshplan.cli`` maps their codes to flags."""
    flags = _cli_flags()
    assert {"--mesh", "--seq", "--dtype", "--data", "--resume"} <= flags
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "cli":
            continue
        for line, value in _texts(ast.parse(path.read_text())):
            named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w-])", value)) & flags
            found += [f"{path.relative_to(SRC)}:{line}: {flag}" for flag in sorted(named)]
    assert found == [], "word these in API terms, with a code the command line maps to flags"


# A parameter that takes any pytree (and a result that is one) is rightly ``Any``; so are a
# dataclass's ``**updates``. Everything else in a public signature has a real type.
PYTREE_PARAMETERS = {"tree", "target", "template", "state", "updates", "val", "abstract_state"}
PYTREE_PARAMETERS |= {"example_batch"}
PYTREE_PARAMETERS |= {"params"}  # pipeline_layers: the stacked layers' parameters
PYTREE_RESULTS = {
    "Restored.into",
    "get_partition_spec",
    "get_sharding",
    "logical_to_mesh",
    "logical_to_mesh_sharding",
    "replace_boxed",
    "unbox",
}
_CONTAINERS = {"tuple", "list", "set", "frozenset", "Sequence", "Iterable", "Optional"}


def _bare_any(node: ast.expr) -> bool:
    """``Any``, a union with ``Any`` in it, or a container of ``Any`` (``tuple[Any, ...]``).

    ``dict[str, Any]`` (JSON-like data) and ``Callable[..., Any]`` are not bare.
    """
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) == "Any"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _bare_any(node.left) or _bare_any(node.right)
    if isinstance(node, ast.Subscript):
        base = node.value
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        if name in _CONTAINERS:
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return any(_bare_any(item) for item in items)
    return False


def _public_functions():
    """``(name, function)`` of everything in ``meshplan.__all__``, with the public methods,
    properties and constructors of its classes."""
    for name in meshplan.__all__:
        obj = getattr(meshplan, name)
        if inspect.isfunction(obj):
            yield name, obj
        elif inspect.isclass(obj):
            for attr, value in vars(obj).items():
                if attr.startswith("_") and attr != "__init__":
                    continue
                if isinstance(value, staticmethod | classmethod):
                    value = value.__func__
                if isinstance(value, property):
                    value = value.fget
                if inspect.isfunction(value):
                    yield f"{name}.{attr}", value


def _bare_anys(name: str, fn: object) -> list[str]:
    signature = inspect.signature(fn)
    found = []
    annotated = [(p.name, p.annotation) for p in signature.parameters.values()]
    for param, annotation in [*annotated, ("return", signature.return_annotation)]:
        if annotation is inspect.Parameter.empty:
            continue
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        if not _bare_any(ast.parse(text, mode="eval").body):
            continue
        if param in PYTREE_PARAMETERS or (param == "return" and name in PYTREE_RESULTS):
            continue
        found.append(f"{name}({param}: {text})")
    return found


def test_the_bare_any_finder_tells_a_bare_any_from_json_data():
    def bare(text: str) -> bool:
        return _bare_any(ast.parse(text, mode="eval").body)

    assert bare("Any") and bare("typing.Any") and bare("str | Any") and bare("tuple[Any, ...]")
    assert not bare("dict[str, Any]") and not bare("Callable[..., Any]") and not bare("MeshLike")


def test_public_signatures_have_no_bare_any_but_pytrees():
    functions = dict(_public_functions())
    assert {"check", "Plan.table", "Partitioned.__init__", "active_mesh"} <= set(functions)
    found = [f for name, fn in functions.items() for f in _bare_anys(name, fn)]
    assert found == [], (
        "give these a real type (meshplan._spmd.mesh_info.MeshLike, ..._spmd.rules.LogicalNames, "
        "...), or add a parameter that takes any pytree to PYTREE_PARAMETERS"
    )


def _meshplan_errors() -> set[str]:
    import meshplan._errors as errors

    return {
        name
        for name, value in vars(errors).items()
        if isinstance(value, type) and issubclass(value, errors.MeshplanError)
    }


def test_every_library_error_carries_its_problem_records():
    """A library error is built with its :class:`meshplan.Problem` records (``error_for``,
    ``error_from_problems``, or the class with ``problems``), so that a caller (the command
    line) reads a code, never the message's text. The command line's own errors, which it
    prints and nobody reads back, may be bare."""
    classes = _meshplan_errors()
    assert {"MeshplanError", "CheckpointError", "ArgumentError"} <= classes
    bare = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] == "cli" or path.name == "_errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in classes and len(node.args) + len(node.keywords) < 2:
                bare.append(f"{path.relative_to(SRC)}:{node.lineno}: {name}")
    assert bare == [], "raise these with error_for(...) or with their Problem records"
