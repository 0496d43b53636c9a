"""Capacity planning (``kvoffload.sim.plan``): the plan does not depend on how many
processes run its simulations. What ``kvoffload plan`` prints of it is tested in
``tests/cli/test_plan_cli.py``."""

from __future__ import annotations

from kvoffload.sim.plan import make_plan
from kvoffload.sim.simulation import Mode, SimulationConfig
from kvoffload.workloads.spec import WorkloadSpec

# 150 chat requests in a small engine (as ``kvoffload plan --workload chat --limit 150
# --engine-tokens 12000``): host memory matters, and each run takes a fraction of a second.
SPEC = WorkloadSpec("chat", None, 150, 0)
BASE = SimulationConfig(mode=Mode.ACCOUNTING, engine_tokens=12000, decode_tokens_per_step=16)


def test_more_jobs_give_the_same_plan() -> None:
    def plan(jobs: int) -> dict[str, object]:
        return make_plan(BASE, SPEC, policies=["lru", "value"], fractions=(0.05, 0.2, 0.5, 1),
                         jobs=jobs).to_dict()

    one = plan(1)
    two = plan(2)
    assert one == two
