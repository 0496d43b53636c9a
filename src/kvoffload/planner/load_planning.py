"""Load planning: which host slots and engine blocks one load job moves, and issuing it.

``LoadPlanner.plan`` is called by ``Planner.update_state_after_alloc`` once the engine
took the hit a lookup offered and allocated its blocks. It keeps rules 2 and 5 of
``docs/architecture.md``: every key of the load must still be readable (one evicted
between the lookup and the allocation makes the engine recompute: the load fails early,
nothing is pinned), the tier pins each key it grants (``prepare_load``, +1 until the job
completes), and the blocks the load writes are exactly the positions each group's hit
needs (``positions.load_transfers``). The store half of the planner is
``store_planning``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType

from kvoffload.config import OffloadConfig
from kvoffload.jobs import Direction, TransferJob
from kvoffload.metrics import PlannerStats
from kvoffload.planner.jobs_in_flight import JobsInFlight
from kvoffload.planner.positions import load_transfers, with_slots
from kvoffload.planner.state import JobState, PlannedLoad, RequestState
from kvoffload.tiers.base import LookupResult, Tier

NO_LOAD: Mapping[tuple[str, int], int] = MappingProxyType({})
"""``update_state_after_alloc``'s answer when it planned no load."""


class LoadPlanner:
    """Plans and issues a request's load (module docstring)."""

    def __init__(self, config: OffloadConfig, tier: Tier, jobs: JobsInFlight,
                 stats: PlannerStats) -> None:
        self._groups = config.resolved
        self._tier = tier
        self._jobs = jobs
        self.stats = stats

    def plan(self, st: RequestState, planned: PlannedLoad,
             tables: Sequence[Sequence[int]]) -> Mapping[tuple[str, int], int]:
        """Issue the load ``planned`` into the request's block ``tables`` (one list per
        group); returns where its blocks come from (``LoadGrant.blocks_by_source``), or
        ``NO_LOAD`` when nothing is loaded (the hit's keys were evicted: the request
        recomputes; or the engine's own blocks already cover it). The job joins the
        request's jobs and the next plan's loads; its destination blocks are fenced."""
        rid = st.request.request_id
        keys, parts = load_transfers(self._groups, st.groups, tables, planned)
        if any(self._tier.lookup(k) is not LookupResult.HIT for k in keys):
            # Evicted between lookup and allocation: the engine recomputes instead.
            self._jobs.load_failed_early(rid, planned.num_local_tokens)
            return NO_LOAD
        if not keys:
            self._jobs.load_done_early(rid)
            return NO_LOAD
        grant = self._tier.prepare_load(keys)
        for g, gs in zip(self._groups, st.groups, strict=True):
            gs.next_stored = max(gs.next_stored, planned.end // g.offloaded_block_size)
        filled = with_slots(parts, grant.slots)
        for t in filled:
            self.stats.add_blocks(self.stats.blocks_loaded, t.group, len(t.block_ids))
        dests = tuple(b for t in filled for b in t.block_ids)
        job_id = self._jobs.issue(lambda job_id: JobState(
            job_id, rid, Direction.LOAD, tuple(keys), (), dests,
            num_local_tokens=planned.num_local_tokens)).job_id
        st.jobs.add(job_id)
        self._jobs.allocated(dests)
        self._jobs.loads.append(TransferJob(job_id, Direction.LOAD, rid, filled))
        self.stats.load_jobs += 1
        return grant.blocks_by_source
