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
   window prefix) and the preempted ids.
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
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, TypeVar

from kvoffload.config import GroupKind, OffloadConfig
from kvoffload.engine.block_pool import Allocation, HybridBlockPool
from kvoffload.engine.executors import AccountingExecutor, HoldsReports, TransferExecutor
from kvoffload.engine.metrics import EngineMetrics, Sample
from kvoffload.engine.model_presets import ModelLayout
from kvoffload.engine.requests import EngineRequest, Status
from kvoffload.engine.timing import TimingModel, TransferClock
from kvoffload.errors import ConfigError
from kvoffload.jobs import (
    Direction,
    JobId,
    StepPlan,
    TierJob,
    TierJobId,
    TierOp,
    TransferJob,
    WorkerReport,
)
from kvoffload.keys import BlockHasher
from kvoffload.planner.contract import ReportOutcome, ScheduledRequest, StepInput
from kvoffload.planner.planner import Planner
from kvoffload.tiers.base import Tier
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.cpu import HostTier

if TYPE_CHECKING:  # bytes mode imports torch; accounting mode never does
    from kvoffload.engine.device import DeviceCaches, HostAuditor
    from kvoffload.engine.verify import ByteChecks


@dataclass(frozen=True)
class EngineConfig:
    """The engine's own limits.

    Attributes:
        num_blocks: engine block ids, the null block 0 included.
        max_num_batched_tokens: token budget of one step (prefill chunks + decodes).
        max_num_seqs: requests running or loading at once.
        decode_tokens_per_step: engine iterations one step stands for (K). 1 is a real
            engine. With K > 1 (long replays in fewer steps) a decoding request computes K
            tokens per step, the step's token budget is K x ``max_num_batched_tokens``
            (one request's chunk stays within ``max_num_batched_tokens``), and a step
            with decodes lasts at least K decode iterations: the same blocks fill in the
            same order, in coarser steps.
        sample_interval_s: modelled seconds between two ``Sample`` values.
        check_integrity: check the pool's and the planner's bookkeeping every step (slow;
            for tests).
        load_deadline_s: modelled seconds a request waits for its load before it gives
            up and recomputes (module docstring, point 7); None waits for ever.
    """

    num_blocks: int
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    decode_tokens_per_step: int = 1
    sample_interval_s: float = 1.0
    check_integrity: bool = False
    load_deadline_s: float | None = None

    def __post_init__(self) -> None:
        if self.load_deadline_s is not None and not self.load_deadline_s > 0:
            raise ConfigError("load_deadline_s", f"must be positive, got {self.load_deadline_s}",
                              "Give seconds, or None to wait for every load.")
        for name in ("max_num_batched_tokens", "max_num_seqs", "decode_tokens_per_step"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}",
                                  "Give a positive count.")
        if self.num_blocks < 2:
            raise ConfigError("engine capacity", f"{self.num_blocks} block ids leave no "
                              "block to allocate", "Raise the engine capacity.")
        if not self.sample_interval_s > 0:
            raise ConfigError("sample_interval_s", "must be positive", "Give seconds.")


class _Admission(Enum):
    DEFERRED = "deferred"
    NO_ROOM = "no_room"
    LOADING = "loading"
    SCHEDULED = "scheduled"


@dataclass
class _Entry:
    """One request scheduled in the current step."""

    request: EngineRequest
    start: int
    count: int
    sched: ScheduledRequest


@dataclass
class _Job:
    direction: Direction
    request_id: str
    blocks: tuple[tuple[int, int], ...]  # (group, engine blocks)


_Id = TypeVar("_Id", JobId, TierJobId)


def _split_due(entries: list[tuple[_Id, int, bool]], transfers: TransferClock, now: float,
               on_rank0: Callable[[_Id, bool], None],
               ) -> tuple[dict[int, tuple[list[_Id], list[_Id]]], list[tuple[_Id, int, bool]]]:
    """Split ``(job, rank, failed)`` reports into those due by ``now``, as rank -> (ok,
    failed), and those still in flight; ``on_rank0`` sees each due report of rank 0."""
    due: dict[int, tuple[list[_Id], list[_Id]]] = {}
    later: list[tuple[_Id, int, bool]] = []
    for job_id, rank, failed in entries:
        if transfers.done_at(job_id) > now:
            later.append((job_id, rank, failed))
            continue
        ok, bad = due.setdefault(rank, ([], []))
        (bad if failed else ok).append(job_id)
        if rank == 0:
            on_rank0(job_id, failed)
    return due, later


class ReferenceEngine:
    """The step loop (see the module docstring).

    Args:
        layout: the model laid out for the engine's block size; ``layout.specs`` are the
            pages moved (possibly scaled), the real sizes are used for accounting.
        config: the engine's limits.
        offload: the planner's configuration, or None to run without offloading.
        executor: the worker side; defaults to ``AccountingExecutor``.
        device: the engine's tensors (bytes mode): contents are written by the forward
            pass and every loaded block is verified. None: nothing is written.
        auditor: bytes mode: checks the host arena against what the stores were to write
            (``audit_host``).
        tier: the planner's tier, built from ``offload`` (e.g. a ``CascadeTier`` with
            disk and remote tiers); by default a ``HostTier``.
        timing: the modelled accelerator and link.
        hash_seed: seed of the chained block hashes.
    """

    def __init__(self, layout: ModelLayout, config: EngineConfig, *,
                 offload: OffloadConfig | None = None,
                 executor: TransferExecutor | None = None,
                 device: DeviceCaches | None = None,
                 auditor: HostAuditor | None = None,
                 timing: TimingModel | None = None,
                 tier: Tier | None = None,
                 hash_seed: str = "kvoffload") -> None:
        specs = layout.specs
        if offload is not None:
            if tuple(g.block_size for g in offload.groups) != tuple(g.block_size for g in specs):
                raise ConfigError("offload.groups", "block sizes differ from the layout's",
                                  "Build the offload config from the same layout.")
            hash_block_size = offload.hash_block_size
        else:
            hash_block_size = math.gcd(*(g.block_size for g in specs))
        self.layout = layout
        self._state_block = max((s.block_size for s in layout.specs
                                 if s.kind is GroupKind.MAMBA), default=0)
        """Mamba block size (0 without Mamba): prefill chunks end on its multiples."""
        self.config = config
        self.specs = specs
        self.timing = timing or TimingModel()
        self.pool = HybridBlockPool(specs, config.num_blocks, hash_block_size)
        self.hasher = BlockHasher(hash_block_size, seed=hash_seed)
        self.offload = offload
        self.tier: Tier | None = None
        self.host: HostTier | None = None
        """Host memory: the tier itself, or the first level of a cascade."""
        self.planner: Planner | None = None
        if offload is not None:
            self.tier = tier if tier is not None else HostTier(offload, enable_events=False)
            host = self.tier.host if isinstance(self.tier, CascadeTier) else self.tier
            if not isinstance(host, HostTier):
                raise TypeError(f"tier {type(self.tier).__name__} is neither a HostTier nor "
                                "a CascadeTier over one")
            self.host = host
            self.planner = Planner(offload, self.tier,
                                   prefill_flops=layout.preset.prefill_flops)
        self.executor: TransferExecutor = executor or AccountingExecutor(
            offload.num_workers if offload is not None else 1)
        self.metrics = EngineMetrics(num_groups=len(specs))
        self.checks: ByteChecks | None = None
        if device is not None:
            from kvoffload.engine.verify import ByteChecks

            self.checks = ByteChecks(
                device, auditor, pool=self.pool, specs=specs, hash_block_size=hash_block_size,
                factor=offload.block_size_factor if offload else 1, metrics=self.metrics)
        self.transfers = TransferClock(self.timing)
        self.tier_transfers = TransferClock(self.timing, self.timing.lower_bytes_per_s)
        """Modelled time of tier jobs (promotes read, demotes write a lower tier)."""
        self.clock = 0.0
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.loading: dict[str, EngineRequest] = {}
        self.finished_ids: dict[str, float] = {}
        self._real_block_bytes = [g.real_block_bytes for g in layout.groups]
        factor = offload.block_size_factor if offload is not None else 1
        self._moved_offloaded_bytes = [g.page_bytes * g.num_layers * factor for g in specs]
        self._real_offloaded_bytes = [b * factor for b in self._real_block_bytes]
        self._jobs: dict[JobId, _Job] = {}
        self._load_jobs: dict[str, TransferJob] = {}
        self._reports: list[tuple[JobId, int, bool]] = []
        self._tier_reports: list[tuple[TierJobId, int, bool]] = []
        self._next_sample = 0.0
        self._holder = self.executor if isinstance(self.executor, HoldsReports) else None
        self._parked: dict[JobId, str] = {}
        """Abandoned load -> the pool owner holding its request's blocks until it reports."""
        self._offload_since: dict[str, float] = {}
        """When each request went onto the offload path (deferred, or loading: for a
        request in ``self.loading``, when its load started)."""
        self._deferred = False
        """Some lookup of the last step answered "ask again later"."""
        if self.planner is not None:
            self.pool.avoid = self._used_by_overdue_job

    # ------------------------------------------------------------------ requests

    @property
    def num_live(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request for admission (at the back of the waiting queue)."""
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_pending_transfers(self) -> bool:
        return (bool(self._jobs or self._tier_reports or len(self.tier_transfers)
                     or self._parked)
                or (self._holder is not None and self._holder.next_release() is not None)
                or (self.planner is not None and self.planner.has_pending_work()))

    def next_transfer_completion(self) -> float | None:
        # A deferred lookup is asked again next step: an engine keeps stepping meanwhile.
        retry = self.clock + self.timing.decode_step_s if self._deferred else None
        times = [t for t in (self.transfers.next_completion(),
                             self.tier_transfers.next_completion(), retry,
                             self._holder.next_release() if self._holder else None,
                             self._next_deadline()) if t is not None]
        # A job held past its modelled completion leaves a time in the past: look beyond.
        future = [t for t in times if t > self.clock]
        return min(future, default=min(times, default=None))

    def _next_deadline(self) -> float | None:
        deadline = self.config.load_deadline_s
        if deadline is None or not self.loading:
            return None
        return min(self._offload_since[rid] for rid in self.loading) + deadline

    def reset_cache(self) -> None:
        """Drop everything offloaded (``Planner.reset_cache``): loads in flight fail
        (their requests recompute) and late reports of earlier jobs are ignored."""
        if self.planner is not None:
            self.planner.reset_cache()
            self.metrics.cache_resets += 1

    # ---------------------------------------------------------------------- step

    def step(self) -> bool:
        """Run one engine step at ``self.clock``; False when it had nothing to do."""
        if isinstance(self.tier, CascadeTier):
            # A modelled step takes no wall time; a real one outlasts a lower tier's
            # existence checks, so let them land before the lookups of this step.
            self.tier.wait_idle()
        budget = self.config.max_num_batched_tokens * self.config.decode_tokens_per_step
        self._deferred = False
        self._give_up_late_loads()
        entries: list[_Entry] = []
        preempted: list[str] = []
        budget = self._schedule_running(entries, preempted, budget)
        if not preempted:
            self._admit_waiting(entries, budget)
        plan = StepPlan()
        if self.planner is not None:
            plan = self.planner.build_step_plan(
                StepInput(tuple(e.sched for e in entries), tuple(preempted)))
        start = self.clock
        if plan.tier_flush:
            start = max(start, *(self.tier_transfers.done_at(j) for j in plan.tier_flush))
        if plan.flush:
            stores = {j.job_id for j in plan.stores}
            # A store planned this step reads blocks this step's forward pass writes; a
            # flush makes the worker run it before that pass (a planner bug: counted, and
            # in bytes mode the verification shows what it stored).
            self.metrics.same_step_flushes += len(stores.intersection(plan.flush))
            done = max(self._done_at(j) for j in plan.flush)
            if done > start:
                self.metrics.flush_stall_s += done - start
                start = done
        if self.checks is not None and plan.stores:
            self.checks.expect_stores(plan.stores, {e.request.request_id: e.request
                                                    for e in entries})
        if self.checks is not None and plan.tier_jobs:
            self.checks.promoting(plan.tier_jobs)
        self.executor.begin_step(plan)
        for tier_job in plan.tier_jobs:
            self._tier_submitted(tier_job, start)
        for job in plan.loads:
            self._submitted(job, start)
        flops, iterations = self._forward(entries)
        end = start + (self.timing.step_seconds(flops, iterations) if entries else 0.0)
        self.metrics.max_step_s = max(self.metrics.max_step_s, end - self.clock)
        self._after_forward(entries, end)
        self.executor.end_step()
        for job in plan.stores:
            self._submitted(job, end)
        self.clock = end
        delivered = self._deliver()
        if self.config.check_integrity:
            self.check_integrity()
        active = bool(entries or preempted or not plan.is_empty or delivered)
        if active:
            self.metrics.steps += 1
        self._sample()
        return active

    # ------------------------------------------------------------ scheduling

    def _schedule_running(self, entries: list[_Entry], preempted: list[str],
                          budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed
            count = self._chunk(req, start, budget)
            alloc = self.pool.allocate(req.request_id, start + count, start)
            while alloc is None:
                victim = self.running[-1]
                if (victim is req and len(self.running) == 1 and not self.loading
                        and not self._parked):
                    raise ConfigError(
                        "engine capacity",
                        f"request {req.request_id} alone needs more than the engine's "
                        f"{self.config.num_blocks - 1} blocks at {start + count} tokens",
                        "Raise the engine capacity or lower the batched-token budget.")
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                alloc = self.pool.allocate(req.request_id, start + count, start)
            if alloc is None:
                break
            entries.append(self._entry(req, start, count, alloc))
            budget -= count
            i += 1
        return budget

    def _chunk(self, req: EngineRequest, start: int, budget: int) -> int:
        """Tokens to schedule for ``req`` from ``start``: what is left, within the budget.

        With a Mamba group, prefill chunks follow vLLM's ``align`` mode: a recurrent state
        exists only where a step ends, and only states at block ends can be cached and
        offloaded, so a chunk that does not finish the prefill ends on a block boundary
        when it can, and no chunk runs past the last block boundary before the request's
        last token (the state there is the one a later turn hits).
        """
        left = req.num_tokens - start
        count = min(left, budget, self.config.max_num_batched_tokens)
        m = self._state_block
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        if not m or start >= prefill_end:
            return count
        end = start + count
        if end < prefill_end and end // m * m > start:
            end = end // m * m
        last_cacheable = (req.num_tokens - 1) // m * m
        if start < last_cacheable < end:
            end = last_cacheable
        return end - start

    def _preempt(self, req: EngineRequest) -> None:
        self.running.remove(req)
        self.pool.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed = 0
        req.resumed = True
        req.send_full_table = True
        req.record.preemptions += 1
        self.metrics.preemptions += 1
        self.waiting.appendleft(req)

    def _entry(self, req: EngineRequest, start: int, count: int,
               alloc: Allocation) -> _Entry:
        rid = req.request_id
        ids = self.pool.block_table(rid) if req.send_full_table else alloc.new_block_ids
        sched = ScheduledRequest(req, ids, start, count, resumed=req.resumed,
                                 num_freed_blocks=self.pool.num_freed_blocks(rid))
        req.send_full_table = False
        req.resumed = False
        return _Entry(req, start, count, sched)

    def _admit_waiting(self, entries: list[_Entry], budget: int) -> None:
        kept: deque[EngineRequest] = deque()
        blocked = False
        while self.waiting:
            req = self.waiting.popleft()
            full = len(self.running) + len(self.loading) >= self.config.max_num_seqs
            if blocked or budget <= 0 or full:
                blocked = True
                kept.append(req)
                # Not asked this step: it waits for the engine, not for the offload path
                # (a later deferral starts a new wait, with a new deadline).
                self._off_offload_path(req.request_id)
                continue
            outcome, count = self._admit(req, entries, budget)
            if outcome is _Admission.DEFERRED:
                kept.append(req)
            elif outcome is _Admission.NO_ROOM:
                if not self.running and not self.loading and not self._parked:
                    raise ConfigError(
                        "engine capacity",
                        f"request {req.request_id} ({req.num_tokens} tokens) does not fit "
                        f"in the engine's {self.config.num_blocks - 1} blocks even when "
                        "nothing else runs", "Raise the engine capacity.")
                blocked = True
                kept.append(req)
            else:
                budget -= count
        self.waiting = kept

    def _admit(self, req: EngineRequest, entries: list[_Entry],
               budget: int) -> tuple[_Admission, int]:
        rid = req.request_id
        hit = self.pool.get_computed_blocks(req.block_hashes, req.num_tokens)
        local = hit.num_tokens
        external = 0
        if self.planner is not None:
            match = self.planner.get_num_new_matched_tokens(req, local)
            deadline = self.config.load_deadline_s
            if match.num_tokens is None:
                since = self._offload_since.setdefault(rid, self.clock)
                if deadline is None or self.clock - since < deadline:
                    self._deferred = True
                    return _Admission.DEFERRED, 0
                # Deferred past the deadline: run now with the engine's own hit only.
                self.metrics.deferral_give_ups += 1
            self._off_offload_path(rid)  # the lookup answered: its wait is over
            external = 0 if req.refuse_external or match.num_tokens is None \
                else match.num_tokens
        if external > 0:
            end = local + external
            if self.pool.allocate(rid, end, end, hit=hit) is None:
                return _Admission.NO_ROOM, 0
            if self.checks is not None:
                self.checks.check_hit(req, hit)
            assert self.planner is not None
            before = self._loaded_by_tier()
            self.planner.update_state_after_alloc(req, self.pool.block_table(rid), external)
            after = self._loaded_by_tier()
            req.pending_origin = {k: n - before.get(k, 0) for k, n in after.items()
                                  if n > before.get(k, 0)}
            req.status = Status.LOADING
            req.num_computed = local
            req.pending_hits = (local, external)
            self.loading[rid] = req
            self._offload_since[rid] = self.clock  # the load's own wait starts
            return _Admission.LOADING, 0
        count = self._chunk(req, local, budget)
        alloc = self.pool.allocate(rid, local + count, local, hit=hit)
        if alloc is None:
            return _Admission.NO_ROOM, 0
        if self.checks is not None:
            self.checks.check_hit(req, hit)
        if self.planner is not None:
            self.planner.update_state_after_alloc(req, self.pool.block_table(rid), 0)
        req.status = Status.RUNNING
        req.num_computed = local
        req.send_full_table = True
        self._off_offload_path(rid)
        self._started(req, local, 0, 0)
        self.running.append(req)
        entries.append(self._entry(req, local, count, alloc))
        return _Admission.SCHEDULED, count

    # ---------------------------------------------------------------- forward

    def _forward(self, entries: list[_Entry]) -> tuple[int, int]:
        """Write the scheduled tokens' KV (bytes mode); return (FLOPs, decode iterations)."""
        preset = self.layout.preset
        flops = 0
        iterations = 1
        for e in entries:
            flops += preset.prefill_flops(e.start + e.count, e.start)
            if e.request.num_emitted:
                # Decode iterations: the new tokens only. Recomputing the prefix after a
                # preemption or a failed load is prefill (its FLOPs count above).
                new = e.start + e.count - max(e.start, e.request.high_water)
                iterations = max(iterations, new)
        if self.checks is not None:
            self.checks.forward([(e.request, e.start, e.count) for e in entries])
        return flops, iterations

    def _after_forward(self, entries: list[_Entry], end: float) -> None:
        preset = self.layout.preset
        finished: list[EngineRequest] = []
        for e in entries:
            req = e.request
            rec = req.record
            done = e.start + e.count
            if rec.first_token_s is None:
                rec.prefill_tokens += e.count
                rec.prefill_flops += preset.prefill_flops(done, e.start)
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
        self.running.remove(req)
        req.status = Status.FINISHED
        req.record.finish_s = now
        self.finished_ids[rid] = now
        self.metrics.records.append(req.record)

    # -------------------------------------------------------------- transfers

    def _submitted(self, job: TransferJob, now: float) -> None:
        blocks = tuple((t.group, len(t.block_ids)) for t in job.groups)
        nbytes = sum(n * self._real_block_bytes[g] for g, n in blocks)
        self._jobs[job.job_id] = _Job(job.direction, job.request_id, blocks)
        self.transfers.submit(job.job_id, job.direction, nbytes, now)
        if job.direction is Direction.LOAD:
            self._load_jobs[job.request_id] = job

    def _tier_submitted(self, job: TierJob, now: float) -> None:
        moves = job.op in (TierOp.PROMOTE, TierOp.DEMOTE)
        nbytes = self._real_offloaded_bytes[job.group] if moves else 0
        direction = Direction.LOAD if job.op is TierOp.PROMOTE else Direction.STORE
        self.tier_transfers.submit(job.job_id, direction, nbytes, now)

    def _deliver(self) -> bool:
        """Hand the planner every report whose modelled completion time has passed."""
        for report in self.executor.poll():
            self._reports.extend((j, report.rank, False) for j in report.finished)
            self._reports.extend((j, report.rank, True) for j in report.failed)
            self._tier_reports.extend((j, report.rank, False) for j in report.tier_finished)
            self._tier_reports.extend((j, report.rank, True) for j in report.tier_failed)
            s = report.stats
            self.metrics.moved_stored_bytes += s.stored_bytes
            self.metrics.moved_loaded_bytes += s.loaded_bytes
            self.metrics.measured_store_s += s.store_seconds
            self.metrics.measured_load_s += s.load_seconds
        due, self._reports = _split_due(self._reports, self.transfers, self.clock,
                                        self._account)
        tier_due, self._tier_reports = _split_due(
            self._tier_reports, self.tier_transfers, self.clock,
            lambda tier_id, _failed: self.tier_transfers.forget(tier_id))
        if self.planner is None:
            return bool(due)
        reports = []
        for rank in sorted(due.keys() | tier_due.keys()):
            ok, bad = due.get(rank, ([], []))
            ok_t, bad_t = tier_due.get(rank, ([], []))
            reports.append(WorkerReport(rank, tuple(ok), tuple(bad), tier_finished=tuple(ok_t),
                                        tier_failed=tuple(bad_t)))
        outcome = self.planner.update_from_worker_reports(reports)
        self._loads_done(outcome)
        return bool(due or tier_due or outcome.finished_loads)

    def _account(self, job_id: JobId, failed: bool) -> None:
        job = self._jobs.pop(job_id, None)
        self.transfers.forget(job_id)
        if job is None:
            return  # a second report of the job: the planner counts (or rejects) it
        for g, n in job.blocks:
            traffic = self.metrics.traffic[g]
            if failed:
                traffic.failed_jobs += 1
            elif job.direction is Direction.STORE:
                traffic.stored_blocks += n
                traffic.stored_bytes += n * self._real_block_bytes[g]
            else:
                traffic.loaded_blocks += n
                traffic.loaded_bytes += n * self._real_block_bytes[g]

    def _loads_done(self, outcome: ReportOutcome) -> None:
        for job_id in outcome.released_loads:
            owner = self._parked.pop(job_id, None)
            if owner is not None:
                self.pool.free(owner)
        failed = {f.request_id for f in outcome.failed_loads}
        for rid in outcome.finished_loads:
            req = self.loading.pop(rid, None)
            if req is None:
                continue
            self._off_offload_path(rid)
            job = self._load_jobs.pop(rid, None)
            if rid in failed:
                # Recompute from the engine's own prefix: the re-admission accepts no
                # external tokens (a retried load could fail the same way forever).
                req.record.failed_loads += 1
                req.refuse_external = True
                self._requeue(req)
                continue
            if job is not None and self.checks is not None and self.checks.check_load(req, job):
                # Wrong bytes: never use them; recompute, and take no external tokens.
                req.record.corrupt_loads += 1
                req.refuse_external = True
                self._requeue(req)
                continue
            local, external = req.pending_hits
            done = local + external
            req.num_computed = min(done, req.num_tokens - 1)
            self.pool.cache_blocks(rid, req.block_hashes, req.num_computed)
            loaded = 0 if job is None else sum(len(t.block_ids) * self._real_block_bytes[t.group]
                                               for t in job.groups)
            self._started(req, local, external, loaded)
            req.status = Status.RUNNING
            req.send_full_table = True
            self.running.append(req)

    def _done_at(self, job_id: JobId) -> float:
        """When ``job_id`` reports: its modelled transfer, or later if its report is held."""
        done = self.transfers.done_at(job_id)
        if self._holder is not None:
            done = max(done, self._holder.held_until(job_id))
        return done

    def _used_by_overdue_job(self, block: int) -> bool:
        """Whether a job that should have reported by now still uses ``block``: reusing
        it would make the next plan flush that job, stalling the step behind it."""
        assert self.planner is not None
        clock = self.clock
        return any(self.transfers.done_at(j) < clock
                   for j in self.planner.jobs_fencing((block,)))

    def _off_offload_path(self, rid: str) -> None:
        since = self._offload_since.pop(rid, None)
        if since is not None:
            self.metrics.max_offload_wait_s = max(self.metrics.max_offload_wait_s,
                                                  self.clock - since)

    def _give_up_late_loads(self) -> None:
        """Abandon loads older than the deadline (module docstring, point 7)."""
        deadline = self.config.load_deadline_s
        if deadline is None or self.planner is None:
            return
        late = [rid for rid in self.loading
                if self.clock - self._offload_since[rid] >= deadline]
        for rid in late:
            req = self.loading.pop(rid)
            self._load_jobs.pop(rid, None)
            self._off_offload_path(rid)
            job_id = self.planner.abandon_load(req)
            req.refuse_external = True
            req.record.failed_loads += 1
            self.metrics.abandoned_loads += 1
            if job_id is None:
                self._requeue(req)
                continue
            owner = f"{rid}\x00parked-load-{job_id}"
            self.pool.rename(rid, owner)
            self._parked[job_id] = owner
            parked = sum(len(t) for o in self._parked.values()
                         for t in self.pool.block_table(o))
            self.metrics.parked_blocks_peak = max(self.metrics.parked_blocks_peak, parked)
            self._back_to_waiting(req)

    @property
    def num_parked_loads(self) -> int:
        """Abandoned loads whose blocks are still parked (their job has not reported)."""
        return len(self._parked)

    def _loaded_by_tier(self) -> dict[tuple[str, int], int]:
        """Blocks the cascade has handed to loads so far, by (tier they came from, group)."""
        if isinstance(self.tier, CascadeTier):
            return dict(self.tier.stats.loaded_group_blocks)
        return {}

    def _started(self, req: EngineRequest, local: int, external: int, loaded: int) -> None:
        """The request starts to run: its first start fixes its hits (later admissions
        after a preemption hit its own blocks, which is no reuse)."""
        if req.started:
            return
        req.started = True
        rec = req.record
        rec.engine_hit_tokens, rec.host_hit_tokens, rec.loaded_bytes = local, external, loaded
        if external:
            # Split the external tokens by where the load's blocks came from (all from
            # host memory without lower tiers); promoted blocks were read from a lower
            # tier first.
            origin: dict[str, int] = {}
            for (tier, group), n in req.pending_origin.items():
                origin[tier] = origin.get(tier, 0) + n
                if tier != "host":
                    rec.promoted_bytes += n * self._real_offloaded_bytes[group]
            origin = origin or {"host": 1}
            total = sum(origin.values())
            shares = {t: external * n // total for t, n in origin.items()}
            first = next(iter(shares))
            shares[first] += external - sum(shares.values())
            rec.tier_hit_tokens = shares
        self.metrics.started(rec)

    def _requeue(self, req: EngineRequest) -> None:
        """Free a request whose load cannot be used and queue it to recompute."""
        self.pool.free(req.request_id)
        self._back_to_waiting(req)

    def _back_to_waiting(self, req: EngineRequest) -> None:
        """Queue ``req`` first to recompute from scratch (its blocks already released or
        parked)."""
        req.status = Status.WAITING
        req.num_computed = 0
        req.send_full_table = True
        self.waiting.appendleft(req)

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
        return max(self._real_offloaded_bytes)

    def host_bytes_by_group(self) -> tuple[int, ...]:
        """Real bytes the host tier holds per group now (ready and being written)."""
        if self.tier is None:
            return tuple(0 for _ in self.specs)
        usage = self.tier.usage().bytes_by_group
        out = []
        for g, moved in enumerate(self._moved_offloaded_bytes):
            keys = usage.get(g, 0) // moved if moved else 0
            out.append(keys * self._real_offloaded_bytes[g])
        return tuple(out)

    def _sample(self) -> None:
        if self.clock < self._next_sample:
            return
        self._next_sample = self.clock + self.config.sample_interval_s
        self.take_sample()

    def take_sample(self) -> None:
        """Record a ``Sample`` now."""
        m = self.metrics
        held = self.host_bytes_by_group()
        for g, b in enumerate(held):
            m.peak_host_bytes_by_group[g] = max(m.peak_host_bytes_by_group[g], b)
        pool = self.pool
        m.samples.append(Sample(
            time_s=self.clock, prompt_tokens=m.cum_prompt_tokens,
            engine_hit_tokens=m.cum_engine_hit_tokens, host_hit_tokens=m.cum_host_hit_tokens,
            host_bytes_by_group=held,
            host_used_slots=self.host.usage().used_slots if self.host is not None else 0,
            engine_blocks_used=pool.num_blocks - 1 - pool.num_free_blocks,
            running=len(self.running) + len(self.loading), waiting=len(self.waiting)))

    def check_integrity(self) -> None:
        """Check the pool's and the planner's bookkeeping (``InvariantError`` if broken)."""
        self.pool.check_integrity()
        if self.planner is not None:
            self.planner.check_integrity()
