"""The scheduler <-> worker contract: transfer jobs, step plans and worker reports.

The planner (scheduler side) decides every transfer and hands the workers a ``StepPlan``
each engine step. Workers execute it and answer with ``WorkerReport`` values, which the
planner sums over ranks. Nothing else crosses the boundary.

Block addressing. For one group, a transfer names the engine block ids of consecutive
logical positions ``first_block_index, first_block_index + 1, ...`` of the request and the
host slots of the offloaded blocks that cover them. Offloaded block ``k`` covers logical
engine blocks ``[k * factor, (k + 1) * factor)``; inside its slot, engine block ``i`` sits
at sub-block ``i % factor``. So the first slot may be entered mid-way (a load whose first
blocks are already in the engine's prefix cache, or a store whose first blocks are null
because they left the sliding window), and::

    len(slots) == ceil((first_block_index % factor + len(block_ids)) / factor)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NewType

JobId = NewType("JobId", int)
TierJobId = NewType("TierJobId", int)
"""Ids of tier jobs (``TierJob``): their own id space, allocated by the cascade tier."""

NULL_BLOCK_ID = 0
"""Engine block id 0 means "no data here"; it is never stored and never loaded into."""


class Direction(str, Enum):
    STORE = "store"
    """Engine (device) memory -> host tier."""
    LOAD = "load"
    """Host tier -> engine (device) memory."""


@dataclass(frozen=True)
class GroupTransfer:
    """The part of a job that touches one KV-cache group (see the module docstring)."""

    group: int
    block_ids: tuple[int, ...]
    first_block_index: int
    slots: tuple[int, ...]

    def validate(self, factor: int) -> None:
        """Raise ``ValueError`` unless the block ids and slots line up under ``factor``."""
        if not self.block_ids:
            raise ValueError(f"group {self.group}: empty transfer")
        if NULL_BLOCK_ID in self.block_ids:
            raise ValueError(f"group {self.group}: null block id in a transfer")
        skip = self.first_block_index % factor
        need = -(-(skip + len(self.block_ids)) // factor)
        if len(self.slots) != need:
            raise ValueError(
                f"group {self.group}: {len(self.block_ids)} engine blocks from logical index "
                f"{self.first_block_index} with factor {factor} need {need} slots, "
                f"got {len(self.slots)}")

    def pairs(self, factor: int) -> list[tuple[int, int, int]]:
        """``(engine block id, slot, sub-block index)`` for every engine block, in order."""
        out = []
        for i, block_id in enumerate(self.block_ids):
            pos = self.first_block_index % factor + i
            out.append((block_id, self.slots[pos // factor], pos % factor))
        return out


@dataclass(frozen=True)
class TransferJob:
    """One store or load for one request; ``groups`` holds one entry per group it touches."""

    job_id: JobId
    direction: Direction
    request_id: str
    groups: tuple[GroupTransfer, ...]

    @property
    def num_blocks(self) -> int:
        return sum(len(g.block_ids) for g in self.groups)


class TierOp(str, Enum):
    """What a tier job does. Lower tiers are the disk and remote tiers below host memory."""

    PROMOTE = "promote"
    """Lower tier -> host slot: read the block, verify it, write it into ``slot``."""
    DEMOTE = "demote"
    """Host slot -> lower tier: write the block's bytes from ``slot`` to the tier."""
    DELETE = "delete"
    """Remove the block from the lower tier (no slot)."""
    PURGE = "purge"
    """Remove every block of this namespace and rank from the lower tier (no key, no slot)."""


@dataclass(frozen=True)
class TierJob:
    """One block moved between host memory and a lower tier, on every rank.

    Attributes:
        job_id: unique among tier jobs; a job is done when every rank has reported it.
        op: what to do.
        tier: the lower tier's name (``"disk"``, ``"remote"``).
        key: the block's offload key (empty for ``PURGE``).
        group: the key's group (decides how many bytes of the slot are the block).
        slot: the host slot read (``DEMOTE``) or written (``PROMOTE``); -1 otherwise.
        snapshot: ``DEMOTE`` only: the slot is reused by this step's stores or promotes,
            so the worker copies its bytes before submitting anything else of the plan.
            Without it the cascade keeps the host key pinned until the job reports.
    """

    job_id: TierJobId
    op: TierOp
    tier: str
    key: bytes
    group: int = 0
    slot: int = -1
    snapshot: bool = False


@dataclass(frozen=True)
class TierWork:
    """Tier jobs a tier hands to the step plan (see ``StepPlan.tier_jobs``)."""

    flush: tuple[TierJobId, ...] = ()
    jobs: tuple[TierJob, ...] = ()


@dataclass(frozen=True)
class StepPlan:
    """What the workers must do this step, in this order.

    Before the step's forward pass:

    1. ``flush``: wait until these jobs are done (their engine blocks are about to be
       reused). Stores among them that are also in ``stores`` are submitted first.
    2. submit ``loads`` (the engine will not run these requests until the load reports).

    After the forward pass:

    3. submit the other ``stores``: they read blocks this step's forward pass writes.

    Jobs of one direction in flight together never write the same slot or engine block.

    Tier jobs (only with lower tiers, see ``kvoffload.tiers.cascade``) come first of all:
    wait for ``tier_flush`` (tier jobs from before a cache reset), copy the slots of
    ``snapshot`` demotes, then submit every tier job asynchronously.
    """

    flush: tuple[JobId, ...] = ()
    stores: tuple[TransferJob, ...] = ()
    loads: tuple[TransferJob, ...] = ()
    tier_flush: tuple[TierJobId, ...] = ()
    tier_jobs: tuple[TierJob, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.flush or self.stores or self.loads or self.tier_flush
                    or self.tier_jobs)


@dataclass(frozen=True)
class TransferStats:
    """Bytes moved and seconds spent by one worker since its previous report."""

    stored_bytes: int = 0
    loaded_bytes: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    flushed_jobs: int = 0
    """Jobs of earlier steps a step's plan flushed (engine blocks handed out again while
    a job still used them; some may have ended already)."""
    flush_wait_seconds: float = 0.0
    """Seconds steps waited for those jobs to end before the forward pass (the engine's
    step is held up that long)."""


@dataclass(frozen=True)
class WorkerReport:
    """What one rank finished since its last report. Every job appears once per rank."""

    rank: int
    finished: tuple[JobId, ...] = ()
    failed: tuple[JobId, ...] = ()
    stats: TransferStats = field(default_factory=TransferStats)
    tier_finished: tuple[TierJobId, ...] = ()
    """Tier jobs this rank completed (each exactly once)."""
    tier_failed: tuple[TierJobId, ...] = ()
    """Tier jobs this rank could not complete (a miss, a corrupt block, an I/O error)."""
    tier_unreachable: tuple[str, ...] = ()
    """Lower tiers this rank could not reach since its last report (skip them a while)."""


def merge_reports(reports: Sequence[WorkerReport]) -> tuple[dict[JobId, int], set[JobId]]:
    """Sum reports over ranks: per job, how many ranks reported it; and which jobs failed."""
    counts: dict[JobId, int] = {}
    failed: set[JobId] = set()
    for report in reports:
        for job in report.finished:
            counts[job] = counts.get(job, 0) + 1
        for job in report.failed:
            counts[job] = counts.get(job, 0) + 1
            failed.add(job)
    return counts, failed
