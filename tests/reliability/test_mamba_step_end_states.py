"""A Mamba block holds the state after its last token only if a step ended exactly there.

With chunked prefill whose chunks do not end on block boundaries (and with decode, which
crosses a boundary mid-step), the block at a boundary position holds the step's input
state, not the boundary state. Storing it as the boundary state would serve a wrong state
to every later hit at that boundary (silent corruption; peers' most reported bug class).
"""

from __future__ import annotations

import pytest

from kvoffload.config import GroupKind
from kvoffload.sim.replay import Arrival, replay
from kvoffload.sim.simulation import Mode, SimulationConfig, run_one
from kvoffload.workloads import builtin_workload
from refengine.engine_kit import make_engine, req, tiny_preset, toks


@pytest.mark.parametrize("budget", [6, 8, 10])
def test_states_of_steps_ending_mid_block_are_never_stored(budget: int) -> None:
    engine = make_engine(tiny_preset(mamba=True), budget=budget, num_blocks=64)
    workload = [req("a", toks(40), output=2), req("b", toks(40, base=5000), output=2, at=1.0),
                req("c", toks(44), output=2, at=2.0)]
    metrics = replay(engine, workload, arrival=Arrival.TRACE)
    assert metrics.audited_host_blocks > 0
    assert metrics.wrong_host_bytes == 0
    assert metrics.wrong_bytes == 0
    mamba = next(i for i, g in enumerate(engine.specs) if g.kind is GroupKind.MAMBA)
    stats = engine.planner.stats  # type: ignore[union-attr]
    assert stats.blocks_stored.get(mamba, 0) > 0  # states at step ends are still stored


def test_a_hybrid_mamba_model_replays_agents_without_a_wrong_byte() -> None:
    """nemotron-h-8b, whose 1040-token blocks no 8192-token chunk ends on: every stored
    state is one a step really produced, and every loaded one matches."""
    sim = SimulationConfig(preset="nemotron-h-8b", mode=Mode.BYTES, engine_tokens=65536,
                           host_capacity_bytes=8 << 30, baseline=False, eviction_policy="lru")
    summary = run_one(sim, builtin_workload("agentic", 0)[:40])
    assert summary.host_hit_tokens > 0
    assert summary.wrong_bytes == 0 and summary.corrupt_loads == 0
