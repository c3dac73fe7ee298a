"""The Flax NNX front end: a ``flax.nnx.Variable``'s sharding metadata, read with Linen's rules.

An NNX variable carries its names as metadata (``out_sharding``; older Flax
wrote ``sharding_names`` or ``sharding``), and may carry its own rules
(``sharding_rules``). Flax NNX resolves them by a dict (the last rule for a
name wins, a mesh axis may repeat, a name no rule matches is kept as a mesh
axis); meshplan resolves them as Linen does (the first rule that fits wins, a
mesh axis is used once per array, a name no rule matches is unsharded).

What names mean, as in Flax NNX: with no rules in effect (none given, none
active in ``meshplan.logical_axis_rules``, none on the variable) they are mesh
axes, so the guide's ``out_sharding=(None, 'model')`` means what it says in
Flax. With rules in effect they are logical names. An ``out_sharding`` that is
a ``NamedSharding`` is always mesh axes (it is resolved already).

A variable's own ``sharding_rules`` come first, then the rules in effect: the
more specific rules win (Flax raises when the two disagree on a name).

Nothing here imports ``flax.nnx`` at module import: a variable can only exist
once Flax NNX is imported, so :func:`is_variable` looks it up in ``sys.modules``.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from jax.sharding import NamedSharding, PartitionSpec

from meshplan._errors import ArgumentError, LogicalNamesError, Problem, error_for
from meshplan._spmd.mesh_info import JaxMesh
from meshplan._spmd.nnx_fit import check_fit
from meshplan._spmd.place import active_mesh
from meshplan._spmd.rules import (
    LogicalNames,
    LogicalRules,
    NamesKind,
    bad_entries,
    get_logical_axis_rules,
    logical_to_mesh_axes,
    names_problem,
    normalize_rules,
)
from meshplan._spmd.validate import rank_problem

if TYPE_CHECKING:
    from flax.nnx.variablelib import VariableMetadata
    from flax.typing import Initializer

__all__ = [
    "NAME_KEYS",
    "NnxNames",
    "flax_placement",
    "is_variable",
    "nnx_sharding",
    "variable_names",
    "variable_spec",
    "with_nnx_partitioning",
]

NAME_KEYS = ("out_sharding", "sharding_names", "sharding")
"""The metadata keys that hold a variable's names, newest first (Flax 0.12 remaps the older ones)."""


_IS_VARIABLE: dict[type, bool] = {}
"""``isinstance(x, nnx.Variable)`` by type, as for boxes: every leaf of a state asks."""


def is_variable(x: Any) -> bool:
    """Whether ``x`` is a ``flax.nnx.Variable`` (without importing Flax NNX).

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from meshplan._spmd.nnx import is_variable
        >>> is_variable(nnx.Param(jnp.ones(2))), is_variable(jnp.ones(2))
        (True, False)
    """
    kind = type(x)
    found = _IS_VARIABLE.get(kind)
    if found is None:
        module = sys.modules.get("flax.nnx.variablelib")
        if module is None:  # NNX not imported: nothing can be a variable yet (do not cache)
            return False
        found = _IS_VARIABLE[kind] = isinstance(x, module.Variable)
    return found


@dataclasses.dataclass(frozen=True)
class NnxNames:
    """What a variable's metadata says about its layout.

    Attributes:
        names: Its names as a tuple (``None``: no names, replicated).
        kind: ``'logical'`` (through rules), ``'mesh'`` (mesh axes) or ``'unboxed'``.
        rules: The rules to resolve logical names with: the variable's own
            ``sharding_rules`` first, then the rules in effect; ``None`` when the
            variable has no rules of its own (use the rules in effect).
        local_rules: The variable's own ``sharding_rules`` (``()`` when none).
    """

    names: tuple[Any, ...] | None
    kind: NamesKind
    rules: tuple[tuple[str, Any], ...] | None
    local_rules: tuple[tuple[str, Any], ...]


def _raw_names(var: Any) -> Any:
    metadata = var.get_metadata()
    for key in NAME_KEYS:
        if key in metadata and metadata[key] is not None:
            return metadata[key]
    return None


def _has_rules(rules: object) -> bool:
    try:
        return bool(rules)
    except Exception:  # an odd object: the validator says what is wrong with it
        return True


def variable_names(var: Any, rules: LogicalRules | None = None) -> NnxNames:
    """Reads one variable's names and rules (``rules``: the caller's, ``None``: the active ones).

    Example:
        >>> from flax import nnx
        >>> import jax, jax.numpy as jnp
        >>> from meshplan._spmd.nnx import variable_names
        >>> w = nnx.Param(jnp.ones((4, 8)), out_sharding=("embed", "hidden"), eager_sharding=False)
        >>> variable_names(w).kind, variable_names(w, (("embed", "data"),)).kind
        ('mesh', 'logical')
    """
    raw = _raw_names(var)
    if raw is None or (not isinstance(raw, NamedSharding) and len(raw) == 0):
        return NnxNames(None, "unboxed", None, ())
    local = var.get_metadata().get("sharding_rules") or ()
    local_rules = tuple(local) if isinstance(local, Sequence) and not isinstance(local, str) else ()
    if local and not local_rules:  # not a sequence: the validator says so at rules[...]
        local_rules = (local,)
    if isinstance(raw, NamedSharding):
        return NnxNames(tuple(raw.spec), "mesh", None, local_rules)
    names = tuple(raw) if isinstance(raw, PartitionSpec | list | tuple) else raw
    active: object = get_logical_axis_rules() if rules is None else rules
    if not local_rules and not _has_rules(active):
        return NnxNames(names, "mesh", None, ())
    composed = None
    if local_rules:
        rest = tuple(active) if isinstance(active, Sequence) and not isinstance(active, str) else ()
        composed = local_rules + rest
    return NnxNames(names, "logical", composed, local_rules)


def _names_error(path: str, what: str, problem: Problem) -> LogicalNamesError:
    problem = dataclasses.replace(problem, path=path)
    where = f"{path}: " if path else ""
    return LogicalNamesError(f"{where}{what}: {problem.message}.\n{problem.fix}", [problem])


def variable_spec(
    var: Any, rules: LogicalRules | None = None, path: str = "", *, logical: bool | None = None
) -> PartitionSpec | None:
    """The mesh ``PartitionSpec`` of one variable, as ``nnx.get_partition_spec`` gives it.

    Names go through meshplan's rules (see the module); ``logical=True`` reads
    them as logical names even with no rules in effect (as
    :func:`meshplan.logical_to_mesh` does). ``None`` for a value without a
    shape; ``PartitionSpec()`` for an array without names. Bad names (more
    than the rank, entries that are not names) raise a ``LogicalNamesError``
    naming ``path``.

    Example:
        >>> from flax import nnx
        >>> import jax.numpy as jnp
        >>> from meshplan._spmd.nnx import variable_spec
        >>> w = nnx.Param(jnp.ones((4, 8)), out_sharding=("embed", "hidden"), eager_sharding=False)
        >>> variable_spec(w, (("embed", "data"), ("embed", "model"), ("hidden", "data"),
        ...                   ("hidden", "model")))
        P('data', 'model')
        >>> variable_spec(w)  # no rules: the names are mesh axes, as in Flax NNX
        P('embed', 'hidden')
    """
    info = variable_names(var, rules)
    value = var.get_value()
    is_spec = isinstance(value, PartitionSpec)  # a spec tree (nnx.get_partition_spec's result)
    shape = None if is_spec else getattr(value, "shape", None)
    if info.names is None:
        return None if shape is None and not is_spec else PartitionSpec()
    what = f"{type(var).__name__} out_sharding {info.names!r}"
    bad = names_problem(info.names, what="out_sharding")
    if bad is not None and (info.kind != "mesh" or bad_entries(info.names)):
        raise _names_error(path, what, bad)
    if shape is not None and len(info.names) > len(shape):
        raise _names_error(path, what, rank_problem(info.names, tuple(shape)))
    fixed = isinstance(_raw_names(var), NamedSharding)  # resolved already: always mesh axes
    kind = "logical" if logical and not fixed else info.kind
    if kind == "mesh":
        return PartitionSpec(*info.names)
    use = info.rules if info.rules is not None else rules
    if use is None:
        use = get_logical_axis_rules()
    return logical_to_mesh_axes(info.names, use)


def flax_placement(names: Sequence[Any], rules: Sequence[tuple[str, Any]]) -> PartitionSpec:
    """What Flax NNX gives for ``names`` under ``rules``: a dict, the last rule per name wins.

    A name no rule matches is kept (as a mesh axis); no mesh axis is checked
    for use twice. (``flax.core.spmd.from_sharding_rules`` over the dict of the rules.)

    Example:
        >>> from meshplan._spmd.nnx import flax_placement
        >>> flax_placement(("embed", "hidden"), (("embed", "data"), ("embed", "model"),
        ...                                      ("hidden", "data"), ("hidden", "model")))
        P('model', 'model')
    """
    table = dict(rules)
    return PartitionSpec(
        *(table[n] if isinstance(n, str) and n and n in table else n for n in names)
    )


def nnx_sharding(
    names: LogicalNames,
    rules: LogicalRules | None = None,
    mesh: JaxMesh | None = None,
    *,
    shape: Sequence[int] | None = None,
) -> dict[str, Any]:
    """``flax.nnx.Variable`` metadata that makes Flax place a variable as meshplan's rules do.

    ``out_sharding`` keeps the logical names (so transforms, checkpoints and
    meshplan's plans see them), and ``sharding_rules`` holds this variable's
    own resolution, one ``(name, mesh axes)`` per name. Flax's eager sharding
    (under ``jax.set_mesh``) applies it at creation, and ``nnx.get_partition_spec``
    agrees with meshplan. The names are resolved with ``rules`` (``None``: the
    active ``meshplan.logical_axis_rules``) when this is called; with no rules
    the names are mesh axes, and are given as they are.

    Given the value's ``shape``, the placement is checked against ``mesh`` (or
    the active one) first: a dimension its mesh axes do not divide raises
    meshplan's ``ShardingValidationError`` naming the dimension, its name, the
    mesh axes and sizes and the fix, where Flax's eager sharding would end in
    JAX's ``IndivisibleError`` naming none of them. (Flax gives this function no
    way to see the value: pass ``shape``, or use :func:`with_nnx_partitioning`,
    which checks the initializer's result.)

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from flax import nnx
        >>> rules = (("embed", "data"), ("embed", "model"), ("hidden", "data"), ("hidden", "model"))
        >>> meshplan.nnx_sharding(("embed", "hidden"), rules)
        {'out_sharding': ('embed', 'hidden'), 'sharding_rules': (('embed', 'data'), ('hidden', 'model'))}
        >>> w = nnx.Param(jnp.ones((4, 8)), eager_sharding=False,
        ...               **meshplan.nnx_sharding(("embed", "hidden"), rules))
        >>> nnx.get_partition_spec(nnx.state(nnx.Dict(w=w)))["w"].get_value()
        P('data', 'model')
        >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        ...     nnx.Param(jnp.ones((4, 6)), **meshplan.nnx_sharding(("embed", "hidden"), rules,
        ...                                                        shape=(4, 6)))
        Traceback (most recent call last):
        ...
        meshplan.ShardingValidationError: Cannot place nnx_sharding's variable of shape (4, 6) by ('embed', 'hidden') on the mesh {'data': 2, 'model': 4}:
          * dim 1 ('hidden') of size 6 does not divide by 4 (mesh axis 'model' of size 4)
        Pad dim 1 to 8 (the nearest multiple of 4), or put a rule for 'hidden' first (rules[3] maps it now) that maps it to mesh axes whose size divides 6, or ('hidden', None) to keep it whole.

    Args:
        names: One logical name (or ``None``, or a tuple of mesh axes) per dimension.
        rules: Logical axis rules; ``None`` uses the active ones.
        mesh: Also hand Flax this mesh as the variable's ``mesh`` metadata.
        shape: The value's shape: check that the placement fits it on ``mesh`` (or the
            active mesh; with neither, nothing is checked).

    Returns:
        Keyword arguments for ``nnx.Param(...)`` (or ``nnx.with_metadata``).

    Raises:
        ShardingValidationError: ``shape`` given and the placement does not fit it.
    """
    bad = names_problem(names, what="names")
    if bad is not None:
        raise LogicalNamesError(f"nnx_sharding: {bad.message}.\n{bad.fix}", [bad])
    names = tuple(tuple(n) if isinstance(n, list) else n for n in names)
    active = get_logical_axis_rules() if rules is None else normalize_rules(rules)
    out: dict[str, Any] = {"out_sharding": names}
    if active:
        spec = logical_to_mesh_axes(names, active)
        out["sharding_rules"] = tuple(
            (n, entry) for n, entry in zip(names, spec, strict=False) if isinstance(n, str)
        )
    if mesh is not None:
        out["mesh"] = mesh
    target = mesh if mesh is not None else active_mesh()
    if shape is not None and target is not None:
        check_fit(names, shape, target, active, "nnx_sharding's variable")
    return out


def with_nnx_partitioning(
    initializer: Initializer,
    names: LogicalNames,
    rules: LogicalRules | None = None,
    mesh: JaxMesh | None = None,
) -> Callable[..., VariableMetadata[Any]]:
    """Like ``nnx.with_partitioning``, with the names placed by meshplan's rules.

    The wrapped initializer returns ``nnx.VariableMetadata`` carrying
    :func:`nnx_sharding`'s metadata, resolved with ``rules`` (``None``: the
    rules active when the initializer runs). Under ``jax.set_mesh`` Flax's
    eager sharding places the variable at creation as meshplan does; the
    variable keeps its logical names. The placement is checked against the
    initializer's result first: a dimension the mesh axes do not divide raises
    meshplan's ``ShardingValidationError`` (the dimension, its name, the mesh
    axes and sizes, the fix) instead of JAX's ``IndivisibleError``.

    Example:
        >>> import jax, meshplan
        >>> from flax import nnx
        >>> rules = (("embed", "data"), ("embed", "model"), ("hidden", "data"), ("hidden", "model"))
        >>> init = meshplan.with_nnx_partitioning(nnx.initializers.lecun_normal(),
        ...                                       ("embed", "hidden"), rules)
        >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
        ...     layer = nnx.Linear(8, 16, kernel_init=init, rngs=nnx.Rngs(0))
        >>> layer.kernel.sharding.spec, layer.kernel.out_sharding
        (P('data', 'model'), ('embed', 'hidden'))

    Args:
        initializer: The initializer to wrap.
        names: One logical name (or ``None``) per dimension of its result.
        rules: Logical axis rules; ``None`` uses the active ones at creation.
        mesh: The mesh to shard on; ``None`` uses the one of ``jax.set_mesh``.

    Returns:
        An initializer whose result Flax turns into a placed variable.
    """
    from flax.nnx import variablelib

    if not callable(initializer):
        raise error_for(
            ArgumentError,
            "not-an-initializer",
            "initializer",
            f"with_nnx_partitioning needs an initializer as its first argument, got "
            f"{initializer!r}",
            "Pass one, e.g. with_nnx_partitioning(nnx.initializers.lecun_normal(), "
            "('embed', 'mlp')).",
        )
    bad = names_problem(names, what="names")
    if bad is not None:
        raise LogicalNamesError(f"with_nnx_partitioning: {bad.message}.\n{bad.fix}", [bad])
    fixed_rules = None if rules is None else normalize_rules(rules)

    def wrapper(*args: Any, **kwargs: Any) -> VariableMetadata[Any]:
        value = initializer(*args, **kwargs)
        metadata = nnx_sharding(names, fixed_rules, mesh)
        target = mesh if mesh is not None else active_mesh()
        shape = getattr(value, "shape", None)
        if shape is not None and target is not None and variablelib.using_eager_sharding():
            rules_used = get_logical_axis_rules() if fixed_rules is None else fixed_rules
            check_fit(names, shape, target, rules_used, "with_nnx_partitioning's variable")
        return variablelib.VariableMetadata(value, metadata=metadata)

    return wrapper
