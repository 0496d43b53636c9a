"""The planner state machine (``test_planner_state_machine``) under the ``oracle`` policy.

The oracle needs its workload's future before the run, so each run draws a pool of
requests up front (new prompts sharing prefixes, and follow-ups that extend an earlier
prompt), builds its ``WorkloadFuture`` and binds the oracle to it; the machine's
request rules then add the pool's next request, in order. Every other rule (steps with
chunked prefill, preemptions, aborts, late or failed reports, cache resets) and every
check after each step are the base machine's.
"""

from __future__ import annotations

import random
from array import array

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule
from test_planner_state_machine import EXAMPLES, STEPS, PlannerMachine, layouts

from kvoffload.planner.contract import RequestControls
from kvoffload.sim.oracle.binding import oracle_policy
from kvoffload.sim.oracle.eviction import OraclePolicy
from kvoffload.sim.oracle.future import WorkloadFuture
from kvoffload.sim.oracle.store import OracleStorePolicy
from kvoffload.workloads.request import WorkloadRequest
from support.sim_engine import SimEngine

POOL = 24
"""Requests drawn per run (a run adds at most this many)."""


def _pool(rng: random.Random) -> list[list[int]]:
    prefixes = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    pool: list[list[int]] = []
    for _ in range(POOL):
        if pool and rng.random() < 0.4:
            tokens = rng.choice(pool) + [rng.randrange(50) for _ in range(rng.randrange(7))]
        else:
            shared = rng.choice([0, 6, 13, 24, 40])
            tokens = prefixes[rng.randrange(3)][:shared] + [
                rng.randrange(50) for _ in range(rng.randrange(13))]
        pool.append(tokens or [1])
    return pool


class OracleMachine(PlannerMachine):
    @initialize(config=layouts(), pool=st.integers(12, 80), seed=st.integers(0, 2**16))
    def setup(self, config, pool: int, seed: int) -> None:  # type: ignore[no-untyped-def]
        self.rng = random.Random(seed)
        self.pool = _pool(self.rng)
        requests = [WorkloadRequest(f"r{i}", 0.0, array("i", tokens), 1)
                    for i, tokens in enumerate(self.pool)]
        future = WorkloadFuture.build(requests, config, hash_seed="sim")
        self.engine = SimEngine(config, num_blocks=pool, seed=seed,
                                policy=oracle_policy(future))
        assert isinstance(self.engine.tier.policy, OraclePolicy)
        assert isinstance(self.engine.planner.store_policy, OracleStorePolicy)

    def _next(self, out: int, controls: RequestControls | None = None) -> None:
        tokens = self.pool[len(self.engine.requests)]
        if controls is None:
            self.engine.add_request(tokens, out)
        else:
            self.engine.add_request(tokens, out, controls)

    @precondition(lambda self: len(self.engine.requests) < POOL)
    @rule(out=st.integers(0, 8),
          max_store=st.one_of(st.none(), st.none(), st.integers(0, 40)),
          max_load=st.one_of(st.none(), st.none(), st.integers(0, 40)))
    def new_request(self, out: int, *, max_store: int | None,  # type: ignore[override]
                    max_load: int | None) -> None:
        self._next(out, RequestControls(max_store, max_load))

    @precondition(lambda self: 0 < len(self.engine.requests) < POOL)
    @rule(out=st.integers(0, 4))
    def follow_up(self, out: int) -> None:  # type: ignore[override]
        self._next(out)


OracleMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestOracleStateMachine = OracleMachine.TestCase
