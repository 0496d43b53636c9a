"""Disk and remote tier throughput, against raw file I/O and raw Redis SET/GET.

For each block size, the script fills ``--total-mib`` of host slots with random bytes and
moves them through a real ``TierIO`` (the worker's tier path: framing, XXH3-64 checksum,
atomic temporary-file + rename on disk, pipelined ``SET``/``GET`` on Redis, verification of
every header and checksum on the way back into the slots), as ``DEMOTE`` jobs (store) and
``PROMOTE`` jobs (load). The reference moves the same bytes with the same number of
threads and the same batching, doing only the raw operation:

* disk store: ``open``/``write``/``close`` of one new file per block (plus, when the tier
  fsyncs, ``fsync`` of the file and of its directory: the same durability as the tier's
  block, whose name too must reach the disk); disk load: ``open``/``readinto``/``close``
  of those files;
* remote store: pipelined ``SET`` of the bare payloads; remote load: pipelined ``GET``.

The remote tier is measured twice: against one standalone server (``remote``: one
master) and against a Redis Cluster of ``--cluster-masters`` masters started on loopback
(``cluster``), each against raw ``SET``/``GET`` on the same servers (on the cluster,
through redis-py's cluster pipeline, which groups commands per master).

Both run in the same process, interleaved (which goes first alternates), several
repetitions; the ratio is tier throughput / raw throughput per repetition, reported as the
median. The ``cpu`` column is the median of raw / tier CPU seconds of this process (user and
system, all threads) per repetition: the tier's extra work, which a busy machine blurs less
than wall time. Disk reads come from the page cache for both sides, where the tier's checksum of
every byte is the dominant extra cost (``kvoffload.blockfile.checksum``: natively, each piece
is hashed right after it is read, while in cache, without the GIL; run with
``KVOFFLOAD_NATIVE_CHECKSUM=0`` to measure the ``xxhash`` package instead); ``--cold``
evicts each side's files from the page cache before it reads (``POSIX_FADV_DONTNEED`` on
those files only), measuring reads from the disk, which a tier larger than memory does;
``--fsync`` also measures durable writes. Loaded slot bytes are compared
with the stored ones once per size. A ``redis-server`` is started on a free loopback port
unless ``--redis-url`` is given.

Goal: the disk tier at >= 0.85 of raw file I/O in every cell; the remote tier at >= 0.8 of
raw ``SET``/``GET`` for blocks of 256 KiB and more.

    python benchmarks/tier_throughput.py
    python benchmarks/tier_throughput.py --sizes 256,1024,4096 --fsync --cold --json
    python benchmarks/tier_throughput.py --tiers disk --sizes 256,1024,4096 --cold
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kvoffload.blockfile.checksum import NATIVE, checksums
from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import TierJob, TierJobId, TierOp
from kvoffload.keys import make_offload_key
from kvoffload.tiers.config import DiskTierConfig, RemoteTierConfig, TierConfig
from kvoffload.worker import GroupTensors, TransferWorker
from kvoffload.worker.tier_io import TierIO

KIB = 1024


@dataclass
class Row:
    tier: str
    op: str
    block_kib: int
    tier_mb_s: float
    raw_mb_s: float
    ratio: float
    ratio_min: float
    ratio_max: float
    cpu_ratio: float
    """Median of raw / tier CPU seconds (this process, all threads) per repetition: what the
    tier's extra work costs, steadier than wall time on a busy machine."""


# -- set-up -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: run scripts/install_redis.sh or pass --redis-url")
    port = free_port()
    with tempfile.TemporaryDirectory() as directory:
        proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", directory],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            import redis

            client = redis.Redis(port=port)
            for _ in range(200):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.02)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


@contextmanager
def redis_cluster(masters: int) -> Iterator[str]:
    """A Redis Cluster of ``masters`` masters (no replicas) on loopback; yields a seed URL."""
    binary, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if binary is None or cli is None:
        sys.exit("redis-server/redis-cli not found: run scripts/install_redis.sh")
    with tempfile.TemporaryDirectory() as directory:
        ports, procs = [], []
        while len(ports) < masters:
            port = free_port()
            if port + 10_000 > 65_535:
                continue  # the cluster bus listens on port + 10000
            ports.append(port)
            procs.append(subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled",
                 "yes", "--cluster-config-file", f"nodes-{port}.conf", "--save", "",
                 "--appendonly", "no", "--dir", directory],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        try:
            for port in ports:
                for _ in range(200):
                    done = subprocess.run([cli, "-p", str(port), "PING"], capture_output=True,
                                          check=False)
                    if done.stdout.strip() == b"PONG":
                        break
                    time.sleep(0.02)
            subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports),
                            "--cluster-replicas", "0", "--cluster-yes"], check=True,
                           capture_output=True)
            for _ in range(300):
                info = subprocess.run([cli, "-p", str(ports[0]), "CLUSTER", "INFO"],
                                      capture_output=True, check=False).stdout
                if b"cluster_state:ok" in info:
                    break
                time.sleep(0.05)
            yield f"redis://127.0.0.1:{ports[0]}/0"
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


def worker_for(block_bytes: int, num_slots: int, tiers: TierConfig) -> TransferWorker:
    """A worker with one group whose offloaded block is ``block_bytes``, and its arena
    filled with random bytes."""
    spec = GroupSpec(GroupKind.FULL_ATTENTION, 16, page_bytes=block_bytes)
    config = OffloadConfig(groups=(spec,), hash_block_size=16,
                           host_capacity_bytes=block_bytes * num_slots, eviction_policy="lru")
    cache = torch.zeros((2, block_bytes), dtype=torch.uint8)
    worker = TransferWorker(config, 0, pin_memory=False, tiers=tiers)
    worker.register_kv_caches([GroupTensors(0, [("layer", cache)])])
    arena = worker.host_pool.arena
    arena.copy_(torch.randint(0, 256, arena.shape, dtype=torch.uint8))
    return worker


_ids = iter(range(1 << 62))


def jobs(op: TierOp, tier: str, keys: list[bytes], slots: range) -> list[TierJob]:
    return [TierJob(TierJobId(next(_ids)), op, tier, k, 0, s) for k, s in zip(keys, slots,
                                                                              strict=True)]


def run_tier(io: TierIO, job_list: list[TierJob]) -> float:
    start = time.perf_counter()
    io.begin((), job_list)
    io.wait()
    seconds = time.perf_counter() - start
    failed = io.poll().failed
    if failed:
        raise RuntimeError(f"{len(failed)} tier jobs failed")
    return seconds


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# -- raw references ---------------------------------------------------------------------------


def raw_disk_write(directory: str, payloads: list[memoryview], threads: int,
                   fsync: bool) -> Callable[[], None]:
    """One new file per block; with ``fsync``, durable as the tier's are: the file and
    then its directory entry (a new file's name survives a crash only once its directory
    is fsync-ed), once per block."""
    os.makedirs(directory, exist_ok=True)
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)

    def one(i: int) -> None:
        fd = os.open(f"{i}.raw", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644, dir_fd=dir_fd)
        try:
            view = payloads[i]
            while view.nbytes:
                view = view[os.write(fd, view):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if fsync:
            os.fsync(dir_fd)

    def run() -> None:
        try:
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(one, range(len(payloads))))
        finally:
            os.close(dir_fd)

    return run


def drop_from_page_cache(directory: str) -> None:
    """Evict every file under ``directory`` from the page cache (``POSIX_FADV_DONTNEED``
    on each file: only these files, nothing else on the machine), so the next reads go
    to the disk."""
    for root, _, names in os.walk(directory):
        for name in names:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def raw_disk_read(directory: str, buffers: list[memoryview],
                  threads: int) -> Callable[[], None]:
    def one(i: int) -> None:
        with open(os.path.join(directory, f"{i}.raw"), "rb", buffering=0) as f:
            f.readinto(buffers[i])

    def run() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(buffers))))

    return run


def raw_redis(client: object, names: list[bytes], payloads: list[memoryview],  # noqa: PLR0917
              buffers: list[memoryview], threads: int, batch: int,
              write: bool) -> Callable[[], None]:
    chunks = [range(i, min(i + batch, len(names))) for i in range(0, len(names), batch)]

    def one(chunk: range) -> None:
        pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
        for i in chunk:
            if write:
                pipe.set(names[i], payloads[i])
            else:
                pipe.get(names[i])
        replies = pipe.execute()
        if not write:
            for i, value in zip(chunk, replies, strict=True):
                buffers[i][:] = value  # the tier copies into the slot too

    def run() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, chunks))

    return run


# -- one block size ---------------------------------------------------------------------------


def measure(block_kib: int, args: argparse.Namespace, redis_url: str,
            scratch: str, cluster: bool = False) -> list[Row]:
    """Rows for one block size: disk and remote, or (``cluster``) the remote tier alone
    on the Redis Cluster ``redis_url`` seeds, named ``cluster``."""
    block = block_kib * KIB
    count = max(4, args.total_mib * 1024 // block_kib)
    disk_dir = os.path.join(scratch, f"tier-{block_kib}")
    raw_dir = os.path.join(scratch, f"raw-{block_kib}")
    tiers = TierConfig(
        model_id="bench",
        disk=None if cluster else DiskTierConfig(disk_dir, 1 << 40, io_threads=args.threads,
                                                 fsync=args.fsync),
        remote=RemoteTierConfig(redis_url, io_threads=args.threads,
                                max_connections=args.threads + 1, timeout_s=30,
                                batch_blocks=args.batch, cluster=cluster))
    worker = worker_for(block, 2 * count, tiers)
    io = worker.tier_io
    assert io is not None
    arena = worker.host_pool.arena
    keys = [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(count)]  # type: ignore[arg-type]
    src = range(count)
    dst = range(count, 2 * count)
    payloads = [memoryview(arena[i].numpy()) for i in src]  # type: ignore[arg-type]
    buffers = [memoryview(arena[i].numpy()) for i in dst]  # type: ignore[arg-type]
    import redis
    from redis.cluster import RedisCluster

    client: Any = (RedisCluster.from_url(redis_url) if cluster
                   else redis.Redis.from_url(redis_url))
    names = [b"raw:%d" % i for i in range(count)]
    nbytes = count * block
    samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}

    for rep in range(args.repeats):
        for tier in (("remote",) if cluster else args.tiers):
            if tier == "disk":
                raw_store = raw_disk_write(raw_dir, payloads, args.threads, args.fsync)
                raw_load = raw_disk_read(raw_dir, buffers, args.threads)
            else:
                raw_store = raw_redis(client, names, payloads, buffers, args.threads,
                                      args.batch, write=True)
                raw_load = raw_redis(client, names, payloads, buffers, args.threads,
                                     args.batch, write=False)
            for op, raw, tier_op, slots in (("store", raw_store, TierOp.DEMOTE, src),
                                            ("load", raw_load, TierOp.PROMOTE, dst)):
                pair: list[float] = [0.0, 0.0]
                cpu_s: list[float] = [0.0, 0.0]
                order = (0, 1) if rep % 2 == 0 else (1, 0)
                for which in order:
                    if args.cold and tier == "disk" and op == "load":
                        drop_from_page_cache(disk_dir if which == 0 else raw_dir)
                    if tier == "disk":
                        # Each side starts with no dirty pages left by the other: the
                        # kernel throttles writers once enough are dirty.
                        os.sync()
                    time.sleep(0.05)
                    cpu_start = time.process_time()
                    if which == 0:
                        pair[0] = run_tier(io, jobs(tier_op, tier, keys, slots))
                    else:
                        pair[1] = timed(raw)
                    cpu_s[which] = time.process_time() - cpu_start
                samples.setdefault((tier, op), []).append((pair[0], pair[1]))
                cpu.setdefault((tier, op), []).append(cpu_s[1] / max(cpu_s[0], 1e-9))
            # Loaded bytes must be the stored ones.
            if rep == 0 and not torch.equal(arena[count:], arena[:count]):
                raise RuntimeError(f"{tier}: loaded bytes differ from the stored ones")
            arena[count:].zero_()
        if cluster:
            client.flushdb(target_nodes=RedisCluster.PRIMARIES)
        else:
            client.flushdb()
            shutil.rmtree(disk_dir, ignore_errors=True)
            shutil.rmtree(raw_dir, ignore_errors=True)
            io.stores["disk"].purge()
    worker.shutdown()
    client.close()

    rows = []
    for (tier, op), pairs in samples.items():
        ratios = [raw_s / tier_s for tier_s, raw_s in pairs]
        rows.append(Row(
            tier="cluster" if cluster else tier, op=op, block_kib=block_kib,
            tier_mb_s=nbytes / statistics.median(t for t, _ in pairs) / 1e6,
            raw_mb_s=nbytes / statistics.median(r for _, r in pairs) / 1e6,
            ratio=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios),
            cpu_ratio=statistics.median(cpu[(tier, op)])))
    return rows


def goal_of(row: Row) -> float | None:
    """The ratio ``row`` must reach (None: no goal for it)."""
    if row.tier == "disk":
        return 0.85
    return 0.8 if row.block_kib >= 256 else None


def checksum_name() -> str:
    """The checksum implementation the tier uses here, with its stripe loop."""
    used = checksums()
    if NATIVE is not None and used is NATIVE:
        return f"native ({NATIVE.kernel()})"
    return "xxhash package"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024,4096",
                        help="block sizes in KiB, comma separated")
    parser.add_argument("--total-mib", type=int, default=128, help="bytes moved per run")
    parser.add_argument("--threads", type=int, default=4, help="I/O threads, both sides")
    parser.add_argument("--batch", type=int, default=16, help="blocks per Redis pipeline")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--fsync", action="store_true",
                        help="durable disk writes (fsync) on both sides")
    parser.add_argument("--cold", action="store_true",
                        help="disk loads read from the disk, not the page cache (each "
                             "side's files are evicted from the page cache before it reads)")
    parser.add_argument("--tiers", default="disk,remote",
                        help="tiers to measure against their raw reference, comma separated")
    parser.add_argument("--redis-url", default=None)
    parser.add_argument("--dir", default=None, help="scratch directory (default: a temp dir)")
    parser.add_argument("--cluster-masters", type=int, default=3,
                        help="also measure the remote tier on a Redis Cluster of this many "
                             "masters started on loopback (0: skip)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    sizes = [int(s) for s in args.sizes.split(",")]
    args.tiers = tuple(t.strip() for t in args.tiers.split(","))
    unknown = set(args.tiers) - {"disk", "remote"}
    if unknown or not args.tiers:
        parser.error(f"--tiers takes disk and/or remote, got {args.tiers}")
    if "remote" not in args.tiers:
        args.cluster_masters = 0
    rows: list[Row] = []
    with redis_server(args.redis_url) as url, \
            tempfile.TemporaryDirectory(dir=args.dir, prefix="kvoffload-bench-") as scratch:
        for size in sizes:
            rows.extend(measure(size, args, url, scratch))
    if args.cluster_masters > 0:
        with redis_cluster(args.cluster_masters) as url, \
                tempfile.TemporaryDirectory(dir=args.dir, prefix="kvoffload-bench-") as scratch:
            for size in sizes:
                rows.extend(measure(size, args, url, scratch, cluster=True))
    if args.json:
        print(json.dumps([{**asdict(r), "checksum": checksum_name()} for r in rows], indent=1))
        return
    print(f"# tier throughput vs raw, {args.total_mib} MiB per run, {args.threads} threads, "
          f"redis pipeline {args.batch}, fsync={'on' if args.fsync else 'off'}, "
          f"disk loads {'cold (from disk)' if args.cold else 'from the page cache'}, "
          f"{args.repeats} repetitions (median, [min, max] of per-repetition ratios), "
          f"checksum {checksum_name()}")
    print(f"{'tier':7} {'op':6} {'block':>8} {'tier MB/s':>10} {'raw MB/s':>10} "
          f"{'ratio':>6}  {'range':14} {'cpu':>5}")
    for r in sorted(rows, key=lambda r: (r.tier, r.op, r.block_kib)):
        target = goal_of(r)
        goal = "" if target is None else (
            "  ok" if r.ratio >= target else f"  BELOW {target}")
        print(f"{r.tier:7} {r.op:6} {r.block_kib:>6}Ki {r.tier_mb_s:>10.0f} "
              f"{r.raw_mb_s:>10.0f} {r.ratio:>6.2f}  "
              f"{f'[{r.ratio_min:.2f}, {r.ratio_max:.2f}]':14} {r.cpu_ratio:>5.2f}"
              f"{goal}")
    print("goal: disk >= 0.85 in every cell; remote >= 0.8 for blocks >= 256 KiB "
          "(cpu: raw / tier CPU seconds of this process, median)")


if __name__ == "__main__":
    main()
