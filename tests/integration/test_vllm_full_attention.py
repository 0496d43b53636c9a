"""End to end on a real vLLM engine: a full-attention model (tiny Llama), one engine.

Every test tells the same story: a first round computes prompts and the connector stores
their blocks in host memory; vLLM's own prefix cache is dropped; a second round must get
its prefix from the connector, and the greedy outputs must not change. The negative
controls corrupt or fail the loads, so the identity check is shown able to fail.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

ALIGN = 32  # vLLM block size used by the engine; hits are multiples of it


class CaptureEvents:
    """Stands in for vLLM's ZMQ event sink only: keeps the batches vLLM publishes."""

    def __init__(self) -> None:
        self.events: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        return


@pytest.fixture(scope="module")
def eng(tiny_model: Callable[[str], Path]) -> Iterator[Any]:
    from vllm.config import KVEventsConfig

    from integration.vllm_kit import engine

    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with engine(tiny_model("llama"), disable_log_stats=False, kv_events_config=events) as e:
        e.extra["events"] = sink = CaptureEvents()
        e.core.scheduler.kv_event_publisher = sink
        yield e


@pytest.fixture(autouse=True)
def clean_hooks(eng: Any) -> Iterator[None]:
    yield
    eng.worker.after_load = None
    eng.worker.worker.backend.fault_hook = None
    eng.assert_idle()


def test_second_round_hits_the_connector_and_outputs_are_identical(eng: Any) -> None:
    from integration.vllm_kit import expected_hit, random_prompts, verify_loads

    prompts = random_prompts([70, 100, 161, 200, 256], seed=1)
    first = eng.generate(prompts)
    assert all(r.num_cached_tokens == 0 for r in first)
    eng.reset_prefix_cache()
    checked = [0]
    eng.worker.after_load = verify_loads(lambda: eng.worker.worker.host_pool, checked)
    hits_before = eng.hit_tokens()
    second = eng.generate(prompts)
    for prompt, a, b in zip(prompts, first, second, strict=True):
        assert b.num_cached_tokens == expected_hit(len(prompt), ALIGN, windowed=False)
        assert b.tokens == a.tokens
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)
    assert eng.hit_tokens() - hits_before == sum(
        expected_hit(len(p), ALIGN, windowed=False) for p in prompts)
    assert checked[0] > 0  # every loaded page equalled its host slot, byte for byte


def test_corrupted_load_changes_the_output(eng: Any) -> None:
    from integration.vllm_kit import corrupt_groups, random_prompts

    prompts = random_prompts([150, 190, 230], seed=2)
    first = eng.generate(prompts)
    eng.reset_prefix_cache()
    eng.worker.after_load = corrupt_groups({0})
    second = eng.generate(prompts)
    assert all(b.num_cached_tokens > 0 for b in second)
    changed = [a.tokens != b.tokens or a.logprobs != pytest.approx(b.logprobs, abs=1e-2)
               for a, b in zip(first, second, strict=True)]
    assert all(changed), changed


def test_failed_load_is_recomputed_with_the_same_output(eng: Any) -> None:
    from integration.vllm_kit import random_prompts
    from kvoffload.jobs import Direction

    prompts = random_prompts([120, 180], seed=3)
    first = eng.generate(prompts)
    eng.reset_prefix_cache()
    failed_before = eng.scheduler.planner.stats.failed_loads
    eng.worker.worker.backend.fault_hook = lambda job: job.direction is Direction.LOAD
    second = eng.generate(prompts)
    assert [b.tokens for b in second] == [a.tokens for a in first]
    assert eng.scheduler.planner.stats.failed_loads - failed_before == len(prompts)


def test_many_concurrent_requests_share_one_prefix(eng: Any) -> None:
    from integration.vllm_kit import random_prompts

    prefix = random_prompts([160], seed=4)[0]
    prompts = random_prompts([200 + 7 * i for i in range(16)], seed=5, prefix=prefix)
    first = eng.generate(prompts)
    eng.reset_prefix_cache()
    loads_before = eng.scheduler.planner.stats.load_jobs
    second = eng.generate(prompts)
    assert [b.tokens for b in second] == [a.tokens for a in first]
    assert all(b.num_cached_tokens >= len(prefix) for b in second)
    assert eng.scheduler.planner.stats.load_jobs > loads_before


def test_request_aborted_while_its_load_is_in_flight(eng: Any) -> None:
    from vllm import SamplingParams

    from integration.vllm_kit import random_prompts
    from kvoffload.jobs import Direction

    prompt = random_prompts([230], seed=6)[0]
    reference = eng.generate([prompt])[0]
    eng.reset_prefix_cache()
    backend = eng.worker.worker.backend
    backend.hold(Direction.LOAD)  # loads stay queued, their blocks owned, until released
    engine = eng.llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("aborted-while-loading", {"prompt_token_ids": prompt}, params)
    deadline = time.monotonic() + 30
    while not eng.worker.worker.jobs_in_flight and time.monotonic() < deadline:
        engine.step()
        time.sleep(0.01)
    assert eng.worker.worker.jobs_in_flight, "the load never started"
    assert eng.scheduler.tier.usage().pinned_slots > 0  # the load pins its host blocks
    engine.abort_request(["aborted-while-loading"])
    for _ in range(3):
        engine.step()  # vLLM keeps the blocks: the transfer still writes them
    backend.hold(Direction.LOAD, False)
    eng.drain()
    for _ in range(5):
        engine.step()
    eng.assert_idle()
    again = eng.generate([prompt])[0]
    assert again.tokens == reference.tokens


def test_stats_reach_prometheus_and_events_name_the_host_blocks(eng: Any) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from integration.vllm_kit import random_prompts

    sink = eng.extra["events"]
    sink.events.clear()
    prompts = random_prompts([96, 128], seed=7)
    eng.generate(prompts)
    eng.reset_prefix_cache()
    eng.generate(prompts)
    eng.drain()
    metrics = {m.name: m for m in eng.llm.get_metrics()}
    assert metrics["vllm:kvoffload_hit_tokens"].value >= 96 + 128
    assert metrics["vllm:kvoffload_loaded_bytes"].value > 0
    assert metrics["vllm:kvoffload_stored_bytes"].value > 0
    assert metrics["vllm:kvoffload_host_used_slots"].value > 0
    stored = [e for e in sink.events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in stored) >= (96 + 128) // ALIGN
    assert all(e.group_idx == 0 and e.kv_cache_spec_kind == "full_attention" for e in stored)
    # Dropping the connector's cache announces every host block as removed.
    sink.events.clear()
    assert eng.llm.reset_prefix_cache(reset_connector=True)
    eng.generate(random_prompts([20], seed=8))  # a step publishes the queued events
    removed = [e for e in sink.events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert sum(len(e.block_hashes) for e in removed) >= (96 + 128) // ALIGN


def test_follow_up_turn_hits_blocks_completed_by_generated_tokens(eng: Any) -> None:
    from integration.vllm_kit import follow_up_uses_blocks_stored_during_decode

    follow_up_uses_blocks_stored_during_decode(eng, prompt_len=100, generated=40, suffix_len=20,
                                               alignment=ALIGN, seed=53, windowed=False)
