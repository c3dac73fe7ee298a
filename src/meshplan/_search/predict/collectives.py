"""The time of one collective over a group of mesh axes, hierarchical where the group crosses links.

A mesh is laid out row-major over the devices (the last axis varies fastest). Each
axis of a group splits into the part whose devices share a fast domain (an NVLink
host, a TPU slice's ICI) and the part that crosses domains (the data-centre network:
InfiniBand between hosts, DCN between slices). A collective over the group runs as
XLA and NCCL run it there: hierarchically, the fast part first where that shrinks what
crosses the slow links.

With ``k`` devices of the group in each domain and ``m`` domains, for ``b`` bytes per
device (the operand, as :func:`meshplan._search.measure.hlo.collective_bytes` counts it):

* all-reduce: a reduce-scatter within the domain, an all-reduce of ``b / k`` across
  domains, an all-gather back: ``2 (k-1)/k b / fast + 2 (m-1)/m (b/k) / slow``;
* reduce-scatter (``b`` the unreduced operand): ``(k-1)/k b / fast + (m-1)/m (b/k) / slow``;
* all-gather of a ``b``-byte shard: across domains first, ``(m-1) b / slow``, then
  within, ``(k-1) m b / fast``;
* all-to-all: ``(k-1)/(k m) b / fast + (m-1)/m b / slow``;
* collective-permute (a ring shift, context parallelism): ``b`` over the slowest link.

Each adds the latency of the links it uses (``latency_s``, ``slow_latency_s``: a
collective's start), and the latency of its steps, as NCCL's tuning model counts them
(``ncclTopoTuneModel``): a ring over ``n = k m`` devices takes ``n - 1`` steps per phase
(two phases for an all-reduce), of which ``m - 1`` cross domains
(``slow_hop_latency_s`` each) and the rest do not (``hop_latency_s`` each). So the time
of a collective grows with its participants where the bytes per device do not: FSDP's
gathers over 512 GPUs pay 511 steps each, over 128 GPUs 127. Where the profile says
``latency_per_device`` (XLA:CPU's threads), a group of ``k m`` of the domain's devices pays
``k m / domain_devices`` of the latency instead, and of ``array_latency_s`` for each array a
combined collective carries beyond its first (:func:`array_latency`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from meshplan._search.measure.hlo import COLLECTIVES
from meshplan._search.predict.profiles import HardwareProfile

__all__ = ["collective_time", "split_group"]


def split_group(mesh: Mapping[str, int], axes: Sequence[str], domain: int) -> tuple[int, int]:
    """``(k, m)``: devices of the group within one fast domain, and domains it spans.

    Example:
        >>> from meshplan._search.predict.collectives import split_group
        >>> split_group({"data": 4, "tensor": 8}, ("data",), 8)     # 8-GPU hosts
        (1, 4)
        >>> split_group({"data": 4, "tensor": 8}, ("data", "tensor"), 16)
        (16, 2)
    """
    names = list(mesh)
    k = m = 1
    for a in axes:
        stride = math.prod(mesh[b] for b in names[names.index(a) + 1 :])
        n = mesh[a]
        inner = max(1, min(n, domain // stride)) if stride < domain else 1
        while n % inner:
            inner -= 1
        k *= inner
        m *= n // inner
    return k, m


def collective_time(
    profile: HardwareProfile,
    kind: str,
    mesh: Mapping[str, int],
    axes: Sequence[str],
    nbytes: float,
) -> float:
    """Seconds one ``kind`` collective of ``nbytes`` per device takes over ``axes`` of ``mesh``.

    Example:
        >>> from meshplan._search.predict.collectives import collective_time
        >>> from meshplan._search.predict.profiles import get_profile
        >>> h100 = get_profile("h100")
        >>> within = collective_time(h100, "all-reduce", {"data": 8}, ("data",), 1e9)
        >>> across = collective_time(h100, "all-reduce", {"data": 16}, ("data",), 1e9)
        >>> across > within         # 16 GPUs: two hosts, over InfiniBand
        True
    """
    k, m = split_group(mesh, axes, profile.domain_devices)
    fast, slow = profile.fast_bandwidth, profile.slow_bandwidth
    slow_lat = profile.slow_latency_s if profile.slow_latency_s is not None else profile.latency_s
    lat = (profile.latency_s if k > 1 else 0.0) + (slow_lat if m > 1 else 0.0)
    lat *= 1.0 if kind == "collective-permute" else _met_share(profile, k, m)
    phases = {"all-reduce": 2, "reduce-scatter": 1, "all-gather": 1}.get(kind, 0)
    if phases:  # the ring's steps: those crossing domains and the others
        lat += phases * ((m - 1) * profile.slow_hop_latency_s + (k * m - m) * profile.hop_latency_s)
    b = float(nbytes)
    if kind == "all-reduce":
        t = 2 * (k - 1) / k * b / fast + 2 * (m - 1) / m * (b / k) / slow
    elif kind == "reduce-scatter":
        t = (k - 1) / k * b / fast + (m - 1) / m * (b / k) / slow
    elif kind == "all-gather":
        t = (m - 1) * b / slow + (k - 1) * m * b / fast
    elif kind == "all-to-all":
        t = (k - 1) / (k * m) * b / fast + (m - 1) / m * b / slow
    elif kind == "collective-permute":
        t = b / (slow if m > 1 else fast)
    else:
        raise ValueError(f"unknown collective kind {kind!r}; one of {', '.join(COLLECTIVES)}")
    return t + lat


def array_latency(profile: HardwareProfile, mesh: Mapping[str, int], axes: Sequence[str]) -> float:
    """Seconds each array beyond the first adds to a collective combined over ``axes``.

    Example:
        >>> import dataclasses
        >>> from meshplan._search.predict.collectives import array_latency
        >>> from meshplan._search.predict.profiles import get_profile
        >>> threads = dataclasses.replace(
        ...     get_profile("h100"), array_latency_s=2e-4, latency_per_device=True
        ... )
        >>> round(array_latency(threads, {"data": 4, "tensor": 2}, ("data",)) * 1e6)  # 4 of 8
        100
    """
    k, m = split_group(mesh, axes, profile.domain_devices)
    return profile.array_latency_s * _met_share(profile, k, m) if k * m > 1 else 0.0


def _met_share(profile: HardwareProfile, k: int, m: int) -> float:
    """The share of a latency measured over the whole domain that a group of ``k m`` pays:
    ``k m / domain_devices`` where the devices meet in turn (``latency_per_device``), else 1."""
    return k * m / profile.domain_devices if profile.latency_per_device else 1.0
