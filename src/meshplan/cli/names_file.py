"""``--names FILE`` of ``meshplan plan``, ``search`` and ``train``, and what they say of a model with no names.

The file holds path rules (:func:`meshplan.layouts.get_names`: ``.json`` pairs or
a ``.py`` file defining ``NAMES``) that name a ``--model pkg.module:factory``'s
arrays (:mod:`meshplan.cli.factory_names`). A model whose arrays carry no names
under the rules given is said first, in flags (the library's problem
``'no-names'`` names functions).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from meshplan._errors import ArgumentError, Problem, error_for
from meshplan._spmd.by_path import PathRules

__all__ = [
    "INFER",
    "NAMES_HELP",
    "add_names_argument",
    "factory_rules",
    "inferred_names",
    "no_names_text",
    "notes_text",
    "read_names",
    "refuse_names",
]

NAMES_HELP = (
    "a .json file of [pattern, names] pairs, or a .py file defining NAMES: logical names for "
    "the arrays of a --model pkg.module:factory written without them (a regex matched in full "
    "against the paths the plan prints, e.g. params/transformer/h/0/mlp/c_fc/kernel, first "
    "match wins; one name or null per dimension; docs/any_model.md); or 'infer': names "
    "inferred from the model's train step (meshplan.infer_names, docs/infer.md)"
)

INFER = "infer"
"""``--names infer``: the names :func:`meshplan.infer_names` reads from the factory's step."""


def add_names_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Adds ``--names FILE``."""
    parser.add_argument("--names", default=None, metavar="FILE", help=NAMES_HELP)


def read_names(names: str | None, model: str | None) -> PathRules | None:
    """The path rules of ``--names`` (``None`` without it), for a factory's ``--model``.

    Example:
        >>> from meshplan.cli.names_file import read_names
        >>> read_names(None, "mlp") is None
        True
        >>> read_names("names.json", "transformer")
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: --names names the arrays of a --model pkg.module:factory; --model transformer carries its own names.
        Leave out --names, or pass --model mymodels:make_model.

    ``--names infer`` infers them from the factory's train step (:func:`inferred_names`).

    Raises:
        ArgumentError: ``--names`` with a built-in model (code ``'names-built-in'``).
        LogicalNamesError: a file that is missing or does not hold valid pairs.
    """
    if names is None:
        return None
    refuse_names(names, model)
    if names == INFER:
        assert model is not None  # refused above
        return inferred_names(model)
    from meshplan.layouts import get_names

    return get_names(names)


def refuse_names(names: str | None, model: str | None) -> None:
    """Refuses ``--names`` for a built-in model (code ``'names-built-in'``): its arrays carry
    their own names.

    Example:
        >>> from meshplan.cli.names_file import refuse_names
        >>> refuse_names("names.json", "mymodels:make_model")  # a factory's: nothing to refuse
    """
    if names is not None and (model is None or ":" not in model):
        raise error_for(
            ArgumentError,
            "names-built-in",
            "--names",
            f"--names names the arrays of a --model pkg.module:factory; --model "
            f"{model or 'transformer'} carries its own names",
            "Leave out --names, or pass --model mymodels:make_model.",
        )


def inferred_names(model: str) -> PathRules:
    """The path rules :func:`meshplan.infer_names` reads from ``model``'s train step (the
    factory loaded without names, traced once), for its parameters: the rules that leave an
    array alone (the step count, Adam's count) are left out, as a factory's names apply to
    the parameters it initialises (:func:`factory_rules`).

    Example:
        >>> from meshplan.cli.names_file import inferred_names
        >>> dict(inferred_names("meshplan.examples.third_party:jax_mlp"))["(?:.*/)?w1"]
        ('dim_16', 'embed')
    """
    import meshplan
    from meshplan.cli.factory import load_factory

    loaded = load_factory(model, None)
    return factory_rules(
        meshplan.infer_names(loaded.step_fn, loaded.abstract_state, loaded.example_batch)
    )


def factory_rules(path_rules: PathRules) -> PathRules:
    """``path_rules`` less those that leave arrays alone (``names`` ``None``): a factory's
    names are given to its parameters, where no step count or optimizer count is.

    Example:
        >>> from meshplan.cli.names_file import factory_rules
        >>> factory_rules([("w", ("embed",)), ("step", None)])
        [('w', ('embed',))]
    """
    return [(p, n) for p, n in path_rules if n is not None]


def no_names_text(problems: Sequence[Problem], model: str, rules: str) -> str | None:
    """What to say first when no array of ``model`` carries a name under ``rules``, or ``None``.

    Example:
        >>> import meshplan
        >>> from meshplan.cli.names_file import no_names_text
        >>> p = meshplan.Problem("warning", "params/w", "no array ...", "Name them.", "no-names")
        >>> print(no_names_text([p], "mymodels:gpt2", "fsdp"))
        No array of --model mymodels:gpt2 carries a logical name: the rules fsdp place nothing, every array is replicated.
        Pass --names FILE: [pattern, names] pairs that name them by path (docs/any_model.md), or name them in the model (meshplan.name_by_path, meshplan.infer_names, with_logical_partitioning).
    """
    found = [p for p in problems if p.code == "no-names"]
    if not found:
        return None
    return (
        f"No array of --model {model} carries a logical name: the rules {rules} place "
        f"nothing, every array is replicated.\nPass --names FILE: [pattern, names] pairs that "
        f"name them by path (docs/any_model.md), or name them in the model "
        f"(meshplan.name_by_path, meshplan.infer_names, with_logical_partitioning)."
    )


def notes_text(notes: Sequence[str]) -> list[str]:
    """What naming by ``--names`` warned of, one line each, as the commands say it.

    Example:
        >>> from meshplan.cli.names_file import notes_text
        >>> notes_text(["name_by_path: 1 array that no pattern matches stays unnamed: b."])
        ['--names: 1 array that no pattern matches stays unnamed: b.']
    """
    return [f"--names: {n.removeprefix('name_by_path: ')}" for n in notes]
