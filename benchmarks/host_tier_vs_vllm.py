"""Host tier cost per key: kvoffload's ``HostTier`` vs vLLM's ``CPUOffloadingManager``.

Both replay the same Mooncake-format trace with the same loop, one full-attention key per
512-token block (the trace's hash ids, chained into prefix hashes; only full blocks are
keys), host memory sized to 5, 10, 25 and 100 % of the trace's distinct keys, with LRU and
with ARC eviction. Per request, in vLLM's terms (its scheduler-side connector calls these)::

    on_new_request; lookup the keys in order until the first that is not a HIT;
    prepare_load(hits); prepare_store(misses); complete_load(hits);
    complete_store(stored); on_request_finished

and in kvoffload's (``Tier`` API; ``touch`` takes the place of vLLM's request-scoped
recency: the misses before the store, so ARC learns from its ghosts as vLLM's store-miss
hook does, and the whole prefix once more while the stores are in flight, as at a
request's end)::

    lookup the keys in order until the first that is not a HIT;
    prepare_load(hits); touch(misses); prepare_store(misses); touch(all keys);
    complete_load(hits); complete_store(stored)

Both managers must keep the same keys: the script checks that every request gets the same
number of hit blocks from both, and stops with an error otherwise. Cost is the time of a
whole replay divided by the keys the requests offered (each key of each request counted
once), in nanoseconds; keys, request contexts and the managers are built outside the
timed part; the time is the replaying thread's CPU time, with the garbage collector
paused. Each repetition runs
both managers back to back (alternating which goes first); the figures are medians over
the repetitions, and the ratio is kvoffload / vLLM of those medians.

    .venv/bin/python benchmarks/host_tier_vs_vllm.py                     # whole trace, 5 reps
    .venv/bin/python benchmarks/host_tier_vs_vllm.py --limit 3000 --repeat 3
    .venv/bin/python benchmarks/host_tier_vs_vllm.py --policy arc --capacity 25 --json

Goal: ratio <= 0.5 for both policies at every capacity.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import TraceError
from kvoffload.keys import BlockHash, hash_block, make_offload_key, root_hash
from kvoffload.policies import cache_policy
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.host import HostTier
from kvoffload.workloads.mooncake import MOONCAKE_BLOCK_TOKENS, iter_trace_records

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", ROOT.parent / "shared" / "traces"
                            / "mooncake_conversation_trace.jsonl"))
CAPACITIES = (5, 10, 25, 100)
"""Host capacity in percent of the trace's distinct keys."""
POLICIES = ("lru", "arc")
PAGE_BYTES = 64
"""Bytes of one block's page in the kvoffload config (bookkeeping only: no byte moves)."""


@dataclass(frozen=True)
class Replay:
    """One manager's replay of the trace: its time and the hit blocks of each request."""

    seconds: float
    hits: tuple[int, ...]


@dataclass(frozen=True)
class Row:
    """The figures of one (policy, capacity) cell."""

    policy: str
    capacity_pct: int
    capacity_keys: int
    keys: int
    hit_rate: float
    vllm_ns_per_key: float
    kvoffload_ns_per_key: float
    ratio: float


def read_prefixes(path: Path, limit: int | None) -> list[list[BlockHash]]:
    """Each request's chained block hashes, one per full 512-token block (the trace's hash
    ids hashed along the prefix, as an engine hashes token blocks)."""
    root = root_hash()
    prefixes: list[list[BlockHash]] = []
    for record in iter_trace_records(path, limit=limit):
        parent = root
        chain: list[BlockHash] = []
        for hash_id in record.hash_ids[:record.input_length // MOONCAKE_BLOCK_TOKENS]:
            parent = hash_block(parent, (hash_id,))
            chain.append(parent)
        prefixes.append(chain)
    return prefixes


def distinct_keys(prefixes: Sequence[Sequence[BlockHash]]) -> int:
    return len({block for prefix in prefixes for block in prefix})


# -- vLLM ----------------------------------------------------------------------------


def vllm_replay(prefixes: Sequence[Sequence[BlockHash]], capacity: int,
                policy: str) -> Replay:
    """Replay through vLLM's ``CPUOffloadingManager`` (module docstring loop)."""
    from vllm.v1.kv_offload.base import LookupResult as VLookup
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.base import make_offload_key as vllm_key
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    manager = CPUOffloadingManager(num_chunks=capacity, cache_policy=policy)
    requests = [[vllm_key(block, 0) for block in prefix] for prefix in prefixes]
    contexts = [ReqContext(req_id=f"r{i}") for i in range(len(requests))]
    hit = VLookup.HIT
    hits: list[int] = []

    def run() -> None:
        lookup = manager.lookup
        for keys, ctx in zip(requests, contexts, strict=True):
            manager.on_new_request(ctx)
            n = 0
            for key in keys:
                if lookup(key, ctx) is not hit:
                    break
                n += 1
            loaded = keys[:n]
            if n:
                manager.prepare_load(loaded, ctx)
            out = manager.prepare_store(keys[n:], ctx) if n < len(keys) else None
            if n:
                manager.complete_load(loaded, ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx)
            manager.on_request_finished(ctx)
            hits.append(n)

    return Replay(timed(run), tuple(hits))


# -- kvoffload -----------------------------------------------------------------------


def host_config(capacity: int, policy: str) -> OffloadConfig:
    """One full-attention group of 512-token blocks; ``capacity`` host slots."""
    group = GroupSpec(GroupKind.FULL_ATTENTION, block_size=MOONCAKE_BLOCK_TOKENS,
                      num_layers=1, page_bytes=PAGE_BYTES)
    return OffloadConfig(groups=(group,), hash_block_size=MOONCAKE_BLOCK_TOKENS,
                         host_capacity_bytes=PAGE_BYTES * capacity, eviction_policy=policy)


def kvoffload_replay(prefixes: Sequence[Sequence[BlockHash]], capacity: int,
                     policy: str) -> Replay:
    """Replay through kvoffload's ``HostTier`` (module docstring loop)."""
    tier = HostTier(host_config(capacity, policy), cache_policy(policy), enable_events=False)
    if tier.capacity != capacity:
        raise RuntimeError(f"host tier has {tier.capacity} slots, wanted {capacity}")
    requests = [[make_offload_key(block, 0) for block in prefix] for prefix in prefixes]
    hit = LookupResult.HIT
    hits: list[int] = []

    def run() -> None:
        lookup = tier.lookup
        for keys in requests:
            n = 0
            for key in keys:
                if lookup(key) is not hit:
                    break
                n += 1
            loaded = keys[:n]
            if n:
                tier.prepare_load(loaded)
            result = None
            if n < len(keys):
                misses = keys[n:]
                tier.touch(misses)
                result = tier.prepare_store(misses)
            tier.touch(keys)
            if n:
                tier.complete_load(loaded)
            if result is not None and result.keys_to_store:
                tier.complete_store(result.keys_to_store)
            hits.append(n)

    seconds = timed(run)
    tier.check_integrity()
    return Replay(seconds, tuple(hits))


# -- measurement ---------------------------------------------------------------------


def timed(run: Callable[[], None]) -> float:
    """CPU seconds of this thread while ``run`` runs, with the garbage collector paused
    (CPU time, not wall time: other processes on the machine inflate it much less)."""
    gc.collect()
    gc.disable()
    try:
        start = time.thread_time()
        run()
        return time.thread_time() - start
    finally:
        gc.enable()


REPLAYS: dict[str, Callable[[Sequence[Sequence[BlockHash]], int, str], Replay]] = {
    "vllm": vllm_replay,
    "kvoffload": kvoffload_replay,
}


def measure(prefixes: Sequence[Sequence[BlockHash]], policy: str, pct: int, working_set: int,
            repeat: int) -> Row:
    """Interleaved repetitions of both replays at one capacity; medians and their ratio."""
    capacity = max(1, working_set * pct // 100)
    seconds: dict[str, list[float]] = {name: [] for name in REPLAYS}
    hits: dict[str, tuple[int, ...]] = {}
    names = list(REPLAYS)
    for rep in range(repeat):
        for name in names if rep % 2 == 0 else names[::-1]:
            replay = REPLAYS[name](prefixes, capacity, policy)
            seconds[name].append(replay.seconds)
            if hits.setdefault(name, replay.hits) != replay.hits:
                raise RuntimeError(f"{name} {policy} at {pct} %: hits differ between "
                                   "repetitions of the same replay")
    if hits["vllm"] != hits["kvoffload"]:
        first = next(i for i, (a, b) in enumerate(zip(hits["vllm"], hits["kvoffload"],
                                                      strict=True)) if a != b)
        raise RuntimeError(
            f"{policy} at {pct} %: the managers kept different keys (first at request "
            f"{first}: vLLM hit {hits['vllm'][first]} blocks, kvoffload "
            f"{hits['kvoffload'][first]}; totals {sum(hits['vllm'])} vs "
            f"{sum(hits['kvoffload'])})")
    keys = sum(len(prefix) for prefix in prefixes)
    ns = {name: statistics.median(times) / keys * 1e9 for name, times in seconds.items()}
    return Row(policy=policy, capacity_pct=pct, capacity_keys=capacity, keys=keys,
               hit_rate=sum(hits["vllm"]) / keys, vllm_ns_per_key=ns["vllm"],
               kvoffload_ns_per_key=ns["kvoffload"],
               ratio=ns["kvoffload"] / ns["vllm"])


def percent(text: str) -> int:
    value = int(text)
    if not 1 <= value <= 100:
        raise argparse.ArgumentTypeError(f"capacity must be a percent in [1, 100], got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE,
                        help=f"Mooncake-format JSON-lines trace (default: {TRACE})")
    parser.add_argument("--limit", type=int, default=None,
                        help="replay only the first N requests (default: all)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="interleaved repetitions per cell; medians are reported")
    parser.add_argument("--policy", choices=POLICIES, action="append",
                        help="eviction policy (repeatable; default: lru and arc)")
    parser.add_argument("--capacity", type=percent, action="append",
                        help="host capacity in percent of the distinct keys (repeatable; "
                             "default: 5, 10, 25, 100)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be >= 1, got {args.repeat}")
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit must be >= 1, got {args.limit}")
    try:
        prefixes = read_prefixes(args.trace, args.limit)
    except TraceError as exc:
        parser.error(str(exc))
    working_set = distinct_keys(prefixes)
    if working_set == 0:
        parser.error(f"{args.trace}: no request has a full {MOONCAKE_BLOCK_TOKENS}-token "
                     "block; give a trace with longer prompts")
    rows = [measure(prefixes, policy, pct, working_set, args.repeat)
            for policy in args.policy or POLICIES for pct in args.capacity or CAPACITIES]
    if args.json:
        print(json.dumps({"trace": args.trace.name, "requests": len(prefixes),
                          "distinct_keys": working_set, "repeat": args.repeat,
                          "rows": [asdict(row) for row in rows]}, indent=2))
        return 0
    print(f"trace {args.trace.name}: {len(prefixes)} requests, {rows[0].keys} keys offered, "
          f"{working_set} distinct; median of {args.repeat} interleaved repetitions")
    print(f"{'policy':<7}{'capacity':>9}{'slots':>9}{'hit rate':>10}"
          f"{'vLLM ns/key':>13}{'kvoffload ns/key':>18}{'ratio':>8}")
    for row in rows:
        print(f"{row.policy:<7}{row.capacity_pct:>8}%{row.capacity_keys:>9}"
              f"{row.hit_rate:>10.3f}{row.vllm_ns_per_key:>13.0f}"
              f"{row.kvoffload_ns_per_key:>18.0f}{row.ratio:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
