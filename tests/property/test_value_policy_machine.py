"""The planner's rules under the hybrid-aware ``value`` policy, with per-group byte
accounting, plus the policy's own admission rule.

The engine event sequences are those of ``test_planner_state_machine`` (every rule of
docs/architecture.md is checked after every step by ``support.sim_engine``); the layouts
here give groups different page sizes, charge the host budget in bytes, and select the
``value`` policy (or, for comparison, LRU/ARC under the same byte budget).

On top, every window block or Mamba state the planner asks the tier to store must be one
that can serve a hit under the policy's own rule: some aligned hit point whose window (or
state) needs the block must be one the admission calls likely (the prompt's end, a point
after the prompt, a multiple of the learned granule just before the prompt's end, or a
learned miss point; a request's client hint ``continues`` makes the points from the
prompt's end on likely, or not, as ``docs/policy.md`` says), or, stored provisionally, the
window or state of the request's resume point (the last aligned point of a prefill still
inside its prompt), unless the tier had free room when it was admitted (then the policy
admits everything, as store-everything would).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant
from test_planner_state_machine import EXAMPLES, STEPS, PlannerMachine

from kvoffload.config import OffloadConfig, ResolvedGroup
from kvoffload.keys import BlockHash, OffloadKey, key_group, make_offload_key
from kvoffload.planner.admission import Admit, HitPointAdmission
from kvoffload.tiers.base import PrepareStoreResult
from support.sim_engine import SimEngine
from support.strategies import draw_groups


@st.composite
def byte_layouts(draw: st.DrawFn) -> OffloadConfig:
    hash_bs, factor, groups = draw_groups(draw, max_factor=3, page_bytes=True)
    largest = max(g.page_bytes * factor for g in groups)
    return OffloadConfig(
        groups=groups, hash_block_size=hash_bs, block_size_factor=factor,
        num_workers=draw(st.integers(1, 4)),
        host_capacity_bytes=largest * draw(st.integers(2, 40)),
        eviction_policy=draw(st.sampled_from(["value", "value", "lru", "arc"])),
        host_accounting=draw(st.sampled_from(["bytes", "bytes", "slot"])),
        max_deferred_steps=draw(st.integers(1, 8)),
    )


def _hit_points(g: ResolvedGroup, block: int, alignment: int) -> range:
    """Aligned hit points whose window (or state) needs offloaded block ``block``."""
    obs = g.offloaded_block_size
    first = (block + 1) * obs
    first += -first % alignment
    return range(first, (block + (g.window_blocks or 1)) * obs + 1, alignment)


class AdmissionAudit:
    """Wraps a planner's ``HitPointAdmission`` and its tier's ``prepare_store``: records
    the keys admitted and checks each admission and each stored key against the rule."""

    def __init__(self, engine: SimEngine) -> None:
        planner = engine.planner
        self.admission = planner.store_policy.admission
        assert isinstance(self.admission, HitPointAdmission)
        self.alignment = engine.config.hit_alignment
        self.hash_bs = engine.config.hash_block_size
        self.groups = engine.config.resolved
        self.admitted: set[OffloadKey] = set()
        self.checked = 0
        self.resumed = 0
        """Blocks stored for a resume point."""
        self._verdicts: dict[tuple[int, int], tuple[Admit, Sequence[BlockHash], int]] = {}
        """(group, block) -> the last verdict on it, with the request's hashes and prompt."""
        admit = self.admission.admit
        self.has_room: Callable[[], bool] = self.admission._has_room
        self.admission.admit = self._admit  # type: ignore[method-assign]
        self._admit_inner = admit
        self._admit_blocks_inner = self.admission.admit_blocks
        self.admission.admit_blocks = self._admit_blocks  # type: ignore[method-assign]
        self._resume_inner = self.admission.admit_for_resume
        self.admission.admit_for_resume = self._admit_for_resume  # type: ignore[method-assign]
        store = engine.tier.prepare_store
        self._store_inner = store
        engine.tier.prepare_store = self._prepare_store  # type: ignore[method-assign]

    def _likely(self, point: int, hashes: Sequence[BlockHash], prompt: int,
                continues: bool | None) -> bool:
        """The rule, restated from the policy's documented parameters and the request's
        client hint (``continues``)."""
        last = prompt - 1
        if point > prompt:
            if continues is not None:
                return continues
            return self.admission.turn_ends_hit  # learned (tests/core/test_admission.py)
        if continues is not False and point in (prompt, last // self.alignment * self.alignment):
            return True
        granule = self.admission.granule
        points = self.admission.granule_points
        if point % granule == 0 and last // granule * granule - point < points * granule:
            return True
        index = point // self.hash_bs - 1
        return 0 <= index < len(hashes) and hashes[index] in self.admission._learned

    def _admit(self, group: ResolvedGroup, block: int, hashes: Sequence[BlockHash],
               num_prompt_tokens: int, continues: bool | None = None) -> Admit:
        room = self.has_room()
        result = self._admit_inner(group, block, hashes, num_prompt_tokens, continues)
        self._check(group, block, hashes, num_prompt_tokens, continues, room=room,
                        result=result)
        return result

    def _admit_blocks(self, group: ResolvedGroup, blocks: Sequence[int],
                      hashes: Sequence[BlockHash], num_prompt_tokens: int,
                      continues: bool | None = None) -> list[Admit]:
        room = self.has_room()
        results = self._admit_blocks_inner(group, blocks, hashes, num_prompt_tokens, continues)
        assert len(results) == len(blocks)
        for block, result in zip(blocks, results, strict=True):
            self._check(group, block, hashes, num_prompt_tokens, continues, room=room,
                        result=result)
        return results

    def _check(self, group: ResolvedGroup, block: int, hashes: Sequence[BlockHash],
               num_prompt_tokens: int, continues: bool | None, *, room: bool,
               result: Admit) -> None:
        """One verdict against the rule (``room``: whether the tier had room before)."""
        points = list(_hit_points(group, block, self.alignment))
        likely = any(self._likely(p, hashes, num_prompt_tokens, continues) for p in points)
        expected = Admit.YES if likely else Admit.SPARE_ROOM if room else Admit.NO
        assert result is expected, (
            f"group {group.index} block {block}: {result.name}, the rule says "
            f"{expected.name} (room {room}, prompt {num_prompt_tokens})")
        if result:
            assert points, f"group {group.index} block {block}: no aligned hit can use it"
            self._record(group, block, hashes)
        self._verdicts[(group.index, block)] = (result, hashes, num_prompt_tokens)
        self.checked += 1

    def _admit_for_resume(self, group: ResolvedGroup, block: int, point: int) -> bool:
        """A resume point is an aligned point of a prefill still inside the prompt; a
        block stored for it must be in that point's window (or be its state)."""
        result = self._resume_inner(group, block, point)
        if result:
            verdict = self._verdicts.get((group.index, block))
            assert verdict is not None and verdict[0] is not Admit.YES, \
                "asked for a resume without being refused first"
            _, hashes, prompt = verdict
            assert 0 < point < prompt - 1, f"resume point {point} outside the prompt"
            assert point % self.alignment == 0, f"resume point {point} not aligned"
            assert point in _hit_points(group, block, self.alignment), (
                f"group {group.index} block {block} stored for a resume at {point}, "
                "whose window does not need it")
            self.resumed += 1
            self._record(group, block, hashes)
        return result

    def _record(self, group: ResolvedGroup, block: int, hashes: Sequence[BlockHash]) -> None:
        index = (block + 1) * group.hashes_per_block - 1
        if index < len(hashes):
            self.admitted.add(make_offload_key(hashes[index], group.index))

    def _prepare_store(self, keys: Sequence[OffloadKey], **kwargs: object
                       ) -> PrepareStoreResult | None:
        for key in keys:
            if self.groups[key_group(key)].window_blocks is not None:
                assert key in self.admitted, "a window block or state stored unadmitted"
        return self._store_inner(keys, **kwargs)  # type: ignore[arg-type]


class ValuePolicyMachine(PlannerMachine):
    audit: AdmissionAudit | None

    @initialize(config=byte_layouts(), pool=st.integers(12, 80), seed=st.integers(0, 2**16))
    def setup(self, config: OffloadConfig, pool: int, seed: int) -> None:
        super().setup(config, pool, seed)
        self.audit = (AdmissionAudit(self.engine)
                      if isinstance(self.engine.planner.store_policy.admission,
                                    HitPointAdmission) else None)

    def teardown(self) -> None:
        if getattr(self, "audit", None) is not None:
            assert self.audit is not None
            event(f"blocks stored for a resume point: {'some' if self.audit.resumed else 'none'}")
        super().teardown()

    @invariant()
    def byte_budget_holds(self) -> None:
        if hasattr(self, "engine") and self.engine.config.charges_bytes:
            usage = self.engine.tier.usage()
            assert sum(usage.bytes_by_group.values()) <= self.engine.config.host_capacity_bytes
        if hasattr(self, "engine"):  # the quick answer admission asks, per candidate block
            assert self.engine.tier.is_full() == self.engine.tier.usage().is_full


ValuePolicyMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestValuePolicyMachine = ValuePolicyMachine.TestCase
