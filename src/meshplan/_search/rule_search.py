"""Searching the space of rules: candidates generated, pruned, priced, a few compiled.

:func:`search_rules` traces the step once (:mod:`meshplan._search.trace`), builds
every candidate (:mod:`meshplan._search.candidates`: the built-in layouts, then
generated meshes of 1 to 3 axes with rules), prunes by symmetry, the
validator (:func:`meshplan.validate` on every distinct array and the batch),
idle axes and the memory budget, predicts the step time of every survivor
(:mod:`meshplan._search.cost`) and ranks by it. Only the first ``compile_top``
are compiled (when this process has the devices) to refine with the HLO's
exact collective bytes and XLA's memory analysis; ``measure=True`` runs the
first ``measure_top`` for real and ranks them by measured time. Nothing needs
devices unless it compiles or measures: a 16,384-device search is analytic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from meshplan._errors import ArgumentError
from meshplan._search.candidates import ALL_ROLES, CONTEXT_NAMES, Candidate, generate
from meshplan._search.cost import Cost, _Specs, predict, state_bytes
from meshplan._search.hlo import measure_step
from meshplan._search.profiles import HardwareProfile, get_profile
from meshplan._search.search import mesh_shapes
from meshplan._search.trace import Workload, trace_workload
from meshplan._spmd.validate import validate
from meshplan._text import human_bytes
from meshplan.layouts import LAYOUTS

__all__ = ["RuleRow", "RuleSearchResult", "linen_step", "search_rules"]

PRUNE_REASONS = ("invalid", "batch", "idle", "symmetric", "memory")
"""Why a candidate is pruned, in the order the checks run."""


@dataclasses.dataclass
class RuleRow:
    """One candidate: its mesh (axis -> size), rules, and what the search found.

    ``status``: ``'ok'`` or ``'pruned'`` (``reason``: ``'<kind>: <detail>'``, the
    kind one of ``PRUNE_REASONS``); ``cost``: the prediction; ``compiled``: what the
    compiled step showed (:func:`meshplan._search.hlo.measure_step`); ``measured_s``:
    the median step time when run; ``rank``: 1 is the best.
    """

    mesh: dict[str, int]
    rules: tuple[tuple[str, Any], ...]
    layout: str = "searched"
    status: str = "ok"
    reason: str = ""
    cost: Cost | None = None
    compiled: dict[str, Any] | None = None
    measured_s: float | None = None
    rank: int | None = None

    @property
    def mesh_text(self) -> str:
        return "x".join(str(s) for s in self.mesh.values())

    @property
    def axes_text(self) -> str:
        return ",".join(self.mesh)

    @property
    def predicted_s(self) -> float | None:
        """The predicted step time in seconds (refined by the compile, when compiled)."""
        return None if self.cost is None else self.cost.step_s

    @property
    def rules_pairs(self) -> list[list[Any]]:
        """The rules as JSON-ready ``[name, axes]`` pairs (axes a name, a list or ``None``)."""
        return [[n, list(a) if isinstance(a, tuple) else a] for n, a in self.rules]

    @property
    def short_rules(self) -> str:
        """The rules that split something: ``batch=data+fsdp embed=fsdp mlp=tensor``."""
        parts = []
        for n, a in self.rules:
            axes = a if isinstance(a, tuple) else (() if a is None else (a,))
            axes = tuple(x for x in axes if self.mesh.get(x, 1) > 1)
            if axes:
                parts.append(f"{n}={'+'.join(axes)}")
        return " ".join(parts) or "(all replicated)"

    def train_command(self, rules_path: str = "rules.json", write: bool = True) -> str:
        """A ready ``meshplan train`` command for this row; writes ``rules_path`` (the rules JSON).

        Example:
            >>> from meshplan._search.rule_search import RuleRow
            >>> row = RuleRow({"data": 2, "tensor": 4}, (("batch", ("data",)), ("mlp", "tensor")))
            >>> row.train_command("/tmp/rules.json", write=False)
            'meshplan train --mesh 2x4 --axes data,tensor --rules /tmp/rules.json'
        """
        if write:
            with open(rules_path, "w") as f:
                json.dump(self.rules_pairs, f)
                f.write("\n")
        return (
            f"meshplan train --mesh {self.mesh_text} --axes {self.axes_text} --rules {rules_path}"
        )

    def to_dict(self, result: RuleSearchResult | None = None) -> dict[str, Any]:
        """Plain data; with ``result``, the prediction's fields of ``meshplan plan --json``
        (tokens/s, MFU, memory by kind against the budget: :mod:`meshplan._search.report`)."""
        cost = self.cost
        data: dict[str, Any] = {
            "mesh": dict(self.mesh), "mesh_shape": list(self.mesh.values()),
            "axis_names": list(self.mesh), "layout": self.layout, "rules": self.rules_pairs,
            "status": self.status, "reason": self.reason, "rank": self.rank,
            "predicted_step_s": self.predicted_s,
            "memory_bytes_per_device": None if cost is None else cost.memory_bytes,
            "state_bytes_per_device": None if cost is None else cost.state_bytes,
            "comm_bytes": None if cost is None else dict(cost.comm_bytes),
            "comm_by_axis": None if cost is None else dict(cost.comm_by_axis),
            "compute_s": None if cost is None else cost.compute_s,
            "comm_s": None if cost is None else cost.comm_s,
            "compiled": self.compiled, "measured_step_s": self.measured_s,
        }  # fmt: skip
        if cost is not None and result is not None:
            from meshplan._search.report import prediction_fields

            fields = prediction_fields(
                cost, result.tokens, result.devices, result.profile, result.budget_bytes
            )
            data.update({k: v for k, v in fields.items() if k not in ("devices", "profile")})
        return data


@dataclasses.dataclass
class RuleSearchResult:
    """What :func:`search_rules` found: ``rows`` (ranked ``ok`` rows, then pruned), counts.

    ``counts``: ``enumerated``, ``pruned`` (by reason), ``scored``, ``compiled``,
    ``measured``; ``best``: the first ``ok`` row, or ``None``; ``seconds``: the
    search's wall time (tracing included).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
        >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
        >>> def step(s, x):
        ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)
        >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
        >>> result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
        >>> result.counts["compiled"], result.best.rank
        (0, 1)
    """

    rows: list[RuleRow]
    devices: int
    profile: HardwareProfile
    budget_bytes: int
    counts: dict[str, Any]
    seconds: float
    batch: int | None = None
    tokens: int | None = None

    @property
    def ok(self) -> list[RuleRow]:
        """The rows that passed, ranked.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
            >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
            >>> def step(s, x):
            ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)
            >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
            >>> result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
            >>> [r.rank for r in result.ok][:3]
            [1, 2, 3]
        """
        return [r for r in self.rows if r.status == "ok"]

    @property
    def best(self) -> RuleRow | None:
        """The first ranked row, or ``None`` when nothing passed.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
            >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
            >>> def step(s, x):
            ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)
            >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
            >>> result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
            >>> result.best.mesh_text, result.best.layout
            ('1x8', 'tensor_parallel')
        """
        return next(iter(self.ok), None)

    def best_builtin(self) -> RuleRow | None:
        """The first ``ok`` row of a built-in layout.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
            >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
            >>> def step(s, x):
            ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)
            >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
            >>> result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
            >>> result.best_builtin().layout
            'tensor_parallel'
        """
        return next((r for r in self.ok if r.layout != "searched"), None)

    def train_command(self, rules_path: str = "rules.json", write: bool = True) -> str | None:
        """The best row's ``meshplan train`` command; writes its rules to ``rules_path``.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
            >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
            >>> def step(s, x):
            ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)
            >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
            >>> result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
            >>> result.train_command("/tmp/rules.json")
            'meshplan train --mesh 1x8 --axes data,model --rules /tmp/rules.json'
        """
        return None if self.best is None else self.best.train_command(rules_path, write)

    def table(self, top: int = 10) -> str:
        """The first ``top`` ranked rows and the pruning counts, as text.

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
            >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
            >>> def step(s, x):
            ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)
            >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
            >>> result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
            >>> print(result.table(1))  # doctest: +ELLIPSIS
            8 devices, profile h100, budget 74.51 GiB/device, batch 64
              #  mesh ...
              1  1x8 data,model ...
            enumerated ..., pruned ...
            best: 1x8 data,model mlp=model
        """
        lines = [
            f"{self.devices} devices, profile {self.profile.name}, budget "
            f"{human_bytes(self.budget_bytes)}/device" + (f", batch {self.batch}" if self.batch else ""),
            f"{'#':>3}  {'mesh':<14} {'predicted':>10} {'measured':>9} {'memory':>11} "
            f"{'all-reduce':>11} {'all-gather':>11}  rules",
        ]  # fmt: skip
        for r in self.ok[:top]:
            c = r.cost
            assert c is not None
            mesh = f"{r.mesh_text} {r.axes_text}"
            measured = "-" if r.measured_s is None else f"{r.measured_s * 1e3:.2f}ms"
            name = f" ({r.layout})" if r.layout != "searched" else ""
            lines.append(
                f"{r.rank:>3}  {mesh:<14} {c.step_s * 1e3:>8.3f}ms {measured:>9} "
                f"{human_bytes(c.memory_bytes):>11} "
                f"{human_bytes(c.comm_bytes.get('all-reduce', 0)):>11} "
                f"{human_bytes(c.comm_bytes.get('all-gather', 0)):>11}  {r.short_rules}{name}"
            )
        pruned = self.counts["pruned"]
        lines.append(
            f"enumerated {self.counts['enumerated']}, pruned "
            + ", ".join(f"{k} {v}" for k, v in pruned.items() if v)
            + f"; scored {self.counts['scored']}, compiled {self.counts['compiled']}, "
            f"measured {self.counts['measured']}; {self.seconds:.1f} s"
        )
        if self.best is not None:
            lines.append(
                f"best: {self.best.mesh_text} {self.best.axes_text} {self.best.short_rules}"
            )
        else:
            lines.append("best: none (no candidate passes and fits)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (``schema`` ``meshplan.rule_search/1``).

        Example:
            >>> import jax, jax.numpy as jnp, meshplan
            >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
            >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
            >>> def step(s, x):
            ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(s["w"].value)
            >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.float32)
            >>> result = meshplan.search_rules(8, state, step, x, profile="h100", compile_top=0)
            >>> data = result.to_dict()
            >>> data["best"]["mesh_shape"], data["best"]["axis_names"], data["best"]["rules"][1]
            ([1, 8], ['data', 'model'], ['mlp', 'model'])
        """
        return {
            "schema": "meshplan.rule_search/1", "devices": self.devices, "batch": self.batch,
            "profile": self.profile.to_dict(), "budget_bytes": self.budget_bytes,
            "counts": self.counts, "seconds": self.seconds,
            "best": None if self.best is None else self.best.to_dict(self),
            "rows": [r.to_dict(self) for r in self.rows],
        }  # fmt: skip


def linen_step(
    model: Any,
    example_inputs: Any,
    loss: Callable[[Any, Any], Any] | None = None,
    optimizer: Any = None,
) -> tuple[Any, Callable[[Any, Any], Any], Any]:
    """``(abstract_state, step_fn, example_batch)`` of a Flax Linen model's train step.

    The state is a ``flax.training.train_state.TrainState`` (``optimizer``, default
    Adam) from ``jax.eval_shape`` of ``model.init``; the step applies the gradient
    of ``loss(model.apply({'params': params}, inputs), batch)`` (default: the mean
    of the squared outputs). ``example_inputs`` is the batch (first dimension
    ``'batch'``): arrays or ``ShapeDtypeStruct``s. A tuple or list batch is
    ``(inputs, targets, ...)``: the model gets its first item, the loss all of it
    (``loss(outputs, (images, labels))``).
    """
    import jax.numpy as jnp
    import optax
    from flax.training import train_state

    tx = optimizer if optimizer is not None else optax.adam(1e-3)
    loss_fn = loss if loss is not None else (lambda y, _: jnp.mean(jnp.square(y)))

    def inputs(batch: Any) -> Any:
        return batch[0] if isinstance(batch, tuple | list) else batch

    def init(key: Any, batch: Any) -> Any:
        params = model.init(key, inputs(batch))["params"]
        return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

    abstract = jax.eval_shape(init, jax.random.key(0), example_inputs)

    def step(state: Any, batch: Any) -> Any:
        def objective(params: Any) -> Any:
            return loss_fn(state.apply_fn({"params": params}, inputs(batch)), batch)

        return state.apply_gradients(grads=jax.grad(objective)(state.params))

    return abstract, step, example_inputs


TIE = 0.03
"""Predictions within 3% of each other are ties (the cost model is not that exact, and a
measured CPU profile moves that much from run to run): broken by a fixed order."""


def _step(row: RuleRow) -> float:
    return row.cost.step_s if row.cost is not None else math.inf


def _rank(rows: list[RuleRow]) -> list[RuleRow]:
    """Rows by predicted time; ties (:data:`TIE`) broken deterministically: built-in layouts,
    fewer mesh axes, less memory, then the mesh and rules' text."""
    by_time = sorted(rows, key=lambda r: r.cost.step_s if r.cost else math.inf)
    out: list[RuleRow] = []
    i = 0
    while i < len(by_time):
        first = by_time[i].cost
        limit = first.step_s * (1 + TIE) if first else math.inf
        j = i
        while j < len(by_time) and _step(by_time[j]) <= limit:
            j += 1
        j = max(j, i + 1)
        group = by_time[i:j]
        group.sort(key=lambda r: (r.layout == "searched", len(r.mesh),
                                  r.cost.memory_bytes if r.cost else 0, r.mesh_text,
                                  r.axes_text, r.short_rules))  # fmt: skip
        out += group
        i = j
    return out


def _own_rules(rules: Any, workload: Workload) -> tuple[tuple[str, Any], ...]:
    """A built-in layout's rules for this model: only the names the model has (``batch``
    too), then every other name it has, unsplit, so that a rules file written from it names
    all of them (``meshplan check`` then finds nothing unknown)."""
    model = set(workload.names) | {"batch"}
    own = [(n, a) for n, a in rules if n in model]
    given = {n for n, _ in own}
    return (*own, *((n, None) for n in workload.names if n not in given))


def _signature(
    c: Candidate,
    hierarchical: bool,
    leaves: list[tuple[tuple[Any, ...], tuple[int, ...]]],
    batch_names: tuple[Any, ...],
) -> tuple[Any, ...]:
    """What makes two candidates the same: where each mesh axis splits the state's arrays
    and the batch (dimension by dimension), whatever its name. Axes that split the same
    dimensions are one axis of their product (merged) unless the profile's links differ
    by position (``hierarchical``: then mesh order counts too)."""
    specs = _Specs(c.mesh, c.rules)
    where: dict[str, list[tuple[int, int]]] = {a: [] for a, s in c.mesh.items() if s > 1}
    arrays = [*leaves, (batch_names, (0,) * len(batch_names))]
    for i, (names, shape) in enumerate(arrays):
        for d, axes in enumerate(specs(names, len(shape))):
            for a in axes:
                where[a].append((i, d))
    if hierarchical:
        return tuple((c.mesh[a], tuple(w)) for a, w in where.items())
    merged: dict[tuple[tuple[int, int], ...], int] = {}
    for a, w in where.items():
        merged[tuple(w)] = merged.get(tuple(w), 1) * c.mesh[a]
    return tuple(sorted((size, w) for w, size in merged.items()))


def _divides(c: Candidate, leaves: list[tuple[tuple[Any, ...], tuple[int, ...]]]) -> int | None:
    """The index of the first leaf whose split does not divide its shape (fast), or None."""
    specs = _Specs(c.mesh, c.rules)
    for i, (names, shape) in enumerate(leaves):
        for size, axes in zip(shape, specs(names, len(shape)), strict=True):
            if axes and size % math.prod(c.mesh[a] for a in axes):
                return i
    return None


def _prune(
    c: Candidate,
    work: Workload,
    batch: int | None,
    batch_names: tuple[Any, ...],
    leaves: list[tuple[tuple[Any, ...], tuple[int, ...]]],
) -> str | None:
    """Why the validator (or an idle axis) rejects ``c``, or ``None``.

    A fast divisibility pass finds the leaf to ask :func:`meshplan.validate` about; rules
    naming axes the mesh lacks (given layouts) are asked about for every leaf."""
    given = c.layout != "searched"
    first = _divides(c, leaves)
    for names, shape in leaves if given or first is None else [leaves[first]]:
        errors = [
            p for p in validate("state", shape, names, c.mesh, c.rules) if p.severity == "error"
        ]
        if errors:
            return f"invalid: {errors[0].message}"
    if batch is not None:
        shape = (batch,) + (1,) * (len(batch_names) - 1)
        bad = [
            p
            for p in validate("batch", shape, batch_names, c.mesh, c.rules)
            if p.severity == "error"
        ]
        if bad:
            return f"batch: {bad[0].message}"
    specs = _Specs(c.mesh, c.rules)
    used = {a for names, shape in leaves for axes in specs(names, len(shape)) for a in axes}
    used |= {a for axes in specs(batch_names, len(batch_names)) for a in axes}
    acts = tuple(n for n in work.names if n in CONTEXT_NAMES or n.startswith("activation_"))
    used |= {a for axes in specs(acts, len(acts)) for a in axes}
    idle = [a for a, s in c.mesh.items() if s > 1 and a not in used]
    if idle:
        return f"idle: mesh axis {idle[0]!r} ({c.mesh[idle[0]]}) splits nothing"
    return None


def search_rules(
    devices: int,
    abstract_state: Any = None,
    step_fn: Callable[[Any, Any], Any] | None = None,
    example_batch: Any = None,
    *,
    model: Any = None,
    loss: Callable[[Any, Any], Any] | None = None,
    optimizer: Any = None,
    profile: str | HardwareProfile = "cpu",
    memory_budget_bytes: int | None = None,
    layouts: Mapping[str, Any] | Sequence[str] | None = None,
    names: Sequence[str] | None = None,
    roles: Sequence[str] = ALL_ROLES,
    max_axes: int = 3,
    compile_top: int = 3,
    measure: bool = False,
    measure_top: int = 3,
    measure_steps: int = 5,
    workload: Workload | None = None,
) -> RuleSearchResult:
    """Searches meshes of ``devices`` and logical rules for the fastest predicted step.

    Give the step as ``(abstract_state, step_fn, example_batch)``, or a Flax Linen
    ``model`` with ``example_batch`` (its inputs) and optionally ``loss``/``optimizer``
    (:func:`linen_step` builds the step), or a traced ``workload``.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.float32)
        >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
        >>> def step(state, x):
        ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(state["w"].value)
        >>> result = meshplan.search_rules(8, state, step, jax.ShapeDtypeStruct((64, 4096), jnp.float32),
        ...                                profile="h100", compile_top=0)
        >>> result.best.mesh_text, result.best.layout    # Megatron-style: the weight split by columns
        ('1x8', 'tensor_parallel')
        >>> result.counts["enumerated"] > result.counts["scored"] > 0
        True

    Args:
        devices: The device count (any: nothing runs unless compiling or measuring).
        abstract_state: The state (``jax.eval_shape`` of init), boxed or NNX.
        step_fn: ``step_fn(state, batch)``, not jitted.
        example_batch: The batch (its arrays' first dimension is ``'batch'``).
        model: A Flax Linen module, in place of the three above (with ``example_batch``).
        loss: ``loss(outputs, batch)`` for ``model``.
        optimizer: An Optax optimizer for ``model`` (default Adam).
        profile: ``'cpu'`` (measured here), ``'h100'``, ``'h200'``, ``'tpu_v5e'`` or a
            :class:`meshplan.HardwareProfile`.
        memory_budget_bytes: Bytes one device may hold (default: the profile's memory).
        layouts: Built-in layout names or ``{name: rules}`` always tried (default: all
            built-in layouts; their mesh axes are ``('data', 'model')``).
        names: Parameter names the search may split (default: every name the state
            carries but ``layer``).
        roles: Mesh axis roles to use (``data``, ``fsdp``, ``tensor``, and ``context``,
            ``expert`` where the model has a sequence or expert name).
        max_axes: At most this many mesh axes.
        compile_top: Compile the first this many (needs ``devices`` JAX devices; else 0).
        measure: Run the first ``measure_top`` and rank them by measured time.
        measure_top: How many to run.
        measure_steps: Steps timed per candidate (the median counts).
        workload: A traced workload (skips tracing).

    Raises:
        ArgumentError: neither a step nor a model; ``measure`` without the devices.
    """
    t0 = time.perf_counter()
    if model is not None:
        if example_batch is None:
            raise ArgumentError(
                "search_rules(model=...) needs example_batch= (the model's inputs)."
            )
        abstract_state, step_fn, example_batch = linen_step(model, example_batch, loss, optimizer)
    if workload is None:
        if step_fn is None or abstract_state is None or example_batch is None:
            raise ArgumentError(
                "search_rules needs (abstract_state, step_fn, example_batch), or model= with "
                "example_batch=, or workload=."
            )
        workload = trace_workload(step_fn, abstract_state, example_batch, read_constraints=True)
    have_devices = jax.device_count() >= devices
    if measure and (not have_devices or step_fn is None):
        raise ArgumentError(
            f"measure=True runs the step on {devices} devices; JAX has {jax.device_count()} "
            f"(and a step is needed).\nSet XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{devices} before JAX starts, or search without measure."
        )
    prof = get_profile(profile, devices)
    budget = memory_budget_bytes if memory_budget_bytes is not None else prof.memory_bytes
    if layouts is None:
        layouts = dict(LAYOUTS)
    elif not isinstance(layouts, Mapping):
        layouts = {n: LAYOUTS[n] for n in layouts}
    search_names = [n for n in (names or workload.param_names) if n != "layer"]
    if names is None:  # activations' own names (MaxText's activation_embed) may split too
        search_names += [n for n in workload.names
                         if n.startswith("activation_") and n not in CONTEXT_NAMES]  # fmt: skip
    other = [n for n in workload.names if n not in search_names and n != "batch"]
    candidates: list[Candidate] = [
        Candidate(dict(zip(("data", "model"), s, strict=True)), _own_rules(r, workload), name)
        for name, r in layouts.items()
        for s in mesh_shapes(devices, 2)
    ]
    candidates += generate(devices, search_names, other_names=other, max_axes=max_axes, roles=roles)
    hierarchical = devices > prof.domain_devices
    leaves = list(dict.fromkeys((n, s) for n, s, _ in workload.state if n is not None))
    batch = workload.batch
    batch_names: tuple[Any, ...] = ("batch",)
    pruned = dict.fromkeys(PRUNE_REASONS, 0)
    acts = tuple(n for n in workload.names if n in CONTEXT_NAMES or n.startswith("activation_"))
    sig_arrays = [*leaves, (acts, (0,) * len(acts))] if acts else leaves
    seen: set[Any] = set()
    rows: list[RuleRow] = []
    out: list[RuleRow] = []
    for c in candidates:
        row = RuleRow(c.mesh, c.rules, c.layout)
        # A generated candidate with the splits of one listed before is that candidate
        # (asked first: it is cheaper than the validator, and most are).
        sig = _signature(c, hierarchical, sig_arrays, batch_names)
        if c.layout == "searched" and sig in seen:
            reason: str | None = "symmetric: the same splits as a candidate listed before"
        else:
            reason = _prune(c, workload, batch, batch_names, leaves)
            if reason is None and sig in seen:
                reason = "symmetric: the same splits as a candidate listed before"
            if c.layout == "searched" or reason is None:
                seen.add(sig)
        if reason is None:
            held = state_bytes(workload, _Specs(c.mesh, c.rules))
            if held > budget:  # the state alone: no need to price the step
                reason = (f"memory: the state alone, {human_bytes(held)} per device, is over "
                          f"the budget of {human_bytes(budget)}")  # fmt: skip
        if reason is None:
            row.cost = predict(workload, c.mesh, c.rules, prof)
            if row.cost.memory_bytes > budget:
                reason = (f"memory: {human_bytes(row.cost.memory_bytes)} per device is over "
                          f"the budget of {human_bytes(budget)}")  # fmt: skip
        if reason is not None:
            row.status, row.reason = "pruned", reason
            pruned[reason.split(":")[0]] += 1
            if c.layout != "searched" or reason.split(":")[0] != "symmetric":
                out.append(row)
            continue
        rows.append(row)
    scored = sum(1 for r in [*rows, *out] if r.cost is not None)
    rows = _rank(rows)
    compiled = 0
    if compile_top and have_devices and step_fn is not None:
        for row in rows[:compile_top]:
            row.compiled = measure_step(step_fn, abstract_state, example_batch, row.mesh, row.rules)
            compiled += 1
            _refine(row)
        rows[:compile_top] = sorted(
            rows[:compile_top], key=lambda r: r.cost.step_s if r.cost else 0
        )
    measured = 0
    if measure and step_fn is not None:
        from meshplan._search.timing import prepare_step

        top = rows[:measure_top]
        prepared = [
            prepare_step(step_fn, abstract_state, example_batch, r.mesh, r.rules) for r in top
        ]
        samples: list[list[float]] = [[] for _ in top]
        for _ in range(measure_steps):  # interleaved: noise hits every candidate alike
            for i, p in enumerate(prepared):
                # The first step after switching programs pays for the switch (caches,
                # the thread pool). Keep the second.
                samples[i] += p.run(2)[1:]
        for row, s in zip(top, samples, strict=True):
            row.measured_s = statistics.median(s)
        measured = len(top)
        rows[:measure_top] = sorted(top, key=lambda r: r.measured_s or 0)
    for i, row in enumerate(rows, 1):
        row.rank = i
    counts = {"enumerated": len(candidates), "pruned": pruned, "scored": scored,
              "compiled": compiled, "measured": measured}  # fmt: skip
    return RuleSearchResult(
        rows + out, devices, prof, budget, counts, time.perf_counter() - t0, batch,
        workload.tokens,
    )  # fmt: skip


def _refine(row: RuleRow) -> None:
    """Scale the predicted communication time by the compiled step's bytes over the predicted."""
    cost, comp = row.cost, row.compiled
    if cost is None or comp is None:
        return
    predicted = sum(cost.comm_bytes.values())
    exact = comp["collective_bytes"]
    if predicted and exact:
        scale = exact / predicted
        extra = cost.comm_s * (scale - 1)
        cost.comm_s += extra
        cost.step_s += extra
    temp = comp.get("xla_temp_bytes")
    if temp is not None:
        cost.activation_bytes = int(temp)
