"""The fence: engine blocks that in-flight jobs still read or write.

An engine block in the fence must not be overwritten until its jobs finish. When the engine
hands such a block to someone again, the planner adds the jobs to the step's flush set, and
the workers wait for them before anything else touches the block.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from kvoffload.errors import InvariantError
from kvoffload.jobs import NULL_BLOCK_ID, JobId


class Fence:
    """Index from engine block id to the in-flight jobs that use it."""

    def __init__(self) -> None:
        self._jobs_by_block: dict[int, set[JobId]] = {}

    def add(self, job: JobId, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            if block == NULL_BLOCK_ID:
                raise InvariantError(f"job {job}: null block in fence")
            self._jobs_by_block.setdefault(block, set()).add(job)

    def remove(self, job: JobId, block_ids: Iterable[int]) -> None:
        for block in block_ids:
            jobs = self._jobs_by_block.get(block)
            if jobs is None or job not in jobs:
                raise InvariantError(f"job {job} is not fenced on block {block}")
            jobs.discard(job)
            if not jobs:
                del self._jobs_by_block[block]

    def jobs_using(self, block_ids: Collection[int]) -> set[JobId]:
        """Every fenced job that uses any of ``block_ids``."""
        found: set[JobId] = set()
        table = self._jobs_by_block
        if table.keys().isdisjoint(block_ids):
            return found  # the usual case: no fenced block among them (no step per block)
        for block in block_ids:
            jobs = table.get(block)
            if jobs:
                found |= jobs
        return found

    def clear(self) -> None:
        self._jobs_by_block.clear()

    def __len__(self) -> int:
        return len(self._jobs_by_block)

    def all_jobs(self) -> set[JobId]:
        out: set[JobId] = set()
        for jobs in self._jobs_by_block.values():
            out |= jobs
        return out
