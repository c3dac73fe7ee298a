"""Sizes in bytes as a user writes them: ``--budget 16GiB``."""

from __future__ import annotations

import argparse
import re

__all__ = ["parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: str) -> int:
    """``'1MiB'`` -> 1048576; ``'2GB'`` -> 2000000000; ``'4096'`` -> 4096.

    Example:
        >>> from meshplan.cli.sizes import parse_bytes
        >>> parse_bytes("1MiB"), parse_bytes("1.5 KiB"), parse_bytes("2GB"), parse_bytes("4096")
        (1048576, 1536, 2000000000, 4096)
    """
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = found.group(2).lower() if found else None
    if found is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(
            f"cannot read the size {text!r}: write e.g. 1MiB, 512KiB, 2GB or 4096 (bytes)"
        )
    return int(float(found.group(1)) * _UNITS[unit])
