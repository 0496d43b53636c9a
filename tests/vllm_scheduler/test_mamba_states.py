"""Mamba states under vLLM's real scheduler in its ``align`` cache mode (``kit``,
``mamba_runner``): which block holds which state is vLLM's decision, and the connector
must store exactly those states and load each into the block vLLM reads it from.

Mamba1 (``"mamba1"``) ends every prefill chunk but the prompt's last on a block boundary,
so the state a hit needs exists at a step end. Mamba2 (``"mamba2"``) also writes the
state at the prompt's last boundary from inside a longer chunk (vLLM's in-chunk prefill
checkpoint) and the scheduler then leaves the prompt in one chunk: no step ends at that
boundary, and the connector learns where the state is from vLLM's boundary-state
hand-off (``SchedulerOutput.kv_connector_block_state``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from integration.markers import VLLM

pytestmark = VLLM

kit = pytest.importorskip("vllm_scheduler.kit")

MAMBA, FULL = 0, 2
"""Group indices of the Mamba layouts: Mamba, sliding window, full attention."""


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kit.model_dir(tmp_path_factory.mktemp("llama-config"))


def last_boundary(num_tokens: int) -> int:
    """The longest hit a prompt of ``num_tokens`` can get: whole blocks, one token short."""
    return (num_tokens - 1) // kit.BLOCK * kit.BLOCK


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("layout", ["mamba1", "mamba2"])
def test_a_prompt_prefilled_in_one_step_comes_back_from_its_last_boundary(
        root: Path, layout: str, async_scheduling: bool) -> None:
    """Each prompt fits one step's budget; the second pass must load, for every request,
    the attention blocks and the one Mamba state at its last block boundary (Mamba2:
    the in-chunk checkpoint)."""
    lengths = [100, 150, 64, 37, 210]
    batch = kit.prompts(len(lengths), seed=5, prefixes=1, prefix_len=0, tail=(1, 2))
    batch = [p + [(7 * i + n) % 29_000 + 10 for i in range(n - len(p))]
             for p, n in zip(batch, lengths, strict=True)]
    with kit.engine(root, kit.Layout(layout), async_scheduling=async_scheduling,
                    max_num_batched_tokens=256) as eng:
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], per_step=1, max_tokens=4)
        first = dict(eng.outputs)
        if layout == "mamba2":
            assert eng.mamba is not None and eng.mamba.checkpoints_written >= len(lengths) - 1
        assert eng.scheduler.reset_prefix_cache()
        eng.outputs.clear()
        stats = eng.side.planner.stats
        loaded_before = dict(stats.blocks_loaded)
        kit.feed(eng, [(f"a{i}", p) for i, p in enumerate(batch)], per_step=1, max_tokens=4)
        assert eng.outputs == first
        loaded = {g: stats.blocks_loaded.get(g, 0) - loaded_before.get(g, 0)
                  for g in (MAMBA, FULL)}
        assert loaded == {MAMBA: len(lengths),
                          FULL: sum(last_boundary(n) // kit.BLOCK for n in lengths)}
        assert eng.mamba is not None and eng.mamba.checked_states > 0


def test_a_named_state_counts_only_where_every_mamba_table_holds_the_named_block() -> None:
    """vLLM's hand-off names (group, block, tokens); a boundary reaches the planner only
    when each Mamba group's table holds that very block at the boundary's position, and
    only for whole Mamba blocks (a sub-block state is not a block boundary)."""
    from types import SimpleNamespace

    from kvoffload.integrations.vllm.mamba_states import checkpointed_state_ends

    def table(*ids: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(block_id=i) for i in ids]

    tables = {0: {"a": table(0, 0, 7, 8), "b": table(0, 5, 6), "c": table(0, 3)},
              3: {"a": table(0, 0, 9, 4), "b": table(0, 5, 6), "c": table(0, 3)}}
    offloads = {
        "a": [(0, 7, 48), (3, 9, 48), (0, 8, 64), (3, 11, 64)],  # 64: group 3 differs
        "b": [(0, 5, 32), (3, 5, 32), (0, 6, 40), (3, 6, 40)],  # 40: inside a block
        "c": [(0, 3, 32)],  # group 3 named nothing
    }
    so = SimpleNamespace(kv_connector_block_state=SimpleNamespace(
        boundary_state_offloads=offloads))
    assert checkpointed_state_ends(so, [(0, 16), (3, 16)], tables) == {"a": (48,), "b": (32,)}
    assert checkpointed_state_ends(SimpleNamespace(kv_connector_block_state=None),
                                   [(0, 16)], tables) == {}
