"""The reference engine's modelled time is the clock its planner and tier cascade measure
their waits in seconds with, so a simulation never depends on the wall clock (a wait for
host room lasts modelled seconds, and a run repeats exactly)."""

from __future__ import annotations

from pathlib import Path

from kvoffload.config import OffloadConfig
from kvoffload.refengine.context import EngineConfig
from kvoffload.refengine.engine import offload_for
from kvoffload.sim.simulation import Mode, assemble
from kvoffload.tiers.cascade import CascadeTier
from kvoffload.tiers.config import DiskTierConfig, TierConfig
from refengine.engine_kit import BS, tiny_preset


def test_the_planner_and_the_cascade_read_the_engines_modelled_time(tmp_path: Path) -> None:
    layout = tiny_preset().layout(BS)
    config = OffloadConfig(groups=layout.specs, hash_block_size=BS, host_capacity_bytes=1 << 16)
    offload = offload_for(layout, config,
                          tiers=TierConfig(disk=DiskTierConfig(str(tmp_path), 1 << 20)),
                          accounting=True)
    assert isinstance(offload.tier, CascadeTier)
    engine = assemble(layout, EngineConfig(num_blocks=16, max_num_batched_tokens=16,
                                           max_num_seqs=2), offload, mode=Mode.ACCOUNTING)
    engine.clock = 12.5
    assert offload.clock() == 12.5
    assert offload.planner._clock() == 12.5
    assert offload.tier._clock() == 12.5
