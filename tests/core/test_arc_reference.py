"""ARC against a straightforward reference: seeded random call sequences give the same
lists, target, victims and lookups, step by step.

The reference below is ARC as its class doc states it, written for clarity: one key at a
time, one candidate at a time, no bulk paths. ``ARCPolicy`` must keep and evict exactly
what it keeps and evicts, whatever fast paths it takes.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

import pytest

from kvoffload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.tiers.eviction import WRITING, ARCPolicy, BlockState


class ReferenceARC:
    """ARC one key at a time (the ``ARCPolicy`` class doc, literally)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.target = 0.0
        self.t1: OrderedDict[OffloadKey, BlockState] = OrderedDict()
        self.t2: OrderedDict[OffloadKey, BlockState] = OrderedDict()
        self.b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self.b2: OrderedDict[OffloadKey, None] = OrderedDict()

    def get(self, key: OffloadKey) -> BlockState | None:
        return self.t1.get(key) or self.t2.get(key)

    def insert(self, key: OffloadKey, state: BlockState) -> None:
        assert self.get(key) is None
        self.t1[key] = state
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: OffloadKey) -> BlockState:
        if key in self.t1:
            return self.t1.pop(key)
        return self.t2.pop(key)

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            if key in self.t1:
                state = self.t1.pop(key)
                if state.ref >= 0:
                    self.t2[key] = state
                else:
                    self.t1[key] = state
            elif key in self.t2:
                self.t2.move_to_end(key)
            elif key in self.b1:
                delta = max(1.0, len(self.b2) / len(self.b1))
                self.target = min(self.target + delta, float(self.capacity))
                self.b1.move_to_end(key)
            elif key in self.b2:
                delta = max(1.0, len(self.b1) / len(self.b2))
                self.target = max(self.target - delta, 0.0)
                self.b2.move_to_end(key)

    def evict(self, n: int, protected: AbstractSet[OffloadKey],
              ) -> list[tuple[OffloadKey, BlockState]] | None:
        t1_left = [(k, s) for k, s in self.t1.items() if s.ref == 0 and k not in protected]
        t2_left = [(k, s) for k, s in self.t2.items() if s.ref == 0 and k not in protected]
        t1_size = len(self.t1)
        chosen: list[tuple[OffloadKey, BlockState, bool]] = []
        for _ in range(n):
            if t1_left and t1_size >= int(self.target):
                key, state = t1_left.pop(0)
                chosen.append((key, state, True))
                t1_size -= 1
            elif t2_left:
                key, state = t2_left.pop(0)
                chosen.append((key, state, False))
            elif t1_left:
                key, state = t1_left.pop(0)
                chosen.append((key, state, True))
                t1_size -= 1
            else:
                return None
        for key, _, from_t1 in chosen:
            if from_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        for ghost in (self.b1, self.b2):
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [(key, state) for key, state, _ in chosen]

    def lists(self) -> dict[str, object]:
        return {"t1": list(self.t1), "t2": list(self.t2), "b1": list(self.b1),
                "b2": list(self.b2), "target": self.target}


def lists_of(arc: ARCPolicy) -> dict[str, object]:
    return {"t1": list(arc.t1), "t2": list(arc.t2), "b1": list(arc.b1),
            "b2": list(arc.b2), "target": arc.target_t1_size}


def key(i: int) -> OffloadKey:
    return make_offload_key(BlockHash(i.to_bytes(16, "big")), 0)


def run_sequence(seed: int, capacity: int, universe: int, steps: int) -> dict[str, int]:
    """Drive both with the same random calls (shared states, so a ref change reaches
    both); compare after every call. Returns how often each kind of call ran."""
    rng = random.Random(seed)
    arc = ARCPolicy(capacity)
    ref = ReferenceARC(capacity)
    keys = [key(i) for i in range(universe)]
    counts = {"insert": 0, "evict": 0, "evict_none": 0, "touch": 0, "ghost_touch": 0,
              "remove": 0, "ref": 0}
    for _ in range(steps):
        op = rng.random()
        present = [k for k in keys if ref.get(k) is not None]
        if op < 0.3:
            absent = [k for k in keys if ref.get(k) is None]
            rng.shuffle(absent)
            room = capacity - len(present)
            batch = absent[:rng.randint(0, max(0, min(room, 6)))]
            states = [BlockState(slot=rng.randrange(1000), ref=rng.choice((WRITING, 0, 0)))
                      for _ in batch]
            if rng.random() < 0.5:
                arc.insert_all(batch, states)
            else:
                for k, s in zip(batch, states, strict=True):
                    arc.insert(k, s)
            for k, s in zip(batch, states, strict=True):
                ref.insert(k, s)
            counts["insert"] += len(batch)
        elif op < 0.6:
            # A request's prefix: present keys, ghosts and unknown keys, repeats allowed.
            touched = [rng.choice(keys) for _ in range(rng.randint(0, 8))]
            if rng.random() < 0.3:  # the misses a store is about to write
                touched = [k for k in touched if ref.get(k) is None]
            counts["ghost_touch"] += sum(k in ref.b1 or k in ref.b2 for k in touched)
            arc.touch(touched)
            ref.touch(touched)
            counts["touch"] += 1
        elif op < 0.8:
            n = rng.randint(0, 5)
            protected = frozenset(rng.sample(keys, rng.randint(0, 4)))
            got = arc.evict(n, protected)
            want = ref.evict(n, protected)
            if want is None:
                assert got is None
                counts["evict_none"] += 1
            else:
                assert got is not None
                assert [(k, s) for k, s in got] == want
                counts["evict"] += len(want)
        elif op < 0.85 and present:
            k = rng.choice(present)
            assert arc.remove(k) is ref.remove(k)
            counts["remove"] += 1
        elif present:
            state = ref.get(rng.choice(present))
            assert state is not None
            # As a tier changes refs: a write ends (never starts again), loads pin and
            # release.
            state.ref = 0 if state.ref == WRITING else rng.choice((0, 0, 1, 2))
            counts["ref"] += 1
        assert lists_of(arc) == ref.lists()
        assert len(arc) == len(ref.t1) + len(ref.t2)
        for k in keys:
            assert arc.get(k) is ref.get(k)
            assert arc.state_of(k) is ref.get(k)
            assert (k in arc) == (ref.get(k) is not None)
        arc.check_integrity()
    return counts


@pytest.mark.parametrize("seed", range(12))
def test_arc_matches_the_reference_on_random_sequences(seed: int) -> None:
    capacity = (2, 3, 5, 8)[seed % 4]
    counts = run_sequence(seed, capacity, universe=capacity * 3, steps=600)
    # The sequences reach every branch: ghosts hit, victims taken, evictions refused.
    assert counts["ghost_touch"] > 0 and counts["evict"] > 0 and counts["evict_none"] > 0
    assert counts["remove"] > 0 and counts["ref"] > 0


def test_arc_matches_the_reference_with_long_ghost_lists() -> None:
    counts = run_sequence(seed=99, capacity=24, universe=90, steps=1500)
    assert counts["ghost_touch"] > 50 and counts["evict"] > 200
