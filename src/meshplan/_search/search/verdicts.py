"""Every role's verdict on a finished search: ``context``, ``expert`` and ``pipeline``."""

from __future__ import annotations

from meshplan._search.search.pipeline_verdict import pipeline_verdict
from meshplan._search.search.result import SearchResult
from meshplan._search.search.roles import RoleVerdict, role_verdict

__all__ = ["search_verdicts"]


def search_verdicts(result: SearchResult) -> list[RoleVerdict]:
    """Whether ``result``'s best uses a ``context``, an ``expert`` and a ``pipeline`` axis,
    and why (:func:`~meshplan._search.search.roles.role_verdict`,
    :func:`~meshplan._search.search.pipeline_verdict.pipeline_verdict`).

    Example:
        >>> from meshplan._search.search.rule_search import example_search
        >>> from meshplan._search.search.verdicts import search_verdicts
        >>> [(v.role, v.proposed, v.kind) for v in search_verdicts(example_search())]
        [('context', False, 'absent'), ('expert', False, 'absent'), ('pipeline', False, 'absent')]
    """
    return [
        role_verdict(result, "context"),
        role_verdict(result, "expert"),
        pipeline_verdict(result),
    ]
