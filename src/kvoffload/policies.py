"""Cache policies by name: one registry entry yields everything a policy name selects.

A cache policy is two parts that must agree: how a tier evicts (an ``EvictionPolicy``,
``kvoffload.tiers.eviction``) and what the planner stores and hints (a ``StorePolicy``,
``kvoffload.planner.store_policy``). ``OffloadConfig.eviction_policy`` (and a disk tier's
``eviction_policy``) names one entry; the host tier builds its eviction from it, the planner
its store policy, and neither reads the name any other way.

Built-in entries:

=========  ==========================  ==============================================
name       eviction                    store policy
=========  ==========================  ==============================================
``lru``    least recently used         every block a hit could use
``arc``    adaptive replacement        every block a hit could use
``hybrid`` LRU (honours demotion)      hit points (``selective.HitPointStorePolicy``)
``value``  compute saved per byte      hit points, learned granule, value hints, the
                                       insertion duel
``oracle`` furthest next use per byte  only what a later request hits (simulator only:
                                       ``kvoffload.sim.oracle.binding``)
=========  ==========================  ==============================================

``oracle`` is a *reference* entry: it knows the future of the workload it replays, so
``cache_policy("oracle")`` (and an ``OffloadConfig`` or vLLM configuration naming it)
raises ``ConfigError``; the simulator binds it to a workload's future for one run
(``engine.oracle.bind_oracle``). ``cache_policy_names()`` leaves reference entries out
unless asked for them.

``register_cache_policy`` adds one; a policy registered with an eviction only stores every
block (the null ``StorePolicy``), which its entry says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.planner.store_policy import StorePolicy, StorePolicyContext
    from kvoffload.tiers.eviction.base import EvictionPolicy

EvictionFactory = Callable[[int], "EvictionPolicy"]
"""Builds an eviction policy from its capacity (slots)."""

StoreFactory = Callable[["StorePolicyContext"], "StorePolicy"]
"""Builds a store policy for one planner."""


def store_everything(context: StorePolicyContext) -> StorePolicy:
    """The null store policy: every block a hit could use, no hints."""
    del context
    from kvoffload.planner.store_policy import StorePolicy

    return StorePolicy()


@dataclass(frozen=True)
class CachePolicy:
    """One registry entry.

    Attributes:
        name: what ``eviction_policy`` says to select it.
        eviction: builds the tier's eviction policy for a capacity in slots.
        store: builds the planner's store policy.
        reference_only: non-empty for a reference no configuration may select (why);
            ``cache_policy`` raises ``ConfigError`` with it.
    """

    name: str
    eviction: EvictionFactory
    store: StoreFactory = store_everything
    reference_only: str = ""


_REGISTRY: dict[str, CachePolicy] = {}


def register_cache_policy(name: str, eviction: EvictionFactory,
                          store: StoreFactory = store_everything, *,
                          replace: bool = False) -> CachePolicy:
    """Make ``name`` select ``eviction`` in tiers and ``store`` in the planner.

    Registering different factories under a taken name raises ``ValueError`` unless
    ``replace`` is set; registering the same ones again is a no-op. Returns the entry.
    """
    if not name:
        raise ValueError("policy name must be non-empty")
    _ensure_builtins()
    entry = CachePolicy(name, eviction, store)
    current = _REGISTRY.get(name)
    if current is not None and current != entry and not replace:
        raise ValueError(f"cache policy {name!r} is already registered; pass replace=True")
    _REGISTRY[name] = entry
    return entry


def drop_cache_policy(name: str) -> None:
    """Remove the entry registered as ``name`` (absent: nothing happens). Built-in
    entries may not be dropped (``ValueError``)."""
    if name in BUILTIN_NAMES:
        raise ValueError(f"cache policy {name!r} is built in")
    _REGISTRY.pop(name, None)


def cache_policy_names(references: bool = False) -> tuple[str, ...]:
    """Every registered name a configuration may select, sorted; with ``references``,
    the reference entries (``oracle``) too."""
    _ensure_builtins()
    return tuple(sorted(name for name, entry in _REGISTRY.items()
                        if references or not entry.reference_only))


def cache_policy(name: str, field: str = "eviction_policy") -> CachePolicy:
    """The entry registered as ``name``.

    Unknown names raise ``ConfigError`` (for ``field``) listing the known ones.
    """
    _ensure_builtins()
    entry = _REGISTRY.get(name)
    if entry is None:
        known = ", ".join(repr(n) for n in cache_policy_names())
        raise ConfigError(field, f"unknown policy {name!r}", f"Use one of: {known}.")
    if entry.reference_only:
        known = ", ".join(repr(n) for n in cache_policy_names())
        raise ConfigError(field, entry.reference_only,
                          f"Run it in the simulator (kvoffload simulate/sweep --policy "
                          f"{name}); a deployment uses one of: {known}.")
    return entry


ORACLE = "oracle"
"""The simulator-only reference policy (``kvoffload.sim.oracle.binding``)."""

BUILTIN_NAMES = frozenset({"lru", "arc", "hybrid", "value", ORACLE})

_BUILTINS_READY = False


def _unbound_reference(capacity: int) -> EvictionPolicy:
    raise ConfigError("eviction_policy", "a reference policy is bound by the simulator",
                      "Use kvoffload simulate/sweep.")


def _ensure_builtins() -> None:
    """Register the built-in policies, once (imported here, not at module import: the
    configuration validates names and is imported by the modules that implement them)."""
    global _BUILTINS_READY  # noqa: PLW0603 - a one-time registration
    if _BUILTINS_READY:
        return
    from kvoffload.planner.selective import hybrid_store_policy, value_store_policy
    from kvoffload.tiers.eviction.arc import ARCPolicy
    from kvoffload.tiers.eviction.lru import LRUPolicy
    from kvoffload.tiers.eviction.value import ValuePolicy

    for entry in (CachePolicy("lru", LRUPolicy), CachePolicy("arc", ARCPolicy),
                  CachePolicy("hybrid", LRUPolicy, hybrid_store_policy),
                  CachePolicy("value", ValuePolicy, value_store_policy),
                  CachePolicy(ORACLE, _unbound_reference, reference_only=(
                      "'oracle' is a simulator-only reference: it knows the future of "
                      "the workload it replays"))):
        _REGISTRY.setdefault(entry.name, entry)
    _BUILTINS_READY = True
