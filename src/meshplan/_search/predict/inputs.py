"""The planner's inputs, checked in one place: hardware profiles and the searches' arguments.

A :class:`meshplan.HardwareProfile` is checked when it is built (its ``__post_init__``
calls :func:`check_profile`), so a profile from the constructor, from a JSON file
(:func:`profile_fields` reads the file's object first) or cached by the ``cpu``
calibration obeys the same rules: every figure finite, in its range and of its type.
:func:`check_search_args` checks the numbers and names :func:`meshplan.search_rules`,
:func:`meshplan.search_layouts` and :func:`meshplan.predict` take. Every problem is a
:class:`meshplan.Problem` naming the field or argument, the value, the expected form and
the fix, and all of them are raised at once as one :class:`meshplan.ArgumentError`.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from meshplan._errors import ArgumentError, Problem, error_from_problems
from meshplan._types import PyTree

__all__ = [
    "check_profile",
    "check_profile_arg",
    "check_search_args",
    "profile_fields",
    "whole_number",
]


@dataclasses.dataclass(frozen=True)
class _Range:
    """A figure's range: above ``low`` (``open``) or from it, up to ``high``; what it is."""

    low: float
    open: bool
    high: float
    what: str
    example: str

    def holds(self, v: float) -> bool:
        return (v > self.low if self.open else v >= self.low) and v <= self.high

    def text(self) -> str:
        low = f"above {self.low:g}" if self.open else f"at least {self.low:g}"
        return low if self.high == math.inf else f"{low} and at most {self.high:g}"


_POSITIVE, _FRACTION = (0.0, True, math.inf), (0.0, False, 1.0)
_RANGES: dict[str, _Range] = {
    "peak_flops": _Range(*_POSITIVE, "matmul FLOP/s of one device", "989e12"),
    "memory_bytes": _Range(*_POSITIVE, "bytes of one device's memory", "80e9"),
    "memory_bandwidth": _Range(*_POSITIVE, "bytes/s one device reads or writes", "3.35e12"),
    "fast_bandwidth": _Range(*_POSITIVE, "bytes/s per device within a fast domain", "450e9"),
    "slow_bandwidth": _Range(*_POSITIVE, "bytes/s per device across domains", "50e9"),
    "domain_devices": _Range(1.0, False, math.inf, "devices per fast domain", "8"),
    "latency_s": _Range(0.0, False, math.inf, "seconds a collective costs at least", "10e-6"),
    "slow_latency_s": _Range(0.0, False, math.inf, "the same across domains", "20e-6"),
    "matmul_efficiency": _Range(0.0, True, 1.0, "the fraction of peak_flops matmuls reach", "0.45"),
    "attention_efficiency": _Range(
        *_FRACTION,
        "the fraction of peak_flops attention kernels reach (0: matmul_efficiency)",
        "0.35",
    ),
    "attention_head_dim": _Range(
        0.0, False, math.inf, "the head dimension attention_efficiency holds from (0: any)", "128"
    ),
    "overlap_cost": _Range(
        *_FRACTION, "the fraction of hidden collectives' time still paid", "0.2"
    ),
    "overlap": _Range(*_FRACTION, "the fraction of compute time hiding collectives", "0.9"),
    "combine_bytes": _Range(0.0, False, math.inf, "bytes up to which collectives combine", "0"),
}
"""The range of each figure; a figure added later gets one from its name (:func:`_range`)."""


def _range(name: str) -> _Range:
    """The range of field ``name``: :data:`_RANGES`, else ``*_efficiency`` a fraction above 0,
    ``*_fraction``/``*overlap`` a fraction, anything else not negative."""
    if name in _RANGES:
        return _RANGES[name]
    if name.endswith("efficiency"):
        return _Range(0.0, True, 1.0, f"the fraction of the peak {name} stands for", "0.5")
    if name.endswith(("fraction", "overlap")):
        return _Range(*_FRACTION, "a fraction", "0.5")
    return _Range(0.0, False, math.inf, "a figure", "1")


@functools.cache
def _kinds(cls: type) -> dict[str, tuple[type, bool]]:
    """``{field: (type, may be None)}`` of a dataclass, from its annotations."""
    hints = typing.get_type_hints(cls)
    out: dict[str, tuple[type, bool]] = {}
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = bool(typing.get_args(hint)) and len(args) < len(typing.get_args(hint))
        out[f.name] = (args[0] if args else hint, optional)
    return out


def whole_number(value: object) -> int | None:
    """``value`` as an int when it is one (``94e9`` too; never a bool), else ``None``.

    Example:
        >>> from meshplan._search.predict.inputs import whole_number
        >>> whole_number(94e9), whole_number(8), whole_number(8.5), whole_number(True)
        (94000000000, 8, None, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    return None


def _field_problem(name: str, value: Any, kind: type, optional: bool, where: str) -> Problem | None:
    """What is wrong with one field's value, or ``None``."""
    path = f"{where}.{name}"
    if value is None and optional:
        return None
    if kind is str or kind is bool:
        if isinstance(value, kind) and (kind is bool or value or name != "name"):
            return None
        form = "true or false" if kind is bool else "a non-empty text"
        return Problem(
            "error",
            path,
            f"{name} is {value!r}: expected {form}",
            f"Write {name} as {form}.",
            "profile-field",
        )
    rng = _range(name)
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value):
        why = "not a finite number" if number else f"a {type(value).__name__}, not a number"
        return Problem(
            "error",
            path,
            f"{name} is {value!r}: {why} ({rng.what}, {rng.text()})",
            f"Write {name} as a number, e.g. {rng.example}.",
            "profile-field",
        )
    if kind is int and whole_number(value) is None:
        return Problem(
            "error",
            path,
            f"{name} is {value!r}: not a whole number ({rng.what})",
            f"Write {name} as a whole number, e.g. {rng.example}.",
            "profile-field",
        )
    if not rng.holds(value):
        return Problem(
            "error",
            path,
            f"{name} is {value!r}: out of range ({rng.what}, {rng.text()})",
            f"Write {name} {rng.text()}, e.g. {rng.example}.",
            "profile-field",
        )
    return None


def check_profile(profile: Any) -> None:
    """Raises one :class:`meshplan.ArgumentError` listing every field of ``profile`` (a
    :class:`meshplan.HardwareProfile`) that is not finite, in range or of its type; a
    whole-number float of an ``int`` field (``memory_bytes=94e9``) becomes that int.

    Example:
        >>> import dataclasses, meshplan
        >>> h100 = meshplan.get_profile("h100")
        >>> dataclasses.replace(h100, name="x", memory_bytes=94e9).memory_bytes
        94000000000
        >>> dataclasses.replace(h100, name="x", overlap=5)
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: The hardware profile 'x' is not valid:
          * profile.overlap: overlap is 5: out of range (the fraction of compute time hiding collectives, at least 0 and at most 1)
        Write overlap at least 0 and at most 1, e.g. 0.9.
    """
    problems = []
    cls: object = type(profile)
    for name, (kind, optional) in _kinds(cls).items():
        value = getattr(profile, name)
        problem = _field_problem(name, value, kind, optional, "profile")
        if problem is not None:
            problems.append(problem)
        elif kind is int and not isinstance(value, int):
            object.__setattr__(profile, name, whole_number(value))
    if problems:
        raise error_from_problems(
            ArgumentError, f"The hardware profile {profile.name!r} is not valid:", problems
        )


def profile_fields(data: Any, path: str, cls: type) -> dict[str, Any]:
    """The fields of ``cls`` (:class:`meshplan.HardwareProfile`) that a JSON file's value
    ``data`` holds, or one :class:`meshplan.ArgumentError` listing every missing field,
    unknown field (with the nearest field's name) and bad value.

    Example:
        >>> import meshplan
        >>> from meshplan._search.predict.inputs import profile_fields
        >>> data = dict(meshplan.get_profile("h100").to_dict(), peak_flop=1e15)
        >>> profile_fields(data, "mine.json", meshplan.HardwareProfile)
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: The profile 'mine.json' is not a valid hardware profile:
          * mine.json.peak_flop: unknown field 'peak_flop' (did you mean 'peak_flops'?)
        Rename it 'peak_flops', or remove it (the fields are meshplan.HardwareProfile's).
    """
    kinds = _kinds(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    required = [n for n, f in fields.items() if f.default is dataclasses.MISSING]
    problems = [
        Problem(
            "error",
            f"{path}.{n}",
            f"missing field {n!r}",
            f"Add {n!r}; required: {', '.join(required)}.",
            "profile-field",
        )
        for n in required
        if n not in data
    ]
    for n in data:
        if n not in fields:
            near = difflib.get_close_matches(str(n), list(fields), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            fix = f"Rename it {near[0]!r}, or remove it" if near else "Remove it"
            problems.append(
                Problem(
                    "error",
                    f"{path}.{n}",
                    f"unknown field {n!r}{hint}",
                    f"{fix} (the fields are meshplan.HardwareProfile's).",
                    "profile-field",
                )
            )
    out: dict[str, object] = {}
    for n, v in data.items():
        if n not in fields:
            continue
        problem = _field_problem(n, v, *kinds[n], path)
        if problem is not None:
            problems.append(problem)
        out[n] = whole_number(v) if kinds[n][0] is int and problem is None else v
    if problems:
        raise error_from_problems(
            ArgumentError, f"The profile {path!r} is not a valid hardware profile:", problems
        )
    return out


def check_profile_arg(profile: object, devices: object, known: Sequence[str], cls: type) -> None:
    """:func:`meshplan.get_profile`'s arguments: a name, a ``.json`` path or a ``cls`` (a profile);
    ``devices`` ``None`` or a whole number of at least 1.

    Example:
        >>> import meshplan
        >>> meshplan.get_profile(None)
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: Cannot choose a hardware profile:
          * profile: profile is None (NoneType): expected a profile's name, a .json file of HardwareProfile fields, or a meshplan.HardwareProfile
        Pass e.g. profile='h100'; the names: cpu, a100, h100, h100_a3, h200, b200, tpu_v4, tpu_v5e, tpu_v5p, tpu_v6e.
    """
    problems = []
    if not isinstance(profile, str | cls):
        problems.append(
            Problem(
                "error",
                "profile",
                f"profile is {profile!r} ({type(profile).__name__}): expected a profile's name, a "
                f".json file of HardwareProfile fields, or a meshplan.HardwareProfile",
                f"Pass e.g. profile='h100'; the names: {', '.join(known)}.",
                "bad-argument",
            )
        )
    problems += _count_problems({"devices": devices}, {"devices": 1}, optional=True)
    if problems:
        raise error_from_problems(ArgumentError, "Cannot choose a hardware profile:", problems)


def _count_problems(
    values: Mapping[str, object], least: Mapping[str, int], optional: bool = False
) -> list[Problem]:
    """Each of ``values`` that is not a whole number of at least ``least[name]``."""
    problems = []
    for name, v in values.items():
        if v is None and optional:
            continue
        n = whole_number(v) if not isinstance(v, float) else None  # 8.0 devices: say 8
        if n is not None and n >= least[name]:
            continue
        why = (
            f"{v!r} is less than {least[name]}"
            if n is not None
            else f"{v!r} ({type(v).__name__}) is not a whole number"
        )
        example = max(least[name], 8 if name == "devices" else least[name])
        problems.append(
            Problem(
                "error",
                name,
                f"{name}={why}: expected a whole number of at least {least[name]}",
                f"Pass {name}={example} or more (an int).",
                "bad-argument",
            )
        )
    return problems


def _bytes_problem(name: str, v: object) -> Problem | None:
    """A byte count: ``None`` or a positive whole number (an int, or a float such as 16e9)."""
    if v is None or (whole_number(v) or 0) > 0:
        return None
    return Problem(
        "error",
        name,
        f"{name}={v!r}: expected a whole number of bytes above 0 (or None: the profile's memory)",
        f"Pass e.g. {name}=16 * 2**30 (16 GiB), or leave it out.",
        "bad-argument",
    )


def check_search_args(
    *,
    devices: object = 1,
    budget: object = None,
    roles: object = None,
    all_roles: Sequence[str] = (),
    max_axes: object = 3,
    counts: Mapping[str, object] | None = None,
    names: object = None,
    batch: PyTree = None,
    where: str = "search_rules",
) -> None:
    """Raises one :class:`meshplan.ArgumentError` for every bad argument of a search (or of
    :func:`meshplan.predict`): ``devices`` a whole number of at least 1, ``budget`` bytes
    above 0, ``roles`` a sequence of :data:`~meshplan._search.search.candidates.ALL_ROLES` (not a
    string), ``max_axes`` 0 to the number of roles, ``counts`` (``compile_top``...) whole
    numbers of at least 0 (``measure_steps`` 1), ``names`` a sequence of names, ``batch``
    ``None`` or a whole number of at least 1.

    Example:
        >>> import meshplan
        >>> meshplan.search_rules("8", memory_budget_bytes=-1, roles=["bogus"])
        Traceback (most recent call last):
        ...
        meshplan.ArgumentError: search_rules got arguments it cannot use:
          * devices: devices='8' (str) is not a whole number: expected a whole number of at least 1
          * memory_budget_bytes: memory_budget_bytes=-1: expected a whole number of bytes above 0 (or None: the profile's memory)
          * roles: roles=['bogus']: 'bogus' is not a role; the roles: data, fsdp, tensor, context, expert
        To fix:
          - Pass devices=8 or more (an int).
          - Pass e.g. memory_budget_bytes=16 * 2**30 (16 GiB), or leave it out.
          - Pass roles as a list of those, e.g. roles=['data', 'fsdp', 'tensor'].
    """
    problems = _count_problems({"devices": devices}, {"devices": 1})
    problems += _count_problems({"batch": batch}, {"batch": 1}, optional=True)
    budget_problem = _bytes_problem("memory_budget_bytes", budget)
    problems += [budget_problem] if budget_problem is not None else []
    if roles is not None:
        bad = (
            [f"a {type(roles).__name__}, not a list of roles"]
            if isinstance(roles, str) or not isinstance(roles, Sequence)
            else [f"{r!r} is not a role" for r in roles if r not in all_roles]
            or (["no role"] if not roles else [])
        )
        if bad:
            problems.append(
                Problem(
                    "error",
                    "roles",
                    f"roles={roles!r}: {'; '.join(bad)}; the roles: {', '.join(all_roles)}",
                    "Pass roles as a list of those, e.g. roles=['data', 'fsdp', 'tensor'].",
                    "bad-argument",
                )
            )
    n = whole_number(max_axes) if not isinstance(max_axes, float) else None
    if n is None or not 0 <= n <= len(all_roles or (0,) * 5):
        problems.append(
            Problem(
                "error",
                "max_axes",
                f"max_axes={max_axes!r}: expected a whole number from 0 (the "
                f"layouts only) to {len(all_roles) or 5} (one mesh axis per role)",
                "Pass max_axes=3 (the default) or fewer.",
                "bad-argument",
            )
        )
    counts = dict(counts or {})
    problems += _count_problems(counts, {k: 1 if k == "measure_steps" else 0 for k in counts})
    if names is not None and (
        isinstance(names, str)
        or not isinstance(names, Sequence)
        or not all(isinstance(x, str) for x in names)
    ):
        problems.append(
            Problem(
                "error",
                "names",
                f"names={names!r}: expected a list of logical names (strings)",
                "Pass e.g. names=['embed', 'mlp'], or leave it out (every name the state carries).",
                "bad-argument",
            )
        )
    if problems:
        raise error_from_problems(ArgumentError, f"{where} got arguments it cannot use:", problems)
