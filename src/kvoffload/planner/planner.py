"""The planner: kvoffload's scheduler side (``docs/architecture.md``: the contract and the rules).

The engine calls, each step and in this order:

1. ``get_num_new_matched_tokens`` for each waiting request it considers;
2. ``update_state_after_alloc`` once it allocated blocks for such a request;
3. ``build_step_plan`` once per step, with the requests it scheduled;
4. ``update_from_worker_reports`` with whatever the workers reported;
5. ``request_finished`` when a request ends (finished, aborted).

The planner decides every transfer and never moves a byte. Its promises:

* a load is issued only for blocks that are readable in the tier, and pins them until every
  worker has reported the load;
* a request has either one load or any number of stores in flight, never both;
* no engine block is overwritten while a job still uses it: blocks of window and Mamba
  groups are fenced as soon as their store is created, the rest when the request finishes;
  a fenced block allocated again puts its jobs into the next plan's ``flush``;
* a failed transfer frees its slots and, for a load, tells the engine to recompute;
* a load the engine gives up on (``abandon_load``: it waited past its deadline) keeps its
  keys pinned and its engine blocks fenced until it reports; the engine must not reuse
  those blocks until ``ReportOutcome.released_loads`` names the job;
* a deferred lookup ("ask again later") is answered within ``max_deferred_steps`` steps
  (and, when set, ``min_deferral_s`` seconds, whichever comes later); one that waits on
  answers a lower tier is still asking a server for, or on host room for a promote
  (``Tier.answer_wait_s``), waits up to that many seconds from its first deferral,
  however many steps pass, and the step bound starts once the wait ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.jobs import Direction, JobId, StepPlan, TransferJob, WorkerReport
from kvoffload.metrics import PlannerStats
from kvoffload.planner.contract import (
    LoadFailure,
    MatchResult,
    ReportOutcome,
    RequestControls,
    RequestInfo,
    ScheduledRequest,
    StepInput,
)
from kvoffload.planner.insertion import InsertionDuel
from kvoffload.planner.jobs_in_flight import JobsInFlight
from kvoffload.planner.load_planning import NO_LOAD, LoadPlanner
from kvoffload.planner.prefix_lookup import PrefixLookup
from kvoffload.planner.state import GroupState, JobState, PlannedLoad, RequestState
from kvoffload.planner.store_planning import StorePlanner
from kvoffload.planner.store_policy import StorePolicy, StorePolicyContext
from kvoffload.planner.valuation import PrefillFlops
from kvoffload.tiers.base import Tier, TierEvent

if TYPE_CHECKING:
    from kvoffload.policies import CachePolicy

logger = logging.getLogger(__name__)



class Planner:
    """Engine-neutral scheduler side of kvoffload. See the module docstring."""

    def __init__(self, config: OffloadConfig, tier: Tier, policy: CachePolicy, *,
                 prefill_flops: PrefillFlops | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
            config: the offload configuration.
            tier: the tier (or cascade of tiers) the planner plans transfers against.
            policy: the cache policy whose store half decides what is stored beyond a
                hit's rules (``kvoffload.offload.build_offload`` gives the tier and the
                planner the same one).
            prefill_flops: ``prefill_flops(end, start)``, the model's prefill cost of
                tokens ``[start, end)``, for value-aware policies (a layout-based
                estimate if not given).
            clock: seconds on a clock that never goes back (``time.monotonic`` by
                default); the planner reads time only through it, to bound how long a
                deferred lookup waits (``min_deferral_s``, ``Tier.answer_wait_s``).
        """
        self.config = config
        self.tier = tier
        self.stats = PlannerStats()
        self._groups = config.resolved
        self._alignment = config.hit_alignment
        self._requests: dict[str, RequestState] = {}
        self._jobs = JobsInFlight(config.num_workers, tier, self.stats)
        self._policy = policy.store(
            StorePolicyContext(config, tier, self.stats, prefill_flops))
        self._lookups = PrefixLookup(config, tier, self._policy)
        self._stores = StorePlanner(config, tier, self._policy, self.stats)
        self._loads = LoadPlanner(config, tier, self._jobs, self.stats)
        self._clock = clock

    @property
    def store_policy(self) -> StorePolicy:
        """What the planner stores beyond a hit's rules, and the hints it sends
        (``kvoffload.planner.store_policy``; built by the cache policy it was given)."""
        return self._policy

    @property
    def insertion(self) -> InsertionDuel | None:
        """The store policy's duel between LRU and bimodal insertion, if it runs one."""
        return self._policy.insertion

    # ------------------------------------------------------------------ lookup

    def get_num_new_matched_tokens(self, request: RequestInfo,
                                   num_computed_tokens: int) -> MatchResult:
        """Tokens the tier can provide beyond the engine's own prefix hit.

        Returns ``MatchResult(None)`` ("ask again next step") while a block the hit needs
        is still being written, or while the request still has jobs in flight (e.g. stores
        of a preempted request); after ``max_deferred_steps`` such answers in a row it
        answers with what is readable now -- or, while a lower tier's answers about the
        blocks, or host room to promote them into, are outstanding, after that bound in
        seconds of the planner's clock (``_defer_or``). Touches the blocks a future hit may
        need.

        A request whose load failed or was abandoned is answered 0 from then on (it
        recomputes; the same blocks could fail the same way forever), after the same
        lookup, touches and deferrals as any other.
        """
        st = self._live_state(request)
        st.planned = None
        self.stats.lookups += 1
        if st.jobs:
            return self._defer_or(st, 0)
        st.reset_table()
        self._lookups.refresh_keys(st)
        st.num_local_tokens = num_computed_tokens
        reach = self._lookups.find(st, num_computed_tokens)
        end = reach.end
        if reach.waiting_helps:
            result = self._defer_or(st, end - num_computed_tokens, reach.answer_wait_s)
            if result.is_deferred:
                return result
        st.deferred_steps = 0
        hits = end - num_computed_tokens
        first = not st.looked_up
        if first:
            st.looked_up = True
            for g, gs in zip(self._groups, st.groups, strict=True):
                gs.num_hit_blocks = end // g.offloaded_block_size
            self._policy.first_lookup(st, num_computed_tokens, end)
        self._lookups.touch(st, self._policy.touch_skip(st, finishing=False))
        if hits > 0:
            self.stats.lookup_hit_tokens += hits
            if st.refuses_loads:
                return MatchResult(0)
            st.planned = PlannedLoad(num_computed_tokens, end)
        return MatchResult(hits, load_async=hits > 0)

    def _defer_or(self, st: RequestState, fallback: int,
                  answer_wait_s: float = 0.0) -> MatchResult:
        """Defer this lookup, unless the request has waited long enough already
        (``RequestState.keeps_deferring``: while a lower tier's answers are outstanding,
        ``max(min_deferral_s, answer_wait_s)`` seconds however many steps pass; else
        ``max_deferred_steps`` answers and ``min_deferral_s`` seconds)."""
        wait_more = st.keeps_deferring(self._clock(), answer_wait_s,
                                       self.config.max_deferred_steps,
                                       self.config.min_deferral_s)
        if wait_more:
            st.deferred_steps += 1
            self.stats.deferred_lookups += 1
            return MatchResult(None)
        self.stats.deferral_timeouts += 1
        st.deferred_steps = 0
        if st.jobs:
            return MatchResult(0)
        return MatchResult(fallback, load_async=fallback > 0)

    # ------------------------------------------------------------------- loads

    def update_state_after_alloc(self, request: RequestInfo,
                                 blocks_per_group: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> Mapping[tuple[str, int], int]:
        """Record the request's block table and plan its load, if the engine took one.

        ``blocks_per_group`` is the request's whole block table per group (0 = null).
        ``num_external_tokens`` is what the engine accepted from the last lookup: that
        number exactly, or 0. Every allocated block is checked against the fence.

        Returns where the planned load's blocks come from: blocks by (tier that serves
        them, group), ``LoadGrant.blocks_by_source``; empty when no load was planned.
        """
        st = self._requests.get(request.request_id)
        if st is None:
            raise ValueError(f"request {request.request_id!r} was never looked up; call "
                             "get_num_new_matched_tokens first")
        if len(blocks_per_group) != len(self._groups):
            raise ValueError(f"got block lists for {len(blocks_per_group)} groups, the "
                             f"configuration has {len(self._groups)}")
        for ids in blocks_per_group:
            self._jobs.allocated(ids)
        planned, st.planned = st.planned, None
        if num_external_tokens == 0:
            return NO_LOAD
        if planned is None or planned.end - planned.num_local_tokens != num_external_tokens:
            offered = 0 if planned is None else planned.end - planned.num_local_tokens
            raise ValueError(f"request {request.request_id!r}: engine accepted "
                             f"{num_external_tokens} external tokens, the last lookup offered "
                             f"{offered}; pass exactly that number or 0")
        if st.jobs:
            raise InvariantError(f"request {request.request_id!r} has jobs in flight; "
                                 "a load needs none")
        return self._loads.plan(st, planned, blocks_per_group)

    # ------------------------------------------------------------------ stores

    def build_step_plan(self, step: StepInput) -> StepPlan:
        """Everything the workers must do this step: flushes, stores, loads.

        Stores cover blocks complete once this step's tokens are computed; the workers
        submit them after the step's forward pass (flushed ones right away).
        """
        for rid in step.preempted:
            st = self._requests.get(rid)
            if st is None:
                continue
            self._jobs.flush |= st.jobs
            st.reset_table()
            self._policy.preempted(st)
        stores: list[TransferJob] = []
        for sched in step.scheduled:
            job = self._schedule_request(sched)
            if job is not None:
                stores.append(job)
        self._jobs.allocated(step.other_allocations)
        tier_work = self.tier.take_tier_work()  # after the stores: it sees their evictions
        # A store created in this step reads only blocks its running request still holds
        # (freed positions are never stored), so none of them can be handed out afresh
        # this step (``JobsInFlight.take_plan`` never flushes it).
        planned = self._jobs.take_plan(stores)
        return StepPlan(flush=planned.flush, stores=tuple(stores), loads=planned.loads,
                        tier_flush=tier_work.flush, tier_jobs=tier_work.jobs)

    def step_is_idle(self, request_id: str, offloadable: int) -> bool:
        """Whether live request ``request_id``, scheduled with no new blocks, not resumed,
        no ``state_ends``, ``offloadable`` tokens (computed plus scheduled, capped at its
        length) at the step's end, needs nothing of this step: no block completes before
        its next store is due, no Mamba state is kept at step ends, no load is in flight.
        The engine may then leave it out of ``StepInput.scheduled``; the next step that
        lists it brings its keys and freed positions up to date before a store reads them.
        """
        st = self._requests.get(request_id)
        return (st is not None and st.controls.store_end(offloadable) < st.store_due
                and not st.finished
                and not self._stores.step_end_states
                and not any(self._jobs[j].direction is Direction.LOAD for j in st.jobs))

    def _schedule_request(self, sched: ScheduledRequest) -> TransferJob | None:
        request = sched.request
        st = self._requests.get(request.request_id)  # ``_live_state``, its usual case inline
        if st is None or st.finished:
            st = self._live_state(request)
        if len(sched.new_block_ids) != len(self._groups):
            raise ValueError(f"request {request.request_id!r}: new_block_ids has "
                             f"{len(sched.new_block_ids)} groups, expected {len(self._groups)}")
        if st.jobs and any(self._jobs[j].direction is Direction.LOAD for j in st.jobs):
            raise InvariantError(f"request {request.request_id!r} scheduled while its load "
                                 "is in flight; wait for finished_loads")
        if sched.resumed:
            st.reset_table()
        if len(request.block_hashes) != st.hashes_keyed:  # else every key exists already
            self._lookups.refresh_keys(st)
        for gs, ids in zip(st.groups, sched.new_block_ids, strict=True):
            if ids:
                gs.block_ids.extend(ids)
                self._jobs.allocated(ids)
        freed = sched.num_freed_blocks
        if freed is not None:
            for gs, n in zip(st.groups, freed, strict=True):
                gs.num_freed = max(gs.num_freed, n)
        offloadable = sched.offloadable
        if self._stores.step_end_states:
            # A Mamba state exists only where a step ends or the engine checkpoints
            # (module docstring of state.py).
            alignment = self._alignment
            st.state_ends.update(end for end in (offloadable, *sched.state_ends)
                                 if 0 < end <= offloadable and end % alignment == 0)
        planned = self._stores.plan(st, st.controls.store_end(offloadable))
        if planned is None:
            return None
        rid = request.request_id
        job_id = self._jobs.issue(lambda job_id: JobState(
            job_id, rid, Direction.STORE, planned.keys, planned.windowed_block_ids,
            planned.other_block_ids)).job_id
        self._jobs.fence.add(job_id, planned.windowed_block_ids)
        st.jobs.add(job_id)
        self.stats.store_jobs += 1
        return TransferJob(job_id, Direction.STORE, rid, planned.transfers)

    # ------------------------------------------------------------- completion

    def update_from_worker_reports(self, reports: Sequence[WorkerReport]) -> ReportOutcome:
        """Count reports per job and rank; finish jobs every worker has reported.

        A report for a job from before ``reset_cache`` is ignored; a second report of a
        job by the same rank is ignored and counted; a report for a job id never issued
        raises ``InvariantError``. The reports' tier-job parts go to the tier
        (``Tier.update_from_tier_reports``), which keeps the same rules.
        """
        early = self._jobs.take_outcomes()
        finished = list(early.finished_loads)
        failures = list(early.failed_loads)
        released = list(early.released_loads)
        failed_stores = 0
        duplicates = self.stats.duplicate_reports
        for report in reports:
            self._jobs.ledger.check_rank(report.rank)
            for failed, ids in ((False, report.finished), (True, report.failed)):
                for job_id in ids:
                    js = self._jobs.ledger.count(job_id, report.rank, failed)
                    if js is None:
                        continue
                    if self._finish_job(js):
                        released.append(js.job_id)
                    elif js.direction is Direction.LOAD:
                        finished.append(js.request_id)
                        if js.failed:
                            failures.append(LoadFailure(js.request_id, js.num_local_tokens))
                    elif js.failed:
                        failed_stores += 1
        if self.stats.duplicate_reports > duplicates:
            # Only a faulty worker reports a job twice: ignored, but never silently.
            logger.warning("ignored %d duplicate job reports (a worker reported a job it "
                           "had reported already)", self.stats.duplicate_reports - duplicates)
        self.tier.update_from_tier_reports(reports)
        self.stats.failed_loads += len(failures)
        for failure in failures:
            refused = self._requests.get(failure.request_id)
            if refused is not None:
                refused.refuses_loads = True
        self.stats.failed_stores += failed_stores
        return ReportOutcome(tuple(finished), tuple(failures), failed_stores,
                             tuple(released))

    def _finish_job(self, js: JobState) -> bool:
        """Retire a job every rank reported; True if it was an abandoned load."""
        if self._jobs.retire(js):
            return True
        st = self._requests[js.request_id]
        st.jobs.discard(js.job_id)
        if st.finished and not st.jobs:
            del self._requests[js.request_id]
        return False

    def set_controls(self, request: RequestInfo, controls: RequestControls) -> None:
        """Apply the request's own limits and hints (``RequestControls``) from now on.

        Call it before the request's first lookup, so that nothing beyond the caps is
        stored or loaded and its session id is seen there; a later call applies to what
        comes after it. Stores issued before are not undone.
        """
        st = self._live_state(request)
        st.controls = controls

    def refuse_loads(self, request: RequestInfo) -> None:
        """Offer the request no load again (the engine found a load's bytes wrong); the
        planner does this itself for loads that fail or are abandoned."""
        st = self._requests.get(request.request_id)
        if st is not None:
            st.refuses_loads = True

    def abandon_load(self, request: RequestInfo) -> JobId | None:
        """The engine gives up waiting for the request's load; return the load's job id.

        A transfer in flight cannot be cancelled: the job keeps its keys pinned and its
        engine blocks fenced until every worker reports it, and then appears in
        ``ReportOutcome.released_loads`` (never in ``finished_loads``). Until then the
        engine must not hand those blocks to anyone (a late copy would overwrite them);
        the request itself is free to recompute into other blocks, and must not accept
        external tokens again (``update_state_after_alloc`` with 0). Returns None when
        the request has no load in flight.
        """
        st = self._requests.get(request.request_id)
        if st is None:
            return None
        st.refuses_loads = True
        loads = [j for j in st.jobs if self._jobs[j].direction is Direction.LOAD]
        if not loads:
            return None
        job_id = loads[0]
        js = self._jobs[job_id]
        st.jobs.discard(job_id)
        self._jobs.abandon(js)
        if st.finished and not st.jobs:
            del self._requests[request.request_id]
        return job_id

    def job_block_ids(self, job_id: JobId) -> tuple[int, ...]:
        """The engine blocks job ``job_id`` (in flight) reads or writes."""
        js = self._jobs[job_id]
        return js.windowed_block_ids + js.other_block_ids

    # ------------------------------------------------------------ lifecycle

    def request_finished(self, request: RequestInfo,
                         blocks_per_group: Sequence[Sequence[int]] | None = None) -> None:
        """The request ended (finished or aborted); the engine may free its blocks now.

        Blocks that in-flight jobs still use are fenced: allocating them again makes the
        next plan flush those jobs first. ``blocks_per_group`` is accepted for engines
        that pass it; the planner already knows every block its jobs use.
        """
        del blocks_per_group
        st = self._requests.get(request.request_id)
        if st is None:
            return
        st.finished = True
        st.planned = None
        # Refresh the whole prefix once, at the end: early blocks end most recent (they
        # serve the most future hits). Stores insert their keys as most recent already;
        # touching the whole prefix on every store would cost O(context) per block. What
        # the store policy keeps apart (stored cold, passed resume points) stays so.
        self._lookups.touch(st, self._policy.touch_skip(st, finishing=True))
        self._policy.finished(st)
        if not st.jobs:
            del self._requests[request.request_id]
            return
        for job_id in st.jobs:
            self._jobs.fence_all(self._jobs[job_id])

    def take_events(self) -> list[TierEvent]:
        """Cache events (blocks stored or removed) since the last call, for routers."""
        return self.tier.take_events()

    def reset_cache(self) -> None:
        """Drop everything offloaded. In-flight jobs are flushed in the next plan,
        their late reports ignored; loads in flight are reported failed (recompute)."""
        self._jobs.reset()
        self.tier.reset()
        for rid in [r for r, st in self._requests.items() if st.finished]:
            del self._requests[rid]
        for st in self._requests.values():
            st.jobs.clear()
            st.planned = None
            st.store_due = 0
            for gs in st.groups:
                gs.next_stored = 0
        self._policy.reset(list(self._requests.values()))

    def shutdown(self) -> None:
        """Forget every request; the tier keeps its contents until reset."""
        self._requests.clear()

    # ------------------------------------------------------------ inspection

    def has_pending_work(self) -> bool:
        """Jobs in flight or not yet handed to the workers."""
        return self._jobs.has_pending_work() or self.tier.has_pending_work()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def jobs_fencing(self, block_ids: Sequence[int]) -> set[JobId]:
        """The in-flight jobs that still use any of ``block_ids``."""
        return self._jobs.fence.jobs_using(block_ids)

    @property
    def fence_size(self) -> int:
        return len(self._jobs.fence)

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` if the planner's bookkeeping is inconsistent."""
        self._jobs.check_integrity(self._requests)
        self.tier.check_integrity()

    # --------------------------------------------------------------- helpers

    def _live_state(self, request: RequestInfo) -> RequestState:
        """The request's state, created the first time the planner sees it.

        A request that already finished raises ``ValueError``: its id came back (a new
        request reusing it, or a call after ``request_finished``), and ids must be unique.
        """
        st = self._requests.get(request.request_id)
        if st is None:
            st = self._requests[request.request_id] = RequestState(
                request, [GroupState() for _ in self._groups])
        elif st.finished:
            raise ValueError(f"request {request.request_id!r} already finished; "
                             "request ids must be unique")
        return st

