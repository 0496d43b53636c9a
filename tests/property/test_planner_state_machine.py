"""Random engine event sequences against the planner's rules (the rules of docs/architecture.md).

Each run draws a hybrid layout (1-4 groups mixing full attention, sliding window and Mamba,
block_size_factor 1-4, 1-4 workers, a small host capacity and engine pool), then a random
sequence of engine events: new requests sharing prefixes, steps with chunked prefill and
decode, preemptions, aborts, worker reports that come late, reordered, split across ranks
or failed, and cache resets. A run either lists every scheduled request in each step or
leaves out those whose step needs nothing of the planner (``Planner.step_is_idle``, as
the vLLM adapter does). Requests carry random client hints (``continues``: none, true
or false; a session id from a small set, so that later requests find theirs seen), which
may change what is stored but never what a hit loads. The simulated engine checks every
rule after every step (``support.sim_engine``): loaded and read blocks hold exactly the
right data, no block is overwritten while a job uses it, hits are aligned and capped,
deferrals are bounded, and after a drain nothing is pinned, fenced or pending.

KVOFFLOAD_HYPOTHESIS_EXAMPLES raises the example count for a long run.
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvoffload.config import OffloadConfig
from kvoffload.planner.contract import NO_CONTROLS, RequestControls
from support.sim_engine import SimEngine
from support.strategies import draw_groups

EXAMPLES = int(os.environ.get("KVOFFLOAD_HYPOTHESIS_EXAMPLES", "60"))
STEPS = int(os.environ.get("KVOFFLOAD_HYPOTHESIS_STEPS", "60"))

HINTS = st.sampled_from([None, None, True, False])
"""A request's ``continues`` hint: mostly none."""
SESSIONS = st.sampled_from([None, "s1", "s2"])
"""A request's session id."""


@st.composite
def layouts(draw: st.DrawFn) -> OffloadConfig:
    hash_bs, factor, groups = draw_groups(draw, max_factor=4)
    return OffloadConfig(
        groups=groups, hash_block_size=hash_bs, block_size_factor=factor,
        num_workers=draw(st.integers(1, 4)),
        host_capacity_bytes=draw(st.integers(2, 64)),
        eviction_policy=draw(st.sampled_from(["lru", "arc", "hybrid", "value"])),
        max_deferred_steps=draw(st.integers(1, 8)),
        # Mamba states only where a step ends (vLLM's align mode), or at every block end.
        mamba_states_every_block=draw(st.booleans()),
    )


class PlannerMachine(RuleBasedStateMachine):
    engine: SimEngine

    @initialize(config=layouts(), pool=st.integers(12, 80), seed=st.integers(0, 2**16),
                leave_out_idle=st.booleans())
    def setup(self, config: OffloadConfig, pool: int, seed: int,
              leave_out_idle: bool = True) -> None:
        self.engine = SimEngine(config, num_blocks=pool, seed=seed,
                                leave_out_idle=leave_out_idle)
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(50) for _ in range(40)] for _ in range(3)]

    @rule(prefix=st.integers(0, 2), shared=st.sampled_from([0, 6, 13, 24, 40]),
          extra=st.integers(0, 12),
          out=st.integers(0, 8),
          max_store=st.one_of(st.none(), st.none(), st.integers(0, 40)),
          max_load=st.one_of(st.none(), st.none(), st.integers(0, 40)),
          continues=HINTS, session=SESSIONS)
    def new_request(self, prefix: int, shared: int, extra: int, out: int, *,
                    max_store: int | None, max_load: int | None, continues: bool | None,
                    session: str | None) -> None:
        tokens = self.prefixes[prefix][:shared] + [self.rng.randrange(50) for _ in range(extra)]
        if not tokens:
            tokens = [1]
        self.engine.add_request(tokens, out, RequestControls(max_store, max_load,
                                                             continues, session))

    @precondition(lambda self: bool(self.engine.requests))
    @rule(data=st.data(), extra=st.integers(0, 6), out=st.integers(0, 4),
          continues=HINTS, session=SESSIONS)
    def follow_up(self, data: st.DataObject, extra: int, out: int, continues: bool | None,
                  session: str | None) -> None:
        """A next turn: an earlier request's whole context plus new tokens."""
        earlier = data.draw(st.sampled_from(sorted(self.engine.requests)))
        tokens = self.engine.requests[earlier].tokens + [self.rng.randrange(50)
                                                         for _ in range(extra)]
        controls = RequestControls(continues=continues, session_id=session)
        self.engine.add_request(tokens, out, controls if controls.has_hints else NO_CONTROLS)

    @rule(chunk=st.integers(1, 24), fraction=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
          fail=st.sampled_from([0.0, 0.0, 0.2]))
    def step(self, chunk: int, fraction: float, fail: float) -> None:
        self.engine.step(chunk, fraction, fail)

    @precondition(lambda self: any(r.state == "running" for r in self.engine.requests.values()))
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        running = [r for r in self.engine.requests.values() if r.state == "running"]
        victim = data.draw(st.sampled_from(running))
        self.engine.step(4, 0.5, 0.0, preempt=victim)

    @precondition(lambda self: any(r.state != "done" for r in self.engine.requests.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        live = [r for r in self.engine.requests.values() if r.state != "done"]
        victim = data.draw(st.sampled_from(live))
        self.engine.step(4, 0.5, 0.0, abort=victim)

    @rule(fraction=st.sampled_from([0.5, 1.0]))
    def deliver_reports(self, fraction: float) -> None:
        self.engine.deliver(fraction, 0.1)

    @rule()
    def reset_cache(self) -> None:
        self.engine.reset_cache()

    @invariant()
    def integrity(self) -> None:
        if hasattr(self, "engine"):
            self.engine.planner.check_integrity()

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            self.engine.drain()


PlannerMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPlannerStateMachine = PlannerMachine.TestCase
