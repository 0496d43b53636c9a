"""The transfer worker: one per rank, executing the planner's ``StepPlan`` each step.

Life cycle::

    worker = TransferWorker(config, rank=r)
    worker.register_kv_caches([GroupTensors(0, [...]), GroupTensors(1, [...])])
    every step:
        worker.execute(plan)        # flush, then submit stores, then loads
        report = worker.poll()      # -> planner.update_from_worker_reports([...all ranks])
    worker.shutdown()

Tensor parallelism: every rank runs its own worker over its own shard tensors and its own
host arena; slot ids are shared (the planner allocates them once for all ranks), and each
rank reports every job once.

Lower tiers: with ``tiers=TierConfig(...)`` the worker also runs the plans' tier jobs
(promotes from disk/remote into host slots, demotes, deletes) on its ``TierIO`` threads,
started first thing in ``begin_step`` and reported in the same ``WorkerReport``.

Validation happens here, at submit, not inside a copy thread: a job naming an unregistered
group, a null or out-of-range engine block, an out-of-range slot, a slot count that does not
match ``block_size_factor``, or two writes to the same destination is not started and is
reported failed by the next ``poll``. Failed jobs leave the slots they named untouched or
partly written; the host tier frees them and may reuse them at once.

A backend that reports a job it is not running (a second report, or an id never
submitted) breaks its contract: the worker drops that report, logs an error and counts it
in ``backend_errors``, so the scheduler still hears of each job exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch

from kvoffload.config import OffloadConfig
from kvoffload.errors import InvariantError
from kvoffload.jobs import (
    NULL_BLOCK_ID,
    Direction,
    GroupTransfer,
    JobId,
    StepPlan,
    TierJobId,
    TransferJob,
    WorkerReport,
)
from kvoffload.sizes import parse_size
from kvoffload.tiers.config import TierConfig
from kvoffload.worker.backend import FaultHook, TransferBackend
from kvoffload.worker.cpu_common import CHUNK_BYTES, PARALLEL_BYTES
from kvoffload.worker.cpu_memmove import BATCH_BYTES, MemmoveCpuBackend
from kvoffload.worker.cpu_native import NativeCpuBackend
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout, GroupTensors
from kvoffload.worker.native_copy import load_native_copy
from kvoffload.worker.tier_io import TierIO, TierIOReport

logger = logging.getLogger(__name__)


def default_backend(device: torch.device, *,
                    staging_bytes: int | None = None) -> TransferBackend:
    """The backend for caches on ``device``: CUDA streams for a GPU, threads for the CPU
    (``cpu_backend``).

    ``staging_bytes``: the CUDA backend's device staging budget per direction (None: its
    default, ``kvoffload.worker.cuda.DEFAULT_STAGING_BYTES``); the CPU backends copy
    directly and ignore it.
    """
    if device.type == "cuda":
        from kvoffload.worker.cuda import CudaBackend

        return CudaBackend() if staging_bytes is None \
            else CudaBackend(staging_bytes=staging_bytes)
    return cpu_backend()


def cpu_backend(*, native_copy: bool | None = None, copy_threads: int | None = None,
                parallel_bytes: int = PARALLEL_BYTES, batch_bytes: int = BATCH_BYTES,
                chunk_bytes: int = CHUNK_BYTES,
                fault_hook: FaultHook | None = None) -> NativeCpuBackend | MemmoveCpuBackend:
    """A new, unbound CPU backend on the copy path ``native_copy`` asks for.

    Args:
        native_copy: ``None`` (default): the native queue (``_copy.c``) where the install
            built it and ``KVOFFLOAD_NATIVE_COPY=0`` does not turn it off, else
            ``ctypes.memmove`` from Python threads; ``True`` requires the native queue
            (``RuntimeError`` saying how to get it where it is missing); ``False`` copies
            with ``ctypes.memmove``.
        batch_bytes: the ``memmove`` path's pass size (``MemmoveCpuBackend``); the native
            queue takes no batches.
        copy_threads, parallel_bytes, chunk_bytes, fault_hook: as ``CpuBackend`` takes
            them (each copy path's class says how it uses ``parallel_bytes``).
    """
    library = load_native_copy() if native_copy is None else None
    if native_copy or library is not None:
        # native_copy=True: no library passed, so the backend loads it, or raises.
        return NativeCpuBackend(library=library, copy_threads=copy_threads,
                                parallel_bytes=parallel_bytes, chunk_bytes=chunk_bytes,
                                fault_hook=fault_hook)
    return MemmoveCpuBackend(copy_threads=copy_threads, parallel_bytes=parallel_bytes,
                             batch_bytes=batch_bytes, chunk_bytes=chunk_bytes,
                             fault_hook=fault_hook)


class TransferWorker:
    """Moves one rank's KV blocks between its engine caches and its host arena."""

    def __init__(self, config: OffloadConfig, rank: int = 0,
                 backend: TransferBackend | None = None, *,
                 pin_memory: bool | None = None, tiers: TierConfig | None = None,
                 staging_bytes: int | str | None = None) -> None:
        """Args:
            config: the offload configuration (groups, factor, host capacity).
            rank: this worker's tensor-parallel rank, echoed in its reports.
            backend: how bytes move; by default chosen from the caches' device at
                registration (``default_backend``).
            pin_memory: pin the host arena; by default when CUDA is available.
            tiers: the lower tiers (disk, remote) this rank reads and writes for the
                plans' tier jobs (``kvoffload.worker.tier_io``); None: host memory only.
            staging_bytes: the device staging budget per direction of the default CUDA
                backend, a size (``kvoffload.sizes``); None: its default (64 MiB). The CPU
                backends ignore it. With an explicit ``backend``, configure that instead.

        Raises ``ConfigError`` for a ``staging_bytes`` that is not a positive size.
        """
        if not 0 <= rank < config.num_workers:
            raise ValueError(f"rank {rank} outside [0, num_workers={config.num_workers})")
        if staging_bytes is not None and backend is not None:
            raise ValueError("staging_bytes configures the default CUDA backend; with an "
                             "explicit backend pass CudaBackend(staging_bytes=...) instead")
        self._staging_bytes = None if staging_bytes is None \
            else parse_size(staging_bytes, "staging_bytes", minimum=1)
        self.config = config
        self.rank = rank
        self._backend = backend
        self._pin = pin_memory
        self._layout: CacheLayout | None = None
        self._pool: HostPool | None = None
        self._in_flight: set[JobId] = set()
        self._rejected: list[JobId] = []
        self._deferred_stores: list[TransferJob] = []
        self._tiers = tiers
        self._tier_io: TierIO | None = None
        self._tier_rejected: list[TierJobId] = []
        self._num_blocks: dict[int, int] = {}
        """Engine blocks of every registered group (``_plainly_valid``'s bounds)."""
        self._factor = 1
        self._num_slots = 0
        self._suspended = False
        self.backend_errors = 0
        """Reports the backend made for jobs not in flight (dropped; see module docstring)."""

    # -- registration --------------------------------------------------------------------

    def register_kv_caches(self, groups: Sequence[GroupTensors]) -> None:
        """Register this rank's cache tensors, one ``GroupTensors`` per config group.

        Allocates the host arena (``config.num_host_slots`` slots of ``config.slot_bytes``)
        and binds the backend. Raises ``LayoutError`` for tensors it cannot handle.
        """
        if self._layout is not None:
            raise RuntimeError("register_kv_caches was already called on this worker")
        layout = CacheLayout.build(self.config, groups)
        pool = HostPool(layout, self.config.num_host_slots, pin=self._pin)
        backend = self._backend or default_backend(layout.device,
                                                   staging_bytes=self._staging_bytes)
        backend.bind(layout, pool)
        self._layout, self._pool, self._backend = layout, pool, backend
        self._num_blocks = {group: g.num_blocks for group, g in layout.groups.items()}
        self._factor, self._num_slots = layout.factor, pool.num_slots
        if self._tiers is not None and self._tiers.enabled:
            self._tier_io = TierIO(self._tiers, self.config, layout, pool, self.rank)

    @property
    def layout(self) -> CacheLayout:
        if self._layout is None:
            raise RuntimeError("no caches registered yet")
        return self._layout

    @property
    def host_pool(self) -> HostPool:
        if self._pool is None:
            raise RuntimeError("no caches registered yet")
        return self._pool

    @property
    def backend(self) -> TransferBackend:
        if self._backend is None or self._layout is None:
            raise RuntimeError("no caches registered yet")
        return self._backend

    # -- per step -------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> None:
        """Run a whole plan at once: ``begin_step`` then ``end_step``.

        For callers with no forward pass between the two (tests, accounting runs).
        """
        self.begin_step(plan)
        self.end_step()

    def begin_step(self, plan: StepPlan) -> None:
        """The part of a step's plan that must happen before the forward pass.

        1. Submit the stores of ``plan.stores`` that are also in ``plan.flush`` (they read
           blocks written by earlier steps), then block until every job in ``plan.flush``
           is done: their engine blocks may be reused once this returns.
        2. Submit the loads (asynchronous).
        3. Keep the other stores until ``end_step``: they read blocks this step's forward
           pass writes.

        Raises ``InvariantError`` for a job id that is already in flight (a planner bug).
        """
        if self._deferred_stores:
            raise InvariantError("begin_step called twice without end_step")
        if plan.tier_flush or plan.tier_jobs:
            # First of all: tier jobs snapshot slots that this plan's stores overwrite.
            if self._tier_io is not None:
                self._tier_io.begin(plan.tier_flush, plan.tier_jobs)
            else:
                if plan.tier_jobs:
                    logger.warning("rank %d: %d tier jobs but no lower tiers configured on "
                                   "this worker; failing them", self.rank, len(plan.tier_jobs))
                self._tier_rejected.extend(job.job_id for job in plan.tier_jobs)
        flush = set(plan.flush)
        for job in plan.stores:
            if job.job_id in flush:
                self._submit(job, Direction.STORE)
        self.wait(plan.flush)
        for job in plan.loads:
            self._submit(job, Direction.LOAD)
        self._deferred_stores = [job for job in plan.stores if job.job_id not in flush]

    def end_step(self) -> None:
        """After the forward pass: submit the stores ``begin_step`` kept back."""
        deferred, self._deferred_stores = self._deferred_stores, []
        for job in deferred:
            self._submit(job, Direction.STORE)

    def poll(self) -> WorkerReport:
        """Jobs done since the previous poll (each exactly once), and transfer stats."""
        done, broken = self.backend.poll()
        finished = self._first_reports(done)
        failed = self._first_reports(broken)
        failed.extend(self._rejected)
        self._rejected = []
        tier_failed, self._tier_rejected = self._tier_rejected, []
        tier = self._tier_io.poll() if self._tier_io is not None else TierIOReport()
        tier_failed.extend(tier.failed)
        return WorkerReport(rank=self.rank, finished=tuple(finished), failed=tuple(failed),
                            stats=self.backend.take_stats(), tier_finished=tier.finished,
                            tier_failed=tuple(tier_failed), tier_unreachable=tier.unreachable)

    def _first_reports(self, job_ids: list[JobId]) -> list[JobId]:
        """The reported jobs that were in flight (now no longer); the others are dropped."""
        out = []
        for job_id in job_ids:
            if job_id in self._in_flight:
                self._in_flight.discard(job_id)
                out.append(job_id)
            else:
                self.backend_errors += 1
                logger.error("rank %d: the backend reported job %s, which is not in flight; "
                             "report dropped", self.rank, job_id)
        return out

    def wait(self, jobs: Iterable[JobId]) -> None:
        """Block until the listed jobs are done; unknown or reported ids are ignored.

        Does not report them: the next ``poll`` does.
        """
        jobs = list(jobs)
        if jobs and self._backend is not None and self._layout is not None:
            self._backend.wait(jobs)

    def fence_engine_reads(self, jobs: Iterable[JobId]) -> None:
        """Make the listed stores' reads of the engine cache complete before the engine's
        next use of it (``TransferBackend.fence_engine_reads``): for an engine that may
        zero or copy into blocks before the next plan's flush runs. Unknown or finished
        ids are ignored."""
        jobs = [job for job in jobs if job in self._in_flight]
        if jobs and self._backend is not None and self._layout is not None:
            self._backend.fence_engine_reads(jobs)

    def suspend(self) -> None:
        """The engine is about to release its cache memory (vLLM's
        ``unregister_kv_caches``): block until every transfer in flight is done; until
        ``resume`` every job submitted is rejected (reported failed by the next ``poll``;
        no byte moves), so nothing reads or writes the caches meanwhile. The host arena
        and the lower tiers keep what they hold. Idempotent."""
        self._suspended = True
        self.wait(list(self._in_flight))

    def resume(self) -> None:
        """The engine's cache memory is back at the registered addresses (vLLM's
        ``restore_kv_caches``): jobs run again. Idempotent."""
        self._suspended = False

    @property
    def suspended(self) -> bool:
        """Between ``suspend`` and ``resume``."""
        return self._suspended

    @property
    def jobs_in_flight(self) -> int:
        """Transfer jobs submitted to the backend and not yet reported by ``poll``."""
        return len(self._in_flight)

    @property
    def tier_io(self) -> TierIO | None:
        """This rank's tier I/O, when lower tiers are configured."""
        return self._tier_io

    def wait_tier_jobs(self, jobs: Iterable[TierJobId] | None = None) -> None:
        """Block until the listed tier jobs (default: all in flight) are done; the next
        ``poll`` reports them."""
        if self._tier_io is not None:
            self._tier_io.wait(jobs)

    def shutdown(self) -> None:
        """Wait for in-flight jobs and release the backend's threads/streams."""
        if self._backend is not None and self._layout is not None:
            self._backend.shutdown()
        if self._tier_io is not None:
            self._tier_io.shutdown()

    # -- internals ------------------------------------------------------------------------

    def _submit(self, job: TransferJob, expected: Direction) -> None:
        if job.job_id in self._in_flight:
            raise InvariantError(f"job {job.job_id} submitted while already in flight")
        problem = self._check(job, expected)
        if problem is not None:
            logger.warning("rank %d: rejecting %s job %s: %s", self.rank, job.direction.value,
                           job.job_id, problem)
            self._rejected.append(job.job_id)
            return
        self._in_flight.add(job.job_id)
        self.backend.submit(job)

    def _check(self, job: TransferJob, expected: Direction) -> str | None:
        """Why ``job`` cannot run here, or ``None`` when it can.

        Most jobs pass ``_plainly_valid``, which decides with a handful of C-level scans
        per transfer (min, max, set sizes). A job it does not clear goes through
        ``_find_problem``, the exact page-by-page check, which also names the fault.
        """
        if self._suspended:
            return "the engine's cache memory is released (suspended until it is restored)"
        if job.direction is not expected:
            return f"a {job.direction.value} job listed among the {expected.value}s"
        if self._plainly_valid(job):
            return None
        return self._find_problem(job)

    def _plainly_valid(self, job: TransferJob) -> bool:
        """True only if ``_find_problem(job)`` would find nothing.

        Sufficient, not necessary: every group registered, every engine block in
        ``[1, num_blocks)``, every slot in ``[0, num_slots)``, slot counts matching
        ``block_size_factor``, and no destination named twice, tested the cheap way (a
        store names every slot once over the whole job; a load names every engine block of
        a group once). Jobs that repeat a slot legitimately (sub-blocks of one slot split
        across transfers) are left to the exact check.
        """
        store = job.direction is Direction.STORE
        if len(job.groups) == 1:
            return self._plainly_valid_alone(job.groups[0], store)
        layout = self.layout
        groups = layout.groups
        factor = layout.factor
        num_slots = self.host_pool.num_slots
        slots_named = 0
        distinct_slots: set[int] = set()
        blocks_of_group: dict[int, set[int]] = {}
        for transfer in job.groups:
            group = groups.get(transfer.group)
            block_ids, slots = transfer.block_ids, transfer.slots
            if group is None or not block_ids:
                return False
            if min(block_ids) <= NULL_BLOCK_ID or max(block_ids) >= group.num_blocks:
                return False
            skip = transfer.first_block_index % factor
            if len(slots) != -(-(skip + len(block_ids)) // factor):
                return False
            if min(slots) < 0 or max(slots) >= num_slots:
                return False
            if store:
                slots_named += len(slots)
                distinct_slots.update(slots)
            else:
                seen = blocks_of_group.setdefault(transfer.group, set())
                before = len(seen)
                seen.update(block_ids)
                if len(seen) != before + len(block_ids):
                    return False
        return not store or len(distinct_slots) == slots_named

    def _plainly_valid_alone(self, transfer: GroupTransfer, store: bool) -> bool:
        """``_plainly_valid`` of a job of this one transfer (most jobs): the same tests
        with less bookkeeping, on the bounds noted at registration."""
        num_blocks = self._num_blocks.get(transfer.group)
        block_ids, slots = transfer.block_ids, transfer.slots
        if num_blocks is None or not block_ids:
            return False
        if min(block_ids) <= NULL_BLOCK_ID or max(block_ids) >= num_blocks:
            return False
        factor = self._factor
        if len(slots) != -(-(transfer.first_block_index % factor + len(block_ids)) // factor):
            return False
        if min(slots) < 0 or max(slots) >= self._num_slots:
            return False
        named = slots if store else block_ids  # every destination once
        return len(set(named)) == len(named)

    def _find_problem(self, job: TransferJob) -> str | None:
        """The first thing wrong with ``job`` (checked page by page), or ``None``."""
        layout = self.layout
        num_slots = self.host_pool.num_slots
        slot_owner: dict[int, int] = {}
        destinations: set[tuple[int, int, int]] = set()
        for transfer in job.groups:
            group = layout.groups.get(transfer.group)
            if group is None:
                return f"group {transfer.group} is not registered"
            try:
                transfer.validate(layout.factor)
            except ValueError as exc:
                return str(exc)
            for block_id in transfer.block_ids:
                if not NULL_BLOCK_ID < block_id < group.num_blocks:
                    return (f"group {transfer.group}: engine block {block_id} outside "
                            f"[1, {group.num_blocks})")
            for slot in transfer.slots:
                if not 0 <= slot < num_slots:
                    return f"group {transfer.group}: slot {slot} outside [0, {num_slots})"
                if job.direction is Direction.STORE and \
                        slot_owner.setdefault(slot, transfer.group) != transfer.group:
                    return f"slot {slot} written by groups {slot_owner[slot]} and {transfer.group}"
            for block_id, slot, sub in transfer.pairs(layout.factor):
                key = (slot, sub, -1) if job.direction is Direction.STORE \
                    else (-1, transfer.group, block_id)
                if key in destinations:
                    where = f"slot {slot} sub-block {sub}" if job.direction is Direction.STORE \
                        else f"group {transfer.group} engine block {block_id}"
                    return f"{where} written twice by one job"
                destinations.add(key)
        return None
