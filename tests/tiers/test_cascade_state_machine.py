"""The planner's random engine events, now with a disk tier below a tiny host memory.

The same event sequences as the planner's property test (hybrid layouts, shared prefixes,
chunked prefill, decode, preemption, aborts, late/reordered/split/failed reports, cache
resets), with a ``CascadeTier`` (write-back or write-through to a small disk budget) and
real worker ranks moving real bytes between engine tensors, host slots and block files.
Tier-job reports are held back and reordered like transfer reports, and a rule damages
random block files. After every step the engine checks the rules of docs/architecture.md:
every loaded block holds exactly the right bytes, nothing is overwritten while in use,
deferrals are bounded; after a drain nothing is pinned or pending -- in host memory or on
disk.

KVOFFLOAD_HYPOTHESIS_EXAMPLES raises the example count for a long run.
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule

from kvoffload.blockfile.framing import HEADER_BYTES
from kvoffload.config import OffloadConfig
from kvoffload.tiers.config import WriteMode
from property.test_planner_state_machine import PlannerMachine, layouts
from support.real_workers import with_pages
from tiers.tier_kit import TieredEngine, block_files, disk_tiers

EXAMPLES = int(os.environ.get("KVOFFLOAD_HYPOTHESIS_EXAMPLES", "10"))


class CascadeMachine(PlannerMachine):
    tiered: TieredEngine
    directory: str

    @initialize(config=layouts(), pool=st.integers(12, 80), seed=st.integers(0, 2**16),
                write_through=st.booleans(), disk_blocks=st.integers(4, 400))
    def setup(self, config: OffloadConfig, pool: int, seed: int,  # type: ignore[override]
              write_through: bool, disk_blocks: int) -> None:
        real = with_pages(config, config.num_host_slots)
        self.directory = tempfile.mkdtemp(prefix="kvoffload-cascade-")
        entry = real.num_workers * (HEADER_BYTES + real.slot_bytes)
        mode = WriteMode.WRITE_THROUGH if write_through else WriteMode.WRITE_BACK
        tiers = disk_tiers(self.directory, capacity=disk_blocks * entry, mode=mode)
        self.tiered = TieredEngine(real, tiers, num_blocks=pool, seed=seed)
        self.engine = self.tiered.sim
        self.engine.rng = random.Random(seed)  # the engine's own prefix hits are back on
        self.rng = random.Random(seed)
        self.prefixes = [[self.rng.randrange(50) for _ in range(40)] for _ in range(3)]

    @rule(first=st.integers(0, 2), other=st.integers(0, 2), extra=st.integers(1, 8),
          chunk=st.integers(4, 24))
    def revisit_a_prefix(self, first: int, other: int, extra: int, chunk: int) -> None:
        """Requests on shared 40-token prefixes, each stepped until done (with whatever
        else runs): one prefix, another, the first again -- by then host memory may have
        let it go, and the disk tier serves it."""
        for prefix in (first, other, first):
            tokens = self.prefixes[prefix] + [self.rng.randrange(50) for _ in range(extra)]
            req = self.engine.add_request(tokens, 2)
            for _ in range(60):
                if req.state == "done":
                    break
                self.engine.step(chunk, 1.0, 0.0)

    @precondition(lambda self: self.rng.random() < 0.15)
    @rule()
    def reset_cache(self) -> None:
        """Rarer than in the planner's test: a reset purges the disk tier too."""
        self.engine.reset_cache()

    @precondition(lambda self: hasattr(self, "directory") and
                  bool(block_files(self.directory)))
    @rule(data=st.data(), truncate=st.booleans())
    def damage_a_block_file(self, data: st.DataObject, truncate: bool) -> None:
        files = block_files(self.directory)
        path: Path = data.draw(st.sampled_from(files))
        raw = bytearray(path.read_bytes())
        if truncate:
            raw = raw[: len(raw) // 2]
        else:
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= 0x01
        path.write_bytes(bytes(raw))

    def teardown(self) -> None:
        if not hasattr(self, "tiered"):
            return
        try:
            self.engine.drain()
            self.tiered.tier.check_integrity()
            assert not self.tiered.tier.has_pending_work()
            disk = self.tiered.tier.lower("disk")
            assert disk._busy == 0  # type: ignore[attr-defined]  # nothing pinned or writing
        finally:
            self.tiered.workers.shutdown()
            shutil.rmtree(self.directory, ignore_errors=True)


CascadeMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCascadeStateMachine = CascadeMachine.TestCase
