"""How busy this machine is, so a cached ``cpu`` calibration measured under another load is
measured again (:func:`meshplan._search.predict.profiles.calibrate_cpu`'s cache).

The ``cpu`` profile's figures are what this process's emulated devices got while others ran:
with the machine's 1-minute load average at ``L`` runnable processes per core, a process gets
about ``1 / (1 + L)`` of a core. A calibration cached at one load predicts wrongly at another
(10x off was seen on a loaded 2-core machine), so the cache keeps the load it was measured at,
and is used only while the share now is within :data:`SHARE_TOLERANCE` of that one.
Since the figures are CPU time over the cores where the devices fill them
(:func:`meshplan._search.measure.cpu.call_seconds`), another load moves them much less than
the clock's share (every figure within 2-5% IQR across 10 fresh processes at loads of 6-9
per core: ``benchmarks/bench_calibration.py``), but not nothing: the co-runners' use of the
caches and the memory bus is in the CPU time too (the matmul figure's median was 25 GFLOP/s
in one set of processes and 18 in the next, at a heavier load). A calibration is measured
again under another load; that costs a few seconds and guards the case of fewer devices
than cores, where the figures are the wall clock's.
"""

from __future__ import annotations

import os

__all__ = ["SHARE_TOLERANCE", "load_per_core", "same_load"]

SHARE_TOLERANCE = 1.5
"""A cached calibration is kept while ``1 / (1 + load)`` now is within this factor of then."""


def load_per_core() -> float | None:
    """The 1-minute load average per core (``None`` where the system has none).

    Example:
        >>> from meshplan._search.measure.machine_load import load_per_core
        >>> load = load_per_core()
        >>> load is None or load >= 0
        True
    """
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (OSError, AttributeError):
        return None


def same_load(then: object, now: float | None) -> bool:
    """Whether a calibration measured at load ``then`` (per core) holds at load ``now``.

    Example:
        >>> from meshplan._search.measure.machine_load import same_load
        >>> same_load(0.2, 0.4), same_load(0.1, 3.0), same_load(None, 1.0), same_load(1.0, None)
        (True, False, False, True)
    """
    if now is None:
        return True  # nothing to compare with: keep what was measured
    if not isinstance(then, int | float) or isinstance(then, bool) or then < 0:
        return False  # cached before the load was kept, or damaged: measure again
    ratio = (1 + float(then)) / (1 + now)  # the share now over the share then
    return 1 / SHARE_TOLERANCE <= ratio <= SHARE_TOLERANCE
