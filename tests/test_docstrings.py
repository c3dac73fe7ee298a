"""The house rule, enforced: every public API object has a docstring with a ``>>>`` example.

The examples run as doctests: ``--doctest-modules`` over ``src/meshplan`` runs most, and
the methods of public classes (which it cannot see) run here;
this test makes sure none is missing. It covers every name in ``meshplan.__all__``
except exception classes and plain constants, and every public method (and property)
defined on those classes.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest

import meshplan


def _public_api() -> list[tuple[str, Any]]:
    """``(dotted name, function or class)`` for every object that needs an example."""
    table: list[tuple[str, Any]] = []
    for name in meshplan.__all__:
        obj = getattr(meshplan, name)
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue  # exceptions: their message is the documentation
        if not callable(obj):
            continue  # plain constants such as PARTITION_NAME
        table.append((name, obj))
        if not inspect.isclass(obj):
            continue
        for attr, member in vars(obj).items():  # defined on the class itself, not inherited
            if attr.startswith("_"):
                continue
            if isinstance(member, (classmethod, staticmethod)):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if inspect.isfunction(member):
                table.append((f"{name}.{attr}", member))
    return table


API = _public_api()


def test_the_table_covers_the_api() -> None:
    names = {name for name, _ in API}
    assert {
        "Checkpointer",
        "Checkpointer.save",
        "Partitioned.get_sharding",
        "LogicallyPartitioned.unbox",
        "Partitioned.from_nnx_metadata",
        "CheckpointMetadata.axis_names",
        "explain",
    } <= names
    assert not names & {"PARTITION_NAME", "MeshplanError", "CheckpointError"}


@pytest.mark.parametrize(("name", "obj"), API, ids=[name for name, _ in API])
def test_public_api_has_a_doctested_example(name: str, obj: Any) -> None:
    # obj.__doc__, not inspect.getdoc: an override must not borrow its parent's example.
    doc = obj.__doc__ or ""
    assert ">>>" in doc, (
        f"meshplan.{name} has no `>>>` example in its docstring. Add a short, cheap one "
        f"under an 'Example:' section (it runs as a doctest)."
    )
    # --doctest-modules only collects objects from the module that defines them.
    assert obj.__module__.startswith("meshplan"), (
        f"meshplan.{name} is defined in {obj.__module__}, outside meshplan: its example "
        f"would not run as a doctest."
    )


def _public_methods() -> list[tuple[str, Any]]:
    """Methods (and class/static methods) of the public classes: ``--doctest-modules`` misses
    them, because the class reports ``__module__ == "meshplan"`` while the method's globals
    are its defining module's, so neither module's doctest finder claims them."""
    out = []
    for name in meshplan.__all__:
        cls = getattr(meshplan, name)
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for attr, member in vars(cls).items():
            if isinstance(member, (classmethod, staticmethod)):
                member = member.__func__
            if not attr.startswith("_") and inspect.isfunction(member) and member.__doc__:
                out.append((f"{name}.{attr}", member))
    return out


METHODS = _public_methods()


def test_the_method_table_holds_what_the_module_finder_misses() -> None:
    names = {name for name, _ in METHODS}
    assert {"Checkpointer.save", "Partitioned.replace_boxed", "Plan.save_png"} <= names


@pytest.mark.parametrize(("name", "method"), METHODS, ids=[name for name, _ in METHODS])
@pytest.mark.slow
def test_examples_of_public_methods_run(name: str, method: Any) -> None:
    import doctest

    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(
        optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS, verbose=False
    )
    for test in finder.find(method, f"meshplan.{name}", module=False, globs={}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"the example of meshplan.{name} fails (output above)"
