"""The connector inside vLLM's real scheduler, many steps at a time (``kit``).

Each run replays prompts that share long prefixes, drops vLLM's own prefix cache and
replays them again, so the second pass is served by kvoffload's loads; the scripted model
runner checks every cached position a step reads. The hybrid layout runs with a pool small
enough that vLLM preempts requests.
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


def two_passes(eng: kit.Engine, batch: list[list[int]]) -> None:
    kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)])
    assert eng.scheduler.reset_prefix_cache()  # vLLM's own cache only
    kit.feed(eng, [(f"b{i}", p) for i, p in enumerate(batch)])


def loaded_blocks(eng: kit.Engine) -> int:
    return sum(eng.side.planner.stats.blocks_loaded.values())


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_a_second_pass_is_loaded_and_every_read_position_holds_its_bytes(
        root: Path, layout: str) -> None:
    batch = kit.prompts(24)
    with kit.engine(root, kit.Layout(layout)) as eng:
        two_passes(eng, batch)
        assert loaded_blocks(eng) > 0
        assert eng.checked_positions > 10_000
        planner = eng.side.planner
        planner.check_integrity()
        assert planner.num_jobs == 0 and planner.fence_size == 0
        assert eng.side.tier.usage().pinned_slots == 0
        # Same greedy outputs in both passes: the loads changed nothing.
        for i in range(len(batch)):
            assert eng.outputs[f"a{i}"] == eng.outputs[f"b{i}"]


def test_a_hybrid_layout_through_preemptions(root: Path) -> None:
    batch = kit.prompts(30, prefix_len=128, tail=(40, 160))
    # 80 blocks: vLLM preempts in both passes. (Much smaller pools can deadlock inside
    # vLLM itself: two requests whose loads each hold half the pool both wait for more.)
    with kit.engine(root, kit.Layout("hybrid"), num_blocks=80, max_num_seqs=8,
                    max_num_batched_tokens=128) as eng:
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        assert eng.scheduler.reset_prefix_cache()
        kit.feed(eng, [(f"b{i}", p) for i, p in enumerate(batch)], max_tokens=24)
        assert eng.side.num_preempted > 0
        assert loaded_blocks(eng) > 0
        eng.side.planner.check_integrity()
        assert eng.side.planner.num_jobs == 0
        for i in range(len(batch)):
            assert eng.outputs[f"a{i}"] == eng.outputs[f"b{i}"]


@pytest.mark.parametrize("layout", ["full", "hybrid"])
def test_decode_steps_inside_a_block_are_left_out_and_every_decoded_block_is_stored(
        root: Path, layout: str) -> None:
    prompt = kit.prompts(1, tail=(40, 41))[0]
    with kit.engine(root, kit.Layout(layout)) as eng:
        step_input = eng.side.step_input
        listed: list[bool] = []

        def recording(so: object) -> object:
            step = step_input(so)
            listed.append(any(s.request.request_id == "a" for s in step.scheduled))
            return step

        eng.side.step_input = recording
        kit.feed(eng, [("a", prompt)], max_tokens=70)
        out = eng.outputs["a"]
        assert len(out) == 70
        # One prefill and 69 decode steps; the planner sees the prefill and, per block
        # boundary, the step that completes a block and the one that allocates the next.
        assert len(listed) >= 70 and sum(listed) <= 1 + 2 * (70 // kit.BLOCK + 1)
        computed = len(prompt) + len(out) - 1  # the last token's KV is never computed
        full = next(g.index for g in eng.side.config.resolved if g.window_blocks is None)
        # Every complete block is stored, decode ones too.
        assert eng.side.planner.stats.blocks_stored[full] == computed // kit.BLOCK
        # Served back after vLLM's own cache is dropped: the runner checks every position.
        assert eng.scheduler.reset_prefix_cache()
        kit.feed(eng, [("b", prompt + out)], max_tokens=4)
        assert sum(eng.side.planner.stats.blocks_loaded.values()) > 0
        assert eng.first_computed["b"] == computed // kit.BLOCK * kit.BLOCK
