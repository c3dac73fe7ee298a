"""What :func:`meshplan.search_rules` is asked, as three records: what it searches
(:class:`SearchSpace`), what it prices on (:class:`SearchHardware`) and what it compiles and
runs (:class:`SearchChecks`); the keywords it took before the records, still taken
(:class:`SearchKeywords`), and :func:`search_options`, which reads either into the records.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TypedDict

from meshplan._errors import ArgumentError, error_for
from meshplan._search.predict.profiles import HardwareProfile
from meshplan._search.search.candidates import ALL_ROLES
from meshplan._spmd.rules import LogicalRules

__all__ = ["SearchChecks", "SearchHardware", "SearchKeywords", "SearchSpace", "search_options"]


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What a search tries.

    Attributes:
        layouts: Built-in layout names or ``{name: rules}`` always tried (default: every
            built-in layout, and the pipeline layouts where the model has a layer stack).
        names: Parameter names the search may split (default: every name but ``layer``).
        roles: Mesh axis roles generated candidates use (``data``, ``fsdp``, ``tensor``,
            ``context``, ``expert``).
        max_axes: At most this many mesh axes of generated candidates (0: the layouts only).
        axis_names: The mesh axis names of the ``layouts``' rules.

    Example:
        >>> from meshplan import SearchSpace
        >>> SearchSpace(layouts=["fsdp"], max_axes=0).roles
        ('data', 'fsdp', 'tensor', 'context', 'expert')
    """

    layouts: Mapping[str, LogicalRules] | Sequence[str] | None = None
    names: Sequence[str] | None = None
    roles: Sequence[str] = ALL_ROLES
    max_axes: int = 3
    axis_names: tuple[str, ...] = ("data", "model")


@dataclasses.dataclass(frozen=True)
class SearchHardware:
    """What a search prices the step on.

    Attributes:
        profile: ``'cpu'`` (measured here), a profile's name (``'h100'``, ``'tpu_v5e'``...)
            or a :class:`meshplan.HardwareProfile`.
        memory_budget_bytes: Bytes one device may hold (default: the profile's memory).
        attention: ``'flash'`` (a fused kernel), ``'xla'`` (as written) or ``None`` (the
            profile's): :func:`meshplan.predict`'s ``attention``.

    Example:
        >>> from meshplan import SearchHardware
        >>> SearchHardware("h100", 16 * 2**30).memory_budget_bytes // 2**30
        16
    """

    profile: str | HardwareProfile = "cpu"
    memory_budget_bytes: int | None = None
    attention: str | None = None


@dataclasses.dataclass(frozen=True)
class SearchChecks:
    """What a search compiles and runs of its first rows.

    Attributes:
        compile_top: Compile the first this many (with ``devices`` JAX devices; else none).
        measure: Run the first ``measure_top`` and rank them by measured time.
        measure_top: How many to run.
        measure_steps: Steps timed per candidate (the median counts).

    Example:
        >>> from meshplan import SearchChecks
        >>> SearchChecks(compile_top=0), SearchChecks(measure=True).measure_top
        (SearchChecks(compile_top=0, measure=False, measure_top=3, measure_steps=5), 3)
    """

    compile_top: int = 3
    measure: bool = False
    measure_top: int = 3
    measure_steps: int = 5


class SearchKeywords(TypedDict, total=False):
    """The keywords :func:`meshplan.search_rules` took before the records, each a field of
    one of them (still taken: ``profile=`` is ``SearchHardware(profile=...)``)."""

    profile: str | HardwareProfile
    memory_budget_bytes: int | None
    attention: str | None
    layouts: Mapping[str, LogicalRules] | Sequence[str] | None
    names: Sequence[str] | None
    roles: Sequence[str]
    max_axes: int
    axis_names: tuple[str, ...]
    compile_top: int
    measure: bool
    measure_top: int
    measure_steps: int


_RECORDS: dict[str, type[SearchSpace] | type[SearchHardware] | type[SearchChecks]] = {
    **{f.name: SearchSpace for f in dataclasses.fields(SearchSpace)},
    **{f.name: SearchHardware for f in dataclasses.fields(SearchHardware)},
    **{f.name: SearchChecks for f in dataclasses.fields(SearchChecks)},
}
_PARAMETER = {SearchSpace: "space", SearchHardware: "hardware", SearchChecks: "checks"}


def search_options(
    space: SearchSpace | None = None,
    hardware: SearchHardware | None = None,
    checks: SearchChecks | None = None,
    keywords: SearchKeywords | None = None,
) -> tuple[SearchSpace, SearchHardware, SearchChecks]:
    """The three records of a search: those given, each field a keyword names set on the
    record it belongs to; a keyword of a record also given is refused (which would win?).

    Example:
        >>> from meshplan._search.search.options import search_options
        >>> space, hardware, checks = search_options(keywords={"profile": "h100", "max_axes": 0})
        >>> hardware.profile, space.max_axes, checks.compile_top
        ('h100', 0, 3)
        >>> search_options(SearchSpace(), keywords={"max_axes": 2})
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: search_rules got max_axes= and space=, which also sets it.
        Pass max_axes in space= (SearchSpace(max_axes=...)), or leave space= out.
    """
    records: dict[type, SearchSpace | SearchHardware | SearchChecks | None] = {
        SearchSpace: space,
        SearchHardware: hardware,
        SearchChecks: checks,
    }
    unknown = sorted(set(keywords or {}) - set(_RECORDS))
    if unknown:
        raise error_for(
            ArgumentError,
            "bad-argument",
            unknown[0],
            f"search_rules got an unexpected keyword {unknown[0]!r}",
            f"Pass one of {', '.join(sorted(_RECORDS))}, or the records space=, hardware=, "
            "checks=.",
        )
    by_record: dict[type, dict[str, object]] = {}
    for key, value in (keywords or {}).items():
        record = _RECORDS[key]
        if records[record] is not None:
            raise error_for(
                ArgumentError,
                "bad-argument",
                key,
                f"search_rules got {key}= and {_PARAMETER[record]}=, which also sets it",
                f"Pass {key} in {_PARAMETER[record]}= ({record.__name__}({key}=...)), or "
                f"leave {_PARAMETER[record]}= out.",
            )
        by_record.setdefault(record, {})[key] = value
    made = {
        kind: given if given is not None else kind(**by_record.get(kind, {}))
        for kind, given in records.items()
    }
    out_space, out_hardware, out_checks = (
        made[SearchSpace],
        made[SearchHardware],
        made[SearchChecks],
    )
    assert isinstance(out_space, SearchSpace) and isinstance(out_hardware, SearchHardware)
    assert isinstance(out_checks, SearchChecks)
    return out_space, out_hardware, out_checks
