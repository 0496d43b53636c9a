"""Eviction policies for fixed-size tiers, looked up by name (``make_policy``).

Importing this package registers the built-in policies: ``"lru"``, ``"arc"``, ``"hybrid"``
(LRU with hit-point admission) and ``"value"`` (hit-point admission with eviction by
compute saved per byte, blended with recency).
"""

from kvoffload.tiers.eviction.arc import ARCPolicy
from kvoffload.tiers.eviction.base import (
    WRITING,
    BlockState,
    EvictionPolicy,
    ValueHint,
    Victims,
)
from kvoffload.tiers.eviction.lru import LRUPolicy
from kvoffload.tiers.eviction.value import ValuePolicy

__all__ = [
    "WRITING",
    "ARCPolicy",
    "BlockState",
    "EvictionPolicy",
    "LRUPolicy",
    "ValueHint",
    "ValuePolicy",
    "Victims",
]
