"""Leaving idle requests out of a step changes no plan (``Planner.step_is_idle``).

Two simulated engines with the same layout and seed run the same random event sequence
(``PlannerMachine``'s rules: requests sharing prefixes, follow-ups, chunked prefill and
decode, preemptions, aborts, late and failed reports, cache resets): one lists every
scheduled request in each step, the other leaves out those the planner calls idle, as
the vLLM adapter does. Every step's plan (flushes, stores, loads, job ids) must be the
same in both: a store that comes a step late, or a block it reads from a different
position, fails the run. Each engine also checks every rule of docs/architecture.md.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize
from test_planner_state_machine import EXAMPLES, STEPS, PlannerMachine, layouts

from kvoffload.config import OffloadConfig
from kvoffload.jobs import StepPlan
from kvoffload.planner.contract import StepInput
from support.sim_engine import SimEngine, SimRequest


def recorded(engine: SimEngine) -> list[tuple[Any, ...]]:
    """The plans ``engine``'s planner makes from now on, as comparable tuples."""
    plans: list[tuple[Any, ...]] = []
    build = engine.planner.build_step_plan

    def recording(step: StepInput) -> StepPlan:
        plan = build(step)
        plans.append((plan.flush, plan.stores, plan.loads))
        return plan

    engine.planner.build_step_plan = recording  # type: ignore[method-assign]
    return plans


class TwinEngines:
    """Two engines driven alike (``SimEngine``'s calls the machine's rules make)."""

    def __init__(self, config: OffloadConfig, pool: int, seed: int) -> None:
        self.listing = SimEngine(config, num_blocks=pool, seed=seed, leave_out_idle=False)
        self.leaving_out = SimEngine(config, num_blocks=pool, seed=seed, leave_out_idle=True)
        self._plans = (recorded(self.listing), recorded(self.leaving_out))

    @property
    def requests(self) -> dict[str, SimRequest]:
        return self.listing.requests

    @property
    def planner(self) -> Any:
        return self.listing.planner

    def _same_plans(self) -> None:
        listed, left_out = self._plans
        assert listed == left_out, (
            f"step {len(listed)}: plans differ when idle requests are left out")
        self.leaving_out.planner.check_integrity()

    def add_request(self, *args: Any) -> None:
        self.listing.add_request(*args)
        self.leaving_out.add_request(*args)

    def step(self, chunk: int, fraction: float, fail: float, *,
             preempt: SimRequest | None = None, abort: SimRequest | None = None) -> None:
        twin = self.leaving_out.requests
        self.listing.step(chunk, fraction, fail, preempt=preempt, abort=abort)
        self.leaving_out.step(chunk, fraction, fail,
                              preempt=None if preempt is None else twin[preempt.request_id],
                              abort=None if abort is None else twin[abort.request_id])
        self._same_plans()

    def deliver(self, fraction: float, fail: float) -> None:
        self.listing.deliver(fraction, fail)
        self.leaving_out.deliver(fraction, fail)

    def reset_cache(self) -> None:
        self.listing.reset_cache()
        self.leaving_out.reset_cache()

    def drain(self) -> None:
        self.listing.drain()
        self.leaving_out.drain()
        self._same_plans()


class IdleStepsMachine(PlannerMachine):
    @initialize(config=layouts(), pool=st.integers(12, 80), seed=st.integers(0, 2**16))
    def setup(self, config: OffloadConfig, pool: int, seed: int,  # type: ignore[override]
              leave_out_idle: bool = True) -> None:
        super().setup(config, pool, seed)
        self.engine = TwinEngines(config, pool, seed)  # type: ignore[assignment]


IdleStepsMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestIdleStepsMachine = IdleStepsMachine.TestCase
