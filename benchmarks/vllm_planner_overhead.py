"""Scheduler-side cost per engine step: kvoffload's connector vs vLLM's OffloadingConnector.

Both connectors run inside vLLM's real ``Scheduler`` (0.32 in .venv, 0.33 in .venv-vllm033,
0.34 in .venv-vllm034; platform-neutral, so this runs on a CPU-only machine), fed the same
synthetic requests: prompts that share a few long system prefixes, chunked prefill, decode,
requests finishing and new ones arriving, then the same prompts again after vLLM's own
prefix cache is dropped, so the second pass is served by the connector. No model runs: a
fake worker samples one token per request that finished its prefill, and completes every
transfer job of a step at the end of that step (the cheapest possible worker, so only
scheduler-side work is measured).

Every scheduler-side method vLLM calls on the connector is timed (lookups, allocation
updates, building the step's metadata, completion handling, request end, events, stats,
the idle check). The script prints the connector time per engine step for both and the
ratio kvoffload / vLLM, measured in the same run, for a full-attention layout and a
hybrid one (sliding window + full attention, like gpt-oss).

    .venv/bin/python benchmarks/vllm_planner_overhead.py [--requests 192] [--repeat 5]
    VLLM_TARGET_DEVICE=cpu .venv-vllm034/bin/python benchmarks/vllm_planner_overhead.py
    .venv/bin/python benchmarks/vllm_planner_overhead.py --profile   # where the time goes

``--profile`` runs each kvoffload connector once per layout under ``cProfile`` instead
and prints the time spent in each of kvoffload's modules (own time, not counting what a
function calls), largest first, with each module's difference between ``value`` and
``lru``: what the default policy's own bookkeeping costs, and where. Profiled time is
inflated against the plain runs (about 2x); compare its figures with each other only.

Goal: ratio <= 1 for kvoffload-lru (kvoffload costs no more than vLLM's own scheduler side
doing the same work); kvoffload-value, the default, is printed beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

BLOCK = 16
CONNECTORS = ("vllm", "kvoffload-lru", "kvoffload-value")
"""vLLM's OffloadingConnector (store everything, LRU), kvoffload doing the same, and
kvoffload with its default policy (``value``: hit-point stores, value eviction)."""
NUM_GPU_BLOCKS = 6000
TIMED = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "request_finished_all_groups",
    "take_events", "get_kv_connector_stats", "has_pending_push_work", "on_new_request",
    "get_external_cache_hit_sources", "get_loaded_kv_cache_group_ids",
)


@dataclass
class Workload:
    """The synthetic request stream (identical for both connectors)."""

    prompts: list[list[int]]
    arrivals_per_step: int
    max_tokens: int


def make_workload(num_requests: int, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 30000) for _ in range(rng.choice((512, 1024, 2048)))]
                for _ in range(6)]
    prompts = []
    for _ in range(num_requests):
        prefix = rng.choice(prefixes) if rng.random() < 0.8 else []
        tail = [rng.randrange(10, 30000) for _ in range(rng.randrange(100, 1500))]
        prompts.append(prefix + tail)
    return Workload(prompts=prompts, arrivals_per_step=4, max_tokens=32)


def model_dir(root: Path) -> Path:
    """A config-only Llama directory (vLLM's config needs one; no weights are loaded)."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=16384).save_pretrained(root)
    return root


def kv_cache_config(layout: str, num_blocks: int) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    attn = {"block_size": BLOCK, "num_kv_heads": 8, "head_size": 64, "dtype": torch.bfloat16}
    full = [f"model.layers.{i}.attn" for i in range(0, 24, 2 if layout == "hybrid" else 1)]
    groups = []
    if layout == "hybrid":
        window = [f"model.layers.{i}.attn" for i in range(1, 24, 2)]
        groups.append(KVCacheGroupSpec(window, SlidingWindowSpec(**attn, sliding_window=128)))
    groups.append(KVCacheGroupSpec(full, FullAttentionSpec(**attn)))
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups,
                         hash_block_size=BLOCK, cache_hit_alignment_tokens=BLOCK)


def create_engine_config(args: Any) -> Any:
    """``args.create_engine_config()``; where vLLM (0.34) refuses an x86 CPU without Triton,
    built again with Triton claimed present for the call. Only the scheduler runs here,
    which no Triton kernel is part of (the same as ``tests/vllm_scheduler/kit.py``'s
    ``create_engine_config``, which says why)."""
    try:
        return args.create_engine_config()
    except RuntimeError as error:
        if "requires Triton" not in str(error):
            raise
    from vllm import triton_utils

    had = triton_utils.HAS_TRITON
    triton_utils.HAS_TRITON = True
    try:
        return args.create_engine_config()
    finally:
        triton_utils.HAS_TRITON = had


def build_scheduler(which: str, layout: str, model: Path, host_bytes: int) -> Any:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    if which.startswith("kvoffload"):
        policy = which.split("-", 1)[1]
        transfer = KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.integrations.vllm", kv_role="kv_both",
            kv_connector_extra_config={"host_memory_bytes": host_bytes,
                                       "eviction_policy": policy})
    else:
        transfer = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                    kv_connector_extra_config={"cpu_bytes_to_use": host_bytes})
    args = EngineArgs(model=str(model), skip_tokenizer_init=True, dtype="bfloat16",
                      block_size=BLOCK, enable_prefix_caching=True, max_model_len=8192,
                      max_num_batched_tokens=4096, max_num_seqs=64, enforce_eager=True,
                      kv_transfer_config=transfer)
    vllm_config = create_engine_config(args)
    config = kv_cache_config(layout, num_blocks=NUM_GPU_BLOCKS)
    vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
    return Scheduler(vllm_config=vllm_config, kv_cache_config=config,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=BLOCK, hash_block_size=BLOCK)


class Timer:
    """Wraps the connector's scheduler-side methods and sums the time spent in them."""

    def __init__(self, connector: Any) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.loaded_tokens = 0
        """External tokens vLLM accepted (``update_state_after_alloc``), a neutral count."""
        for name in TIMED:
            method = getattr(connector, name, None)
            if method is not None:
                setattr(connector, name, self._wrap(method))

    def _wrap(self, method: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if method.__name__ == "update_state_after_alloc":
                self.loaded_tokens += args[2]
            start = time.perf_counter()
            try:
                result = method(*args, **kwargs)
                if hasattr(result, "__next__"):  # a generator: time its draining too
                    result = list(result)
                return result
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


def fake_worker_output(which: str, so: Any, scheduler: Any) -> Any:
    """The model runner's output for ``so``: one token per request past its prefill,
    every transfer job of the step reported complete."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from kvoffload.integrations.vllm.metadata import KVOffloadWorkerMetadata
    from kvoffload.jobs import WorkerReport

    req_ids = list(so.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = scheduler.requests[rid]
        done_prefill = req.num_computed_tokens >= req.num_tokens  # after this step
        sampled.append([7] if done_prefill else [])
    meta = so.kv_connector_metadata
    finished_recving: set[str] = set()
    if which.startswith("kvoffload"):
        plan = meta.plan
        jobs = [j.job_id for j in (*plan.stores, *plan.loads)]
        finished_recving = {j.request_id for j in plan.loads}
        finished_recving |= {rid for rid, _ in meta.resolved_loads}
        worker_meta: Any = (KVOffloadWorkerMetadata([WorkerReport(0, finished=tuple(jobs))])
                            if jobs else None)
    else:
        completed = {job_id: 1 for job_id in (*meta.load_jobs, *meta.store_jobs)}
        finished_recving = {job.req_id for job in meta.load_jobs.values()}
        worker_meta = OffloadingWorkerMetadata(completed_jobs=completed) if completed else None
    kv_out = KVConnectorOutput(finished_recving=finished_recving or None,
                               kv_connector_worker_meta=worker_meta)
    # req_id_to_index: required by vLLM 0.32 and 0.33, gone in 0.34.
    index = ({"req_id_to_index": {r: i for i, r in enumerate(req_ids)}}
             if "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
             else {})
    return ModelRunnerOutput(req_ids=req_ids, **index, sampled_token_ids=sampled,
                             kv_connector_output=kv_out)


@dataclass
class RunResult:
    steps: int
    connector_seconds: float
    step_seconds: float
    loaded_tokens: int

    @property
    def us_per_step(self) -> float:
        return 1e6 * self.connector_seconds / self.steps


def run(which: str, layout: str, workload: Workload, model: Path, host_bytes: int,
        ) -> RunResult:
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    scheduler = build_scheduler(which, layout, model, host_bytes)
    timer = Timer(scheduler.connector)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)
    steps = 0
    step_seconds = 0.0
    for pass_no in range(2):
        queue = list(enumerate(workload.prompts))
        while queue or scheduler.has_requests():
            for _ in range(workload.arrivals_per_step):
                if queue:
                    i, prompt = queue.pop(0)
                    scheduler.add_request(Request(f"{pass_no}-{i}", prompt, params, None,
                                                  block_hasher=hasher))
            start = time.perf_counter()
            so = scheduler.schedule()
            output = fake_worker_output(which, so, scheduler)
            scheduler.update_from_output(so, output)
            step_seconds += time.perf_counter() - start
            steps += 1
            assert steps < 100_000
        if pass_no == 0:
            assert scheduler.reset_prefix_cache()  # vLLM's own cache only
    scheduler.shutdown()
    return RunResult(steps, timer.seconds, step_seconds, timer.loaded_tokens)


def profile_by_module(which: str, layout: str, workload: Workload, model: Path,
                      host_bytes: int) -> tuple[dict[str, float], int]:
    """One run of ``which`` under ``cProfile``: seconds of own time per kvoffload module
    (path below ``kvoffload/``), and the run's engine steps."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        result = run(which, layout, workload, model, host_bytes)
    finally:
        profiler.disable()
    by_module: dict[str, float] = {}
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]  # not in typeshed
    for (filename, _line, _name), (_cc, _nc, own, _cum, _callers) in stats.items():
        path = Path(filename).as_posix()
        if "/kvoffload/" in path:
            module = path.rsplit("/kvoffload/", 1)[1]
            by_module[module] = by_module.get(module, 0.0) + own
    return by_module, result.steps


def print_profile(workload: Workload, model: Path, host_bytes: int) -> None:
    """``--profile``: kvoffload's time per module, ``value`` beside ``lru`` (module doc)."""
    for layout in ("full", "hybrid"):
        per_step: dict[str, dict[str, float]] = {}  # connector -> module -> us per step
        steps: dict[str, int] = {}
        with quiet():  # warm-up: first calls (imports, caches) not in either profile
            run("kvoffload-value", layout, workload, model, host_bytes)
        for which in ("kvoffload-lru", "kvoffload-value"):
            with quiet():
                seconds, steps[which] = profile_by_module(which, layout, workload, model,
                                                          host_bytes)
            per_step[which] = {m: 1e6 * s / steps[which] for m, s in seconds.items()}
        lru, value = per_step["kvoffload-lru"], per_step["kvoffload-value"]
        print(f"  {layout}: own time per module in us per step (profiled), "
              f"lru {sum(lru.values()):.0f} over {steps['kvoffload-lru']} steps, "
              f"value {sum(value.values()):.0f} over {steps['kvoffload-value']} steps")
        print(f"    {'module':44s} {'lru':>8s} {'value':>8s} {'value-lru':>10s}")
        for module in sorted(set(lru) | set(value), key=lambda m: -value.get(m, 0.0))[:20]:
            a, b = lru.get(module, 0.0), value.get(module, 0.0)
            print(f"    {module:44s} {a:8.0f} {b:8.0f} {b - a:10.0f}")


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    logging.disable(logging.WARNING)
    err = sys.stderr
    sys.stderr = io.StringIO()
    try:
        yield
    finally:
        sys.stderr = err
        logging.disable(logging.NOTSET)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="vllm_planner_overhead.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=192,
                        help="synthetic requests per pass; each runs twice, the second pass "
                             "served by the connector (default 192)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs per connector and layout; the median is printed "
                             "(default 5)")
    parser.add_argument("--host-gib", type=float, default=16.0,
                        help="host memory of both connectors in GiB (default 16: enough "
                             "for every block of the default workload, so neither evicts and both "
                             "do the same work)")
    parser.add_argument("--profile", action="store_true",
                        help="one profiled run of each kvoffload connector per layout: own "
                             "time per kvoffload module, value beside lru (no ratios)")
    args = parser.parse_args(argv)
    for flag, value in (("--requests", args.requests), ("--repeat", args.repeat)):
        if value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    if not args.host_gib > 0:
        parser.error(f"--host-gib must be a positive number of GiB, got {args.host_gib}")
    workload = make_workload(args.requests)
    host_bytes = int(args.host_gib * (1 << 30))
    if args.profile:
        print(f"{args.requests} requests x 2 passes, block {BLOCK}, host {args.host_gib} GiB")
        with tempfile.TemporaryDirectory() as tmp:
            print_profile(workload, model_dir(Path(tmp)), host_bytes)
        return 0
    print(f"{args.requests} requests x 2 passes, {sum(map(len, workload.prompts))} prompt "
          f"tokens per pass, block {BLOCK}, host {args.host_gib} GiB; median of "
          f"{args.repeat} runs")
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(Path(tmp))
        for layout in ("full", "hybrid"):
            results: dict[str, list[RunResult]] = {w: [] for w in CONNECTORS}
            for _ in range(args.repeat):
                for which in CONNECTORS:  # interleaved: same machine state
                    with quiet():
                        results[which].append(run(which, layout, workload, model,
                                                  host_bytes))
            med = {w: statistics.median(r.us_per_step for r in rs) for w, rs in results.items()}
            for which in CONNECTORS:
                r = results[which][-1]
                print(f"  {layout:6s} {which:15s}: {med[which]:8.1f} us/step in the connector; "
                      f"{r.steps} steps of {1e6 * r.step_seconds / r.steps:7.0f} us, "
                      f"{r.loaded_tokens} tokens loaded by the connector")
            for which in CONNECTORS[1:]:
                ratio = med[which] / med["vllm"]
                worst = max(worst, ratio) if which == "kvoffload-lru" else worst
                print(f"  {layout:6s} ratio {which} / vLLM OffloadingConnector: {ratio:.2f}")
    print(f"worst like-for-like ratio (kvoffload-lru, store everything as vLLM's connector "
          f"does): {worst:.2f} ({'meets' if worst <= 1.0 else 'misses'} the goal <= 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
