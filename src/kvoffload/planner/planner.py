"""The planner: kvoffload's scheduler side (SYSTEM.md sections 2, 4 and 5).

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
  (and, when set, ``min_deferral_s`` seconds, whichever comes later).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import cast

from kvoffload.completion import count_rank_report
from kvoffload.config import GroupKind, OffloadConfig, ResolvedGroup
from kvoffload.errors import InvariantError
from kvoffload.jobs import (
    NULL_BLOCK_ID,
    Direction,
    GroupTransfer,
    JobId,
    StepPlan,
    TransferJob,
    WorkerReport,
)
from kvoffload.keys import BlockHash, OffloadKey, key_group, make_offload_key
from kvoffload.metrics import PlannerStats
from kvoffload.planner.admission import (
    VALUE_AWARE_POLICIES,
    Admit,
    make_admission,
    window_at,
)
from kvoffload.planner.contract import (
    LoadFailure,
    MatchResult,
    ReportOutcome,
    RequestInfo,
    ScheduledRequest,
    StepInput,
)
from kvoffload.planner.fence import Fence
from kvoffload.planner.insertion import InsertionDuel, is_hot_request
from kvoffload.planner.lookup import BlockReadable, GroupView, combined_hit_end, lookup_order
from kvoffload.planner.state import GroupState, JobState, PlannedLoad, RequestState
from kvoffload.planner.value import PrefillFlops, PrefixValuer
from kvoffload.tiers.base import LookupResult, Tier, TierEvent, TierHints

logger = logging.getLogger(__name__)

CHECKPOINT_SHARE = 0.1
"""A prefill's passed resume point stays (is not demoted) when its window blocks and
state charge at most this share of the full-attention blocks the request stored since
its last kept point (or its first hit): a cheap checkpoint where a later request may
branch off. On the shared trace that keeps every resume point of gpt-oss-20b (a window
is one block) and one every ~53k tokens on Gemma 3 (a window is 4 blocks of 52 layers)."""


class Planner:
    """Engine-neutral scheduler side of kvoffload. See the module docstring."""

    def __init__(self, config: OffloadConfig, tier: Tier, *,
                 prefill_flops: PrefillFlops | None = None) -> None:
        """``prefill_flops(end, start)``: the model's prefill cost of tokens ``[start,
        end)``, for value-aware policies (a layout-based estimate if not given)."""
        self.config = config
        self.tier = tier
        self.stats = PlannerStats()
        self._groups = config.resolved
        self._order = lookup_order(self._groups)
        self._alignment = config.hit_alignment
        self._all_ranks = (1 << config.num_workers) - 1
        self._requests: dict[str, RequestState] = {}
        self._jobs: dict[JobId, JobState] = {}
        self._next_job = 0
        self._stale_below = 0
        self._fence = Fence()
        self._flush: set[JobId] = set()
        self._loads: list[TransferJob] = []
        self._early_finished: list[str] = []
        self._early_failed: list[LoadFailure] = []
        self._abandoned: set[JobId] = set()
        self._early_released: list[JobId] = []
        self._admission = make_admission(config.eviction_policy, config.hash_block_size,
                                         self._alignment, self._tier_has_room)
        self._full_views = [g for g in self._order if g.window_blocks is None]
        self._learns_points = (self._admission.learns
                               and 0 < len(self._full_views) < len(self._order))
        """Whether admission learns hit points (a hybrid layout under selective admission)."""
        self._valuer = (PrefixValuer(config, prefill_flops)
                        if config.eviction_policy in VALUE_AWARE_POLICIES else None)
        self._charge = [g.block_bytes if config.charges_bytes else 1 for g in self._groups]
        self._insertion = self._new_insertion()
        self._key_suffix = [make_offload_key(BlockHash(b""), g.index) for g in self._groups]
        self._step_end_states = (not config.mamba_states_every_block
                                 and any(g.kind is GroupKind.MAMBA for g in self._groups))
        self._point_charge = sum(self._charge[g.index] * (g.window_blocks or 1)
                                 for g in self._groups if g.window_blocks is not None)
        """What the window blocks and state of one hit point charge, all groups."""
        self._full_charge_per_token = sum(self._charge[g.index] / g.offloaded_block_size
                                          for g in self._groups if g.window_blocks is None)

    def _new_insertion(self) -> InsertionDuel | None:
        """A fresh insertion duel at the tier's budget (value-aware policies only)."""
        if self._valuer is None or not self._full_views:
            return None
        config = self.config
        return InsertionDuel(config.host_capacity_bytes if config.charges_bytes
                             else config.num_host_slots, self._full_views[0].offloaded_block_size)

    @property
    def insertion(self) -> InsertionDuel | None:
        """The duel between LRU and bimodal insertion (value-aware policies only)."""
        return self._insertion

    # ------------------------------------------------------------------ lookup

    def get_num_new_matched_tokens(self, request: RequestInfo,
                                   num_computed_tokens: int) -> MatchResult:
        """Tokens the tier can provide beyond the engine's own prefix hit.

        Returns ``MatchResult(None)`` ("ask again next step") while a block the hit needs
        is still being written, or while the request still has jobs in flight (e.g. stores
        of a preempted request); after ``max_deferred_steps`` such answers in a row it
        answers with what is readable now. Touches the blocks a future hit may need.
        """
        st = self._requests.get(request.request_id)
        if st is None:
            st = self._new_state(request)
        elif st.finished:
            raise ValueError(f"request {request.request_id!r} already finished; "
                             "request ids must be unique")
        st.planned = None
        self.stats.lookups += 1
        if st.jobs:
            return self._defer_or(st, 0)
        st.reset_table()
        self._refresh_keys(st)
        st.num_local_tokens = num_computed_tokens
        end, deferred = self._lookup(st, num_computed_tokens)
        if deferred:
            result = self._defer_or(st, end - num_computed_tokens)
            if result.is_deferred:
                return result
        st.deferred_steps = 0
        hits = end - num_computed_tokens
        first = not st.looked_up
        if first:
            st.looked_up = True
            st.first_hit_tokens = end
            for g, gs in zip(self._groups, st.groups, strict=True):
                gs.num_hit_blocks = end // g.offloaded_block_size
        duel = self._insertion
        if duel is not None and first:
            full = self._full_views[0]
            duel.observe_lookup(st.groups[full.index].keys,
                                num_computed_tokens // full.offloaded_block_size, hits)
            st.cold_candidate = not is_hot_request(request.request_id)
            st.stores_cold = st.cold_candidate and duel.bimodal_ahead
        self._touch(st, frozenset(st.passed_keys))
        if hits > 0:
            st.planned = PlannedLoad(num_computed_tokens, end)
            self.stats.lookup_hit_tokens += hits
        return MatchResult(hits, load_async=hits > 0)

    def _defer_or(self, st: RequestState, fallback: int) -> MatchResult:
        """Defer this lookup, unless the request has waited long enough already: for
        ``max_deferred_steps`` answers and (``min_deferral_s``) that many seconds."""
        now = time.monotonic()
        if st.deferred_steps == 0:
            st.deferred_since = now
        if (st.deferred_steps < self.config.max_deferred_steps
                or now - st.deferred_since < self.config.min_deferral_s):
            st.deferred_steps += 1
            self.stats.deferred_lookups += 1
            return MatchResult(None)
        self.stats.deferral_timeouts += 1
        st.deferred_steps = 0
        if st.jobs:
            return MatchResult(0)
        return MatchResult(fallback, load_async=fallback > 0)

    def _lookup(self, st: RequestState, num_computed: int) -> tuple[int, bool]:
        """(hit end with what is readable now, whether waiting could give more)."""
        request = st.request
        max_end = request.num_tokens - (1 if self.config.has_windowed_group else 0)
        tier_lookup = self.tier.lookup
        hit, miss, pending = LookupResult.HIT, LookupResult.MISS, LookupResult.PENDING
        # Each (group, block) is asked of the tier at most once per lookup, whatever the
        # fixpoint re-checks; one closure per group keeps the per-block cost to one call.
        seen: list[dict[int, LookupResult]] = [{} for _ in self._groups]
        saw_pending = False

        def readable(keys: list[OffloadKey], cache: dict[int, LookupResult],
                     accept_pending: bool) -> BlockReadable:
            def status(i: int) -> LookupResult:
                nonlocal saw_pending
                found = cache.get(i)
                if found is None:
                    found = cache[i] = tier_lookup(keys[i])
                    if found is pending:
                        saw_pending = True
                return found

            if accept_pending:
                return lambda i: (cache.get(i) or status(i)) is not miss
            return lambda i: (cache.get(i) or status(i)) is hit

        def views(accept_pending: bool) -> list[GroupView]:
            return [GroupView(g, len(st.groups[g.index].keys),
                              readable(st.groups[g.index].keys, seen[g.index], accept_pending))
                    for g in self._order]

        end = combined_hit_end(views(False), num_computed, max_end, self._alignment)
        once_landed = views(True)
        full_end = 0
        if self._learns_points:
            # Learn from where the prefix reaches once the stores in flight land: a lookup
            # that is deferred and asked again must tell the admission what the answer does.
            # (Before ``hopeful``: probing the full-attention prefix may find stores pending.)
            full_only = [v for v in once_landed if v.group.window_blocks is None]
            full_end = combined_hit_end(full_only, num_computed, max_end, self._alignment)
        hopeful = (combined_hit_end(once_landed, num_computed, max_end, self._alignment)
                   if saw_pending else end)
        if self._learns_points:
            self._admission.observe_lookup(full_end, hopeful, request.block_hashes)
            if full_end > hopeful:
                self._admission.learn_miss(request.block_hashes, full_end)
        if not saw_pending:
            return end, False
        if hopeful > end:
            self.tier.hint(TierHints(prefetch=tuple(self._hit_keys(st, num_computed, hopeful))))
        return end, hopeful > end

    def _hit_keys(self, st: RequestState, start: int, end: int) -> list[OffloadKey]:
        """Keys a load of tokens ``[start, end)`` reads: every block of a full-attention
        group, the last window of a window group, the state at ``end`` of a Mamba group."""
        keys: list[OffloadKey] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            last = end // g.offloaded_block_size
            first = start // g.offloaded_block_size
            if g.window_blocks is not None:
                first = max(first, last - g.window_blocks)
            keys.extend(gs.keys[first:last])
        return keys

    def _touch(self, st: RequestState, skip: AbstractSet[OffloadKey] = frozenset()) -> None:
        """Keep warm what a future hit on this request's prefix needs (SYSTEM.md 2.4).

        Full attention: every key. Window and Mamba groups: the keys from the last W
        blocks of the first hit on -- of those, only blocks that some aligned hit can use:
        the others are never stored (``_useful_blocks``), so touching them would only
        cost time (for a 16-block alignment, 15 of every 16 Mamba keys). Keys in ``skip``
        are left as they are.
        """
        keys: list[OffloadKey] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            if g.window_blocks is None:
                keys.extend(gs.keys)
                continue
            blocks = self._useful_blocks(g, max(0, gs.num_hit_blocks - g.window_blocks),
                                         len(gs.keys))
            keys.extend(gs.keys[blocks.start:blocks.stop:blocks.step]
                        if isinstance(blocks, range) else [gs.keys[k] for k in blocks])
        if skip:
            keys = [key for key in keys if key not in skip]
        self.tier.touch(keys)

    # ------------------------------------------------------------------- loads

    def update_state_after_alloc(self, request: RequestInfo,
                                 blocks_per_group: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        """Record the request's block table and plan its load, if the engine took one.

        ``blocks_per_group`` is the request's whole block table per group (0 = null).
        ``num_external_tokens`` is what the engine accepted from the last lookup: that
        number exactly, or 0. Every allocated block is checked against the fence.
        """
        st = self._requests.get(request.request_id)
        if st is None:
            raise ValueError(f"request {request.request_id!r} was never looked up; call "
                             "get_num_new_matched_tokens first")
        if len(blocks_per_group) != len(self._groups):
            raise ValueError(f"got block lists for {len(blocks_per_group)} groups, the "
                             f"configuration has {len(self._groups)}")
        for ids in blocks_per_group:
            self._flush |= self._fence.jobs_using(ids)
        planned, st.planned = st.planned, None
        if num_external_tokens == 0:
            return
        if planned is None or planned.end - planned.num_local_tokens != num_external_tokens:
            offered = 0 if planned is None else planned.end - planned.num_local_tokens
            raise ValueError(f"request {request.request_id!r}: engine accepted "
                             f"{num_external_tokens} external tokens, the last lookup offered "
                             f"{offered}; pass exactly that number or 0")
        if st.jobs:
            raise InvariantError(f"request {request.request_id!r} has jobs in flight; "
                                 "a load needs none")
        self._plan_load(st, planned, blocks_per_group)

    def _plan_load(self, st: RequestState, planned: PlannedLoad,
                   tables: Sequence[Sequence[int]]) -> None:
        rid = st.request.request_id
        transfers: list[GroupTransfer] = []
        keys: list[OffloadKey] = []
        key_groups: list[tuple[int, int]] = []  # (index into transfers, number of keys)
        for g, gs, table in zip(self._groups, st.groups, tables, strict=True):
            positions = self._load_positions(g, table, planned)
            if not positions:
                continue
            f = g.factor
            first_block, last_block = positions[0] // f, positions[-1] // f
            group_keys = gs.keys[first_block:last_block + 1]
            keys.extend(group_keys)
            key_groups.append((len(transfers), len(group_keys)))
            transfers.append(GroupTransfer(g.index, tuple(table[p] for p in positions),
                                           positions[0], ()))
        if any(self.tier.lookup(k) is not LookupResult.HIT for k in keys):
            # Evicted between lookup and allocation: the engine recomputes instead.
            self._early_finished.append(rid)
            self._early_failed.append(LoadFailure(rid, planned.num_local_tokens))
            return
        if not keys:
            self._early_finished.append(rid)
            return
        slots = self.tier.prepare_load(keys).slots
        for g, gs in zip(self._groups, st.groups, strict=True):
            gs.next_stored = max(gs.next_stored, planned.end // g.offloaded_block_size)
        for t in transfers:
            self.stats.add_blocks(self.stats.blocks_loaded, t.group, len(t.block_ids))
        filled: list[GroupTransfer] = []
        cursor = 0
        for index, count in key_groups:
            t = transfers[index]
            filled.append(GroupTransfer(t.group, t.block_ids, t.first_block_index,
                                        slots[cursor:cursor + count]))
            cursor += count
        job_id = self._new_job_id()
        dests = tuple(b for t in filled for b in t.block_ids)
        self._jobs[job_id] = JobState(job_id, rid, Direction.LOAD, tuple(keys), (), dests,
                                      num_local_tokens=planned.num_local_tokens)
        st.jobs.add(job_id)
        self._flush |= self._fence.jobs_using(dests)
        self._loads.append(TransferJob(job_id, Direction.LOAD, rid, tuple(filled)))
        self.stats.load_jobs += 1

    @staticmethod
    def _load_positions(g: ResolvedGroup, ids: Sequence[int], planned: PlannedLoad) -> list[int]:
        """Engine block positions of group ``g`` the hit needs that the engine lacks."""
        bs = g.spec.block_size
        end_pos = planned.end // bs
        first = planned.num_local_tokens // bs
        if g.kind is GroupKind.MAMBA:
            first = max(first, end_pos - 1)
        elif g.kind is GroupKind.SLIDING_WINDOW:
            assert g.spec.sliding_window is not None
            first = max(first, (planned.end - g.spec.sliding_window) // bs)
        if len(ids) < end_pos:
            raise InvariantError(f"group {g.index}: block table has {len(ids)} blocks, the "
                                 f"load needs {end_pos}")
        positions = [p for p in range(first, end_pos) if ids[p] != NULL_BLOCK_ID]
        if g.kind is not GroupKind.SLIDING_WINDOW and len(positions) != end_pos - first:
            raise InvariantError(f"group {g.index} ({g.kind.value}): null block where the "
                                 "load must write; allocate a block for every needed position")
        if positions and positions[-1] - positions[0] + 1 != len(positions):
            raise InvariantError(f"group {g.index}: null blocks inside the loaded range")
        return positions

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
            self._flush |= st.jobs
            st.reset_table()
            if self._insertion is not None:
                # It reloads its prefix when it resumes: cold blocks of it (whoever stored
                # them) become normal after all.
                keys = [key for gs in st.groups for key in gs.keys]
                self.tier.hint(TierHints(warm=tuple(keys)))
                self._insertion.observe_preempt(keys)
                st.cold_keys = []
        stores: list[TransferJob] = []
        for sched in step.scheduled:
            job = self._schedule_request(sched)
            if job is not None:
                stores.append(job)
        if step.other_allocations:
            self._flush |= self._fence.jobs_using(step.other_allocations)
        tier_work = self.tier.take_tier_work()  # after the stores: it sees their evictions
        # A store created in this step reads only blocks its running request still holds
        # (freed positions are never stored), so none of them can be handed out afresh
        # this step: a fence hit on it is another request adopting a shared prefix block,
        # which reads it. Flushing such a store would run it before the forward pass
        # writes its blocks.
        self._flush.difference_update(job.job_id for job in stores)
        plan = StepPlan(flush=tuple(sorted(self._flush)), stores=tuple(stores),
                        loads=tuple(self._loads), tier_flush=tier_work.flush,
                        tier_jobs=tier_work.jobs)
        self._flush = set()
        self._loads = []
        return plan

    def _schedule_request(self, sched: ScheduledRequest) -> TransferJob | None:
        request = sched.request
        st = self._requests.get(request.request_id)
        if st is None:
            st = self._new_state(request)
        elif st.finished:
            raise ValueError(f"request {request.request_id!r} already finished; "
                             "request ids must be unique")
        if len(sched.new_block_ids) != len(self._groups):
            raise ValueError(f"request {request.request_id!r}: new_block_ids has "
                             f"{len(sched.new_block_ids)} groups, expected {len(self._groups)}")
        if st.jobs and any(self._jobs[j].direction is Direction.LOAD for j in st.jobs):
            raise InvariantError(f"request {request.request_id!r} scheduled while its load "
                                 "is in flight; wait for finished_loads")
        if sched.resumed:
            st.reset_table()
        self._refresh_keys(st)
        for gs, ids in zip(st.groups, sched.new_block_ids, strict=True):
            if ids:
                gs.block_ids.extend(ids)
                self._flush |= self._fence.jobs_using(ids)
        freed = sched.num_freed_blocks
        if freed is not None:
            for gs, n in zip(st.groups, freed, strict=True):
                gs.num_freed = max(gs.num_freed, n)
        offloadable = min(sched.num_computed_tokens + sched.num_scheduled_tokens,
                          request.num_tokens)
        if self._step_end_states and offloadable % self._alignment == 0 and offloadable:
            # A Mamba state exists only where a step ends (module docstring of state.py).
            st.state_ends.add(offloadable)
        return self._plan_store(st, offloadable)

    def _plan_store(self, st: RequestState, offloadable: int) -> TransferJob | None:
        """A store job for the request's newly complete blocks, or None.

        Store progress advances only when the blocks were stored, found present or
        skipped; a failed ``prepare_store`` leaves it in place to retry next step.
        """
        limits = [min(offloadable // g.offloaded_block_size, len(gs.keys),
                      len(gs.block_ids) // g.factor)
                  for g, gs in zip(self._groups, st.groups, strict=True)]
        if all(limit <= gs.next_stored for limit, gs in zip(limits, st.groups, strict=True)):
            return None  # no block completed since the last store (the common decode step)
        candidates: list[list[tuple[int, list[int]]]] = []
        keys: list[OffloadKey] = []
        request = st.request
        resume = self._admission.resume_point(offloadable, request.num_prompt_tokens)
        if resume and self._step_end_states and resume not in st.state_ends:
            resume = 0  # no Mamba state there: the last resume point stays the one
        provisional: list[tuple[int, int, OffloadKey]] = []
        spare: list[OffloadKey] = []
        for g, gs, limit in zip(self._groups, st.groups, limits, strict=True):
            entries = []
            first = gs.next_stored
            f = g.factor
            if (g.kind is GroupKind.FULL_ATTENTION and first < limit and gs.num_freed <= first * f
                    and NULL_BLOCK_ID not in gs.block_ids[first * f:limit * f]):
                # Every block live (the usual case): what _store_positions would say,
                # without a call per block.
                entries = [(k, list(range(k * f, (k + 1) * f))) for k in range(first, limit)]
                keys.extend(gs.keys[first:limit])
                candidates.append(entries)
                continue
            blocks = (range(first, limit) if g.window_blocks is None
                      else self._useful_blocks(g, first, limit))
            for k in blocks:
                positions = self._store_positions(g, gs, k, st.state_ends)
                if not positions:
                    continue
                verdict = Admit.YES if g.window_blocks is None else self._admission.admit(
                    g, k, request.block_hashes, request.num_prompt_tokens)
                if verdict is Admit.YES:
                    pass
                elif resume and self._admission.admit_for_resume(g, k, resume):
                    provisional.append((g.index, k, gs.keys[k]))
                elif verdict is Admit.SPARE_ROOM:
                    spare.append(gs.keys[k])
                else:
                    continue
                entries.append((k, positions))
                keys.append(gs.keys[k])
            candidates.append(entries)
        if not keys:
            self._advance(st, limits)
            return None
        result = self.tier.prepare_store(keys)
        if result is None:
            self.stats.store_retries += 1
            return None
        self._advance(st, limits)
        if resume and not self._holds_window(st, resume):
            resume = 0  # a block of its window (or its state) was never stored: keep the last
        self._track_resume_point(st, resume, provisional, result.keys_to_store)
        resume_keys = frozenset(key for _, _, key in provisional)
        if self._insertion is not None:
            charge = self._charge
            self._insertion.observe_store([(key, charge[key_group(key)]) for key in keys],
                                          st.cold_candidate, normal=resume_keys)
        if st.stores_cold:
            self._store_cold(st, result.keys_to_store, resume_keys)
        if spare:
            fresh = set(result.keys_to_store)
            st.spare_keys.extend(key for key in spare if key in fresh)
        if not result.keys_to_store:
            return None
        slot_of = dict(zip(result.keys_to_store, result.slots, strict=True))
        transfers: list[GroupTransfer] = []
        windowed_ids: list[int] = []
        other_ids: list[int] = []
        valued: list[list[tuple[int, OffloadKey]]] = []
        for g, gs, entries in zip(self._groups, st.groups, candidates, strict=True):
            chosen = [(k, p) for k, p in entries if gs.keys[k] in slot_of]
            if self._valuer is not None:
                valued.append([(k, gs.keys[k]) for k, _ in chosen])
            if not chosen:
                continue
            self.stats.add_blocks(self.stats.blocks_stored, g.index, len(chosen))
            group_transfers = self._group_store_transfers(g, gs, chosen, slot_of)
            transfers.extend(group_transfers)
            ids = [b for t in group_transfers for b in t.block_ids]
            (windowed_ids if g.is_windowed else other_ids).extend(ids)
        if self._valuer is not None:
            frontier = max(limit * g.offloaded_block_size
                           for g, limit in zip(self._groups, limits, strict=True))
            self.tier.hint(TierHints(values=tuple(self._valuer.hints(
                frontier, valued, [gs.keys for gs in st.groups], self._reuse(st)))))
        job_id = self._new_job_id()
        rid = st.request.request_id
        self._jobs[job_id] = JobState(job_id, rid, Direction.STORE, result.keys_to_store,
                                      tuple(windowed_ids), tuple(other_ids))
        self._fence.add(job_id, windowed_ids)
        st.jobs.add(job_id)
        self.stats.store_jobs += 1
        return TransferJob(job_id, Direction.STORE, rid, tuple(transfers))

    def _store_cold(self, st: RequestState, stored: Sequence[OffloadKey],
                    provisional: AbstractSet[OffloadKey]) -> None:
        """Bimodal insertion: the newly stored keys go in cold, except the window and state
        blocks stored only for the resume point (``provisional``: a preemption reloads
        them)."""
        cold = [key for key in stored if key not in provisional]
        st.cold_keys.extend(cold)
        self.stats.cold_stored_keys += self.tier.hint(TierHints(cool=tuple(cold)))

    def _demote(self, keys: list[OffloadKey]) -> None:
        """Tell the tier (and the insertion duel's directories) that no likely hit uses
        ``keys``."""
        self.tier.hint(TierHints(demote=tuple(keys)))
        if self._insertion is not None:
            self._insertion.observe_demote(keys)

    def _track_resume_point(self, st: RequestState, point: int,
                           provisional: list[tuple[int, int, OffloadKey]],
                           stored: Sequence[OffloadKey]) -> None:
        """Record the blocks stored only for a resume at ``point``; when the prefill moved
        past the previous resume point, demote that point's blocks that ``point`` does not
        need itself (admission's resume points), unless it is a cheap checkpoint
        (``CHECKPOINT_SHARE``) or ``_keeps_resume_point``."""
        if point > st.resume_point:
            still: list[tuple[int, int, OffloadKey]] = []
            if st.resume_keys and self._cheap_checkpoint(st):
                st.kept_point = st.resume_point  # its blocks stay as stored
            elif st.resume_keys and not self._keeps_resume_point(st, point):
                passed: list[OffloadKey] = []
                for entry in st.resume_keys:
                    group, block, key = entry
                    if block in window_at(self._groups[group], point):
                        still.append(entry)
                    else:
                        passed.append(key)
                self._demote(passed)
                st.passed_keys.extend(passed)
            st.resume_keys = still
            st.resume_point = point
        if provisional:
            fresh = set(stored)
            st.resume_keys.extend(entry for entry in provisional if entry[2] in fresh)

    def _cheap_checkpoint(self, st: RequestState) -> bool:
        """Whether the blocks of the request's resume point charge at most
        ``CHECKPOINT_SHARE`` of the full-attention blocks it stored since its last kept
        point (or its first hit)."""
        since = max(st.kept_point, st.first_hit_tokens)
        full = (st.resume_point - since) * self._full_charge_per_token
        return 0 < self._point_charge <= CHECKPOINT_SHARE * full

    def _holds_window(self, st: RequestState, point: int) -> bool:
        """Whether the tier holds (ready or being written) every window block and state a
        hit at ``point`` reads: else ``point`` cannot be resumed from."""
        tier = self.tier
        return all(gs.keys[k] in tier
                   for g, gs in zip(self._groups, st.groups, strict=True)
                   if g.window_blocks is not None for k in window_at(g, point))

    def _keeps_resume_point(self, st: RequestState, stop: int) -> bool:
        """Whether the blocks of the request's resume point stay (are not demoted) when
        its prefill moves on to ``stop``: in a layout with Mamba groups, a state exists
        only where a step ended, so when a likely hit point lies in ``[resume point,
        stop)``, the resume point is the deepest one a hit there can use."""
        request = st.request
        return self._step_end_states and self._admission.hit_point_between(
            st.resume_point, stop, request.block_hashes, request.num_prompt_tokens)

    @staticmethod
    def _group_store_transfers(g: ResolvedGroup, gs: GroupState,
                               chosen: list[tuple[int, list[int]]],
                               slot_of: dict[OffloadKey, int]) -> list[GroupTransfer]:
        """Transfers for the chosen offloaded blocks of one group.

        One transfer per run of adjacent blocks, so ``first_block_index + i`` names the
        position of each block (blocks already in the tier split a run). Only the first
        block of a run may be partial (nulls are a prefix). A Mamba group stores only the
        last state of each block, one transfer per block.
        """
        ids = gs.block_ids
        if g.kind is GroupKind.MAMBA:
            return [GroupTransfer(g.index, (ids[p[0]],), p[0], (slot_of[gs.keys[k]],))
                    for k, p in chosen]
        runs: list[list[tuple[int, list[int]]]] = []
        for k, positions in chosen:
            if runs and runs[-1][-1][0] == k - 1:
                if len(positions) != g.factor:
                    raise InvariantError(f"group {g.index}: a partial block inside a run")
                runs[-1].append((k, positions))
            else:
                runs.append([(k, positions)])
        return [GroupTransfer(
            g.index,
            tuple(ids[p] for _, positions in run for p in positions),
            run[0][1][0],
            tuple(slot_of[gs.keys[k]] for k, _ in run),
        ) for run in runs]

    def _store_positions(self, g: ResolvedGroup, gs: GroupState, k: int,
                         state_ends: set[int]) -> list[int] | None:
        """Engine positions to store for offloaded block ``k``, or None to skip it.

        Window and Mamba blocks come from ``_useful_blocks`` (so a Mamba block ends at a
        hit alignment point, and some aligned hit's window uses a window block). Skipped:
        blocks that are null or freed, Mamba states that (``mamba_states_every_block`` off)
        no step of the request produced (``state_ends``: a step ending mid-block leaves the
        block holding another state), and partial window blocks whose missing part a hit's
        window would need.
        """
        f = g.factor
        lo, hi = k * f, (k + 1) * f
        ids = gs.block_ids
        obs = g.offloaded_block_size
        if g.kind is GroupKind.MAMBA:
            last = hi - 1  # the state after the block's last token
            if (last < gs.num_freed or ids[last] == NULL_BLOCK_ID
                    or (self._step_end_states and (k + 1) * obs not in state_ends)):
                return None
            return [last]
        live = [p for p in range(max(lo, gs.num_freed), hi) if ids[p] != NULL_BLOCK_ID]
        if g.kind is GroupKind.FULL_ATTENTION:
            if len(live) != f:
                raise InvariantError(f"group {g.index} (full attention): null or freed block "
                                     f"at offloaded block {k}")
            return live
        if not live:
            return None
        assert g.spec.sliding_window is not None
        step = self._alignment // obs
        first_hit_block = (k // step + 1) * step
        if live[0] > lo and (first_hit_block * obs - g.spec.sliding_window
                             < live[0] * g.spec.block_size):
            return None
        return live

    def _useful_blocks(self, g: ResolvedGroup, start: int, stop: int) -> Sequence[int]:
        """Blocks in ``[start, stop)`` of window or Mamba group ``g`` that some aligned hit
        can use: with hits every ``step`` blocks and a window of ``W``, block ``k`` serves
        one iff ``k % step >= step - W``. No other block of the group is ever stored."""
        assert g.window_blocks is not None
        step = self._alignment // g.offloaded_block_size
        width = min(g.window_blocks, step)
        if width == step:
            return range(start, stop)
        if width == 1:
            return range(start + (step - 1 - start % step), stop, step)
        return [k for seg in range(start - start % step, stop, step)
                for k in range(max(start, seg + step - width), min(seg + step, stop))]

    def _advance(self, st: RequestState, limits: list[int]) -> None:
        for gs, limit in zip(st.groups, limits, strict=True):
            gs.next_stored = max(gs.next_stored, limit)
        if st.state_ends:
            done = min(gs.next_stored * g.offloaded_block_size
                       for g, gs in zip(self._groups, st.groups, strict=True)
                       if g.kind is GroupKind.MAMBA)
            st.state_ends = {end for end in st.state_ends if end > done}

    # ------------------------------------------------------------- completion

    def update_from_worker_reports(self, reports: Sequence[WorkerReport]) -> ReportOutcome:
        """Count reports per job and rank; finish jobs every worker has reported.

        A report for a job from before ``reset_cache`` is ignored; a second report of a
        job by the same rank is ignored and counted; a report for a job id never issued
        raises ``InvariantError``. The reports' tier-job parts go to the tier
        (``Tier.update_from_tier_reports``), which keeps the same rules.
        """
        finished = self._early_finished
        failures = self._early_failed
        released = self._early_released
        self._early_finished, self._early_failed, self._early_released = [], [], []
        failed_stores = 0
        duplicates = self.stats.duplicate_reports
        for report in reports:
            if not 0 <= report.rank < self.config.num_workers:
                raise InvariantError(f"report from rank {report.rank}; num_workers is "
                                     f"{self.config.num_workers}")
            for failed, ids in ((False, report.finished), (True, report.failed)):
                for job_id in ids:
                    js = self._count_report(job_id, report.rank, failed)
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
        self.stats.failed_stores += failed_stores
        return ReportOutcome(tuple(finished), tuple(failures), failed_stores,
                             tuple(released))

    def _count_report(self, job_id: JobId, rank: int, failed: bool) -> JobState | None:
        """Record one rank's report; return the job once every rank has reported it."""
        return count_rank_report(self._jobs, job_id, rank, failed, next_id=self._next_job,
                                 stale_below=self._stale_below, all_ranks=self._all_ranks,
                                 counters=self.stats)

    def _finish_job(self, js: JobState) -> bool:
        """Retire a job every rank reported; True if it was an abandoned load."""
        del self._jobs[js.job_id]
        self._fence.remove(js.job_id, js.windowed_block_ids)
        if js.fenced_other:
            self._fence.remove(js.job_id, js.other_block_ids)
        if js.direction is Direction.STORE:
            self.tier.complete_store(js.keys, success=not js.failed)
        else:
            self.tier.complete_load(js.keys)
        if js.job_id in self._abandoned:
            self._abandoned.discard(js.job_id)
            return True
        st = self._requests[js.request_id]
        st.jobs.discard(js.job_id)
        if st.finished and not st.jobs:
            del self._requests[js.request_id]
        return False

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
        loads = [j for j in st.jobs if self._jobs[j].direction is Direction.LOAD]
        if not loads:
            return None
        job_id = loads[0]
        js = self._jobs[job_id]
        st.jobs.discard(job_id)
        self._abandoned.add(job_id)
        self.stats.abandoned_loads += 1
        if not js.fenced_other:
            self._fence.add(job_id, js.other_block_ids)
            js.fenced_other = True
        pending = [job for job in self._loads if job.job_id == job_id]
        if pending:  # never handed to the workers: nothing can write its blocks
            self._loads.remove(pending[0])
            self._finish_job(js)
            self._early_released.append(job_id)
        if st.finished and not st.jobs:
            del self._requests[request.request_id]
        return job_id

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
        # the request stored cold stays cold.
        self._touch(st, frozenset(st.cold_keys).union(st.passed_keys))
        st.cold_keys = []
        st.passed_keys = []
        if self._learns_points:
            self._admission.record_prompt_end(request.block_hashes, request.num_prompt_tokens)
            if request.num_tokens > request.num_prompt_tokens:
                self._admission.record_turn_end(request.block_hashes,
                                                request.num_prompt_tokens, request.num_tokens)
        self._value_finished(st)
        self._demote_finished(st)
        if not st.jobs:
            del self._requests[request.request_id]
            return
        for job_id in st.jobs:
            js = self._jobs[job_id]
            if not js.fenced_other:
                self._fence.add(job_id, js.other_block_ids)
                js.fenced_other = True

    def _value_finished(self, st: RequestState) -> None:
        """Value every key the request stored or reused as its whole prefix."""
        if self._valuer is None:
            return
        frontier = max(min(gs.next_stored, len(gs.keys)) * g.offloaded_block_size
                       for g, gs in zip(self._groups, st.groups, strict=True))
        if frontier <= 0:
            return
        entries: list[list[tuple[int, OffloadKey]]] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            stop = min(gs.next_stored, len(gs.keys))
            blocks = (range(stop) if g.window_blocks is None
                      else self._useful_blocks(g, 0, stop))
            entries.append([(k, gs.keys[k]) for k in blocks])
        self.tier.hint(TierHints(values=tuple(self._valuer.hints(
            frontier, entries, [gs.keys for gs in st.groups], self._reuse(st)))))

    @staticmethod
    def _reuse(st: RequestState) -> float:
        """Share of the request's prompt that was cached when it arrived."""
        prompt = st.request.num_prompt_tokens
        return min(1.0, st.first_hit_tokens / prompt) if prompt > 0 else 0.0

    def _demote_finished(self, st: RequestState) -> None:
        """Tell the tier which of the request's stored blocks no likely hit can use."""
        request = st.request
        worthless: list[OffloadKey] = []
        for g, gs in zip(self._groups, st.groups, strict=True):
            if g.window_blocks is None:
                continue
            blocks = self._admission.demote_on_finish(g, 0, min(gs.next_stored, len(gs.keys)),
                                                      request.num_prompt_tokens,
                                                      request.num_tokens)
            worthless.extend(gs.keys[k] for k in blocks)
        # The last resume point lies at or before the prompt's end point, a likely hit
        # point, so where states exist only at step ends (``_keeps_resume_point``) its
        # state may be the deepest one a hit there can use: kept. Else it is kept only as
        # a cheap checkpoint.
        if not self._step_end_states and not self._cheap_checkpoint(st):
            worthless.extend(entry[2] for entry in st.resume_keys)
        st.resume_keys = []
        # Stored only because the tier had room: first to go once memory is short.
        worthless.extend(st.spare_keys)
        st.spare_keys = []
        if worthless:
            self._demote(worthless)

    def _tier_has_room(self) -> bool:
        return not self.tier.is_full()

    def take_events(self) -> list[TierEvent]:
        """Cache events (blocks stored or removed) since the last call, for routers."""
        return self.tier.take_events()

    def reset_cache(self) -> None:
        """Drop everything offloaded. In-flight jobs are flushed in the next plan,
        their late reports ignored; loads in flight are reported failed (recompute)."""
        for js in self._jobs.values():
            if js.job_id in self._abandoned:
                self._early_released.append(js.job_id)
            elif js.direction is Direction.LOAD:
                self._early_finished.append(js.request_id)
                self._early_failed.append(LoadFailure(js.request_id, js.num_local_tokens))
        self._flush |= set(self._jobs)
        self._loads = []
        self.tier.reset()
        self._admission.forget_cached()
        self._stale_below = self._next_job
        self._jobs.clear()
        self._abandoned.clear()
        self._fence.clear()
        for rid in [r for r, st in self._requests.items() if st.finished]:
            del self._requests[rid]
        for st in self._requests.values():
            st.jobs.clear()
            st.planned = None
            st.resume_point = st.kept_point = 0
            st.resume_keys = []
            st.spare_keys = []
            st.passed_keys = []
            st.cold_keys = []
            for gs in st.groups:
                gs.next_stored = 0
        self._insertion = self._new_insertion()  # its directories modelled what is gone

    def shutdown(self) -> None:
        """Forget every request; the tier keeps its contents until reset."""
        self._requests.clear()

    # ------------------------------------------------------------ inspection

    def has_pending_work(self) -> bool:
        """Jobs in flight or not yet handed to the workers."""
        return bool(self._jobs or self._loads or self._flush or self.tier.has_pending_work())

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def jobs_fencing(self, block_ids: Sequence[int]) -> set[JobId]:
        """The in-flight jobs that still use any of ``block_ids``."""
        return self._fence.jobs_using(block_ids)

    @property
    def fence_size(self) -> int:
        return len(self._fence)

    def check_integrity(self) -> None:
        """Raise ``InvariantError`` if the planner's bookkeeping is inconsistent."""
        stray_abandoned = self._abandoned - self._jobs.keys()
        if stray_abandoned:
            raise InvariantError(f"abandoned loads {sorted(stray_abandoned)} not in flight")
        for job_id, js in self._jobs.items():
            if job_id in self._abandoned:
                if not js.fenced_other:
                    raise InvariantError(f"abandoned load {job_id} not fenced")
                continue
            st = self._requests.get(js.request_id)
            if st is None or job_id not in st.jobs:
                raise InvariantError(f"job {job_id} has no live request holding it")
        for rid, st in self._requests.items():
            missing = st.jobs - self._jobs.keys()
            if missing:
                raise InvariantError(f"request {rid} holds unknown jobs {sorted(missing)}")
            loads = [j for j in st.jobs if self._jobs[j].direction is Direction.LOAD]
            if loads and len(st.jobs) != 1:
                raise InvariantError(f"request {rid} has a load and other jobs in flight")
            if st.finished and not st.jobs:
                raise InvariantError(f"finished request {rid} kept without jobs")
        stray = self._fence.all_jobs() - self._jobs.keys()
        if stray:
            raise InvariantError(f"fence holds finished jobs {sorted(stray)}")
        self.tier.check_integrity()

    # --------------------------------------------------------------- helpers

    def _new_state(self, request: RequestInfo) -> RequestState:
        st = RequestState(request, [GroupState() for _ in self._groups])
        self._requests[request.request_id] = st
        return st

    def _new_job_id(self) -> JobId:
        job_id = JobId(self._next_job)
        self._next_job += 1
        return job_id

    def _refresh_keys(self, st: RequestState) -> None:
        """Append a key for every offloaded block completed since the last call."""
        hashes = st.request.block_hashes
        num_hashes = len(hashes)
        for g, gs, suffix in zip(self._groups, st.groups, self._key_suffix, strict=True):
            hpb = g.hashes_per_block
            keys = gs.keys
            if len(keys) < num_hashes // hpb:
                # hash + suffix is make_offload_key(hash, g.index), minus a call per key.
                first = (len(keys) + 1) * hpb - 1
                keys.extend(cast("list[OffloadKey]",
                                 [hashes[i] + suffix for i in range(first, num_hashes, hpb)]))
