"""Helpers for the hit-point policy tests: full attention + a window of 8 tokens.

The layout is two groups of 4-token blocks, a full-attention group (0) and a
sliding-window group (1) whose window is 8 tokens (2 blocks), so a hit is possible every 4
tokens. Host capacity counts blocks directly (``page_bytes`` is 0).
"""

from __future__ import annotations

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import StepPlan, WorkerReport
from kvoffload.keys import BlockHasher
from kvoffload.planner.contract import NO_CONTROLS, RequestControls, ScheduledRequest, StepInput
from kvoffload.planner.planner import Planner

WINDOW_GROUP = 1
"""The sliding-window group's index in ``config``'s layout."""


class Req:
    """A request of ``tokens``, the first ``prompt`` of them its prompt (all by default)."""

    def __init__(self, rid: str, tokens: list[int], hasher: BlockHasher,
                 prompt: int | None = None) -> None:
        self.request_id = rid
        self.tokens = tokens
        self.num_prompt_tokens = len(tokens) if prompt is None else prompt
        self.block_hashes = hasher.hashes(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def config(slots: int, policy: str = "hybrid") -> OffloadConfig:
    """The layout above with ``slots`` blocks of host memory under ``policy``."""
    return OffloadConfig(
        groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4),
                GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8)),
        hash_block_size=4, host_capacity_bytes=slots, eviction_policy=policy)


def stored_window_blocks(plan: StepPlan) -> list[int]:
    """Logical positions of the window group's blocks a plan stores."""
    out: list[int] = []
    for job in plan.stores:
        for t in job.groups:
            if t.group == WINDOW_GROUP:
                out.extend(range(t.first_block_index, t.first_block_index + len(t.block_ids)))
    return out


def prefill(planner: Planner, req: Req, first_block_id: int,
            controls: RequestControls = NO_CONTROLS) -> StepPlan:
    """Set ``controls`` (if any), look the request up (no hit), allocate one block per
    position and run its whole prefill in one step."""
    if controls is not NO_CONTROLS:
        planner.set_controls(req, controls)
    assert planner.get_num_new_matched_tokens(req, 0).num_tokens == 0
    n = req.num_tokens // 4
    table = tuple(range(first_block_id, first_block_id + n))
    planner.update_state_after_alloc(req, (table, table), 0)
    return planner.build_step_plan(StepInput((ScheduledRequest(
        req, (table, table), 0, req.num_tokens, num_freed_blocks=(0, 0)),)))


def complete(planner: Planner, plan: StepPlan) -> None:
    """Report every store of ``plan`` done."""
    planner.update_from_worker_reports(
        [WorkerReport(0, tuple(j.job_id for j in plan.stores))])
