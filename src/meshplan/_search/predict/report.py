"""What a user sees of one prediction: step time, tokens/s, MFU and memory against the budget.

One set of fields for ``meshplan plan``, ``meshplan search`` and their ``--json``: the
predicted step time, the tokens (or examples) per second, the FLOP utilisation (the
step's traced matmul FLOPs, recomputation included, over the devices' peak), and the
memory per device by kind (state, batch, activations, temporaries) against the budget.
"""

from __future__ import annotations

from typing import Any

from meshplan._search.predict.cost import Cost
from meshplan._search.predict.profiles import HardwareProfile
from meshplan._text import human_bytes, human_seconds

__all__ = ["pipeline_line", "prediction_fields", "prediction_lines", "unpriced_line"]


def prediction_fields(
    cost: Cost,
    tokens: int | None,
    devices: int,
    profile: HardwareProfile,
    budget: int,
    unit: str = "tokens",
) -> dict[str, object]:
    """The prediction as plain data (the ``--json`` fields).

    ``tokens``: what one step processes, in ``unit`` (``'tokens'``, or ``'examples'`` for
    a batch without token ids); ``tokens_per_s`` is that count per second, and
    ``throughput_unit`` names it.

    Example:
        >>> from meshplan._search.predict.cost import Cost
        >>> from meshplan._search.predict.profiles import get_profile
        >>> from meshplan._search.predict.report import prediction_fields
        >>> c = Cost(2.0, 1.5, 0.1, 0.4, 2e14, {}, {}, 4 << 30, 6 << 30, 10, 1 << 30, 0, 1.0)
        >>> f = prediction_fields(c, 1 << 20, 256, get_profile("tpu_v5e"), 16 << 30)
        >>> f["tokens_per_s"], round(f["mfu"], 3), f["fits"]
        (524288.0, 0.508, True)
    """
    step = cost.step_s
    return {
        "predicted_step_s": step,
        "tokens_per_s": None if not tokens or step <= 0 else tokens / step,
        "throughput_unit": unit,
        "mfu": None if step <= 0 else cost.flops_per_device / (step * profile.peak_flops),
        "compute_s": cost.compute_s,
        "memory_s": cost.memory_s,
        "first_touch_s": cost.first_touch_s,
        "fresh_bytes": profile.fresh_bytes,
        "comm_s": cost.comm_s,
        "comm_total_s": cost.comm_total_s,
        "memory_bytes_per_device": cost.memory_bytes,
        "state_bytes_per_device": cost.state_bytes,
        "batch_bytes_per_device": cost.batch_bytes,
        "activation_bytes_per_device": cost.activation_bytes,
        "temporary_bytes_per_device": cost.temporary_bytes,
        "budget_bytes": budget,
        "fits": cost.memory_bytes <= budget,
        "comm_bytes": dict(cost.comm_bytes),
        "comm_by_axis": dict(cost.comm_by_axis),
        "devices": devices,
        "profile": profile.name,
        "attention": "flash" if profile.fused_attention else "xla",
        "unpriced": list(cost.unpriced),
        "notes": list(cost.notes),
    }


TIGHT = 0.95
"""A step predicted above this share of the budget fits only narrowly: on a TPU v5e a
decoder predicted at 15.40 of 15.75 GiB did not fit (docs/benchmarks.md, "On a real
accelerator"), and the memory model's errors are of 10-20%."""


def _verdict(fields: dict[str, Any]) -> str:
    """``fits``, ``fits, within 5% of the budget: XLA may need more``, or ``OVER the budget``.

    Example:
        >>> from meshplan._search.predict.report import _verdict
        >>> _verdict({"fits": True, "memory_bytes_per_device": 96, "budget_bytes": 100})
        'fits, within 5% of the budget: XLA may need more'
    """
    if not fields["fits"]:
        return "OVER the budget"
    if fields["memory_bytes_per_device"] > TIGHT * fields["budget_bytes"]:
        return f"fits, within {1 - TIGHT:.0%} of the budget: XLA may need more"
    return "fits"


def prediction_lines(fields: dict[str, Any]) -> list[str]:
    """The prediction as text, a few lines (what ``meshplan plan --profile`` prints).

    Example:
        >>> from meshplan._search.predict.cost import Cost
        >>> from meshplan._search.predict.profiles import get_profile
        >>> from meshplan._search.predict.report import prediction_fields, prediction_lines
        >>> c = Cost(2.0, 1.5, 0.1, 0.4, 2e14, {}, {}, 4 << 30, 6 << 30, 10, 1 << 30, 0, 1.0)
        >>> print("\\n".join(prediction_lines(prediction_fields(c, 1 << 20, 256, get_profile("tpu_v5e"), 16 << 30))))
        predicted step 2.000 s on 256 tpu_v5e (compute 1.500 s, memory traffic 100.000 ms, exposed communication 400.000 ms of 1.000 s)
        throughput 524,288 tokens/s · MFU 50.8% (traced matmul FLOPs, recomputation included)
        memory/device 11.00 GiB of 16.00 GiB (fits): state 4.00 GiB, batch 0 B, activations 6.00 GiB, temporaries 1.00 GiB
    """
    f = fields
    touched = f.get("first_touch_s") or 0.0
    fresh = f", {human_seconds(touched)} of it writing new memory" if touched else ""
    lines = [
        f"predicted step {human_seconds(f['predicted_step_s'])} on {f['devices']} "
        f"{f['profile']}{' (flash attention)' if f.get('attention') == 'flash' else ''} "
        f"(compute {human_seconds(f['compute_s'])}, memory traffic "
        f"{human_seconds(f['memory_s'])}{fresh}, exposed communication "
        f"{human_seconds(f['comm_s'])} of {human_seconds(f['comm_total_s'])})"
    ]
    tps = "-" if f["tokens_per_s"] is None else f"{f['tokens_per_s']:,.0f}"
    mfu = "-" if f["mfu"] is None else f"{f['mfu']:.1%}"
    lines.append(
        f"throughput {tps} {f.get('throughput_unit', 'tokens')}/s · MFU {mfu} (traced matmul FLOPs, recomputation included)"
    )
    lines.append(
        f"memory/device {human_bytes(f['memory_bytes_per_device'])} of "
        f"{human_bytes(f['budget_bytes'])} ({_verdict(f)}): "
        f"state {human_bytes(f['state_bytes_per_device'])}, batch "
        f"{human_bytes(f['batch_bytes_per_device'])}, activations "
        f"{human_bytes(f['activation_bytes_per_device'])}, temporaries "
        f"{human_bytes(f['temporary_bytes_per_device'])}"
    )
    if touched:  # what the first touch was priced on: all but the state and the batch
        step = f["activation_bytes_per_device"] + f["temporary_bytes_per_device"]
        held = f["memory_bytes_per_device"] - f["state_bytes_per_device"]
        held -= f["batch_bytes_per_device"]
        more = ", its gradient accumulator included" if held > step else ""
        lines.append(
            f"note: the step's activations and temporaries ({human_bytes(held)} a device{more}) "
            f"reach {human_bytes(f['fresh_bytes'])}, from which XLA:CPU allocates them "
            "afresh every step, their pages written for the first time; a smaller batch a "
            "device, or more devices, avoids it"
        )
    if f.get("unpriced"):
        lines.append(unpriced_line(f["unpriced"]))
    lines += [f"note: {n}" for n in f.get("notes", ())]
    if f.get("pipeline"):
        lines.append(pipeline_line(f["pipeline"]))
    return lines


def pipeline_line(pp: dict[str, Any]) -> str:
    """A pipelined prediction's schedule, bubble and sends, as one line.

    Example:
        >>> from meshplan._search.predict.report import pipeline_line
        >>> pipeline_line({"stages": 4, "microbatches": 8, "repeats": 1, "iterations": 11,
        ...                "bubble": 3 / 11, "bubble_s": 0.003, "send_bytes": 2 << 20,
        ...                "send_s": 0.0001, "link": "slow"})
        'pipeline 4 stages x 8 microbatches (GPipe, 11 iterations): bubble 27% (3.000 ms), sends 2.00 MiB over the slow link (0.100 ms); each stage holds 1/4 of the layers'
    """
    kind = "GPipe" if pp["repeats"] == 1 else f"circular, {pp['repeats']} repeats"
    return (
        f"pipeline {pp['stages']} stages x {pp['microbatches']} microbatches ({kind}, "
        f"{pp['iterations']} iterations): bubble {pp['bubble']:.0%} "
        f"({human_seconds(pp['bubble_s'])}), sends {human_bytes(pp['send_bytes'])} over the "
        f"{pp['link']} link ({human_seconds(pp['send_s'])}); each stage holds "
        f"1/{pp['stages']} of the layers"
        + (f" (in {pp['repeats']} groups)" if pp["repeats"] > 1 else "")
    )


def unpriced_line(unpriced: list[str] | tuple[str, ...]) -> str:
    """The primitives a prediction does not understand, as one line.

    Example:
        >>> from meshplan._search.predict.report import unpriced_line
        >>> unpriced_line(["pallas_call at model.py:12:8 (attend) (4 runs)"])
        'not understood, priced as replicated (an upper bound): pallas_call at model.py:12:8 (attend) (4 runs)'
    """
    return "not understood, priced as replicated (an upper bound): " + "; ".join(unpriced)
