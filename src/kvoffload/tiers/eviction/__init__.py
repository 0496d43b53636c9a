"""Eviction policies for fixed-size tiers: LRU, ARC and value (compute saved per byte,
blended with recency).

A tier builds its policy from the cache-policy registry (``kvoffload.policies``), whose
entries ``"lru"``, ``"arc"``, ``"hybrid"`` (LRU, with hit-point admission in the planner)
and ``"value"`` name these classes.
"""

from kvoffload.tiers.eviction.arc import ARCPolicy
from kvoffload.tiers.eviction.base import (
    WRITING,
    BlockState,
    EvictionPolicy,
    ValueHint,
    ValueRun,
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
    "ValueRun",
    "Victims",
]
