"""Cache policies by name: one registry entry yields everything a policy name selects.

A cache policy is two parts that must agree: how a tier evicts (an ``EvictionPolicy``,
``kvoffload.tiers.eviction``) and what the planner stores and hints (a ``StorePolicy``,
``kvoffload.planner.store_policy``). ``cache_policy(name)`` is the one place a policy's
name is read: ``kvoffload.offload.build_offload`` calls it for
``OffloadConfig.eviction_policy`` (and a disk tier's ``disk_eviction_policy``) and hands
the resulting ``CachePolicy`` to the host tier, which builds its eviction from it, and to
the planner, which builds its store policy from it. Neither reads the name.

Built-in entries:

=========  ==========================  ==============================================
name       eviction                    store policy
=========  ==========================  ==============================================
``lru``    least recently used         every block a hit could use
``arc``    adaptive replacement        every block a hit could use
``hybrid`` LRU (honours demotion)      hit points (``selective.HitPointStorePolicy``)
``value``  compute saved per byte      hit points, learned granule, value hints, the
                                       insertion duel (the default, ``DEFAULT_POLICY``)
=========  ==========================  ==============================================

The simulator's reference policy, the oracle, is not an entry: it knows the future of the
workload it replays, so the simulator builds its ``CachePolicy`` for one run and hands it
over as an object (``kvoffload.sim.oracle``). Its name is reserved (``RESERVED_NAMES``):
``cache_policy("oracle")`` says why a deployment cannot select it.

``register_cache_policy`` adds an entry; a policy registered with an eviction only stores
every block (the null ``StorePolicy``), which its entry says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.config import DEFAULT_POLICY
from kvoffload.errors import ConfigError, shown
from kvoffload.planner.selective import hybrid_store_policy, value_store_policy
from kvoffload.planner.store_policy import StorePolicy, StorePolicyContext
from kvoffload.tiers.eviction.arc import ARCPolicy
from kvoffload.tiers.eviction.base import EvictionPolicy
from kvoffload.tiers.eviction.lru import LRUPolicy
from kvoffload.tiers.eviction.value import ValuePolicy

__all__ = ["DEFAULT_POLICY", "RESERVED_NAMES", "CachePolicy", "cache_policy",
           "cache_policy_names", "register_cache_policy"]

EvictionFactory = Callable[[int], EvictionPolicy]
"""Builds an eviction policy from its capacity (slots)."""

StoreFactory = Callable[[StorePolicyContext], StorePolicy]
"""Builds a store policy for one planner."""


def store_everything(context: StorePolicyContext) -> StorePolicy:
    """The null store policy: every block a hit could use, no hints."""
    del context
    return StorePolicy()


@dataclass(frozen=True)
class CachePolicy:
    """One cache policy: both halves, built for each tier and planner that uses it.

    Attributes:
        name: what ``eviction_policy`` says to select it (reports print it).
        eviction: builds a tier's eviction policy for a capacity in slots.
        store: builds the planner's store policy.
    """

    name: str
    eviction: EvictionFactory
    store: StoreFactory = store_everything


BUILTIN_POLICIES = (CachePolicy("lru", LRUPolicy), CachePolicy("arc", ARCPolicy),
                    CachePolicy("hybrid", LRUPolicy, hybrid_store_policy),
                    CachePolicy("value", ValuePolicy, value_store_policy))

_REGISTRY: dict[str, CachePolicy] = {entry.name: entry for entry in BUILTIN_POLICIES}

RESERVED_NAMES = {"oracle": "'oracle' is a simulator-only reference: it knows the future of "
                            "the workload it replays"}
"""Names no entry may take, with the reason ``cache_policy`` gives for them."""


def register_cache_policy(name: str, eviction: EvictionFactory,
                          store: StoreFactory = store_everything, *,
                          replace: bool = False) -> CachePolicy:
    """Make ``name`` select ``eviction`` in tiers and ``store`` in the planner.

    Registering different factories under a taken name raises ``ValueError`` unless
    ``replace`` is set; registering the same ones again is a no-op. Returns the entry.
    """
    if not name:
        raise ValueError("policy name must be non-empty")
    if name in RESERVED_NAMES:
        raise ValueError(f"cache policy {name!r} is reserved: {RESERVED_NAMES[name]}")
    entry = CachePolicy(name, eviction, store)
    current = _REGISTRY.get(name)
    if current is not None and current != entry and not replace:
        raise ValueError(f"cache policy {name!r} is already registered; pass replace=True")
    _REGISTRY[name] = entry
    return entry


def drop_cache_policy(name: str) -> None:
    """Remove the entry registered as ``name`` (absent: nothing happens). Built-in
    entries may not be dropped (``ValueError``)."""
    if any(entry.name == name for entry in BUILTIN_POLICIES):
        raise ValueError(f"cache policy {name!r} is built in")
    _REGISTRY.pop(name, None)


def cache_policy_names() -> tuple[str, ...]:
    """Every registered name a configuration may select, sorted."""
    return tuple(sorted(_REGISTRY))


def cache_policy(name: str, field: str = "eviction_policy") -> CachePolicy:
    """The entry registered as ``name``: the one reading of a policy's name.

    Raises ``ConfigError`` (for ``field``) listing the known names when none is
    registered as ``name``, saying why for a reserved one.
    """
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(repr(n) for n in cache_policy_names())
        if name in RESERVED_NAMES:
            raise ConfigError(field, RESERVED_NAMES[name],
                              f"Run it in the simulator (kvoffload simulate/sweep --policy "
                              f"{name}); a deployment uses one of: {known}.")
        raise ConfigError(field, f"unknown policy {shown(name)}", f"Use one of: {known}.")
    return entry
