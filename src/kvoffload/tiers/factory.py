"""Build the scheduler side's tier from the configuration: ``make_tier``.

Lower tiers are chosen from a table (``LOWER_TIERS``), by name, in ``TierConfig.order``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.config import OffloadConfig
from kvoffload.tiers.base import Tier
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import DiskTierConfig, TierConfig
from kvoffload.tiers.disk import DiskIndex
from kvoffload.tiers.host import HostTier
from kvoffload.tiers.lower import LowerTier
from kvoffload.tiers.naming import namespace
from kvoffload.tiers.remote import RemoteIndex


def _disk(config: OffloadConfig, tiers: TierConfig, ns: str) -> LowerTier:
    assert tiers.disk is not None
    return DiskIndex(config, tiers.disk, ns)


def _remote(config: OffloadConfig, tiers: TierConfig, ns: str) -> LowerTier:
    assert tiers.remote is not None
    return RemoteIndex(config, tiers.remote, ns)


LOWER_TIERS: dict[str, Callable[[OffloadConfig, TierConfig, str], LowerTier]] = {
    "disk": _disk,
    "remote": _remote,
}
"""Lower-tier bookkeeping by name: built from the offload config, the tier config and the
namespace fingerprint."""


def make_tier(config: OffloadConfig, tiers: TierConfig | None = None, *,
              enable_events: bool = True, accounting: bool = False,
              remote_capacity_bytes: int = 1 << 50) -> Tier:
    """The tier the planner talks to: a ``HostTier``, wrapped in a ``CascadeTier`` when
    ``tiers`` configures a disk or remote tier.

    Building the disk tier scans its directory (a restarted engine finds what it stored);
    building the remote tier opens no connection yet.

    ``accounting=True`` is for simulations whose workers move no bytes (they report every
    tier job done): the disk tier starts empty without reading its directory, and the
    remote tier is modelled as a budgeted index of ``remote_capacity_bytes`` (all ranks,
    LRU, like a server's ``maxmemory``) instead of asking a server.
    """
    host = HostTier(config, enable_events=enable_events)
    if tiers is None or not tiers.enabled:
        return host
    ns = namespace(config, tiers)
    if not accounting:
        return CascadeTier(host, [LOWER_TIERS[name](config, tiers, ns)
                                  for name in tiers.enabled])
    lowers: list[LowerTier] = []
    for name in tiers.enabled:
        if name == "disk":
            assert tiers.disk is not None
            lowers.append(DiskIndex(config, tiers.disk, ns, scan=False))
        else:
            assert tiers.remote is not None
            model = DiskTierConfig("(simulated remote)", remote_capacity_bytes,
                                   write_mode=tiers.remote.write_mode)
            lowers.append(DiskIndex(config, model, ns, scan=False, name="remote"))
    return CascadeTier(host, lowers)
