"""The JSON stored beside a checkpoint's arrays: what is needed to restore without model code.

For every array: its shape, dtype and axis names (logical or mesh), keyed by
its path; for the run: the step, the model config, the rules and the mesh
shape, anything else the saver adds, and the meshplan version. The JSON is
marked with :data:`FORMAT` so a folder that is not meshplan's is recognised.

The JSON carries its own digest (``"digest"``: SHA-256 of the rest, keys sorted),
so the logical names, the rules, the mesh, the step and the arrays' checksums are
covered too: metadata edited or damaged since it was saved is a damaged step
(code ``'ckpt-damaged'``), not another layout. Metadata without a digest (an older
meshplan's, or edited) still reads, with :attr:`CheckpointMetadata.sealed`
``False``; :func:`~meshplan.restore` then warns that the step is unverified.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jax.sharding import Mesh, NamedSharding

from meshplan._checkpoint.tree import flatten_state
from meshplan._errors import CheckpointError, error_for
from meshplan._spmd.rules import (
    LogicalRules,
    RulePairs,
    get_logical_axis_rules,
    normalize_rules,
    rules_to_json,
)

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ArrayInfo",
    "CheckpointMetadata",
    "UnverifiedWarning",
    "metadata_digest",
]

FORMAT = "meshplan-checkpoint"
"""Value of the ``format`` field that marks meshplan's metadata."""

FORMAT_VERSION = 1
"""The newest metadata layout this meshplan reads and writes."""


class UnverifiedWarning(UserWarning):
    """A step was restored without checksums to verify it against (see :meth:`CheckpointMetadata.unverified`)."""


_DIGEST_KEY = "digest"


def metadata_digest(data: Mapping[str, object]) -> str:
    """The digest of a metadata JSON dict: SHA-256 of everything but its ``"digest"``.

    Example:
        >>> from meshplan._checkpoint.metadata import metadata_digest
        >>> metadata_digest({"step": 1, "a": [1, 2]}) == metadata_digest({"a": [1, 2], "step": 1})
        True
    """
    body = {k: v for k, v in data.items() if k != _DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
    """What a checkpoint knows about one array.

    Attributes:
        shape: The array's global shape.
        dtype: Its dtype name (``"float32"``).
        names: One axis name (or ``None``) per dimension, or ``None`` for an
            array that was saved unboxed (replicated on restore).
        logical: ``True`` when ``names`` are logical names (mapped through
            rules), ``False`` when they are mesh axis names.
        checksum: The array's checksum at save (:mod:`meshplan._checkpoint.checksum`),
            verified by :func:`~meshplan.restore`; ``None`` when not stored
            (checkpoints of older meshplans, dtypes without one).

    Example:
        >>> from meshplan._checkpoint.metadata import ArrayInfo
        >>> info = ArrayInfo((256, 32), "float32", ("vocab", "embed"))
        >>> ArrayInfo.from_json(info.to_json()) == info
        True
    """

    shape: tuple[int, ...]
    dtype: str
    names: tuple[str | None, ...] | None = None
    logical: bool = True
    checksum: str | None = None

    def to_json(self) -> dict[str, object]:
        """A JSON-serialisable dict."""
        out: dict[str, object] = {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "names": None if self.names is None else list(self.names),
            "logical": self.logical,
        }
        if self.checksum is not None:
            out["checksum"] = self.checksum
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ArrayInfo:
        """The inverse of :meth:`to_json`."""
        names = data.get("names")
        return cls(
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
            names=None if names is None else tuple(_name_from_json(n) for n in names),
            logical=bool(data.get("logical", True)),
            checksum=None if data.get("checksum") is None else str(data["checksum"]),
        )


def _name_from_json(name: object) -> Any:
    return tuple(name) if isinstance(name, list) else name


def _rules_from_json(rules: Sequence[Any]) -> RulePairs:
    """The rules of a metadata file (JSON ``[name, axes]`` lists), validated."""
    return normalize_rules(
        tuple((name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in rules)
    )


def _mesh_of(flat: Mapping[str, tuple[object, object]]) -> Any:
    for value, _ in flat.values():
        sharding = getattr(value, "sharding", None)
        if isinstance(sharding, NamedSharding):
            return sharding.mesh
    return None


@dataclasses.dataclass(frozen=True)
class CheckpointMetadata:
    """The JSON stored beside a checkpoint's arrays.

    Attributes:
        step: The training step the checkpoint was saved at.
        arrays: :class:`ArrayInfo` of every array, keyed by its path.
        rules: The logical axis rules of the run that saved it.
        mesh_shape: Mesh axis name to size, in the mesh's order (``{}`` if unknown).
        config: The model config as a dict (``None`` if none was given).
        extra: Anything else the saver stored (training settings, best loss, ...).
        meshplan_version: The meshplan version that wrote it.
        sealed: ``False`` when read from JSON that carried no digest (an older
            meshplan's, or edited by hand): nothing verifies the names and
            checksums it holds (see :meth:`unverified`).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = meshplan.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))
        >>> mesh = jax.make_mesh((2, 4), ("data", "model"))
        >>> meta = meshplan.CheckpointMetadata.describe(3, {"w": w}, mesh=mesh)
        >>> meta.step, meta.arrays["w"].shape, meta.arrays["w"].names, meta.mesh_shape
        (3, (2, 4), ('embed', 'mlp'), {'data': 2, 'model': 4})
    """

    step: int
    arrays: dict[str, ArrayInfo]
    rules: RulePairs = ()
    mesh_shape: dict[str, int] = dataclasses.field(default_factory=dict)
    config: dict[str, object] | None = None
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    meshplan_version: str = ""
    sealed: bool = dataclasses.field(default=True, compare=False)

    def unverified(self) -> list[str]:
        """What a restore of this step cannot verify: ``[]`` when everything is covered.

        ``'metadata'`` when it carried no digest, and the path of every array whose
        dtype has a checksum but that was stored without one.

        Example:
            >>> import meshplan
            >>> from meshplan._checkpoint.metadata import ArrayInfo
            >>> meta = meshplan.CheckpointMetadata(1, {"w": ArrayInfo((2,), "float32")},
            ...                                    sealed=False)
            >>> meta.unverified()
            ['metadata', 'w']
        """
        from meshplan._checkpoint.checksum import dtype_has_checksum

        missing = [] if self.sealed else ["metadata"]
        missing += [
            key
            for key, info in self.arrays.items()
            if info.checksum is None and dtype_has_checksum(info.dtype)
        ]
        return missing

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The saving mesh's axis names, in order.

        Example:
            >>> import meshplan
            >>> meta = meshplan.CheckpointMetadata(0, {}, mesh_shape={"data": 2, "model": 4})
            >>> meta.axis_names
            ('data', 'model')
        """
        return tuple(self.mesh_shape)

    @classmethod
    def describe(
        cls,
        step: int,
        state: object,
        *,
        rules: LogicalRules | None = None,
        mesh: Mesh | None = None,
        config: Mapping[str, object] | None = None,
        extra: Mapping[str, object] | None = None,
    ) -> CheckpointMetadata:
        """The metadata of saving ``state`` (boxed or raw arrays) as ``step``.

        ``rules`` default to the active ones, ``mesh`` to the mesh of the first
        sharded array.

        Example:
            >>> import jax.numpy as jnp, meshplan
            >>> from meshplan._checkpoint.metadata import CheckpointMetadata
            >>> w = meshplan.LogicallyPartitioned(jnp.ones((2, 4)), ("embed", "mlp"))
            >>> meta = CheckpointMetadata.describe(3, {"w": w}, rules=(("mlp", "model"),))
            >>> meta.step, meta.arrays["w"].names, meta.rules
            (3, ('embed', 'mlp'), (('mlp', 'model'),))
        """
        return cls.from_flat(
            step, flatten_state(state, rules), rules=rules, mesh=mesh, config=config, extra=extra
        )

    @classmethod
    def from_flat(
        cls,
        step: int,
        flat: Mapping[str, tuple[Any, Any]],
        *,
        rules: LogicalRules | None = None,
        mesh: Mesh | None = None,
        config: Mapping[str, object] | None = None,
        extra: Mapping[str, object] | None = None,
        checksums: Mapping[str, str] | None = None,
    ) -> CheckpointMetadata:
        """:meth:`describe` for a state already flattened by ``flatten_state``.

        ``checksums``: each array's checksum by path (what :class:`~meshplan.Checkpointer`
        stores, from :func:`meshplan._checkpoint.checksum.array_checksums`).

        Example:
            >>> import jax.numpy as jnp
            >>> from meshplan._checkpoint.metadata import CheckpointMetadata
            >>> from meshplan._checkpoint.tree import flatten_state
            >>> meta = CheckpointMetadata.from_flat(1, flatten_state({"b": jnp.zeros(3)}))
            >>> meta.arrays["b"].shape, meta.arrays["b"].names
            ((3,), None)
        """
        from meshplan._version import __version__

        mesh = mesh if mesh is not None else _mesh_of(flat)
        arrays = {
            key: ArrayInfo(
                shape=tuple(int(d) for d in value.shape),
                dtype=str(np.dtype(value.dtype)),
                names=None if box is None else tuple(box.names),
                logical=box is None or box.logical,
                checksum=None if checksums is None else checksums.get(key),
            )
            for key, (value, box) in flat.items()
        }
        return cls(
            step=int(step),
            arrays=arrays,
            rules=normalize_rules(rules) if rules is not None else get_logical_axis_rules(),
            mesh_shape={} if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
            config=None if config is None else dict(config),
            extra=dict(extra or {}),
            meshplan_version=__version__,
        )

    def to_json(self) -> dict[str, object]:
        """A JSON-serialisable dict, marked with :data:`FORMAT`.

        Example:
            >>> import json, meshplan
            >>> meta = meshplan.CheckpointMetadata(step=7, arrays={}, mesh_shape={"data": 8})
            >>> data = meta.to_json()
            >>> data["format"], data["step"], data["mesh"], data["digest"][:7]
            ('meshplan-checkpoint', 7, {'axis_names': ['data'], 'shape': [8]}, 'sha256:')
            >>> meshplan.CheckpointMetadata.from_json(json.loads(json.dumps(data))) == meta
            True
        """
        out = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "meshplan_version": self.meshplan_version,
            "step": self.step,
            "config": self.config,
            "rules": rules_to_json(self.rules),
            "mesh": {"axis_names": list(self.mesh_shape), "shape": list(self.mesh_shape.values())},
            "arrays": {k: v.to_json() for k, v in self.arrays.items()},
            "extra": self.extra,
        }
        out[_DIGEST_KEY] = metadata_digest(out)
        return out

    @classmethod
    def from_json(cls, data: object, where: str = "checkpoint") -> CheckpointMetadata:
        """The inverse of :meth:`to_json`; raises :class:`CheckpointError` on anything else.

        Example:
            >>> import meshplan
            >>> from meshplan._checkpoint.metadata import CheckpointMetadata
            >>> try:
            ...     CheckpointMetadata.from_json({"format": "other"}, "'/tmp/run' (step 3)")
            ... except meshplan.CheckpointError as e:
            ...     print(str(e).splitlines()[0])
            '/tmp/run' (step 3) is not a meshplan checkpoint: its 'meshplan' item is not meshplan metadata, got format='other'.
        """
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise error_for(
                CheckpointError,
                "ckpt-not-meshplan",
                where,
                f"{where} is not a meshplan checkpoint: its 'meshplan' item is not meshplan "
                f"metadata, got format={data.get('format') if isinstance(data, Mapping) else None!r}",
                "Pass the folder a meshplan.Checkpointer saved into.",
            )
        if int(data.get("format_version", 0)) > FORMAT_VERSION:
            raise error_for(
                CheckpointError,
                "ckpt-newer-format",
                where,
                f"{where} was written by a newer meshplan "
                f"({data.get('meshplan_version')!r}, format_version="
                f"{data.get('format_version')}), this one reads format_version {FORMAT_VERSION}",
                "Upgrade meshplan to restore it.",
            )
        stored = data.get(_DIGEST_KEY)
        if stored is not None and stored != metadata_digest(data):
            raise error_for(
                CheckpointError,
                "ckpt-damaged",
                where,
                f"{where}: its meshplan metadata changed since it was saved (digest "
                f"mismatch): the logical names, layout, step and checksums it holds cannot "
                f"be trusted",
                "Restore an earlier step (step=...), or save into a new checkpoint folder.",
            )
        mesh = data.get("mesh") or {}
        try:
            return cls(
                step=int(data["step"]),
                arrays={k: ArrayInfo.from_json(v) for k, v in data["arrays"].items()},
                rules=_rules_from_json(data.get("rules") or ()),
                mesh_shape=dict(
                    zip(mesh.get("axis_names", ()), mesh.get("shape", ()), strict=True)
                ),
                config=data.get("config"),
                extra=dict(data.get("extra") or {}),
                meshplan_version=str(data.get("meshplan_version", "")),
                sealed=stored is not None,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise error_for(
                CheckpointError,
                "ckpt-damaged",
                where,
                f"{where}: its meshplan metadata is damaged ({type(e).__name__}: {e})",
                "Restore an earlier step (step=...), or save into a new checkpoint folder.",
            ) from e
