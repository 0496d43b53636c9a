"""A small simulated engine that drives the planner the way an engine would.

It models what matters for the planner's rules: per-group block tables in one shared pool
of block ids (id 0 = null), sliding-window and Mamba blocks freed while a request runs,
chunked prefill, decode, preemption, aborts, and workers that finish jobs late, out of
order, split across ranks, or not at all (failures).

Block contents are symbolic: the content of engine block ``p`` of group ``g`` is the tuple
of tokens it summarises (its prefix up to the block's end), so every block read by the
engine, and every block loaded, is checked against what it must hold. The worker copies
at the *latest* legal moment (when a rank reports, or when flushed), which exposes any
block overwritten while a job still used it.

Speculative decoding (``speculative_tokens`` k > 0): a decoding request is scheduled for
its next token and k draft tokens; the step accepts some of the drafts (``accept``), and
only the accepted tokens become the request's. A draft model's group
(``GroupSpec.proof_tokens`` P) holds at a position KV that depends on the P tokens after
it: its block's content is the prefix up to P tokens past the block's end, as far as the
request has computed, and each forward pass rewrites the blocks that reach into its tokens.
Such a block is *final* once P tokens past it are computed; a store must copy only final
blocks, and a load must bring the final block of the loading request's own tokens.

Used by the property tests and, with real bytes, by the worker end-to-end tests.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.config import GroupKind, OffloadConfig
from kvoffload.jobs import NULL_BLOCK_ID, Direction, JobId, StepPlan, TransferJob, WorkerReport
from kvoffload.keys import BlockHash, BlockHasher
from kvoffload.offload import build_offload
from kvoffload.planner.contract import NO_CONTROLS, RequestControls, ScheduledRequest, StepInput
from kvoffload.policies import CachePolicy
from kvoffload.tiers.base import LookupResult

Content = tuple[int, ...]
GARBAGE: Content = (-1,)


class RuleViolation(AssertionError):  # noqa: N818 - reads as the rule it reports
    """The planner broke one of the rules of docs/architecture.md."""


@dataclass
class SimRequest:
    """An engine request; satisfies ``kvoffload.planner.contract.RequestInfo``."""

    request_id: str
    tokens: list[int]
    num_prompt_tokens: int
    max_new_tokens: int
    hasher: BlockHasher
    block_hashes: list[BlockHash] = field(default_factory=list)
    state: str = "waiting"  # waiting | loading | running | done
    num_computed: int = 0
    tables: list[list[int]] = field(default_factory=list)
    send_full_table: bool = True
    resumed: bool = False
    deferrals: int = 0
    deferred_since: float = 0.0
    planned_end: int = 0
    controls: RequestControls = NO_CONTROLS

    def __post_init__(self) -> None:
        self.hasher.extend(self.block_hashes, self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def append_token(self, token: int) -> None:
        self.tokens.append(token)
        self.hasher.extend(self.block_hashes, self.tokens)


class SymbolicDevice:
    """Engine memory holding symbolic contents, keyed by block id."""

    def __init__(self) -> None:
        self.data: dict[int, Content] = {}

    def write(self, group: int, block: int, content: Content) -> None:
        del group
        self.data[block] = content

    def holds(self, group: int, block: int, content: Content) -> bool:
        del group
        return self.data.get(block) == content


@dataclass
class InFlight:
    job: TransferJob
    expected_gen: dict[int, int]
    pending_ranks: set[int]
    copied: bool = False
    failed: bool = False


class SimWorkers:
    """Symbolic workers for every rank: execute plans, copy late, report per rank."""

    def __init__(self, engine: SimEngine, num_workers: int, factors: list[int]) -> None:
        self.engine = engine
        self.num_workers = num_workers
        self.factors = factors
        self.host: dict[tuple[int, int], Content] = {}
        self.inflight: dict[JobId, InFlight] = {}

    @property
    def idle(self) -> bool:
        return not self.inflight

    def end(self) -> None:
        """Stores are copied when reported, after the forward pass: nothing to do here."""

    def begin(self, plan: StepPlan) -> None:
        for job in (*plan.stores, *plan.loads):
            expected = {b: self.engine.gen[b] for t in job.groups for b in t.block_ids}
            self.inflight[job.job_id] = InFlight(job, expected, set(range(self.num_workers)))
        for job_id in plan.flush:
            flight = self.inflight.get(job_id)
            if flight is not None and not flight.copied:
                self._copy(flight)

    def _copy(self, flight: InFlight) -> None:
        flight.copied = True
        job = flight.job
        for t in job.groups:
            for block, slot, sub in t.pairs(self.factors[t.group]):
                if self.engine.written_gen.get(block, -1) > flight.expected_gen[block]:
                    raise RuleViolation(
                        f"rule 4: job {job.job_id} ({job.direction.value}) touched block "
                        f"{block} after its new owner wrote it")
                device = self.engine.device
                assert isinstance(device, SymbolicDevice)
                if job.direction is Direction.STORE:
                    self.host[(slot, sub)] = GARBAGE if flight.failed else device.data[block]
                else:
                    device.data[block] = (GARBAGE if flight.failed
                                          else self.host.get((slot, sub), GARBAGE))

    def deliver(self, rng: random.Random, fraction: float, fail_rate: float) -> list[WorkerReport]:
        """Report a random share of the pending (job, rank) pairs, in random order."""
        pairs = [(j, r) for j, f in self.inflight.items() for r in f.pending_ranks]
        rng.shuffle(pairs)
        pairs = pairs[:max(0, round(len(pairs) * fraction))]
        by_rank: dict[int, tuple[list[JobId], list[JobId]]] = {}
        for job_id, rank in pairs:
            flight = self.inflight[job_id]
            if not flight.copied:
                flight.failed = rng.random() < fail_rate
                self._copy(flight)
            flight.pending_ranks.discard(rank)
            ok, bad = by_rank.setdefault(rank, ([], []))
            (bad if flight.failed else ok).append(job_id)
            if not flight.pending_ranks:
                del self.inflight[job_id]
        return [WorkerReport(rank, tuple(ok), tuple(bad)) for rank, (ok, bad) in by_rank.items()]


class SimEngine:
    """The simulated engine. ``step`` runs one scheduler step and checks the rules."""

    def __init__(self, config: OffloadConfig, num_blocks: int, seed: int = 0,
                 real: RealBackendFactory | None = None, *,
                 policy: CachePolicy | None = None, speculative_tokens: int = 0,
                 leave_out_idle: bool = True) -> None:
        self.config = config
        self.leave_out_idle = leave_out_idle
        """Leave requests whose step needs nothing of the planner out of the step
        (``Planner.step_is_idle``), as the vLLM adapter does; False lists every one."""
        self.speculative_tokens = speculative_tokens
        """Draft tokens scheduled with every decoding request's next token (0: none)."""
        self.accept: Callable[[int], int] = lambda k: k
        """How many of ``k`` draft tokens a step accepts (set by the tests)."""
        self.max_deferral_s = config.min_deferral_s
        """Rule 8: a request may be deferred past ``max_deferred_steps`` times only this
        long (wall clock) since its first deferral; a run over a tier that waits on a
        server's answers sets the tier's bound (``Tier.answer_wait_s``)."""
        offload = build_offload(config, policy=policy)  # policy None: the one config names
        self.tier = offload.host
        self.planner = offload.planner
        self.groups = config.resolved
        self.hasher = BlockHasher(config.hash_block_size, seed="sim")
        self.free: list[int] = list(range(num_blocks, 0, -1))
        self.gen: dict[int, int] = {}
        self.written_gen: dict[int, int] = {}
        self.device: SymbolicDevice | Device = SymbolicDevice()
        self._next_gen = 0
        self.requests: dict[str, SimRequest] = {}
        self.workers: SimWorkers | Workers = SimWorkers(self, config.num_workers,
                                                        [g.factor for g in self.groups])
        if real is not None:
            self.device, self.workers = real(self, num_blocks)
        self.stored_ok: set[bytes] = set()
        self.loaded_blocks = 0
        self.loaded_draft_blocks = 0
        self.rejected_drafts = 0
        """Draft tokens scheduled and not accepted."""
        self.hit_tokens = 0
        self.recomputed_loads = 0
        self.rng = random.Random(seed)
        self._hit_writes: list[tuple[SimRequest, int]] = []

    def _idle(self, sched: ScheduledRequest) -> bool:
        """Whether ``sched`` is left out of the planner's step (``leave_out_idle``)."""
        return (self.leave_out_idle and sched.may_be_idle
                and self.planner.step_is_idle(sched.request.request_id, sched.offloadable))

    # -------------------------------------------------------------- blocks

    def _alloc(self) -> int | None:
        if not self.free:
            return None
        block = self.free.pop()
        self._next_gen += 1
        self.gen[block] = self._next_gen
        return block

    def _release(self, block: int) -> None:
        if block != NULL_BLOCK_ID:
            self.free.append(block)

    def _free_request_blocks(self, req: SimRequest) -> None:
        for table in req.tables:
            for block in table:
                self._release(block)
        req.tables = []

    def depth(self, group: int, pos: int) -> int:
        """Tokens the content of ``group``'s block ``pos`` depends on once final: its
        prefix, and for a draft model's group the proof tokens after it."""
        spec = self.groups[group].spec
        return (pos + 1) * spec.block_size + spec.proof_tokens

    def content(self, req: SimRequest, group: int, pos: int, upto: int) -> Content:
        return (group, pos, *req.tokens[:min(self.depth(group, pos), upto)])

    def is_final(self, req: SimRequest, group: int, pos: int, content: Content) -> bool:
        """Whether ``content`` is block ``pos``'s final content for ``req``'s tokens."""
        depth = self.depth(group, pos)
        return depth <= req.num_tokens and content == self.content(req, group, pos, depth)

    def _skipped_positions(self, group: int, computed: int) -> int:
        """Leading positions the engine no longer needs once ``computed`` tokens exist."""
        g = self.groups[group]
        bs = g.spec.block_size
        if g.kind is GroupKind.SLIDING_WINDOW:
            assert g.spec.sliding_window is not None
            return max(0, computed - g.spec.sliding_window + 1) // bs
        if g.kind is GroupKind.MAMBA:
            return max(0, computed // bs - 1)
        return 0

    def _grow_tables(self, req: SimRequest, upto: int) -> bool:
        """Allocate blocks so every group covers ``upto`` tokens; False if out of blocks."""
        need = []
        for gi, g in enumerate(self.groups):
            table = req.tables[gi]
            want = -(-upto // g.spec.block_size)
            skipped = self._skipped_positions(gi, req.num_computed)
            for pos in range(len(table), want):
                need.append((gi, pos < skipped))
        if sum(1 for _, null in need if not null) > len(self.free):
            return False
        for gi, null in need:
            block = NULL_BLOCK_ID if null else self._alloc()
            assert block is not None
            req.tables[gi].append(block)
        return True

    def _free_skipped(self, req: SimRequest) -> None:
        for gi, table in enumerate(req.tables):
            for pos in range(min(self._skipped_positions(gi, req.num_computed), len(table))):
                if table[pos] != NULL_BLOCK_ID:
                    self._release(table[pos])
                    table[pos] = NULL_BLOCK_ID

    def _state_at_step_end(self, group: int) -> bool:
        """Whether ``group`` is a Mamba group whose state exists only where a step ends
        (vLLM's align mode); with ``mamba_states_every_block`` every block end has one."""
        return (self.groups[group].kind is GroupKind.MAMBA
                and not self.config.mamba_states_every_block)

    def _write(self, req: SimRequest, start: int, end: int, *, cached: bool = False) -> None:
        """The forward pass: write KV for tokens ``[start, end)``.

        A Mamba group (unless ``mamba_states_every_block``) gets one state, the one at
        ``end``, in the block holding ``end``: the blocks whose ends the step crossed never
        see the state at their end. ``cached``: the blocks of the engine's own prefix hit,
        which hold their final contents.
        """
        for gi, table in enumerate(req.tables):
            spec = self.groups[gi].spec
            bs = spec.block_size
            # A draft group's earlier blocks reach into these tokens: rewritten too.
            first = max(0, start - spec.proof_tokens) // bs
            if self._state_at_step_end(gi):
                first = max(first, -(-end // bs) - 1)
            for pos in range(first, -(-end // bs)):
                block = table[pos]
                if block == NULL_BLOCK_ID:
                    continue
                # A cached block (the engine's own prefix hit) holds its final content.
                upto = self.depth(gi, pos) if cached else end
                self.device.write(gi, block, self.content(req, gi, pos, upto))
                self.written_gen[block] = self.gen[block]

    def _holds(self, req: SimRequest, group: int, pos: int, computed: int, block: int) -> bool:
        """Whether ``block`` holds position ``pos`` of ``group`` with >= ``computed`` tokens.

        A block may hold more tokens than the engine counts as computed (a loaded last
        block whose final token the engine recomputes), never fewer or other ones.
        """
        depth = self.depth(group, pos)
        lowest = min(depth, computed)
        return any(self.device.holds(group, block, self.content(req, group, pos, upto))
                   for upto in range(lowest, min(depth, req.num_tokens) + 1))

    def _verify_readable(self, req: SimRequest) -> None:
        """Rule 6: every block the engine reads holds exactly what it must."""
        c = req.num_computed
        for gi, table in enumerate(req.tables):
            bs = self.groups[gi].spec.block_size
            positions = range(min(len(table), -(-c // bs)))
            if self._state_at_step_end(gi):
                positions = positions[-1:]  # the one state the step reads: the one at c
            for pos in positions:
                block = table[pos]
                if block == NULL_BLOCK_ID:
                    continue
                if not self._holds(req, gi, pos, c, block):
                    raise RuleViolation(
                        f"rule 6: request {req.request_id} group {gi} position {pos} (block "
                        f"{block}) holds wrong data")

    # ------------------------------------------------------------ requests

    def add_request(self, tokens: list[int], max_new_tokens: int,
                    controls: RequestControls = NO_CONTROLS) -> SimRequest:
        rid = f"r{len(self.requests)}"
        req = SimRequest(rid, list(tokens), len(tokens), max_new_tokens, self.hasher,
                         controls=controls)
        self.requests[rid] = req
        if controls is not NO_CONTROLS:
            self.planner.set_controls(req, controls)
        return req

    def _finish(self, req: SimRequest) -> None:
        self.planner.request_finished(req, req.tables)
        self._free_request_blocks(req)
        req.state = "done"

    def abort(self, req: SimRequest) -> None:
        if req.state != "done":
            self._finish(req)

    def preempt(self, req: SimRequest) -> str | None:
        if req.state != "running":
            return None
        self._free_request_blocks(req)
        req.state = "waiting"
        req.num_computed = 0
        req.resumed = True
        return req.request_id

    # --------------------------------------------------------------- step

    def _admit(self, req: SimRequest) -> None:
        """Look the request up and allocate it (the engine's waiting-queue pass)."""
        local = 0
        if self.rng.random() < 0.3 and req.num_tokens > 1:
            bss = [g.spec.block_size for g in self.groups]
            step = max(bss)
            while any(step % b for b in bss):
                step += max(bss)
            # The engine's own prefix cache proves a draft block as kvoffload must: only
            # with the tokens after it (vLLM drops such a hit's last block).
            proof = max(g.spec.proof_tokens for g in self.groups)
            if req.num_tokens > proof:
                local = self.rng.randrange(0, req.num_tokens - proof) // step * step
        result = self.planner.get_num_new_matched_tokens(req, local)
        if result.num_tokens is None:
            now = time.monotonic()
            if req.deferrals == 0:
                req.deferred_since = now
            req.deferrals += 1
            if (req.deferrals > self.config.max_deferred_steps
                    and now - req.deferred_since > self.max_deferral_s):
                raise RuleViolation(f"rule 8: {req.request_id} deferred {req.deferrals} times "
                                    f"over {now - req.deferred_since:.3f} s")
            return
        req.deferrals = 0
        hits = result.num_tokens
        end = local + hits
        cap = req.controls.max_load_tokens
        if cap is not None and hits > cap:
            raise RuleViolation(f"rule 9: {req.request_id} offered {hits} tokens, "
                                f"max_load_tokens is {cap}")
        if hits:
            if end % self.config.hit_alignment:
                raise RuleViolation(f"rule 5: hit end {end} not aligned")
            cap = req.num_tokens - (1 if self.config.has_windowed_group else 0)
            if end > cap:
                raise RuleViolation(f"rule 5: hit end {end} beyond cap {cap}")
        req.tables = [[] for _ in self.groups]
        req.num_computed = end
        if not self._grow_tables(req, max(end, 1)):
            req.tables = []
            req.num_computed = 0
            return
        self._free_skipped(req)
        # The engine's own prefix hit: its blocks get their data before this step's
        # forward pass (after the plan's flush), as cached blocks would hold it.
        self._hit_writes.append((req, local))
        self.planner.update_state_after_alloc(req, req.tables, hits)
        self.hit_tokens += hits
        req.send_full_table = True
        if hits:
            req.state = "loading"
            req.planned_end = end
        else:
            req.state = "running"

    def step(self, chunk: int, deliver_fraction: float, fail_rate: float,
             preempt: SimRequest | None = None, abort: SimRequest | None = None) -> None:
        preempted: list[str] = []
        if preempt is not None:
            rid = self.preempt(preempt)
            if rid:
                preempted.append(rid)
        if abort is not None:
            self.abort(abort)
        for req in list(self.requests.values()):
            if req.state == "waiting":
                self._admit(req)
        scheduled: list[tuple[SimRequest, ScheduledRequest, int]] = []
        for req in list(self.requests.values()):
            if req.state != "running":
                continue
            c = req.num_computed
            if c >= req.num_tokens:
                if req.num_tokens - req.num_prompt_tokens >= req.max_new_tokens:
                    self._finish(req)
                    continue
                req.append_token(self.rng.randrange(50))
            n = min(chunk, req.num_tokens - c)
            drafts = 0
            if self.speculative_tokens and c + n == req.num_tokens \
                    and req.num_tokens > req.num_prompt_tokens:
                drafts = self.speculative_tokens  # decoding: the drafts come along
            before = [len(t) for t in req.tables]
            self._free_skipped(req)
            if not self._grow_tables(req, c + n + drafts):
                rid = self.preempt(req)
                if rid:
                    preempted.append(rid)
                continue
            if req.send_full_table:
                new_ids = tuple(tuple(t) for t in req.tables)
            else:
                new_ids = tuple(tuple(t[b:]) for t, b in zip(req.tables, before, strict=True))
            freed = tuple(self._skipped_positions(gi, c) for gi in range(len(self.groups)))
            sched = ScheduledRequest(req, new_ids, c, n + drafts, resumed=req.resumed and
                                     req.send_full_table, num_freed_blocks=freed)
            req.send_full_table = False
            req.resumed = False
            scheduled.append((req, sched, n + drafts))
        plan = self.planner.build_step_plan(StepInput(
            tuple(s for _, s, _ in scheduled if not self._idle(s)), tuple(preempted)))
        self._check_plan(plan)
        self.workers.begin(plan)
        for req, local in self._hit_writes:
            if req.tables:
                self._write(req, 0, local, cached=True)
        self._hit_writes.clear()
        for req, _, scheduled_tokens in scheduled:
            self._verify_readable(req)
            n, known = scheduled_tokens, req.num_tokens - req.num_computed
            if scheduled_tokens > known:  # speculative: accepted drafts become its tokens
                accepted = min(self.accept(scheduled_tokens - known), scheduled_tokens - known)
                self.rejected_drafts += scheduled_tokens - known - accepted
                for _ in range(accepted):
                    req.append_token(self.rng.randrange(50))
                n = known + accepted
            self._write(req, req.num_computed, req.num_computed + n)
            req.num_computed += n
        self._check_stores_final(plan)
        self.workers.end()
        self.deliver(deliver_fraction, fail_rate)
        self.planner.check_integrity()
        self._check_tier()

    def deliver(self, fraction: float, fail_rate: float) -> None:
        reports = self.workers.deliver(self.rng, fraction, fail_rate)
        outcome = self.planner.update_from_worker_reports(reports)
        failed = {f.request_id for f in outcome.failed_loads}
        for rid in outcome.finished_loads:
            req = self.requests[rid]
            if req.state != "loading":
                continue
            if rid in failed:
                # Recompute: the engine starts the request again without the load.
                self.recomputed_loads += 1
                self._free_request_blocks(req)
                req.state = "waiting"
                req.num_computed = 0
                continue
            self._check_loaded(req)
            req.state = "running"
            if req.num_computed >= req.num_tokens:
                req.num_computed = req.num_tokens - 1

    def _check_loaded(self, req: SimRequest) -> None:
        c = req.num_computed
        for gi, table in enumerate(req.tables):
            bs = self.groups[gi].spec.block_size
            positions = range(min(len(table), c // bs))
            if self._state_at_step_end(gi):
                positions = positions[-1:]  # a load brings the one state at the hit
            draft = self.groups[gi].spec.proof_tokens > 0
            for pos in positions:
                block = table[pos]
                if block == NULL_BLOCK_ID:
                    continue
                if draft:
                    # Rule 5: only the final block of this request's own tokens will do.
                    device = self.device
                    if not (isinstance(device, SymbolicDevice) and self.is_final(
                            req, gi, pos, device.data.get(block, GARBAGE))):
                        raise RuleViolation(
                            f"rule 5: loaded draft block {block} of {req.request_id} group "
                            f"{gi} position {pos} is not the final one of its tokens")
                elif not self._holds(req, gi, pos, c, block):
                    raise RuleViolation(f"rule 6: loaded block {block} of {req.request_id} "
                                        f"group {gi} position {pos} is wrong")
                self.loaded_blocks += 1
                self.loaded_draft_blocks += draft

    def _check_stores_final(self, plan: StepPlan) -> None:
        """A draft model's block is stored only once final (its proof tokens computed):
        checked when the store is submitted, after the forward pass (a copy may run then)."""
        device = self.device
        if not isinstance(device, SymbolicDevice):
            return
        for job in plan.stores:
            req = self.requests[job.request_id]
            for t in job.groups:
                if not self.groups[t.group].spec.proof_tokens:
                    continue
                for i, block in enumerate(t.block_ids):
                    pos = t.first_block_index + i
                    data = device.data.get(block, GARBAGE)
                    if not self.is_final(req, t.group, pos, data) \
                            or self.depth(t.group, pos) > req.num_computed:
                        raise RuleViolation(
                            f"rule 7: store {job.job_id} of {req.request_id} copies draft "
                            f"block {block} (group {t.group} position {pos}) before the "
                            f"tokens it depends on are computed")

    def _check_plan(self, plan: StepPlan) -> None:
        for job in (*plan.stores, *plan.loads):
            for t in job.groups:
                t.validate(self.groups[t.group].factor)
        for job in plan.stores:
            cap = self.requests[job.request_id].controls.max_store_tokens
            for t in job.groups:
                block_size = self.groups[t.group].spec.block_size
                end = (t.first_block_index + len(t.block_ids)) * block_size
                if cap is not None and end > cap:
                    raise RuleViolation(f"rule 9: store of {job.request_id} reaches token "
                                        f"{end}, max_store_tokens is {cap}")

    def _check_tier(self) -> None:
        """Rule 1: readable keys were stored by jobs every worker completed."""
        for key in self.tier:
            if self.tier.lookup(key) is LookupResult.HIT:
                continue
            if self.tier.lookup(key) is LookupResult.PENDING and self.workers.idle:
                # A store whose reports are all in must have resolved the key.
                raise RuleViolation("rule 1: key still being written with no job in flight")

    def reset_cache(self) -> None:
        self.planner.reset_cache()

    # ---------------------------------------------------------------- end

    def drain(self, max_steps: int = 500) -> None:
        """Finish every request and deliver every report; then nothing may be held."""
        for req in self.requests.values():
            if req.state in ("waiting", "running"):
                self.abort(req)
        for _ in range(max_steps):
            if self.workers.idle and not self.planner.has_pending_work():
                break
            plan = self.planner.build_step_plan(StepInput())
            self.workers.begin(plan)
            self.workers.end()
            self.deliver(1.0, 0.0)
            for req in self.requests.values():
                if req.state in ("waiting", "running"):
                    self.abort(req)
        for req in self.requests.values():
            if req.state == "loading":
                raise RuleViolation(f"rule 8: {req.request_id} still loading after drain")
        self.planner.check_integrity()
        usage = self.tier.usage()
        problems = []
        if self.planner.num_jobs:
            problems.append(f"{self.planner.num_jobs} jobs in flight")
        if self.planner.fence_size:
            problems.append(f"{self.planner.fence_size} fenced blocks")
        if self.planner.num_requests:
            problems.append(f"{self.planner.num_requests} requests kept")
        if usage.pinned_slots or usage.writing_slots:
            problems.append(f"{usage.pinned_slots} pinned, {usage.writing_slots} writing slots")
        if problems:
            raise RuleViolation("rule 2: after drain: " + ", ".join(problems))


class Device(Protocol):
    """Engine memory: writes symbolic contents, tells whether a block holds one."""

    def write(self, group: int, block: int, content: Content) -> None: ...

    def holds(self, group: int, block: int, content: Content) -> bool: ...


class Workers(Protocol):
    """Every rank's worker, seen from the engine loop."""

    @property
    def idle(self) -> bool: ...

    def begin(self, plan: StepPlan) -> None: ...

    def end(self) -> None: ...

    def deliver(self, rng: random.Random, fraction: float,
                fail_rate: float) -> list[WorkerReport]: ...


RealBackendFactory = Callable[[SimEngine, int], tuple[Device, Workers]]
