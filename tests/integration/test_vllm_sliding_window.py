"""End to end on a real vLLM engine: sliding window + full attention (tiny Gemma 3 text).

vLLM keeps two KV-cache groups: layers with a 32-token window, and full-attention
layers. A hit needs every full-attention block before it but only the window before it
from the sliding group, and the connector stores and loads each group by its own rule.
The engine runs once with ``block_size_factor`` 1 and once with 2 (offloaded blocks of 64
tokens, so the first loaded window block straddles the window's edge).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

SLIDING, FULL = 0, 1


@pytest.fixture(scope="module", params=[1, 2], ids=["factor1", "factor2"])
def eng(request: pytest.FixtureRequest, tiny_model: Callable[[str], Path]) -> Iterator[Any]:
    from integration.vllm_kit import engine

    with engine(tiny_model("gemma3"), extra={"block_size_factor": request.param}) as e:
        e.extra["factor"] = request.param
        yield e


@pytest.fixture(autouse=True)
def idle_after(eng: Any) -> Iterator[None]:
    yield
    eng.assert_idle()


def test_groups_are_translated_by_kind(eng: Any) -> None:
    groups = eng.scheduler.config.resolved
    assert [g.kind.value for g in groups] == ["sliding_window", "full_attention"]
    assert groups[SLIDING].spec.sliding_window == 32
    assert groups[SLIDING].window_blocks == 1


def test_second_round_hits_and_outputs_are_identical(eng: Any) -> None:
    from integration.vllm_kit import random_prompts, roundtrip

    alignment = 32 * eng.extra["factor"]
    prompts = random_prompts([65, 100, 129, 200, 257], seed=11)
    stats = eng.scheduler.planner.stats
    loaded_before = dict(stats.blocks_loaded)
    roundtrip(eng, prompts, alignment, windowed=True)
    sliding_loaded = stats.blocks_loaded.get(SLIDING, 0) - loaded_before.get(SLIDING, 0)
    full_loaded = stats.blocks_loaded.get(FULL, 0) - loaded_before.get(FULL, 0)
    # Only the window before each hit comes back for the sliding group.
    assert 0 < sliding_loaded <= len(prompts) * 2
    assert full_loaded > sliding_loaded


@pytest.mark.parametrize("groups", [{SLIDING}, {FULL}], ids=["sliding", "full"])
def test_corrupting_one_group_changes_the_output(eng: Any, groups: set[int]) -> None:
    from integration.vllm_kit import corrupted_roundtrip_changes_output, random_prompts

    seed = 12 + min(groups) + 10 * eng.extra["factor"]
    prompts = random_prompts([150, 190, 230], seed=seed)
    changed = corrupted_roundtrip_changes_output(eng, prompts, groups)
    assert all(changed), changed


def test_many_concurrent_requests_share_one_prefix(eng: Any) -> None:
    from integration.vllm_kit import shared_prefix_outputs_match

    shared_prefix_outputs_match(eng, 130, [170 + 5 * i for i in range(12)], seed=14,
                                min_cached=128)


def test_preempted_requests_resume_with_identical_outputs(eng: Any) -> None:
    from integration.vllm_kit import preempted_outputs_match

    preempted_outputs_match(eng, [140, 170, 200, 230], seed=41)


def test_follow_up_turn_hits_blocks_completed_by_generated_tokens(eng: Any) -> None:
    from integration.vllm_kit import follow_up_uses_blocks_stored_during_decode

    follow_up_uses_blocks_stored_during_decode(eng, prompt_len=100, generated=40, suffix_len=20,
                                               alignment=32 * eng.extra["factor"], seed=51)
