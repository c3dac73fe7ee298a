"""``meshplan search`` of a model with no names: the names it inferred, said and written.

:func:`meshplan.search_rules` names a model that carries no logical name from its
train step (:func:`meshplan.infer_names`); this module says which names it gave
(each with its size and role), writes them with ``--names-out PATH`` (the JSON
``[pattern, names]`` pairs ``--names`` reads back, to edit and pass on; a factory's
names are its parameters', :func:`meshplan.cli.names_file.factory_rules`), and gives
the ``meshplan train`` command its ``--names`` (that file, else ``infer``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from meshplan.cli.names_file import INFER, factory_rules

__all__ = ["add_names_out_argument", "names_flag", "names_json", "names_lines", "write_names"]


def names_json(result: Any) -> list[list[Any]]:
    """The inferred names as ``--json`` gives them (what ``--names-out`` writes)."""
    return [[p, list(n or ())] for p, n in factory_rules(result.path_rules or ())]


def add_names_out_argument(parser: argparse.ArgumentParser) -> None:
    """Adds ``--names-out PATH``."""
    parser.add_argument(
        "--names-out",
        metavar="PATH",
        default=None,
        help="for a model with no names (searched with names inferred from its step): write "
        "those names here, as the [pattern, names] pairs --names reads (JSON)",
    )


def write_names(args: argparse.Namespace, result: Any) -> Path | None:
    """Writes the inferred names to ``--names-out`` (where the search inferred some)."""
    out = getattr(args, "names_out", None)
    if out is None or result.path_rules is None:
        return None
    path = Path(out)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    pairs = [json.dumps([p, list(n or ())]) for p, n in factory_rules(result.path_rules)]
    path.write_text("[\n  " + ",\n  ".join(pairs) + "\n]\n", encoding="utf-8")
    return path


def names_flag(args: argparse.Namespace, result: Any, written: Path | None) -> str | None:
    """The ``--names`` of the ``meshplan train`` command: the file given or written, else
    ``infer`` where the search inferred the names, else ``None``.

    Example:
        >>> import argparse
        >>> from meshplan.cli.inferred import names_flag
        >>> class R: path_rules = [("w", ("embed",))]
        >>> names_flag(argparse.Namespace(names=None), R(), None)
        'infer'
    """
    if args.names and args.names != INFER:
        return str(args.names)
    if written is not None:
        return str(written)
    return INFER if result.path_rules is not None or args.names == INFER else None


def names_lines(result: Any, written: Path | None) -> list[str]:
    """What the search says of the names it inferred (nothing for a named model).

    Example:
        >>> from meshplan.cli.inferred import names_lines
        >>> from meshplan import InferredNames, NameClass
        >>> class R: path_rules = InferredNames([("w", ("embed", "mlp"))],
        ...     [NameClass("embed", 64, "residual stream", 1), NameClass("mlp", 256, "MLP hidden", 1)])
        >>> print("\\n".join(names_lines(R(), None)))
        names inferred from the step (the model has none): embed 64 (residual stream), mlp 256 (MLP hidden)
        names not written: pass --names-out PATH to write them (JSON), edit them, pass them back with --names
    """
    rules = result.path_rules
    if rules is None:
        return []
    classes = getattr(rules, "classes", ())
    said = ", ".join(f"{c.name} {c.size} ({c.role})" for c in classes) or f"{len(rules)} rules"
    lines = [f"names inferred from the step (the model has none): {said}"]
    if written is None:
        lines.append(
            "names not written: pass --names-out PATH to write them (JSON), edit them, "
            "pass them back with --names"
        )
    else:
        lines.append(f"names written to {written} (edit them, pass them back with --names)")
    return lines
