"""A simulation: one preset, one workload, the engine with and without offloading.

``SimulationConfig`` holds every knob in user terms (capacities in real bytes);
``build_engine`` turns it into a ``ReferenceEngine`` wired to the real planner and host tier,
and in ``bytes`` mode to the real ``TransferWorker`` over real (scaled) tensors;
``simulate`` runs the workload with offloading and, for comparison, without it, and
returns both runs' ``RunSummary`` (``sim.summary``).

Sizes. Accounting always uses the model's real page sizes. Bytes mode moves pages scaled
so that the smallest is ``scale_bytes`` bytes (``ModelPreset.layout``); the host tier gets
exactly as many slots as the real capacity holds, so both modes make the same decisions
(a test checks that they produce the same counts).

Engine capacity. Block ids are shared by every group (vLLM pads every group's page to one
size), so one block id costs the largest group's block: ``engine_capacity_bytes //
max(real block bytes)`` ids, plus the null block; or, given in tokens, ``cdiv(tokens,
block_size)`` ids.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING

from kvoffload.blockfile.framing import MacKey
from kvoffload.config import DEFAULT_POLICY, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.group_kinds import KIND_RULES
from kvoffload.models.hf_config import resolve_model
from kvoffload.models.layout import ModelLayout
from kvoffload.models.preset import ModelPreset
from kvoffload.offload import Offload
from kvoffload.policies import CachePolicy, cache_policy
from kvoffload.refengine.context import EngineConfig
from kvoffload.refengine.engine import ReferenceEngine, offload_for
from kvoffload.refengine.executors import AccountingExecutor, TransferExecutor
from kvoffload.refengine.timing import TimingModel
from kvoffload.sim.oracle.binding import ORACLE, oracle_policy
from kvoffload.sim.oracle.future import WorkloadFuture
from kvoffload.sim.replay import Arrival, Progress, replay
from kvoffload.sim.summary import RunSummary, summarize
from kvoffload.tiers.config import DiskTierConfig, RemoteTierConfig, TierConfig
from kvoffload.tiers.lower import LowerTier
from kvoffload.workloads.request import WorkloadRequest

if TYPE_CHECKING:
    from kvoffload.refengine.device import DeviceCaches, WorkerExecutor

GiB = 1 << 30


class Mode(str, Enum):
    BYTES = "bytes"
    """Real tensors (scaled pages) moved by the real worker; every load verified."""
    ACCOUNTING = "accounting"
    """No tensors: jobs complete in modelled time only. For long traces and sweeps."""


KERNEL_BLOCK_ALIGNMENT = 16
"""Attention block sizes are multiples of this (the attention kernels' block alignment)."""


def is_oracle(policy: str) -> bool:
    """Whether ``policy`` names the simulator-only oracle (``kvoffload.sim.oracle``)."""
    return policy == ORACLE


def auto_block_size(preset: ModelPreset, alignment: int = KERNEL_BLOCK_ALIGNMENT) -> int:
    """The engine block size vLLM would pick: 16, or for a model with Mamba layers the
    smallest multiple of ``alignment`` whose attention page holds a Mamba state page (vLLM
    unifies page sizes), which is then the Mamba block size too. vLLM aligns to the larger
    of the attention kernel's block (16) and a block size the user gave."""
    if preset.mamba is None:
        return 16
    per_token = max(a.bytes_per_token_per_layer for a in preset.attention)
    unit = alignment * per_token
    return alignment * math.ceil(preset.mamba.state_bytes_per_layer / unit)


@dataclass(frozen=True)
class SimulationConfig:
    """Every knob of a simulation.

    Attributes:
        preset: model preset name (``kvoffload presets``), or a local model directory or
            config.json (``--model``; ``kvoffload.models.hf_config``).
        mode: ``bytes`` or ``accounting``.
        block_size: engine block size in tokens; None picks ``auto_block_size``.
        block_size_factor: engine blocks per offloaded block.
        engine_capacity_bytes: accelerator memory for KV blocks (real bytes); when None,
            ``engine_tokens`` decides.
        engine_tokens: engine capacity in tokens of one group (``cdiv(engine_tokens,
            block_size)`` block ids), used when ``engine_capacity_bytes`` is None.
        host_capacity_bytes: host memory for offloaded blocks (real bytes).
        disk_capacity_bytes / remote_capacity_bytes: lower tiers below host memory (real
            bytes): a disk tier (write-back: host evictions land there) and a shared
            remote store (write-through). Accounting mode models both as budgeted
            indexes; bytes mode runs a real disk tier (``disk_path`` with this budget)
            and a real Redis/Valkey server (``remote_url``; its capacity is the
            server's own ``maxmemory``, so ``remote_capacity_bytes`` stays None).
        disk_path: bytes mode: the real disk tier's directory. A second run on the same
            directory finds the blocks the first one stored (a restart).
        remote_url: bytes mode: ``redis://host:port/db`` of a real shared tier.
        eviction_policy: the cache policy (``value``, the default, ``lru``, ``arc``,
            ``hybrid``; ``oracle``, the simulator-only reference, in ``run_one``).
        host_accounting: ``slot`` (every block takes a slot of the largest group's size)
            or ``bytes`` (every block is charged its own group's bytes; accounting mode).
        scale_bytes: bytes mode: the smallest moved page, in bytes.
        max_num_batched_tokens / max_num_seqs / decode_tokens_per_step: engine limits.
        arrival: ``trace`` (use arrival times) or ``asap``.
        max_queued: requests waiting in the engine at most (and read ahead at most).
        timing: the modelled accelerator and link.
        baseline: also run without offloading, for the side-by-side comparison.
        sample_interval_s: modelled seconds between samples for the plots.
        check_integrity: check bookkeeping every step (slow; tests).
        tensor_parallel: tensor-parallel ranks (``--tp``): the model's figures are one
            rank's.
        mac_key: bytes mode: the key every block in the real lower tiers is MAC'd with
            (``kvoffload.tiers.config.read_mac_key``: ``--tier-mac-key-file`` or
            ``$KVOFFLOAD_TIER_MAC_KEY``), as the connector does; None: checksums only.
    """

    preset: str = "gpt-oss-20b"
    mode: Mode = Mode.BYTES
    block_size: int | None = None
    block_size_factor: int = 1
    engine_capacity_bytes: int | None = None
    engine_tokens: int = 32768
    host_capacity_bytes: int = 16 * GiB
    eviction_policy: str = DEFAULT_POLICY
    host_accounting: str = "slot"
    disk_capacity_bytes: int | None = None
    remote_capacity_bytes: int | None = None
    disk_path: str | None = None
    remote_url: str | None = None
    scale_bytes: int = 64
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 64
    decode_tokens_per_step: int = 1
    arrival: Arrival = Arrival.TRACE
    max_queued: int = 256
    timing: TimingModel = field(default_factory=TimingModel)
    baseline: bool = True
    sample_interval_s: float = 1.0
    check_integrity: bool = False
    tensor_parallel: int = 1
    mac_key: MacKey | None = None

    def model(self) -> ModelPreset:
        return resolve_model(self.preset, self.tensor_parallel)

    @property
    def model_id(self) -> str:
        """The model as the lower tiers key it (each rank count has its own layout)."""
        return self.preset if self.tensor_parallel == 1 else \
            f"{self.preset}@tp{self.tensor_parallel}"

    def layout(self) -> ModelLayout:
        """The preset laid out: moved pages scaled in bytes mode, real in accounting."""
        preset = self.model()
        bs = self.block_size or auto_block_size(preset)
        scale = self.scale_bytes if self.mode is Mode.BYTES else None
        return preset.layout(bs, scale_bytes=scale)


@dataclass(frozen=True)
class Capacities:
    """The capacities a ``SimulationConfig`` resolves to."""

    engine_blocks: int
    engine_block_bytes: int
    host_slots: int
    host_slot_bytes: int


MAX_ENGINE_BLOCKS = 1 << 24
"""The most engine blocks a simulated engine keeps (its pool holds a Python list of them)."""

MAX_HOST_SLOTS = 1 << 32
"""The most host slots a simulated host tier keeps (one byte of bookkeeping each)."""

MAX_MOVED_BYTES = 1 << 34
"""Bytes mode: the most bytes the engine's tensors or the host arena may allocate."""


def resolve(config: SimulationConfig, layout: ModelLayout) -> tuple[Capacities, OffloadConfig]:
    """Engine block count, host slots, and the planner's ``OffloadConfig`` (moved sizes).

    Raises ``ConfigError`` naming what to change when a capacity holds nothing, or more
    than this machine's simulation can keep (``MAX_ENGINE_BLOCKS``, ``MAX_HOST_SLOTS``,
    ``MAX_MOVED_BYTES``): a clear error before anything is allocated.
    """
    block_bytes = max(g.real_block_bytes for g in layout.groups)
    if config.engine_capacity_bytes is not None:
        engine_blocks = config.engine_capacity_bytes // block_bytes
        if engine_blocks < 1:
            raise ConfigError("engine_capacity_bytes",
                              f"{config.engine_capacity_bytes} bytes hold no engine block of "
                              f"{block_bytes} bytes ({layout.preset.name}, block size "
                              f"{layout.block_size})", f"Give at least {block_bytes} bytes.")
    else:
        if config.engine_tokens < 1:
            raise ConfigError("engine_tokens", f"must be >= 1, got {config.engine_tokens}",
                              "Give the tokens the engine's KV memory holds.")
        engine_blocks = -(-config.engine_tokens // layout.block_size)
    _check_engine_size(config, layout, engine_blocks)
    hash_block_size = math.gcd(*(g.spec.block_size for g in layout.groups))
    real = OffloadConfig(groups=layout.real_specs, hash_block_size=hash_block_size,
                         host_capacity_bytes=config.host_capacity_bytes,
                         block_size_factor=config.block_size_factor,
                         eviction_policy=config.eviction_policy,
                         host_accounting=config.host_accounting)
    if real.charges_bytes and layout.is_scaled:
        raise ConfigError("host_accounting", "byte accounting is modelled in accounting mode "
                          "only (bytes mode scales pages unevenly across groups)",
                          "Add --mode accounting, or use --host-accounting slot.")
    slots = real.num_host_slots
    moved = real
    if layout.is_scaled:
        probe = replace(real, groups=layout.specs, host_capacity_bytes=1 << 62)
        moved = replace(real, groups=layout.specs,
                        host_capacity_bytes=slots * probe.slot_bytes)
    arena = moved.host_capacity_bytes if layout.is_scaled else 0
    if slots > MAX_HOST_SLOTS or arena > MAX_MOVED_BYTES:
        raise ConfigError("host_capacity_bytes", f"{config.host_capacity_bytes} bytes are "
                          f"{slots} host slots, more than the simulation keeps",
                          "Give a smaller host capacity (or --mode accounting in bytes mode).")
    return Capacities(engine_blocks + 1, block_bytes, slots, real.slot_bytes), moved


def _check_engine_size(config: SimulationConfig, layout: ModelLayout, blocks: int) -> None:
    field = ("engine_capacity_bytes" if config.engine_capacity_bytes is not None
             else "engine_tokens")
    moved = blocks * sum(g.spec.page_bytes * g.spec.num_layers for g in layout.groups)
    if blocks > MAX_ENGINE_BLOCKS or (layout.is_scaled and moved > MAX_MOVED_BYTES):
        raise ConfigError(field, f"{blocks} engine blocks are more than the simulation keeps "
                          f"(at most {MAX_ENGINE_BLOCKS}, {MAX_MOVED_BYTES} moved bytes)",
                          "Give a smaller engine capacity.")


@dataclass(frozen=True)
class EngineParts:
    """What the engine of a ``SimulationConfig`` is built from (``engine_parts``)."""

    layout: ModelLayout
    offload: OffloadConfig
    engine: EngineConfig
    policy: CachePolicy | None
    """The cache policy (None: parts of an engine without offloading)."""
    tiers: TierConfig | None
    """The lower tiers below host memory; in bytes mode the real worker reads and writes
    them too."""
    accounting: bool
    """Accounting mode: lower tiers are modelled, not read (``kvoffload.offload.build_offload``)."""
    remote_capacity_bytes: int
    """The modelled remote tier's budget (accounting mode)."""

    def build_offload(self, lower_tiers: Sequence[LowerTier] | None = None) -> Offload:
        """The planner and its tiers (``lower_tiers``: already built, instead of
        ``tiers``'). Raises ``ValueError`` for parts built without offloading."""
        if self.policy is None:
            raise ValueError("these engine parts were built without offloading")
        return offload_for(self.layout, self.offload, tiers=self.tiers, policy=self.policy,
                           lower_tiers=lower_tiers, accounting=self.accounting,
                           remote_capacity_bytes=self.remote_capacity_bytes)


def named_policy(config: SimulationConfig) -> CachePolicy:
    """The registered cache policy ``config.eviction_policy`` names.

    The oracle is no entry: it needs its workload's future, which ``run_one`` builds
    (``ConfigError`` here)."""
    if is_oracle(config.eviction_policy):
        raise ConfigError("eviction_policy", "the oracle knows the future of the workload "
                          "it replays; an engine built without it has none",
                          "Run it through simulation.run_one / simulate (which build the "
                          "workload's future), or pick another policy.")
    return cache_policy(config.eviction_policy)


def engine_parts(config: SimulationConfig, *, offload: bool = True,
                 policy: CachePolicy | None = None, lower_tiers: bool = True,
                 num_workers: int = 1, load_deadline_s: float | None = None) -> EngineParts:
    """The layout and configurations of ``config``'s engine: with ``offload``, its cache
    policy (``policy``, or the one ``config`` names: ``named_policy``) and the lower tiers
    it asks for unless ``lower_tiers`` is False (a fleet builds its own)."""
    if offload and policy is None:
        policy = named_policy(config)
    layout = config.layout()
    caps, offload_config = resolve(config, layout)
    offload_config = replace(offload_config, num_workers=num_workers)
    engine_config = EngineConfig(
        num_blocks=caps.engine_blocks, max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs, decode_tokens_per_step=config.decode_tokens_per_step,
        sample_interval_s=config.sample_interval_s, check_integrity=config.check_integrity,
        load_deadline_s=load_deadline_s)
    tiers = None
    if offload and lower_tiers and (config.disk_capacity_bytes or config.remote_capacity_bytes
                                    or config.disk_path or config.remote_url):
        tiers = lower_tier_config(config, offload_config.slot_bytes / caps.host_slot_bytes)
    return EngineParts(layout, offload_config, engine_config, policy if offload else None,
                       tiers, accounting=config.mode is Mode.ACCOUNTING,
                       remote_capacity_bytes=config.remote_capacity_bytes or 1)


def build_engine(config: SimulationConfig, *, offload: bool = True,
                 policy: CachePolicy | None = None,
                 executor: TransferExecutor | None = None) -> ReferenceEngine:
    """The engine for ``config``; ``offload=False`` builds the no-offloading baseline.
    ``policy``: the cache policy (default: the one ``config`` names).

    In bytes mode (and with offloading) the engine gets real tensors and a
    ``WorkerExecutor`` unless ``executor`` is given.
    """
    parts = engine_parts(config, offload=offload, policy=policy)
    return assemble(parts.layout, parts.engine, parts.build_offload() if offload else None,
                    mode=config.mode, executor=executor, timing=config.timing,
                    tiers=parts.tiers)


def lower_tier_config(config: SimulationConfig, byte_scale: float = 1.0) -> TierConfig:
    """The lower tiers ``config`` asks for: modelled ones in accounting mode, real ones
    (a directory, a Redis/Valkey server) in bytes mode. ``byte_scale``: moved bytes per
    real byte (bytes mode scales pages down; the disk budget, given in real bytes, keeps
    the same number of blocks)."""
    for name in ("disk_capacity_bytes", "remote_capacity_bytes"):
        value = getattr(config, name)
        if value is not None and value <= 0:
            raise ConfigError(name, f"must be positive, got {value}", "Give a size, e.g. 1TiB.")
    if config.mode is Mode.ACCOUNTING:
        if config.disk_path or config.remote_url:
            raise ConfigError("disk_path" if config.disk_path else "remote_url",
                              "real tiers move real bytes: they need bytes mode",
                              "Use --mode bytes, or model the tiers with --disk-capacity / "
                              "--remote-capacity in accounting mode.")
        disk = (DiskTierConfig("(simulated disk)", config.disk_capacity_bytes)
                if config.disk_capacity_bytes else None)
        remote = RemoteTierConfig() if config.remote_capacity_bytes else None
        return TierConfig(model_id=config.model_id, disk=disk, remote=remote)
    if config.disk_capacity_bytes and not config.disk_path:
        raise ConfigError("disk_path", "is missing: bytes mode writes a real disk tier",
                          "Give --disk-path DIR, or use --mode accounting.")
    if config.disk_path and not config.disk_capacity_bytes:
        raise ConfigError("disk_capacity_bytes", "is missing for the disk tier",
                          "Give --disk-capacity, e.g. 1GiB.")
    if config.remote_capacity_bytes:
        raise ConfigError("remote_capacity_bytes", "a real server's capacity is its own "
                          "maxmemory", "Drop --remote-capacity and give --remote-url; or use "
                          "--mode accounting to model the store.")
    disk = None
    if config.disk_path and config.disk_capacity_bytes:
        budget = max(1, int(config.disk_capacity_bytes * byte_scale))
        disk = DiskTierConfig(config.disk_path, budget, fsync=False)
    remote = RemoteTierConfig(config.remote_url) if config.remote_url else None
    return TierConfig(model_id=f"{config.model_id}:scaled{config.scale_bytes}",
                      disk=disk, remote=remote, mac_key=config.mac_key)


ExecutorWrap = Callable[[TransferExecutor, "DeviceCaches | None", "WorkerExecutor | None"],
                        TransferExecutor]
"""Wraps the executor ``assemble`` built (given the engine caches and the real worker in
bytes mode), e.g. to inject faults."""


def assemble(layout: ModelLayout, engine_config: EngineConfig,
             offload: Offload | None, *, mode: Mode = Mode.ACCOUNTING,
             executor: TransferExecutor | None = None,
             timing: TimingModel | None = None,
             tiers: TierConfig | None = None,
             wrap_executor: ExecutorWrap | None = None) -> ReferenceEngine:
    """Wire an engine: ``offload`` (the planner and its tiers: ``EngineParts.build_offload``
    or ``refengine.engine.offload_for``) None runs without offloading; bytes mode gives
    it real tensors over ``layout.specs`` pages, the real worker (unless ``executor`` is
    given) and a host auditor. ``tiers``: the lower tiers the real worker reads and writes
    (bytes mode); ``wrap_executor``: applied to the executor before the engine gets it."""
    if offload is None:
        return ReferenceEngine(layout, engine_config, timing=timing)
    offload_config = offload.config
    device = worker = auditor = None
    if mode is Mode.BYTES:
        from kvoffload.refengine.device import DeviceCaches, HostAuditor, WorkerExecutor

        device = DeviceCaches(layout.specs, engine_config.num_blocks)
        if executor is None:
            worker = WorkerExecutor(offload_config, device, tiers=tiers)
            auditor = HostAuditor(worker.worker.host_pool, layout.specs,
                                  offload_config.block_size_factor)
            executor = worker
    executor = executor or AccountingExecutor(offload_config.num_workers)
    if wrap_executor is not None:
        executor = wrap_executor(executor, device, worker)
    return ReferenceEngine(layout, engine_config, offload=offload,
                           executor=executor, device=device, auditor=auditor, timing=timing)


@dataclass(frozen=True)
class SimulationResult:
    """Both runs of one simulation."""

    config: SimulationConfig
    layout: ModelLayout
    capacities: Capacities
    offload: RunSummary
    baseline: RunSummary | None


def run_one(config: SimulationConfig, workload: Iterable[WorkloadRequest], *,
            offload: bool = True, progress: Progress | None = None,
            policy: CachePolicy | None = None) -> RunSummary:
    """Run ``workload`` once, with or without offloading.

    The cache policy is ``policy`` where given, else the one ``config.eviction_policy``
    names. Under the ``oracle`` the workload is read into a list first and its future
    (``sim.oracle.future.WorkloadFuture``) built from it; the run's cache policy is the
    oracle bound to that future (``sim.oracle.binding.oracle_policy``). Without offloading
    the policy is unused."""
    if offload and policy is None and is_oracle(config.eviction_policy):
        requests = list(workload)
        policy = oracle_policy(_workload_future(config, requests))
        workload = requests
    engine = build_engine(config, offload=offload, policy=policy)
    start = time.perf_counter()
    try:
        metrics = replay(engine, workload, arrival=config.arrival, max_queued=config.max_queued,
                         progress=progress)
    finally:
        engine.executor.shutdown()
        if engine.tier is not None:
            engine.tier.close()
    if config.check_integrity:
        engine.check_integrity()
    return summarize(engine, metrics, wall_s=time.perf_counter() - start)


def _workload_future(config: SimulationConfig,
                     requests: Sequence[WorkloadRequest]) -> WorkloadFuture:
    """The future the oracle knows: ``requests`` hashed as ``config``'s engine hashes
    them, with the engine's own prefix cache modelled."""
    layout = config.layout()
    caps, offload_config = resolve(config, layout)
    # Block ids are shared by the groups: a prefix holds one per group per block. An
    # engine caches a Mamba state only where a step ended on its boundary, which the
    # future cannot tell: with a Mamba group its prefix cache is not modelled.
    engine_tokens = 0 if any(KIND_RULES[g.spec.kind].holds_state for g in layout.groups) \
        else (caps.engine_blocks - 1) * layout.block_size // len(layout.groups)
    return WorkloadFuture.build(requests, offload_config,
                                unstored_tail=config.decode_tokens_per_step,
                                engine_tokens=engine_tokens)


def simulate(config: SimulationConfig, workload: Iterable[WorkloadRequest], *,
             progress: Progress | None = None,
             baseline_progress: Progress | None = None) -> SimulationResult:
    """Run the workload with offloading and (``config.baseline``) without.

    ``workload`` is iterated once per run: pass a list, or a re-iterable object.
    """
    layout = config.layout()
    caps, _ = resolve(config, layout)
    result = run_one(config, workload, progress=progress)
    base = None
    if config.baseline:
        base = run_one(replace(config, mode=Mode.ACCOUNTING), workload, offload=False,
                       progress=baseline_progress)
    return SimulationResult(config, layout, caps, result, base)


def describe_groups(layout: ModelLayout) -> list[str]:
    """One line per group: kind, window, layers, block size."""
    out = []
    for g in layout.groups:
        s = g.spec
        kind = KIND_RULES[s.kind].label(s)
        out.append(f"{kind}: {s.num_layers} layers, block {s.block_size} tokens")
    return out
