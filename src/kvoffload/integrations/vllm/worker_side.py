"""The connector's worker role: vLLM's per-rank hooks mapped onto ``TransferWorker``.

vLLM calls, every engine step, on every rank::

    handle_preemptions(meta)   before the forward pass              -> flush
    ... forward pass ...
    start_load_kv()            async loads start after the forward is launched
    wait_for_save()            after the forward                    -> stores (fenced)
    get_transfer_results()     finished / failed loads for the scheduler
    build_connector_worker_meta()   reports for the scheduler side

Where vLLM writes engine blocks outside the forward pass matters. Blocks freed by a
finished or preempted request, or sliding out of a window, can be handed to another
request at the next step, and a store of their old contents may still be reading them.
The V1 model runner (vLLM 0.32 and 0.33 without ``VLLM_USE_V2_MODEL_RUNNER``) calls
``handle_preemptions`` before it updates the batch, so the plan's ``flush`` (every job
using a block vLLM handed out again) is waited for before vLLM zeroes or copies into
such a block. The V2 runner (the only one in 0.34) zeroes new blocks, applies
copy-on-write copies and copies Mamba states *before* ``handle_preemptions``
(``compat.runner_writes_before_flush``); there the flush comes too late, so every store
is fenced when it is submitted (``TransferWorker.fence_engine_reads``): its reads of the
engine cache complete before the engine's next work on it. The CUDA backend orders only
its device gather before the next kernels; a CPU backend waits for the copy.

The plan is executed in three slices with ``TransferWorker.execute``:

1. ``flush``: every flushed job of an earlier step is waited for, so the blocks vLLM
   reuses this step are no longer read;
2. ``loads``: submitted asynchronously; they write blocks of requests vLLM keeps in
   WAITING_FOR_REMOTE_KVS, which no forward pass touches;
3. ``stores``: all of this step's stores, submitted after the forward pass that wrote
   their blocks.

A store created this step is never submitted before the forward pass, even when the plan
also lists it in ``flush``: its blocks belong to its running request (a store never
reads a position vLLM has freed), so another request can only have been handed them as a
prefix-cache hit, sharing the same contents, never to overwrite them; submitting it
early would copy blocks the forward pass has not written yet. Such same-step flushes are
counted in ``same_step_flushes``. The jobs of earlier steps a flush waits for, and how
long the step waited, go to the scheduler side with the next report
(``TransferStats.flushed_jobs``, ``flush_wait_seconds``; exported as
``vllm:kvoffload_flushed_jobs`` and ``vllm:kvoffload_flush_wait_seconds``).

A load is reported to vLLM as finished receiving when the transfer worker reports it
(as failed receiving too, when it failed); vLLM then recomputes (with
``kv_load_failure_policy="recompute"``) or fails the request. A load the scheduler side
gave up at its deadline arrives in ``resolved_loads`` as failed and in
``abandoned_loads``: its late end is reported to the scheduler side only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from vllm.v1.kv_cache_interface import group_kernel_blocks

from kvoffload.config import OffloadConfig
from kvoffload.errors import LayoutError
from kvoffload.integrations.vllm.metadata import KVOffloadMetadata, KVOffloadWorkerMetadata
from kvoffload.jobs import JobId, StepPlan, TransferJob, TransferStats, WorkerReport
from kvoffload.tiers.config import TierConfig
from kvoffload.worker.backend import TransferBackend
from kvoffload.worker.layout import CacheLayout, CacheTensorLayout, GroupTensors
from kvoffload.worker.worker import TransferWorker

logger = logging.getLogger(__name__)

LoadHook = Callable[[TransferJob, CacheLayout], None]
"""Test hook: called for every successfully finished load before vLLM hears of it."""


class WorkerSide:
    """One rank's half of the connector (see the module docstring)."""

    def __init__(self, config: OffloadConfig, layer_names: Sequence[Sequence[str]],
                 num_blocks: int, *, rank: int = 0,
                 backend: TransferBackend | None = None,
                 tiers: TierConfig | None = None,
                 staging_bytes: int | None = None,
                 fence_store_reads: bool = True) -> None:
        """Args:
            config: the offload configuration every rank and the scheduler share.
            layer_names: per group, the vLLM layers whose caches belong to it.
            num_blocks: blocks in vLLM's pool (kernel-block splits are regrouped).
            rank: this worker's tensor-parallel rank.
            backend: transfer backend; chosen from the caches' device by default.
            tiers: lower tiers (disk, remote) this rank reads and writes; None: host only.
            staging_bytes: the CUDA backend's device staging budget per direction; None:
                its default (``TransferWorker``).
            fence_store_reads: vLLM may write engine blocks before the next
                ``handle_preemptions`` (``compat.runner_writes_before_flush``): each
                step's stores are fenced when submitted (module docstring). False only
                where vLLM calls ``handle_preemptions`` first.
        """
        self.config = config
        self.layer_names = [tuple(names) for names in layer_names]
        self.num_blocks = num_blocks
        self.worker = TransferWorker(config, rank=rank, backend=backend, tiers=tiers,
                                     staging_bytes=staging_bytes)
        self.fence_store_reads = fence_store_reads
        self.after_load: LoadHook | None = None
        self.same_step_flushes = 0
        """Stores the plan flushed in the step that created them (submitted after the
        forward pass all the same; see the module docstring)."""
        self._flushed = TransferStats()
        """Flushed jobs and the wait for them since the last report (``flush``)."""
        self._loads: dict[JobId, TransferJob] = {}
        self._reports: list[WorkerReport] = []
        # The step being executed and how far: 0 nothing, 1 flushed, 2 loads, 3 stores.
        # Holding the metadata object keeps its identity unique while it is current.
        self._meta: KVOffloadMetadata | None = None
        self._phase = 0
        self._resolved_for: KVOffloadMetadata | None = None

    # -- registration ---------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
                           ) -> None:
        """Register vLLM's per-layer caches, grouped by KV-cache group.

        Layers vLLM adds on the worker only (KV-sharing or encoder-only layers) are not
        in the groups and are ignored: they own no blocks. A Mamba layer arrives as one
        raw page tensor ``(num_blocks, 1, 1, real_bytes)`` whose row stride is the padded
        page; attention layers as ``(num_blocks, heads, block_size, 2 * head_size)``.
        """
        groups = []
        for index, names in enumerate(self.layer_names):
            layers: list[tuple[str, torch.Tensor | Sequence[torch.Tensor]]] = []
            for name in names:
                if name not in kv_caches:
                    raise LayoutError(f"KV-cache group {index}: layer {name!r} has no cache "
                                      f"tensor among the {len(kv_caches)} vLLM registered")
                cache = kv_caches[name]
                if isinstance(cache, torch.Tensor):
                    layers.append((name, group_kernel_blocks(cache, self.num_blocks)))
                else:
                    layers.append((name, [group_kernel_blocks(t, self.num_blocks)
                                          for t in cache]))
            groups.append(GroupTensors(index, layers, CacheTensorLayout.BLOCKS_FIRST))
        self.worker.register_kv_caches(groups)

    # -- per step -------------------------------------------------------------------------

    def _enter(self, meta: KVOffloadMetadata, phase: int) -> bool:
        """Whether ``phase`` of ``meta`` still has to run (phases run once, in order)."""
        if meta is not self._meta:
            self._meta, self._phase = meta, 0
        if self._phase >= phase:
            return False
        self._phase = phase
        return True

    def flush(self, meta: KVOffloadMetadata) -> None:
        """Before the batch is updated: submit flushed stores, wait for every flushed job."""
        if not self._enter(meta, 1):
            return
        plan = meta.plan
        this_step = {job.job_id for job in plan.stores}
        earlier = tuple(j for j in plan.flush if j not in this_step)
        self.same_step_flushes += len(plan.flush) - len(earlier)
        if earlier:
            # Waited for here, timed alone (``execute`` below finds them done).
            start = time.perf_counter()
            self.worker.wait(earlier)
            flushed = self._flushed
            self._flushed = TransferStats(
                flushed_jobs=flushed.flushed_jobs + len(earlier),
                flush_wait_seconds=flushed.flush_wait_seconds + time.perf_counter() - start)
        self.worker.execute(dataclasses.replace(plan, flush=earlier, loads=(), stores=()))

    def start_loads(self, meta: KVOffloadMetadata) -> None:
        """Submit the plan's loads (after ``flush``, which runs first if vLLM skipped it)."""
        self.flush(meta)
        if not self._enter(meta, 2):
            return
        if meta.plan.loads:
            for job in meta.plan.loads:
                self._loads[job.job_id] = job
            self.worker.execute(StepPlan(loads=meta.plan.loads))

    def submit_stores(self, meta: KVOffloadMetadata) -> None:
        """After the forward pass: submit the plan's stores, and fence them where vLLM
        writes blocks before the next flush (``fence_store_reads``)."""
        self.start_loads(meta)
        if not self._enter(meta, 3):
            return
        if meta.plan.stores:
            self.worker.execute(StepPlan(stores=meta.plan.stores))
            if self.fence_store_reads:
                self.worker.fence_engine_reads(job.job_id for job in meta.plan.stores)

    def transfer_results(self, meta: KVOffloadMetadata | None) -> tuple[set[str], set[str]]:
        """``(finished receiving, failed receiving)`` request ids, from a poll of the worker.

        Also queues the poll's report for ``take_worker_meta``.
        """
        if meta is not None:
            for job_id in meta.abandoned_loads:
                # vLLM recomputes the request already; the late copy is for the planner.
                self._loads.pop(job_id, None)
        report = self.worker.poll()
        finished: set[str] = set()
        failed: set[str] = set()
        for job_id in report.finished:
            job = self._loads.pop(job_id, None)
            if job is not None:
                if self.after_load is not None:
                    self.after_load(job, self.worker.layout)
                finished.add(job.request_id)
        for job_id in report.failed:
            job = self._loads.pop(job_id, None)
            if job is not None:
                logger.warning("kvoffload: load for request %s failed; vLLM recomputes it",
                               job.request_id)
                finished.add(job.request_id)
                failed.add(job.request_id)
        if meta is not None and meta is not self._resolved_for:
            self._resolved_for = meta
            for request_id, load_failed in meta.resolved_loads:
                finished.add(request_id)
                if load_failed:
                    failed.add(request_id)
        if self._flushed.flushed_jobs:
            report = dataclasses.replace(report, stats=dataclasses.replace(
                report.stats, flushed_jobs=self._flushed.flushed_jobs,
                flush_wait_seconds=self._flushed.flush_wait_seconds))
            self._flushed = TransferStats()
        if report.finished or report.failed or report.stats.stored_bytes \
                or report.stats.loaded_bytes or report.stats.flushed_jobs \
                or report.tier_finished or report.tier_failed or report.tier_unreachable:
            self._reports.append(report)
        return finished, failed

    def unregister(self) -> None:
        """vLLM releases the caches' memory (``unregister_kv_caches``: sleep, or vLLM
        0.34's extensible KV cache giving its memory back): wait for every transfer, then
        reject jobs until ``restore`` (``TransferWorker.suspend``)."""
        self.worker.suspend()

    def restore(self) -> None:
        """vLLM committed the caches' memory again, at the same addresses
        (``restore_kv_caches``)."""
        self.worker.resume()

    def take_worker_meta(self) -> KVOffloadWorkerMetadata | None:
        """The reports since the last call, for the scheduler side; None when empty."""
        if not self._reports:
            return None
        reports, self._reports = self._reports, []
        return KVOffloadWorkerMetadata(reports)

    def shutdown(self) -> None:
        self.worker.shutdown()
