"""Random engine event sequences with speculative decoding and a draft model's KV group.

The layouts of ``test_planner_state_machine`` without Mamba groups, plus one draft group:
full attention whose KV at a position depends on the ``proof_tokens`` after it
(``num_speculative_tokens + 1``; EAGLE, MTP). Decoding requests are scheduled with their
next token and the draft tokens; each step accepts a drawn number of them
(``support.sim_engine``, "Speculative decoding"). Besides every rule the simulated engine
checks, a draft block must be final when a store is submitted (its proof tokens computed)
and a loaded draft block must be the final block of the loading request's own tokens:
no hit reaches over the volatile tail, and none trusts tokens the request does not share.
Preemptions, aborts, failed and late reports and cache resets come as in the base
machine (the rules are inherited).
"""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_planner_state_machine import EXAMPLES, STEPS, PlannerMachine

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from support.sim_engine import SimEngine
from support.strategies import draw_groups


@st.composite
def speculative_layouts(draw: st.DrawFn) -> tuple[OffloadConfig, int]:
    """A layout with one draft group, and the number of speculative tokens."""
    hash_bs, factor, groups = draw_groups(draw, max_factor=3)
    groups = tuple(g for g in groups if g.kind is not GroupKind.MAMBA)
    spec_tokens = draw(st.integers(1, 4))
    block_size = hash_bs * draw(st.sampled_from([1, 2]))
    draft = GroupSpec(GroupKind.FULL_ATTENTION, block_size, proof_tokens=spec_tokens + 1,
                      name="draft")
    at = draw(st.integers(0, len(groups)))
    config = OffloadConfig(
        groups=(*groups[:at], draft, *groups[at:]), hash_block_size=hash_bs,
        block_size_factor=factor, num_workers=draw(st.integers(1, 3)),
        host_capacity_bytes=draw(st.integers(2, 64)),
        eviction_policy=draw(st.sampled_from(["lru", "arc", "hybrid", "value"])),
        max_deferred_steps=draw(st.integers(1, 8)))
    return config, spec_tokens


class SpeculativeMachine(PlannerMachine):
    @initialize(layout=speculative_layouts(), pool=st.integers(16, 80),
                seed=st.integers(0, 2**16), leave_out_idle=st.booleans())
    def setup(self, layout: tuple[OffloadConfig, int], pool: int,  # type: ignore[override]
              seed: int, leave_out_idle: bool = True) -> None:
        config, spec_tokens = layout
        super().setup(config, pool, seed)
        self.engine = SimEngine(config, num_blocks=pool, seed=seed,
                                speculative_tokens=spec_tokens,
                                leave_out_idle=leave_out_idle)
        self.accepted = [spec_tokens]

    @rule(accepted=st.lists(st.integers(0, 4), min_size=1, max_size=6),
          chunk=st.integers(1, 24), fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
          fail=st.sampled_from([0.0, 0.0, 0.2]))
    def speculative_step(self, accepted: list[int], chunk: int, fraction: float,
                         fail: float) -> None:
        """A step whose decoding requests accept ``accepted[i]`` drafts, in turn."""
        counts = iter(accepted * 64)
        self.engine.accept = lambda k: min(k, next(counts, k))
        self.engine.step(chunk, fraction, fail)


    def teardown(self) -> None:
        if hasattr(self, "engine"):
            event("drafts rejected" if self.engine.rejected_drafts else "no draft rejected")
            event("draft blocks loaded" if self.engine.loaded_draft_blocks
                  else "no draft block loaded")
        super().teardown()


SpeculativeMachine.TestCase.settings = settings(
    max_examples=2 * EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestSpeculativeMachine = SpeculativeMachine.TestCase
