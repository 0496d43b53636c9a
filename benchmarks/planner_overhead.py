"""The planner's cost per scheduler step and per key, next to the bare dict work it implies.

Scenario (steady-state decode, defaults): 256 running requests, each already holding a
32k-token context whose blocks were offloaded (setup, not timed); a 3-group hybrid layout
with 16-token blocks -- full attention, a 128-token sliding window and Mamba states
checkpointed every 256 tokens (so hits are multiples of 256); a host tier sized to what
the contexts hold plus one block per request, so it evicts from a few steps in. Each timed
step every request decodes one token; request start lengths are staggered, so 1/16 of them
complete a block (and store it) per step; workers report every job of the step before the
next one; ``--arrivals`` new requests per step look up a follow-up turn of a running
request (its whole context plus a few tokens: a long hit) and then leave. ``--factor``
makes offloaded blocks ``16 x factor`` tokens (vLLM's default is 256-token blocks).

Timed per step, with ``time.perf_counter_ns``:

* ``plan``: ``build_step_plan`` (fence checks, store planning, touch);
* ``reports``: ``update_from_worker_reports`` (completions);
* ``lookups``: ``get_num_new_matched_tokens`` + ``request_finished`` of the arrivals.

The bare baseline replays, right after each step (so both see the same machine load), the
key operations the planner asked of the tier in that step, on a plain ``OrderedDict``
holding the same keys in the same order: ``k in d`` + ``move_to_end`` per touched key,
``k in d`` per key offered to ``prepare_store``, an insert per stored key and a delete per
evicted key, ``d[k]`` per completed key and per looked-up key (the same number of present
keys), and a ``dict`` get per newly allocated engine block (the fence check). Reported per
phase: medians over steps of the time per step, that median over the mean keys per step,
and the median per-step ratio planner / bare -- what the planner costs beyond the dict
work its decisions need. Steps where nothing is stored cost the bare baseline almost
nothing, so the plan ratio there is the planner's fixed cost per scheduled request.

    python benchmarks/planner_overhead.py
    python benchmarks/planner_overhead.py --requests 64 --context 8192 --steps 32 --json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.jobs import JobId, StepPlan, WorkerReport
from kvoffload.keys import BlockHash, BlockHasher, OffloadKey
from kvoffload.planner.contract import ScheduledRequest, StepInput
from kvoffload.planner.planner import Planner
from kvoffload.policies import CachePolicy, cache_policy
from kvoffload.tiers.base import PrepareStoreResult
from kvoffload.tiers.host import HostTier

BLOCK = 16
PHASES = ("plan", "reports", "lookups")


@dataclass
class Request:
    """A running request (satisfies ``contract.RequestInfo``)."""

    request_id: str
    tokens: list[int]
    num_prompt_tokens: int
    hasher: BlockHasher
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_computed: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass
class FollowUp:
    """An arriving request: a running request's context plus a few new tokens."""

    request_id: str
    num_tokens: int
    num_prompt_tokens: int
    block_hashes: Sequence[BlockHash]


class RecordingTier(HostTier):
    """A ``HostTier`` that remembers, per call (not per key), what the planner asked."""

    def __init__(self, config: OffloadConfig, policy: CachePolicy) -> None:
        super().__init__(config, policy, enable_events=False)
        self.phase = "setup"
        self.ops: list[tuple[str, str, object]] = []

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self.ops.append((self.phase, "touch", keys))
        super().touch(keys)

    def prepare_store(self, keys: Sequence[OffloadKey]) -> PrepareStoreResult | None:
        result = super().prepare_store(keys)
        self.ops.append((self.phase, "store", (keys, result)))
        return result

    def complete_store(self, keys: Iterable[OffloadKey], success: bool = True) -> None:
        keys = tuple(keys)
        self.ops.append((self.phase, "complete", keys))
        super().complete_store(keys, success)

    def lookups(self) -> int:
        s = self.stats
        return s.lookup_hits + s.lookup_misses + s.lookup_pending


@dataclass
class PhaseResult:
    phase: str
    keys_per_step: float
    planner_us_per_step: float
    bare_us_per_step: float
    planner_ns_per_key: float
    bare_ns_per_key: float
    ratio: float


@dataclass
class Result:
    requests: int
    context: int
    offloaded_block: int
    steps: int
    arrivals_per_step: int
    keys_in_tier: int
    setup_s: float
    phases: list[PhaseResult]
    counts_per_step: dict[str, float]


def make_config(args: argparse.Namespace, capacity: int) -> OffloadConfig:
    groups = (
        GroupSpec(GroupKind.FULL_ATTENTION, BLOCK, name="full"),
        GroupSpec(GroupKind.SLIDING_WINDOW, BLOCK, sliding_window=args.window, name="swa"),
        GroupSpec(GroupKind.MAMBA, BLOCK, state_alignment=args.mamba_align, name="mamba"),
    )
    return OffloadConfig(groups=groups, hash_block_size=BLOCK, host_capacity_bytes=capacity,
                         block_size_factor=args.factor,
                         eviction_policy=args.policy)


def stored_blocks(config: OffloadConfig, num_tokens: int) -> int:
    """Offloaded blocks a prefill of ``num_tokens`` stores over all groups."""
    total = 0
    for g in config.resolved:
        step = config.hit_alignment // g.offloaded_block_size
        n = num_tokens // g.offloaded_block_size
        if g.window_blocks is None:
            total += n
        else:
            width = min(g.window_blocks, step)
            total += sum(1 for k in range(n) if k % step >= step - width)
    return total


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.hasher = BlockHasher(BLOCK, seed="bench")
        self.next_block = 1
        self.next_job_report: list[JobId] = []
        # Contexts C, C+1, ..., C+obs-1 (cycled): with an offloaded block of obs tokens,
        # 1/obs of the requests complete (and store) a block per step.
        obs = BLOCK * args.factor
        self.requests = [
            Request(f"r{i}", [(i * 7919 + t) % 50_000 for t in range(args.context + i % obs)],
                    0, self.hasher)
            for i in range(args.requests)
        ]
        for r in self.requests:
            r.num_prompt_tokens = r.num_tokens
            self.hasher.extend(r.block_hashes, r.tokens)
        # Room for what the setup stores plus one block per request: the tier fills up a
        # few steps in and evicts from then on.
        probe = make_config(args, 1 << 40)
        capacity = sum(stored_blocks(probe, r.num_tokens) for r in self.requests)
        self.config = make_config(args, capacity + args.requests)
        policy = cache_policy(self.config.eviction_policy)
        self.tier = RecordingTier(self.config, policy)
        self.planner = Planner(self.config, self.tier, policy)
        self.tables: dict[str, list[list[int]]] = {}

    def new_ids(self, n: int) -> list[int]:
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def freed(self, computed: int) -> tuple[int, ...]:
        return (0, max(0, computed - self.args.window + 1) // BLOCK,
                max(0, computed // BLOCK - 1))

    def finish_jobs(self, plan: StepPlan) -> list[WorkerReport]:
        jobs = tuple(j.job_id for j in (*plan.stores, *plan.loads))
        return [WorkerReport(0, jobs)] if jobs else []

    def setup(self) -> None:
        """Admit and prefill every request in one chunk; complete every store."""
        planner = self.planner
        batch = 16
        for start in range(0, len(self.requests), batch):
            scheduled = []
            for r in self.requests[start:start + batch]:
                planner.get_num_new_matched_tokens(r, 0)
                n = -(-r.num_tokens // BLOCK)
                table = [self.new_ids(n) for _ in range(3)]
                planner.update_state_after_alloc(r, table, 0)
                self.tables[r.request_id] = table
                scheduled.append(ScheduledRequest(r, tuple(tuple(t) for t in table), 0,
                                                  r.num_tokens))
                r.num_computed = r.num_tokens
            plan = planner.build_step_plan(StepInput(tuple(scheduled)))
            planner.update_from_worker_reports(self.finish_jobs(plan))
        self.tier.ops.clear()

    def decode_inputs(self, step: int) -> StepInput:
        """Every request decodes one token (hashing is the engine's work: untimed)."""
        scheduled = []
        for r in self.requests:
            r.tokens.append((step * 31 + len(r.tokens)) % 50_000)
            if len(r.tokens) % BLOCK == 0:
                self.hasher.extend(r.block_hashes, r.tokens)
            c = r.num_computed
            new: tuple[tuple[int, ...], ...] = ((), (), ())
            if c % BLOCK == 0:  # token c opens a new engine block in every group
                new = tuple((b,) for b in self.new_ids(3))
            scheduled.append(ScheduledRequest(r, new, c, 1, num_freed_blocks=self.freed(c)))
            r.num_computed = c + 1
        return StepInput(tuple(scheduled))

    def arrivals(self, step: int) -> list[FollowUp]:
        out = []
        for a in range(self.args.arrivals):
            parent = self.requests[(step * 17 + a * 101) % len(self.requests)]
            n = parent.num_tokens + 8  # a few new tokens: no new full hash block
            hashes = list(parent.block_hashes[:n // BLOCK])
            out.append(FollowUp(f"a{step}.{a}", n, n, hashes))
        return out

    def run(self) -> Result:
        t0 = time.perf_counter()
        self.setup()
        setup_s = time.perf_counter() - t0
        bare = BareDict(list(self.tier), self.tier)  # the tier's keys, next victim first
        gc.collect()
        gc.freeze()  # keep collections of the big setup heap out of the timings

        tier, planner, clock = self.tier, self.planner, time.perf_counter_ns
        steps = self.args.steps
        times = {p: [0] * steps for p in PHASES}
        bare_times = {p: [0] * steps for p in PHASES}
        keys = dict.fromkeys(PHASES, 0)
        for step in range(steps):
            step_input = self.decode_inputs(step)
            arriving = self.arrivals(step)
            new_blocks = [b for s in step_input.scheduled for ids in s.new_block_ids for b in ids]
            tier.phase = "plan"
            start = clock()
            plan = planner.build_step_plan(step_input)
            times["plan"][step] = clock() - start
            reports = self.finish_jobs(plan)
            tier.phase = "reports"
            start = clock()
            planner.update_from_worker_reports(reports)
            times["reports"][step] = clock() - start
            tier.phase = "lookups"
            before = tier.lookups()
            start = clock()
            for req in arriving:
                planner.get_num_new_matched_tokens(req, 0)
                planner.request_finished(req)
            times["lookups"][step] = clock() - start
            looked_up = tier.lookups() - before
            # The bare dict work of this very step, timed right after it (drift-safe).
            for phase in PHASES:
                extra = new_blocks if phase == "plan" else ()
                gets = looked_up if phase == "lookups" else 0
                bare_times[phase][step], n = bare.replay(
                    [op for op in tier.ops if op[0] == phase], extra, gets)
                keys[phase] += n
            tier.ops.clear()
        gc.unfreeze()

        phases = []
        for p in PHASES:
            phases.append(summarize(p, times[p], bare_times[p], keys[p], steps))
        total = [sum(times[p][s] for p in PHASES) for s in range(steps)]
        bare_total = [sum(bare_times[p][s] for p in PHASES) for s in range(steps)]
        phases.append(summarize("total", total, bare_total, sum(keys.values()), steps))
        return Result(
            requests=self.args.requests, context=self.args.context,
            offloaded_block=BLOCK * self.args.factor, steps=steps,
            arrivals_per_step=self.args.arrivals, keys_in_tier=bare.initial_keys,
            setup_s=round(setup_s, 2), phases=phases,
            counts_per_step={k: v / steps for k, v in bare.counts.items()})


def summarize(phase: str, planner_ns: list[int], bare_ns: list[int], keys: int,
              steps: int) -> PhaseResult:
    """Medians over steps (shared machines drift); the ratio is the median per-step ratio."""
    ratios = [p / b for p, b in zip(planner_ns, bare_ns, strict=True) if b > 0]
    return PhaseResult(
        phase=phase, keys_per_step=keys / steps,
        planner_us_per_step=statistics.median(planner_ns) / 1e3,
        bare_us_per_step=statistics.median(bare_ns) / 1e3,
        planner_ns_per_key=statistics.median(planner_ns) / max(keys / steps, 1),
        bare_ns_per_key=statistics.median(bare_ns) / max(keys / steps, 1),
        ratio=statistics.median(ratios) if ratios else float("nan"))


class BareDict:
    """The tier's keys in a plain OrderedDict; replays recorded key operations."""

    def __init__(self, snapshot: list[OffloadKey], tier: HostTier) -> None:
        self.d: OrderedDict[OffloadKey, int] = OrderedDict((k, 0) for k in snapshot)
        self.fence: dict[int, int] = {}
        self.initial_keys = len(snapshot)
        self.sample = snapshot[:: max(1, len(snapshot) // 4096)]
        self.counts = {"touched": 0, "offered": 0, "stored": 0, "evicted": 0,
                       "completed": 0, "looked_up": 0, "new_blocks": 0}
        del tier

    def replay(self, ops: list[tuple[str, str, object]], new_blocks: Sequence[int],
               gets: int) -> tuple[int, int]:
        """Time the dict work of ``ops``, ``new_blocks`` fence checks and ``gets`` lookups.

        Returns (nanoseconds, key operations). Lookups use present keys spread over the
        dict: a dict get costs about the same for any present key.
        """
        d, fence, mte = self.d, self.fence, self.d.move_to_end
        sample = self.sample
        look = [sample[i % len(sample)] for i in range(gets)]
        start = time.perf_counter_ns()
        for b in new_blocks:
            fence.get(b)
        for _, op, arg in ops:
            if op == "touch":
                for k in reversed(arg):  # type: ignore[call-overload]
                    if k in d:
                        mte(k)
            elif op == "store":
                keys, result = arg  # type: ignore[misc]
                for k in keys:
                    k in d  # noqa: B015 - the dedup check
                if result is not None:
                    for k in result.evicted:
                        del d[k]
                    for k in result.keys_to_store:
                        d[k] = 0
            else:
                for k in arg:  # type: ignore[attr-defined]
                    d[k]  # the completion finds the key's state
        for k in look:
            d.get(k)
        elapsed = time.perf_counter_ns() - start

        c = self.counts
        n = len(new_blocks) + gets
        c["new_blocks"] += len(new_blocks)
        c["looked_up"] += gets
        for _, op, arg in ops:
            if op == "touch":
                c["touched"] += len(arg)  # type: ignore[arg-type]
                n += len(arg)  # type: ignore[arg-type]
            elif op == "store":
                keys, result = arg  # type: ignore[misc]
                c["offered"] += len(keys)
                n += len(keys)
                if result is not None:
                    c["stored"] += len(result.keys_to_store)
                    c["evicted"] += len(result.evicted)
                    n += len(result.keys_to_store) + len(result.evicted)
            else:
                c["completed"] += len(arg)  # type: ignore[arg-type]
                n += len(arg)  # type: ignore[arg-type]
        return elapsed, n


def print_table(result: Result) -> None:
    print(f"planner overhead: {result.requests} requests x {result.context} tokens, "
          f"3 groups (full, window, Mamba), offloaded blocks of {result.offloaded_block} "
          f"tokens, {result.steps} decode steps, "
          f"{result.arrivals_per_step} arrival(s)/step, {result.keys_in_tier} keys in the "
          f"tier (setup {result.setup_s} s)")
    header = (f"{'phase':<8} {'keys/step':>10} {'planner us/step':>16} {'bare us/step':>13} "
              f"{'planner ns/key':>15} {'bare ns/key':>12} {'ratio':>6}")
    print(header)
    print("-" * len(header))
    for p in result.phases:
        print(f"{p.phase:<8} {p.keys_per_step:>10.0f} {p.planner_us_per_step:>16.1f} "
              f"{p.bare_us_per_step:>13.1f} {p.planner_ns_per_key:>15.1f} "
              f"{p.bare_ns_per_key:>12.1f} {p.ratio:>6.2f}")
    detail = ", ".join(f"{k} {v:.0f}" for k, v in result.counts_per_step.items())
    print(f"key operations per step: {detail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--context", type=int, default=32768, help="tokens per request")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps")
    parser.add_argument("--arrivals", type=int, default=1, help="new requests per step")
    parser.add_argument("--window", type=int, default=128, help="sliding window (tokens)")
    parser.add_argument("--mamba-align", type=int, default=256,
                        help="Mamba state checkpoint interval (tokens)")
    parser.add_argument("--factor", type=int, default=1,
                        help="block_size_factor: offloaded block = 16 x factor tokens")
    parser.add_argument("--policy", default="lru", help="eviction policy")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.context < BLOCK or args.steps < 1 or args.arrivals < 0:
        parser.error("need --requests >= 1, --context >= 16, --steps >= 1, --arrivals >= 0")
    if args.factor < 1 or args.mamba_align % BLOCK:
        parser.error(f"need --factor >= 1 and --mamba-align a multiple of {BLOCK}")
    result = Bench(args).run()
    if args.json:
        out = asdict(result)
        json.dump(out, sys.stdout, indent=2)
        print()
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
