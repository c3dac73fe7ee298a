"""Emulated CPU devices for the command line, set before JAX's backend starts."""

from __future__ import annotations

import os
import re

from rich.console import Console

from meshplan._errors import MeshError
from meshplan.cli.output import say

__all__ = ["MAX_CPU_DEVICES", "check_device_count", "use_cpu_backend", "use_cpu_devices"]

MAX_CPU_DEVICES = 4096
"""The most CPU devices the command line emulates.

Starting XLA's CPU client takes longer than linearly in the device count (on
a 2-core machine: 2048 devices about 1 s, 4096 about 3 s, 8192 about 14 s;
100,000 does not start in minutes), and every device keeps its own copy of
each replicated array in this machine's memory.
"""

_FLAG = "xla_force_host_platform_device_count"


def check_device_count(count: object, flag: str = "--devices") -> int:
    """``count`` as an int, if it is a number of CPU devices meshplan can emulate.

    Example:
        >>> from meshplan.cli.devices import check_device_count
        >>> check_device_count(8)
        8
        >>> check_device_count(0)
        Traceback (most recent call last):
        ...
        meshplan.MeshError: --devices 0: the number of emulated CPU devices must be at least 1...

    Raises:
        MeshError: ``count`` is not an integer from 1 to :data:`MAX_CPU_DEVICES`.
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise MeshError(
            f"{flag} {count}: the number of emulated CPU devices must be at least 1.\n"
            f"Pass {flag} N with N from 1 to {MAX_CPU_DEVICES} (e.g. {flag} 8)."
        )
    if count > MAX_CPU_DEVICES:
        raise MeshError(
            f"{flag} {count}: meshplan emulates at most {MAX_CPU_DEVICES} CPU devices. "
            f"Starting XLA's CPU client takes longer than linearly in the device count "
            f"(8192 devices take about 14 s on 2 cores; {count} would take minutes or more), "
            f"and each device keeps its own copy of every replicated array in this "
            f"machine's memory.\nPass {flag} {MAX_CPU_DEVICES} or fewer, with a mesh that "
            f"fits them."
        )
    return count


def _forced_count(flags: str) -> str | None:
    """The value of the last ``--xla_force_host_platform_device_count`` in ``flags``, if any."""
    found = re.findall(rf"--{_FLAG}(?:=(\S*))?", flags)
    return found[-1] if found else None


def use_cpu_devices(
    count: int, console: Console | None = None, flag: str | None = "--devices"
) -> None:
    """Asks XLA for ``count`` host CPU devices, before JAX's backend starts.

    XLA reads ``XLA_FLAGS`` once, when JAX's backend starts; the command line
    calls this before any array is made. ``XLA_FLAGS`` that already ask for
    exactly ``count`` devices are kept (the test suite sets 8).

    Example:
        >>> import os
        >>> from meshplan.cli.devices import use_cpu_devices
        >>> os.environ["XLA_FLAGS"].split()[-1]  # the test suite's 8 devices
        '--xla_force_host_platform_device_count=8'
        >>> use_cpu_devices(8)  # the same count: nothing to do
        >>> use_cpu_devices(4)
        Traceback (most recent call last):
        ...
        meshplan.MeshError: XLA_FLAGS already asks for 8 emulated CPU devices ...

    Args:
        count: The number of devices.
        console: Where to say what was set (nothing is said without one).
        flag: The command-line flag that gave ``count``, for messages; ``None``
            when the command always needs ``count`` devices.

    Raises:
        MeshError: ``count`` is not from 1 to :data:`MAX_CPU_DEVICES`
            (:func:`check_device_count`), or ``XLA_FLAGS`` forces another count.
    """
    check_device_count(count, flag or "the device count")
    flags = os.environ.get("XLA_FLAGS", "")
    forced = _forced_count(flags)
    if forced is not None:
        if forced.isdigit() and int(forced) == count:
            return
        asks = f"{flag} asks for {count}" if flag else f"this command needs {count}"
        fix = (
            f"Remove --{_FLAG} from XLA_FLAGS (meshplan sets it"
            + (f" from {flag})" if flag else ")")
            + f", or set it to {count}"
            + (f", or pass {flag} {forced}." if flag and forced.isdigit() else ".")
        )
        raise MeshError(
            f"XLA_FLAGS already asks for {forced if forced.isdigit() else repr(forced)} emulated "
            f"CPU devices (--{_FLAG}={forced} in XLA_FLAGS={flags!r}), but {asks}.\n{fix}"
        )
    os.environ["XLA_FLAGS"] = f"{flags} --{_FLAG}={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if console is not None:
        say(
            console,
            (
                f"Set XLA_FLAGS=--{_FLAG}={count} before JAX starts: {count} emulated CPU devices.",
                "dim",
            ),
        )


def use_cpu_backend() -> None:
    """Runs JAX on the CPU (unless ``JAX_PLATFORMS`` says otherwise), with no device count.

    For commands that need no devices, only shapes (``meshplan plan``): the
    ``XLA_FLAGS`` device count is left as it is, whatever it says.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
