"""The ``oracle`` cache policy: an offline reference that knows the future of the
workload it replays (``docs/policy.md``, "Distance to the oracle").

It runs through the same planner, engine and byte accounting as every other policy; only
its knowledge differs. Its two halves:

* store (``sim.oracle.store.OracleStorePolicy``): full-attention blocks as every policy;
  a window block or Mamba state only where a request that has not started yet hits
  (``sim.oracle.future``: the later request's prompt shares the prefix and its hit,
  nothing evicted, ends where that window or state serves it);
* eviction (``sim.oracle.eviction.OraclePolicy``): the idle key whose next use lies
  furthest ahead, weighted by its bytes (Belady with sizes: a heuristic bound, not the
  optimum).

What it learns from the replay is only which requests have started (the store policy's
``first_lookup``); everything else comes from the ``WorkloadFuture`` built before the
replay. It is not an entry of the cache-policy registry, so neither an ``OffloadConfig``
nor the vLLM connector can name it: the simulator (``sim.simulation.run_one``, for the
name ``ORACLE``) builds the future and hands the run a ``CachePolicy`` bound to it
(``oracle_policy``), as an object.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.planner.store_policy import StorePolicy, StorePolicyContext
from kvoffload.policies import CachePolicy
from kvoffload.sim.oracle.eviction import OraclePolicy
from kvoffload.sim.oracle.future import NO_USE, WorkloadFuture
from kvoffload.sim.oracle.store import OracleStorePolicy
from kvoffload.tiers.eviction.base import EvictionPolicy

ORACLE = "oracle"
"""The name the simulator (``--policy``, ``SimulationConfig.eviction_policy``) gives the
oracle; no registry entry has it."""

ENGINE_ONLY = NO_USE // 2
"""``OracleRun.next_use`` of a key only the engine's own prefix cache is modelled to
serve: after every key a tier serves (``NO_USE`` is larger still)."""


class OracleRun:
    """One replay's view of the future: which requests have started, and the next use of
    a key among those that have not (``sim.oracle.eviction.OracleClock``)."""

    def __init__(self, future: WorkloadFuture) -> None:
        self.future = future
        self._started = bytearray(len(future))
        self._now = 0
        self._listeners: list[Callable[[Sequence[OffloadKey]], None]] = []

    @property
    def now(self) -> int:
        return self._now

    def start(self, request_id: str) -> int:
        """Mark the request started (once); rescore the keys it used. Returns its index."""
        index = self.future.index_of(request_id)
        if not self._started[index]:
            self._started[index] = 1
            while self._now < len(self._started) and self._started[self._now]:
                self._now += 1
            used = self.future.keys_used_by(index)
            for listener in self._listeners:
                listener(used)
        return index

    def next_use(self, key: OffloadKey) -> int:
        """The first request not started yet that reads ``key`` from a tier; for a key
        only the modelled engine prefix cache serves from now on, ``ENGINE_ONLY`` plus the
        first such request (after every key a tier serves, before keys nobody reads);
        ``NO_USE`` if no request reads it."""
        found = self._pending(self.future.uses(key), -1)
        if found is not None:
            return found
        found = self._pending(self.future.engine_uses(key), -1)
        return NO_USE if found is None else ENGINE_ONLY + found

    def _pending(self, uses: Sequence[int], other_than: int) -> int | None:
        """The first of ``uses`` (ascending) not started yet and not ``other_than``."""
        for r in uses[bisect_left(uses, self._now):]:
            if not self._started[r] and r != other_than:
                return r
        return None

    def used_later(self, key: OffloadKey, by_other_than: int) -> bool:
        """Whether a request not started yet, other than ``by_other_than``, reads ``key``
        (from a tier, or from the engine's prefix cache as modelled: a window block or
        state is kept where the model may be wrong)."""
        return (self._pending(self.future.uses(key), by_other_than) is not None
                or self._pending(self.future.engine_uses(key), by_other_than) is not None)

    def depth(self, key: OffloadKey) -> int:
        return self.future.depth(key)

    def subscribe(self, listener: Callable[[Sequence[OffloadKey]], None]) -> None:
        self._listeners.append(listener)


def oracle_policy(future: WorkloadFuture) -> CachePolicy:
    """The oracle bound to ``future`` for one run: every tier and planner built from the
    returned policy shares one ``OracleRun``."""
    run = OracleRun(future)

    def eviction(capacity: int) -> EvictionPolicy:
        return OraclePolicy(capacity, run)

    def store(context: StorePolicyContext) -> StorePolicy:
        del context
        return OracleStorePolicy(run)

    return CachePolicy(ORACLE, eviction, store)
