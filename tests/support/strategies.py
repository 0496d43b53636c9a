"""Hypothesis strategies shared by the stateful tests: random group layouts."""

from __future__ import annotations

from hypothesis import strategies as st

from kvoffload.config import GroupKind, GroupSpec


def draw_groups(draw: st.DrawFn, *, max_factor: int,
                page_bytes: bool = False) -> tuple[int, int, tuple[GroupSpec, ...]]:
    """``(hash_block_size, block_size_factor, groups)``: 1-4 groups of any kind, block
    sizes 1-2 hash blocks, windows up to three offloaded blocks, and (``page_bytes``)
    page sizes of 1-6 bytes that differ between groups."""
    hash_bs = draw(st.sampled_from([1, 2, 4]))
    factor = draw(st.integers(1, max_factor))
    groups = []
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(list(GroupKind)))
        bs = hash_bs * draw(st.sampled_from([1, 2]))
        window = draw(st.integers(1, 3 * bs * factor)) if kind is GroupKind.SLIDING_WINDOW \
            else None
        page = draw(st.integers(1, 6)) if page_bytes else 0
        groups.append(GroupSpec(kind, bs, sliding_window=window, name=f"g{i}",
                                page_bytes=page))
    return hash_bs, factor, tuple(groups)
