"""The layout kvoffload derives from a model's config.json is the one a real vLLM engine builds.

For each tiny model the vLLM tests use (``tiny_models``: Llama, Gemma 3 with sliding
windows, a Granite 4.0 Mamba2 hybrid), ``kvoffload.models.hf_config`` reads the saved
config.json and lays the model out; the engine's KV-cache specs, as the connector
translates them (``KVOffloadConnector.layout``), must give the same groups: per kind and
window, the same layers, block size and page bytes. vLLM splits one kind into several
groups of equal size, kvoffload keeps one per kind, so the comparison sums layers per kind.

The engine runs in float32 (``vllm_kit.start_engine``), so the derivation is told so
(``dtype="float32"``); the block size is the kit's 32 tokens, which vLLM raises for the
hybrid until an attention page holds a Mamba state: ``auto_block_size`` must predict it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from integration.markers import VLLM
from kvoffload.config import GroupKind, GroupSpec
from kvoffload.models.hf_config import derive_preset, load_model_config
from kvoffload.sim.simulation import auto_block_size

pytestmark = VLLM

BLOCK = 32
"""The block size the tests give vLLM (``--block-size``)."""

Kinds = dict[tuple[GroupKind, int | None], tuple[int, int, int]]


def by_kind(groups: Iterable[GroupSpec]) -> Kinds:
    """(kind, window) -> (layers, block size, page bytes) over every group of that kind."""
    out: Kinds = {}
    for g in groups:
        key = (g.kind, g.sliding_window)
        layers, block, page = out.get(key, (0, g.block_size, g.page_bytes))
        assert (block, page) == (g.block_size, g.page_bytes), f"groups of {key} differ"
        out[key] = (layers + g.num_layers, block, page)
    return out


@pytest.mark.parametrize(("name", "expected"), [
    # 2 layers x 1 KV head x 32 dims x (K, V) x 4 B (float32) x 32 tokens = 8192 B a page.
    ("llama", {(GroupKind.FULL_ATTENTION, None): (2, 32, 32 * 1 * 32 * 2 * 4)}),
    # layer_types sliding/full twice, window 32: two layers of each kind.
    ("gemma3", {(GroupKind.SLIDING_WINDOW, 32): (2, 32, 8192),
                (GroupKind.FULL_ATTENTION, None): (2, 32, 8192)}),
    # Mamba2 state: conv (4 - 1) x (4 heads x 32 + 2 x 1 group x 16) = 480 elements, SSM
    # 4 x 32 x 16 = 2048 elements, float32: 10112 B. An attention page of 32 tokens (8192 B)
    # is smaller, so vLLM doubles the block to 64 tokens (16384 B) for both groups.
    ("granite_hybrid", {(GroupKind.MAMBA, None): (2, 64, (480 + 2048) * 4),
                        (GroupKind.FULL_ATTENTION, None): (2, 64, 64 * 1 * 32 * 2 * 4)}),
])
def test_layout_from_config_json_is_the_engines(tiny_model: Callable[[str], Path], name: str,
                                                expected: Kinds) -> None:
    from integration.vllm_kit import engine

    path = tiny_model(name)
    preset = derive_preset(load_model_config(path / "config.json"), name=name,
                           source=str(path), dtype="float32")
    block = auto_block_size(preset, alignment=BLOCK) if preset.mamba is not None else BLOCK
    ours = by_kind(preset.layout(block).specs)
    # The hybrid's CPU Mamba2 kernel in align mode needs one Mamba block per prefill chunk.
    limits = {"max_num_batched_tokens": 64} if preset.mamba is not None else {}
    with engine(path, block_size=BLOCK, **limits) as eng:
        theirs = by_kind(eng.core.scheduler.connector.layout.groups)
    assert ours == theirs == expected
