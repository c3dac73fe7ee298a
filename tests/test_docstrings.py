"""The house rule, enforced: every public API object has a docstring with a ``>>>`` example.

The examples themselves run as doctests (``--doctest-modules`` over ``src/meshplan``);
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
