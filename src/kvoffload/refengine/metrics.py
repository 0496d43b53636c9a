"""What the reference engine measures while it runs, as plain data.

All byte figures are *real* bytes (the model's page sizes), whatever the worker moved;
``moved_*`` figures are what the worker actually copied in bytes mode (scaled pages).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.refengine.requests import RequestRecord


@dataclass
class GroupTraffic:
    """Transfers of one KV-cache group, counted when the planner hears of them."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    stored_bytes: int = 0
    loaded_bytes: int = 0
    failed_jobs: int = 0


@dataclass(frozen=True)
class Sample:
    """The engine at one moment of modelled time.

    Hit counters are cumulative over the requests that started running so far.
    """

    time_s: float
    prompt_tokens: int
    engine_hit_tokens: int
    host_hit_tokens: int
    host_bytes_by_group: tuple[int, ...]
    host_used_slots: int
    engine_blocks_used: int
    running: int
    waiting: int


@dataclass
class EngineMetrics:
    """Counters of one engine run (see the module docstring).

    Attributes:
        records: one per finished request, in finishing order.
        traffic: per group.
        steps: engine steps that did something; idle_advances: clock jumps while idle.
        flush_stall_s: modelled time steps waited for flushed jobs.
        wrong_loaded_bytes: bytes of loaded blocks that differ from what they must hold.
        wrong_cached_bytes: same, for blocks the engine's own prefix cache handed out.
        wrong_host_bytes: bytes of host blocks, readable at the end, that differ from what
            their stores were to write (``audited_host_blocks`` were compared).
        verified_blocks / verified_bytes: engine blocks (and moved bytes) compared.
        same_step_flushes: stores a plan both created and flushed, so the worker had to
            run them before the forward pass that writes their blocks (a planner bug).
        misplaced_store_blocks: stored engine blocks that do not sit at the position their
            ``GroupTransfer`` implies (``first_block_index + i``; bytes mode checks it).
        peak_host_bytes_by_group: the most each group held at any sample.
        moved_*: bytes and measured seconds of the real worker (bytes mode only).
        abandoned_loads: loads given up after ``EngineConfig.load_deadline_s``; their
            blocks stayed parked (``parked_blocks_peak`` at most) until the job reported.
        cache_resets: ``ReferenceEngine.reset_cache`` calls.
        max_offload_wait_s: the longest a request waited on the offload path, modelled
            seconds: for its load (until it reported or was given up), or in a run of
            deferred lookups (until one answered; a step in which the engine did not ask
            the request, busy with others, ends the run).
        deferral_give_ups: lookups deferred past the load deadline, run without offload.
        max_step_s: the longest step, flush stalls included (modelled seconds).
    """

    num_groups: int
    records: list[RequestRecord] = field(default_factory=list)
    traffic: list[GroupTraffic] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    steps: int = 0
    idle_advances: int = 0
    preemptions: int = 0
    same_step_flushes: int = 0
    misplaced_store_blocks: int = 0
    flush_stall_s: float = 0.0
    wrong_loaded_bytes: int = 0
    wrong_cached_bytes: int = 0
    wrong_host_bytes: int = 0
    audited_host_blocks: int = 0
    verified_blocks: int = 0
    verified_bytes: int = 0
    peak_host_bytes_by_group: list[int] = field(default_factory=list)
    moved_stored_bytes: int = 0
    moved_loaded_bytes: int = 0
    measured_store_s: float = 0.0
    measured_load_s: float = 0.0
    cum_prompt_tokens: int = 0
    cum_engine_hit_tokens: int = 0
    cum_host_hit_tokens: int = 0
    abandoned_loads: int = 0
    parked_blocks_peak: int = 0
    cache_resets: int = 0
    max_offload_wait_s: float = 0.0
    deferral_give_ups: int = 0
    max_step_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.traffic:
            self.traffic = [GroupTraffic() for _ in range(self.num_groups)]
        if not self.peak_host_bytes_by_group:
            self.peak_host_bytes_by_group = [0] * self.num_groups

    def started(self, record: RequestRecord) -> None:
        """Fold a request's hits into the cumulative counters (when it first runs)."""
        self.cum_prompt_tokens += record.prompt_tokens
        self.cum_engine_hit_tokens += record.engine_hit_tokens
        self.cum_host_hit_tokens += record.host_hit_tokens

    @property
    def wrong_bytes(self) -> int:
        return self.wrong_loaded_bytes + self.wrong_cached_bytes + self.wrong_host_bytes
