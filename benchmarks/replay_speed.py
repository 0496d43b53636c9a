"""Replay the whole shared Mooncake trace on gpt-oss-20b in accounting mode; print speed.

The same planner, host tier and reference engine as ``kvoffload simulate``; the worker is
replaced by the accounting executor (every job completes in modelled time, no tensors).
Prints requests and engine blocks per second (wall and CPU time: on a shared machine CPU
time is the steadier figure), the replay's own results, and the ratio of its time to a
replay of the same requests without offloading, timed next to it in the same run (what
offloading adds to the bare engine). Goal: the whole trace (12,031 requests) in under two
minutes on two cores.

    .venv/bin/python benchmarks/replay_speed.py                 # the whole trace
    .venv/bin/python benchmarks/replay_speed.py --limit 2000    # a slice
    .venv/bin/python benchmarks/replay_speed.py --block-size 16 --block-size-factor 16

Defaults: engine blocks of 64 tokens and offloaded blocks of 256 (block_size_factor 4,
vLLM's default offloaded block size); one simulated step stands for 16 engine iterations
(``--decode-steps``); engine 1M tokens, host 128 GiB, LRU. The trace is looked up at
``$KVOFFLOAD_TRACE`` or at ``../shared/traces/`` beside the checkout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from kvoffload.sim.replay import Arrival
from kvoffload.sim.simulation import Mode, SimulationConfig, run_one
from kvoffload.sim.summary import RunSummary
from kvoffload.workloads import WorkloadRequest, read_mooncake_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", ROOT.parent / "shared" / "traces"
                            / "mooncake_conversation_trace.jsonl"))


def timed_run(config: SimulationConfig, workload: list[WorkloadRequest], *,
              offload: bool) -> tuple[RunSummary, float, float]:
    """One replay and its wall and CPU seconds."""
    wall, cpu = time.perf_counter(), time.process_time()
    summary = run_one(config, workload, offload=offload)
    return summary, time.perf_counter() - wall, time.process_time() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--block-size-factor", type=int, default=4)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--engine-tokens", type=int, default=1 << 20)
    parser.add_argument("--host-gib", type=int, default=128)
    parser.add_argument("--policy", default="lru")
    args = parser.parse_args()
    if not args.trace.exists():
        print(f"trace not found: {args.trace} (set KVOFFLOAD_TRACE)", file=sys.stderr)
        return 2
    config = SimulationConfig(
        preset=args.preset, mode=Mode.ACCOUNTING, block_size=args.block_size,
        block_size_factor=args.block_size_factor, engine_tokens=args.engine_tokens,
        host_capacity_bytes=args.host_gib << 30, eviction_policy=args.policy,
        decode_tokens_per_step=args.decode_steps, arrival=Arrival.TRACE, baseline=False,
        sample_interval_s=10.0)
    workload = list(read_mooncake_trace(args.trace, limit=args.limit))
    summary, wall, cpu = timed_run(config, workload, offload=True)
    _, base_wall, base_cpu = timed_run(config, workload, offload=False)
    layout = config.layout()
    groups = len(layout.groups)
    tokens = summary.prompt_tokens + summary.output_tokens
    blocks = groups * tokens / layout.block_size  # engine blocks the replay went through
    print(f"replay of {summary.requests:,} requests ({summary.prompt_tokens:,} prompt tokens) "
          f"on {args.preset}, block {layout.block_size} x factor {args.block_size_factor}, "
          f"{args.decode_steps} iterations per step, accounting mode")
    print(f"  wall {wall:.1f} s, CPU {cpu:.1f} s")
    print(f"  {summary.requests / wall:,.0f} requests/s, {blocks / wall:,.0f} engine blocks/s "
          f"(wall); {summary.requests / cpu:,.0f} requests/s, {blocks / cpu:,.0f} blocks/s (CPU)")
    print(f"  prompt tokens served: engine {100 * summary.engine_hit_rate:.1f} %, host "
          f"{100 * summary.host_hit_rate:.1f} %; {summary.steps:,} steps, "
          f"{summary.preemptions:,} preemptions; modelled makespan {summary.makespan_s:,.0f} s")
    print(f"  ratio to the same replay without offloading, timed in this run: "
          f"{wall / base_wall:.2f}x wall, {cpu / base_cpu:.2f}x CPU "
          f"(baseline {base_wall:.1f} s wall, {base_cpu:.1f} s CPU)")
    goal = 120.0
    print(f"  goal: whole trace under {goal:.0f} s -> "
          + ("met" if wall < goal else "NOT met") + (" (slice only)" if args.limit else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
