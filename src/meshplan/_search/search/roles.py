"""Whether a search's best layout uses the ``context`` or ``expert`` role, and why, from its figures.

:func:`role_verdict` reads a finished :func:`meshplan.search_rules` result: the best row
*with* a mesh axis of the role (size > 1) and the best *without*, and compares their
predictions. The reason is the largest term by which they differ:

* ``memory``: nothing without the role fits the budget (the least memory per device
  without it is over the budget), or nothing with it does;
* ``communication``, ``compute`` or ``memory traffic``: where the best uses the role,
  the term of the step it saves most; where not, the term it adds most (the exposed
  collectives by kind: an all-to-all, the keys' and values' gathers, against the
  weights' gathers and gradient reductions; the matmuls; the other ops' bytes);
* ``absent``: the model has no name the role splits, so no candidate has it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, TypeAlias

from meshplan._search.predict.cost import Cost
from meshplan._search.search.result import SearchResult, SearchRow
from meshplan._text import human_bytes

__all__ = ["Role", "RoleVerdict", "Term", "VerdictKind", "role_verdict"]

Role: TypeAlias = Literal["context", "expert", "pipeline"]
"""A role :func:`role_verdict` judges: the mesh axis of that name (``'pipeline'``:
:func:`meshplan._search.search.pipeline_verdict.pipeline_verdict`, which prices its own candidates)."""

Term: TypeAlias = Literal["communication", "compute", "memory traffic"]
"""A term of a predicted step by which the best with a role and without it differ."""

VerdictKind: TypeAlias = Literal["communication", "compute", "memory traffic", "memory", "absent"]
"""Why a role is proposed or not (module docstring): a :data:`Term`, ``'memory'`` or
``'absent'``."""


@dataclasses.dataclass
class RoleVerdict:
    """What :func:`role_verdict` found for one role.

    ``proposed``: the search's best row uses the role; ``kind``: why (module
    docstring); ``with_row``/``without_row``: the best rows with and without it
    (``None``: none fits); ``reason``: one line, from the figures; ``terms``: seconds
    per step the best with the role takes more (negative: less) than the best without,
    by ``communication`` (exposed), ``compute`` and ``memory traffic``;
    ``min_memory_with``/``without``: the least memory per device of any priced
    candidate with and without it.
    """

    role: Role
    proposed: bool
    kind: VerdictKind
    reason: str
    with_row: SearchRow | None = None
    without_row: SearchRow | None = None
    min_memory_without: int | None = None
    min_memory_with: int | None = None
    terms: dict[Term, float] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        def row(r: SearchRow | None) -> dict[str, Any] | None:
            if r is None or r.cost is None:
                return None
            return {
                "mesh": dict(r.mesh),
                "layout": r.layout,
                "rules": r.short_rules,
                "step_s": r.cost.step_s,
                "memory_bytes": r.cost.memory_bytes,
                "schedule": r.schedule_text or None,
            }

        return {
            "role": self.role,
            "proposed": self.proposed,
            "kind": self.kind,
            "reason": self.reason,
            "with": row(self.with_row),
            "without": row(self.without_row),
            "terms": dict(self.terms),
            "min_memory_with": self.min_memory_with,
            "min_memory_without": self.min_memory_without,
        }


def _uses(row: SearchRow, role: Role) -> bool:
    return int(row.mesh.get(role, 1)) > 1


def _comm_line(cost: Cost) -> str:
    kinds = sorted(cost.comm_bytes.items(), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {human_bytes(v)}" for k, v in kinds if v) or "none"


def role_verdict(result: SearchResult, role: Role) -> RoleVerdict:
    """Whether ``result``'s best uses ``role`` (``'context'`` or ``'expert'``), and why.

    Example:
        >>> import jax, jax.numpy as jnp, meshplan
        >>> from meshplan._search.search.roles import role_verdict
        >>> w = jax.ShapeDtypeStruct((256, 256), jnp.float32)
        >>> result = meshplan.search_rules(
        ...     4, {"w": meshplan.LogicallyPartitioned(w, ("embed", "mlp"))},
        ...     lambda s, x: x @ s["w"].value, jax.ShapeDtypeStruct((8, 256), jnp.float32),
        ...     profile="h100", compile_top=0)
        >>> role_verdict(result, "expert").kind      # no 'expert' name: never proposed
        'absent'
    """
    budget = result.budget_bytes
    ok = result.ok
    best = result.best
    memory = [(r.cost.memory_bytes, _uses(r, role)) for r in result.rows if r.cost is not None]
    any_with = any(_uses(r, role) for r in result.rows)
    w = next((r for r in ok if _uses(r, role)), None)
    n = next((r for r in ok if not _uses(r, role)), None)
    mem_w = min((m for m, uses in memory if uses), default=None)
    mem_n = min((m for m, uses in memory if not uses), default=None)
    proposed = best is not None and _uses(best, role)

    def verdict(
        kind: VerdictKind, reason: str, terms: dict[Term, float] | None = None
    ) -> RoleVerdict:
        return RoleVerdict(role, proposed, kind, reason, w, n, mem_n, mem_w, terms or {})

    if not any_with:
        article = "an" if role[0] in "aeiou" else "a"
        return verdict("absent", f"the model has no name {article} {role} axis splits")
    if n is None or w is None:
        side, least = ("without", mem_n) if n is None else ("with", mem_w)
        return verdict(
            "memory",
            f"{side} {role} nothing fits: the least memory per device is "
            f"{'unknown' if least is None else human_bytes(least)}, over the budget "
            f"of {'none' if budget is None else human_bytes(budget)}",
        )
    cw, cn = w.cost, n.cost
    assert cw is not None and cn is not None
    terms: dict[Term, float] = {
        "communication": cw.comm_s - cn.comm_s,
        "compute": cw.compute_s - cn.compute_s,
        "memory traffic": cw.memory_s - cn.memory_s,
    }
    # Why it pays: the term it saves most; why not: the term it adds most.
    kind = min(terms, key=terms.__getitem__) if proposed else max(terms, key=terms.__getitem__)
    pays = "pays" if proposed else "does not pay"
    parts = [f"{k} {d * 1e3:+.2f} ms" for k, d in sorted(terms.items(), key=lambda kv: -abs(kv[1]))]
    reason = (
        f"{role} {pays}: {', '.join(parts)} with it (step {cw.step_s * 1e3:.2f} against "
        f"{cn.step_s * 1e3:.2f} ms; collectives with: {_comm_line(cw)}; without: "
        f"{_comm_line(cn)})"
    )
    return verdict(kind, reason, terms)
