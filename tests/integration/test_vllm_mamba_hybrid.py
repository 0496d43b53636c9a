"""End to end on a real vLLM engine: a Mamba2 + attention hybrid (tiny Granite 4.0 hybrid).

vLLM keeps a Mamba group (one recurrent-state snapshot per 64-token block, in its
'align' prefix-caching mode) and a full-attention group. A hit at token t needs the
attention blocks before t and exactly the Mamba state at t; loading a state from another
position would silently corrupt the output, which the per-group negative controls show
the test would catch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

MAMBA, ATTENTION = 0, 1
MAMBA_BLOCK = 64  # vLLM sizes the Mamba block (and so every group's block) to 64 here


@pytest.fixture(scope="module")
def eng(tiny_model: Callable[[str], Path]) -> Iterator[Any]:
    from integration.vllm_kit import engine

    # The CPU Mamba2 kernel in align mode needs one Mamba block per prefill chunk.
    with engine(tiny_model("granite_hybrid"), max_num_batched_tokens=MAMBA_BLOCK) as e:
        yield e


@pytest.fixture(autouse=True)
def idle_after(eng: Any) -> Iterator[None]:
    yield
    eng.assert_idle()


def test_groups_are_translated_by_kind(eng: Any) -> None:
    groups = eng.scheduler.config.resolved
    assert [g.kind.value for g in groups] == ["mamba", "full_attention"]
    assert all(g.spec.block_size == MAMBA_BLOCK for g in groups)
    # Only the real state bytes move, not vLLM's padding of the Mamba page.
    assert groups[MAMBA].spec.page_bytes < groups[ATTENTION].spec.page_bytes


def test_second_round_hits_and_outputs_are_identical(eng: Any) -> None:
    from integration.vllm_kit import random_prompts, roundtrip

    prompts = random_prompts([65, 128, 129, 200, 300], seed=21)
    stats = eng.scheduler.planner.stats
    before = stats.blocks_loaded.get(MAMBA, 0)
    roundtrip(eng, prompts, MAMBA_BLOCK, windowed=True, max_tokens=12)
    # Exactly one state per request comes back for the Mamba group.
    assert stats.blocks_loaded.get(MAMBA, 0) - before == len(prompts)


@pytest.mark.parametrize("groups", [{MAMBA}, {ATTENTION}], ids=["mamba", "attention"])
def test_corrupting_one_group_changes_the_output(eng: Any, groups: set[int]) -> None:
    from integration.vllm_kit import corrupted_roundtrip_changes_output, random_prompts

    prompts = random_prompts([150, 190, 230], seed=22 + min(groups))
    changed = corrupted_roundtrip_changes_output(eng, prompts, groups)
    assert all(changed), changed


def test_many_concurrent_requests_share_one_prefix(eng: Any) -> None:
    from integration.vllm_kit import shared_prefix_outputs_match

    shared_prefix_outputs_match(eng, 140, [180 + 9 * i for i in range(10)], seed=24,
                                min_cached=128)


def test_preempted_requests_resume_with_identical_outputs(eng: Any) -> None:
    from integration.vllm_kit import preempted_outputs_match

    preempted_outputs_match(eng, [130, 170, 200, 260], seed=41)


def test_follow_up_turn_hits_blocks_completed_by_generated_tokens(eng: Any) -> None:
    from integration.vllm_kit import follow_up_uses_blocks_stored_during_decode

    follow_up_uses_blocks_stored_during_decode(eng, prompt_len=120, generated=16, suffix_len=20,
                                               alignment=MAMBA_BLOCK, seed=52)
