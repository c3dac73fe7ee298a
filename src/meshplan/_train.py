"""The training loop behind ``meshplan train``: sharded state, jitted steps, resumable runs.

The recipe is the guide's, at Transformer scale:

1. ``jax.eval_shape`` of the init function gives the abstract ``TrainState``
   (boxes holding ``ShapeDtypeStruct``\\ s);
2. :func:`meshplan.logical_to_mesh_sharding` of its logical specs gives the
   state's shardings under the chosen layout;
3. ``jax.jit(init, out_shardings=...)`` creates every array where it belongs,
   or :func:`meshplan.restore` reads a checkpoint straight into those shardings;
4. a jitted train step donates the old state and returns the new one with the
   same shardings; batches arrive already sharded
   (``jax.make_array_from_process_local_data``).

Batches are a function of (split, step, seed), and the learning-rate schedule
of the step only, so a run resumed from a checkpoint (on any mesh, with any
layout) sees exactly the batches and updates of an uninterrupted one.

Everything a user can get wrong is checked by :func:`prepare` before any work
starts, and reported at once (one bullet per problem, the fix at the end).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshplan._checkpoint import (
    Checkpointer,
    CheckpointMetadata,
    compatibility_problems,
    flatten_state,
    latest_step,
    read_metadata,
    restore,
)
from meshplan._errors import CheckpointError, MeshError, MeshplanError, problem_message
from meshplan._rules import logical_axis_rules, logical_to_mesh_axes
from meshplan._shardings import get_partition_spec, logical_to_mesh_sharding

__all__ = [
    "MESH_AXES",
    "TrainRequest",
    "TrainResult",
    "TrainSettings",
    "Trainer",
    "make_mesh",
    "make_optimizer",
    "parse_mesh",
    "prepare",
]

MESH_AXES = ("data", "model")
"""Axis names of every mesh ``meshplan train`` builds (the layouts' axes)."""

_BATCH_NAMES = ("batch", "length")


# ---------------------------------------------------------------------------
# Meshes
# ---------------------------------------------------------------------------


def parse_mesh(text: str) -> tuple[int, int]:
    """``"2x4"`` -> ``(2, 4)``: sizes of the ``('data', 'model')`` axes; ``"8"`` means 8x1.

    Example:
        >>> from meshplan._train import parse_mesh
        >>> parse_mesh("2x4"), parse_mesh("8")
        ((2, 4), (8, 1))

    Raises:
        MeshError: ``text`` is not ``DATAxMODEL`` with positive integers.
    """
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        sizes = tuple(int(p) for p in parts)
    except ValueError:
        sizes = ()
    if len(sizes) == 1:
        sizes = (sizes[0], 1)
    if len(sizes) != 2 or min(sizes) < 1:
        raise MeshError(
            f"Cannot read the mesh {text!r}: expected DATAxMODEL sizes of the mesh axes "
            f"{MESH_AXES}.\nWrite it like 2x4, 4x2, 8x1 or 1x1."
        )
    return sizes[0], sizes[1]


def make_mesh(shape: tuple[int, int], devices: Any = None) -> Mesh:
    """A mesh with ``Auto`` axes ``('data', 'model')`` on the first ``prod(shape)`` devices.

    Example:
        >>> from meshplan._train import make_mesh
        >>> dict(make_mesh((4, 2)).shape)
        {'data': 4, 'model': 2}

    Raises:
        MeshError: there are fewer devices than the mesh needs.
    """
    devices = list(jax.devices() if devices is None else devices)
    size = math.prod(shape)
    if size > len(devices):
        raise MeshError(
            f"The mesh {shape[0]}x{shape[1]} needs {size} devices, but there are only "
            f"{len(devices)} ({devices[0].platform}).\nUse a smaller mesh, or more devices "
            f"(meshplan train --devices {size} emulates them on the CPU)."
        )
    return Mesh(np.array(devices[:size]).reshape(shape), MESH_AXES)


def _mesh_text(mesh: Mesh) -> str:
    return "x".join(str(s) for s in mesh.devices.shape)


# ---------------------------------------------------------------------------
# Settings
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """How to train, apart from the model, mesh and layout.

    These are stored with every checkpoint, and a resumed run takes the stored
    values for any the user does not give again.

    Attributes:
        steps: The step to train up to (a resumed run continues to it).
        batch: Sequences per step (global, over all devices).
        seq_len: Bytes per sequence (the model reads ``seq_len`` and predicts the next).
        lr: Peak learning rate of AdamW.
        warmup: Steps of linear warm-up to ``lr``, constant after.
        weight_decay: AdamW's decoupled weight decay.
        seed: Seed of the initial parameters and of the batches.
        eval_every: Evaluate every this many steps (0: only at the end).
        eval_batches: Validation batches per evaluation.
        ckpt_every: Save a checkpoint every this many steps (and at the end).
    """

    steps: int = 300
    batch: int = 32
    seq_len: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.01
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    ckpt_every: int = 100

    # Settings that change which batches or updates a step sees.
    TRAJECTORY = ("batch", "seq_len", "lr", "warmup", "weight_decay", "seed")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrainSettings:
        """Settings from :meth:`to_dict` (unknown keys are ignored)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def make_optimizer(settings: TrainSettings) -> optax.GradientTransformation:
    """Gradient clipping at norm 1, then AdamW with linear warm-up to a constant rate.

    The schedule depends on the step only (not on ``steps``), so stopping and
    resuming never changes an update.

    Example:
        >>> from meshplan._train import TrainSettings, make_optimizer
        >>> tx = make_optimizer(TrainSettings(lr=1e-3, warmup=10))
        >>> type(tx).__name__
        'GradientTransformationExtraArgs'
    """
    warmup = max(settings.warmup, 1)
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, settings.lr, warmup), optax.constant_schedule(settings.lr)],
        [warmup],
    )
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.99, weight_decay=settings.weight_decay),
    )


# ---------------------------------------------------------------------------
# Checking a request before any work
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class TrainRequest:
    """What the user asked for; ``None`` means "the stored value when resuming, else the default".

    Attributes:
        mesh: ``"2x4"``-style sizes of ``('data', 'model')``.
        rules: A built-in layout name (:mod:`meshplan.layouts`) or a rules file.
        config: A preset name (``tiny``, ``small``); ``None`` resumes with the
            stored config, or uses ``tiny``.
        overrides: Model config fields to replace (``{"num_layers": 4}``).
        data: A folder or file of text; ``None`` uses the Python standard library.
        ckpt_dir: Where to save checkpoints (``None``: no checkpoints).
        resume: Continue from the latest complete checkpoint in ``ckpt_dir``.
        settings: :class:`TrainSettings` fields the user gave.
    """

    mesh: str = "2x4"
    rules: str = "fsdp_tp"
    config: str | None = None
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    data: str | None = None
    ckpt_dir: str | None = None
    resume: bool = False
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Problems:
    """Collects (error class, problem, fix) and raises them together."""

    def __init__(self) -> None:
        self.items: list[tuple[type[MeshplanError], str, str]] = []

    def add(self, cls: type[MeshplanError], problem: str, fix: str) -> None:
        self.items.append((cls, problem, fix))

    def add_error(self, error: Exception, cls: type[MeshplanError] = MeshplanError) -> None:
        """Splits an error's message: its last line is the fix when there are several."""
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        if len(lines) > 1:
            problem, fix = " ".join(lines[:-1]), lines[-1]
        else:
            problem, fix = (lines[0] if lines else type(error).__name__), ""
        self.add(type(error) if isinstance(error, MeshplanError) else cls, problem, fix)

    def raise_if_any(self, header: str) -> None:
        if not self.items:
            return
        fixes = list(dict.fromkeys(fix for _, _, fix in self.items if fix))
        raise self.items[0][0](
            problem_message(header, [p for _, p, _ in self.items], "\n".join(fixes))
        )


def _mesh_axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _split_problems(
    shapes: Mapping[str, tuple[tuple[int, ...], tuple[Any, ...] | None]],
    mesh: Mesh,
    rules: Any,
) -> list[str]:
    """Arrays whose dimensions the mesh axes their logical names map to do not divide."""
    sizes = dict(mesh.shape)
    out = []
    for key, (shape, names) in shapes.items():
        if names is None:
            continue
        spec = logical_to_mesh_axes(names, rules)
        for dim, (size, entry) in enumerate(zip(shape, tuple(spec), strict=False)):
            axes = _mesh_axes(entry)
            parts = math.prod(sizes[a] for a in axes) if axes else 1
            if size % parts:
                out.append(
                    f"{key}: dimension {dim} ({names[dim]!r}, size {size}) does not split "
                    f"over mesh axes {axes} (size {parts})"
                )
    return out


def _load_corpus(data: str | None, problems: _Problems) -> Any:
    from meshplan.examples.data import ByteCorpus

    try:
        return ByteCorpus.from_stdlib() if data is None else ByteCorpus.from_path(data)
    except (MeshplanError, ValueError, OSError) as e:
        problems.add_error(e)
        return None


def _resolve_config(request: TrainRequest, stored: CheckpointMetadata | None) -> Any:
    from meshplan.examples.transformer import TransformerConfig, config_from_name

    if request.config is not None or stored is None or stored.config is None:
        return config_from_name(request.config or "tiny", **request.overrides)
    return dataclasses.replace(TransformerConfig.from_dict(stored.config), **request.overrides)


def _check_checkpoint_dir(
    request: TrainRequest, problems: _Problems
) -> tuple[Path | None, CheckpointMetadata | None]:
    """The checkpoint folder, and its latest metadata when resuming."""
    ckpt_dir = Path(request.ckpt_dir).absolute() if request.ckpt_dir else None
    if request.resume and ckpt_dir is None:
        problems.add(
            MeshplanError,
            "--resume needs the checkpoint folder to resume from",
            "Pass --ckpt-dir DIR with --resume.",
        )
    elif request.resume:
        try:
            return ckpt_dir, read_metadata(ckpt_dir)  # type: ignore[arg-type]
        except MeshplanError as e:
            problems.add_error(e)
    elif ckpt_dir is not None and (last := latest_step(ckpt_dir)) is not None:
        problems.add(
            CheckpointError,
            f"--ckpt-dir {str(ckpt_dir)!r} already holds checkpoints (latest step {last})",
            "Pass --resume to continue that run, or a new --ckpt-dir to start another.",
        )
    return ckpt_dir, None


def _resolve_settings(
    request: TrainRequest, stored: CheckpointMetadata | None, problems: _Problems
) -> TrainSettings:
    """The defaults, overridden by the checkpoint's settings, overridden by the request's."""
    stored_train = (stored.extra.get("train") or {}) if stored else {}
    settings = TrainSettings.from_dict(
        {**TrainSettings().to_dict(), **stored_train, **request.settings}
    )
    for name in ("steps", "batch", "seq_len", "eval_batches"):
        if getattr(settings, name) < 1:
            problems.add(
                MeshplanError,
                f"{name} must be positive, got {getattr(settings, name)}",
                "Pass positive --steps, --batch, --seq and --eval-batches.",
            )
    if stored is not None and settings.steps < stored.step:
        problems.add(
            MeshplanError,
            f"--steps {settings.steps} is before the checkpoint's step {stored.step}",
            f"Pass --steps greater than {stored.step} to train further.",
        )
    return settings


def _check_config(
    request: TrainRequest,
    stored: CheckpointMetadata | None,
    settings: TrainSettings,
    problems: _Problems,
) -> Any:
    try:
        config = _resolve_config(request, stored)
    except (ValueError, TypeError) as e:
        problems.add(
            MeshplanError, f"model config: {e}", "Use --config tiny|small with valid size flags."
        )
        return None
    if settings.seq_len > config.max_len:
        problems.add(
            MeshplanError,
            f"--seq {settings.seq_len} exceeds the model's max_len={config.max_len}",
            f"Use --seq {config.max_len} or less, or a larger --max-len.",
        )
    return config


def _check_batch(
    request: TrainRequest, settings: TrainSettings, mesh: Mesh, rules: Any, problems: _Problems
) -> None:
    axes = _mesh_axes(logical_to_mesh_axes(_BATCH_NAMES, rules)[0])
    parts = math.prod(mesh.shape[a] for a in axes if a in mesh.shape) if axes else 1
    if settings.batch % parts:
        good = (settings.batch // parts + 1) * parts
        problems.add(
            MeshplanError,
            f"--batch {settings.batch} does not split over the {parts} devices that "
            f"--rules {request.rules} shard 'batch' over (mesh axes {axes} of the "
            f"{request.mesh} mesh)",
            f"Use a --batch that is a multiple of {parts} (e.g. {good}), or a mesh and "
            f"rules that split 'batch' over fewer devices.",
        )


def _check_state(
    request: TrainRequest,
    config: Any,
    abstract: Any,
    stored: CheckpointMetadata | None,
    mesh: Mesh | None,
    rules: Any,
    problems: _Problems,
) -> None:
    """The checkpoint fits the model's shapes; the layout can split every parameter."""
    if stored is not None:
        mismatch = compatibility_problems(stored, abstract)
        if mismatch:
            saved = stored.config or {}
            fields = [
                f"{name}: the checkpoint has {saved[name]!r}, this run asks for {value!r}"
                for name, value in config.to_dict().items()
                if name in saved and saved[name] != value
            ]
            for line in fields:
                problems.add(CheckpointError, f"model config {line}", "")
            problems.add(
                CheckpointError,
                f"so {len(mismatch)} of the checkpoint's {len(stored.arrays)} arrays (step "
                f"{stored.step}) do not fit the model, e.g. {mismatch[0]}",
                "Resume with the checkpoint's config: leave out --config and the model size "
                "flags (or repeat the ones it was trained with), or train into a new --ckpt-dir.",
            )
    if mesh is not None and rules is not None:
        shapes = {
            k: (tuple(v.shape), None if b is None else tuple(b.names))
            for k, (v, b) in flatten_state(abstract.params).items()
        }
        for line in _split_problems(shapes, mesh, rules)[:6]:
            problems.add(
                MeshError,
                f"--rules {request.rules} on the {request.mesh} mesh: params/{line}",
                "Pick a layout that leaves that dimension whole (e.g. data_parallel), a mesh "
                "whose axes divide it, or model sizes that are multiples of the mesh axes.",
            )


def prepare(request: TrainRequest) -> Trainer:
    """Checks everything in ``request`` and returns a :class:`Trainer` ready to run.

    Every problem found is reported together, before any array is created:
    an unknown layout, a mesh larger than the devices, a batch the mesh does
    not divide, model dimensions the layout cannot split, a ``--data`` path
    with no text, a checkpoint folder that is empty or not a meshplan
    checkpoint, and a model config whose shapes differ from the checkpoint's.

    When resuming, settings and the model config the request leaves out
    (``None``) come from the checkpoint.

    Raises:
        MeshplanError: (the class of the first problem) one bullet per
            problem, then the fixes.

    Example:
        >>> import meshplan
        >>> from meshplan._train import TrainRequest, prepare
        >>> try:
        ...     prepare(TrainRequest(rules="nope", mesh="3x3"))
        ... except meshplan.MeshplanError as e:
        ...     print(str(e).splitlines()[0])
        meshplan train cannot start:
    """
    from meshplan.examples.transformer import Transformer
    from meshplan.layouts import get_layout

    problems = _Problems()
    rules = mesh = None
    try:
        rules = get_layout(request.rules)
    except MeshplanError as e:
        problems.add_error(e)
    try:
        mesh = make_mesh(parse_mesh(request.mesh))
    except MeshplanError as e:
        problems.add_error(e)
    ckpt_dir, stored = _check_checkpoint_dir(request, problems)
    settings = _resolve_settings(request, stored, problems)
    config = _check_config(request, stored, settings, problems)
    if mesh is not None and rules is not None:
        _check_batch(request, settings, mesh, rules, problems)
    data = request.data
    if data is not None:
        data = str(Path(data).absolute())
    elif stored is not None:
        data = (stored.extra.get("train") or {}).get("data")
    corpus = _load_corpus(data, problems)
    if config is not None:
        abstract = abstract_train_state(Transformer(config), make_optimizer(settings), settings)
        _check_state(request, config, abstract, stored, mesh, rules, problems)

    problems.raise_if_any("meshplan train cannot start:")
    assert mesh is not None and config is not None
    return Trainer(
        model=Transformer(config),
        mesh=mesh,
        rules=rules,
        settings=settings,
        corpus=corpus,
        ckpt_dir=ckpt_dir,
        resume_from=stored,
        layout_name=str(request.rules),
        data=data,
    )


# ---------------------------------------------------------------------------
# State and steps
# ---------------------------------------------------------------------------


def _init_fn(model: Any, tx: optax.GradientTransformation, seq_len: int) -> Callable[..., Any]:
    def init(key: jax.Array) -> train_state.TrainState:
        # Parameter shapes do not depend on the length; stay within max_len.
        tokens = jnp.zeros((1, min(seq_len, model.config.max_len)), jnp.int32)
        params = model.init(key, tokens)["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    return init


def abstract_train_state(
    model: Any, tx: optax.GradientTransformation, settings: TrainSettings
) -> train_state.TrainState:
    """The ``TrainState`` as ``jax.eval_shape`` sees it: boxes of ``ShapeDtypeStruct``\\ s."""
    init = _init_fn(model, tx, settings.seq_len)
    return jax.eval_shape(init, jax.random.key(settings.seed))


def state_shardings(abstract: Any, mesh: Mesh, rules: Any) -> Any:
    """The ``NamedSharding`` of every array of ``abstract`` under ``rules`` on ``mesh``."""
    return logical_to_mesh_sharding(get_partition_spec(abstract), mesh, rules)


def per_device_bytes(abstract: Any, shardings: Any) -> int:
    """The largest number of bytes any one device holds of ``abstract`` with ``shardings``."""
    totals: dict[Any, int] = {}
    for value, sharding in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True):
        nbytes = math.prod(sharding.shard_shape(value.shape)) * np.dtype(value.dtype).itemsize
        for device in sharding.device_set:
            totals[device] = totals.get(device, 0) + nbytes
    return max(totals.values(), default=0)


@dataclasses.dataclass
class TrainResult:
    """What :meth:`Trainer.run` did.

    Attributes:
        start_step: The step the run started from (0, or the checkpoint's).
        end_step: The step it reached.
        losses: Training loss after each step run, by step number.
        evals: Validation loss by step number (step 0: before training).
        best_valid: ``(step, loss)`` of the best validation loss, counting
            earlier stretches of a resumed run; ``None`` if none.
        tokens_per_second: Training throughput of the train steps (the first, which
            compiles, and the time spent evaluating and saving left out).
        seconds: Wall time of the loop.
        saved_steps: Steps saved as checkpoints during this run.
    """

    start_step: int
    end_step: int
    losses: dict[int, float] = dataclasses.field(default_factory=dict)
    evals: dict[int, float] = dataclasses.field(default_factory=dict)
    best_valid: tuple[int, float] | None = None
    tokens_per_second: float = 0.0
    seconds: float = 0.0
    saved_steps: list[int] = dataclasses.field(default_factory=list)


class Trainer:
    """A validated training run: build with :func:`prepare`, then :meth:`start` and :meth:`run`.

    Attributes:
        model: The :class:`~meshplan.examples.transformer.Transformer`.
        mesh: The mesh (``Auto`` axes ``('data', 'model')``).
        rules: The layout's logical axis rules.
        settings: The resolved :class:`TrainSettings`.
        step: The current step (host-side counter).
        state: The sharded ``TrainState`` (after :meth:`start`).
    """

    def __init__(
        self,
        *,
        model: Any,
        mesh: Mesh,
        rules: Any,
        settings: TrainSettings,
        corpus: Any,
        ckpt_dir: Path | None = None,
        resume_from: CheckpointMetadata | None = None,
        layout_name: str = "",
        data: str | None = None,
        max_to_keep: int = 3,
    ) -> None:
        self.model = model
        self.mesh = mesh
        self.rules = rules
        self.settings = settings
        self.corpus = corpus
        self.ckpt_dir = ckpt_dir
        self.resume_from = resume_from
        self.layout_name = layout_name
        self.data = data
        self.max_to_keep = max_to_keep
        self.tx = make_optimizer(settings)
        self.abstract = abstract_train_state(model, self.tx, settings)
        self.shardings = state_shardings(self.abstract, mesh, rules)
        self.batch_sharding = logical_to_mesh_sharding(PartitionSpec(*_BATCH_NAMES), mesh, rules)
        self.state: Any = None
        self.step = 0
        self.best_valid: tuple[int, float] | None = None
        if resume_from is not None:
            best = resume_from.extra.get("best_valid")
            self.best_valid = (int(best[0]), float(best[1])) if best else None
        self._checkpointer: Checkpointer | None = None
        self._train_step: Any = None
        self._eval_step: Any = None
        self._valid_batches: list[jax.Array] | None = None

    # -- context ---------------------------------------------------------------

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The mesh and rules in effect while tracing and running the steps."""
        with jax.set_mesh(self.mesh), logical_axis_rules(self.rules):
            yield

    # -- summaries -------------------------------------------------------------

    def plan_summary(self) -> dict[str, Any]:
        """Parameter count and per-device bytes of the parameters and of the whole state.

        Uses :func:`meshplan.explain` when it is available, else sums the shards.
        """
        params = self.abstract.params
        n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
        summary: dict[str, Any] = {
            "mesh": dict(self.mesh.shape),
            "layout": self.layout_name,
            "parameters": n_params,
            "params_total": sum(
                math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params)
            ),
            "params_per_device": per_device_bytes(params, self.shardings.params),
            "state_per_device": per_device_bytes(self.abstract, self.shardings),
            "state_total": sum(
                math.prod(x.shape) * np.dtype(x.dtype).itemsize
                for x in jax.tree.leaves(self.abstract)
            ),
            "source": "meshplan shard sizes",
        }
        import meshplan

        explain = getattr(meshplan, "explain", None)
        if explain is None:  # pragma: no cover - a build without the plan module
            return summary
        try:
            totals = explain(self.abstract, self.mesh, self.rules).totals
            summary["params_per_device"] = int(totals["params"].max_device_bytes)
            summary["state_per_device"] = int(totals["all"].max_device_bytes)
            summary["source"] = "meshplan.explain"
        except Exception:  # the summary is informative only: never stop a run for it
            pass
        return summary

    # -- state -----------------------------------------------------------------

    def start(self) -> None:
        """Creates the sharded state (fresh, or from the checkpoint) and compiles nothing yet."""
        if self.ckpt_dir is not None:
            self._checkpointer = Checkpointer(self.ckpt_dir, max_to_keep=self.max_to_keep)
        if self.resume_from is not None:
            restored = restore(self.ckpt_dir, self.mesh, self.rules, self.resume_from.step)  # type: ignore[arg-type]
            self.state = restored.into(self.abstract)
            self.step = int(restored.metadata.step)
        else:
            init = _init_fn(self.model, self.tx, self.settings.seq_len)
            with self.active():
                self.state = jax.jit(init, out_shardings=self.shardings)(
                    jax.random.key(self.settings.seed)
                )
            self.step = 0

    def _batch(self, split: str, index: int) -> jax.Array:
        from meshplan.examples.data import shard_batch

        s = self.settings
        tokens = self.corpus.batch_at(split, index, s.seed, s.batch, s.seq_len)
        return shard_batch(tokens, self.mesh, self.rules)

    def _compile(self) -> None:
        model = self.model

        def loss(params: Any, tokens: jax.Array) -> jax.Array:
            from meshplan.examples.transformer import loss_fn

            return loss_fn(params, tokens, model)

        def train_step(state: Any, tokens: jax.Array) -> tuple[Any, jax.Array]:
            value, grads = jax.value_and_grad(loss)(state.params, tokens)
            return state.apply_gradients(grads=grads), value

        replicated = NamedSharding(self.mesh, PartitionSpec())
        self._train_step = jax.jit(
            train_step,
            in_shardings=(self.shardings, self.batch_sharding),
            out_shardings=(self.shardings, replicated),
            donate_argnums=(0,),
        )
        self._eval_step = jax.jit(
            loss,
            in_shardings=(self.shardings.params, self.batch_sharding),
            out_shardings=replicated,
        )

    def train_step(self) -> jax.Array:
        """Runs one step on the batch of the current step; returns its loss (not synced)."""
        if self._train_step is None:
            self._compile()
        tokens = self._batch("train", self.step)
        with self.active():
            self.state, loss = self._train_step(self.state, tokens)
        self.step += 1
        return loss

    def evaluate(self) -> float:
        """Mean loss over ``eval_batches`` fixed validation batches, in nats per byte."""
        if self._eval_step is None:
            self._compile()
        if self._valid_batches is None:
            self._valid_batches = [
                self._batch("valid", i) for i in range(self.settings.eval_batches)
            ]
        with self.active():
            losses = [self._eval_step(self.state.params, b) for b in self._valid_batches]
        value = float(np.mean([float(x) for x in losses]))
        if self.best_valid is None or value < self.best_valid[1]:
            self.best_valid = (self.step, value)
        return value

    def save(self) -> bool:
        """Starts an asynchronous save of the current step; ``False`` if not saving."""
        if self._checkpointer is None:
            return False
        extra = {
            "train": {**self.settings.to_dict(), "data": self.data},
            "layout": self.layout_name,
            "best_valid": list(self.best_valid) if self.best_valid else None,
        }
        return self._checkpointer.save(
            self.step,
            self.state,
            rules=self.rules,
            mesh=self.mesh,
            config=self.model.config.to_dict(),
            extra=extra,
        )

    def close(self) -> None:
        """Waits for the last save to reach the disk."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None

    # -- the loop --------------------------------------------------------------

    def run(
        self,
        on_step: Callable[[int, float, float], None] | None = None,
        on_eval: Callable[[int, float], None] | None = None,
        on_save: Callable[[int], None] | None = None,
    ) -> TrainResult:
        """Trains from :attr:`step` up to ``settings.steps``, evaluating and saving on schedule.

        Args:
            on_step: Called after each step with ``(step, loss, tokens_per_second)``.
            on_eval: Called after each evaluation with ``(step, valid_loss)``.
            on_save: Called when a checkpoint save starts, with its step.

        Returns:
            A :class:`TrainResult`.
        """
        s = self.settings
        if self.state is None:
            self.start()
        result = TrainResult(start_step=self.step, end_step=self.step)
        if self.resume_from is None and self.step == 0:
            result.evals[0] = self.evaluate()
            if on_eval:
                on_eval(0, result.evals[0])
        t0 = time.perf_counter()
        first, timed_steps, timed_seconds = True, 0, 0.0
        tokens_per_step = s.batch * s.seq_len
        tps = 0.0
        while self.step < s.steps:
            started = time.perf_counter()
            loss = float(self.train_step())
            if first:
                first = False  # the first step compiles: leave it out of the throughput
            else:
                timed_steps += 1
                timed_seconds += time.perf_counter() - started
                tps = timed_steps * tokens_per_step / max(timed_seconds, 1e-9)
            result.losses[self.step] = loss
            if on_step:
                on_step(self.step, loss, tps)
            last = self.step == s.steps
            if (s.eval_every and self.step % s.eval_every == 0) or last:
                result.evals[self.step] = self.evaluate()
                if on_eval:
                    on_eval(self.step, result.evals[self.step])
            due = (s.ckpt_every and self.step % s.ckpt_every == 0) or last
            if due and self.save():
                result.saved_steps.append(self.step)
                if on_save:
                    on_save(self.step)
        result.seconds = time.perf_counter() - t0
        result.end_step = self.step
        result.best_valid = self.best_valid
        result.tokens_per_second = tps
        return result


def describe_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``.

    Example:
        >>> from meshplan._train import describe_bytes
        >>> describe_bytes(1536), describe_bytes(3 * 2**20)
        ('1.5 KiB', '3.0 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover
