"""Metadata boxes: a value plus one axis name per dimension.

``Partitioned`` carries mesh axis names, ``LogicallyPartitioned`` logical ones.
Both are pytree nodes whose only child is the value (names, mesh and rules are
static), and both implement Flax's ``AxisMetadata`` protocol, so
``nn.Module.param``, ``nn.scan`` and ``nn.vmap`` handle them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import jax
import numpy as np
from flax.core.meta import AxisMetadata
from jax.sharding import NamedSharding, PartitionSpec

from meshplan._errors import (
    ArgumentError,
    LogicalNamesError,
    PartitioningUnspecifiedError,
    Problem,
    error_for,
)
from meshplan._spmd.place import active_mesh, apply_spec
from meshplan._spmd.rules import (
    AxisNames,
    LogicalNames,
    LogicalRules,
    normalize_names,
    normalize_rules,
)
from meshplan._spmd.validate import rank_problem
from meshplan._text import path_text
from meshplan._types import Leaf, PyTree

__all__ = [
    "PARTITION_NAME",
    "LogicallyPartitioned",
    "Partitioned",
    "is_box",
    "replace_boxed",
    "unbox",
    "with_logical_partitioning",
    "with_partitioning",
]

A = TypeVar("A")

PARTITION_NAME = "partition_name"
"""Key of ``metadata_params`` in ``nn.scan``/``nn.vmap`` naming the axis they add."""


def _check_names(names: object, cls_name: str) -> AxisNames:
    if type(names) is tuple and all(n is None or type(n) is str for n in names):
        return names  # fast path: the common case, already normal
    if names is None:
        raise error_for(
            LogicalNamesError,
            "names-none",
            "names",
            f"{cls_name} needs one axis name (or None) per dimension, got names=None",
            "For a replicated value give (None,) * value.ndim, or leave the value unboxed.",
        )
    return normalize_names(names, what=f"{cls_name} names")


def _values_equal(a: object, b: Leaf) -> bool:
    if a is b:
        return True
    if isinstance(a, jax.ShapeDtypeStruct) or isinstance(b, jax.ShapeDtypeStruct):
        return getattr(a, "shape", None) == getattr(b, "shape", None) and getattr(
            a, "dtype", None
        ) == getattr(b, "dtype", None)
    if hasattr(a, "shape") and hasattr(b, "shape"):
        try:
            return bool(np.array_equal(np.asarray(a), np.asarray(b)))
        except (TypeError, RuntimeError, jax.errors.ConcretizationTypeError) as e:
            raise TypeError(
                f"Cannot compare boxes whose values cannot be read here (shape "
                f"{getattr(a, 'shape', None)}): {type(e).__name__}. Inside jax.jit, or for "
                f"arrays spread over several processes, compare .names and the values "
                f"with jnp.array_equal instead of ==."
            ) from e
    return bool(a == b)


@dataclasses.dataclass(frozen=True, eq=False)
class Partitioned(AxisMetadata[A], Generic[A]):
    """A value with one mesh axis name (or ``None``) per dimension.

    The easiest way to create one is :func:`with_partitioning` around a
    parameter initializer. ``jax.tree_util`` sees the value as the only child.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> box = meshplan.Partitioned(jnp.zeros((4, 8)), (None, "model"))
        >>> box.get_partition_spec()
        P(None, 'model')
        >>> jax.tree_util.tree_leaves(box)[0].shape
        (4, 8)

    Attributes:
        value: The wrapped value (an array, a ``jax.ShapeDtypeStruct``, ...).
        names: One mesh axis name, tuple of names, or ``None`` per dimension.
        mesh: The mesh to shard on; ``None`` uses the active one.
    """

    value: A
    names: AxisNames
    mesh: jax.sharding.Mesh | None = None

    def __post_init__(self) -> None:
        names = _check_names(self.names, type(self).__name__)
        if names is not self.names:
            object.__setattr__(self, "names", names)

    # -- the AxisMetadata protocol ------------------------------------------

    def unbox(self, apply_constraint: bool = True) -> A:
        """Returns the value, constrained to its partitioning when a mesh is active.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(jnp.ones((8, 4)), ("data", None))
            >>> box.unbox().shape  # no mesh active: the value as it is
            (8, 4)
            >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
            ...     print(box.unbox().sharding.spec)
            P('data', None)
        """
        if _defer_rank(self):
            return self.value
        if apply_constraint and (self.mesh is not None or active_mesh() is not None):
            value = apply_spec(self.value, self._checked_spec(), self.mesh, what=self._what())
            return _gathered_for_use(self, value, self.get_partition_spec(), None)
        return self.value

    def replace_boxed(self, val: Leaf) -> Partitioned[Leaf]:
        """The same box around a new value.

        Example:
            >>> import jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(jnp.ones((4, 8)), (None, "model"))
            >>> new = box.replace_boxed(jnp.zeros((4, 8)))
            >>> new.names, float(new.value.sum())
            ((None, 'model'), 0.0)
        """
        return dataclasses.replace(self, value=val)

    def _partition_name(self, params: dict[object, object]) -> Any:
        if PARTITION_NAME not in params:
            raise error_for(
                PartitioningUnspecifiedError,
                "partition-name-missing",
                "metadata_params",
                f"nn.scan/nn.vmap is adding an axis to {self._what()}, but its metadata_params "
                f"do not name that axis (got metadata_params={params!r})",
                "Pass metadata_params={meshplan.PARTITION_NAME: 'layer'} (or None for an "
                "unsharded axis) to the transform.",
            )
        return params[PARTITION_NAME]

    def add_axis(self, index: int, params: dict[object, object]) -> Partitioned[A]:
        """Inserts the transform's partition name at ``index`` (``nn.scan``/``nn.vmap``).

        Example:
            >>> import jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(jnp.ones((4, 8)), (None, "model"))
            >>> box.add_axis(0, {meshplan.PARTITION_NAME: "layer"}).names
            ('layer', None, 'model')
        """
        name = self._partition_name(params)
        names = list(self.names)
        while len(names) < index:
            names.append(None)
        names.insert(index, name)
        return dataclasses.replace(self, names=tuple(names))

    def remove_axis(self, index: int, params: dict[object, object]) -> Partitioned[A]:
        """Removes the axis :meth:`add_axis` inserted; its exact inverse.

        Example:
            >>> import jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(jnp.ones((2, 4, 8)), ("layer", None, "model"))
            >>> box.remove_axis(0, {meshplan.PARTITION_NAME: "layer"}).names
            (None, 'model')
        """
        name = self._partition_name(params)
        names = list(self.names)
        if index >= len(names) or names[index] != name:
            raise error_for(
                LogicalNamesError,
                "remove-axis-mismatch",
                "names",
                f"Cannot remove axis {index} named {name!r} from {self._what()}: "
                f"that position holds {names[index] if index < len(names) else 'nothing'!r}",
                "remove_axis must undo the add_axis of the same transform.",
            )
        del names[index]
        return dataclasses.replace(self, names=tuple(names))

    # -- partitioning -------------------------------------------------------

    def get_partition_spec(self) -> PartitionSpec:
        """``PartitionSpec(*names)``.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((8, 4, 2), jnp.float32), ("data", None, ("data", "model")))
            >>> box.get_partition_spec()
            P('data', None, ('data', 'model'))
        """
        return PartitionSpec(*self.names)

    def get_sharding(self, mesh: jax.sharding.Mesh) -> NamedSharding:
        """``NamedSharding(mesh, spec)``.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
            >>> box.get_sharding(jax.make_mesh((2, 4), ("data", "model"))).spec
            P('data', None)
        """
        return NamedSharding(mesh, self._checked_spec())

    def replace(self, **updates: PyTree) -> Partitioned[A]:
        """A copy with some fields replaced, as Flax's ``struct`` dataclasses offer.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((8, 4), jnp.float32), ("data", None))
            >>> box.replace(names=(None, "model")).names
            (None, 'model')
        """
        return dataclasses.replace(self, **updates)

    def to_nnx_metadata(self) -> dict[str, object]:
        """The box's fields as ``flax.nnx.Variable`` metadata (``names`` -> ``out_sharding``).

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> box = meshplan.Partitioned(
            ...     jax.ShapeDtypeStruct((4, 8), jnp.float32), (None, "model"))
            >>> box.to_nnx_metadata()
            {'value': ShapeDtypeStruct(shape=(4, 8), dtype=float32), 'mesh': None,
             'out_sharding': (None, 'model')}
        """
        metadata = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        metadata["out_sharding"] = metadata.pop("names")
        if "rules" in metadata:
            metadata["sharding_rules"] = metadata.pop("rules")
        return metadata

    @classmethod
    def from_nnx_metadata(cls, metadata: dict[str, Any]) -> Partitioned[Any]:
        """The inverse of :meth:`to_nnx_metadata`; unknown keys are ignored.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> value = jax.ShapeDtypeStruct((4, 8), jnp.float32)
            >>> metadata = {"value": value, "out_sharding": (None, "model"), "eager_sharding": True}
            >>> meshplan.Partitioned.from_nnx_metadata(metadata)
            Partitioned(value=ShapeDtypeStruct(shape=(4, 8), dtype=float32), names=(None, 'model'),
                        mesh=None)
        """
        metadata = dict(metadata)
        metadata["names"] = metadata.pop("out_sharding")
        if "sharding_rules" in metadata:
            metadata["rules"] = metadata.pop("sharding_rules")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in metadata.items() if k in fields})

    def _checked_spec(self, path: str = "") -> PartitionSpec:
        spec = self.get_partition_spec()
        shape = getattr(self.value, "shape", None)
        if shape is not None and len(spec) > len(shape):  # fewer names: the rest unsharded
            problem = dataclasses.replace(rank_problem(tuple(spec), tuple(shape)), path=path)
            where = f"{path}: " if path else ""
            raise LogicalNamesError(
                f"{where}{self._what()}: {problem.message}.\n{problem.fix}", [problem]
            )
        return spec

    def _what(self) -> str:
        shape = getattr(self.value, "shape", None)
        return f"{type(self).__name__}(names={self.names!r}, shape={shape})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return all(
            getattr(self, f.name) == getattr(other, f.name)
            for f in dataclasses.fields(self)
            if f.name != "value"
        ) and _values_equal(self.value, other.value)

    def __hash__(self) -> int:
        # Consistent with __eq__, and with Flax's boxes: abstract values hash by shape and
        # dtype; concrete arrays are unhashable (TypeError), as jax.Array itself is.
        value: object = self.value
        if isinstance(value, jax.ShapeDtypeStruct):
            value = (value.shape, value.dtype)
        meta = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "value")
        return hash((type(self), meta, value))


@dataclasses.dataclass(frozen=True, eq=False)
class LogicallyPartitioned(Partitioned[A]):
    """A value with one *logical* axis name per dimension, mapped to mesh axes by rules.

    Example:
        >>> import jax.numpy as jnp, meshplan
        >>> box = meshplan.LogicallyPartitioned(jnp.zeros((4, 8)), ("embed", "hidden"))
        >>> box.get_partition_spec()
        P('embed', 'hidden')
        >>> meshplan.logical_to_mesh_axes(box.names, (("hidden", "model"),))
        P(None, 'model')

    Attributes:
        rules: Rules for this value; ``None`` uses the active ones.
    """

    rules: LogicalRules | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.rules is not None:
            rules = normalize_rules(self.rules)
            if rules is not self.rules:
                object.__setattr__(self, "rules", rules)

    def unbox(self, apply_constraint: bool = True) -> A:
        """Returns the value, constrained through the rules when a mesh is active.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> box = meshplan.LogicallyPartitioned(
            ...     jnp.ones((8, 4)), ("batch", "embed"), rules=(("batch", "data"),))
            >>> box.unbox().shape  # no mesh active: the value as it is
            (8, 4)
            >>> with jax.set_mesh(jax.make_mesh((2, 4), ("data", "model"))):
            ...     print(box.unbox().sharding.spec)
            P('data', None)
        """
        if _defer_rank(self):
            return self.value
        if apply_constraint and (self.mesh is not None or active_mesh() is not None):
            from meshplan._spmd.constraints import with_logical_constraint

            self._checked_spec()
            value = with_logical_constraint(
                self.value, self.get_partition_spec(), rules=self.rules, mesh=self.mesh
            )
            from meshplan._spmd.rules import get_logical_axis_rules, logical_to_mesh_axes

            rules = self.rules if self.rules is not None else get_logical_axis_rules()
            if not rules:
                return value
            spec = logical_to_mesh_axes(self.get_partition_spec(), rules)
            return _gathered_for_use(self, value, spec, rules)
        return self.value

    def get_sharding(self, mesh: jax.sharding.Mesh) -> NamedSharding:
        """The mesh sharding, through this box's rules or the active ones.

        Flax builds ``NamedSharding(mesh, logical_names)`` here, which fails.
        meshplan resolves the names through the rules, and says what to do
        when there are none.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> box = meshplan.LogicallyPartitioned(
            ...     jax.ShapeDtypeStruct((8, 16), jnp.float32), ("batch", "embed"))
            >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
            >>> with meshplan.logical_axis_rules((("batch", "data"), ("embed", "model"))):
            ...     print(box.get_sharding(mesh).spec)
            P('data', 'model')
        """
        from meshplan._spmd.rules import get_logical_axis_rules, logical_to_mesh_axes

        rules = self.rules if self.rules is not None else get_logical_axis_rules()
        spec = self._checked_spec()
        if not rules:
            problem = Problem(
                "error",
                "",
                f"get_sharding got {self._what()}, whose names are logical, and no rules are "
                f"active to map them to mesh axes",
                "Call meshplan.logical_to_mesh_sharding(meshplan.get_partition_spec(tree), mesh, "
                "rules), or get_sharding inside `with meshplan.logical_axis_rules(rules):`.",
                "no-rules",
            )
            raise LogicalNamesError(f"{problem.message}.\n{problem.fix}", [problem])
        return NamedSharding(mesh, logical_to_mesh_axes(tuple(spec), rules))


def _stored_param_path(box: Partitioned[object]) -> str | None:
    """``box``'s path if the Flax module being run holds it as a variable.

    ``""`` when a module is running but holds no such box, ``None`` outside any module.

    Flax's ``Scope.param`` stores an initializer's result before unboxing it; an
    initializer wrapper such as ``nn.DenseGeneral``'s unboxes the *flat* value it asked
    for before reshaping it and putting it back (``replace_boxed``). A box the scope
    already holds is the parameter itself; one it does not hold is such an
    intermediate value.
    """
    from flax.linen.module import _context  # the module whose method is running

    module = _context.module_stack[-1] if _context.module_stack else None
    scope = getattr(module, "scope", None)
    if scope is None:
        return None
    for col, variables in scope.variables().items():
        for name, value in variables.items():
            if value is box:
                return "/".join((col, *scope.path, name))
    return ""


def _defer_rank(box: Partitioned[Leaf]) -> bool:
    """Whether ``box`` has more names than its value has dimensions *for now*.

    Inside a Flax module, a box the module does not hold yet is an initializer's
    intermediate value (``nn.DenseGeneral`` initializes a flat 2-D kernel, then reshapes
    it into the box): its names describe the final shape, so it is returned as it is,
    unconstrained. A box the module holds as a parameter with too many names raises,
    naming the parameter's path; outside a module, the caller's check decides.
    """
    shape = getattr(box.value, "shape", None)
    if shape is None or len(box.names) <= len(shape):
        return False
    path = _stored_param_path(box)
    if path is None:  # not inside a Flax module: the usual checks apply
        return False
    if path == "":
        return True
    box._checked_spec(path)  # raises, naming the parameter
    return False


def _gathered_for_use(
    box: Partitioned[Leaf], value: A, spec: PartitionSpec, rules: LogicalRules | None
) -> A:
    """On an Explicit mesh, a parameter a Flax module reads is gathered over the batch's axes.

    That is FSDP: the parameter is stored split over the mesh axes of ``'batch'`` and
    all-gathered where it is used (its gradient is reduce-scattered back). On an Auto mesh
    XLA inserts the gather itself; on an Explicit one ``x @ kernel`` with both split over
    ``data`` is a ``ShardingTypeError``, so ordinary layers (``nn.Dense``) would fail.
    Outside a module (``meshplan.unbox(tree)``) the value keeps its own sharding.
    """
    mesh = box.mesh if box.mesh is not None else jax.sharding.get_abstract_mesh()
    if mesh is None or getattr(mesh, "empty", False):
        return value
    from jax.sharding import AxisType

    if set(mesh.axis_types) != {AxisType.Explicit} or not _stored_param_path(box):
        return value
    from meshplan._spmd.rules import get_logical_axis_rules, logical_to_mesh_axes, mesh_axes_of

    rules = rules if rules is not None else get_logical_axis_rules()
    if not rules:
        return value
    batch = set(mesh_axes_of(logical_to_mesh_axes(("batch",), rules)[0]))
    entries = [tuple(mesh_axes_of(e)) for e in spec]
    if not batch or not any(batch & set(e) for e in entries):
        return value
    kept = [tuple(a for a in e if a not in batch) for e in entries]
    gathered = PartitionSpec(*(e[0] if len(e) == 1 else (e or None) for e in kept))
    return apply_spec(value, gathered, box.mesh, what=f"{box._what()}, gathered for use")


for _cls, _meta in (
    (Partitioned, ["names", "mesh"]),
    (LogicallyPartitioned, ["names", "mesh", "rules"]),
):
    jax.tree_util.register_dataclass(_cls, data_fields=["value"], meta_fields=_meta)


_IS_BOX: dict[type, bool] = {}
"""``isinstance(x, AxisMetadata)`` by type: the ABC check is slow, and every leaf of a state asks."""


def is_box(x: object) -> bool:
    """Whether ``x`` is a metadata box (any Flax ``AxisMetadata``, meshplan's included).

    Example:
        >>> import jax.numpy as jnp, meshplan
        >>> from meshplan._spmd.boxes import is_box
        >>> is_box(meshplan.Partitioned(jnp.ones(2), ("data",))), is_box(jnp.ones(2))
        (True, False)
    """
    kind = type(x)
    found = _IS_BOX.get(kind)
    if found is None:
        found = _IS_BOX[kind] = isinstance(x, AxisMetadata)
    return found


def _check_initializer_args(fn: object, names: object, who: str) -> AxisNames:
    """``names`` normalised, after checking that ``fn`` is callable and ``names`` are names."""
    if not callable(fn) and callable(names):
        raise error_for(
            ArgumentError,
            "swapped-arguments",
            "fn",
            f"{who}(fn, names) got the arguments swapped: fn={fn!r} is not callable and "
            f"names={names!r} is",
            f"Call {who}(initializer, names), e.g. "
            f"{who}(nn.initializers.lecun_normal(), (None, 'model')).",
        )
    if not callable(fn):
        raise error_for(
            ArgumentError,
            "not-an-initializer",
            "fn",
            f"{who} needs an initializer function as its first argument, got {fn!r}",
            f"Pass an initializer, e.g. {who}(nn.initializers.lecun_normal(), names).",
        )
    return _check_names(names, who)


def with_partitioning(
    fn: Callable[..., object],
    names: LogicalNames,
    mesh: jax.sharding.Mesh | None = None,
) -> Callable[..., Partitioned[Leaf]]:
    """Wraps an initializer so that its result comes back as a :class:`Partitioned` box.

    Example:
        >>> import flax.linen as nn, meshplan
        >>> kernel_init = meshplan.with_partitioning(
        ...     nn.initializers.lecun_normal(), (None, "data"))
        >>> partitioned_dense = nn.Dense(features=3, kernel_init=kernel_init)

    Args:
        fn: The function to wrap, usually an initializer.
        names: One mesh axis name (or ``None``) per dimension of its result.
        mesh: The mesh to shard on; ``None`` uses the active one.

    Returns:
        A function that calls ``fn`` and boxes its result.
    """
    axis_names = _check_initializer_args(fn, names, "with_partitioning")

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> Partitioned[Leaf]:
        return Partitioned(fn(*args, **kwargs), axis_names, mesh=mesh)

    return wrapper


def with_logical_partitioning(
    fn: Callable[..., object],
    names: LogicalNames,
    mesh: jax.sharding.Mesh | None = None,
    rules: LogicalRules | None = None,
) -> Callable[..., LogicallyPartitioned[Leaf]]:
    """Wraps an initializer so that its result is a :class:`LogicallyPartitioned` box.

    Example:
        >>> import flax.linen as nn, meshplan
        >>> kernel_init = meshplan.with_logical_partitioning(
        ...     nn.initializers.lecun_normal(), ("embed", "mlp"))
        >>> dense = nn.Dense(features=3, kernel_init=kernel_init)

    Args:
        fn: The function to wrap, usually an initializer.
        names: One logical axis name (or ``None``) per dimension of its result.
        mesh: The mesh to shard on; ``None`` uses the active one.
        rules: Rules for this value; ``None`` uses the active ones.

    Returns:
        A function that calls ``fn`` and boxes its result.
    """
    axis_names = _check_initializer_args(fn, names, "with_logical_partitioning")
    if rules is not None:
        rules = normalize_rules(rules)

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> LogicallyPartitioned[Leaf]:
        return LogicallyPartitioned(fn(*args, **kwargs), axis_names, mesh=mesh, rules=rules)

    return wrapper


def unbox(tree: PyTree) -> PyTree:
    """Strips every metadata box from ``tree`` (recursively), leaving the raw values.

    Example:
        >>> import jax.numpy as jnp, meshplan
        >>> tree = {"w": meshplan.Partitioned(jnp.ones((2, 2)), (None, None)), "b": 1.0}
        >>> out = meshplan.unbox(tree)
        >>> type(out["w"]).__name__, out["b"]
        ('ArrayImpl', 1.0)
    """
    return jax.tree_util.tree_map(
        lambda x: unbox(x.unbox()) if isinstance(x, AxisMetadata) else x,
        tree,
        is_leaf=is_box,
    )


def replace_boxed(tree: PyTree, updates: PyTree) -> PyTree:
    """Puts the values of ``updates`` into the boxes of ``tree``, keeping their metadata.

    ``updates`` has the structure of ``unbox(tree)``; leaves of ``tree`` that are
    not boxed are replaced as they are.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> tree = {"w": meshplan.Partitioned(jnp.ones((2, 2)), (None, "model"))}
        >>> zeros = jax.tree.map(jnp.zeros_like, meshplan.unbox(tree))
        >>> new = meshplan.replace_boxed(tree, zeros)
        >>> new["w"].names, float(new["w"].value.sum())
        ((None, 'model'), 0.0)
    """
    problems: list[Problem] = []
    fix = "Updates must have the structure and ranks of meshplan.unbox(tree)."

    def update(path: object, box: Leaf, new: PyTree) -> PyTree:
        if not isinstance(box, AxisMetadata):
            return new
        inner = box.value if isinstance(box, Partitioned) else box.unbox()
        if isinstance(new, AxisMetadata):
            problems.append(
                Problem(
                    "error",
                    path_text(path),
                    f"the update is itself a box ({type(new).__name__}); pass raw values "
                    f"(meshplan.unbox(updates))",
                    fix,
                    "update-is-a-box",
                )
            )
            return box
        if isinstance(inner, AxisMetadata):
            new = replace_boxed(inner, new)
        elif isinstance(box, Partitioned):
            new_shape = getattr(new, "shape", None)
            if new_shape is not None and len(new_shape) != len(box.names):
                problems.append(
                    Problem(
                        "error",
                        path_text(path),
                        f"a value of shape {tuple(new_shape)} (rank {len(new_shape)}) cannot go "
                        f"into a box named {box.names!r} (rank {len(box.names)})",
                        fix,
                        "update-rank",
                    )
                )
                return box
        return box.replace_boxed(new)

    out = jax.tree_util.tree_map_with_path(update, tree, updates, is_leaf=is_box)
    if problems:
        from meshplan._errors import error_from_problems

        raise error_from_problems(
            LogicalNamesError, "replace_boxed cannot put these updates into their boxes:", problems
        )
    return out
