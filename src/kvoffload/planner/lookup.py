"""Per-group hit rules and the fixpoint that combines them (``docs/architecture.md``, rule 5).

Pure functions over lookup results, so they are tested without a tier.

A *hit end* is a token position ``e``: the request can skip computing tokens ``[0, e)``.
For one group, with offloaded blocks of ``obs`` tokens and ``hit[i]`` telling whether
offloaded block ``i`` (tokens ``[i*obs, (i+1)*obs)``) is readable:

* full attention accepts ``e`` when every block from the first one not on the device up to
  ``e`` is readable;
* a window group of ``W`` blocks accepts ``e`` when the ``W`` blocks before ``e`` are
  readable, or, when fewer than ``W`` blocks lie between the device's prefix and ``e``, all
  of those (the device already holds the rest of the window);
* a Mamba group is a window of one block: the state right at ``e``.

Every accepted end is a multiple of the combined alignment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.config import ResolvedGroup

BlockReadable = Callable[[int], bool]
"""``readable(i)``: whether offloaded block ``i`` of a group can be read now."""


def prefix_end(readable: BlockReadable, start_block: int, end_block: int) -> int:
    """Index one past the last block of the readable run starting at ``start_block``.

    Scans ``[start_block, end_block)`` left to right and stops at the first unreadable block.
    """
    i = start_block
    while i < end_block and readable(i):
        i += 1
    return i


def window_end(readable: BlockReadable, start_block: int, end_block: int, window: int,
               step: int) -> int:
    """The rightmost acceptable end block index for a window group, or ``start_block``.

    Candidate ends are multiples of ``step`` (the alignment in this group's blocks) in
    ``(start_block, end_block]``. An end ``e`` is acceptable when blocks
    ``[max(start_block, e - window), e)`` are all readable. Scans right to left, so the
    cost is proportional to the distance from ``end_block`` to the answer plus one window.
    """
    e = end_block - end_block % step
    while e > start_block:
        need_from = max(start_block, e - window)
        # Walk back from e-1 until a miss or the window is covered.
        i = e - 1
        while i >= need_from and readable(i):
            i -= 1
        if i < need_from:
            return e
        # Block i is a miss: no acceptable end can include it in its window.
        # The next candidate must satisfy e' - 1 < i, i.e. e' <= i.
        e = i - i % step
    return start_block


@dataclass(frozen=True)
class GroupView:
    """One group's inputs to the fixpoint."""

    group: ResolvedGroup
    num_keys: int
    readable: BlockReadable


def combined_hit_end(views: Sequence[GroupView], num_computed: int, max_end: int,
                     alignment: int) -> int:
    """Largest hit end in tokens that every group accepts, or ``num_computed`` if none.

    ``views`` must list full-attention groups first, then window groups by window size,
    largest first (the order only affects speed: a group can only lower the end, and
    the loop re-checks every group until no group lowers it).
    """
    end = max_end - max_end % alignment
    while True:
        before = end
        for view in views:
            g = view.group
            obs = g.offloaded_block_size
            end = min(end, view.num_keys * obs)
            end -= end % alignment
            if end <= num_computed:
                return num_computed
            start_block = num_computed // obs
            end_block = end // obs
            if g.window_blocks is None:
                found = prefix_end(view.readable, start_block, end_block) * obs
                found -= found % alignment
            else:
                step = alignment // obs
                found = window_end(view.readable, start_block, end_block, g.window_blocks,
                                   step) * obs
            end = min(end, found)
            if end <= num_computed:
                return num_computed
        if end == before:
            return end


def lookup_order(groups: Sequence[ResolvedGroup]) -> list[ResolvedGroup]:
    """Full-attention groups first, then window groups by window size in tokens, largest
    first (``KindRules.lookup_rank``, over offloaded blocks)."""
    return sorted(groups, key=lambda g: g.rules.lookup_rank(g.spec, g.offloaded_block_size))
