"""Whether a pipeline axis pays: pipelines of the devices priced against a search's best.

The prices are :func:`~meshplan._search.predict.pipeline.predict_pipeline`'s.
"""

from __future__ import annotations

import math

from meshplan._search.predict.pipeline import PipelineCost, predict_pipeline
from meshplan._search.predict.profiles import HardwareProfile
from meshplan._search.predict.trace import Workload
from meshplan._search.search.result import SearchResult
from meshplan._search.search.roles import RoleVerdict, Term, VerdictKind
from meshplan._spmd.rules import MeshAxes
from meshplan._text import human_bytes

__all__ = ["pipeline_candidates", "pipeline_verdict"]


def pipeline_candidates(
    workload: Workload, devices: int, profile: HardwareProfile, *, layers: int, batch: int
) -> list[tuple[dict[str, int], tuple[tuple[str, MeshAxes], ...], PipelineCost]]:
    """Pipelines of ``devices``: ``pipeline x data`` meshes with ``p`` dividing ``layers``,
    each stage data parallel or FSDP over ``data``, with the most microbatches up to
    ``4p`` that split ``batch`` over ``data``; each priced by :func:`predict_pipeline`."""
    out: list[tuple[dict[str, int], tuple[tuple[str, MeshAxes], ...], PipelineCost]] = []
    names = [n for n in workload.names if n not in ("batch", "stage", "layer", "embed")]
    for p in range(2, devices + 1):
        if devices % p or layers % p:
            continue
        data = devices // p
        ms = [m for m in range(4 * p, p - 1, -1) if batch % (m * data) == 0]
        if not ms:
            continue
        mesh = {"pipeline": p, "data": data}
        for embed in (None, "data"):
            rules = (("batch", "data"), ("stage", "pipeline"), ("layer", "pipeline"),
                     ("embed", embed), *((n, None) for n in names))  # fmt: skip
            pp = predict_pipeline(workload, mesh, rules, profile, microbatches=ms[0])
            out.append((mesh, rules, pp))
    return out


def pipeline_verdict(
    result: SearchResult, workload: Workload, profile: HardwareProfile, *, layers: int,
    batch: int,
) -> RoleVerdict:  # fmt: skip
    """Whether a pipeline axis pays against ``result``'s best layout without one, and why.

    The search's rows have no pipeline; this prices :func:`pipeline_candidates` and sets
    the fastest that fits against the search's best: ``memory`` when only one side fits,
    else the term of the step (``communication``, ``compute``, ``memory traffic``) the
    pipeline saves most (proposed) or adds most (not). ``absent``: no pipeline of these
    devices splits the layers and the batch.
    """
    budget = result.budget_bytes if result.budget_bytes is not None else profile.memory_bytes
    devices = math.prod(result.rows[0].mesh.values()) if result.rows else 1
    found = pipeline_candidates(workload, devices, profile, layers=layers, batch=batch)
    without = result.best
    cn = None if without is None else without.cost
    mem_n = min((r.cost.memory_bytes for r in result.rows if r.cost is not None), default=None)
    mem_w = min((pp.cost.memory_bytes for _, _, pp in found), default=None)
    fits = sorted((pp.cost.step_s, i) for i, (_, _, pp) in enumerate(found)
                  if pp.cost.memory_bytes <= budget)  # fmt: skip

    def verdict(proposed: bool, kind: VerdictKind, reason: str, terms: dict[Term, float] | None = None
                ) -> RoleVerdict:  # fmt: skip
        return RoleVerdict("pipeline", proposed, kind, reason, None, without, mem_n, mem_w,
                           terms or {})  # fmt: skip

    if not found:
        return verdict(False, "absent", f"no pipeline of {devices} devices splits {layers} layers "
                       f"into stages and a batch of {batch} into at least as many microbatches")  # fmt: skip
    if not fits or cn is None:
        side = "with" if not fits else "without"
        least = mem_w if not fits else mem_n
        return verdict(bool(fits), "memory", f"{side} a pipeline nothing fits: the least memory "
                       f"per device is {'unknown' if least is None else human_bytes(least)}, over "
                       f"the budget of {human_bytes(budget)}")  # fmt: skip
    mesh, _, best = found[fits[0][1]]
    cw = best.cost
    terms: dict[Term, float] = {
        "communication": cw.comm_s - cn.comm_s,
        "compute": cw.compute_s - cn.compute_s,
        "memory traffic": cw.memory_s - cn.memory_s,
    }
    proposed = cw.step_s < cn.step_s
    kind = min(terms, key=terms.__getitem__) if proposed else max(terms, key=terms.__getitem__)
    shape = "x".join(str(n) for n in mesh.values())
    parts = [f"{k} {d * 1e3:+.2f} ms" for k, d in sorted(terms.items(), key=lambda kv: -abs(kv[1]))]
    reason = (
        f"pipeline {'pays' if proposed else 'does not pay'}: {', '.join(parts)} with it (step "
        f"{cw.step_s * 1e3:.2f} against {cn.step_s * 1e3:.2f} ms; best pipeline {shape} "
        f"pipeline x data, {best.schedule.microbatches} microbatches, bubble "
        f"{best.schedule.bubble:.0%}, sends over the {best.link} link)"
    )
    return verdict(proposed, kind, reason, terms)
