"""A host tier and a planner for tests that build them one at a time.

``kvoffload.offload.build_offload`` builds both from a configuration in one call; these
helpers give the cache policy the configuration names to each part a test builds on its
own (a tier alone, or a planner over a tier the test wrapped).
"""

from __future__ import annotations

from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.planner.planner import Planner
from kvoffload.policies import cache_policy
from kvoffload.tiers.base import Tier
from kvoffload.tiers.host import HostTier


def host_tier(config: OffloadConfig, **kwargs: Any) -> HostTier:
    """A host tier evicting by the cache policy ``config.eviction_policy`` names."""
    return HostTier(config, cache_policy(config.eviction_policy), **kwargs)


def planner_for(config: OffloadConfig, tier: Tier, **kwargs: Any) -> Planner:
    """A planner over ``tier`` storing by the cache policy ``config.eviction_policy``
    names."""
    return Planner(config, tier, cache_policy(config.eviction_policy), **kwargs)
