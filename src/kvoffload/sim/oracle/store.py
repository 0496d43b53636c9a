"""The oracle's store policy (``kvoffload.sim.oracle.binding``): window blocks and Mamba
states only where a later request hits.

Full-attention blocks are stored as under every policy. A window block or Mamba state of
request ``i`` is stored only when some request that has not started yet, other than
``i``, uses its key (``sim.oracle.future``: its hit, nothing evicted, ends where that window
or state serves it), so nothing is stored that no hit would read. Preemptions are not
foreseen: a preempted request resumes from what later requests needed. The policy sends
no hints; it tells the oracle's clock when each request starts, which is all the
eviction side learns from the replay.
"""

from __future__ import annotations

from typing import Protocol

from kvoffload.config import ResolvedGroup
from kvoffload.keys import OffloadKey
from kvoffload.planner.state import RequestState
from kvoffload.planner.store_policy import StorePolicy, StoreSelection


class OracleRun(Protocol):
    """What the store policy asks of the oracle's run (``sim.oracle.binding.OracleRun``)."""

    def start(self, request_id: str) -> int:
        """Mark the request started; return its index in the workload."""
        ...

    def used_later(self, key: OffloadKey, by_other_than: int) -> bool:
        """Whether a request not started yet, other than ``by_other_than``, uses ``key``."""
        ...


class _FutureSelection(StoreSelection):
    def __init__(self, run: OracleRun, index: int) -> None:
        self._run = run
        self._index = index

    def admit(self, group: ResolvedGroup, block: int, key: OffloadKey) -> bool:
        del group, block
        return self._run.used_later(key, self._index)


class OracleStorePolicy(StorePolicy):
    """Stores a window block or state only where a later hit reads it (module docstring)."""

    def __init__(self, run: OracleRun) -> None:
        self._run = run
        self._index: dict[str, int] = {}

    def first_lookup(self, st: RequestState, num_computed_tokens: int, hit_end: int) -> None:
        super().first_lookup(st, num_computed_tokens, hit_end)
        rid = st.request.request_id
        self._index[rid] = self._run.start(rid)

    def select(self, st: RequestState, offloadable: int) -> StoreSelection:
        del offloadable
        rid = st.request.request_id
        index = self._index.get(rid)
        if index is None:  # stores before a lookup answered: the request starts now
            index = self._index[rid] = self._run.start(rid)
        return _FutureSelection(self._run, index)

    def finished(self, st: RequestState) -> None:
        self._index.pop(st.request.request_id, None)
