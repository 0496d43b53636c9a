"""Registering engine caches: byte pages per segment, slot offsets, and clear refusals."""

from __future__ import annotations

import pytest
import torch
from worker_kit import (
    LAYOUTS,
    kv_fused_kv_first,
    kv_separate,
    make_config,
    mamba_raw_padded,
    mamba_states,
)

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import LayoutError
from kvoffload.worker import CacheLayout, CacheTensorLayout, GroupTensors, HostPool


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(7)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_every_layout_yields_pages_that_alias_the_engine_bytes(name: str) -> None:
    cache = LAYOUTS[name](12, _gen())
    config = make_config([cache])
    layout = CacheLayout.build(config, [cache.tensors(0)])
    group = layout.groups[0]
    assert group.num_blocks == 12
    assert group.page_bytes == cache.page_bytes * len(cache.layers)
    for block_id in (1, 5, 11):
        joined = torch.cat([seg.pages[block_id] for seg in group.segments])
        assert torch.equal(joined, cache.block(block_id))
    # The views alias: writing a page writes the engine tensor.
    group.segments[-1].pages[3].fill_(0x5A)
    assert bool((cache.block(3)[-group.segments[-1].page_bytes :] == 0x5A).all())


def test_segment_names_and_offsets_follow_registration_order() -> None:
    cache = kv_fused_kv_first(4, _gen(), layers=2)
    config = make_config([cache], factor=3)
    group = CacheLayout.build(config, [cache.tensors(0)]).groups[0]
    assert [s.name for s in group.segments] == ["swa0.k", "swa0.v", "swa1.k", "swa1.v"]
    half = cache.page_bytes // 2
    assert [s.host_offset for s in group.segments] == [0, 3 * half, 6 * half, 9 * half]
    assert group.host_offset(2, 1) == 6 * half + half
    assert group.block_bytes == config.resolved[0].block_bytes


def test_mamba_segments_keep_their_own_page_sizes() -> None:
    cache = mamba_states(4, _gen(), layers=1)
    group = CacheLayout.build(make_config([cache], factor=2), [cache.tensors(0)]).groups[0]
    assert [s.page_bytes for s in group.segments] == [240, 384]
    assert [s.host_offset for s in group.segments] == [0, 480]


def test_padded_raw_pages_keep_their_row_stride() -> None:
    cache = mamba_raw_padded(5, _gen(), layers=1, page_bytes=1000, padded_to=1536)
    seg = CacheLayout.build(make_config([cache]), [cache.tensors(0)]).groups[0].segments[0]
    assert (seg.page_bytes, seg.row_stride) == (1000, 1536)


def test_host_pool_addresses_pages_inside_slots() -> None:
    caches = [kv_separate(6, _gen(), layers=1), mamba_states(6, _gen(), layers=1)]
    config = make_config(caches, factor=2, num_slots=5)
    layout = CacheLayout.build(config, [c.tensors(g) for g, c in enumerate(caches)])
    pool = HostPool(layout, config.num_host_slots, pin=False)
    assert pool.arena.shape == (5, config.slot_bytes)
    assert not pool.pinned
    attn = layout.groups[0]
    k_page = attn.segments[0].page_bytes
    assert pool.page_offset(0, 1, 1) == 2 * k_page + k_page
    pool.page_view(3, 0, 1, 1).fill_(7)
    assert bool((pool.slot_view(3, 0)[3 * k_page : 4 * k_page] == 7).all())
    assert pool.slot_view(3, 1).numel() == layout.groups[1].block_bytes
    buffer = pool.slot_buffer(3, 1)  # the same bytes, as a writable buffer for I/O
    assert len(buffer) == layout.groups[1].block_bytes
    buffer[:4] = b"\x01\x02\x03\x04"
    assert pool.slot_view(3, 1)[:4].tolist() == [1, 2, 3, 4]
    with pytest.raises(IndexError, match="slot -1"):
        pool.slot_buffer(-1, 0)
    seg = pool.segment_view(1, 1)  # mamba ssm state pages
    assert seg.shape == (5, 2, 384)
    seg[4, 1].fill_(9)
    assert bool((pool.page_view(4, 1, 1, 1) == 9).all())
    with pytest.raises(IndexError):
        pool.slot_view(5, 0)
    with pytest.raises(KeyError, match="group 7"):
        pool.slot_view(0, 7)


def test_non_contiguous_blocks_are_refused_naming_layer_and_shape() -> None:
    base = torch.zeros(4, 10, 2, 8)  # (block_size, num_blocks, heads, head_dim)
    k = base.permute(1, 0, 2, 3)  # (num_blocks, block_size, ...) but tokens strided
    spec = GroupSpec(GroupKind.FULL_ATTENTION, 16, page_bytes=2 * 4 * 2 * 8 * 4)
    config = OffloadConfig(groups=(spec,), hash_block_size=16, host_capacity_bytes=1 << 20)
    with pytest.raises(LayoutError, match=r"layer 'L3\[0\]'.*\(10, 4, 2, 8\).*not contiguous"):
        CacheLayout.build(config, [GroupTensors(0, [("L3", (k, k.clone()))])])


def test_size_mismatch_names_the_group_and_the_numbers() -> None:
    cache = kv_separate(4, _gen(), layers=2)
    spec = GroupSpec(GroupKind.FULL_ATTENTION, 16, num_layers=2, page_bytes=cache.page_bytes * 2,
                     name="global")
    config = OffloadConfig(groups=(spec,), hash_block_size=16, host_capacity_bytes=1 << 24,
                           block_size_factor=2)
    msg = (r"group 0 \(global\): the registered tensors hold 512 bytes per engine block "
           r"\(4 page segments\), i.e. 1024 bytes .* page_bytes 512 x num_layers 2 x factor 2 "
           r"= 2048")
    with pytest.raises(LayoutError, match=msg):
        CacheLayout.build(config, [cache.tensors(0)])


def test_kv_first_needs_a_leading_two() -> None:
    t = torch.zeros(3, 8, 4, 2, 8)
    spec = GroupSpec(GroupKind.FULL_ATTENTION, 16, page_bytes=1024)
    config = OffloadConfig(groups=(spec,), hash_block_size=16, host_capacity_bytes=1 << 20)
    with pytest.raises(LayoutError, match=r"layer 'x': shape \(3, 8, 4, 2, 8\) is not \(2, num"):
        CacheLayout.build(config, [GroupTensors(0, [("x", t)], CacheTensorLayout.KV_FIRST)])


def test_group_registration_mistakes() -> None:
    a = kv_separate(4, _gen(), layers=1)
    b = mamba_states(4, _gen(), layers=1)
    config = make_config([a, b])
    with pytest.raises(LayoutError, match=r"groups \[1\]: no tensors registered"):
        CacheLayout.build(config, [a.tensors(0)])
    with pytest.raises(LayoutError, match="group 0: registered twice"):
        CacheLayout.build(config, [a.tensors(0), a.tensors(0), b.tensors(1)])
    with pytest.raises(LayoutError, match="group 5: not in the config"):
        CacheLayout.build(config, [a.tensors(5)])
    with pytest.raises(LayoutError, match="no layers given"):
        CacheLayout.build(config, [GroupTensors(0, []), b.tensors(1)])


def test_block_counts_must_agree_inside_a_group() -> None:
    k = torch.zeros(8, 4, 2, 8, dtype=torch.float16)
    v = torch.zeros(9, 4, 2, 8, dtype=torch.float16)
    spec = GroupSpec(GroupKind.FULL_ATTENTION, 16, page_bytes=256)
    config = OffloadConfig(groups=(spec,), hash_block_size=16, host_capacity_bytes=1 << 20)
    msg = r"disagree on the number of blocks \(a\[0\]: 8, a\[1\]: 9"
    with pytest.raises(LayoutError, match=msg):
        CacheLayout.build(config, [GroupTensors(0, [("a", (k, v))])])


@pytest.mark.parametrize(("tensor", "problem"), [
    (torch.zeros(0, 4), "no block dimension"),
    (torch.zeros(4, 0), "empty pages"),
    (torch.zeros(1, 16).expand(4, 16), "blocks overlap"),
])
def test_degenerate_tensors_are_refused(tensor: torch.Tensor, problem: str) -> None:
    spec = GroupSpec(GroupKind.MAMBA, 16, page_bytes=64)
    config = OffloadConfig(groups=(spec,), hash_block_size=16, host_capacity_bytes=1 << 20)
    with pytest.raises(LayoutError, match=problem):
        CacheLayout.build(config, [GroupTensors(0, [("m", tensor)])])
