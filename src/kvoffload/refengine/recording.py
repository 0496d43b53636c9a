"""What the reference engine records: hits per request and tier, samples over time.

``Recorder`` fills in two parts of ``EngineMetrics``:

* **Hit attribution.** ``started`` fixes a request's hits when it first starts to run
  (later admissions after a preemption hit its own blocks, which is no reuse): the engine
  prefix hit, the external tokens of its load and the bytes loaded, the external tokens
  split by the tier that served them (``RequestRecord.tier_hit_tokens``; all from host
  memory without lower tiers), and the bytes promoted from a lower tier first. Which tier
  served a load's blocks is what the planner's ``update_state_after_alloc`` returns
  (``LoadGrant.blocks_by_source``); tokens that do not split evenly go to host memory.
* **Samples.** ``take_sample`` appends a ``Sample``, due every ``sample_interval_s``
  modelled seconds (``sample_due``): cumulative prompt and hit tokens, the bytes the host
  tier holds per group (real sizes, ``host_bytes_by_group``), slots and engine blocks in
  use, requests running and waiting; it also keeps the per-group peaks.

Every byte figure uses the model's real sizes, not the (possibly scaled) pages moved.
The per-token records of a step (prefill tokens and FLOPs, recomputed tokens, first
token, finish) are written by the step loop itself (``scheduler``), where they are cheap.
"""

from __future__ import annotations

from kvoffload.jobs import TransferJob
from kvoffload.refengine.context import EngineContext
from kvoffload.refengine.metrics import Sample
from kvoffload.refengine.requests import EngineRequest
from kvoffload.tiers.base import HOST, Tier
from kvoffload.tiers.host import HostTier


class Recorder:
    """Hit attribution and samples (module docstring).

    Args:
        context: the engine's clock, limits (``sample_interval_s``), pool (blocks in
            use), metrics (written to) and block sizes.
        tier: the planner's tier, None without offloading.
        host: host memory (the tier, or a cascade's first level).
    """

    def __init__(self, context: EngineContext, tier: Tier | None,
                 host: HostTier | None) -> None:
        self._clock = context.clock
        self._metrics = context.metrics
        self._pool = context.pool
        self._tier = tier
        self._host = host
        self._real_block_bytes = context.block_bytes.real
        self._moved_offloaded_bytes = context.block_bytes.moved_offloaded
        self._real_offloaded_bytes = context.block_bytes.real_offloaded
        self._interval = context.config.sample_interval_s
        self._next_sample = 0.0

    # ------------------------------------------------------------------ hits

    def job_bytes(self, job: TransferJob | None) -> int:
        """Real bytes a load job brings into the engine (0 for no job)."""
        if job is None:
            return 0
        return sum(len(t.block_ids) * self._real_block_bytes[t.group] for t in job.groups)

    def started(self, req: EngineRequest, local: int, external: int, loaded: int) -> None:
        """The request starts to run: its first start fixes its hits (later admissions
        after a preemption hit its own blocks, which is no reuse)."""
        if req.started:
            return
        req.started = True
        rec = req.record
        rec.engine_hit_tokens, rec.host_hit_tokens, rec.loaded_bytes = local, external, loaded
        if external:
            # Split the external tokens by where the load's blocks came from (all from
            # host memory without lower tiers); promoted blocks were read from a lower
            # tier first.
            origin: dict[str, int] = {}
            for (tier, group), n in req.pending_origin.items():
                origin[tier] = origin.get(tier, 0) + n
                if tier != HOST:
                    rec.promoted_bytes += n * self._real_offloaded_bytes[group]
            origin = origin or {HOST: 1}
            total = sum(origin.values())
            shares = {t: external * n // total for t, n in origin.items()}
            first = next(iter(shares))
            shares[first] += external - sum(shares.values())
            rec.tier_hit_tokens = shares
        self._metrics.started(rec)

    # --------------------------------------------------------------- samples

    @property
    def real_slot_bytes(self) -> int:
        """Real bytes of one host slot (the largest group's offloaded block)."""
        return max(self._real_offloaded_bytes)

    def host_bytes_by_group(self) -> tuple[int, ...]:
        """Real bytes the host tier holds per group now (ready and being written)."""
        if self._tier is None:
            return tuple(0 for _ in self._real_offloaded_bytes)
        usage = self._tier.usage().bytes_by_group
        out = []
        for g, moved in enumerate(self._moved_offloaded_bytes):
            keys = usage.get(g, 0) // moved if moved else 0
            out.append(keys * self._real_offloaded_bytes[g])
        return tuple(out)

    def sample_due(self) -> bool:
        """Whether a sample is due now (every ``sample_interval_s``); if so, the next one
        is due an interval later."""
        clock = self._clock.clock
        if clock < self._next_sample:
            return False
        self._next_sample = clock + self._interval
        return True

    def take_sample(self, running: int, waiting: int) -> None:
        """Record a ``Sample`` now, with ``running`` requests running or loading and
        ``waiting`` waiting."""
        m = self._metrics
        held = self.host_bytes_by_group()
        for g, b in enumerate(held):
            m.peak_host_bytes_by_group[g] = max(m.peak_host_bytes_by_group[g], b)
        pool = self._pool
        m.samples.append(Sample(
            time_s=self._clock.clock, prompt_tokens=m.cum_prompt_tokens,
            engine_hit_tokens=m.cum_engine_hit_tokens, host_hit_tokens=m.cum_host_hit_tokens,
            host_bytes_by_group=held,
            host_used_slots=self._host.usage().used_slots if self._host is not None else 0,
            engine_blocks_used=pool.num_blocks - 1 - pool.num_free_blocks,
            running=running, waiting=waiting))
