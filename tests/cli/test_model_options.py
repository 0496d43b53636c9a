"""``--model PATH`` and ``--tp N`` on ``simulate``, ``sweep`` and ``presets``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.models.hf_config import preset_entries
from kvoffload.models.presets import PRESETS

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "model_configs"
QWEN3 = str(CONFIGS / "Qwen3-8B")
NEMOTRON = str(CONFIGS / "Nemotron-H-8B-Base-8K")
SMALL = ["--workload", "chat", "--limit", "12", "--engine-tokens", "6000", "--quiet"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_presets_lists_every_model_of_the_presets_file(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "presets")
    assert status == 0 and "family" in out.splitlines()[0]
    for name in preset_entries():
        assert name in out
    status, out, _ = run(capsys, "presets", "--json")
    data = {p["name"]: p for p in json.loads(out)}
    assert set(data) == set(PRESETS) == set(preset_entries())
    assert data["deepseek-v3"]["bytes_per_token"] == 61 * (512 + 64) * 2
    assert data["falcon-h1-7b"]["family"].startswith("Falcon-H1")
    assert data["qwen3-next-80b-a3b"]["bytes_per_state"] == 36 * 1_097_728


def test_presets_per_rank_and_for_a_model_directory(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "presets", "--json", "--tp", "2")
    assert status == 0
    data = {p["name"]: p for p in json.loads(out)}
    assert data["llama3-8b@tp2"]["bytes_per_token"] == 32 * 8 * 128 * 2 * 2 // 2
    assert data["llama3-8b@tp2"]["tensor_parallel"] == 2
    status, out, _ = run(capsys, "presets", "--json", "--model", NEMOTRON, "--tp", "2")
    assert status == 0
    (model,) = json.loads(out)
    assert model["name"] == "Nemotron-H-8B-Base-8K@tp2"
    assert model["bytes_per_token"] == 4 * 8 * 128 * 2 * 2 // 2
    assert model["bytes_per_state"] == 24 * 4_255_744 // 2
    status, out, _ = run(capsys, "presets", "--verbose", "--model", QWEN3)
    assert status == 0 and "Qwen3-8B" in out and "assumptions" in out


def test_presets_leaves_out_models_that_cannot_split(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "presets", "--json", "--tp", "16")
    assert status == 0
    names = {p["name"] for p in json.loads(out)}
    # 16 ranks keep one of gpt-oss's 8 KV heads each; Falcon-H1's 12 query heads and
    # Nemotron-H's 8 Mamba groups do not split 16 ways.
    assert "gpt-oss-20b@tp16" in names and "llama3-8b@tp16" in names
    assert "falcon-h1-7b@tp16" not in names and "nemotron-h-8b@tp16" not in names
    assert "note: falcon-h1-7b@tp16: 16 ranks do not divide its 12 attention heads" in err
    assert "note: nemotron-h-8b@tp16: 16 ranks do not divide its 8 Mamba groups" in err


def test_simulate_a_model_directory_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "simulate", *SMALL, "--model", NEMOTRON, "--tp", "2",
                           "--mode", "accounting", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["layout"]["preset"] == "Nemotron-H-8B-Base-8K@tp2"
    groups = {g["kind"]: g for g in data["layout"]["groups"]}
    assert groups["mamba"]["real_page_bytes"] == 4_255_744 // 2
    assert data["offload"]["requests"] == 12


def test_simulate_bytes_mode_and_sweep_take_a_config_json(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "simulate", *SMALL, "--model", QWEN3 + "/config.json")
    assert status == 0, err
    assert "kvoffload simulate: Qwen3-8B" in out and "wrong bytes 0 [OK]" in out
    status, out, err = run(capsys, "sweep", *SMALL, "--model", QWEN3, "--tp", "2",
                           "--policy", "lru", "--host-capacity", "1GiB", "--json")
    assert status == 0, err
    (point,) = json.loads(out)["points"]
    assert point["preset"] == QWEN3


@pytest.mark.parametrize(("argv", "needle"), [
    (["simulate", "--model", QWEN3, "--preset", "llama3-8b"],
     "--model: give either --model PATH or --preset NAME, not both"),
    (["sweep", "--preset", "gpt-oss-20b", "--model", QWEN3],
     "--model: give either --model PATH or --preset NAME, not both"),
    (["simulate", "--model", "/nonexistent/model"],
     "/nonexistent/model: is neither a model directory"),
    (["simulate", "--tp", "3"],
     "gpt-oss-20b@tp3: 3 ranks do not divide its 64 attention heads"),
    (["simulate", "--tp", "0"], "--tp: must be at least 1"),
    (["sweep", "--model", str(CONFIGS / "Falcon-H1-7B-Instruct"), "--tp", "3"],
     "3 ranks cannot share its 2 KV heads"),
    (["presets", "--model", QWEN3, "--tp", "5"], "5 ranks do not divide its 32 attention heads"),
])
def test_model_mistakes_exit_2_with_one_clear_line(capsys: pytest.CaptureFixture[str],
                                                   argv: list[str], needle: str) -> None:
    status, out, err = run(capsys, *argv)
    assert status == 2
    assert needle in err and err.count("\n") == 1 and err.startswith("error: ")
    assert "Traceback" not in err and out == ""
    if "ranks" in needle:
        assert "(option --tp)" in err


def test_an_unknown_architecture_is_named(capsys: pytest.CaptureFixture[str],
                                          tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "rwkv", "architectures": ["RwkvForCausalLM"]}))
    status, _, err = run(capsys, "simulate", "--model", str(tmp_path), "--quiet")
    assert status == 2
    assert "model_type: architecture 'rwkv' (RwkvForCausalLM) is not one kvoffload" in err
