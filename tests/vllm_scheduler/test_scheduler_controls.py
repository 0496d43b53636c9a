"""Per-request controls, tenant salts and the load deadline inside vLLM's real scheduler.

``kv_transfer_params`` carries ``max_offload_tokens`` / ``max_load_tokens`` (the names of
vLLM's own offloading connector); ``cache_salt`` is vLLM's request field. The deadline is
``load_deadline_s``: a load held back past it is given up, vLLM recomputes, and the late
copy lands without touching what the recompute wrote (the runner checks every position).
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from integration.markers import VLLM
from kvoffload.jobs import Direction

pytestmark = VLLM

kit = pytest.importorskip("vllm_scheduler.kit")

PROMPT = list(range(1000, 1000 + 200))  # 12 full blocks of 16, and 8 tokens more


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kit.model_dir(tmp_path_factory.mktemp("llama-config"))


def host_blocks(eng: kit.Engine) -> int:
    return eng.side.tier.usage().used_slots


def run_one(eng: kit.Engine, rid: str, prompt: list[int] = PROMPT, **add: object) -> None:
    eng.add(rid, prompt, max_tokens=4, **add)  # type: ignore[arg-type]
    eng.run()


def external_hit(eng: kit.Engine, rid: str, prompt: list[int] = PROMPT,
                 **add: object) -> int:
    """Tokens the connector offers ``rid`` once vLLM's own cache is dropped."""
    assert eng.scheduler.reset_prefix_cache()
    before = eng.side.planner.stats.lookup_hit_tokens
    run_one(eng, rid, prompt, **add)
    return int(eng.side.planner.stats.lookup_hit_tokens - before)


def test_a_request_with_storing_off_leaves_nothing_and_is_never_hit(root: Path) -> None:
    with kit.engine(root, kit.Layout("full")) as eng:
        run_one(eng, "private", kv_transfer_params={"max_offload_tokens": 0})
        assert host_blocks(eng) == 0
        assert external_hit(eng, "again") == 0
        # the same prompt without the control is stored, and then hit
        assert host_blocks(eng) > 0
        assert external_hit(eng, "third") > 0


def test_a_capped_request_stores_exactly_the_cap_in_whole_blocks(root: Path) -> None:
    with kit.engine(root, kit.Layout("full")) as eng:
        run_one(eng, "capped", kv_transfer_params={"max_offload_tokens": 100})
        # 100 tokens: 6 whole blocks of 16, in each of the layout's one group
        assert host_blocks(eng) == 6
        assert external_hit(eng, "again") == 96


def test_a_load_cap_limits_the_tokens_loaded(root: Path) -> None:
    with kit.engine(root, kit.Layout("full")) as eng:
        run_one(eng, "first")
        assert external_hit(eng, "capped", kv_transfer_params={"max_load_tokens": 40}) == 32


def test_a_bad_control_value_stores_nothing(root: Path) -> None:
    with kit.engine(root, kit.Layout("full")) as eng:
        run_one(eng, "typo", kv_transfer_params={"max_offload_tokens": "0"})
        assert host_blocks(eng) == 0


def test_params_that_are_not_an_object_never_stop_the_scheduler(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    # Issue 40: vLLM passes kv_transfer_params on unchecked; a string, list or number raised
    # in the connector (an HTTP 500 for the client). Read as empty: the request is stored
    # as one without controls; a 1 MiB session id is no hint.
    with kit.engine(root, kit.Layout("full")) as eng, caplog.at_level("WARNING"):
        for i, params in enumerate(["max_offload_tokens=0", ["max_offload_tokens", 0], 7]):
            run_one(eng, f"odd-{i}", [5000 + i, *PROMPT[1:]],
                    kv_transfer_params=params)
        assert host_blocks(eng) == 3 * 12
        run_one(eng, "long-session", [6000, *PROMPT[1:]],
                kv_transfer_params={"session_id": "s" * (1 << 20)})
        assert host_blocks(eng) == 4 * 12
    assert caplog.text.count("must be a JSON object") == 3
    assert "kv_transfer_params.session_id" in caplog.text and len(caplog.text) < 20_000


def test_tenants_with_different_salts_never_share_blocks(root: Path) -> None:
    with kit.engine(root, kit.Layout("hybrid")) as eng:
        run_one(eng, "a1", cache_salt="tenant-a")
        assert external_hit(eng, "b1", cache_salt="tenant-b") == 0
        assert external_hit(eng, "a2", cache_salt="tenant-a") > 0
        assert external_hit(eng, "none") == 0


@pytest.mark.parametrize(("layout", "num_blocks"), [
    ("full", 256), ("hybrid", 256),
    # A pool so small that the recompute needs the blocks the late copy still writes:
    # it waits for them to come back (vLLM's own pool pressure), never for a flush.
    ("full", 16), ("hybrid", 30)])
def test_a_load_past_its_deadline_is_recomputed_and_released(root: Path, layout: str,
                                                             num_blocks: int) -> None:
    with kit.engine(root, kit.Layout(layout), num_blocks=num_blocks,
                    extra={"load_deadline_s": 0.2}) as eng:
        run_one(eng, "first")
        expected = eng.outputs["first"]
        backend = eng.worker_side.worker.backend
        pool = eng.scheduler.kv_cache_manager.block_pool
        free_before = pool.get_num_free_blocks()
        backend.hold(Direction.LOAD)
        # The held copy is let go later from another thread, as a slow disk would.
        release = threading.Timer(1.5, backend.hold, (Direction.LOAD, False))
        release.start()
        try:
            assert eng.scheduler.reset_prefix_cache()
            eng.add("late", PROMPT, max_tokens=4)
            eng.run_until_finished("late")
            if num_blocks > 100:
                # recomputed into other blocks while the copy is still held back
                assert release.is_alive()
                assert pool.get_num_free_blocks() < free_before  # the copy's blocks held
            eng.run()
        finally:
            release.cancel()
            backend.hold(Direction.LOAD, False)
        assert eng.side.num_abandoned_loads == 1 and len(eng.abandoned) == 1
        assert not eng.abandoned & eng.flushed  # nobody had to wait for the late copy
        assert eng.outputs["late"] == expected
        planner = eng.side.planner
        assert planner.stats.abandoned_loads == 1 and planner.stats.failed_loads == 0
        # run() waited for the late copy: nothing is pinned, fenced or held any more
        assert planner.num_jobs == 0 and planner.fence_size == 0
        assert eng.side.tier.usage().pinned_slots == 0
        assert pool.get_num_free_blocks() == free_before
        planner.check_integrity()
        # the request's own blocks held what the recompute wrote (checked at every step);
        # and the tier still serves the next request
        assert external_hit(eng, "after") > 0
