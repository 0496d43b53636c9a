"""OffloadConfig and GroupSpec: validation messages and derived numbers.

Every invalid value raises ``ConfigError`` naming the field and saying what to change
(docs/architecture.md: what the engine cannot honour is refused at start-up).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.offload import build_offload

FA = GroupKind.FULL_ATTENTION
SW = GroupKind.SLIDING_WINDOW
MB = GroupKind.MAMBA


def cfg(*groups: GroupSpec, **kwargs: int | str) -> OffloadConfig:
    base: dict[str, object] = {"hash_block_size": 16, "host_capacity_bytes": 1 << 20}
    base.update(kwargs)
    return OffloadConfig(groups=groups, **base)  # type: ignore[arg-type]


FULL16 = GroupSpec(FA, 16, num_layers=2, page_bytes=64)

CASES: list[tuple[str, Callable[[], object], str, str]] = [
    ("block_size", lambda: GroupSpec(FA, 0), "groups[full_attention].block_size",
     "engine's block size"),
    ("window missing", lambda: GroupSpec(SW, 16), "groups[sliding_window].sliding_window",
     "attention window"),
    ("window zero", lambda: GroupSpec(SW, 16, sliding_window=0, name="swa"),
     "groups[swa].sliding_window", "attention window"),
    ("window on full", lambda: GroupSpec(FA, 16, sliding_window=128),
     "groups[full_attention].sliding_window", "Only sliding_window groups take a window"),
    ("num_layers", lambda: GroupSpec(FA, 16, num_layers=0), "groups[full_attention].num_layers",
     "Count the layers"),
    ("page_bytes", lambda: GroupSpec(FA, 16, page_bytes=-1), "groups[full_attention].page_bytes",
     "bytes of one block"),
    ("alignment on window", lambda: GroupSpec(SW, 16, sliding_window=8, state_alignment=32),
     "groups[sliding_window].state_alignment", "Only Mamba groups"),
    ("alignment not a multiple", lambda: GroupSpec(MB, 16, state_alignment=24),
     "groups[mamba].state_alignment", "checkpoint interval"),
    ("no groups", cfg, "groups", "at least one group"),
    ("hash_block_size", lambda: cfg(FULL16, hash_block_size=0), "hash_block_size",
     "prefix-hash block size"),
    ("block_size_factor", lambda: cfg(FULL16, block_size_factor=0), "block_size_factor",
     "Use 1"),
    ("num_workers", lambda: cfg(FULL16, num_workers=0), "num_workers", "tensor-parallel size"),
    # Issue 40: generous caps, so a typo (1e9) is refused instead of run.
    ("block_size_factor cap", lambda: cfg(FULL16, block_size_factor=10**9),
     "block_size_factor", "Use 1"),
    ("block_size_factor float", lambda: cfg(FULL16, block_size_factor=2.0),
     "block_size_factor", "Use 1"),
    ("num_workers cap", lambda: cfg(FULL16, num_workers=10**6), "num_workers",
     "tensor-parallel size"),
    ("max_deferred_steps cap", lambda: cfg(FULL16, max_deferred_steps=10**12),
     "max_deferred_steps", "Bound how many steps"),
    ("max_deferred_steps", lambda: cfg(FULL16, max_deferred_steps=0), "max_deferred_steps",
     "Bound how many steps"),
    ("min_deferral_s", lambda: cfg(FULL16, min_deferral_s=61), "min_deferral_s",
     "bound by steps only"),
    ("capacity", lambda: cfg(FULL16, host_capacity_bytes=127), "host_capacity_bytes",
     "at least 128 bytes"),
    # A group finer than the hash unit would get a hash factor of 0 (a bug vLLM fixed in #55038).
    ("finer than hash", lambda: cfg(FULL16, GroupSpec(SW, 8, sliding_window=32)),
     "groups[1].block_size", "Lower hash_block_size"),
    ("not a multiple of hash", lambda: cfg(GroupSpec(FA, 24)), "groups[0].block_size",
     "common divisor"),
]


@pytest.mark.parametrize(("make", "field", "fix"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_invalid_values_name_the_field_and_the_fix(make: Callable[[], object], field: str,
                                                   fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        make()
    assert info.value.field == field
    assert fix in info.value.fix
    assert str(info.value).startswith(f"{field}: ")
    assert isinstance(info.value, ValueError)  # callers catching ValueError still work


def test_unknown_eviction_policy_is_rejected_when_the_offload_is_built() -> None:
    # One registry (kvoffload.policies) answers for the tier and the planner alike, read
    # once where both are built (kvoffload.offload), before either exists.
    with pytest.raises(ConfigError) as info:
        build_offload(cfg(FULL16, eviction_policy="fifo"))
    assert info.value.field == "eviction_policy"
    assert "'lru'" in info.value.fix and "'arc'" in info.value.fix


def test_derived_numbers_of_a_hybrid_layout() -> None:
    config = cfg(
        GroupSpec(FA, 16, num_layers=2, page_bytes=64, name="full"),
        GroupSpec(SW, 16, sliding_window=100, num_layers=5, page_bytes=64, name="swa"),
        GroupSpec(MB, 16, num_layers=1, page_bytes=1000, state_alignment=64, name="ssm"),
        hash_block_size=16, block_size_factor=2, host_capacity_bytes=10_000,
    )
    full_g, swa, ssm = config.resolved
    assert [g.index for g in config.resolved] == [0, 1, 2]
    assert (full_g.factor, full_g.offloaded_block_size, full_g.hashes_per_block) == (2, 32, 2)
    assert full_g.window_blocks is None and not full_g.is_windowed
    assert swa.window_blocks == 4  # ceil(100 / 32)
    assert ssm.window_blocks == 1  # one state
    assert ssm.alignment == 64  # lcm(32, 64)
    assert [g.block_bytes for g in config.resolved] == [256, 640, 2000]
    assert config.slot_bytes == 2000  # the largest block of any group
    assert config.num_host_slots == 5
    assert config.hit_alignment == 64
    assert config.has_windowed_group
    assert not cfg(FULL16).has_windowed_group


def test_mixed_block_sizes_align_hits_to_their_lcm() -> None:
    config = cfg(GroupSpec(FA, 12), GroupSpec(FA, 16), hash_block_size=4,
                 host_capacity_bytes=8)
    assert [g.hashes_per_block for g in config.resolved] == [3, 4]
    assert config.hit_alignment == 48
    # No page sizes: capacity counts blocks directly (accounting-only layouts).
    assert config.slot_bytes == 0 and config.num_host_slots == 8
