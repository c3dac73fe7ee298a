"""Built-in layouts: logical axis rules for a mesh with axes ``('data', 'model')``.

The context-parallel layouts (:data:`context_parallel`, :data:`fsdp_cp`) are
for a mesh with axes ``('data', 'context')``, the expert-parallel ones
(:data:`expert_parallel`, :data:`fsdp_ep`) for ``('data', 'expert')``
(``meshplan train --mesh 2x4 --axes data,context --rules fsdp_cp``). The pipeline
layouts (:data:`pipeline`, :data:`pp_fsdp`) are for ``('pipeline', 'data')``,
:data:`pp_tp` for ``('pipeline', 'data', 'model')``: they map the stage
dimension ``stage`` and the stored layer stack ``layer`` to ``pipeline``
(``meshplan train --rules pipeline --mesh 4x2 --microbatches 8``).

Each layout is a plain tuple of ``(logical_name, mesh_axes)`` rules that covers
every name of the Transformer's vocabulary (``batch``, ``length``, ``embed``,
``heads``, ``kv``, ``mlp``, ``vocab``, ``layer``; see
:mod:`meshplan.models.transformer`; the expert-parallel layouts also
``expert``, ``expert_batch`` and ``capacity``, :mod:`meshplan.models.moe`). RulePairs are applied in order, so
``batch`` comes first: an activation named ``('batch', 'length', 'embed')``
gives its mesh axes to ``batch``, and ``embed`` (which a parameter may shard
over the same axes) stays whole in activations.

Pick one by name (:func:`get_layout`), or write your own in a ``.py`` file
(defining ``RULES``) or a ``.json`` file (a list of ``[name, axes]`` pairs).

Example:
    >>> import meshplan, meshplan.layouts
    >>> rules = meshplan.layouts.get_layout("fsdp_tp")
    >>> meshplan.logical_to_mesh_axes(("embed", "mlp"), rules)
    P('data', 'model')
    >>> meshplan.logical_to_mesh_axes(("batch", "length", "embed"), rules)
    P('data', None, None)
"""

from __future__ import annotations

import inspect
import json
import os
import runpy
from typing import Any

from meshplan._errors import (
    LogicalNamesError,
    MeshplanError,
    RulesError,
    bullets,
    error_for,
    error_from_problems,
)
from meshplan._spmd.by_path import check_path_rules
from meshplan._spmd.rules import RulePairs, check_rules

__all__ = [
    "ALL_LAYOUTS",
    "CONTEXT_EXPERT_LAYOUTS",
    "LAYOUTS",
    "LAYOUT_AXES",
    "context_parallel",
    "data_parallel",
    "expert_parallel",
    "fsdp",
    "fsdp_cp",
    "fsdp_ep",
    "fsdp_tp",
    "get_layout",
    "get_names",
    "guide",
    "list_layouts",
    "pipeline",
    "pp_fsdp",
    "pp_tp",
    "tensor_parallel",
]

_DATA_MODEL = ("data", "model")
_CONTEXT = ("data", "context")
_EXPERT = ("data", "expert")
_PIPELINE = ("pipeline", "data")
_PIPELINE_TP = ("pipeline", "data", "model")

_REGISTRY: dict[str, tuple[RulePairs, tuple[str, ...], str]] = {}
"""Every built-in layout by name: its rules, the mesh axes it is written for, its description."""


def _layout(name: str, axes: tuple[str, ...], doc: str, rules: RulePairs) -> RulePairs:
    """Registers a built-in layout (its one entry: rules, axes and description) and returns
    its rules."""
    _REGISTRY[name] = (rules, axes, inspect.cleandoc(doc))
    return rules


data_parallel: RulePairs = _layout(
    "data_parallel",
    _DATA_MODEL,
    """Data parallel: the batch split over all devices, every parameter replicated.

Shards ``batch`` over ``('data', 'model')`` (all 8 devices of a 2x4 mesh);
every parameter and optimizer state is whole on every device, and gradients
are all-reduced each step. Pick it when the model and its Adam state fit on
one device several times over: it is the simplest layout and moves the fewest
bytes for small models. The batch must be a multiple of the device count.
""",
    (
        ("batch", ("data", "model")),
        ("length", None),
        ("embed", None),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
        ("layer", None),
    ),
)


fsdp: RulePairs = _layout(
    "fsdp",
    _DATA_MODEL,
    """Fully sharded data parallel (ZeRO-3): batch and parameters split over all devices.

Shards ``batch`` over ``('data', 'model')`` as :data:`data_parallel` does, and
every parameter's ``embed`` dimension over the same axes, so each device keeps
1/8 of the parameters and of the optimizer state. Parameters are all-gathered
before use and gradients reduce-scattered. Pick it when parameters plus
optimizer state no longer fit one device but activations do. ``embed_dim``
and the batch must be multiples of the device count.
""",
    (
        ("batch", ("data", "model")),
        ("embed", ("data", "model")),
        ("length", None),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
        ("layer", None),
    ),
)


tensor_parallel: RulePairs = _layout(
    "tensor_parallel",
    _DATA_MODEL,
    """Tensor parallel (Megatron-style): heads, MLP and vocabulary split over ``model``.

Shards ``batch`` over ``data`` only, and the ``heads``, ``mlp`` and ``vocab``
dimensions of parameters and activations over ``model``: each block needs one
all-reduce of activations in the forward pass per attention and per MLP.
Parameters are replicated over ``data``. Pick it for wide layers (large
``mlp_dim``/``heads``) on fast interconnect, or when the batch per device
would be too small for data parallel. ``num_heads``, ``mlp_dim`` and
``vocab_size`` must be multiples of the ``model`` axis size.
""",
    (
        ("batch", "data"),
        ("heads", "model"),
        ("mlp", "model"),
        ("vocab", "model"),
        ("length", None),
        ("embed", None),
        ("kv", None),
        ("layer", None),
    ),
)


fsdp_tp: RulePairs = _layout(
    "fsdp_tp",
    _DATA_MODEL,
    """FSDP over ``data`` combined with tensor parallel over ``model`` (2-D sharding).

Shards ``batch`` and the parameters' ``embed`` dimension over ``data`` and
``heads``, ``mlp`` and ``vocab`` over ``model``: every weight matrix is split
over all devices (``('embed', 'mlp')`` becomes ``P('data', 'model')``), and
activations are split by batch over ``data`` and by heads/MLP over ``model``.
Pick it for the largest models: per-device state is as small as with
:data:`fsdp`, with less gathering of parameters per step.
""",
    (
        ("batch", "data"),
        ("embed", "data"),
        ("heads", "model"),
        ("mlp", "model"),
        ("vocab", "model"),
        ("length", None),
        ("kv", None),
        ("layer", None),
    ),
)


context_parallel: RulePairs = _layout(
    "context_parallel",
    _CONTEXT,
    """Context parallel: the batch over ``data``, every sequence split along ``length`` over ``context``.

For a mesh with axes ``('data', 'context')``. Each device holds its examples'
activations for ``1/context`` of the positions, so activation memory falls
about as ``1/context``; parameters are replicated. Attention stays exact: keys
and values are all-gathered over ``context`` once per layer, and the sequence
is fed in load-balanced order so that the causal mask leaves every shard the
same work (:mod:`meshplan.models.context`). Pick it for long sequences,
when one sequence's activations no longer fit a device (the batch per device
cannot go below one sequence). The sequence length must be a multiple of
``2 * context``.
""",
    (
        ("batch", "data"),
        ("length", "context"),
        ("embed", None),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
        ("layer", None),
    ),
)


fsdp_cp: RulePairs = _layout(
    "fsdp_cp",
    _CONTEXT,
    """FSDP over all devices combined with context parallel over ``context``.

For a mesh with axes ``('data', 'context')``. Activations are split as in
:data:`context_parallel` (batch over ``data``, ``length`` over ``context``),
and every parameter's ``embed`` dimension over both axes, so each device keeps
``1/devices`` of the parameters and optimizer state; they are all-gathered
before use and gradients reduce-scattered. Pick it for long sequences of a
model whose state does not fit one device either. ``embed_dim`` must be a
multiple of the device count, the sequence length of ``2 * context``.
""",
    (
        ("batch", "data"),
        ("length", "context"),
        ("embed", ("data", "context")),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
        ("layer", None),
    ),
)


expert_parallel: RulePairs = _layout(
    "expert_parallel",
    _EXPERT,
    """Expert parallel: each device of the ``expert`` axis holds its own experts; data parallel elsewhere.

For a mesh with axes ``('data', 'expert')`` and a mixture-of-experts model
(``TransformerConfig(num_experts=E)``). The batch is split over all devices, as in
:data:`data_parallel`; the experts' weights (``'expert'`` dimension) over the
``expert`` axis, so each device keeps ``E / expert`` experts. Tokens go to
their experts by an all-to-all over ``expert`` (the dispatched tokens are
named ``('expert', 'expert_batch', 'capacity', 'embed')``, ``expert_batch``
over ``data``) and come back by another. Pick it when the experts' weights
dominate the model: they are never replicated nor gathered. ``num_experts``
must be a multiple of the ``expert`` axis size.
""",
    (
        ("batch", ("data", "expert")),
        ("expert", "expert"),
        ("expert_batch", "data"),
        ("capacity", None),
        ("length", None),
        ("embed", None),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
        ("layer", None),
    ),
)


fsdp_ep: RulePairs = _layout(
    "fsdp_ep",
    _EXPERT,
    """Expert parallel over ``expert`` combined with FSDP: every weight split over the devices.

For a mesh with axes ``('data', 'expert')``. As :data:`expert_parallel`, and
the dense parameters' ``embed`` dimension over all devices (FSDP), the
experts' ``embed`` dimension over ``data`` (their ``expert`` dimension holds
the ``expert`` axis): each device keeps ``1/devices`` of every weight. Pick
it for a large MoE model whose dense part does not fit one device either.
""",
    (
        ("batch", ("data", "expert")),
        ("expert", "expert"),
        ("expert_batch", "data"),
        ("embed", ("data", "expert")),
        ("embed", "data"),
        ("capacity", None),
        ("length", None),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
        ("layer", None),
    ),
)


pipeline: RulePairs = _layout(
    "pipeline",
    _PIPELINE,
    """Pipeline parallel: the layers split into stages over ``pipeline``, the batch over ``data``.

For a mesh with axes ``('pipeline', 'data')``. The stored ``('layer', ...)``
stack of the scanned blocks is split over ``pipeline`` (stage ``s`` of ``p``
holds layers ``s L/p`` to ``(s+1) L/p - 1``), and in the step the blocks run as a
pipeline of ``p`` stages (``'stage'`` on ``pipeline``) over the config's
``microbatches`` (:class:`meshplan.PipelineSchedule`; ``pipeline_repeats``
for the circular schedule); only activations, and their gradients, move
between stages. The embedding and head are replicated, the batch split over
``data``. Pick it across slow links (between hosts or slices), where FSDP's
gathers or tensor parallelism's all-reduces would wait on the network; the
bubble ``(p - 1) / (M v + p - 1)`` is the price. ``num_layers`` must be a
multiple of ``p`` (times the repeats), the batch of the microbatches.
""",
    (
        ("batch", "data"),
        ("stage", "pipeline"),
        ("layer", "pipeline"),
        ("length", None),
        ("embed", None),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
    ),
)


pp_fsdp: RulePairs = _layout(
    "pp_fsdp",
    _PIPELINE,
    """Pipeline parallel over ``pipeline`` combined with FSDP over ``data``.

For a mesh with axes ``('pipeline', 'data')``. As :data:`pipeline`, and every
parameter's ``embed`` dimension split over ``data`` (each stage's layers
sharded over its ``data`` devices, gathered before use): each device keeps
``1 / devices`` of the blocks' parameters and optimizer state. Pick it when
one stage's layers do not fit a device either.
""",
    (
        ("batch", "data"),
        ("stage", "pipeline"),
        ("layer", "pipeline"),
        ("embed", "data"),
        ("length", None),
        ("heads", None),
        ("kv", None),
        ("mlp", None),
        ("vocab", None),
    ),
)


pp_tp: RulePairs = _layout(
    "pp_tp",
    _PIPELINE_TP,
    """Pipeline parallel over ``pipeline``, tensor parallel over ``model``, batch over ``data``.

For a mesh with axes ``('pipeline', 'data', 'model')``. As
:data:`pipeline`, and the ``heads``, ``mlp`` and ``vocab`` dimensions split
over ``model`` as in :data:`tensor_parallel`, Megatron-LM's 3-D layout: tensor
parallelism inside a host, the pipeline between hosts, data parallel over the
rest. ``num_heads``, ``mlp_dim`` and ``vocab_size`` must be multiples of the
``model`` axis size.
""",
    (
        ("batch", "data"),
        ("stage", "pipeline"),
        ("layer", "pipeline"),
        ("heads", "model"),
        ("mlp", "model"),
        ("vocab", "model"),
        ("length", None),
        ("embed", None),
        ("kv", None),
    ),
)


guide: RulePairs = _layout(
    "guide",
    _DATA_MODEL,
    """The guide's rules, for its MLP demo: ``batch`` over ``data``, ``hidden`` over ``model``.

They do not cover the Transformer's vocabulary; use them with
:mod:`meshplan.models.mlp`.
""",
    (("batch", "data"), ("hidden", "model")),
)


LAYOUTS: dict[str, RulePairs] = {n: r for n, (r, a, _) in _REGISTRY.items() if a == _DATA_MODEL}
"""The built-in layouts for a mesh with axes ``('data', 'model')``, by name."""

CONTEXT_EXPERT_LAYOUTS: dict[str, RulePairs] = {
    n: r for n, (r, a, _) in _REGISTRY.items() if a != _DATA_MODEL
}
"""The built-in layouts for meshes with a ``context``, an ``expert`` or a ``pipeline`` axis, by name."""

ALL_LAYOUTS: dict[str, RulePairs] = {**LAYOUTS, **CONTEXT_EXPERT_LAYOUTS}
"""Every built-in layout by name: :data:`LAYOUTS` and :data:`CONTEXT_EXPERT_LAYOUTS`."""

LAYOUT_AXES: dict[str, tuple[str, ...]] = {n: _REGISTRY[n][1] for n in ALL_LAYOUTS}
"""The mesh axis names each built-in layout is written for.

Example:
    >>> import meshplan.layouts
    >>> meshplan.layouts.LAYOUT_AXES["fsdp_cp"]
    ('data', 'context')
"""


def list_layouts() -> list[tuple[str, str]]:
    """The built-in layouts as ``(name, one-line description)`` pairs, for the CLI.

    Example:
        >>> import meshplan.layouts
        >>> [name for name, _ in meshplan.layouts.list_layouts()][:5]
        ['data_parallel', 'fsdp', 'tensor_parallel', 'fsdp_tp', 'guide']
        >>> [name for name, _ in meshplan.layouts.list_layouts()][5:]
        ['context_parallel', 'fsdp_cp', 'expert_parallel', 'fsdp_ep', 'pipeline', 'pp_fsdp', 'pp_tp']
    """
    return [(name, _REGISTRY[name][2].split("\n", 1)[0]) for name in ALL_LAYOUTS]


def describe_layout(name: str) -> str:
    """The full description of a built-in layout (its docstring).

    Example:
        >>> import meshplan.layouts
        >>> "Pick it" in meshplan.layouts.describe_layout("fsdp")
        True
        >>> meshplan.layouts.describe_layout("zero3")
        Traceback (most recent call last):
        ...
        meshplan.RulesError: Unknown layout 'zero3'. Built-in layouts: ...
    """
    if name not in ALL_LAYOUTS:
        raise _unknown_layout(
            name, "Pick one of those (meshplan.layouts.list_layouts() describes each)."
        )
    return _REGISTRY[name][2]


def _unknown_layout(name: str, fix: str) -> MeshplanError:
    """A name that is no built-in layout (code ``'unknown-layout'``)."""
    message = f"Unknown layout {name!r}. Built-in layouts: {', '.join(ALL_LAYOUTS)}"
    return error_for(RulesError, "unknown-layout", "layout", message, fix)


def _file_error(
    path: str, problem: str, fix: str, what: str = "rules", error: type[MeshplanError] = RulesError
) -> MeshplanError:
    """A rules (or names) file that cannot be read (code ``'rules-file'`` or ``'names-file'``)."""
    message = f"Cannot read {what} from {path!r}: {problem.removesuffix('.')}"
    return error_for(error, f"{what}-file", path, message, fix)


def _axes_from_json(entry: object) -> Any:
    if entry is None or isinstance(entry, str):
        return entry
    if isinstance(entry, list) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise TypeError(entry)


def _json_list(path: str, fix: str, what: str, error: type[MeshplanError]) -> list[object]:
    """The top-level JSON list of ``path``; the error names the line and column of bad JSON."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise _file_error(
            path,
            f"not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}).",
            fix,
            what,
            error,
        ) from None
    if not isinstance(data, list):
        raise _file_error(
            path, f"the top level is a JSON {type(data).__name__}, not a list.", fix, what, error
        )
    return data


def _load_json(path: str) -> RulePairs:
    fix = 'Write a list of [name, axes] pairs, e.g. [["batch", "data"], ["mlp", "model"], ["embed", null]].'
    data = _json_list(path, fix, "rules", RulesError)
    rules = []
    problems = []
    for i, pair in enumerate(data):
        if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
            problems.append(f"rules[{i}]: {json.dumps(pair)} is not a [name, axes] pair")
            continue
        try:
            rules.append((pair[0], _axes_from_json(pair[1])))
        except TypeError:
            problems.append(
                f"rules[{i}]: the axes {json.dumps(pair[1])} are not a string, a list of strings "
                f"or null"
            )
    if problems:
        raise _file_error(
            path, f"not [name, axes] pairs (rules[i] is entry i, from 0):\n{bullets(problems)}", fix
        )
    return tuple(rules)


def _load_py(
    path: str,
    keys: tuple[str, str] = ("RULES", "rules"),
    fix: str = "Define RULES = (('batch', 'data'), ('mlp', 'model'), ...) at the top level of the "
    "file.",
    what: str = "rules",
    error: type[MeshplanError] = RulesError,
) -> object:
    """What the file defines as ``keys[0]`` (or ``keys[1]``), as it is: the caller validates it."""
    try:
        namespace = runpy.run_path(path)
    except KeyboardInterrupt:
        raise
    except SystemExit as e:  # exit() or sys.exit() in the file: never end the caller
        raise _file_error(
            path,
            f"running it called exit (SystemExit with code {e.code!r}), which would end the caller.",
            f"Remove the exit()/sys.exit() call from the {what} file: it is run, not launched. "
            + fix,
            what,
            error,
        ) from None
    except BaseException as e:  # anything else the file raises, named
        raise _file_error(
            path, f"running it raised {type(e).__name__}: {e}", fix, what, error
        ) from e
    for key in keys:
        if key in namespace:
            return namespace[key]
    raise _file_error(path, f"it defines neither {keys[0]} nor {keys[1]}.", fix, what, error)


def get_layout(name_or_path: str | os.PathLike[str]) -> RulePairs:
    """RulePairs by built-in name, or from a ``.py`` file (``RULES``) or a ``.json`` file.

    Example:
        >>> import meshplan.layouts
        >>> meshplan.layouts.get_layout("guide")
        (('batch', 'data'), ('hidden', 'model'))

    Args:
        name_or_path: A name from :data:`ALL_LAYOUTS`, or the path of a Python file
            defining ``RULES`` (or ``rules``), or of a JSON file holding a list
            of ``[name, axes]`` pairs (axes a string, a list of strings, or null).

    Returns:
        The rules, validated, as a tuple of pairs.

    Raises:
        RulesError: an unknown name (the message lists the built-in ones), or
            a file that is missing, unreadable or does not hold valid rules.
    """
    text = os.fspath(name_or_path)
    if text in ALL_LAYOUTS:
        return ALL_LAYOUTS[text]
    is_path = text.endswith((".py", ".json")) or os.sep in text or os.path.exists(text)
    if not is_path:
        raise _unknown_layout(
            text,
            "Pick one of those, or give the path of a .py file defining RULES or of a "
            ".json file of [name, axes] pairs.",
        )
    if not os.path.isfile(text):
        raise _file_error(
            text,
            "no such file." if not os.path.exists(text) else "it is not a file.",
            f"Give a built-in layout ({', '.join(ALL_LAYOUTS)}) or the path of a .py or .json "
            "rules file.",
        )
    if text.endswith(".json"):
        rules: object = _load_json(text)
    elif text.endswith(".py"):
        rules = _load_py(text)
    else:
        raise _file_error(
            text, "rules files must end in .py or .json.", "Rename it, or convert it to JSON."
        )
    return _check_file_rules(text, rules)


def _check_file_rules(path: str, rules: object) -> RulePairs:
    """``rules`` read from ``path``, validated; errors name the file and each ``rules[i]``.

    The checks are :func:`meshplan._spmd.rules.check_rules`'s (a mesh axis named
    twice in one rule, ``["batch", ["data", "data"]]``, among them).
    """
    valid, problems = check_rules(rules)
    if not problems:
        return valid.pairs
    where = "" if all(p.path == "rules" for p in problems) else " (rules[i] is rule i, from 0)"
    raise error_from_problems(RulesError, f"Cannot read rules from {path!r}{where}:", problems)


_NAMES_FIX = (
    "Write a list of [pattern, names] pairs: a regular expression matched in full against the "
    "paths meshplan.explain prints, and one logical name (or null) per dimension, e.g. "
    '[[".*/kernel", ["embed", "mlp"]], [".*/bias", ["mlp"]]] in a .json file, or '
    "NAMES = [(r'.*/kernel', ('embed', 'mlp')), ...] in a .py file."
)


def get_names(path: str | os.PathLike[str]) -> tuple[tuple[str, tuple[object, ...] | None], ...]:
    """Path rules for :func:`meshplan.name_by_path` from a ``.json`` or ``.py`` file.

    A ``.json`` file holds a list of ``[pattern, names]`` pairs (``names`` a list of
    strings and nulls, or null to leave the arrays alone); a ``.py`` file defines
    ``NAMES`` (or ``names``) as a list of such pairs. ``meshplan plan``, ``search`` and
    ``train`` read ``--names FILE`` with it.

    Example:
        >>> import json, os, tempfile, meshplan.layouts
        >>> path = os.path.join(tempfile.mkdtemp(), "names.json")
        >>> with open(path, "w") as f:
        ...     json.dump([[".*/kernel", ["embed", "mlp"]], [".*/bias", None]], f)
        >>> meshplan.layouts.get_names(path)
        (('.*/kernel', ('embed', 'mlp')), ('.*/bias', None))

    Raises:
        LogicalNamesError: a missing or unreadable file, or pairs that are not valid
            (every one named, with its index).
    """
    text = os.fspath(path)
    if not os.path.isfile(text) or not text.endswith((".py", ".json")):
        problem = "no such file." if not os.path.exists(text) else "it is not a .py or .json file."
        raise _file_error(text, problem, _NAMES_FIX, "names", LogicalNamesError)
    if text.endswith(".json"):
        pairs: object = _json_list(text, _NAMES_FIX, "names", LogicalNamesError)
    else:
        pairs = _load_py(text, ("NAMES", "names"), _NAMES_FIX, "names", LogicalNamesError)
    try:
        checked = check_path_rules(pairs)  # type: ignore[arg-type]
    except LogicalNamesError as e:
        raise error_from_problems(
            LogicalNamesError,
            f"Cannot read names from {text!r} (path_rules[i] is pair i, from 0):",
            e.problems,
        ) from None
    return tuple((r.pattern.pattern, r.names) for r in checked)
