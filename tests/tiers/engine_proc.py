"""One engine process for the restart and sharing tests: serve prompts, print stats.

    python -m tiers.engine_proc --disk DIR --remote URL [--remote-cluster] --prompts 1,2 --extend 3

Builds the simulated engine with the real planner, a ``CascadeTier`` and two real
``TransferWorker`` ranks with tier I/O, serves the prompts (seeded token lists, each
extended by ``--extend`` fresh tokens) one after the other, shuts everything down, and
prints one JSON line: hit tokens per prompt and the cascade's counters. Every loaded block
is checked byte for byte by the engine (a wrong byte raises, the process exits non-zero).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvoffload.tiers.config import DiskTierConfig, RemoteTierConfig, TierConfig, WriteMode
from tiers.tier_kit import hybrid_config, prompt, tiered_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--disk")
    parser.add_argument("--remote")
    parser.add_argument("--remote-cluster", action="store_true",
                        help="--remote names one node of a Redis Cluster")
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--extend", type=int, default=0)
    parser.add_argument("--length", type=int, default=40)
    parser.add_argument("--host-slots", type=int, default=48)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    tiers = TierConfig(
        model_id="test-model",
        disk=DiskTierConfig(args.disk, 1 << 30, write_mode=WriteMode.WRITE_THROUGH,
                            io_threads=2, fsync=True) if args.disk else None,
        remote=RemoteTierConfig(args.remote, io_threads=2, max_connections=4,
                                negative_ttl_s=0.0, cluster=args.remote_cluster)
        if args.remote else None)
    hits = []
    with tiered_engine(hybrid_config(host_slots=args.host_slots), tiers) as engine:
        for seed in (int(s) for s in args.prompts.split(",")):
            tokens = prompt(seed, args.length) + prompt(10_000 + seed, args.extend)
            hits.append(engine.run([tokens]))
        stats = engine.tier.stats
        disk_extra = engine.tier.lower("disk").stats.extra if args.disk else {}
        out = {"hits": hits, "loaded": stats.loaded_blocks, "promoted": stats.promoted,
               "demoted": stats.demoted, "disk": disk_extra,
               "loaded_groups": {f"{t}/{g}": n
                                 for (t, g), n in stats.loaded_group_blocks.items()}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
