"""Text pieces that plan tables, messages, pictures and snapshot diffs share.

Bytes for people, shapes, rules, mesh axes and counted nouns, each written one
way everywhere a plan is shown.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import PartitionSpec

UNCONSTRAINED = PartitionSpec.UNCONSTRAINED

__all__ = [
    "axes_text",
    "count_text",
    "human_bytes",
    "human_seconds",
    "path_text",
    "paths_text",
    "rule_text",
    "shape_text",
]


def human_bytes(n: float) -> str:
    """Bytes for people: ``'4.00 MiB'``.

    Example:
        >>> from meshplan._text import human_bytes
        >>> human_bytes(512), human_bytes(4 << 20)
        ('512 B', '4.00 MiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def human_seconds(s: float) -> str:
    """A duration for people, three decimals in seconds or milliseconds: ``'0.079 ms'``.

    Example:
        >>> from meshplan._text import human_seconds
        >>> human_seconds(2.0), human_seconds(7.9e-5)
        ('2.000 s', '0.079 ms')
    """
    return f"{s:.3f} s" if s >= 1 or s == 0 else f"{s * 1e3:.3f} ms"


def shape_text(shape: tuple[int, ...] | None) -> str:
    """A shape as Python writes it; ``'-'`` for no shape.

    Example:
        >>> from meshplan._text import shape_text
        >>> shape_text((8, 4)), shape_text((64,)), shape_text(()), shape_text(None)
        ('(8, 4)', '(64,)', '()', '-')
    """
    return "-" if shape is None else str(tuple(int(s) for s in shape))


def rule_text(index: int, rule: Any) -> str:
    """``"rule 0 ('hidden', 'model')"``."""
    name, axes = rule
    axes_txt = "UNCONSTRAINED" if axes is UNCONSTRAINED else repr(axes)
    return f"rule {index} ({name!r}, {axes_txt})"


def axes_text(axes: tuple[str, ...]) -> str:
    """``"'data'×'model'"``."""
    return "×".join(repr(a) for a in axes)


def count_text(n: int, singular: str, plural: str | None = None) -> str:
    """``'1 error'``, ``'2 errors'``; ``plural`` for irregular nouns.

    Example:
        >>> from meshplan._text import count_text
        >>> count_text(1, "leaf", "leaves"), count_text(3, "leaf", "leaves"), count_text(0, "error")
        ('1 leaf', '3 leaves', '0 errors')
    """
    return f"{n} {singular if n == 1 else plural or singular + 's'}"


def path_text(keypath: Any) -> str:
    """A key path as every meshplan message, plan and checkpoint writes it: ``params/w``.

    The one path format of meshplan: ``jax.tree_util.keystr(path, simple=True, separator="/")``.

    Example:
        >>> import jax
        >>> from meshplan._text import path_text
        >>> [path_text(p) for p, _ in jax.tree_util.tree_flatten_with_path({"a": [1, {"b": 2}]})[0]]
        ['a/0', 'a/1/b']
    """
    return jax.tree_util.keystr(tuple(keypath), simple=True, separator="/")


def paths_text(paths: Sequence[str], shown: int = 3) -> str:
    """The first ``shown`` paths, then how many more.

    Example:
        >>> from meshplan._text import paths_text
        >>> paths_text(["a/w", "b/w", "c/w", "d/w", "e/w"])
        'a/w, b/w, c/w and 2 more'
    """
    more = len(paths) - shown
    return ", ".join(paths[:shown]) + (f" and {more} more" if more > 0 else "")
