"""Host-tier events as vLLM KV-cache events (for KV-aware routers).

Each ``TierEvent`` (keys that became readable, or left the tier) becomes one
``BlockStored`` / ``BlockRemoved`` per KV-cache group it touches, with ``medium="CPU"``
and the group's index, kind and window, so a router subscribed to vLLM's event stream
learns which prefixes this engine can serve from host memory. A key's block hash is the
hash vLLM itself computed for the prefix ending at that block (``Request.block_hashes``).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby

from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import BlockHash as VllmBlockHash
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvoffload.config import OffloadConfig
from kvoffload.keys import OffloadKey, key_block_hash, key_group
from kvoffload.tiers.base import TierEvent


def to_vllm_events(events: Iterable[TierEvent], config: OffloadConfig) -> list[KVCacheEvent]:
    """vLLM events for ``events``, in order, one per (event, group)."""
    out: list[KVCacheEvent] = []
    for event in events:
        for group, keys in groupby(sorted(event.keys, key=key_group), key=key_group):
            hashes = [maybe_convert_block_hash(VllmBlockHash(key_block_hash(OffloadKey(k))))
                      for k in keys]
            if event.removed:
                out.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU,
                                        group_idx=group))
                continue
            g = config.resolved[group]
            out.append(BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=[],
                block_size=g.offloaded_block_size, lora_id=None, medium=MEDIUM_CPU,
                lora_name=None, group_idx=group, kv_cache_spec_kind=g.kind.value,
                kv_cache_spec_sliding_window=g.spec.sliding_window))
    return out
