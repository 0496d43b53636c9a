"""Every store checked at the moment it finishes: its host slots hold what the forward pass
wrote for that request at those positions.

A store reads engine blocks after the forward pass that wrote them, on the worker's copy
threads, while later steps run. If any of its blocks were overwritten before the copy
read them (a block freed and handed to another request, a Mamba running block moving on)
or the store read the wrong block (a Mamba state from a column that does not hold the
boundary state), the slot holds other bytes. ``StoreCheck`` remembers each store job of a
plan with the request's tokens of that step, and, when a worker report names the job
finished, compares every page of every slot against the values the scripted forward pass
writes (``attention_runner.kv_values`` for attention, the final ``draft_values`` for a
speculative drafter's layers, ``mamba_runner.state_tensors`` for Mamba states): rule 4
("no engine block is overwritten while a store still reads it") and rule 6 ("loaded bytes
equal stored bytes", its store half) of ``docs/architecture.md``, checked directly instead
of only through the loads that happen to follow, and, for a drafter's layers, rule 5's
draft clause: a store of a draft block that is still volatile fails.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

Expected = Callable[[int, int, Sequence[int]], list[torch.Tensor]]
"""``(group, engine block position, tokens) -> one tensor per page segment``."""


@dataclass
class StoreCheck:
    """Store jobs in flight and what their slots must hold (module docstring)."""

    expected: Expected
    host_pool: Callable[[], Any]
    factor: int
    pending: dict[Any, tuple[str, Any, list[int]]] = field(default_factory=dict)
    checked_pages: int = 0

    def planned(self, stores: Sequence[Any], tokens: dict[str, list[int]]) -> None:
        """Remember this step's store jobs with their request's tokens of the step."""
        for job in stores:
            self.pending[job.job_id] = (job.request_id, job.groups, tokens[job.request_id])

    def reported(self, reports: Sequence[Any]) -> None:
        """Check the slots of every store a report names finished; forget failed ones."""
        for report in reports:
            for job_id in report.failed:
                self.pending.pop(job_id, None)
            for job_id in report.finished:
                entry = self.pending.pop(job_id, None)
                if entry is not None:
                    self._check(job_id, *entry)

    def _check(self, job_id: Any, rid: str, transfers: Sequence[Any],
               tokens: list[int]) -> None:
        pool = self.host_pool()
        for transfer in transfers:
            for i, (block, slot, sub) in enumerate(transfer.pairs(self.factor)):
                position = transfer.first_block_index + i
                pages = self.expected(transfer.group, position, tokens)
                for segment, want in enumerate(pages):
                    got = pool.page_view(slot, transfer.group, segment, sub)
                    if not torch.equal(got, want.contiguous().view(-1).view(torch.uint8)):
                        raise AssertionError(
                            f"store {job_id} of request {rid}: group {transfer.group} "
                            f"position {position} (engine block {block}, slot {slot}) "
                            f"segment {segment} does not hold what the forward pass wrote "
                            f"(a drafter's layer: its final values)")
                    self.checked_pages += 1
