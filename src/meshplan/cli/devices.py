"""Emulated CPU devices for the command line, set before JAX's backend starts."""

from __future__ import annotations

import os

from rich.console import Console

from meshplan.cli.output import say


def use_cpu_devices(count: int, console: Console | None = None) -> None:
    """Asks XLA for ``count`` host CPU devices, unless the backend already runs.

    XLA reads ``XLA_FLAGS`` once, when JAX's backend starts; the command line
    calls this before any array is made. An existing device-count flag is kept.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if console is not None:
        say(
            console,
            (
                f"Set XLA_FLAGS=--xla_force_host_platform_device_count={count} before JAX "
                f"starts: {count} emulated CPU devices.",
                "dim",
            ),
        )
