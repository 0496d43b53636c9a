"""Build kvoffload's scheduler side: the one place that turns a configuration into a
planner with its tiers.

``build_offload(config, tiers)`` reads the cache policy's name once
(``kvoffload.policies.cache_policy``: ``config.eviction_policy``, and
``tiers.disk.eviction_policy`` for a disk tier), builds the tier the planner talks to (a
``HostTier``, wrapped in a ``CascadeTier`` over the lower tiers ``tiers`` configures) and
the ``Planner`` over it, and gives the host tier and the planner the same ``CachePolicy``.
Every engine builds its scheduler side here: the vLLM connector, the reference engine, the
simulator and its fleet. A caller holding a policy object the registry does not name (the
simulator's oracle) passes it as ``policy``.

Lower tiers are chosen from a table (``LOWER_TIERS``), by name, in ``TierConfig.order``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.config import OffloadConfig
from kvoffload.planner.planner import Planner
from kvoffload.planner.valuation import PrefillFlops
from kvoffload.policies import CachePolicy, cache_policy
from kvoffload.tiers.base import Tier
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import DiskTierConfig, TierConfig
from kvoffload.tiers.disk import DiskIndex
from kvoffload.tiers.host import HostTier
from kvoffload.tiers.lower import LowerTier
from kvoffload.tiers.naming import namespace
from kvoffload.tiers.remote import RemoteIndex

__all__ = ["Offload", "build_lower_tiers", "build_offload", "disk_index"]


@dataclass(frozen=True)
class Offload:
    """A planner and the tier it plans against, built by ``build_offload``.

    Attributes:
        config: the configuration both were built from.
        policy: the cache policy both use (the tier its eviction, the planner its store
            policy).
        host: host memory: the tier itself, or the first level of the cascade; it owns
            the host slots every load and store names.
        tier: the planner's tier: host memory, or a cascade with lower tiers below it.
        planner: the scheduler side an engine calls each step.
        clock: the clock the planner and a cascade measure their waits in seconds with.
    """

    config: OffloadConfig
    policy: CachePolicy
    host: HostTier
    tier: Tier
    planner: Planner
    clock: Callable[[], float] = time.monotonic


def build_offload(config: OffloadConfig, tiers: TierConfig | None = None, *,
                  policy: CachePolicy | None = None,
                  lower_tiers: Sequence[LowerTier] | None = None,
                  enable_events: bool = True, accounting: bool = False,
                  remote_capacity_bytes: int = 1 << 50,
                  prefill_flops: PrefillFlops | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Offload:
    """The planner and its tiers for ``config``.

    Args:
        config: the offload configuration.
        tiers: lower tiers (disk, remote) below host memory; None: host memory only.
        policy: the cache policy; None reads ``config.eviction_policy`` (an unknown name
            raises ``ConfigError`` listing the registered ones).
        lower_tiers: lower tiers already built, used instead of building ``tiers``' (a
            simulated fleet gives each engine a view of one shared store).
        enable_events: publish cache events (``Planner.take_events``).
        accounting: for simulations whose workers move no bytes (they report every tier
            job done): the disk tier starts empty without reading its directory, and the
            remote tier is modelled as a budgeted index of ``remote_capacity_bytes`` (all
            ranks, LRU, like a server's ``maxmemory``) instead of asking a server.
        remote_capacity_bytes: the modelled remote tier's budget (``accounting``).
        prefill_flops: the model's prefill cost (``Planner``).
        clock: the planner's clock (``Planner``), also the cascade's (its wait for host
            room, ``CascadeTier``).

    Building a disk tier scans its directory (a restarted engine finds what it stored);
    building a remote tier opens no connection yet.
    """
    if policy is None:
        policy = cache_policy(config.eviction_policy)
    host = HostTier(config, policy, enable_events=enable_events)
    if lower_tiers is None:
        lower_tiers = build_lower_tiers(config, tiers, accounting=accounting,
                                        remote_capacity_bytes=remote_capacity_bytes)
    tier: Tier = CascadeTier(host, list(lower_tiers), clock=clock) if lower_tiers else host
    planner = Planner(config, tier, policy, prefill_flops=prefill_flops, clock=clock)
    return Offload(config, policy, host, tier, planner, clock)


def disk_index(config: OffloadConfig, disk: DiskTierConfig, ns: str, *,
               scan: bool = True) -> DiskIndex:
    """The disk tier's bookkeeping, evicting by ``disk.eviction_policy``'s eviction half
    (an unknown name raises ``ConfigError`` for ``disk_eviction_policy``)."""
    eviction = cache_policy(disk.eviction_policy, "disk_eviction_policy").eviction
    return DiskIndex(config, disk, ns, scan=scan, eviction=eviction)


def _disk(config: OffloadConfig, tiers: TierConfig, ns: str) -> LowerTier:
    assert tiers.disk is not None
    return disk_index(config, tiers.disk, ns)


def _remote(config: OffloadConfig, tiers: TierConfig, ns: str) -> LowerTier:
    assert tiers.remote is not None
    return RemoteIndex(config, tiers.remote, ns)


LOWER_TIERS: dict[str, Callable[[OffloadConfig, TierConfig, str], LowerTier]] = {
    "disk": _disk,
    "remote": _remote,
}
"""Lower-tier bookkeeping by name: built from the offload config, the tier config and the
namespace fingerprint."""


def build_lower_tiers(config: OffloadConfig, tiers: TierConfig | None, *,
                      accounting: bool = False,
                      remote_capacity_bytes: int = 1 << 50) -> list[LowerTier]:
    """The bookkeeping of the tiers ``tiers`` configures below host memory, in lookup
    order (empty for None); ``accounting`` and ``remote_capacity_bytes`` as in
    ``build_offload``."""
    if tiers is None or not tiers.enabled:
        return []
    ns = namespace(config, tiers)
    if not accounting:
        return [LOWER_TIERS[name](config, tiers, ns) for name in tiers.enabled]
    lowers: list[LowerTier] = []
    for name in tiers.enabled:
        if name == "disk":
            assert tiers.disk is not None
            lowers.append(disk_index(config, tiers.disk, ns, scan=False))
        else:
            assert tiers.remote is not None
            model = DiskTierConfig("(simulated remote)", remote_capacity_bytes,
                                   write_mode=tiers.remote.write_mode)
            lowers.append(DiskIndex(config, model, ns, scan=False, name="remote"))
    return lowers
