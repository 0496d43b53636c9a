"""Stateful property tests of cold insertion: the value policy's eviction order under
random inserts, touches, cold and demotion hints, removals and evictions, and the shadow
directories of the insertion duel under random inserts, warms, demotions and lookups.

Value policy (weight 0, so value plays no part): the eviction order is always demoted
keys (in the order they were demoted), then cold and normal keys, each kind by last
insertion or touch, a normal key next while normal keys are more than ``normal_share``
of the keys left, a cold one otherwise; a touch makes a cold key normal and undoes a
demotion (all demotions here are hints); a key touched since its insertion is never made
cold.
Shadow directory: it never holds more than its budget, and holds exactly what a model of
three lists (demoted, normal, cold) holds, in the same eviction order, which follows the
same share rule; a lookup counts held keys in a row and makes them normal.
"""

from __future__ import annotations

import os

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvoffload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.planner.insertion import ShadowDirectory
from kvoffload.tiers.eviction import BlockState, ValuePolicy

KEYS = [make_offload_key(BlockHash(i.to_bytes(16, "big")), 0) for i in range(8)]
EXAMPLES = int(os.environ.get("KVOFFLOAD_HYPOTHESIS_EXAMPLES", "50"))
some_keys = st.lists(st.sampled_from(KEYS), max_size=5)
NORMAL_SHARE = 0.5
"""Low enough that both normal and cold keys go first in turn among 8 keys."""


def eviction_order(demoted: list[OffloadKey], normal: list[OffloadKey],
                   cold: list[OffloadKey]) -> list[OffloadKey]:
    """The model's order: demoted keys, then normal keys while they are more than
    ``NORMAL_SHARE`` of the keys left, cold keys otherwise (each list next first)."""
    normal, cold = list(normal), list(cold)
    order = list(demoted)
    while normal or cold:
        share = len(normal) / (len(normal) + len(cold))
        order.append(cold.pop(0) if cold and (not normal or share <= NORMAL_SHARE)
                     else normal.pop(0))
    return order


class ValueOrderMachine(RuleBasedStateMachine):
    """Model: ``demoted`` in demotion order; ``stamp`` per key; ``cold`` keys."""

    def __init__(self) -> None:
        super().__init__()
        self.policy = ValuePolicy(len(KEYS), weight=0.0, normal_share=NORMAL_SHARE)
        self.clock = 0
        self.stamp: dict[OffloadKey, int] = {}
        self.cold: set[OffloadKey] = set()
        self.demoted: list[OffloadKey] = []
        self.touched: set[OffloadKey] = set()  # since insertion

    def order(self) -> list[OffloadKey]:
        def by_stamp(cold: bool) -> list[OffloadKey]:
            return sorted((k for k in self.stamp
                           if k not in self.demoted and (k in self.cold) == cold),
                          key=self.stamp.__getitem__)

        return eviction_order(self.demoted, by_stamp(False), by_stamp(True))

    @rule(key=st.sampled_from(KEYS))
    def insert(self, key: OffloadKey) -> None:
        if key in self.stamp:
            return
        self.policy.insert(key, BlockState(slot=KEYS.index(key), ref=0))
        self.clock += 1
        self.stamp[key] = self.clock

    @rule(keys=some_keys)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.policy.touch(keys)
        for key in reversed(keys):
            if key in self.stamp:
                if key in self.demoted:
                    self.demoted.remove(key)
                self.clock += 1
                self.stamp[key] = self.clock
                self.cold.discard(key)
                self.touched.add(key)

    @rule(keys=some_keys)
    def cool(self, keys: list[OffloadKey]) -> None:
        self.policy.cool(keys)
        self.cold |= {k for k in keys if k in self.stamp and k not in self.demoted
                      and k not in self.touched}

    @rule(keys=some_keys)
    def demote(self, keys: list[OffloadKey]) -> None:
        self.policy.demote(keys)
        for key in keys:
            if key in self.stamp:
                if key in self.demoted:
                    self.demoted.remove(key)
                self.demoted.append(key)

    def forget(self, key: OffloadKey) -> None:
        del self.stamp[key]
        self.cold.discard(key)
        self.touched.discard(key)
        if key in self.demoted:
            self.demoted.remove(key)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: OffloadKey) -> None:
        if key in self.stamp:
            self.policy.remove(key)
            self.forget(key)

    @rule(keys=some_keys)
    def warm(self, keys: list[OffloadKey]) -> None:
        cold = [key for key in keys if key in self.cold]
        self.policy.warm(keys)
        self.touch(cold)

    @rule(n=st.integers(1, 4), shielded=st.frozensets(st.sampled_from(KEYS), max_size=4))
    def evict_around_shielded_keys(self, n: int, shielded: frozenset[OffloadKey]) -> None:
        """Shielded keys are passed over but still count in the share of normal keys:
        the model replays the choice victim by victim; a failed eviction changes nothing."""
        order = self.order()
        low = [key for key in order if key in self.demoted or key in self.cold]
        normal = [key for key in order if key not in low]
        count, total = len(normal), len(order)
        expected: list[OffloadKey] = []
        while len(expected) < n and (low or normal):
            take_low = bool(low) and (not normal or low[0] in self.demoted
                                      or count <= NORMAL_SHARE * total)
            key = low.pop(0) if take_low else normal.pop(0)
            if key in shielded:
                continue
            expected.append(key)
            total -= 1
            count -= not take_low
        victims = self.policy.evict(n, shielded)
        if len(expected) < n:
            assert victims is None
            return
        assert victims is not None and [key for key, _ in victims] == expected
        for key in expected:
            self.forget(key)

    @rule(n=st.integers(0, 3))
    def evict(self, n: int) -> None:
        victims = self.policy.evict(n, set())
        if n > len(self.stamp):
            assert victims is None
            return
        assert victims is not None
        expected = self.order()[:n]
        assert [key for key, _ in victims] == expected
        for key in expected:
            self.forget(key)

    @invariant()
    def order_matches_the_model(self) -> None:
        self.policy.check_integrity()
        assert [key for key, _ in self.policy.items()] == self.order()




class ShadowMachine(RuleBasedStateMachine):
    """Model: ``demoted``, ``normal`` and ``cold`` lists, front evicted first, charges."""

    @initialize(budget=st.integers(1, 12))
    def setup(self, budget: int) -> None:
        self.shadow = ShadowDirectory(budget, normal_share=NORMAL_SHARE)
        self.budget = budget
        self.demoted: list[OffloadKey] = []
        self.normal: list[OffloadKey] = []
        self.cold: list[OffloadKey] = []
        self.charge: dict[OffloadKey, int] = {}

    def order(self) -> list[OffloadKey]:
        return eviction_order(self.demoted, self.normal, self.cold)

    def drop(self, key: OffloadKey) -> None:
        for segment in (self.demoted, self.normal, self.cold):
            if key in segment:
                segment.remove(key)

    @rule(items=st.lists(st.tuples(st.sampled_from(KEYS), st.integers(1, 5)), max_size=4),
          cold=st.booleans(), normal=st.frozensets(st.sampled_from(KEYS), max_size=2))
    def insert(self, items: list[tuple[OffloadKey, int]], cold: bool,
               normal: frozenset[OffloadKey]) -> None:
        self.shadow.insert(items, cold=cold, normal=normal)
        for key, charge in items:
            if key in self.charge or charge > self.budget:
                continue
            while sum(self.charge.values()) + charge > self.budget:
                victim = self.order()[0]
                self.drop(victim)
                del self.charge[victim]
            (self.cold if cold and key not in normal else self.normal).append(key)
            self.charge[key] = charge

    @rule(keys=some_keys)
    def warm(self, keys: list[OffloadKey]) -> None:
        self.shadow.warm(keys)
        for key in reversed(keys):
            if key in self.cold:
                self.cold.remove(key)
                self.normal.append(key)

    @rule(keys=some_keys)
    def demote(self, keys: list[OffloadKey]) -> None:
        self.shadow.demote(keys)
        for key in keys:
            if key in self.charge:
                self.drop(key)
                self.demoted.append(key)

    @rule(keys=some_keys, start=st.integers(0, 3))
    def lookup(self, keys: list[OffloadKey], start: int) -> None:
        found = self.shadow.lookup(keys, start)
        run = 0
        for key in keys[start:]:
            if key not in self.charge:
                break
            run += 1
        assert found == run
        for key in reversed(keys[:start + run]):
            if key in self.normal or key in self.cold:
                self.drop(key)
                self.normal.append(key)

    @invariant()
    def holds_what_the_model_holds_within_budget(self) -> None:
        if not hasattr(self, "shadow"):
            return
        assert self.shadow.used == sum(self.charge.values()) <= self.budget
        assert list(self.shadow) == self.order()


ValueOrderMachine.TestCase.settings = settings(max_examples=EXAMPLES, deadline=None)
ShadowMachine.TestCase.settings = settings(max_examples=EXAMPLES, deadline=None)
TestValueOrder = ValueOrderMachine.TestCase
TestShadowDirectory = ShadowMachine.TestCase
