"""Which requests a reference-engine step runs, and for how many tokens.

``Scheduler`` holds the engine's queues (``waiting``, FCFS; ``running``, in order) and
makes each step's decision, as vLLM's V1 scheduler does (``scheduler`` module docstring,
points 1, 2 and 6):

* ``schedule`` takes the running requests first, in order, under the token budget
  (chunked prefill, then decode; ``chunk`` is the chunk rule). When the pool has no room
  the *last* running request is preempted (blocks freed, back to the front of the waiting
  queue) until the request fits or preempts itself. In a step without a preemption it
  then admits waiting requests FCFS: the engine's own prefix hit, then the planner's
  lookup ("ask again later" keeps the request waiting); an offload hit allocates the hit's
  blocks, calls ``update_state_after_alloc`` and leaves the request loading
  (``TransferTracker.loading``); otherwise its first chunk runs now. The first allocation
  failure stops admission for the step.
* ``loads_done`` acts on the planner's report outcome: a finished load joins the running
  requests; a failed or corrupt one (bytes mode) recomputes, accepting no external tokens.
* ``back_to_waiting`` queues a request first to recompute from scratch.

Each scheduled request becomes a ``StepEntry`` carrying the planner's
``ScheduledRequest`` (the whole block table on its first schedule after admission or
preemption, else the newly appended ids).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from kvoffload.config import GroupSpec
from kvoffload.errors import ConfigError
from kvoffload.group_kinds import KIND_RULES
from kvoffload.planner.contract import ReportOutcome, ScheduledRequest
from kvoffload.refengine.block_pool import Allocation
from kvoffload.refengine.context import EngineContext
from kvoffload.refengine.recording import Recorder
from kvoffload.refengine.requests import EngineRequest, Status
from kvoffload.refengine.transfers import TransferTracker
from kvoffload.tiers.base import HOST

if TYPE_CHECKING:  # bytes mode imports torch; accounting mode never does
    from kvoffload.refengine.verify import ByteChecks


class _Admission(Enum):
    DEFERRED = "deferred"
    NO_ROOM = "no_room"
    LOADING = "loading"
    SCHEDULED = "scheduled"


@dataclass
class StepEntry:
    """One request scheduled in the current step: tokens ``[start, start + count)``."""

    request: EngineRequest
    start: int
    count: int
    sched: ScheduledRequest
    flops: int = 0
    """The prefill FLOPs of those tokens (set by the forward pass, read after it)."""


class Scheduler:
    """The engine's queues and each step's scheduling decision (module docstring).

    Args:
        context: the engine's clock, limits, pool, planner (None without offloading) and
            metrics (where preemptions and deferral give-ups are counted).
        specs: the KV-cache groups (a Mamba group sets the chunk alignment).
        transfers: loads in flight and the offload path's waits.
        recorder: hit attribution.
        checks: bytes mode's checks, or None.
    """

    def __init__(self, context: EngineContext, *, specs: tuple[GroupSpec, ...],
                 transfers: TransferTracker, recorder: Recorder,
                 checks: ByteChecks | None) -> None:
        self._clock = context.clock
        self._config = context.config
        self._pool = context.pool
        self._planner = context.planner
        self._transfers = transfers
        self._loading = transfers.loading
        self._recorder = recorder
        self._metrics = context.metrics
        self._checks = checks
        self._state_block = max((s.block_size for s in specs
                                 if KIND_RULES[s.kind].holds_state), default=0)
        """Mamba block size (0 without Mamba): prefill chunks end on its multiples."""
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.deferred = False
        """Some lookup of the last step answered "ask again later"."""

    # ---------------------------------------------------------------- the step

    def schedule(self, budget: int) -> tuple[list[StepEntry], list[str]]:
        """This step's scheduled requests and the ids it preempted."""
        self.deferred = False
        entries: list[StepEntry] = []
        preempted: list[str] = []
        budget = self._schedule_running(entries, preempted, budget)
        if not preempted:
            self._admit_waiting(entries, budget)
        return entries, preempted

    def _schedule_running(self, entries: list[StepEntry], preempted: list[str],
                          budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            start = req.num_computed
            count = self.chunk(req, start, budget)
            alloc = self._pool.allocate(req.request_id, start + count, start)
            while alloc is None:
                victim = self.running[-1]
                if (victim is req and len(self.running) == 1 and not self._loading
                        and not self._transfers.num_parked):
                    raise ConfigError(
                        "engine capacity",
                        f"request {req.request_id} alone needs more than the engine's "
                        f"{self._config.num_blocks - 1} blocks at {start + count} tokens",
                        "Raise the engine capacity or lower the batched-token budget.")
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
                alloc = self._pool.allocate(req.request_id, start + count, start)
            if alloc is None:
                break
            entries.append(self._entry(req, start, count, alloc))
            budget -= count
            i += 1
        return budget

    def chunk(self, req: EngineRequest, start: int, budget: int) -> int:
        """Tokens to schedule for ``req`` from ``start``: what is left, within the budget.

        With a Mamba group, prefill chunks follow vLLM's ``align`` mode: a recurrent state
        exists only where a step ends, and only states at block ends can be cached and
        offloaded, so a chunk that does not finish the prefill ends on a block boundary
        when it can, and no chunk runs past the last block boundary before the request's
        last token (the state there is the one a later turn hits).
        """
        left = req.num_tokens - start
        count = min(left, budget, self._config.max_num_batched_tokens)
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
        self._pool.free(req.request_id)
        req.status = Status.WAITING
        req.num_computed = 0
        req.resumed = True
        req.send_full_table = True
        req.record.preemptions += 1
        self._metrics.preemptions += 1
        self.waiting.appendleft(req)

    def _entry(self, req: EngineRequest, start: int, count: int,
               alloc: Allocation) -> StepEntry:
        rid = req.request_id
        ids = self._pool.block_table(rid) if req.send_full_table else alloc.new_block_ids
        sched = ScheduledRequest(req, ids, start, count, resumed=req.resumed,
                                 num_freed_blocks=self._pool.num_freed_blocks(rid))
        req.send_full_table = False
        req.resumed = False
        return StepEntry(req, start, count, sched)

    # --------------------------------------------------------------- admission

    def _admit_waiting(self, entries: list[StepEntry], budget: int) -> None:
        kept: deque[EngineRequest] = deque()
        blocked = False
        off_offload_path = self._transfers.off_offload_path
        while self.waiting:
            req = self.waiting.popleft()
            full = len(self.running) + len(self._loading) >= self._config.max_num_seqs
            if blocked or budget <= 0 or full:
                blocked = True
                kept.append(req)
                # Not asked this step: it waits for the engine, not for the offload path
                # (a later deferral starts a new wait, with a new deadline).
                off_offload_path(req.request_id)
                continue
            outcome, count = self._admit(req, entries, budget)
            if outcome is _Admission.DEFERRED:
                kept.append(req)
            elif outcome is _Admission.NO_ROOM:
                if not self.running and not self._loading and not self._transfers.num_parked:
                    raise ConfigError(
                        "engine capacity",
                        f"request {req.request_id} ({req.num_tokens} tokens) does not fit "
                        f"in the engine's {self._config.num_blocks - 1} blocks even when "
                        "nothing else runs", "Raise the engine capacity.")
                blocked = True
                kept.append(req)
            else:
                budget -= count
        self.waiting = kept

    def _admit(self, req: EngineRequest, entries: list[StepEntry],
               budget: int) -> tuple[_Admission, int]:
        rid = req.request_id
        pool = self._pool
        hit = pool.get_computed_blocks(req.block_hashes, req.num_tokens)
        local = hit.num_tokens
        external = 0
        if self._planner is not None:
            match = self._planner.get_num_new_matched_tokens(req, local)
            if match.num_tokens is None:
                if self._transfers.may_defer(rid):
                    self.deferred = True
                    return _Admission.DEFERRED, 0
                # Deferred past the deadline: run now with the engine's own hit only.
                self._metrics.deferral_give_ups += 1
            self._transfers.off_offload_path(rid)  # the lookup answered: its wait is over
            external = match.num_tokens or 0
        if external > 0:
            end = local + external
            if pool.allocate(rid, end, end, hit=hit) is None:
                return _Admission.NO_ROOM, 0
            if self._checks is not None:
                self._checks.check_hit(req, hit)
            self._start_load(req, local, external)
            return _Admission.LOADING, 0
        count = self.chunk(req, local, budget)
        alloc = pool.allocate(rid, local + count, local, hit=hit)
        if alloc is None:
            return _Admission.NO_ROOM, 0
        if self._checks is not None:
            self._checks.check_hit(req, hit)
        if self._planner is not None:
            self._planner.update_state_after_alloc(req, pool.block_table(rid), 0)
        req.status = Status.RUNNING
        req.num_computed = local
        req.send_full_table = True
        self._recorder.started(req, local, 0, 0)
        self.running.append(req)
        entries.append(self._entry(req, local, count, alloc))
        return _Admission.SCHEDULED, count

    def _start_load(self, req: EngineRequest, local: int, external: int) -> None:
        """The blocks of ``req``'s hit are allocated: tell the planner, learn which tier
        serves the load, and leave the request loading."""
        assert self._planner is not None
        sources = self._planner.update_state_after_alloc(
            req, self._pool.block_table(req.request_id), external)
        # Host memory first: a share that does not divide evenly goes to it.
        req.pending_origin = dict(sorted(sources.items(), key=lambda kv: kv[0][0] != HOST))
        req.status = Status.LOADING
        req.num_computed = local
        req.pending_hits = (local, external)
        self._transfers.start_load(req)

    # ------------------------------------------------------------------- loads

    def loads_done(self, outcome: ReportOutcome) -> None:
        """Loads the planner reports finished: run their requests, or recompute those
        whose load failed or (bytes mode) brought wrong bytes."""
        assert self._planner is not None  # only a planner reports loads
        failed = {f.request_id for f in outcome.failed_loads}
        for rid in outcome.finished_loads:
            finished = self._transfers.load_finished(rid)
            if finished is None:
                continue
            req, job = finished
            if rid in failed:
                # Recompute from the engine's own prefix: the planner offers the
                # re-admission no external tokens (a retried load could fail forever).
                req.record.failed_loads += 1
                self.requeue(req)
                continue
            if job is not None and self._checks is not None and self._checks.check_load(req,
                                                                                        job):
                # Wrong bytes: never use them; recompute, and take no external tokens.
                req.record.corrupt_loads += 1
                self._planner.refuse_loads(req)
                self.requeue(req)
                continue
            local, external = req.pending_hits
            req.num_computed = min(local + external, req.num_tokens - 1)
            self._pool.cache_blocks(rid, req.block_hashes, req.num_computed)
            self._recorder.started(req, local, external, self._recorder.job_bytes(job))
            req.status = Status.RUNNING
            req.send_full_table = True
            self.running.append(req)

    def requeue(self, req: EngineRequest) -> None:
        """Free a request whose load cannot be used and queue it to recompute."""
        self._pool.free(req.request_id)
        self.back_to_waiting(req)

    def back_to_waiting(self, req: EngineRequest) -> None:
        """Queue ``req`` first to recompute from scratch (its blocks already released or
        parked)."""
        req.status = Status.WAITING
        req.num_computed = 0
        req.send_full_table = True
        self.waiting.appendleft(req)
