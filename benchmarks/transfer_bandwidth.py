"""Store and load throughput of the real TransferWorker, against one contiguous copy.

For each offloaded-block size (the bytes of one offloaded block: all its pages together),
the script fills an engine cache, stores ``--total-mib`` of blocks from scattered engine
blocks into scattered host slots through ``TransferWorker.execute``/``wait`` in jobs of
``--blocks-per-job`` blocks, then loads them back into other scattered blocks. The
reference is one contiguous ``copy_`` of the same number of bytes between the same two
allocations (engine cache <-> host arena), timed in the same run, interleaved with the
worker runs. The ratio is worker throughput / contiguous throughput, taken per repetition
against the reference run next to it and reported as the median (shared machines drift);
the GB/s columns are medians. The worker's loaded bytes are checked against the stored ones
once per size.

    python benchmarks/transfer_bandwidth.py                 # CPU backend
    python benchmarks/transfer_bandwidth.py --device cuda   # CUDA backend, pinned arena
    python benchmarks/transfer_bandwidth.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob
from kvoffload.worker import GroupTensors, TransferWorker

KIB = 1024
SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB, 4096 * KIB]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def run_size(block_bytes: int, args: argparse.Namespace, device: torch.device) -> Row:
    segments = args.segments
    page = block_bytes // (segments * args.factor)
    num = max(args.factor, (args.total_mib * KIB * KIB) // block_bytes)
    num -= num % args.blocks_per_job if num >= args.blocks_per_job else 0
    engine_blocks = num * args.factor
    spec = GroupSpec(GroupKind.FULL_ATTENTION, block_size=16, num_layers=segments,
                     page_bytes=page)
    config = OffloadConfig(groups=(spec,), hash_block_size=16, block_size_factor=args.factor,
                           host_capacity_bytes=2 * num * block_bytes)
    # Engine cache: one (blocks, page) uint8 tensor per segment, twice the blocks needed,
    # so stores read and loads write scattered blocks.
    cache = [torch.randint(0, 256, (2 * engine_blocks + 1, page), dtype=torch.uint8,
                           device=device) for _ in range(segments)]
    worker = TransferWorker(config)
    worker.register_kv_caches([GroupTensors(0, [(f"s{i}", t) for i, t in enumerate(cache)])])
    gen = torch.Generator().manual_seed(block_bytes)
    ids = (torch.randperm(2 * engine_blocks, generator=gen) + 1).tolist()
    src_ids, dst_ids = ids[:engine_blocks], ids[engine_blocks:]
    slots = torch.randperm(2 * num, generator=gen)[:num].tolist()
    per_job = min(args.blocks_per_job, num)
    next_id = [1]

    def jobs(direction: Direction, block_ids: list[int]) -> list[TransferJob]:
        out = []
        for k in range(0, num, per_job):
            blocks = tuple(block_ids[k * args.factor : (k + per_job) * args.factor])
            transfer = GroupTransfer(0, blocks, 0, tuple(slots[k : k + per_job]))
            out.append(TransferJob(JobId(next_id[0]), direction, f"r{k}", (transfer,)))
            next_id[0] += 1
        return out

    def through_worker(direction: Direction, block_ids: list[int]) -> None:
        batch = tuple(jobs(direction, block_ids))
        plan = StepPlan(stores=batch) if direction is Direction.STORE else StepPlan(loads=batch)
        worker.execute(plan)
        worker.wait(j.job_id for j in batch)
        report = worker.poll()
        assert not report.failed and len(report.finished) == len(batch), report

    total: int = num * block_bytes
    arena_flat = worker.host_pool.arena.view(-1)[:total]  # (total,) host bytes
    engine_flat = cache[0].view(-1)[:total]  # (total,) engine bytes, same allocation kind

    def contiguous_store() -> None:
        arena_flat.copy_(engine_flat, non_blocking=True)

    def contiguous_load() -> None:
        engine_flat.copy_(arena_flat, non_blocking=True)

    # Warm up (thread pools, pinned staging, page faults) and check bytes once.
    through_worker(Direction.STORE, src_ids)
    through_worker(Direction.LOAD, dst_ids)
    for t in cache:
        assert torch.equal(t[torch.tensor(src_ids, device=device)],
                           t[torch.tensor(dst_ids, device=device)]), "loaded bytes differ"
    store_t, load_t, base_store_t, base_load_t = [], [], [], []
    for _ in range(args.reps):
        base_store_t.append(_timed(contiguous_store, device))
        store_t.append(_timed(lambda: through_worker(Direction.STORE, src_ids), device))
        base_load_t.append(_timed(contiguous_load, device))
        load_t.append(_timed(lambda: through_worker(Direction.LOAD, dst_ids), device))
    worker.shutdown()

    def gbps(times: list[float]) -> float:
        return total / float(statistics.median(times)) / 1e9

    def ratio(worker_t: list[float], ref_t: list[float]) -> float:
        # Paired with the reference run next to it: robust to bandwidth drifting over time.
        return float(statistics.median(r / w for w, r in zip(worker_t, ref_t, strict=True)))

    return Row(block_kib=block_bytes // KIB, page_kib=page / KIB, blocks=num,
               store_gbps=gbps(store_t), store_ref_gbps=gbps(base_store_t),
               load_gbps=gbps(load_t), load_ref_gbps=gbps(base_load_t),
               store_ratio=ratio(store_t, base_store_t), load_ratio=ratio(load_t, base_load_t))


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
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    rows = [run_size(kib * KIB, args, device) for kib in args.sizes_kib]
    if args.json:
        print(json.dumps({"device": args.device, "segments": args.segments,
                          "factor": args.factor, "threads": torch.get_num_threads(),
                          "rows": [r.as_json() for r in rows]}, indent=1))
        return 0
    print(f"device={args.device} segments/block={args.segments} factor={args.factor} "
          f"torch threads={torch.get_num_threads()} (median of {args.reps}; GB/s)")
    head = (f"{'block':>8} {'page':>9} {'store':>7} {'contig':>7} {'ratio':>6}   "
            f"{'load':>7} {'contig':>7} {'ratio':>6}")
    print(head)
    for r in rows:
        print(f"{r.block_kib:>6}Ki {r.page_kib:>7.1f}Ki "
              f"{r.store_gbps:>7.2f} {r.store_ref_gbps:>7.2f} {r.store_ratio:>6.2f}   "
              f"{r.load_gbps:>7.2f} {r.load_ref_gbps:>7.2f} {r.load_ratio:>6.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
