"""The connector under vLLM's async scheduling (``AsyncScheduler``, outputs one step late).

On CUDA vLLM schedules step N+1 before step N's output is processed; its CPU platform turns
that off, so only this harness (``kit``, ``async_scheduling=True``) runs it here: vLLM's
real ``AsyncScheduler``, the batch queue of two, the connector's real worker side over CPU
tensors, every cached position a step reads checked. Stories: long runs with preemptions
over the hybrid layouts (sliding window + full attention, and the same with a Mamba group
in vLLM's ``align`` mode, Mamba1-like and Mamba2 with in-chunk checkpoints, whose every
state a step starts from is checked too: ``mamba_runner``), aborts while loads and stores
are in flight, requests that finish while their last step is still out, cache resets
mid-run, and Hypothesis choosing the order of all of it. At the end nothing is pinned,
fenced or in flight, and every job was completed exactly once (the planner's ledger
refuses a second completion).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from integration.markers import VLLM

pytestmark = VLLM

kit = pytest.importorskip("vllm_scheduler.kit")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kit.model_dir(tmp_path_factory.mktemp("llama-config"))


def assert_drained(eng: kit.Engine, *, after_reset: bool = False) -> None:
    """Nothing in flight, pinned or fenced; no report counted twice (and, unless the
    connector's cache was reset, none arrived for a job the planner had dropped)."""
    planner = eng.side.planner
    planner.check_integrity()
    assert planner.num_jobs == 0 and planner.fence_size == 0
    assert planner.num_requests == 0
    usage = eng.side.tier.usage()
    assert usage.pinned_slots == 0 and usage.writing_slots == 0
    assert planner.stats.duplicate_reports == 0
    assert after_reset or planner.stats.stale_reports == 0


def reference_outputs(root: Path, layout: str, batch: list[list[int]],
                      max_tokens: int) -> dict[str, list[int]]:
    """What synchronous scheduling gives for the same requests."""
    with kit.engine(root, kit.Layout(layout)) as eng:
        kit.feed(eng, [(f"r{i}", p) for i, p in enumerate(batch)], max_tokens=max_tokens)
        return eng.outputs


HYBRIDS = ["hybrid", "mamba1", "mamba2"]
"""Layouts with groups that free or overwrite blocks while a request runs."""


def loaded_every_group(eng: kit.Engine) -> bool:
    """Whether the connector loaded blocks of every group (Mamba states included)."""
    loaded = eng.side.planner.stats.blocks_loaded
    return all(loaded.get(g, 0) > 0 for g in range(len(eng.groups)))


@pytest.mark.parametrize("layout", ["full", *HYBRIDS])
def test_two_passes_under_async_scheduling_match_synchronous_outputs(
        root: Path, layout: str) -> None:
    batch = kit.prompts(20)
    expected = reference_outputs(root, layout, batch, 8)
    with kit.engine(root, kit.Layout(layout), async_scheduling=True) as eng:
        kit.feed(eng, [(f"r{i}", p) for i, p in enumerate(batch)], max_tokens=8)
        assert eng.outputs == expected
        assert eng.scheduler.reset_prefix_cache()
        eng.outputs.clear()
        kit.feed(eng, [(f"r{i}", p) for i, p in enumerate(batch)], max_tokens=8)
        assert eng.outputs == expected
        assert loaded_every_group(eng)
        assert_drained(eng)


@pytest.mark.parametrize("layout", HYBRIDS)
def test_preemptions_under_async_scheduling(root: Path, layout: str) -> None:
    batch = kit.prompts(30, prefix_len=128, tail=(40, 160))
    expected = reference_outputs(root, layout, batch, 24)
    with kit.engine(root, kit.Layout(layout), num_blocks=80, max_num_seqs=8,
                    max_num_batched_tokens=128, async_scheduling=True) as eng:
        kit.feed(eng, [(f"r{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        assert eng.scheduler.reset_prefix_cache()
        first = dict(eng.outputs)
        eng.outputs.clear()
        kit.feed(eng, [(f"r{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        assert eng.side.num_preempted > 0
        assert first == expected and eng.outputs == expected
        assert loaded_every_group(eng)
        assert_drained(eng)


@pytest.mark.parametrize("layout", ["hybrid", "mamba2"])
def test_aborts_with_loads_and_stores_in_flight(root: Path, layout: str) -> None:
    from kvoffload.jobs import Direction

    batch = kit.prompts(12)
    with kit.engine(root, kit.Layout(layout), async_scheduling=True) as eng:
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], max_tokens=4)
        assert eng.scheduler.reset_prefix_cache()
        backend = eng.worker_side.worker.backend
        backend.hold(Direction.LOAD)
        # Where stores are fenced when submitted (vLLM's V2 runner) a held store would
        # hold the step itself: only loads stay in flight there.
        hold_stores = not eng.worker_side.fence_store_reads
        backend.hold(Direction.STORE, hold_stores)
        for i, prompt in enumerate(batch):
            eng.add(f"b{i}", [*prompt, 7, 7, 7], max_tokens=6)
        for _ in range(6):
            eng.step()
        assert eng.worker_side.worker.jobs_in_flight  # held copies
        from vllm.v1.request import RequestStatus

        eng.scheduler.finish_requests([f"b{i}" for i in range(0, 12, 2)],
                                      RequestStatus.FINISHED_ABORTED)
        for _ in range(3):
            eng.step()
        backend.hold(Direction.LOAD, False)
        backend.hold(Direction.STORE, False)
        eng.run()
        for i in range(1, 12, 2):
            assert len(eng.outputs[f"b{i}"]) == 6
        assert_drained(eng)


@pytest.mark.parametrize("layout", ["hybrid", "mamba2"])
def test_a_cache_reset_while_steps_are_in_flight(root: Path, layout: str) -> None:
    batch = kit.prompts(16)
    with kit.engine(root, kit.Layout(layout), async_scheduling=True) as eng:
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], max_tokens=4)
        for i, prompt in enumerate(batch):
            eng.add(f"b{i}", prompt, max_tokens=8)
        for _ in range(5):
            eng.step()
        assert eng.in_flight  # a step is out while the connector is reset
        assert eng.connector.reset_cache() is True
        eng.run()
        assert all(len(eng.outputs[f"b{i}"]) == 8 for i in range(len(batch)))
        assert_drained(eng, after_reset=True)


@pytest.mark.parametrize("layout", HYBRIDS)
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture,
                                 HealthCheck.too_slow])
@given(events=st.lists(st.sampled_from(["add", "add", "add", "step", "step", "abort",
                                        "reset_prefix", "follow_up"]),
                       min_size=10, max_size=60),
       seed=st.integers(0, 1000), factor=st.sampled_from([1, 1, 2]))
def test_random_event_orders_under_async_scheduling(root: Path, layout: str,
                                                    events: list[str], seed: int,
                                                    factor: int) -> None:
    """Hypothesis picks when requests arrive, when the engine steps (so when outputs
    land), which request is aborted, when vLLM's own cache is dropped, which earlier
    request a follow-up extends, and whether an offloaded block is one engine block or
    two (so prefill chunks and checkpoints need not end on an offloaded block); the pool
    is small enough for preemptions."""
    rng = random.Random(seed)
    prefixes = kit.prompts(3, seed=seed, prefix_len=64, tail=(1, 2))
    with kit.engine(root, kit.Layout(layout), num_blocks=64, max_num_seqs=6,
                    max_num_batched_tokens=96, async_scheduling=True,
                    extra={"block_size_factor": factor}) as eng:
        prompts: dict[str, list[int]] = {}
        for n, event in enumerate(events):
            live = sorted(eng.scheduler.requests)
            if event == "add" or (event == "follow_up" and not prompts):
                prompt = rng.choice(prefixes) + [rng.randrange(10, 30_000)
                                                  for _ in range(rng.randrange(1, 60))]
            elif event == "follow_up":
                earlier = rng.choice(sorted(prompts))
                prompt = prompts[earlier] + eng.outputs.get(earlier, []) + [5, 6, 7]
            elif event == "abort" and live:
                from vllm.v1.request import RequestStatus

                eng.scheduler.finish_requests([rng.choice(live)],
                                              RequestStatus.FINISHED_ABORTED)
                continue
            elif event == "reset_prefix":
                eng.scheduler.reset_prefix_cache()  # refused while blocks are in use
                continue
            else:
                eng.step()
                continue
            rid = f"q{n}"
            prompts[rid] = prompt[:400]
            eng.add(rid, prompts[rid], max_tokens=rng.randrange(1, 10))
        eng.run()
        assert_drained(eng)
