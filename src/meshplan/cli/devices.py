"""The devices a command runs on: the machine's accelerators, else emulated CPU devices.

Two steps, because XLA reads its flags once, when JAX's backend starts:

1. before JAX starts, :func:`select_platform` asks XLA for the emulated CPU
   devices (``XLA_FLAGS``; they do not hide accelerators) and, for
   ``--platform cpu``, sets ``JAX_PLATFORMS=cpu``;
2. then :func:`found_devices` looks at what JAX found and :func:`choose_devices`
   (a pure function) picks: the accelerators when there are any, else the CPU
   devices; a mesh larger than them is refused with the numbers and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

from rich.console import Console

from meshplan._errors import MeshError, MeshplanError, error_for
from meshplan.cli.output import say

__all__ = [
    "MAX_CPU_DEVICES",
    "PLATFORMS",
    "DeviceChoice",
    "check_device_count",
    "choose_devices",
    "found_devices",
    "mesh_flag_advice",
    "select_platform",
    "use_cpu_backend",
    "use_cpu_devices",
    "use_host_devices",
]

MAX_CPU_DEVICES = 4096
"""The most CPU devices the command line emulates.

Starting XLA's CPU client takes longer than linearly in the device count (on
a 2-core machine: 2048 devices about 1 s, 4096 about 3 s, 8192 about 14 s;
100,000 does not start in minutes), and every device keeps its own copy of
each replicated array in this machine's memory.
"""

_FLAG = "xla_force_host_platform_device_count"


_SET_HERE: list[int] = []
"""The device counts this process put into XLA_FLAGS itself (from --devices): then advice
names --devices; when XLA_FLAGS came from the user's environment, it names XLA_FLAGS."""


def count_from_xla_flags() -> bool:
    """Whether the user's ``XLA_FLAGS`` (not ``--devices``) set how many CPU devices are emulated."""
    return not _SET_HERE and bool(_forced_count(os.environ.get("XLA_FLAGS", "")))


def mesh_text(devices: int) -> str:
    """A two-axis mesh of ``devices`` devices, as near square as divides: ``'2x4'`` for 8.

    Example:
        >>> from meshplan.cli.devices import mesh_text
        >>> mesh_text(8), mesh_text(4), mesh_text(6), mesh_text(1)
        ('2x4', '2x2', '2x3', '1x1')
    """
    first = max(d for d in range(1, int(devices**0.5) + 1) if devices % d == 0)
    return f"{first}x{devices // first}"


def mesh_flag_advice(error: MeshplanError, needed: int | None = None) -> MeshplanError:
    """``error`` with its fix in flags, for the codes of the mesh's errors.

    The library's fixes name its functions' arguments; the command line's name
    ``--mesh``, ``--axes`` and ``--devices``. ``needed``: the devices the mesh asked
    for (for ``'mesh-too-few-devices'``). Other errors come back as they are.

    Example:
        >>> from meshplan.cli.devices import mesh_flag_advice
        >>> from meshplan.cli.mesh_text import parse_mesh_shape
        >>> try:
        ...     parse_mesh_shape("2x2x2")
        ... except Exception as e:
        ...     print(mesh_flag_advice(e))
        The mesh '2x2x2' has 3 axes; the default names are ('data', 'model').
        Name them with --axes, e.g. --axes data,fsdp,model.
    """
    if len(error.problems) != 1:
        return error
    problem = error.problems[0]
    fix = {
        "mesh-unreadable": "Write it like 2x4, 4x2, 8 or 2x2x2 (the last with --axes a,b,c).",
        "mesh-axes-unnamed": "Name them with --axes, e.g. --axes data,fsdp,model.",
        "mesh-axis-names": "Give one distinct name per axis, in order, with --axes.",
    }.get(problem.code)
    if problem.code == "mesh-too-few-devices" and needed is not None:
        fix = (
            f"Use a smaller mesh, or more devices (meshplan train --devices {needed} emulates "
            f"them on the CPU)."
        )
    elif problem.code == "mesh-not-every-device":
        import jax

        total, local = jax.device_count(), jax.local_device_count()
        fix = (
            f"Use a mesh of {total} devices (e.g. --mesh {jax.process_count()}x{local}), or "
            f"fewer processes."
        )
    if fix is None:
        return error
    return error_for(type(error), problem.code, problem.path, problem.message, fix)


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


def use_host_devices(
    count: int, console: Console | None = None, flag: str | None = "--devices"
) -> None:
    """Asks XLA for ``count`` host CPU devices, before JAX's backend starts.

    They are JAX's CPU backend's devices; accelerators, when JAX finds any, stay
    its default devices.

    XLA reads ``XLA_FLAGS`` once, when JAX's backend starts; the command line
    calls this before any array is made. ``XLA_FLAGS`` that already ask for
    exactly ``count`` devices are kept (the test suite sets 8).

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
        fewer = (
            f", or pass {flag} {forced} with a mesh of {forced} devices (e.g. --mesh "
            f"{mesh_text(int(forced))})."
            if flag and forced.isdigit() and int(forced) > 0
            else "."
        )
        fix = (
            f"Remove --{_FLAG} from XLA_FLAGS (meshplan sets it"
            + (f" from {flag})" if flag else ")")
            + f", or set it to {count}"
            + fewer
        )
        raise MeshError(
            f"XLA_FLAGS already asks for {forced if forced.isdigit() else repr(forced)} emulated "
            f"CPU devices (--{_FLAG}={forced} in XLA_FLAGS={flags!r}), but {asks}.\n{fix}"
        )
    os.environ["XLA_FLAGS"] = f"{flags} --{_FLAG}={count}".strip()
    _SET_HERE.append(count)
    if console is not None:
        say(
            console,
            (
                f"Set XLA_FLAGS=--{_FLAG}={count} before JAX starts: {count} emulated CPU devices (when no accelerator is used).",
                "dim",
            ),
        )


def use_cpu_devices(
    count: int, console: Console | None = None, flag: str | None = "--devices"
) -> None:
    """Runs JAX on ``count`` emulated CPU devices: :func:`use_host_devices`, and the CPU alone.

    ``JAX_PLATFORMS`` is set to ``cpu`` unless it is set already (for commands
    that always emulate; ``meshplan train`` uses :func:`select_platform`).

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

    Raises:
        MeshError: as :func:`use_host_devices`.
    """
    use_host_devices(count, console, flag)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def use_cpu_backend() -> None:
    """Runs JAX on the CPU (unless ``JAX_PLATFORMS`` says otherwise), with no device count.

    For commands that need no devices, only shapes (``meshplan plan``): the
    ``XLA_FLAGS`` device count is left as it is, whatever it says.
    """
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


# -- which devices a command runs on ----------------------------------------------------------

PLATFORMS = ("auto", "cpu", "gpu", "tpu")
"""What ``--platform`` accepts: ``auto`` (the machine's accelerators, else emulated CPU devices),
or one platform."""


@dataclasses.dataclass(frozen=True)
class DeviceChoice:
    """The devices a command runs on, and why (what :func:`choose_devices` decided).

    Attributes:
        devices: The devices, in JAX's order (meshes are built on the first ones).
        platform: Their platform: ``'gpu'``, ``'tpu'`` or ``'cpu'``.
        kind: Their ``device_kind`` (e.g. ``'NVIDIA H200'``, ``'TPU v5 lite'``, ``'cpu'``).
        emulated: ``True`` for CPU devices that XLA emulates on this host.
        why: Why these: ``'no accelerator found'``, ``'--platform cpu'``, ...
    """

    devices: tuple[Any, ...]
    platform: str
    kind: str
    emulated: bool
    why: str

    @property
    def count(self) -> int:
        """The number of devices."""
        return len(self.devices)

    def describe(self) -> str:
        """One line for a run's header: platform, device kind and count, and why.

        Example:
            >>> from meshplan.cli.devices import DeviceChoice
            >>> DeviceChoice((0,) * 8, "cpu", "cpu", True, "no accelerator found").describe()
            'devices: no accelerator found, so 8 emulated CPU devices (platform cpu)'
            >>> DeviceChoice((0,), "gpu", "NVIDIA H200", False, "found").describe()
            'devices: 1 NVIDIA H200 (platform gpu)'
        """
        s = "s" * (self.count != 1)
        if self.emulated:
            return f"devices: {self.why}, so {self.count} emulated CPU device{s} (platform cpu)"
        return f"devices: {self.count} {self.kind} (platform {self.platform})"


def choose_devices(
    accelerators: Sequence[Any],
    cpus: Sequence[Any],
    *,
    platform: str = "auto",
    needed: int | None = None,
    mesh: str | None = None,
    jax_platforms: str | None = None,
    xla_flags_count: bool = False,
) -> DeviceChoice:
    """The devices a command runs on: the accelerators when there are any, else the CPU's.

    ``xla_flags_count``: the user's ``XLA_FLAGS`` set how many CPU devices are emulated
    (not ``--devices``), so a fix names ``XLA_FLAGS``, not ``--devices``.

    A pure function of what JAX found (tested with fake devices: objects with
    ``platform`` and ``device_kind``):

    * ``platform='cpu'``: the (emulated) CPU devices;
    * ``platform='gpu'`` or ``'tpu'``: those accelerators, or an error saying none were found;
    * ``platform='auto'``: the accelerators if any, else the CPU devices.

    A mesh of ``needed`` devices that is larger than the choice is refused with
    the numbers and the fix.

    Example:
        >>> from types import SimpleNamespace as Device
        >>> from meshplan.cli.devices import choose_devices
        >>> h200 = Device(platform="gpu", device_kind="NVIDIA H200")
        >>> cpus = [Device(platform="cpu", device_kind="cpu")] * 8
        >>> choose_devices([h200], cpus).describe()
        'devices: 1 NVIDIA H200 (platform gpu)'
        >>> choose_devices([], cpus).describe()
        'devices: no accelerator found, so 8 emulated CPU devices (platform cpu)'
        >>> choose_devices([h200], cpus, needed=8, mesh="2x4")
        Traceback (most recent call last):
        ...
        meshplan.MeshError: The mesh 2x4 needs 8 devices, but there are only 1 (NVIDIA H200, platform gpu)...

    Args:
        accelerators: The devices of JAX's default backend when it is not the
            CPU (``[]`` when it is).
        cpus: JAX's CPU devices (``XLA_FLAGS`` sets how many are emulated).
        platform: One of :data:`PLATFORMS`.
        needed: The devices the command's mesh needs (``None``: any number).
        mesh: The mesh as the user wrote it (``--mesh``), for messages; ``None``:
            the command's own mesh, which only ``--platform cpu`` can change.
        jax_platforms: ``JAX_PLATFORMS`` when set: when it leaves accelerators
            out, the header says so instead of "no accelerator found".

    Raises:
        MeshError: an unknown ``platform``, no accelerator of the asked
            platform, or too few devices for the mesh.
    """
    if platform not in PLATFORMS:
        raise MeshError(
            f"--platform {platform!r} is not one of {', '.join(PLATFORMS)}.\n"
            f"Pass --platform auto (the machine's accelerators, else emulated CPU devices) or "
            f"--platform cpu."
        )
    found = [d for d in accelerators if d.platform != "cpu"]
    if platform in ("gpu", "tpu") and not any(d.platform == platform for d in found):
        seen = (
            f"{len(found)} {found[0].platform} device{'s' * (len(found) != 1)}"
            if found
            else f"only {len(cpus)} CPU device{'s' * (len(cpus) != 1)}"
        )
        raise MeshError(
            f"--platform {platform}: JAX found no {platform.upper()} on this machine (it sees "
            f"{seen}{f'; JAX_PLATFORMS={jax_platforms}' if jax_platforms else ''}).\n"
            f"Install JAX for that accelerator (e.g. pip install 'jax[cuda12]'), or pass "
            f"--platform cpu to emulate CPU devices."
        )
    if platform == "cpu" or not found:
        if platform == "cpu":
            why = "--platform cpu asks for the CPU"
        elif jax_platforms and not set(jax_platforms.split(",")) - {"cpu", ""}:
            why = f"JAX_PLATFORMS={jax_platforms} leaves accelerators out"
        else:
            why = "no accelerator found"
        choice = _cpu_choice(cpus, why)
    else:
        first = found[0]
        chosen = tuple(d for d in found if d.platform == first.platform)
        choice = DeviceChoice(chosen, str(first.platform), str(first.device_kind), False, "found")
    if needed is None or needed <= choice.count:
        return choice
    what = f"The mesh {mesh}" if mesh else "This command"
    if choice.emulated and xla_flags_count:
        fix = (  # --devices would clash with XLA_FLAGS: say what sets the count
            f"Use a mesh of {choice.count} devices (e.g. --mesh {mesh_text(choice.count)}), or "
            f"set --{_FLAG}={needed} in XLA_FLAGS (it sets how many CPU devices are emulated)."
        )
        have = f"{choice.count} (emulated CPU devices, set by XLA_FLAGS)"
    elif choice.emulated:
        fix = (
            f"Use a smaller mesh, or pass --devices {needed} to emulate {needed} CPU devices "
            f"(XLA_FLAGS=--{_FLAG}=N sets how many)."
        )
        have = f"{choice.count} (emulated CPU devices)"
    else:
        have = f"{choice.count} ({choice.kind}, platform {choice.platform})"
        fix = (
            f"Pass --platform cpu to run on {needed} emulated CPU devices."
            if mesh is None
            else f"Use a smaller mesh: at most {choice.count} devices (e.g. --mesh "
            f"{choice.count}x1), or pass --platform cpu --devices {needed} to emulate {needed} "
            f"CPU devices."
        )
    raise MeshError(f"{what} needs {needed} devices, but there are only {have}.\n{fix}")


def _cpu_choice(cpus: Sequence[Any], why: str) -> DeviceChoice:
    return DeviceChoice(tuple(cpus), "cpu", "cpu", True, why)


def select_platform(
    platform: str, count: int, console: Console | None = None, flag: str | None = "--devices"
) -> None:
    """Before JAX starts: ``count`` emulated CPU devices, and the CPU alone for ``--platform cpu``.

    The CPU device count (``XLA_FLAGS``) applies to JAX's CPU backend only, so
    it is set whatever the platform: on a machine with accelerators they stay
    JAX's default devices. ``--platform cpu`` sets ``JAX_PLATFORMS=cpu``.

    Raises:
        MeshError: as :func:`use_host_devices`, or an unknown ``platform``.
    """
    if platform not in PLATFORMS:
        choose_devices([], [], platform=platform)  # raises, naming the choices
    use_host_devices(count, console, flag)
    if platform == "cpu":
        os.environ["JAX_PLATFORMS"] = "cpu"


def backend_error(e: BaseException) -> MeshError:
    """The error of JAX failing to start its backends (e.g. ``JAX_PLATFORMS=tpu`` without a TPU).

    JAX raises a ``RuntimeError`` with a screen of traceback the first time, and a
    bare ``AssertionError`` after that; this names the setting and the fix.

    Example:
        >>> from meshplan.cli.devices import backend_error
        >>> e = backend_error(RuntimeError("Unable to initialize backend 'tpu': INTERNAL: "
        ...                                "Failed to open libtpu.so\\nmore"))
        >>> e.problems[0].code, e.problems[0].path, "Failed to open libtpu.so" in str(e)
        ('no-backend', 'JAX_PLATFORMS', True)
    """
    value = os.environ.get("JAX_PLATFORMS")
    text = str(e).strip().splitlines()
    why = text[0] if text else "no platform could be initialised"
    asked = f"JAX_PLATFORMS={value!r} asks for" if value else "JAX looked for"
    return error_for(  # type: ignore[return-value]
        MeshError,
        "no-backend",
        "JAX_PLATFORMS",
        f"JAX could not start the devices {asked}: {why}",
        "Unset JAX_PLATFORMS (or pass --platform cpu, where the command has it) to run on "
        "this machine's CPU, or install JAX for that platform (e.g. pip install "
        "'jax[cuda12]' or 'jax[tpu]') on a machine that has it.",
    )


def found_devices(
    platform: str = "auto",
    needed: int | None = None,
    mesh: str | None = None,
) -> DeviceChoice:
    """:func:`choose_devices` on the devices JAX found (this starts JAX's backends).

    This is what ``meshplan train``, ``demo`` and ``sample`` call after
    :func:`select_platform`; ``meshplan search --measure`` can call it the same way.
    """
    import jax

    try:
        default = jax.devices()
    except (RuntimeError, AssertionError) as e:  # JAX_PLATFORMS names a platform JAX lacks
        raise backend_error(e) from None
    accelerators = [] if default[0].platform == "cpu" else default
    try:
        cpus = default if not accelerators else jax.devices("cpu")
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        cpus = []
    return choose_devices(
        accelerators,
        cpus,
        platform=platform,
        needed=needed,
        mesh=mesh,
        jax_platforms=os.environ.get("JAX_PLATFORMS") or None,
        xla_flags_count=count_from_xla_flags(),
    )
