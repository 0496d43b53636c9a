"""Tier I/O: one rank's side of the tier jobs (``TierJob``) the cascade plans.

``TierIO`` owns the rank's block stores (``DiskStore``, ``RemoteStore``) and one thread
pool per store, and runs the tier jobs of each step plan between the rank's host arena and
the stores. ``TransferWorker`` drives it: ``begin`` at the very start of ``begin_step``,
``poll`` inside ``poll``.

``begin(flush, jobs)`` does, in order:

1. wait for the ``flush`` jobs (tier jobs from before a cache reset: their slots are about
   to be reused);
2. copy the slot bytes of every *snapshot* demote (write-back victims whose slots this
   plan's stores or promotes overwrite) -- synchronously, before the worker submits any
   store of the plan, so the copy always sees the victim's bytes;
3. submit every job to its store's pool and return. Promotes read straight into their host
   slot; non-snapshot demotes write straight from theirs (the cascade pins it).

Ordering. Jobs on one (tier, key) run in submission order (a later job waits for the
earlier one), so a delete and a re-write of one block never race; a purge waits for every
earlier job of its tier and every later job waits for it. Remote jobs of one kind are
batched into pipelined round trips of ``batch_blocks``.

Reporting. Every job is reported exactly once by ``poll``: finished, or failed (a miss, a
damaged block, an I/O error, an unreachable tier, or a job this rank cannot run -- an
unknown tier or group, a slot out of range). Tiers that raised ``TierUnavailable`` are
listed as unreachable in the same poll.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from kvoffload.blockfile.framing import FINGERPRINT_BYTES, BytesLike
from kvoffload.config import OffloadConfig
from kvoffload.jobs import TierJob, TierJobId, TierOp
from kvoffload.tiers.config import TierConfig
from kvoffload.tiers.naming import namespace
from kvoffload.worker.block_store import BlockStore, StoreError, TierUnavailable
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import CacheLayout

logger = logging.getLogger(__name__)

_DISK_BATCH_BLOCKS = 4
"""Disk jobs of one kind per I/O-thread task: fewer hand-offs, still parallel files."""
_SHUTDOWN_WAIT_S = 10.0
"""How long ``TierIO.shutdown`` waits for running tier jobs before abandoning them."""


def layout_fingerprint(ns: str, layout: CacheLayout) -> bytes:
    """16 bytes naming the namespace and how this rank lays out a block inside a slot
    (segment names and page sizes per group). Written into every stored block's header:
    a block laid out differently reads as foreign."""
    desc = [ns, str(layout.factor)]
    for index, group in sorted(layout.groups.items()):
        desc.append(f"g{index}:" + ",".join(f"{s.name}={s.page_bytes}" for s in group.segments))
    return hashlib.sha256("|".join(desc).encode()).digest()[:FINGERPRINT_BYTES]


def build_stores(tiers: TierConfig, ns: str, rank: int,
                 fingerprint: bytes) -> dict[str, BlockStore]:
    """The block stores ``tiers`` configures, by tier name."""
    stores: dict[str, BlockStore] = {}
    if tiers.disk is not None:
        from kvoffload.worker.disk_store import DiskStore

        stores["disk"] = DiskStore(tiers.disk.path, ns, rank, fingerprint,
                                   fsync=tiers.disk.fsync, mac_key=tiers.mac_key)
    if tiers.remote is not None:
        from kvoffload.worker.remote_store import RemoteStore

        stores["remote"] = RemoteStore(tiers.remote, ns, rank, fingerprint,
                                       mac_key=tiers.mac_key)
    return stores


@dataclass
class TierIOStats:
    """Per tier: payload bytes and seconds of successful promotes (reads) and demotes
    (writes), and failed jobs. Plain data; ``TierIO.take_stats`` hands it out and resets."""

    read_bytes: dict[str, int] = field(default_factory=dict)
    written_bytes: dict[str, int] = field(default_factory=dict)
    read_seconds: dict[str, float] = field(default_factory=dict)
    write_seconds: dict[str, float] = field(default_factory=dict)
    failed_jobs: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class TierIOReport:
    """What ``TierIO.poll`` hands out: the tier jobs that ended since the previous poll,
    each exactly once, and the tiers found unreachable meanwhile.

    Attributes:
        finished: tier jobs completed.
        failed: tier jobs that could not complete (module docstring, "Reporting").
        unreachable: tiers a job of which raised ``TierUnavailable``, sorted by name.
    """

    finished: tuple[TierJobId, ...] = ()
    failed: tuple[TierJobId, ...] = ()
    unreachable: tuple[str, ...] = ()


class TierIO:
    """Runs one rank's tier jobs (see the module docstring)."""

    def __init__(self, tiers: TierConfig, config: OffloadConfig, layout: CacheLayout,
                 pool: HostPool, rank: int, *,
                 stores: Mapping[str, BlockStore] | None = None) -> None:
        """Args:
            tiers: the lower tiers' settings (thread counts, batch sizes, stores).
            config: the offload configuration (for the namespace).
            layout: this rank's registered caches (for the layout fingerprint).
            pool: this rank's host arena.
            rank: this worker's rank.
            stores: block stores by tier name (default: built from ``tiers``).
        """
        self.rank = rank
        self.namespace = namespace(config, tiers)
        self.fingerprint = layout_fingerprint(self.namespace, layout)
        self._pool = pool
        self._layout = layout
        self.stores: dict[str, BlockStore] = (
            dict(stores) if stores is not None
            else build_stores(tiers, self.namespace, rank, self.fingerprint))
        threads = {"disk": tiers.disk.io_threads if tiers.disk else 1,
                   "remote": tiers.remote.io_threads if tiers.remote else 1}
        self._batch = {"remote": tiers.remote.batch_blocks if tiers.remote else 1,
                       "disk": _DISK_BATCH_BLOCKS}
        self._executors = {
            name: ThreadPoolExecutor(max_workers=threads.get(name, 2),
                                     thread_name_prefix=f"kvoffload-{name}-r{rank}")
            for name in self.stores}
        self._lock = threading.Lock()
        self._in_flight: dict[TierJobId, Future[None]] = {}
        self._last: dict[tuple[str, bytes], Future[None]] = {}
        self._barrier: dict[str, Future[None]] = {}
        self._tier_of: dict[Future[None], str] = {}  # every submitted, unfinished batch
        self._finished: list[TierJobId] = []
        self._failed: list[TierJobId] = []
        self._unreachable: set[str] = set()
        self._stats = TierIOStats()
        self._closed = False

    # -- per step -----------------------------------------------------------------------

    def begin(self, flush: Sequence[TierJobId], jobs: Sequence[TierJob]) -> None:
        """Wait for ``flush``, snapshot, then submit ``jobs`` (module docstring)."""
        if self._closed:
            raise RuntimeError("TierIO.begin after shutdown")
        self.wait(flush)
        runnable: list[tuple[TierJob, BytesLike | memoryview | None]] = []
        rejected: list[TierJobId] = []
        for job in jobs:
            problem = self._check(job)
            if problem is not None:
                logger.warning("rank %d: rejecting %s job %s on %s: %s", self.rank,
                               job.op.value, job.job_id, job.tier, problem)
                rejected.append(job.job_id)
                continue
            runnable.append((job, self._buffer(job)))
        with self._lock:
            self._failed.extend(rejected)
        for tier, op, chunk in self._chunks(runnable):
            self._submit(tier, op, chunk)

    def poll(self) -> TierIOReport:
        """The tier jobs that ended and the tiers found unreachable since the previous
        poll (``TierIOReport``); never blocks."""
        with self._lock:
            finished, self._finished = self._finished, []
            failed, self._failed = self._failed, []
            unreachable, self._unreachable = sorted(self._unreachable), set()
        return TierIOReport(tuple(finished), tuple(failed), tuple(unreachable))

    def wait(self, job_ids: Iterable[TierJobId] | None = None) -> None:
        """Block until the listed jobs (default: all in flight) are done; unknown or
        reported ids are ignored. Does not report them: ``poll`` does."""
        with self._lock:
            if job_ids is None:
                futures = set(self._in_flight.values())
            else:
                futures = {self._in_flight[j] for j in job_ids if j in self._in_flight}
        if futures:
            wait_futures(futures)

    def take_stats(self) -> TierIOStats:
        with self._lock:
            stats, self._stats = self._stats, TierIOStats()
        return stats

    def shutdown(self, timeout_s: float = _SHUTDOWN_WAIT_S) -> None:
        """Finish the submitted jobs, stop the threads, close the stores; idempotent.

        Returns within about ``timeout_s`` even if an I/O thread is stuck (a store call
        that never returns): the jobs still running then are logged and abandoned, and
        the stores of their tiers are left open (a disk store keeps its directory lock
        until the process exits) so a stuck thread never sees its files closed under it.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            running = dict(self._tier_of)
        _, stuck = wait_futures(set(running), timeout=timeout_s)
        stuck_tiers = {running[f] for f in stuck}
        for name, executor in self._executors.items():
            executor.shutdown(wait=name not in stuck_tiers, cancel_futures=bool(stuck))
        if stuck:
            logger.warning("rank %d: %d tier jobs still running after %.0f s at shutdown "
                           "(tiers %s); abandoned, their stores left open", self.rank,
                           len(stuck), timeout_s, ", ".join(sorted(stuck_tiers)) or "?")
        for name, store in self.stores.items():
            if name not in stuck_tiers:
                store.close()

    # -- internals ----------------------------------------------------------------------

    def _check(self, job: TierJob) -> str | None:
        if job.tier not in self.stores:
            return f"no {job.tier!r} tier is configured on this worker"
        if job.op in (TierOp.PROMOTE, TierOp.DEMOTE):
            if job.group not in self._layout.groups:
                return f"group {job.group} is not registered"
            if not 0 <= job.slot < self._pool.num_slots:
                return f"slot {job.slot} outside [0, {self._pool.num_slots})"
        return None

    def _buffer(self, job: TierJob) -> BytesLike | None:
        """The job's bytes in host memory: a writable view of the slot, or (snapshot) a
        copy of it taken now."""
        if job.op not in (TierOp.PROMOTE, TierOp.DEMOTE):
            return None
        view = self._pool.slot_buffer(job.slot, job.group)
        if job.snapshot:
            return view.tobytes()
        return view

    def _chunks(self, runnable: Sequence[tuple[TierJob, BytesLike | None]]
                ) -> list[tuple[str, TierOp, list[tuple[TierJob, BytesLike | None]]]]:
        """Group jobs by (tier, op) in order; cut into batches of the tier's batch size.
        Purges stay alone."""
        groups: dict[tuple[str, TierOp], list[tuple[TierJob, BytesLike | None]]] = {}
        order: list[tuple[str, TierOp, list[tuple[TierJob, BytesLike | None]]]] = []
        for job, buf in runnable:
            if job.op is TierOp.PURGE:
                order.append((job.tier, job.op, [(job, buf)]))
                groups.clear()  # jobs after a purge start new batches
                continue
            size = self._batch.get(job.tier, 1)
            current = groups.get((job.tier, job.op))
            if current is None or len(current) >= size:
                current = []
                groups[(job.tier, job.op)] = current
                order.append((job.tier, job.op, current))
            current.append((job, buf))
        return order

    def _submit(self, tier: str, op: TierOp,
                chunk: list[tuple[TierJob, BytesLike | None]]) -> None:
        with self._lock:
            waits: set[Future[None]] = set()
            barrier = self._barrier.get(tier)
            if barrier is not None and not barrier.done():
                waits.add(barrier)
            if op is TierOp.PURGE:
                waits.update(f for (t, _), f in self._last.items() if t == tier)
            for job, _ in chunk:
                before = self._last.get((tier, job.key))
                if before is not None:
                    waits.add(before)
            future = self._executors[tier].submit(self._run, tier, op, chunk, waits)
            self._tier_of[future] = tier
            for job, _ in chunk:
                self._in_flight[job.job_id] = future
                if op is not TierOp.PURGE:
                    self._last[(tier, job.key)] = future
            if op is TierOp.PURGE:
                self._barrier[tier] = future
        future.add_done_callback(lambda f: self._forget(tier, chunk, f))

    def _forget(self, tier: str, chunk: list[tuple[TierJob, BytesLike | None]],
                future: Future[None]) -> None:
        with self._lock:
            self._tier_of.pop(future, None)
            for job, _ in chunk:
                self._in_flight.pop(job.job_id, None)
                if self._last.get((tier, job.key)) is future:
                    del self._last[(tier, job.key)]
            if self._barrier.get(tier) is future:
                del self._barrier[tier]

    def _run(self, tier: str, op: TierOp, chunk: list[tuple[TierJob, BytesLike | None]],
             waits: set[Future[None]]) -> None:
        """One batch on an I/O thread: wait for earlier jobs on its keys, run, record."""
        if waits:
            wait_futures(waits)
        store = self.stores[tier]
        start = time.perf_counter()
        unreachable = False
        try:
            oks = _call(store, op, chunk)
        except TierUnavailable as exc:
            logger.debug("rank %d: %s tier unreachable: %s", self.rank, tier, exc)
            unreachable = True
            oks = [False] * len(chunk)
        except StoreError:  # the store logged what failed and what it means
            oks = [False] * len(chunk)
        except Exception:
            logger.exception("rank %d: %s %s batch failed", self.rank, tier, op.value)
            oks = [False] * len(chunk)
        seconds = time.perf_counter() - start
        nbytes = sum(memoryview(buf).nbytes for (_, buf), ok in zip(chunk, oks, strict=True)
                     if ok and buf is not None)
        with self._lock:
            for (job, _), ok in zip(chunk, oks, strict=True):
                (self._finished if ok else self._failed).append(job.job_id)
            if unreachable:
                self._unreachable.add(tier)
            stats = self._stats
            failures = oks.count(False)
            if failures:
                stats.failed_jobs[tier] = stats.failed_jobs.get(tier, 0) + failures
            if op is TierOp.PROMOTE:
                stats.read_bytes[tier] = stats.read_bytes.get(tier, 0) + nbytes
                stats.read_seconds[tier] = stats.read_seconds.get(tier, 0.0) + seconds
            elif op is TierOp.DEMOTE:
                stats.written_bytes[tier] = stats.written_bytes.get(tier, 0) + nbytes
                stats.write_seconds[tier] = stats.write_seconds.get(tier, 0.0) + seconds


def _call(store: BlockStore, op: TierOp,
          chunk: list[tuple[TierJob, BytesLike | None]]) -> list[bool]:
    """Run one batch on ``store``; per job whether it succeeded."""
    if op is TierOp.PROMOTE:
        return store.get_into([(job.key, _as_view(buf)) for job, buf in chunk])
    if op is TierOp.DEMOTE:
        return store.put([(job.key, _as_bytes(buf)) for job, buf in chunk])
    if op is TierOp.DELETE:
        store.delete([job.key for job, _ in chunk])
    else:
        store.purge()
    return [True] * len(chunk)


def _as_view(buf: BytesLike | None) -> memoryview:
    assert isinstance(buf, memoryview)
    return buf


def _as_bytes(buf: BytesLike | None) -> BytesLike:
    assert buf is not None
    return buf
