"""Helpers for the reference-engine tests: tiny models whose numbers are easy to follow,
engines wired like the simulator's, and recorders of what the planner was told and did."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.config import OffloadConfig
from kvoffload.jobs import StepPlan
from kvoffload.keys import BlockHasher, OffloadKey, make_offload_key
from kvoffload.models.preset import AttentionLayers, MambaLayers, ModelPreset
from kvoffload.planner.contract import StepInput
from kvoffload.refengine.context import EngineConfig
from kvoffload.refengine.engine import ReferenceEngine, offload_for
from kvoffload.refengine.requests import RequestRecord
from kvoffload.sim.simulation import Mode, assemble
from kvoffload.workloads import WorkloadRequest

BS = 4
"""Block size of every tiny model (tokens)."""

FULL = AttentionLayers(num_layers=2, num_kv_heads=1, head_dim=4, num_q_heads=1)
"""16 B per token per layer: a 4-token page is 64 B, a block of both layers 128 B."""


def tiny_preset(*, window: int | None = None, mamba: bool = False,
                full: bool = True) -> ModelPreset:
    """A model with a full-attention group, optionally a window group (``window`` tokens)
    and a Mamba group (one layer, 64-byte states)."""
    attention = [FULL] if full else []
    if window is not None:
        attention.append(AttentionLayers(num_layers=2, num_kv_heads=1, head_dim=4,
                                         num_q_heads=1, sliding_window=window))
    m = MambaLayers(num_layers=1, n_heads=2, head_dim=2, n_groups=1, d_state=2, d_conv=3) \
        if mamba else None
    return ModelPreset(name="tiny", source="tests", num_layers=6, attention=tuple(attention),
                       mamba=m, params_per_token=1_000_000)


def make_engine(preset: ModelPreset, *, num_blocks: int = 64, host_slots: int = 256,
                mode: Mode = Mode.BYTES, factor: int = 1, budget: int = 64,
                max_seqs: int = 8, policy: str = "lru") -> ReferenceEngine:
    layout = preset.layout(BS)
    probe = OffloadConfig(groups=layout.specs, hash_block_size=BS, host_capacity_bytes=1 << 40,
                          block_size_factor=factor)
    offload = OffloadConfig(groups=layout.specs, hash_block_size=BS,
                            host_capacity_bytes=host_slots * probe.slot_bytes,
                            block_size_factor=factor, eviction_policy=policy)
    config = EngineConfig(num_blocks=num_blocks, max_num_batched_tokens=budget,
                          max_num_seqs=max_seqs, check_integrity=True)
    return assemble(layout, config, offload_for(layout, offload), mode=mode)


def req(rid: str, tokens: Sequence[int], output: int = 1, at: float = 0.0) -> WorkloadRequest:
    return WorkloadRequest(request_id=rid, arrival_s=at, prompt=list(tokens),
                           output_length=output)


def toks(n: int, base: int = 1000) -> list[int]:
    return list(range(base, base + n))


def key_at(tokens: Sequence[int], position: int, group: int) -> OffloadKey:
    """The offload key of the block ending at ``(position + 1) * BS`` tokens."""
    hashes = BlockHasher(BS).extend([], list(tokens))
    return make_offload_key(hashes[position], group)


@dataclass
class Recorder:
    """What the engine told the planner each step, and the plans it got back."""

    inputs: list[StepInput] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)

    def attach(self, engine: ReferenceEngine) -> Recorder:
        planner = engine.planner
        assert planner is not None
        build = planner.build_step_plan

        def recording(step: StepInput) -> StepPlan:
            plan = build(step)
            self.inputs.append(step)
            self.plans.append(plan)
            return plan

        planner.build_step_plan = recording  # type: ignore[method-assign]
        return self

    def scheduled(self, rid: str) -> list[tuple[int, int]]:
        """``(num_computed_tokens, num_scheduled_tokens)`` of every schedule of ``rid``."""
        return [(s.num_computed_tokens, s.num_scheduled_tokens)
                for step in self.inputs for s in step.scheduled if s.request.request_id == rid]

    def loads(self, rid: str) -> list[tuple[int, tuple[int, ...], int]]:
        """``(group, block ids, first position)`` of every group of ``rid``'s loads."""
        return [(t.group, t.block_ids, t.first_block_index)
                for plan in self.plans for job in plan.loads if job.request_id == rid
                for t in job.groups]

    def stored_positions(self, rid: str, group: int) -> list[int]:
        """Positions of ``group`` stored for ``rid``, in order."""
        return [t.first_block_index + i for plan in self.plans for job in plan.stores
                if job.request_id == rid for t in job.groups if t.group == group
                for i in range(len(t.block_ids))]


def record(engine: ReferenceEngine, rid: str) -> RequestRecord:
    return next(r for r in engine.metrics.records if r.request_id == rid)
