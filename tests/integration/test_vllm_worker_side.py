"""The connector's worker role on tensors shaped like vLLM's CPU caches (no engine).

vLLM 0.32 on CPU hands an attention layer as ``(num_blocks, kv_heads, block_size,
2 * head_size)`` and a Mamba layer as a raw int8 page view ``(num_blocks, 1, 1,
real_bytes)`` whose rows sit a padded page apart. The worker role must move exactly those
bytes, in the order vLLM's hooks call it, and report loads by request.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from integration.markers import VLLM

pytestmark = VLLM

torch = pytest.importorskip("torch")

NUM_BLOCKS = 12
ATTN = (1, 32, 64)  # kv heads, block size, K|V of head size 32
MAMBA_REAL, MAMBA_PADDED = 10112, 16384


def _caches(gen: Any) -> dict[str, Any]:
    attn = torch.randn((NUM_BLOCKS, *ATTN), generator=gen)
    raw = torch.randint(-128, 127, (NUM_BLOCKS * MAMBA_PADDED,), dtype=torch.int8,
                        generator=gen)
    mamba = raw.as_strided((NUM_BLOCKS, 1, 1, MAMBA_REAL), (MAMBA_PADDED, MAMBA_REAL,
                                                             MAMBA_REAL, 1))
    # kernel-block split: vLLM may hand 2 kernel blocks per manager block
    split = torch.randn((NUM_BLOCKS * 2, 1, 16, 64), generator=gen)
    return {"attn": attn, "mixer": mamba, "split": split, "mixer.raw": raw}


def _side() -> tuple[Any, dict[str, Any]]:
    from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
    from kvoffload.integrations.vllm.worker_side import WorkerSide

    config = OffloadConfig(groups=(
        GroupSpec(GroupKind.MAMBA, 32, page_bytes=MAMBA_REAL),
        GroupSpec(GroupKind.FULL_ATTENTION, 32, num_layers=2, page_bytes=32 * 64 * 4),
    ), hash_block_size=32, host_capacity_bytes=16 * 2 * 32 * 64 * 4, eviction_policy="lru")
    side = WorkerSide(config, [["mixer"], ["attn", "split"]], NUM_BLOCKS)
    caches = _caches(torch.Generator().manual_seed(7))
    side.register_kv_caches(caches)
    return side, caches


def _poll_until(side: Any, meta: Any, want: int) -> tuple[set[str], set[str]]:
    import time

    finished: set[str] = set()
    failed: set[str] = set()
    for _ in range(500):
        f, x = side.transfer_results(meta)
        finished |= f
        failed |= x
        if len(finished) >= want:
            break
        time.sleep(0.01)
    return finished, failed


def _run_step(side: Any, meta: Any) -> None:
    """The worker side's calls of one step, the forward pass writing nothing in between."""
    side.flush(meta)
    side.start_loads(meta)
    side.submit_stores(meta)


def test_store_then_load_moves_exactly_the_real_bytes() -> None:
    from kvoffload.integrations.vllm.metadata import KVOffloadMetadata
    from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob

    side, caches = _side()
    mamba_page = caches["mixer"].reshape(NUM_BLOCKS, MAMBA_REAL)
    before = {name: t.clone() for name, t in caches.items()}
    # Store engine blocks 3 (Mamba) and 4, 5 (attention) into slots 0, 1, 2.
    store = TransferJob(JobId(0), Direction.STORE, "r", (
        GroupTransfer(0, (3,), 0, (0,)), GroupTransfer(1, (4, 5), 0, (1, 2))))
    meta = KVOffloadMetadata(StepPlan(stores=(store,)))
    _run_step(side, meta)
    side.worker.wait([JobId(0)])
    # Load them back into engine blocks 7 and 8, 9, as a request's prefix.
    load = TransferJob(JobId(1), Direction.LOAD, "r2", (
        GroupTransfer(0, (7,), 0, (0,)), GroupTransfer(1, (8, 9), 0, (1, 2))))
    meta2 = KVOffloadMetadata(StepPlan(loads=(load,)))
    _run_step(side, meta2)
    finished, failed = _poll_until(side, meta2, 1)
    assert finished == {"r2"} and not failed
    assert torch.equal(mamba_page[7], mamba_page[3])
    assert torch.equal(caches["attn"][8:10], before["attn"][4:6])
    split = caches["split"].unflatten(0, (NUM_BLOCKS, 2))
    assert torch.equal(split[8:10], before["split"].unflatten(0, (NUM_BLOCKS, 2))[4:6])
    # vLLM's padding after each Mamba page is never touched.
    def padding(raw: Any) -> Any:
        return raw.view(NUM_BLOCKS, MAMBA_PADDED)[:, MAMBA_REAL:]

    assert torch.equal(padding(caches["mixer.raw"]), padding(before["mixer.raw"]))
    worker_meta = side.take_worker_meta()
    assert worker_meta is not None
    reported = {j for r in worker_meta.reports for j in r.finished}
    assert reported == {JobId(0), JobId(1)}
    assert side.take_worker_meta() is None
    side.shutdown()


def test_same_step_store_in_flush_waits_for_the_forward_pass() -> None:
    from kvoffload.integrations.vllm.metadata import KVOffloadMetadata
    from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob

    side, caches = _side()
    store = TransferJob(JobId(0), Direction.STORE, "r", (GroupTransfer(1, (2,), 0, (0,)),))
    meta = KVOffloadMetadata(StepPlan(flush=(JobId(0),), stores=(store,)))
    side.flush(meta)
    assert side.worker.poll().finished == ()  # nothing submitted before the forward pass
    caches["attn"][2].fill_(3.0)  # the forward pass writes the block
    side.start_loads(meta)
    side.submit_stores(meta)
    side.worker.wait([JobId(0)])
    assert side.same_step_flushes == 1
    pool = side.worker.host_pool
    assert torch.equal(pool.page_view(0, 1, 0, 0), caches["attn"][2].view(torch.uint8)
                       .reshape(-1))
    side.shutdown()


def test_a_flush_of_an_earlier_store_is_counted_with_its_wait_in_the_next_report() -> None:
    from kvoffload.integrations.vllm.metadata import KVOffloadMetadata
    from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob

    side, _ = _side()
    waited: list[tuple[JobId, ...]] = []
    wait = side.worker.wait

    def slow_wait(jobs: Any) -> None:  # the copy takes 50 ms longer
        jobs = tuple(jobs)
        if jobs:
            waited.append(jobs)
            time.sleep(0.05)
        wait(jobs)

    side.worker.wait = slow_wait
    store = TransferJob(JobId(0), Direction.STORE, "r", (GroupTransfer(1, (2, 3), 0, (0, 1)),))
    _run_step(side, KVOffloadMetadata(StepPlan(stores=(store,))))
    assert not waited  # nothing flushed: no wait
    # Next step: vLLM handed block 2 out again; the plan flushes the store first.
    flushing = KVOffloadMetadata(StepPlan(flush=(JobId(0),)))
    _run_step(side, flushing)
    side.transfer_results(flushing)
    worker_meta = side.take_worker_meta()
    assert worker_meta is not None
    # The flush waited for the store: it is done, and reported with the wait.
    assert JobId(0) in {j for r in worker_meta.reports for j in r.finished}
    stats = [r.stats for r in worker_meta.reports]
    assert sum(s.flushed_jobs for s in stats) == 1
    assert waited[0] == (JobId(0),)  # timed; the plan's own wait then finds it done
    assert 0.05 <= sum(s.flush_wait_seconds for s in stats) < 5.0
    assert side.same_step_flushes == 0
    # Counted once: nothing flushed since.
    _run_step(side, KVOffloadMetadata(StepPlan()))
    side.transfer_results(None)
    later = side.take_worker_meta()
    assert later is None or all(r.stats.flushed_jobs == 0 for r in later.reports)
    side.shutdown()


def test_loads_resolved_without_a_job_are_reported_once() -> None:
    from kvoffload.integrations.vllm.metadata import KVOffloadMetadata

    side, _ = _side()
    meta = KVOffloadMetadata(resolved_loads=(("ok", False), ("bad", True)))
    assert side.transfer_results(meta) == ({"ok", "bad"}, {"bad"})
    assert side.transfer_results(meta) == (set(), set())
    side.shutdown()


def test_a_failed_load_is_reported_as_finished_and_failed() -> None:
    from kvoffload.integrations.vllm.metadata import KVOffloadMetadata
    from kvoffload.jobs import Direction, GroupTransfer, JobId, StepPlan, TransferJob

    side, _ = _side()
    side.worker.backend.fault_hook = lambda job: True  # type: ignore[attr-defined]
    load = TransferJob(JobId(5), Direction.LOAD, "r", (GroupTransfer(1, (3,), 0, (0,)),))
    meta = KVOffloadMetadata(StepPlan(loads=(load,)))
    side.start_loads(meta)
    assert _poll_until(side, meta, 1) == ({"r"}, {"r"})
    side.shutdown()


def test_a_missing_layer_is_named() -> None:
    from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
    from kvoffload.errors import LayoutError
    from kvoffload.integrations.vllm.worker_side import WorkerSide

    config = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 32, page_bytes=8192),),
                           hash_block_size=32, host_capacity_bytes=1 << 20, eviction_policy="lru")
    side = WorkerSide(config, [["model.layers.0.attn"]], NUM_BLOCKS)
    with pytest.raises(LayoutError, match=r"model\.layers\.0\.attn"):
        side.register_kv_caches({"other": torch.zeros((NUM_BLOCKS, *ATTN))})
