"""The reference engine's step loop: schedule, plan, transfer, forward, deliver.

A small, honest model of a vLLM-style scheduler (V1, FCFS) over ``HybridBlockPool``, driving
the planner through its public contract exactly as an engine adapter would:

1. **Running requests first**, in order, under a token budget (chunked prefill, then
   decode). When the pool has no room, the *last* running request is preempted (its blocks
   freed, back to the front of the waiting queue), until the request fits or preempts
   itself.
2. **Waiting requests** next (only in steps without a preemption), FCFS: the engine's own
   prefix hit (``get_computed_blocks``), then ``planner.get_num_new_matched_tokens``
   ("ask again later" keeps the request waiting and moves on). An offload hit allocates
   the blocks of the hit (nulls outside windows, one Mamba state) and calls
   ``update_state_after_alloc``; the request waits in ``LOADING`` until
   ``finished_loads`` names it. Otherwise the first prefill chunk is scheduled now. The
   first allocation failure stops admission for the step.
3. ``build_step_plan`` with every scheduled request (the whole block table on its first
   schedule after admission or preemption, then the newly appended ids, and the freed
   window prefix) and the preempted ids; a request with no new blocks whose step needs
   nothing of the planner (``Planner.step_is_idle``: a decode step inside a block) is
   left out, as the vLLM adapter does.
4. The executor (the worker's ``begin_step``) waits for the plan's flushes and submits its
   loads; the forward pass writes the scheduled tokens' KV (bytes mode); ``end_step``
   submits the stores, which read what the forward pass wrote.
5. Computed blocks enter the prefix cache; requests that caught up emit tokens (the first
   one is the time to first token); finished requests go through ``request_finished``
   and ``free``.
6. Worker reports whose modelled completion time has passed go to
   ``update_from_worker_reports``. A finished load is verified byte for byte (bytes
   mode); a failed or corrupt load frees the request and re-admits it to recompute
   (accepting no external tokens from then on). A load that reaches the last
   token (full-attention-only models) leaves that token to be recomputed.
7. With ``EngineConfig.load_deadline_s``, a request whose load has not reported by then
   gives up (``Planner.abandon_load``): it recomputes into fresh blocks, accepting no
   external tokens, while the blocks the load still writes stay parked (allocated to no
   request) until ``released_loads`` names the job. A transfer cannot be cancelled, so
   handing those blocks out earlier would let the late copy corrupt them. A request
   whose lookup is deferred ("ask again later") past the deadline runs with the engine's
   own prefix hit only.

Time is modelled (``timing``): a step lasts as long as its FLOPs or decode iterations
take on the modelled accelerator, a transfer as long as its bytes take on the link.

``ReferenceEngine`` is the public entry point: it builds the parts, runs the step loop
(points 3 to 5: plan, transfers, forward pass, emitted tokens, finished requests) and
answers the driver (``replay``). The rest is done by one part each:

* ``scheduling.Scheduler``: the queues, and points 1, 2 and 6 (scheduling, preemption,
  admission, acting on finished loads);
* ``transfers.TransferTracker``: submitted jobs and their modelled completion, flushes,
  report delivery, loads waiting and point 7 (late loads given up, parked blocks);
* ``recording.Recorder``: hit attribution per request and tier, and samples.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any

from kvoffload.config import GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.jobs import StepPlan
from kvoffload.keys import BlockHasher
from kvoffload.models.layout import ModelLayout
from kvoffload.offload import Offload, build_offload
from kvoffload.planner.contract import StepInput
from kvoffload.planner.planner import Planner
from kvoffload.refengine.block_pool import HybridBlockPool
from kvoffload.refengine.context import BlockBytes, EngineConfig, EngineContext
from kvoffload.refengine.executors import AccountingExecutor, TransferExecutor
from kvoffload.refengine.metrics import EngineMetrics
from kvoffload.refengine.recording import Recorder
from kvoffload.refengine.requests import EngineRequest, Status
from kvoffload.refengine.scheduler import Scheduler, StepEntry
from kvoffload.refengine.timing import ModelledClock, TimingModel, TransferClock
from kvoffload.refengine.transfers import TransferTracker
from kvoffload.tiers.base import Tier
from kvoffload.tiers.host import HostTier

if TYPE_CHECKING:  # bytes mode imports torch; accounting mode never does
    from kvoffload.refengine.device import DeviceCaches, HostAuditor
    from kvoffload.refengine.verify import ByteChecks


def offload_for(layout: ModelLayout, config: OffloadConfig, **kwargs: Any) -> Offload:
    """The planner and its tiers for an engine of ``layout``: ``build_offload(config,
    **kwargs)`` with the layout's prefill cost (for value-aware policies), no cache
    events (the reference engine publishes none) and, unless ``kwargs`` name one, a
    ``ModelledClock`` the engine built with it keeps at its own modelled time."""
    kwargs.setdefault("clock", ModelledClock())
    return build_offload(config, enable_events=False,
                         prefill_flops=layout.preset.prefill_flops, **kwargs)


class ReferenceEngine:
    """The step loop (see the module docstring).

    Args:
        layout: the model laid out for the engine's block size; ``layout.specs`` are the
            pages moved (possibly scaled), the real sizes are used for accounting.
        config: the engine's limits.
        offload: the planner and its tiers (``kvoffload.offload.build_offload``;
            ``offload_for`` builds them for a layout), or None to run without offloading.
        executor: the worker side; defaults to ``AccountingExecutor``.
        device: the engine's tensors (bytes mode): contents are written by the forward
            pass and every loaded block is verified. None: nothing is written.
        auditor: bytes mode: checks the host arena against what the stores were to write
            (``audit_host``).
        timing: the modelled accelerator and link.
        hash_seed: seed of the chained block hashes.
    """


    def __init__(self, layout: ModelLayout, config: EngineConfig, *,
                 offload: Offload | None = None,
                 executor: TransferExecutor | None = None,
                 device: DeviceCaches | None = None,
                 auditor: HostAuditor | None = None,
                 timing: TimingModel | None = None,
                 hash_seed: str = "kvoffload") -> None:
        specs = layout.specs
        offload_config = offload.config if offload is not None else None
        hash_block_size = _hash_block_size(specs, offload_config)
        self.layout = layout
        self.config = config
        self.specs = specs
        self.timing = timing or TimingModel()
        self.pool = HybridBlockPool(specs, config.num_blocks, hash_block_size)
        self.hasher = BlockHasher(hash_block_size, seed=hash_seed)
        self.offload = offload_config
        self.tier: Tier | None = offload.tier if offload is not None else None
        self.host: HostTier | None = offload.host if offload is not None else None
        """Host memory: the tier itself, or the first level of a cascade."""
        self.planner: Planner | None = offload.planner if offload is not None else None
        self.executor: TransferExecutor = executor or AccountingExecutor(
            offload_config.num_workers if offload_config is not None else 1)
        self.metrics = EngineMetrics(num_groups=len(specs))
        self.checks: ByteChecks | None = None
        factor = offload_config.block_size_factor if offload_config is not None else 1
        if device is not None:
            from kvoffload.refengine.verify import ByteChecks

            self.checks = ByteChecks(
                device, auditor, pool=self.pool, specs=specs, hash_block_size=hash_block_size,
                factor=factor, metrics=self.metrics)
        self._time = (offload.clock if offload is not None
                      and isinstance(offload.clock, ModelledClock) else ModelledClock())
        """The modelled time, shared with the planner and a cascade built by
        ``offload_for`` (their waits in seconds are modelled seconds)."""
        self.finished_ids: dict[str, float] = {}
        self._build_parts(factor)

    def _build_parts(self, factor: int) -> None:
        """The transfer tracker, the recorder and the scheduler, over one context."""
        real = tuple(g.real_block_bytes for g in self.layout.groups)
        context = EngineContext(
            clock=self, config=self.config, pool=self.pool, planner=self.planner,
            metrics=self.metrics, block_bytes=BlockBytes(
                real=real, real_offloaded=tuple(b * factor for b in real),
                moved_offloaded=tuple(g.page_bytes * g.num_layers * factor
                                      for g in self.specs)))
        self._transfers = TransferTracker(context, self.timing, executor=self.executor)
        self._recorder = Recorder(context, self.tier, self.host)
        self._scheduler = Scheduler(context, specs=self.specs, transfers=self._transfers,
                                    recorder=self._recorder, checks=self.checks)
        if self.planner is not None:
            self.pool.avoid = self._transfers.used_by_overdue_job

    # ------------------------------------------------------------------ requests

    @property
    def clock(self) -> float:
        """The modelled time in seconds."""
        return self._time.now

    @clock.setter
    def clock(self, now: float) -> None:
        self._time.now = now

    @property
    def waiting(self) -> deque[EngineRequest]:
        """Requests waiting for admission, next first."""
        return self._scheduler.waiting

    @property
    def running(self) -> list[EngineRequest]:
        """Running requests, in scheduling order."""
        return self._scheduler.running

    @property
    def loading(self) -> dict[str, EngineRequest]:
        """Requests waiting for their load, by id."""
        return self._transfers.loading

    @property
    def num_live(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request for admission (at the back of the waiting queue); its
        workload's ``controls``, if any, go to the planner first."""
        controls = request.source.controls
        if controls is not None and self.planner is not None:
            self.planner.set_controls(request, controls)
        request.status = Status.WAITING
        self._scheduler.waiting.append(request)

    def has_pending_transfers(self) -> bool:
        return self._transfers.has_pending()

    def next_transfer_completion(self) -> float | None:
        # A deferred lookup is asked again next step: an engine keeps stepping meanwhile.
        retry = self.clock + self.timing.decode_step_s if self._scheduler.deferred else None
        return self._transfers.next_completion(retry)

    def reset_cache(self) -> None:
        """Drop everything offloaded (``Planner.reset_cache``): loads in flight fail
        (their requests recompute) and late reports of earlier jobs are ignored."""
        if self.planner is not None:
            self.planner.reset_cache()
            self.metrics.cache_resets += 1

    # ---------------------------------------------------------------------- step

    def step(self) -> bool:
        """Run one engine step at ``self.clock``; False when it had nothing to do."""
        if self.tier is not None:
            # A modelled step takes no wall time; a real one outlasts a lower tier's
            # existence checks, so let them land before the lookups of this step.
            self.tier.wait_idle()
        config = self.config
        scheduler, transfers = self._scheduler, self._transfers
        for req in transfers.give_up_late_loads():
            scheduler.back_to_waiting(req)
        entries, preempted = scheduler.schedule(
            config.max_num_batched_tokens * config.decode_tokens_per_step)
        plan = StepPlan()
        if self.planner is not None:
            plan = self.planner.build_step_plan(StepInput(
                tuple(e.sched for e in entries if not self._idle(e)), tuple(preempted)))
        start = self._begin(plan, entries)
        flops, iterations = self._forward(entries)
        end = start + (self.timing.step_seconds(flops, iterations) if entries else 0.0)
        self.metrics.max_step_s = max(self.metrics.max_step_s, end - self.clock)
        self._after_forward(entries, end)
        self.executor.end_step()
        for job in plan.stores:
            transfers.submitted(job, end)
        self.clock = end
        delivered, outcome = transfers.deliver()
        if outcome is not None:
            scheduler.loads_done(outcome)
        if config.check_integrity:
            self.check_integrity()
        active = bool(entries or preempted or not plan.is_empty or delivered)
        if active:
            self.metrics.steps += 1
        if self._recorder.sample_due():
            self.take_sample()
        return active

    def _idle(self, entry: StepEntry) -> bool:
        """Whether ``entry`` is left out of the planner's step (``Planner.step_is_idle``)."""
        sched = entry.sched
        assert self.planner is not None
        return sched.may_be_idle and self.planner.step_is_idle(entry.request.request_id,
                                                               sched.offloadable)

    def _begin(self, plan: StepPlan, entries: list[StepEntry]) -> float:
        """Start the step's transfers (the worker's ``begin_step``); return when the step
        starts: after the jobs its plan flushes."""
        start = self._transfers.step_start(plan, self.clock)
        checks = self.checks
        if checks is not None and plan.stores:
            checks.expect_stores(plan.stores, {e.request.request_id: e.request
                                               for e in entries})
        if checks is not None and plan.tier_jobs:
            checks.promoting(plan.tier_jobs)
        self.executor.begin_step(plan)
        for tier_job in plan.tier_jobs:
            self._transfers.tier_submitted(tier_job, start)
        for job in plan.loads:
            self._transfers.submitted(job, start)
        return start

    # ---------------------------------------------------------------- forward

    def _forward(self, entries: list[StepEntry]) -> tuple[int, int]:
        """Write the scheduled tokens' KV (bytes mode); return (FLOPs, decode iterations)."""
        preset = self.layout.preset
        flops = 0
        iterations = 1
        for e in entries:
            e.flops = preset.prefill_flops(e.start + e.count, e.start)
            flops += e.flops
            if e.request.num_emitted:
                # Decode iterations: the new tokens only. Recomputing the prefix after a
                # preemption or a failed load is prefill (its FLOPs count above).
                new = e.start + e.count - max(e.start, e.request.high_water)
                iterations = max(iterations, new)
        if self.checks is not None:
            self.checks.forward([(e.request, e.start, e.count) for e in entries])
        return flops, iterations

    def _after_forward(self, entries: list[StepEntry], end: float) -> None:
        finished: list[EngineRequest] = []
        for e in entries:
            req = e.request
            rec = req.record
            done = e.start + e.count
            if rec.first_token_s is None:
                rec.prefill_tokens += e.count
                rec.prefill_flops += e.flops
            else:
                rec.recomputed_tokens += max(0, min(done, req.high_water) - e.start)
            req.num_computed = done
            req.high_water = max(req.high_water, done)
            self.pool.cache_blocks(req.request_id, req.block_hashes, done)
            if done < req.num_tokens:
                continue
            if rec.first_token_s is None:
                rec.first_token_s = end
            count = 1 if req.num_emitted == 0 else self.config.decode_tokens_per_step
            count = min(count, req.remaining_outputs)
            if count == req.remaining_outputs:
                req.num_emitted += count
                finished.append(req)
            else:
                req.emit(count)
        for req in finished:
            self._finish(req, end)

    def _finish(self, req: EngineRequest, now: float) -> None:
        rid = req.request_id
        if self.planner is not None:
            self.planner.request_finished(req, self.pool.block_table(rid))
        self.pool.free(rid)
        self._scheduler.running.remove(req)
        req.status = Status.FINISHED
        req.record.finish_s = now
        self.finished_ids[rid] = now
        self.metrics.records.append(req.record)

    # -------------------------------------------------------------- transfers

    @property
    def transfers(self) -> TransferClock:
        """Modelled time of transfer jobs on the host link."""
        return self._transfers.transfers

    @property
    def tier_transfers(self) -> TransferClock:
        """Modelled time of tier jobs (promotes read, demotes write a lower tier)."""
        return self._transfers.tier_transfers

    @property
    def num_parked_loads(self) -> int:
        """Abandoned loads whose blocks are still parked (their job has not reported)."""
        return self._transfers.num_parked

    def audit_host(self) -> int:
        """Bytes mode: wrong bytes among the blocks the host tier can serve now (also
        added to ``metrics.wrong_host_bytes``); 0 without the real worker."""
        if self.checks is None or self.host is None:
            return 0
        return self.checks.audit(self.host)

    # ---------------------------------------------------------------- metrics

    @property
    def real_slot_bytes(self) -> int:
        """Real bytes of one host slot (the largest group's offloaded block)."""
        return self._recorder.real_slot_bytes

    def host_bytes_by_group(self) -> tuple[int, ...]:
        """Real bytes the host tier holds per group now (ready and being written)."""
        return self._recorder.host_bytes_by_group()

    def take_sample(self) -> None:
        """Record a ``Sample`` now."""
        self._recorder.take_sample(len(self.running) + len(self.loading), len(self.waiting))

    def check_integrity(self) -> None:
        """Check the pool's and the planner's bookkeeping (``InvariantError`` if broken)."""
        self.pool.check_integrity()
        if self.planner is not None:
            self.planner.check_integrity()


def _hash_block_size(specs: tuple[GroupSpec, ...], offload: OffloadConfig | None) -> int:
    """Tokens per chained block hash: the offload config's, else the groups' GCD."""
    if offload is None:
        return math.gcd(*(g.block_size for g in specs))
    if tuple(g.block_size for g in offload.groups) != tuple(g.block_size for g in specs):
        raise ConfigError("offload.groups", "block sizes differ from the layout's",
                          "Build the offload config from the same layout.")
    return offload.hash_block_size
