"""The connector's scheduler role: vLLM's scheduler calls mapped onto the ``Planner``.

vLLM's ``Request`` already satisfies the planner's ``RequestInfo`` protocol (request_id,
num_tokens, num_prompt_tokens, and block_hashes at the hash block size). What this module
adds is the mapping of vLLM's per-step ``SchedulerOutput`` onto ``StepInput`` and of the
planner's outcomes back onto vLLM's expectations:

* every scheduled request becomes a ``ScheduledRequest``; new and resumed requests carry
  their whole block table, running ones the blocks appended this step; a running request
  with no new blocks whose step needs nothing of the planner (``Planner.step_is_idle``:
  a decode step inside a block) is left out, so a step costs little per such request;
* for sliding-window and Mamba groups, ``num_freed_blocks`` is read from vLLM's block
  table: the position of the last null block + 1 (vLLM replaces blocks it frees with the
  null block), so the planner never stores from a position whose id may be reused;
* for Mamba groups, the states vLLM leaves at block boundaries inside a step (Mamba2's
  in-chunk prefill checkpoint) are passed on as ``state_ends``, from vLLM's own
  boundary-state hand-off (``mamba_states``), so they are stored like step ends;
* a load is announced to vLLM (``finished_recving``) by the worker that ran it; a load
  that ends without ever reaching a worker (blocks evicted between lookup and
  allocation, or dropped by a cache reset) is announced through ``resolved_loads`` in the
  next metadata instead, so each waiting request is released exactly once;
* a request whose load failed is not offered a load again (the planner answers 0): vLLM
  recomputes it;
* a load that has not ended ``load_deadline_s`` seconds after it was handed to the
  workers is given up (``Planner.abandon_load``): it is announced to vLLM as failed
  through ``resolved_loads`` (vLLM frees the request's blocks and recomputes it into
  others) and named in ``abandoned_loads``, so its late end reaches the planner only. The
  engine blocks the late copy still writes are held out of vLLM's free queue (one
  reference each in vLLM's block pool, ``BlockPool.touch``) until the planner releases
  the job (``ReportOutcome.released_loads``), so vLLM cannot hand them to anyone, and the
  recompute never waits for the copy. (vLLM reuses uncached blocks first: without the
  hold, the recompute would be handed exactly those blocks and its first step would
  have to wait for the late copy, through the planner's fence.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvoffload.config import OffloadConfig
from kvoffload.integrations.vllm.events import to_vllm_events
from kvoffload.integrations.vllm.mamba_states import checkpointed_state_ends
from kvoffload.integrations.vllm.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata
from kvoffload.integrations.vllm.request_params import request_controls
from kvoffload.integrations.vllm.stats import KVOffloadStats, StatsCollector
from kvoffload.jobs import JobId, WorkerReport
from kvoffload.offload import build_offload
from kvoffload.planner.contract import NO_CONTROLS, ReportOutcome, ScheduledRequest, StepInput
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import TierConfig

logger = logging.getLogger(__name__)


class SchedulerSide:
    """The scheduler half of the connector (see the module docstring)."""

    def __init__(self, config: OffloadConfig, *, enable_events: bool = False,
                 tiers: TierConfig | None = None, load_deadline_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Args:
            config: the offload configuration the workers share.
            enable_events: publish KV-cache events for what the tiers hold.
            tiers: lower tiers (disk, remote) behind host memory; None: host only.
            load_deadline_s: seconds a load may run before it is given up; None: never.
            clock: the time source of the load deadline and of the planner's
                deferral bounds (``Planner``'s ``clock``).
        """
        self.config = config
        offload = build_offload(config, tiers, enable_events=enable_events, clock=clock)
        self.tier = offload.tier
        self.planner = offload.planner
        self.enable_events = enable_events
        self._requests: dict[str, Any] = {}
        self._num_groups = len(config.resolved)
        self._windowed = tuple(g.index for g in config.resolved if g.is_windowed)
        self._mamba_groups = tuple((g.index, g.spec.block_size) for g in config.resolved
                                   if g.rules.holds_state)
        self._empty_ids: tuple[tuple[int, ...], ...] = ((),) * self._num_groups
        self._managers: Sequence[Any] | None = None
        self._block_pool: Any = None
        self._held_blocks: dict[JobId, list[Any]] = {}
        """vLLM blocks kept out of its free queue while a given-up load still writes them."""
        self._loads_at_workers: set[str] = set()
        self._resolved: list[tuple[str, bool]] = []
        self._load_deadline_s = load_deadline_s
        self._clock = clock
        self._load_started: dict[str, float] = {}
        """Request id -> when its load went to the workers (loads in flight only)."""
        self.num_abandoned_loads = 0
        """Loads given up at their deadline so far."""
        self.num_preempted = 0
        """Requests vLLM preempted so far (each preemption counts)."""
        self._stats = StatsCollector()

    def bind_kv_cache_manager(self, manager: Any) -> None:
        """Keep vLLM's per-group block managers, to read freed (null) positions."""
        self._managers = manager.coordinator.single_type_managers
        self._block_pool = manager.block_pool

    # -- lookup and allocation -----------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        """Remember vLLM's request object (scheduler outputs name requests by id only) and
        apply its ``kv_transfer_params`` controls (``request_params``). Params that are
        not a mapping are read as empty (with a warning) and replaced by None on the
        request: vLLM's scheduler reads them after this hook and would raise on them."""
        self._requests[request.request_id] = request
        params = getattr(request, "kv_transfer_params", None)
        controls = request_controls(request.request_id, params)
        if params is not None and not isinstance(params, Mapping):
            request.kv_transfer_params = None
        if controls is not NO_CONTROLS:
            self.planner.set_controls(request, controls)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int,
                                   ) -> tuple[int | None, bool]:
        """The planner's answer (0 for a request whose load failed or was abandoned: vLLM
        recomputes it, and offering the same blocks again could fail again forever)."""
        self._requests[request.request_id] = request
        result = self.planner.get_num_new_matched_tokens(request, num_computed_tokens)
        return result.num_tokens, result.load_async

    def update_state_after_alloc(self, request: Any, block_ids: Sequence[Sequence[int]],
                                 num_external_tokens: int) -> None:
        self._requests[request.request_id] = request
        self.planner.update_state_after_alloc(request, block_ids, num_external_tokens)

    # -- per step ------------------------------------------------------------------------

    def build_meta(self, scheduler_output: Any) -> KVOffloadMetadata:
        """This step's plan for the workers (vLLM calls it once per step, after scheduling)."""
        abandoned = self._abandon_late_loads()
        step = self.step_input(scheduler_output)
        plan = self.planner.build_step_plan(step)
        # Loads that ended before reaching a worker (evicted since lookup, reset).
        self._route(self.planner.update_from_worker_reports(()))
        now = self._clock()
        for job in plan.loads:
            self._loads_at_workers.add(job.request_id)
            self._load_started[job.request_id] = now
        resolved = tuple(self._resolved)
        self._resolved = []
        return KVOffloadMetadata(plan=plan, resolved_loads=resolved,
                                 abandoned_loads=abandoned)

    def _abandon_late_loads(self) -> tuple[JobId, ...]:
        """Give up the loads at the workers for longer than the deadline (module
        docstring); their requests go to ``resolved_loads`` as failed."""
        if self._load_deadline_s is None or not self._load_started:
            return ()
        due = self._clock() - self._load_deadline_s
        abandoned: list[JobId] = []
        for rid, started in list(self._load_started.items()):
            if started > due:
                continue
            del self._load_started[rid]
            request = self._requests.get(rid)
            job_id = None if request is None else self.planner.abandon_load(request)
            if job_id is None:
                continue
            self._loads_at_workers.discard(rid)
            self._resolved.append((rid, True))
            self._hold_blocks(job_id)
            abandoned.append(job_id)
            self.num_abandoned_loads += 1
            logger.warning("kvoffload: the load of request %s did not end within "
                           "load_deadline_s=%g s; vLLM recomputes the request", rid,
                           self._load_deadline_s)
        return tuple(abandoned)

    def step_input(self, so: Any) -> StepInput:
        """vLLM's ``SchedulerOutput`` as the planner's ``StepInput``."""
        scheduled: list[ScheduledRequest] = []
        num_tokens = so.num_scheduled_tokens
        checkpoints = self._checkpointed_state_ends(so)
        for new in so.scheduled_new_reqs:
            rid = new.req_id
            scheduled.append(ScheduledRequest(
                request=self._requests[rid],
                new_block_ids=tuple(tuple(ids) for ids in new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=num_tokens[rid], resumed=True,
                num_freed_blocks=self._freed(rid), state_ends=checkpoints.get(rid, ())))
        cached = so.scheduled_cached_reqs
        # vLLM 0.32/0.33 may send a request back from preemption among the cached ones,
        # named in ``resumed_req_ids``; 0.34 drops the field and re-sends every resumed
        # request in ``scheduled_new_reqs`` with its whole table (handled above).
        resumed_ids = getattr(cached, "resumed_req_ids", ())
        idle = self.planner.step_is_idle
        for i, rid in enumerate(cached.req_ids):
            ids = cached.new_block_ids[i]
            request = self._requests[rid]
            if ((ids is None or not any(ids)) and rid not in resumed_ids
                    and rid not in checkpoints
                    and idle(rid, min(cached.num_computed_tokens[i] + num_tokens[rid],
                                      request.num_tokens))):
                continue  # a decode step inside a block: nothing to plan
            scheduled.append(ScheduledRequest(
                request=request,
                new_block_ids=self._empty_ids if ids is None else tuple(map(tuple, ids)),
                num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=num_tokens[rid], resumed=rid in resumed_ids,
                num_freed_blocks=self._freed(rid), state_ends=checkpoints.get(rid, ())))
        preempted = tuple(so.preempted_req_ids or ())
        self.num_preempted += len(preempted)
        return StepInput(scheduled=tuple(scheduled), preempted=preempted)

    def _checkpointed_state_ends(self, so: Any) -> dict[str, tuple[int, ...]]:
        """Per request, Mamba states vLLM leaves inside this step (``mamba_states``)."""
        if not self._mamba_groups or self._managers is None:
            return {}
        tables = {g: self._managers[g].req_to_blocks for g, _ in self._mamba_groups}
        return checkpointed_state_ends(so, self._mamba_groups, tables)

    def _freed(self, request_id: str) -> tuple[int, ...] | None:
        """Per group, one past the last null position of vLLM's current block table."""
        if not self._windowed or self._managers is None:
            return None
        freed = [0] * self._num_groups
        for g in self._windowed:
            blocks = self._managers[g].req_to_blocks.get(request_id)
            if not blocks:
                continue
            i = len(blocks) - 1
            while i >= 0 and not blocks[i].is_null:
                i -= 1
            freed[g] = i + 1
        return tuple(freed)

    def update_connector_output(self, worker_meta: Any) -> None:
        """Feed the workers' reports (summed over ranks by vLLM) to the planner."""
        reports: list[WorkerReport] = []
        if isinstance(worker_meta, KVOffloadWorkerMetadata):
            reports = worker_meta.reports
        for report in reports:
            self._stats.add_transfer(report.stats)
        self._route(self.planner.update_from_worker_reports(reports))

    def _hold_blocks(self, job_id: JobId) -> None:
        """Take a reference on the vLLM blocks given-up load ``job_id`` writes."""
        pool = self._block_pool
        if pool is None:
            return
        blocks = [pool.blocks[b] for b in self.planner.job_block_ids(job_id) if b]
        pool.touch(blocks)
        self._held_blocks[job_id] = blocks

    def _route(self, outcome: ReportOutcome) -> None:
        """Give back the blocks of released loads; announce loads that ended without a
        worker job through the next metadata."""
        for job_id in outcome.released_loads:
            held = self._held_blocks.pop(job_id, None)
            if held is not None:
                self._block_pool.free_blocks(held)
        if not outcome.finished_loads:
            return
        failed = {f.request_id for f in outcome.failed_loads}
        for rid in outcome.finished_loads:
            if rid in self._loads_at_workers:
                # The worker that ran (or runs) the job tells vLLM itself.
                self._loads_at_workers.discard(rid)
                self._load_started.pop(rid, None)
            else:
                self._resolved.append((rid, rid in failed))

    # -- lifecycle -----------------------------------------------------------------------

    def request_finished(self, request: Any) -> None:
        """The request ended; vLLM may free its blocks now (the planner fences them)."""
        self._requests.pop(request.request_id, None)
        self._load_started.pop(request.request_id, None)
        self.planner.request_finished(request)

    def take_events(self) -> list[Any]:
        events = self.planner.take_events()
        if not events:
            return []
        return to_vllm_events(events, self.config)

    def reset_cache(self) -> bool:
        """Drop every offloaded block (``LLM.reset_prefix_cache(reset_connector=True)``)."""
        self.planner.reset_cache()
        return True

    def has_pending_work(self) -> bool:
        """Jobs in flight or not yet sent: vLLM keeps stepping until they report."""
        return self.planner.has_pending_work() or bool(self._resolved)

    def take_stats(self) -> KVOffloadStats | None:
        return self._stats.take(self.planner.stats, self.tier.usage(), self._by_tier())

    def _by_tier(self) -> dict[str, dict[str, int]]:
        """Cumulative per-tier counters (``stats.TIER_COUNTERS``): blocks loaded by the
        tier that held them (all "host" without lower tiers), lower-tier writes, failed
        writes and reads, blocks computed for want of host room to promote them into."""
        if not isinstance(self.tier, CascadeTier):
            return {"tier_blocks_loaded": {"host": sum(self.planner.stats.blocks_loaded
                                                       .values())}}
        stats = self.tier.stats
        return {"tier_blocks_loaded": stats.loaded_blocks,
                "tier_blocks_written": stats.demoted,
                "tier_write_failures": stats.demote_failed,
                "tier_read_failures": stats.promote_failed,
                "tier_blocks_without_room": stats.promote_no_room_miss}

    def shutdown(self) -> None:
        self.planner.shutdown()
        self.tier.close()
