"""Blocks vLLM writes outside the forward pass never reach a store (``worker_side``).

vLLM's model runner zeroes newly allocated blocks, applies copy-on-write copies and copies
Mamba states into their running column when it updates the batch: the V1 runner (vLLM
0.32, 0.33) after the connector's ``handle_preemptions``, the V2 runner (the only one in
0.34) before it. Any of those blocks may have been freed by a finished or preempted
request, or slid out of a window, while a store of its old contents was still queued.
Here the copy engine runs behind (``lazy_copies``: a store copies as late as the
connector lets it), the layouts have a Mamba group (so vLLM asks for zeroing) and a
sliding-window group, the pool is small enough that vLLM preempts and reuses blocks, and
every finished store's slots are checked against what the forward pass wrote
(``stored_bytes``). A store that copied a zeroed or overwritten block fails the check.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.markers import VLLM

pytestmark = VLLM

kit = pytest.importorskip("vllm_scheduler.kit")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kit.model_dir(tmp_path_factory.mktemp("llama-config"))


@pytest.mark.parametrize("runner", ["v1", "v2"])
@pytest.mark.parametrize("layout", ["mamba1", "mamba2"])
def test_blocks_vllm_zeroes_or_copies_into_never_reach_a_store(
        root: Path, layout: str, runner: str) -> None:
    batch = kit.prompts(30, prefix_len=128, tail=(40, 160))
    with kit.engine(root, kit.Layout(layout), num_blocks=96, max_num_seqs=8,
                    max_num_batched_tokens=128, runner=runner, lazy_stores=True) as eng:
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        first = {rid[1:]: out for rid, out in eng.outputs.items()}
        assert eng.scheduler.reset_prefix_cache()  # vLLM's own cache only
        kit.feed(eng, [(f"b{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        second = {rid[1:]: out for rid, out in eng.outputs.items() if rid.startswith("b")}
        assert eng.zeroed_blocks > 0, "vLLM zeroed no block: the hazard was not exercised"
        assert eng.side.num_preempted > 0
        assert eng.stores is not None and eng.stores.checked_pages > 0
        assert sum(eng.side.planner.stats.blocks_loaded.values()) > 0
        assert second == first
        assert eng.lazy is not None
        if runner == "v1":  # the copy engine did run behind: flushes alone protected
            assert eng.lazy.late_copies > 0
        else:  # every store was fenced when submitted: none copied late
            assert eng.lazy.late_copies == 0
        planner = eng.side.planner
        planner.check_integrity()
        assert planner.num_jobs == 0 and planner.fence_size == 0


def test_the_connector_detects_the_runner_from_vllms_configuration(root: Path) -> None:
    from kvoffload.integrations.vllm.compat import runner_writes_before_flush

    class V034:  # vLLM 0.34 has the V2 runner only, and no flag to ask
        pass

    class Chosen:
        def __init__(self, v2: bool) -> None:
            self.use_v2_model_runner = v2

    assert runner_writes_before_flush(V034()) is True
    assert runner_writes_before_flush(Chosen(True)) is True
    assert runner_writes_before_flush(Chosen(False)) is False
    with kit.engine(root, kit.Layout("hybrid")) as eng:
        config = eng.connector._vllm_config
        expected = bool(getattr(config, "use_v2_model_runner", True))
        assert eng.worker_side.fence_store_reads is expected
        assert eng.runner == ("v2" if expected else "v1")
