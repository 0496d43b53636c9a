"""The per-group hit rules and the fixpoint that combines them (planner/lookup.py).

Pure functions over "is offloaded block i readable", so each part of rule 5
(docs/architecture.md) is pinned here without a tier: full attention takes the readable
prefix, a window group the rightmost run of W readable blocks (or the leading run when
fewer than W blocks lie past the device's prefix), Mamba one state at an aligned end, and
the fixpoint the largest end every group accepts.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from planner_kit import full, make_config, mamba, window

from kvoffload.config import ResolvedGroup
from kvoffload.planner.lookup import (
    BlockReadable,
    GroupView,
    combined_hit_end,
    lookup_order,
    prefix_end,
    window_end,
)


def hits(*blocks: int) -> BlockReadable:
    readable = set(blocks)
    return lambda i: i in readable


def counting(blocks: Iterable[int], calls: list[int]) -> BlockReadable:
    readable = set(blocks)

    def probe(i: int) -> bool:
        calls.append(i)
        return i in readable

    return probe


# -- full attention: the readable prefix ---------------------------------------------


@pytest.mark.parametrize(("readable", "start", "end", "expected"), [
    (range(6), 0, 6, 6),  # all hit
    ((), 0, 6, 0),  # all miss
    ((0, 1, 2, 4, 5), 0, 6, 3),  # stops at the first miss
    ((1, 2, 3), 0, 4, 0),  # a miss first: nothing, even though later blocks hit
    ((0, 1), 3, 3, 3),  # empty range
    ((2, 3, 4), 2, 6, 5),  # starts after the device's prefix: blocks 0-1 never consulted
])
def test_prefix_end(readable: tuple[int, ...], start: int, end: int, expected: int) -> None:
    assert prefix_end(hits(*readable), start, end) == expected


# -- sliding window: the rightmost run of W ------------------------------------------


@pytest.mark.parametrize(("readable", "start", "end", "w", "expected"), [
    (range(8), 0, 8, 2, 8),  # window at the end
    ((2, 3, 4), 0, 8, 2, 5),  # window in the middle
    ((0, 1, 5, 6), 0, 8, 2, 7),  # two windows: the rightmost wins
    ((0, 1, 3, 5, 7), 0, 8, 2, 2),  # single hits (gaps) never form a window; 0-1 does
    ((1, 2, 4, 5, 6), 0, 8, 3, 7),  # a gap at 3 resets the run; 4-6 is a window of 3
    ((), 0, 8, 2, 0),  # nothing
    ((6, 7), 6, 8, 4, 8),  # fewer than W blocks past the device: the leading run counts
    ((6,), 6, 8, 4, 7),  # ... even a shorter one
    ((7,), 6, 8, 4, 6),  # but it must touch the device's prefix: 6 missing -> nothing
    ((3, 4, 5, 6), 0, 7, 4, 7),  # exactly W at the end
    ((0, 1, 2), 0, 7, 4, 3),  # no run of W: the leading run from block 0
])
def test_window_end(readable: tuple[int, ...], start: int, end: int, w: int,
                    expected: int) -> None:
    assert window_end(hits(*readable), start, end, w, 1) == expected


def test_window_end_only_takes_aligned_ends() -> None:
    # Step 2: only even ends count. Blocks 2-4 readable: ends 5 and 4 both have a window
    # of 1, but 5 is not aligned, so the answer is 4.
    assert window_end(hits(2, 3, 4), 0, 6, 1, 2) == 4
    # The end block itself is rounded down to the step first.
    assert window_end(hits(*range(7)), 0, 7, 2, 2) == 6
    # A Mamba state (W=1) between aligned points is useless: only block 3 (end 4) counts.
    assert window_end(hits(3, 4), 0, 6, 1, 2) == 4
    assert window_end(hits(4), 0, 6, 1, 2) == 0


def test_window_end_scans_from_the_right_and_skips_past_a_miss() -> None:
    # The cost is about the distance to the answer plus one window, not the whole range.
    calls: list[int] = []
    assert window_end(counting(range(90, 100), calls), 0, 100, 4, 1) == 100
    assert calls == [99, 98, 97, 96]
    calls.clear()
    # A miss at 97 makes every end in (97, 101] impossible: the next candidate is 97.
    assert window_end(counting((*range(90, 97), 98, 99), calls), 0, 100, 4, 1) == 97
    assert calls == [99, 98, 97, 96, 95, 94, 93]


# -- the fixpoint ---------------------------------------------------------------------


def views(config_groups: tuple[ResolvedGroup, ...], num_keys: int,
          readable: dict[int, BlockReadable]) -> list[GroupView]:
    return [GroupView(g, num_keys, readable[g.index]) for g in lookup_order(config_groups)]


def test_fixpoint_rechecks_a_larger_window_after_a_smaller_one_shrinks_the_hit() -> None:
    # Full attention, window A of 3 blocks, window B of 1 block (bs 4, 10 blocks).
    # Round 1: full -> 10, A -> 10 (blocks 7-9), B -> 6 (block 5 is its rightmost hit).
    # Round 2: A at 6 needs 3-5 but 3 is missing -> 3 (blocks 0-2); B at 3 has block 2.
    # Without re-checking A the answer would be 6, where A has no valid window.
    config = make_config(full(), window(12, name="a"), window(4, name="b"))
    readable = {0: hits(*range(10)), 1: hits(0, 1, 2, 4, 5, 7, 8, 9), 2: hits(2, 5)}
    assert combined_hit_end(views(config.resolved, 10, readable), 0, 40, 4) == 12


def test_fixpoint_full_attention_caps_windows_and_key_count_caps_all() -> None:
    config = make_config(full(), window(8))
    # Full attention has only blocks 0-4: the window (readable to 9) must end by 5.
    readable = {0: hits(*range(5)), 1: hits(*range(10))}
    assert combined_hit_end(views(config.resolved, 10, readable), 0, 40, 4) == 20
    # Fewer keys than max_end covers: the hit ends at the last key.
    readable = {0: hits(*range(10)), 1: hits(*range(10))}
    assert combined_hit_end(views(config.resolved, 6, readable), 0, 40, 4) == 24


def test_fixpoint_returns_num_computed_when_nothing_extends_the_device_prefix() -> None:
    config = make_config(full(), mamba())
    readable = {0: hits(*range(10)), 1: hits()}  # no Mamba state anywhere
    assert combined_hit_end(views(config.resolved, 10, readable), 8, 40, 4) == 8
    # max_end at or below the device's prefix: nothing to look up.
    readable = {0: hits(*range(10)), 1: hits(*range(10))}
    assert combined_hit_end(views(config.resolved, 10, readable), 8, 8, 4) == 8


def test_fixpoint_aligns_the_end_for_every_group() -> None:
    # Block sizes 12 and 16 (hash 4): only multiples of 48 are valid ends.
    config = make_config(full(12, "a"), full(16, "b"))
    assert config.hit_alignment == 48
    a, b = config.resolved
    everything = hits(*range(10))
    got = combined_hit_end([GroupView(a, 8, everything), GroupView(b, 6, everything)],
                           0, 95, 48)
    assert got == 48  # 95 rounds down to 48, though both groups could go further alone
    # Group b missing its 3rd block (tokens 32-48): 36 (a) and 32 (b) are not aligned.
    got = combined_hit_end([GroupView(a, 8, everything), GroupView(b, 6, hits(0, 1))],
                           0, 95, 48)
    assert got == 0


def test_lookup_order_full_first_then_windows_largest_first() -> None:
    config = make_config(mamba(name="m"), window(8, name="small"), full(name="f"),
                         window(64, name="big"), window(12, block_size=12, name="mid"),
                         hash_block_size=4)
    names = [g.spec.name for g in lookup_order(config.resolved)]
    # Window size compared in tokens: big 64, mid 12 (one block of 12), small 8, mamba 4.
    assert names == ["f", "big", "mid", "small", "m"]
