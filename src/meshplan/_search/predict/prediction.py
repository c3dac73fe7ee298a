"""One layout's prediction: :func:`predict`, the figures ``meshplan plan --profile`` prints.

The same trace (:func:`meshplan.trace_workload`, reading the model's logical constraints)
and the same pricing (:func:`meshplan._search.predict.cost.predict_specs`) as every row of
:func:`meshplan.search_rules`: a layout predicted here and found by a search has the same
step time and memory (before a search's compile refines its first rows).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from meshplan._errors import ArgumentError, Problem, error_from_problems
from meshplan._search.predict.cost import Cost, _Specs, predict_specs
from meshplan._search.predict.inputs import check_search_args, whole_number
from meshplan._search.predict.pipeline import PipelineCost, predict_pipeline
from meshplan._search.predict.profiles import HardwareProfile, get_profile, with_attention
from meshplan._search.predict.report import prediction_fields, prediction_lines
from meshplan._search.predict.trace import ThroughputUnit, Workload, trace_workload
from meshplan._spmd.mesh_info import MeshLike
from meshplan._spmd.pipeline import PipelineSchedule, stage_axes
from meshplan._spmd.rules import LogicalRules
from meshplan._types import LossFn, PyTree, StepFn

if TYPE_CHECKING:
    import flax.linen as nn
    import optax

__all__ = ["Prediction", "check_pipeline", "example_prediction", "predict"]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A layout's predicted step on a hardware profile (:func:`predict`).

    Attributes:
        cost: The figures by kind (compute, memory traffic, communication; bytes per
            device of state, batch, activations, temporaries).
        mesh: The mesh's axis sizes.
        profile: The hardware.
        budget_bytes: Bytes one device may hold (default: the profile's memory).
        tokens: What one step processes, in ``tokens_unit`` (``'tokens'`` or ``'examples'``).
        pipeline: Where the rules give ``'stage'`` a mesh axis: the schedule, its bubble,
            the sends between stages (``cost`` is then the pipelined step's, its bytes one
            stage's device's).

    Example:
        >>> from meshplan._search.predict.prediction import example_prediction
        >>> p = example_prediction()  # predict's example, run once
        >>> p.mesh, p.profile.name, p.tokens, p.tokens_unit
        ({'data': 8}, 'h100', 64, 'examples')
    """

    cost: Cost
    mesh: dict[str, int]
    profile: HardwareProfile
    budget_bytes: int
    tokens: int | None
    tokens_unit: ThroughputUnit = "tokens"
    pipeline: PipelineCost | None = None

    @property
    def step_s(self) -> float:
        """The predicted step time, seconds.

        Example:
            >>> from meshplan._search.predict.prediction import example_prediction
            >>> round(example_prediction().step_s * 1e3, 3)
            0.155
        """
        return self.cost.step_s

    @property
    def memory_bytes(self) -> int:
        """The predicted peak bytes on one device.

        Example:
            >>> from meshplan._search.predict.prediction import example_prediction
            >>> example_prediction().memory_bytes / 2**20
            64.125
        """
        return self.cost.memory_bytes

    @property
    def fits(self) -> bool:
        """Whether :attr:`memory_bytes` is within :attr:`budget_bytes`.

        Example:
            >>> from meshplan._search.predict.prediction import example_prediction
            >>> example_prediction().fits, example_prediction().budget_bytes // 2**30
            (True, 74)
        """
        return self.memory_bytes <= self.budget_bytes

    def to_dict(self) -> dict[str, object]:
        """The figures as plain data (``meshplan plan --json``'s ``prediction``).

        Example:
            >>> from meshplan._search.predict.prediction import example_prediction
            >>> data = example_prediction().to_dict()
            >>> data["devices"], data["comm_bytes"], data["fits"]
            (8, {'all-reduce': 33554432}, True)
        """
        devices = math.prod(self.mesh.values())
        fields = prediction_fields(
            self.cost, self.tokens, devices, self.profile, self.budget_bytes, self.tokens_unit
        )
        fields["pipeline"] = None if self.pipeline is None else self.pipeline.to_dict()
        return fields

    def lines(self) -> list[str]:
        """The figures as the lines ``meshplan plan --profile`` prints.

        Example:
            >>> from meshplan._search.predict.prediction import example_prediction
            >>> example_prediction().lines()[2]
            'memory/device 64.12 MiB of 74.51 GiB (fits): state 32.00 MiB, batch 64.00 KiB, activations 64.00 KiB, temporaries 32.00 MiB'
        """
        return prediction_lines(self.to_dict())

    def __str__(self) -> str:
        return "\n".join(self.lines())


@functools.cache
def example_prediction() -> Prediction:
    """:func:`predict`'s example, run once per process (:class:`Prediction`'s examples share it):
    one 4096x4096 bf16 weight, a batch of 64, data parallelism on 8 H100s.

    Example:
        >>> from meshplan._search.predict.prediction import example_prediction
        >>> example_prediction() is example_prediction()
        True
    """
    import jax
    import jax.numpy as jnp

    from meshplan._spmd.boxes import LogicallyPartitioned

    w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
    state = {"w": LogicallyPartitioned(w, ("embed", "mlp"))}

    def step(state: PyTree, x: object) -> PyTree:
        return jax.grad(lambda w: ((x @ w) ** 2).mean())(state["w"].value)

    x = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
    return predict(state, step, x, mesh={"data": 8}, rules=(("batch", "data"),), profile="h100")


def _mesh_sizes(mesh: Any) -> dict[str, int]:
    """``{axis: size}`` of a mapping, a ``jax.sharding.Mesh`` or an ``AbstractMesh``."""
    shape = getattr(mesh, "shape", mesh)
    problems = []
    if not isinstance(shape, Mapping) or not shape:
        problems.append(f"mesh={mesh!r}: expected axis sizes, e.g. {{'data': 8, 'model': 4}}")
    else:
        for axis, size in shape.items():
            n = whole_number(size) if not isinstance(size, float) else None
            if not isinstance(axis, str) or n is None or n < 1:
                problems.append(
                    f"mesh axis {axis!r} of size {size!r}: expected a name and a "
                    f"whole number of at least 1"
                )
    if problems:
        fix = "Pass mesh={'data': 8, 'model': 4} (axis names and sizes), or a jax Mesh."
        raise error_from_problems(
            ArgumentError,
            "predict got a mesh it cannot use:",
            [Problem("error", "mesh", p, fix, "bad-argument") for p in problems],
        )
    return {str(a): int(s) for a, s in shape.items()}


def predict(
    abstract_state: PyTree = None,
    step_fn: StepFn | None = None,
    example_batch: PyTree = None,
    *,
    mesh: MeshLike,
    rules: LogicalRules | str,
    profile: str | HardwareProfile = "cpu",
    memory_budget_bytes: int | None = None,
    model: nn.Module | None = None,
    loss: LossFn | None = None,
    optimizer: optax.GradientTransformation | None = None,
    workload: Workload | None = None,
    microbatches: int = 1,
    pipeline_microbatches: int | None = None,
    pipeline_repeats: int = 1,
    attention: str | None = None,
) -> Prediction:
    """Predicts one layout's training step on a hardware profile, without its devices.

    The step time (compute, memory traffic, exposed communication), tokens/s, MFU and the
    memory per device (state, batch, activations, temporaries) against the budget: what
    ``meshplan plan --profile`` prints, and what :func:`meshplan.search_rules` ranks by
    (the same trace and pricing, so the same figures for the same layout).

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> w = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16)
        >>> state = {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))}
        >>> def step(state, x):
        ...     return jax.grad(lambda w: ((x @ w) ** 2).mean())(state["w"].value)
        >>> x = jax.ShapeDtypeStruct((64, 4096), jnp.bfloat16)
        >>> p = meshplan.predict(state, step, x, mesh={"data": 8}, rules=(("batch", "data"),),
        ...                      profile="h100")
        >>> p.cost.comm_bytes, p.fits       # data parallelism: the gradient all-reduced
        ({'all-reduce': 33554432}, True)
        >>> print(p)
        predicted step 0.155 ms on 8 h100 (compute 0.020 ms, memory traffic 0.010 ms, exposed communication 0.124 ms of 0.146 ms)
        throughput 414,158 examples/s · MFU 0.4% (traced matmul FLOPs, recomputation included)
        memory/device 64.12 MiB of 74.51 GiB (fits): state 32.00 MiB, batch 64.00 KiB, activations 64.00 KiB, temporaries 32.00 MiB

    Args:
        abstract_state: The state (``jax.eval_shape`` of init), boxed or NNX.
        step_fn: ``step_fn(state, batch)``, not jitted.
        example_batch: The batch (arrays or ``ShapeDtypeStruct``s).
        mesh: Axis sizes (``{'data': 8, 'model': 4}``) or a ``jax.sharding.Mesh``.
        rules: Logical axis rules, or a built-in layout's name or a rules file
            (:func:`meshplan.layouts.get_layout`).
        profile: A profile's name, a ``.json`` file, or a :class:`meshplan.HardwareProfile`.
        memory_budget_bytes: Bytes one device may hold (default: the profile's memory).
        model: A Flax Linen module, in place of the three first (with ``example_batch``).
        loss: ``loss(outputs, batch)`` for ``model``.
        optimizer: An Optax optimizer for ``model`` (default Adam).
        workload: A traced step (:func:`meshplan.trace_workload` with
            ``read_constraints=True``), in place of the step: of one microbatch.
        microbatches: Microbatches whose gradients one step accumulates (``--grad-accum``):
            the step is traced on one microbatch of ``example_batch``.
        pipeline_microbatches: Where ``rules`` give ``'stage'`` a mesh axis (the layouts
            ``pipeline``, ``pp_fsdp``, ``pp_tp``): the pipeline's microbatches
            (``--microbatches``, at least the stages). The step is the model's without
            a pipeline; it is priced as the stages run it
            (:func:`meshplan._search.predict.pipeline.predict_pipeline`: the bubble, the
            sends between stages, each stage's share of the layers and activations).
        pipeline_repeats: Layer groups per stage (the circular schedule).
        attention: ``'flash'``: the step's attention priced as a fused kernel runs it (the
            framework calls one: Pallas' splash, cuDNN, FlashAttention); ``'xla'``: as
            written, its scores in memory; ``None``: as the profile says (``'xla'`` in
            every built-in profile: XLA fuses no attention into one kernel).

        A pipeline on 8 H100s, 4 stages of 2 layers and 8 microbatches:

        >>> stack = meshplan.LogicallyPartitioned(
        ...     jax.ShapeDtypeStruct((8, 1024, 1024), jnp.bfloat16), ("layer", "embed", "mlp"))
        >>> def loss(w, x):
        ...     return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0].sum()
        >>> def layers_step(state, x):
        ...     return jax.grad(loss)(state["w"].value, x)
        >>> pp = meshplan.predict({"w": stack}, layers_step,
        ...                       jax.ShapeDtypeStruct((256, 1024), jnp.bfloat16),
        ...                       mesh={"pipeline": 4, "data": 2}, rules="pipeline",
        ...                       profile="h100", pipeline_microbatches=8)
        >>> pp.pipeline.schedule.bubble == 3 / 11, pp.pipeline.link
        (True, 'fast')
        >>> print(pp.lines()[-1])  # doctest: +ELLIPSIS
        pipeline 4 stages x 8 microbatches (GPipe, 11 iterations): bubble 27% (...), sends ... over the fast link (...); each stage holds 1/4 of the layers

    Raises:
        ArgumentError: a bad mesh, budget or profile; no step; a pipeline without
            ``pipeline_microbatches`` or whose schedule does not split the layers and the
            batch, or with ``microbatches`` (gradient accumulation) too.
    """
    from meshplan._search.predict.step import check_microbatches, linen_step, split_batch
    from meshplan.layouts import get_layout

    sizes = _mesh_sizes(mesh)
    devices = math.prod(sizes.values())
    check_search_args(devices=devices, budget=memory_budget_bytes, where="predict")
    check_microbatches(microbatches)
    prof = with_attention(get_profile(profile, devices), attention)
    if isinstance(rules, str):
        rules = get_layout(rules)
    if model is not None:
        if example_batch is None:
            raise error_from_problems(
                ArgumentError,
                "predict(model=...) needs example_batch=:",
                [
                    Problem(
                        "error",
                        "example_batch",
                        "no example batch for the model",
                        "Pass example_batch=, the model's inputs.",
                        "missing-argument",
                    )
                ],
            )
        abstract_state, step_fn, example_batch = linen_step(model, example_batch, loss, optimizer)
    if workload is None:
        if step_fn is None or abstract_state is None or example_batch is None:
            raise error_from_problems(
                ArgumentError,
                "predict has no step to trace:",
                [
                    Problem(
                        "error",
                        "step_fn",
                        "no step",
                        "Pass (abstract_state, step_fn, "
                        "example_batch), model= with example_batch=, or workload=.",
                        "missing-argument",
                    )
                ],
            )
        one = split_batch(example_batch, microbatches)
        workload = trace_workload(step_fn, abstract_state, one, read_constraints=True)
    budget = whole_number(memory_budget_bytes) if memory_budget_bytes is not None else None
    budget = budget if budget is not None else prof.memory_bytes
    tokens = None if workload.tokens is None else workload.tokens * microbatches
    _, stages = stage_axes(rules, sizes)
    if stages > 1:
        check_pipeline(workload, stages, pipeline_microbatches, pipeline_repeats, microbatches)
        assert pipeline_microbatches is not None
        pp = predict_pipeline(
            workload,
            sizes,
            rules,
            prof,
            microbatches=pipeline_microbatches,
            repeats=pipeline_repeats,
        )
        return Prediction(pp.cost, sizes, prof, budget, tokens, workload.tokens_unit, pp)
    cost = predict_specs(workload, _Specs(sizes, rules), prof, microbatches=microbatches)
    return Prediction(cost, sizes, prof, budget, tokens, workload.tokens_unit)


def check_pipeline(
    workload: Workload, stages: int, microbatches: int | None, repeats: int, accumulate: int
) -> None:
    """Raises one :class:`~meshplan.ArgumentError` for every reason a pipeline of ``stages``
    cannot run ``workload`` (:meth:`meshplan.PipelineSchedule.problems`): no microbatches
    given, too few, layers or a batch they do not split, gradient accumulation besides.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.predict.prediction import check_pipeline, example_prediction
        >>> w = meshplan.LogicallyPartitioned(jax.ShapeDtypeStruct((6, 8, 8), jnp.float32),
        ...                                   ("layer", "embed", "mlp"))
        >>> work = meshplan.trace_workload(lambda s, x: x @ s["w"].value[0], {"w": w},
        ...                                jax.ShapeDtypeStruct((16, 8), jnp.float32))
        >>> check_pipeline(work, 4, 8, 1, 1)
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: predict cannot price this pipeline:
          * layers: 6 layers do not split into 4 stages x 1 repeats (4 groups of equal size)
        Use a number of layers that is a multiple of 4 (e.g. 8), or stages x repeats that divide 6.
    """
    problems: list[Problem] = []
    if microbatches is None:
        problems.append(
            Problem(
                "error",
                "pipeline_microbatches",
                f"the rules give 'stage' {stages} devices (a "
                "pipeline) and no pipeline microbatches were given",
                f"Pass pipeline_microbatches=, at least {stages}: e.g. "
                f"{4 * stages} (bubble {(stages - 1) / (4 * stages * repeats + stages - 1):.0%}).",
                "pipeline-microbatches",
            )
        )
    if accumulate > 1:
        problems.append(
            Problem(
                "error",
                "microbatches",
                f"gradient accumulation ({accumulate} microbatches) with a "
                "pipeline: the pipeline's own microbatches cut the batch",
                "Leave microbatches= out and give pipeline_microbatches=.",
                "pipeline-grad-accum",
            )
        )
    sizes = {s[n.index("layer")] for n, s, _ in workload.state if n is not None and "layer" in n}
    if len(sizes) != 1:
        problems.append(
            Problem(
                "error",
                "rules",
                f"the rules give 'stage' {stages} devices, and the state has "
                f"{'no' if not sizes else 'more than one'} 'layer' stack to cut into stages "
                f"({sorted(sizes)})",
                "Pipeline a model whose scanned blocks carry a leading "
                "'layer' name, or use rules without 'stage'.",
                "pipeline-scan",
            )
        )
    elif microbatches is not None:
        plan = PipelineSchedule(stages, microbatches, repeats)
        problems += plan.problems(sizes.pop(), workload.batch)
    if problems:
        raise error_from_problems(ArgumentError, "predict cannot price this pipeline:", problems)
