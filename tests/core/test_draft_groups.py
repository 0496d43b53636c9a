"""A draft model's layers (speculative decoding): blocks keyed, stored and hit late.

A draft layer's KV at a position is computed from the token after it, and rewritten once
the speculated tokens after it are verified (``GroupSpec.proof_tokens``). Its offloaded
block ``b`` is keyed by the hash at the end of block ``b + lag`` (``key_lag_blocks``), so a
block is stored only once the tokens it depends on are computed, and hit only by a request
whose prompt shares them. The stories use a full-attention group and a draft group, 4-token
blocks, a proof of one token (one block of lag).
"""

from __future__ import annotations

import pytest
from planner_kit import Harness, Req, full, make_config, prompt

from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey, make_offload_key

DRAFT = 1
"""The draft group's index in the stories."""


def draft(block_size: int = 4, proof: int = 1) -> GroupSpec:
    return GroupSpec(GroupKind.FULL_ATTENTION, block_size, proof_tokens=proof, name="draft")


def draft_key(h: Harness, req: Req, k: int) -> OffloadKey:
    """The draft group's key of offloaded block ``k``: the hash one block further."""
    return make_offload_key(req.block_hashes[k + 1], DRAFT)


def stored_draft_blocks(h: Harness, req: Req) -> list[int]:
    return [k for k in range(len(req.block_hashes) - 1)
            if draft_key(h, req, k) in h.tier]


def test_the_lag_covers_the_proof_tokens() -> None:
    def lag(proof: int, factor: int = 1) -> int:
        config = OffloadConfig((full(), draft(proof=proof)), 4, 1000, block_size_factor=factor)
        return config.resolved[DRAFT].key_lag_blocks

    assert [lag(0), lag(1), lag(4), lag(5), lag(5, factor=2)] == [0, 1, 1, 2, 1]
    assert make_config(full()).resolved[0].key_lag_blocks == 0


@pytest.mark.parametrize(("spec", "problem"), [
    (lambda: GroupSpec(GroupKind.FULL_ATTENTION, 4, proof_tokens=-1), "must be >= 0"),
    (lambda: GroupSpec(GroupKind.SLIDING_WINDOW, 4, sliding_window=8, proof_tokens=2),
     "is set on a sliding_window group"),
    (lambda: GroupSpec(GroupKind.MAMBA, 4, proof_tokens=2), "is set on a mamba group"),
])
def test_proof_tokens_belong_to_full_attention_groups(spec, problem: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConfigError, match=problem) as info:
        spec()
    assert info.value.field.endswith(".proof_tokens")


def test_a_draft_block_is_stored_once_the_token_after_it_is_computed() -> None:
    h = Harness(make_config(full(), draft()))
    a = h.request("a", prompt(12))
    table = ((1, 2, 3, 4, 5), (11, 12, 13, 14, 15))
    h.admit(a, table)
    plan = h.step(h.sched(a, table, 0, 12))
    (job,) = plan.stores
    moved = {t.group: t.block_ids for t in job.groups}
    assert moved == {0: (1, 2, 3), DRAFT: (11, 12)}  # its block 2 waits for token 12
    h.complete(job.job_id)
    assert stored_draft_blocks(h, a) == [0, 1]
    a.append(*prompt(4, base=5000))  # decode reaches 16 tokens: block 3 of the target
    plan = h.step(h.sched(a, ((), ()), 12, 4))
    (job,) = plan.stores
    assert {t.group: t.block_ids for t in job.groups} == {0: (4,), DRAFT: (13,)}
    h.complete(job.job_id)
    assert stored_draft_blocks(h, a) == [0, 1, 2]
    h.planner.request_finished(a)
    assert h.drained()


def test_a_hit_never_reaches_past_what_the_draft_blocks_prove() -> None:
    h = Harness(make_config(full(), draft()))
    a = h.request("a", prompt(16))
    table = ((1, 2, 3, 4), (11, 12, 13, 14))
    h.admit(a, table)
    (job,) = h.step(h.sched(a, table, 0, 16)).stores
    h.complete(job.job_id)
    h.planner.request_finished(a)
    # The same 16 tokens and more: the target holds 4 blocks, the draft group 3 (its last
    # block would need token 16 of a, which a never computed): the hit is 12 tokens.
    same = h.request("same", [*prompt(16), 7, 7])
    assert h.lookup(same).num_tokens == 12
    h.alloc(same, ((21, 22, 23, 24, 25), (31, 32, 33, 34, 35)), 0)
    # A prompt that shares a's first 8 tokens but not token 8: the draft KV a stored at
    # position 7 was computed from a's token 8, so the draft group proves one block only.
    other = h.request("other", [*prompt(8), 9, 9, 9, 9, 9])
    assert h.lookup(other).num_tokens == 4
    # The target's block 1 is the same for both; the draft group's block 1 is keyed by
    # tokens 0..11, which other does not share (keyed by tokens 0..7 alone, it would hit).
    assert make_offload_key(other.block_hashes[1], 0) in h.tier
    assert draft_key(h, other, 1) not in h.tier and draft_key(h, a, 1) in h.tier
