"""Eviction policies for fixed-size tiers, looked up by name (``make_policy``).

Importing this package registers the built-in policies: ``"lru"`` and ``"arc"``.
"""

from kvoffload.tiers.eviction.arc import ARCPolicy
from kvoffload.tiers.eviction.base import (
    WRITING,
    BlockState,
    EvictionPolicy,
    PolicyFactory,
    Victims,
    make_policy,
    register_policy,
    registered_policies,
)
from kvoffload.tiers.eviction.lru import LRUPolicy

__all__ = [
    "WRITING",
    "ARCPolicy",
    "BlockState",
    "EvictionPolicy",
    "LRUPolicy",
    "PolicyFactory",
    "Victims",
    "make_policy",
    "register_policy",
    "registered_policies",
]
