"""The planner and real transfer workers together, driven by random engine events.

The same random event sequences as the planner's property test (new requests sharing
prefixes, chunked prefill, decode, preemption, aborts, late/reordered/split/failed reports,
resets), but every store and load moves real bytes on CPU tensors through
``TransferWorker`` ranks, asynchronously. Every block the engine reads after a load is
compared byte for byte with what it must hold, for every group, layer and rank.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from kvoffload.config import OffloadConfig
from property.test_planner_state_machine import PlannerMachine, layouts
from support.real_workers import RealWorkers, real_backend, with_pages
from support.sim_engine import SimEngine

EXAMPLES = int(os.environ.get("KVOFFLOAD_HYPOTHESIS_EXAMPLES", "25"))


class RealBytesMachine(PlannerMachine):
    @initialize(config=layouts(), pool=st.integers(12, 80), seed=st.integers(0, 2**16))
    def setup(self, config: OffloadConfig, pool: int, seed: int) -> None:
        import random

        real_config = with_pages(config, config.num_host_slots)
        self.engine = SimEngine(real_config, num_blocks=pool, seed=seed,
                                real=real_backend(seed))  # type: ignore[arg-type]
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(50) for _ in range(40)] for _ in range(3)]

    def teardown(self) -> None:
        if hasattr(self, "engine"):
            try:
                self.engine.drain()
            finally:
                workers = self.engine.workers
                if isinstance(workers, RealWorkers):
                    workers.shutdown()


RealBytesMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPlannerWorkerEndToEnd = RealBytesMachine.TestCase
