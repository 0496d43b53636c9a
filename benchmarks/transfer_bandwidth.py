"""Store and load throughput of the real TransferWorker, against one contiguous copy.

For each offloaded-block size (the bytes of one offloaded block: all its pages together),
the script fills an engine cache, stores ``--total-mib`` of blocks from scattered engine
blocks into scattered host slots through ``TransferWorker.execute``/``wait`` in jobs of
``--blocks-per-job`` blocks, then loads them back into other scattered blocks. The
reference is a contiguous ``copy_`` of the same number of bytes between the same two
allocations (engine cache <-> host arena; one ``copy_`` per engine tensor when a block has
several segments) using torch's intra-op threads, timed in the same run, interleaved with
the worker runs. ``--threads N`` gives both sides the same N threads (torch's intra-op
threads, the CPU backend's copy threads); the header prints both.

Fairness: the jobs are built before the clock starts (the worker's own validation and
planning are timed, the benchmark's bookkeeping is not); OpenMP threads wait passively
(``OMP_WAIT_POLICY=PASSIVE`` unless the environment sets a policy): by default they spin
for milliseconds after each parallel ``copy_``, and on a machine with few cores the spinning
thread steals a core from the worker run timed right after the reference; which of the two
goes first alternates from one repetition to the next; before every timed run (both kinds)
the CPU caches are scrubbed by reading a buffer twice the size of the last-level cache
(``--scrub-mib``; 0 turns it off): a run leaves dirty cache lines (a plain copy leaves its
whole destination dirty when it fits in the cache, the worker's streaming stores leave
none) that whoever runs next must write back, so without the scrub a run's time depended on
what ran before it (the worker run right after the contiguous copy measured about 20%
slower than right after another worker run); ``--gap-ms`` adds an idle gap before
every timed run (both kinds; off by default: after an idle gap every run pays a cold start,
threads and CPUs waking up, which pulls the ratio towards 1). The ratio is worker
throughput / contiguous throughput, taken per repetition against the reference run next to
it and reported as the median with its quartiles (shared machines drift); the GB/s columns
are medians. With ``--best`` the GB/s columns and the ratio come from the fastest run of
each kind instead: on a machine busy with other work, those are the runs nothing
interrupted. The worker's loaded bytes are checked against the stored ones once per size.

Two more figures come from the same run. "1-job" (native queue only): the worker's own
pieces of the whole run, pushed to a native queue of their own as a single job with the
same copy threads, timed among the other runs: scattered copies of this page size with no
per-job cost at all (no Python, no completion of jobs). Its ratio to the contiguous copy is
what the memory system gives scattered pages of this size on the machine, so the worker's
ratio is read against it. "submit": the Python time of ``execute`` per store job, with the
store direction held so that no copy competes for the cores (best of the repetitions).

CUDA only: ``--staging-bytes`` sets the worker's device staging budget (default 64 MiB);
``--compare-staging SIZE`` adds a second worker over the same cache with that budget, timed
in the same rotation, and reports "split": its throughput over the first worker's (the
median of paired runs), the cost of splitting jobs into chunks of that size.

    python benchmarks/transfer_bandwidth.py                 # CPU backend (native queue)
    python benchmarks/transfer_bandwidth.py --memmove       # CPU backend, memmove path
    python benchmarks/transfer_bandwidth.py --device cuda   # CUDA backend, pinned arena
    python benchmarks/transfer_bandwidth.py --device cuda --compare-staging 1MiB
    python benchmarks/transfer_bandwidth.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

# Before torch starts its OpenMP runtime (see "Fairness" above).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob
from kvoffload.sizes import parse_size
from kvoffload.worker import (
    CpuBackend,
    GroupTensors,
    NativeCpuBackend,
    TransferWorker,
    cpu_backend,
)
from kvoffload.worker.native_copy import NativeCopy, load_native_copy, pack

KIB = 1024
SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), or 32 MiB where it cannot be read."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": KIB, "M": KIB * KIB, "G": KIB**3}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 * KIB * KIB)


def _huge_page_mib() -> int:
    """MiB of this process's anonymous memory backed by transparent huge pages (Linux;
    0 where it cannot be read). torch allocates on huge pages with THP_MEM_ALLOC_ENABLE=1."""
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1]) // KIB
    return 0


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


@dataclass(frozen=True)
class Row:
    block_kib: int
    page_kib: float
    blocks: int
    store_gbps: float
    store_ref_gbps: float
    load_gbps: float
    load_ref_gbps: float
    store_ratio: float
    """Median over repetitions of (worker throughput / the contiguous copy timed next to it)."""
    load_ratio: float
    store_ratio_q: tuple[float, float]
    """First and third quartile of the per-repetition store ratios."""
    load_ratio_q: tuple[float, float]
    arena_pinned: bool
    """Whether the host arena (both copies' host side) is page-locked."""
    raw_store_gbps: float | None = None
    """The worker's store pieces pushed to a native queue as one job (no per-job cost):
    what scattered copies of this page size reach on this machine. None without the
    native queue."""
    raw_load_gbps: float | None = None
    raw_store_ratio: float | None = None
    """Median over repetitions of (raw scattered copy / the contiguous copy next to it)."""
    raw_load_ratio: float | None = None
    submit_us: float | None = None
    """Python time of ``TransferWorker.execute`` per store job, its direction held so that
    nothing copies meanwhile (best of the repetitions); None where the backend cannot
    hold (CUDA)."""
    split_store_ratio: float | None = None
    """``--compare-staging``: median over repetitions of (throughput of the worker with the
    compared staging budget / the first worker's, timed next to it); None without it."""
    split_load_ratio: float | None = None
    staging_chunks: int | None = None
    """``--compare-staging``: chunks one job of this size is split into there."""

    def as_json(self) -> dict[str, object]:
        return asdict(self)


class _OneJob:
    """Every piece of a step's jobs, pushed to a native queue of its own as one job: the
    worker's copies (same pieces, same order, same copy threads, same run length per
    thread) without the per-job cost of submitting, checking and completing jobs. Calling
    it copies them once."""

    def __init__(self, library: NativeCopy, backend: NativeCpuBackend,
                 step: StepPlan) -> None:
        pieces = [p for job in (*step.stores, *step.loads) for p in backend.plan(job)]
        self._packed = pack(pieces)
        self._queue = library.queue(backend.copy_threads, backend.parallel_bytes // 2)

    def __call__(self) -> None:
        self._queue.wait(self._queue.push(self._packed).seq)

    def close(self) -> None:
        self._queue.close()


def _one_job(worker: TransferWorker, step: StepPlan) -> _OneJob | None:
    """The one-job reference of ``step`` where the worker copies with the native queue."""
    backend = worker.backend
    library = load_native_copy()
    if not isinstance(backend, NativeCpuBackend) or library is None:
        return None
    return _OneJob(library, backend, step)


def run_size(block_bytes: int, args: argparse.Namespace, device: torch.device,
             scrub: torch.Tensor | None) -> Row:
    segments = args.segments
    page = block_bytes // (segments * args.factor)
    num = max(args.factor, (args.total_mib * KIB * KIB) // block_bytes)
    num -= num % args.blocks_per_job if num >= args.blocks_per_job else 0
    engine_blocks = num * args.factor
    spec = GroupSpec(GroupKind.FULL_ATTENTION, block_size=16, num_layers=segments,
                     page_bytes=page)
    config = OffloadConfig(groups=(spec,), hash_block_size=16, block_size_factor=args.factor,
                           host_capacity_bytes=2 * num * block_bytes, eviction_policy="lru")
    # Engine cache: one (blocks, page) uint8 tensor per segment, twice the blocks needed,
    # so stores read and loads write scattered blocks.
    cache = [torch.randint(0, 256, (2 * engine_blocks + 1, page), dtype=torch.uint8,
                           device=device) for _ in range(segments)]
    def new_worker(staging_bytes: int | None) -> TransferWorker:
        backend = cpu_backend(copy_threads=args.threads or None,
                              native_copy=False if args.memmove else None) \
            if device.type == "cpu" else None
        out = TransferWorker(config, backend=backend, staging_bytes=staging_bytes)
        out.register_kv_caches([GroupTensors(0, [(f"s{i}", t) for i, t in enumerate(cache)])])
        return out

    worker = new_worker(args.staging_bytes)
    # --compare-staging: the same cache behind a second worker with that staging budget.
    split = new_worker(args.compare_staging) if args.compare_staging else None
    gen = torch.Generator().manual_seed(block_bytes)
    ids = (torch.randperm(2 * engine_blocks, generator=gen) + 1).tolist()
    src_ids, dst_ids = ids[:engine_blocks], ids[engine_blocks:]
    slots = torch.randperm(2 * num, generator=gen)[:num].tolist()
    per_job = min(args.blocks_per_job, num)
    next_id = [1]

    def plan(direction: Direction, block_ids: list[int]) -> StepPlan:
        out = []
        for k in range(0, num, per_job):
            blocks = tuple(block_ids[k * args.factor : (k + per_job) * args.factor])
            transfer = GroupTransfer(0, blocks, 0, tuple(slots[k : k + per_job]))
            out.append(TransferJob(JobId(next_id[0]), direction, f"r{k}", (transfer,)))
            next_id[0] += 1
        return StepPlan(stores=tuple(out)) if direction is Direction.STORE \
            else StepPlan(loads=tuple(out))

    def through_worker(step: StepPlan, runner: TransferWorker | None = None,
                       ) -> Callable[[], None]:
        batch = (*step.stores, *step.loads)
        w = runner or worker

        def run() -> None:
            w.execute(step)
            w.wait(j.job_id for j in batch)
            report = w.poll()
            assert not report.failed and len(report.finished) == len(batch), report

        return run

    total: int = num * block_bytes
    # The same bytes between the same two allocations: each engine tensor's first
    # ``share`` bytes to (from) consecutive arena bytes.
    share = num * args.factor * page
    arena_flat = worker.host_pool.arena.view(-1)  # host bytes
    pinned = worker.host_pool.pinned
    pairs = [(arena_flat[i * share : (i + 1) * share], t.view(-1)[:share])
             for i, t in enumerate(cache)]

    def contiguous_store() -> None:
        for host, engine in pairs:
            host.copy_(engine, non_blocking=True)

    def contiguous_load() -> None:
        for host, engine in pairs:
            engine.copy_(host, non_blocking=True)

    def check_loaded() -> None:
        for t in cache:
            assert torch.equal(t[torch.tensor(src_ids, device=device)],
                               t[torch.tensor(dst_ids, device=device)]), "loaded bytes differ"

    # Warm up (thread pools, pinned staging, page faults on both sides) and check bytes.
    through_worker(plan(Direction.STORE, src_ids))()
    through_worker(plan(Direction.LOAD, dst_ids))()
    check_loaded()
    chunks: int | None = None
    if split is not None:  # it moves the same bytes too
        for t in cache:
            t[torch.tensor(dst_ids, device=device)] = 0
        through_worker(plan(Direction.STORE, src_ids), split)()
        through_worker(plan(Direction.LOAD, dst_ids), split)()
        check_loaded()
        copier = getattr(split.backend, "_copier", None)
        if copier is not None:
            chunks = -(-per_job // copier.slots_per_chunk(0))
    raw_store = _one_job(worker, plan(Direction.STORE, src_ids))
    raw_load = _one_job(worker, plan(Direction.LOAD, dst_ids))
    if raw_store is not None and raw_load is not None:  # it copies the same bytes, too
        for t in cache:
            t[torch.tensor(dst_ids, device=device)] = 0
        raw_store()
        raw_load()
        check_loaded()
    contiguous_store()
    contiguous_load()
    store_t, load_t, base_store_t, base_load_t = [], [], [], []
    split_store_t: list[float] = []
    split_load_t: list[float] = []
    raw_store_t: list[float] = []
    raw_load_t: list[float] = []

    def timed(fn: Callable[[], None]) -> float:
        if scrub is not None:
            scrub.sum()  # reads: the dirty lines of the last run are written back now
        time.sleep(args.gap_ms / 1000)
        return _timed(fn, device)

    submit_t: list[float] = []

    def time_submit() -> None:
        """``execute`` alone, its jobs held back from the copy threads."""
        backend = worker.backend
        if not isinstance(backend, CpuBackend):
            return
        step = plan(Direction.STORE, src_ids)
        backend.hold(Direction.STORE)
        start = time.perf_counter()
        worker.execute(step)
        submit_t.append((time.perf_counter() - start) / len(step.stores))
        backend.hold(Direction.STORE, False)
        worker.wait(j.job_id for j in step.stores)
        assert len(worker.poll().finished) == len(step.stores)

    for rep in range(args.reps):
        time_submit()
        stores = through_worker(plan(Direction.STORE, src_ids))
        loads = through_worker(plan(Direction.LOAD, dst_ids))
        split_stores = through_worker(plan(Direction.STORE, src_ids), split) \
            if split is not None else None
        split_loads = through_worker(plan(Direction.LOAD, dst_ids), split) \
            if split is not None else None
        # Each direction's runs in an order that rotates from one repetition to the next.
        for candidates in ([(base_store_t, contiguous_store), (store_t, stores),
                            (raw_store_t, raw_store), (split_store_t, split_stores)],
                           [(base_load_t, contiguous_load), (load_t, loads),
                            (raw_load_t, raw_load), (split_load_t, split_loads)]):
            runs = [(times, fn) for times, fn in candidates if fn is not None]
            shift = rep % len(runs)
            for times, fn in runs[shift:] + runs[:shift]:
                times.append(timed(fn))
    worker.shutdown()
    if split is not None:
        split.shutdown()
    for raw in (raw_store, raw_load):
        if raw is not None:
            raw.close()

    def gbps(times: list[float]) -> float:
        return total / float(min(times) if args.best else statistics.median(times)) / 1e9

    def ratios(worker_t: list[float], ref_t: list[float]) -> list[float]:
        # Paired with the reference run next to it: robust to bandwidth drifting over time.
        return [r / w for w, r in zip(worker_t, ref_t, strict=True)]

    def ratio(worker_t: list[float], ref_t: list[float]) -> float:
        if args.best:  # fastest worker run / fastest reference run
            return min(ref_t) / min(worker_t)
        return float(statistics.median(ratios(worker_t, ref_t)))

    def quartiles(worker_t: list[float], ref_t: list[float]) -> tuple[float, float]:
        values = ratios(worker_t, ref_t)
        if len(values) < 2:
            return values[0], values[0]
        q = statistics.quantiles(values, n=4)
        return float(q[0]), float(q[2])

    return Row(block_kib=block_bytes // KIB, page_kib=page / KIB, blocks=num,
               store_gbps=gbps(store_t), store_ref_gbps=gbps(base_store_t),
               load_gbps=gbps(load_t), load_ref_gbps=gbps(base_load_t),
               store_ratio=ratio(store_t, base_store_t), load_ratio=ratio(load_t, base_load_t),
               store_ratio_q=quartiles(store_t, base_store_t),
               load_ratio_q=quartiles(load_t, base_load_t), arena_pinned=pinned,
               raw_store_gbps=gbps(raw_store_t) if raw_store_t else None,
               raw_load_gbps=gbps(raw_load_t) if raw_load_t else None,
               raw_store_ratio=ratio(raw_store_t, base_store_t) if raw_store_t else None,
               raw_load_ratio=ratio(raw_load_t, base_load_t) if raw_load_t else None,
               submit_us=1e6 * min(submit_t) if submit_t else None,
               split_store_ratio=ratio(split_store_t, store_t) if split_store_t else None,
               split_load_ratio=ratio(split_load_t, load_t) if split_load_t else None,
               staging_chunks=chunks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", action="store_true", help="print rows as JSON")
    parser.add_argument("--sizes-kib", type=int, nargs="*", default=[s // KIB for s in SIZES])
    parser.add_argument("--segments", type=int, default=1,
                        help="page segments per block (e.g. 2 = separate K and V tensors)")
    parser.add_argument("--factor", type=int, default=1, help="block_size_factor")
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per run")
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads and CPU copy threads (default: as is)")
    parser.add_argument("--best", action="store_true",
                        help="GB/s and ratio from the fastest run of each kind instead of "
                             "medians: on a machine shared with other work, the fastest "
                             "runs are the ones nothing else interrupted")
    parser.add_argument("--memmove", action="store_true",
                        help="CPU backend: copy with ctypes.memmove from Python threads "
                             "instead of the native queue (the fallback without a C "
                             "compiler)")
    parser.add_argument("--scrub-mib", type=int, default=None,
                        help="MiB read before every timed run to clean the CPU caches "
                             "(default: twice the last-level cache, at most 1024; 0: off)")
    parser.add_argument("--gap-ms", type=float, default=0.0,
                        help="idle time before every timed run (worker and reference alike)")
    parser.add_argument("--staging-bytes", default=None,
                        help="CUDA: the worker's device staging budget per direction, a "
                             "size such as 64MiB (default: the backend's, 64 MiB)")
    parser.add_argument("--compare-staging", default=None,
                        help="CUDA: also time a worker with this staging budget and report "
                             "its throughput over the first worker's ('split')")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    for name in ("staging_bytes", "compare_staging"):
        value = getattr(args, name)
        if value is not None:
            if args.device != "cuda":
                print(f"--{name.replace('_', '-')}: the CUDA backend's; use --device cuda",
                      file=sys.stderr)
                return 2
            setattr(args, name, parse_size(value, f"--{name.replace('_', '-')}", minimum=1))
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    probe = cpu_backend(native_copy=False if args.memmove else None)
    copy_threads = args.threads or probe.copy_threads
    copy_path = "native queue" if probe.native_copy else "memmove"
    scrub_mib = args.scrub_mib if args.scrub_mib is not None \
        else min(1024, 2 * _llc_bytes() // (KIB * KIB))
    scrub = torch.ones(scrub_mib * KIB * KIB // 8, dtype=torch.int64) if scrub_mib else None
    rows = [run_size(kib * KIB, args, device, scrub) for kib in args.sizes_kib]
    if args.json:
        print(json.dumps({"device": args.device, "segments": args.segments,
                          "factor": args.factor, "threads": torch.get_num_threads(),
                          "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
                          "gap_ms": args.gap_ms, "scrub_mib": scrub_mib,
                          "copy_threads": copy_threads if args.device == "cpu" else None,
                          "copy_path": copy_path if args.device == "cpu" else None,
                          "staging_bytes": args.staging_bytes,
                          "compare_staging": args.compare_staging,
                          "huge_page_mib": _huge_page_mib(),
                          "rows": [r.as_json() for r in rows]}, indent=1))
        return 0
    copies = f" copy threads={copy_threads} ({copy_path})" if args.device == "cpu" else ""
    arena = "pinned host arena" if rows and rows[0].arena_pinned else "host arena"
    print(f"ratio = worker throughput / one contiguous copy_ of the same bytes between the "
          f"{args.device} engine cache and the {arena}")
    one_job = any(r.raw_store_gbps is not None for r in rows)
    if one_job:
        print("1-job = the worker's pieces pushed to a native queue as one job (same pieces, "
              "threads and order, no per-job cost): what scattered copies of these pages "
              "reach here; its ratio is against the same contiguous copy_")
    print(f"device={args.device} segments/block={args.segments} factor={args.factor} "
          f"torch threads={torch.get_num_threads()}{copies} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} gap={args.gap_ms:g}ms "
          f"scrub={scrub_mib}MiB huge pages={_huge_page_mib()}MiB "
          f"(THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}) "
          f"({'best' if args.best else 'median'} of {args.reps}, paired-ratio quartiles in "
          f"brackets; GB/s)")
    raw_head = f" {'1-job':>6} {'ratio':>5}" if one_job else ""
    submit = any(r.submit_us is not None for r in rows)
    if submit:
        print("submit = Python time of TransferWorker.execute per store job, the copies held "
              "back (best run; us)")
    head = (f"{'block':>8} {'page':>9} {'store':>7} {'contig':>7} {'ratio':>17}{raw_head}   "
            f"{'load':>7} {'contig':>7} {'ratio':>17}{raw_head}"
            + (f" {'submit':>7}" if submit else ""))
    if args.compare_staging:
        print(f"split = throughput with a staging budget of {args.compare_staging} bytes / "
              f"with {args.staging_bytes or 'the default'} (paired median; chunks per job "
              "in brackets)")
        head += f" {'split st':>10} {'split ld':>8}"
    print(head)

    def cell(ratio: float, q: tuple[float, float]) -> str:
        return f"{ratio:.2f} [{q[0]:.2f}-{q[1]:.2f}]"

    def raw(gbps: float | None, ratio: float | None) -> str:
        if not one_job:
            return ""
        if gbps is None or ratio is None:
            return f" {'-':>6} {'-':>5}"
        return f" {gbps:>6.2f} {ratio:>5.2f}"

    for r in rows:
        print(f"{r.block_kib:>6}Ki {r.page_kib:>7.1f}Ki "
              f"{r.store_gbps:>7.2f} {r.store_ref_gbps:>7.2f} "
              f"{cell(r.store_ratio, r.store_ratio_q):>17}"
              f"{raw(r.raw_store_gbps, r.raw_store_ratio)}   "
              f"{r.load_gbps:>7.2f} {r.load_ref_gbps:>7.2f} "
              f"{cell(r.load_ratio, r.load_ratio_q):>17}"
              f"{raw(r.raw_load_gbps, r.raw_load_ratio)}"
              + (f" {r.submit_us:>7.1f}" if r.submit_us is not None else "")
              + (f" {f'{r.split_store_ratio:.2f} [{r.staging_chunks}]':>10}"
                 f" {r.split_load_ratio:>8.2f}"
                 if r.split_store_ratio is not None and r.split_load_ratio is not None
                 else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
