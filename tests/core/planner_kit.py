"""Helpers for the planner scenario tests: hybrid layouts, tiny requests, hand-built steps.

The scenarios drive ``Planner`` + ``HostTier`` directly, the way an engine would, with
block tables written out by hand, so every assertion can name exact keys, slots and engine
block ids. Host capacity counts blocks directly (``page_bytes`` is 0), which keeps slot
arithmetic out of the stories.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import JobId, StepPlan, TransferJob, WorkerReport
from kvoffload.keys import BlockHash, BlockHasher, OffloadKey, make_offload_key
from kvoffload.planner.contract import (
    MatchResult,
    ReportOutcome,
    ScheduledRequest,
    StepInput,
)
from kvoffload.tiers.base import LookupResult
from support.offload_kit import host_tier, planner_for

Table = tuple[tuple[int, ...], ...]


def full(block_size: int = 4, name: str = "full") -> GroupSpec:
    return GroupSpec(GroupKind.FULL_ATTENTION, block_size, name=name)


def window(tokens: int, block_size: int = 4, name: str = "swa") -> GroupSpec:
    return GroupSpec(GroupKind.SLIDING_WINDOW, block_size, sliding_window=tokens, name=name)


def mamba(block_size: int = 4, alignment: int | None = None, name: str = "mamba") -> GroupSpec:
    return GroupSpec(GroupKind.MAMBA, block_size, state_alignment=alignment, name=name)


def make_config(*groups: GroupSpec, hash_block_size: int = 4, factor: int = 1,
                slots: int = 1000, workers: int = 1, max_deferred: int = 3,
                policy: str = "lru", every_block: bool = False) -> OffloadConfig:
    # By default a Mamba state exists only where a step ends (vLLM's align mode);
    # ``every_block`` models an engine that checkpoints it at every block boundary.
    return OffloadConfig(groups=groups, hash_block_size=hash_block_size,
                         block_size_factor=factor, num_workers=workers,
                         host_capacity_bytes=slots, eviction_policy=policy,
                         max_deferred_steps=max_deferred, mamba_states_every_block=every_block)


def three_groups(**kwargs: int) -> OffloadConfig:
    """The house layout: full attention, a window of 4 blocks (16 tokens), Mamba; bs 4."""
    return make_config(full(), window(16), mamba(), **kwargs)


@dataclass
class Req:
    """A request as the planner sees it (satisfies ``contract.RequestInfo``)."""

    request_id: str
    tokens: list[int]
    num_prompt_tokens: int
    hasher: BlockHasher
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.hasher.extend(self.block_hashes, self.tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def append(self, *tokens: int) -> None:
        self.tokens.extend(tokens)
        self.hasher.extend(self.block_hashes, self.tokens)


@dataclass(frozen=True)
class Moved:
    """One ``GroupTransfer`` with its slots translated back to the request's key indices."""

    group: int
    block_ids: tuple[int, ...]
    first_block_index: int
    key_indices: tuple[int, ...]


def prompt(n: int, base: int = 1000) -> list[int]:
    """``n`` distinct token ids; two prompts with the same base share their prefix."""
    return list(range(base, base + n))


class Harness:
    """A planner, its host tier, and shorthand for the calls an engine makes."""

    def __init__(self, config: OffloadConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: the planner's time source (a fake one for stories about seconds)."""
        self.config = config
        self.tier = host_tier(config)
        self.planner = planner_for(config, self.tier, clock=clock)
        self.hasher = BlockHasher(config.hash_block_size, seed="scenario")

    # -- requests and keys ------------------------------------------------------------

    def request(self, rid: str, tokens: Sequence[int]) -> Req:
        return Req(rid, list(tokens), len(tokens), self.hasher)

    def key(self, req: Req, group: int, k: int) -> OffloadKey:
        """Offload key of offloaded block ``k`` of ``group`` for ``req``'s tokens."""
        hpb = self.config.resolved[group].hashes_per_block
        return make_offload_key(req.block_hashes[(k + 1) * hpb - 1], group)

    def keys(self, req: Req, group: int, blocks: Iterable[int]) -> list[OffloadKey]:
        return [self.key(req, group, k) for k in blocks]

    def put(self, req: Req, group: int, blocks: Iterable[int]) -> None:
        """Make ``req``'s offloaded blocks ``blocks`` of ``group`` readable in the tier."""
        keys = self.keys(req, group, blocks)
        result = self.tier.prepare_store(keys)
        assert result is not None
        self.tier.complete_store(result.keys_to_store)

    def put_all(self, req: Req, blocks: int) -> None:
        """Make offloaded blocks ``0 .. blocks-1`` readable in every group."""
        for g in range(len(self.config.groups)):
            self.put(req, g, range(blocks))

    def status(self, req: Req, group: int, blocks: Iterable[int]) -> list[LookupResult]:
        return [self.tier.lookup(k) for k in self.keys(req, group, blocks)]

    def ref(self, req: Req, group: int, blocks: Iterable[int]) -> list[int | None]:
        return [self.tier.ref_count(k) for k in self.keys(req, group, blocks)]

    # -- engine calls -----------------------------------------------------------------

    def lookup(self, req: Req, num_computed: int = 0) -> MatchResult:
        return self.planner.get_num_new_matched_tokens(req, num_computed)

    def alloc(self, req: Req, table: Sequence[Sequence[int]], external: int) -> None:
        self.planner.update_state_after_alloc(req, table, external)

    def admit(self, req: Req, table: Sequence[Sequence[int]], num_computed: int = 0) -> MatchResult:
        """Look ``req`` up and allocate it without taking any hit (the engine computes it)."""
        result = self.lookup(req, num_computed)
        self.alloc(req, table, 0)
        return result

    def step(self, *scheduled: ScheduledRequest, preempted: Sequence[str] = (),
             other: Sequence[int] = ()) -> StepPlan:
        plan = self.planner.build_step_plan(
            StepInput(tuple(scheduled), tuple(preempted), tuple(other)))
        for job in (*plan.stores, *plan.loads):
            for t in job.groups:
                t.validate(self.config.resolved[t.group].factor)
        self.planner.check_integrity()
        return plan

    @staticmethod
    def sched(req: Req, new_ids: Sequence[Sequence[int]], computed: int, scheduled: int,
              *, resumed: bool = False, freed: Sequence[int] | None = None) -> ScheduledRequest:
        return ScheduledRequest(req, tuple(tuple(ids) for ids in new_ids), computed, scheduled,
                                resumed=resumed,
                                num_freed_blocks=None if freed is None else tuple(freed))

    def report(self, *jobs: JobId, rank: int = 0, failed: Sequence[JobId] = ()) -> ReportOutcome:
        return self.planner.update_from_worker_reports(
            [WorkerReport(rank, tuple(jobs), tuple(failed))])

    def complete(self, *jobs: JobId, failed: Sequence[JobId] = ()) -> ReportOutcome:
        """Every rank reports ``jobs`` done (and ``failed`` failed)."""
        outcome = self.planner.update_from_worker_reports(
            [WorkerReport(r, tuple(jobs), tuple(failed))
             for r in range(self.config.num_workers)])
        self.planner.check_integrity()
        return outcome

    # -- reading plans ----------------------------------------------------------------

    def moved(self, job: TransferJob, req: Req) -> list[Moved]:
        """The job's transfers, slots shown as indices into ``req``'s key list per group.

        Works for stores (slots reserved) and loads (slots pinned) alike: it maps each slot
        back to the key occupying it and finds that key among ``req``'s keys.
        """
        by_slot = {self.tier.slot_of(k): k for k in self.tier}
        out = []
        for t in job.groups:
            per_block = len(req.block_hashes) // self.config.resolved[t.group].hashes_per_block
            index = {self.key(req, t.group, k): k for k in range(per_block)}
            out.append(Moved(t.group, t.block_ids, t.first_block_index,
                             tuple(index[by_slot[s]] for s in t.slots)))
        return out

    def drained(self) -> bool:
        """Nothing in flight, fenced, pinned or being written; no request kept."""
        usage = self.tier.usage()
        return (self.planner.num_jobs == 0 and self.planner.fence_size == 0
                and self.planner.num_requests == 0 and usage.pinned_slots == 0
                and usage.writing_slots == 0)


def only(jobs: Sequence[TransferJob]) -> TransferJob:
    assert len(jobs) == 1, jobs
    return jobs[0]


LOAD_TABLE: Table = (tuple(range(1, 8)), (0, 0, 11, 12, 13, 14, 15), (0, 0, 0, 0, 0, 21, 22))


def start_load(h: Harness, num_computed: int = 0) -> tuple[Req, TransferJob]:
    """Request "a" (25 tokens, all 6 blocks in the tier) looked up after ``num_computed``
    tokens, allocated ``LOAD_TABLE`` and its load planned (``three_groups`` layout).

    Asserts the hit is the 24 stored tokens past ``num_computed``.
    """
    a = h.request("a", prompt(25))
    h.put_all(a, 6)
    external = 24 - num_computed
    assert h.lookup(a, num_computed) == MatchResult(external, load_async=True)
    h.alloc(a, LOAD_TABLE, external)
    return a, only(h.step().loads)
