"""What a cached prefix is worth: prefill compute saved per byte held (``PrefixValuer``).

A hit at token ``t`` saves the prefill compute of tokens ``[0, t)`` in every layer, and it
needs, per group: every full-attention block before ``t``, the last ``W`` window blocks
before ``t``, and the one Mamba state at ``t``. The value density of that hit point is

    density(t) = prefill_flops(t, 0) / bytes_needed(t)

A prefix that was itself reached through a hit (a later turn of a conversation, a reused
document) is likely to be reached again: its saved compute is scaled by ``1 + reuse_bonus
* reuse``, where ``reuse`` is the share of the request's prompt that was already cached
when it arrived.

The planner hands the tier a ``ValueHint`` for every stored key, as one ``ValueRun`` per
group, with the density of the request's prefix (one density for all keys of a request,
so a value-aware policy still orders one prefix by recency and never prefers a deep
block over the blocks it depends on), and, for window blocks and Mamba states, the
full-attention key they depend on.

``prefill_flops(end, start)`` is the model's cost of prefilling tokens ``[start, end)``.
The simulator passes its preset's exact figure; without one, ``proxy_prefill_flops``
estimates it from the layout alone (a fixed per-layer cost per token plus attention over
each layer's span), which ranks prefixes the same way for a given model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.config import OffloadConfig, ResolvedGroup
from kvoffload.keys import OffloadKey
from kvoffload.tiers.eviction.base import ValueHint, ValueRun

PrefillFlops = Callable[[int, int], float]
"""``prefill_flops(end, start)``: FLOPs to prefill tokens ``[start, end)`` of a sequence."""

PROXY_TOKENS_PER_LAYER = 4096
"""The proxy's fixed per-token cost of one layer, in units of one attended token."""


def _span_sum(lo: int, hi: int, cap: int | None) -> int:
    """Sum of ``min(p, cap)`` for ``p`` in ``[lo, hi]`` (``cap`` None: no cap)."""
    if hi < lo:
        return 0
    if cap is None or hi <= cap:
        return (lo + hi) * (hi - lo + 1) // 2
    if lo > cap:
        return cap * (hi - lo + 1)
    return (lo + cap) * (cap - lo + 1) // 2 + cap * (hi - cap)


def proxy_prefill_flops(config: OffloadConfig) -> PrefillFlops:
    """An estimate of prefill compute from the group layout alone (relative units).

    Each layer costs ``PROXY_TOKENS_PER_LAYER`` plus its attended span per token: all
    earlier tokens for full attention, at most the window for sliding window, none for
    Mamba. Only ratios between prefixes of one model matter to the policy.
    """
    groups = [(g.spec.num_layers, g.rules.attention_cost, g.spec.sliding_window)
              for g in config.resolved]

    def flops(end: int, start: int = 0) -> float:
        if end <= start:
            return 0.0
        total = 0
        for layers, attends, window in groups:
            total += layers * PROXY_TOKENS_PER_LAYER * (end - start)
            if attends:
                total += layers * _span_sum(start + 1, end, window)
        return float(total)

    return flops


class PrefixValuer:
    """Builds ``ValueHint`` lists for one configuration (module docstring).

    Args:
        config: the offload configuration.
        prefill_flops: the model's prefill cost; ``proxy_prefill_flops`` if ``None``.
        reuse_bonus: how much a prefix reached through a hit is worth more (see above).
    """

    def __init__(self, config: OffloadConfig, prefill_flops: PrefillFlops | None = None,
                 reuse_bonus: float = 4.0) -> None:
        self.reuse_bonus = reuse_bonus
        self._groups = config.resolved
        self._flops = prefill_flops or proxy_prefill_flops(config)
        fulls = [g for g in self._groups if g.window_blocks is None]
        self._anchor_group: ResolvedGroup | None = fulls[0] if fulls else None

    def bytes_needed(self, t: int) -> int:
        """Bytes a hit at token ``t`` needs, all groups together."""
        total = 0
        for g in self._groups:
            blocks = t // g.offloaded_block_size
            if g.window_blocks is not None:
                blocks = min(blocks, g.window_blocks)
            total += blocks * g.block_bytes
        return total

    def density(self, t: int) -> float:
        """Compute saved per byte held by a hit at token ``t`` (0 when ``t`` holds nothing)."""
        nbytes = self.bytes_needed(t)
        return self._flops(t, 0) / nbytes if nbytes > 0 else 0.0

    def hints(self, t: int, keys_by_group: Sequence[Sequence[tuple[int, OffloadKey]]],
              group_keys: Sequence[Sequence[OffloadKey]], reuse: float = 0.0
              ) -> list[ValueHint]:
        """Hints for the given keys, all valued as the prefix ending at ``t`` reached with
        ``reuse`` of its prompt already cached.

        ``keys_by_group[g]`` lists (offloaded block index, key) of group ``g`` to describe;
        ``group_keys[g]`` is the request's whole key list of group ``g`` (to name anchors).
        """
        runs = self._runs(t, [[k for k, _ in entries] for entries in keys_by_group],
                          [[key for _, key in entries] for entries in keys_by_group],
                          group_keys, reuse)
        return [hint for run in runs for hint in run.hints()]

    def runs(self, t: int, blocks_by_group: Sequence[Sequence[int]],
             group_keys: Sequence[Sequence[OffloadKey]], reuse: float = 0.0
             ) -> list[ValueRun]:
        """``hints`` as one ``ValueRun`` per group (the same hints, in the same order,
        without an object per key): ``blocks_by_group[g]`` lists the offloaded blocks of
        group ``g`` to describe, whose keys are ``group_keys[g][k]``."""
        keys_by_group: list[Sequence[OffloadKey]] = []
        for blocks, keys in zip(blocks_by_group, group_keys, strict=True):
            if isinstance(blocks, range):
                keys_by_group.append(keys[blocks.start:blocks.stop:blocks.step])
            else:
                keys_by_group.append([keys[k] for k in blocks])
        return self._runs(t, blocks_by_group, keys_by_group, group_keys, reuse)

    def _runs(self, t: int, blocks_by_group: Sequence[Sequence[int]],
              keys_by_group: Sequence[Sequence[OffloadKey]],
              group_keys: Sequence[Sequence[OffloadKey]], reuse: float) -> list[ValueRun]:
        """One ``ValueRun`` per group with blocks (``blocks_by_group[g]``, whose keys are
        ``keys_by_group[g]``), valued as the prefix ending at ``t``."""
        nbytes = self.bytes_needed(t)
        if nbytes <= 0:
            return []
        saved = self._flops(t, 0) * (1.0 + self.reuse_bonus * reuse)
        anchor_group = self._anchor_group
        out: list[ValueRun] = []
        for g, blocks, keys in zip(self._groups, blocks_by_group, keys_by_group, strict=True):
            if not blocks:
                continue
            if g.window_blocks is None or anchor_group is None:
                out.append(ValueRun(keys, saved, nbytes))
                continue
            anchors = group_keys[anchor_group.index]
            obs, anchor_obs = g.offloaded_block_size, anchor_group.offloaded_block_size
            if obs == anchor_obs and min(blocks) >= 0 and max(blocks) < len(anchors):
                # Block ``k`` ends where anchor block ``k`` does: the loop below, no step
                # per block.
                out.append(ValueRun(keys, saved, nbytes, list(map(anchors.__getitem__,
                                                                   blocks))))
                continue
            links: list[OffloadKey | None] = []
            for k in blocks:
                end = (k + 1) * obs
                a = end // anchor_obs - 1
                links.append(anchors[a] if end % anchor_obs == 0 and 0 <= a < len(anchors)
                             else None)
            out.append(ValueRun(keys, saved, nbytes, links))
        return out
