"""Engines and runs of ``vllm_e2e.py``: one vLLM engine per configuration, timed requests.

A configuration is vLLM without offloading, or vLLM with kvoffload's connector and a set
of tiers. Every engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by
``vllm_e2e.py`` before vLLM is imported), in float32, eager, with prefix caching on and
its own cache sized for little more than one request (``Engine cache`` in
``vllm_e2e.py --help``).

TTFT is vLLM's own per-request metric, ``RequestOutput.metrics.first_token_latency``
(the engine's arrival-to-first-token time, the value behind its
``vllm:time_to_first_token_seconds`` histogram; it needs ``disable_log_stats=False``).
Requests are sent one at a time, as one user at a time would, so a TTFT is the prefill
(or the load) of that request alone and never includes queueing behind another.
"""

from __future__ import annotations

import contextlib
import gc
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_models import FIRST_ORDINARY_TOKEN, VOCAB, BuiltModel
from e2e_workload import Conversations, Kind, Turn, WorkloadShape, schedule
from kvoffload.integrations.vllm.process_state import save_thread_state

ENGINE_CACHE_REQUESTS = 1.25
"""vLLM's own prefix cache holds this many longest requests: a conversation's blocks are
gone from it by the time the conversation returns."""
WARMUP_TOKENS = 600


@dataclass(frozen=True)
class Configuration:
    """One way of running the engine.

    ``tiers``: kvoffload's tiers, fastest first; empty for vLLM without offloading.
    ``small_host``: host memory is sized for about one request, so that most hits must
    come from the tier below it. ``restart_of``: the configuration whose disk directory
    this one starts on, as an engine restarted on the same machine would.
    """

    name: str
    label: str
    tiers: tuple[str, ...] = ()
    small_host: bool = False
    restart_of: str | None = None

    @property
    def offloads(self) -> bool:
        return bool(self.tiers)


CONFIGURATIONS: dict[str, Configuration] = {c.name: c for c in (
    Configuration("none", "vLLM alone (recompute)"),
    Configuration("host", "host memory", ("host",)),
    Configuration("disk", "small host memory + disk", ("host", "disk"), small_host=True),
    Configuration("redis", "small host memory + Redis", ("host", "remote"), small_host=True),
    Configuration("restart", "restarted engine, warm disk", ("host", "disk"), small_host=True,
                  restart_of="disk"),
)}
BASELINE = "none"


def parse_configurations(text: str) -> list[Configuration]:
    """``"none,host,disk"`` (or ``"all"``) in run order; the baseline is always first, and
    ``restart`` needs ``disk`` (it restarts on that run's disk directory)."""
    names = list(CONFIGURATIONS) if text.strip() == "all" else [
        n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown:
        raise ValueError(f"--configs: unknown configuration {', '.join(unknown)}; choose "
                         f"from {', '.join(CONFIGURATIONS)} or 'all'")
    chosen = {BASELINE, *names}
    for name in chosen:
        needed = CONFIGURATIONS[name].restart_of
        if needed is not None and needed not in chosen:
            raise ValueError(f"--configs: {name!r} restarts on the disk that {needed!r} "
                             f"fills; add {needed!r}")
    return [c for n, c in CONFIGURATIONS.items() if n in chosen]


@dataclass(frozen=True)
class RunSettings:
    """What every configuration of one model shares."""

    shape: WorkloadShape
    host_memory_bytes: int
    small_host_memory_bytes: int
    policy: str | None
    disk_root: Path
    redis_url: str | None


def connector_options(config: Configuration, settings: RunSettings) -> dict[str, Any] | None:
    """``kv_connector_extra_config`` for ``config``; None without offloading."""
    if not config.offloads:
        return None
    host = settings.small_host_memory_bytes if config.small_host else settings.host_memory_bytes
    options: dict[str, Any] = {"host_memory_bytes": host, "tiers": list(config.tiers)}
    if settings.policy is not None:
        options["eviction_policy"] = settings.policy
    if "disk" in config.tiers:
        directory = settings.disk_root / (config.restart_of or config.name)
        # Write-through: the disk holds every block stored, so a restarted engine finds
        # all of them, not only those host memory had evicted before the stop.
        options |= {"disk_path": str(directory), "disk_capacity": "8GiB",
                    "disk_write_mode": "write_through"}
    if "remote" in config.tiers:
        if settings.redis_url is None:
            raise ValueError("the Redis configuration needs a Redis server")
        options["remote_url"] = settings.redis_url
    return options


@dataclass
class RequestRecord:
    """One request as the engine served it."""

    turn: Turn
    prompt_tokens: int
    cached_tokens: int
    """vLLM's ``num_cached_tokens``: its own prefix-cache hit plus what the connector
    loaded."""
    ttft_s: float
    latency_s: float
    answer: list[int]


@dataclass
class RunResult:
    """One configuration's run of the workload on one model."""

    config: Configuration
    records: list[RequestRecord]
    startup_s: float
    total_s: float
    engine_cache_requests: float
    """Longest requests vLLM's own cache holds (vLLM's ``Maximum concurrency``)."""
    connector: dict[str, Any] = field(default_factory=dict)
    """kvoffload's counters after the run: hit tokens, loads, blocks loaded by tier."""

    @property
    def hit_tokens(self) -> int:
        return int(self.connector.get("hit_tokens", 0))


@contextlib.contextmanager
def engine(model: BuiltModel, config: Configuration, settings: RunSettings,
           cache_requests: float = ENGINE_CACHE_REQUESTS) -> Iterator[Any]:
    """A started ``vllm.LLM`` for ``config``, its own cache sized for ``cache_requests``
    of the longest requests; shut down and forgotten at exit."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    options = connector_options(config, settings)
    transfer = None if options is None else KVTransferConfig(
        kv_connector="KVOffloadConnector",
        kv_connector_module_path="kvoffload.integrations.vllm", kv_role="kv_both",
        kv_load_failure_policy="recompute", kv_connector_extra_config=options)
    spec = model.spec
    max_len = settings.shape.longest_request
    restore = save_thread_state()
    llm = None
    try:
        llm = LLM(model=str(model.path), skip_tokenizer_init=True, dtype="float32",
                  enforce_eager=True, seed=0, max_model_len=max_len,
                  enable_prefix_caching=True, max_num_seqs=4,
                  max_num_batched_tokens=spec.step_tokens,
                  kv_cache_memory_bytes=spec.engine_cache_bytes(max_len, cache_requests),
                  disable_log_stats=False, use_tqdm_on_load=False,
                  kv_transfer_config=transfer)
        check_groups(llm, model)
        yield llm
    finally:
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        restore()


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def check_groups(llm: Any, model: BuiltModel) -> None:
    """The engine made the KV-cache groups and block size ``model.spec`` describes (the
    cache sizing and the Mamba step rely on them)."""
    names = {"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding", "MambaSpec": "mamba"}
    groups = _core(llm).scheduler.kv_cache_config.kv_cache_groups
    found = sorted((names.get(type(g.kv_cache_spec).__name__, type(g.kv_cache_spec).__name__),
                    len(g.layer_names), g.kv_cache_spec.block_size) for g in groups)
    expected = sorted((kind, n, model.spec.block_size) for kind, n in model.spec.groups)
    if found != expected:
        raise RuntimeError(f"{model.spec.name}: vLLM made KV-cache groups (kind, layers, "
                           f"block size) {found}, the benchmark expects {expected}; this "
                           "vLLM version groups layers differently: update e2e_models.py")


def engine_cache_requests(llm: Any) -> float:
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    core = _core(llm)
    return float(get_max_concurrency_for_kv_cache_config(llm.llm_engine.vllm_config,
                                                         core.scheduler.kv_cache_config))


def _scheduler_side(llm: Any) -> Any:
    connector = _core(llm).scheduler.connector
    return None if connector is None else connector.scheduler_side


def drain(llm: Any, timeout_s: float = 120.0) -> None:
    """Step the engine until the connector has nothing in flight (stores included)."""
    side = _scheduler_side(llm)
    deadline = time.monotonic() + timeout_s
    while side is not None and side.has_pending_work():
        if time.monotonic() > deadline:
            raise RuntimeError(f"the connector still had jobs in flight after {timeout_s} s")
        llm.llm_engine.step()


def warm_up(llm: Any, offloads: bool) -> None:
    """One throw-away request that stores and loads nothing, then an empty vLLM cache.

    vLLM's CPU kernels build their code for each new matrix shape on first use, which
    costs the first requests of an engine seconds; every configuration pays it here,
    outside the timed run.
    """
    from vllm import SamplingParams

    rng = random.Random("warm-up")
    length = min(WARMUP_TOKENS, llm.llm_engine.vllm_config.model_config.max_model_len - 8)
    prompt = [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(length)]
    controls = {"kv_transfer_params": {"max_offload_tokens": 0, "max_load_tokens": 0}}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, detokenize=False,
                            extra_args=controls if offloads else None)
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    drain(llm)
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM did not reset its prefix cache after the warm-up")


def connector_counters(llm: Any) -> dict[str, Any]:
    side = _scheduler_side(llm)
    if side is None:
        return {}
    stats = side.planner.stats
    counters: dict[str, Any] = {"hit_tokens": stats.lookup_hit_tokens,
                                "load_jobs": stats.load_jobs, "store_jobs": stats.store_jobs,
                                "deferred_lookups": stats.deferred_lookups,
                                "deferral_timeouts": stats.deferral_timeouts,
                                "failed_loads": stats.failed_loads,
                                "abandoned_loads": stats.abandoned_loads}
    cascade = getattr(side.tier, "stats", None)  # a tier cascade's counters, if any
    loaded = getattr(cascade, "loaded_blocks", None)
    if isinstance(loaded, dict):
        counters["loaded_blocks_by_tier"] = dict(loaded)
    no_room = getattr(cascade, "promote_no_room_miss", None)
    if isinstance(no_room, dict):
        counters["blocks_without_room"] = sum(no_room.values())
    return counters


def run_workload(llm: Any, shape: WorkloadShape,
                 on_request: Callable[[RequestRecord], None]) -> list[RequestRecord]:
    """Send ``shape``'s requests one at a time; greedy answers of ``answer_tokens``."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=shape.answer_tokens, ignore_eos=True,
                            detokenize=False)
    conversations = Conversations(shape)
    records = []
    for turn in schedule(shape):
        prompt = conversations.prompt(turn)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        latency = time.perf_counter() - start
        answer = list(out.outputs[0].token_ids)
        conversations.record(turn, prompt, answer)
        if out.metrics is None:
            raise RuntimeError("vLLM returned no request metrics: the engine must run with "
                               "disable_log_stats=False")
        record = RequestRecord(turn, len(prompt), int(out.num_cached_tokens or 0),
                               float(out.metrics.first_token_latency), latency, answer)
        records.append(record)
        on_request(record)
    return records


def run_configuration(model: BuiltModel, config: Configuration, settings: RunSettings,
                      on_request: Callable[[RequestRecord], None]) -> RunResult:
    """Start an engine for ``config``, warm it up, run the workload, read the counters."""
    start = time.perf_counter()
    with engine(model, config, settings) as llm:
        startup = time.perf_counter() - start
        warm_up(llm, config.offloads)
        began = time.perf_counter()
        records = run_workload(llm, settings.shape, on_request)
        total = time.perf_counter() - began
        drain(llm)  # the stores a restarted engine will look for
        return RunResult(config, records, startup, total, engine_cache_requests(llm),
                         connector_counters(llm))


REVISIT_KINDS = tuple(k for k in Kind if k.is_revisit)
