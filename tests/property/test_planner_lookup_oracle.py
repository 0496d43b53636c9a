"""The planner's lookup and load plan against a brute-force oracle (docs/architecture.md, rule 5).

For a random hybrid layout, a random request and a random set of readable (and of
being-written) offloaded blocks per group, the oracle tries every candidate end ``t`` and
keeps the largest one every group accepts, straight from the rule's wording:

* ``t`` is a multiple of every group's alignment, above the device's prefix, at most
  ``num_tokens - 1`` when a window or Mamba group exists (else ``num_tokens``), and within
  the keys the request has;
* full attention: every offloaded block from the first one not on the device up to ``t``
  is readable; a window group: the ``W`` blocks before ``t`` (or those past the device's
  prefix, if fewer); Mamba: the block right before ``t``.

The planner must answer exactly that (or defer, only when counting the blocks being written
as readable would give more). When it answers with a hit, the load it plans must fill
exactly the engine positions the hit needs -- all of them for full attention, those
covering the window's tokens, the one Mamba state -- from the slot and sub-block that hold
each position's key.
"""

from __future__ import annotations

import math

from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig, ResolvedGroup
from kvoffload.jobs import StepPlan
from kvoffload.keys import BlockHash, BlockHasher, OffloadKey, make_offload_key
from kvoffload.planner.contract import StepInput
from support.offload_kit import host_tier, planner_for


class Req:
    def __init__(self, tokens: list[int], hasher: BlockHasher) -> None:
        self.request_id = "r"
        self.tokens = tokens
        self.num_prompt_tokens = len(tokens)
        self.block_hashes: list[BlockHash] = hasher.hashes(tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@st.composite
def layouts(draw: st.DrawFn) -> OffloadConfig:
    hash_bs = draw(st.sampled_from([1, 2, 4]))
    factor = draw(st.integers(1, 3))
    groups = []
    for i in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(list(GroupKind)))
        bs = hash_bs * draw(st.sampled_from([1, 2, 3]))
        sw = draw(st.integers(1, 3 * bs * factor)) if kind is GroupKind.SLIDING_WINDOW else None
        align = None
        if kind is GroupKind.MAMBA and draw(st.booleans()):
            align = bs * draw(st.sampled_from([1, 2, 4]))
        # A draft model's layers: keyed, stored and hit up to two offloaded blocks late.
        proof = draw(st.sampled_from([0, 0, 1, bs * factor, 2 * bs * factor])) \
            if kind is GroupKind.FULL_ATTENTION else 0
        groups.append(GroupSpec(kind, bs, sliding_window=sw, state_alignment=align,
                                proof_tokens=proof, name=f"g{i}"))
    return OffloadConfig(groups=tuple(groups), hash_block_size=hash_bs,
                         block_size_factor=factor, host_capacity_bytes=100_000,
                         max_deferred_steps=100, eviction_policy="lru")


def accepts(g: ResolvedGroup, ok: set[int], t: int, num_computed: int, num_keys: int) -> bool:
    obs = g.offloaded_block_size
    if t > num_keys * obs:
        return False
    end, start = t // obs, num_computed // obs
    first = start if g.window_blocks is None else max(start, end - g.window_blocks)
    return all(i in ok for i in range(first, end))


def oracle(config: OffloadConfig, readable: list[set[int]], num_keys: list[int],
           num_computed: int, num_tokens: int) -> int:
    cap = num_tokens - (1 if config.has_windowed_group else 0)
    step = math.lcm(*(g.alignment for g in config.resolved))
    best = num_computed
    for t in range(step, cap + 1, step):
        if t > num_computed and all(accepts(g, readable[g.index], t, num_computed,
                                            num_keys[g.index]) for g in config.resolved):
            best = t
    return best


def needed_positions(g: ResolvedGroup, num_computed: int, end: int) -> list[int]:
    bs = g.spec.block_size
    if g.kind is GroupKind.MAMBA:
        return [end // bs - 1]
    first_token = num_computed
    if g.kind is GroupKind.SLIDING_WINDOW:
        assert g.spec.sliding_window is not None
        first_token = max(num_computed, end - g.spec.sliding_window)
    return sorted({t // bs for t in range(first_token, end)})


@settings(max_examples=300, deadline=None)
@given(config=layouts(), data=st.data())
def test_lookup_and_load_match_the_oracle(config: OffloadConfig, data: st.DataObject) -> None:
    tier = host_tier(config)
    planner = planner_for(config, tier)
    hasher = BlockHasher(config.hash_block_size, seed="oracle")
    num_tokens = data.draw(st.integers(1, 120), label="num_tokens")
    req = Req(list(range(num_tokens)), hasher)
    engine_step = math.lcm(*(g.spec.block_size for g in config.resolved))
    num_computed = data.draw(st.one_of(st.just(0), st.integers(0, num_tokens // engine_step)),
                             label="device blocks") * engine_step

    groups = config.resolved
    keys: list[list[OffloadKey]] = []
    readable: list[set[int]] = []
    pending: list[set[int]] = []
    for g in groups:
        hpb, obs = g.hashes_per_block, g.offloaded_block_size
        lag = -(-g.spec.proof_tokens // obs)  # block k is keyed by the hash of block k + lag
        n = max(0, len(req.block_hashes) // hpb - lag)
        keys.append([make_offload_key(req.block_hashes[(k + 1 + lag) * hpb - 1], g.index)
                     for k in range(n)])
        marks = data.draw(st.lists(st.sampled_from("hhhhhhhhmp"), min_size=n, max_size=n),
                          label=f"blocks of group {g.index}")
        readable.append({k for k, m in enumerate(marks) if m == "h"})
        pending.append({k for k, m in enumerate(marks) if m == "p"})
    for g in groups:
        ready = tier.prepare_store([keys[g.index][k] for k in sorted(readable[g.index])])
        assert ready is not None
        tier.complete_store(ready.keys_to_store)
        assert tier.prepare_store([keys[g.index][k] for k in sorted(pending[g.index])])

    num_keys = [len(k) for k in keys]
    now = oracle(config, readable, num_keys, num_computed, num_tokens)
    later = oracle(config, [r | p for r, p in zip(readable, pending, strict=True)], num_keys,
                   num_computed, num_tokens)
    result = planner.get_num_new_matched_tokens(req, num_computed)
    if result.num_tokens is None:
        event("deferred")
        assert later > now, "deferred although waiting cannot give more"
        return
    assert later == now, "answered although a block being written would extend the hit"
    assert result.num_tokens == now - num_computed
    assert result.load_async == (result.num_tokens > 0)
    if not result.num_tokens:
        event("no hit")
        return
    event("hit")

    # Every engine position gets a distinct real block: the plan alone must pick.
    tables = []
    next_id = 1
    for g in groups:
        n = -(-num_tokens // g.spec.block_size)
        tables.append(list(range(next_id, next_id + n)))
        next_id += n
    planner.update_state_after_alloc(req, tables, result.num_tokens)
    plan: StepPlan = planner.build_step_plan(StepInput())
    assert len(plan.loads) == 1
    by_slot = {tier.slot_of(k): k for k in tier}
    moved: dict[int, list[int]] = {}
    for t in plan.loads[0].groups:
        g = groups[t.group]
        t.validate(g.factor)
        for block_id, slot, sub in t.pairs(g.factor):
            position = tables[t.group].index(block_id)
            moved.setdefault(t.group, []).append(position)
            assert by_slot[slot] == keys[t.group][position // g.factor]
            assert sub == position % g.factor
    for g in groups:
        assert moved.get(g.index, []) == needed_positions(g, num_computed, now)
    planner.check_integrity()
