"""The pieces of ``benchmarks/vllm_e2e.py``, and one short run of it on a real engine.

The workload, the figures and the exit-status guard are checked on plain data; the run
starts real vLLM engines (the benchmark's Llama-shaped model, short prompts) and checks
that loaded KV gives the same greedy answers as recompute and that hits were recorded.
No time is asserted: the benchmark prints its ratios, it does not judge them.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from pathlib import Path

import pytest

from integration.markers import requires_vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from e2e_engine import (
    CONFIGURATIONS,
    RequestRecord,
    RunResult,
    RunSettings,
    connector_options,
    parse_configurations,
)
from e2e_models import MODELS, parse_models
from e2e_report import output_problems, percentile, ratios, summarize
from e2e_workload import Conversations, Kind, WorkloadShape, schedule

SHAPE = WorkloadShape(system_tokens=8, documents=2, document_tokens=40, conversations=4,
                      turns=3, question_tokens=5, answer_tokens=3)


def test_the_schedule_sends_turns_in_order_and_neighbours_differ_in_document() -> None:
    turns = schedule(SHAPE)
    assert len(turns) == SHAPE.num_requests == 12
    assert [(t.turn, t.conversation) for t in turns] == [(t, c) for t in range(3)
                                                          for c in range(4)]
    assert [t.kind for t in turns[:4]] == [Kind.NEW_DOCUMENT, Kind.NEW_DOCUMENT,
                                           Kind.SHARED_DOCUMENT, Kind.SHARED_DOCUMENT]
    assert all(t.kind is Kind.NEXT_TURN for t in turns[4:])
    assert all(a.document != b.document for a, b in itertools.pairwise(turns))


def test_a_later_turn_resends_the_history_with_the_answer() -> None:
    conversations = Conversations(SHAPE)
    first, *_ = schedule(SHAPE)
    prompt = conversations.prompt(first)
    assert len(prompt) == SHAPE.system_tokens + SHAPE.document_tokens + SHAPE.question_tokens
    conversations.record(first, prompt, [7, 8, 9])
    second = schedule(SHAPE)[4]
    assert second.conversation == first.conversation
    follow_up = conversations.prompt(second)
    assert follow_up[:len(prompt) + 3] == [*prompt, 7, 8, 9]
    assert len(follow_up) == len(prompt) + 3 + SHAPE.question_tokens
    # Conversations about the same document share system prompt and document exactly.
    third = schedule(SHAPE)[2]
    shared = SHAPE.system_tokens + SHAPE.document_tokens
    assert conversations.prompt(third)[:shared] == prompt[:shared]
    assert conversations.prompt(third) != prompt
    assert Conversations(SHAPE).prompt(first) == prompt  # seeded: the same in every run
    assert SHAPE.longest_prompt == 8 + 40 + 3 * 5 + 2 * 3


def test_a_turn_before_its_conversation_began_is_refused() -> None:
    with pytest.raises(ValueError, match="before its first turn"):
        Conversations(SHAPE).prompt(schedule(SHAPE)[4])


@pytest.mark.parametrize(("change", "message"), [
    ({"turns": 0}, "--turns must be at least 1"),
    ({"documents": 5, "conversations": 4}, "must be at least --documents"),
    ({"system_tokens": -1}, "--system-tokens must be 0 or more"),
])
def test_bad_workload_sizes_name_the_flag(change: dict[str, int], message: str) -> None:
    import dataclasses

    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SHAPE, **change)


def test_model_and_configuration_lists_are_checked() -> None:
    assert [m.name for m in parse_models("all")] == list(MODELS)
    assert [m.name for m in parse_models("granite, llama,granite")] == ["granite", "llama"]
    with pytest.raises(ValueError, match="unknown model mistral"):
        parse_models("llama,mistral")
    assert [c.name for c in parse_configurations("host")] == ["none", "host"]
    assert [c.name for c in parse_configurations("restart,disk")] == [
        "none", "disk", "restart"]
    with pytest.raises(ValueError, match="restarts on the disk that 'disk' fills"):
        parse_configurations("restart")
    with pytest.raises(ValueError, match="unknown configuration ssd"):
        parse_configurations("ssd")


def test_connector_options_per_configuration(tmp_path: Path) -> None:
    settings = RunSettings(SHAPE, 1 << 30, 32 << 20, None, tmp_path, "redis://127.0.0.1:1/0")
    assert connector_options(CONFIGURATIONS["none"], settings) is None
    assert connector_options(CONFIGURATIONS["host"], settings) == {
        "host_memory_bytes": 1 << 30, "tiers": ["host"]}
    disk = connector_options(CONFIGURATIONS["disk"], settings)
    restart = connector_options(CONFIGURATIONS["restart"], settings)
    assert disk is not None and restart is not None
    assert disk["host_memory_bytes"] == 32 << 20
    assert disk["disk_write_mode"] == "write_through"
    assert restart["disk_path"] == disk["disk_path"] == str(tmp_path / "disk")
    redis = connector_options(CONFIGURATIONS["redis"], settings)
    assert redis is not None and redis["remote_url"] == "redis://127.0.0.1:1/0"


def test_engine_cache_sizing_counts_blocks_as_vllm_does() -> None:
    # 5120 tokens are 40 blocks of 128; 1.6 requests are 64 blocks of 8 layers x 128 KiB.
    assert MODELS["llama"].engine_cache_bytes(5120, 1.6) == 64 << 20
    # Gemma-like: 40 full blocks + 3 sliding groups x 21 blocks, pages of 2 layers.
    assert MODELS["gemma3"].engine_cache_bytes(5120, 1.0) == 103 * 2 * 128 * 1024
    # Granite-like: 14 full blocks of 384 + 3 Mamba groups x 3 blocks.
    assert MODELS["granite"].engine_cache_bytes(5120, 1.0) == 23 * 2 * 384 * 1024


def _record(index: int, kind: Kind, ttft: float, answer: list[int]) -> RequestRecord:
    from e2e_workload import Turn

    return RequestRecord(Turn(index, index, 0, 0, kind), 100, 0, ttft, ttft + 1.0, answer)


def _result(name: str, ttfts: list[float], answers: list[list[int]],
            hits: int) -> RunResult:
    kinds = [Kind.NEW_DOCUMENT] + [Kind.NEXT_TURN] * (len(ttfts) - 1)
    records = [_record(i, k, t, a) for i, (k, t, a) in enumerate(zip(kinds, ttfts, answers,
                                                                      strict=True))]
    return RunResult(CONFIGURATIONS[name], records, 1.0, sum(ttfts), 1.25,
                     {"hit_tokens": hits})


def test_percentiles_and_ratios() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 90) == pytest.approx(3.7)
    assert math.isnan(percentile([], 50))
    base = summarize(_result("none", [4.0, 2.0, 2.0], [[1], [2], [3]], 0))
    fast = summarize(_result("host", [4.0, 0.1, 0.1], [[1], [2], [3]], 512))
    r = ratios(base, fast)
    assert r.revisit_ttft_p50 == pytest.approx(20.0)
    assert r.ttft_p50 == pytest.approx(2.0 / 0.1)
    assert r.total == pytest.approx(8.0 / 4.2)
    assert fast.tier_shares == {"host": 1.0}
    assert base.tier_shares == {}


def test_the_guard_reports_differing_outputs_and_missing_hits() -> None:
    base = _result("none", [1.0, 1.0], [[1, 2], [3, 4]], 0)
    same = _result("host", [1.0, 0.1], [[1, 2], [3, 4]], 256)
    assert output_problems("llama", [base, same]) == []
    changed = _result("disk", [1.0, 0.1], [[1, 2], [3, 5]], 256)
    no_hit = _result("redis", [1.0, 1.0], [[1, 2], [3, 4]], 0)
    problems = output_problems("llama", [base, changed, no_hit])
    assert problems == [
        "llama disk: greedy outputs differ from the run without offloading in requests [1]",
        "llama redis: the connector recorded no hit"]


def test_redis_server_starts_and_answers() -> None:
    import shutil

    from e2e_redis import _answers_ping, redis_server

    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed; run scripts/install_redis.sh")
    with redis_server() as url:
        port = int(url.rsplit(":", 1)[1].split("/")[0])
        assert _answers_ping(port)
    assert not _answers_ping(port)


def test_a_missing_redis_server_is_a_clear_error(tmp_path: Path) -> None:
    from e2e_redis import redis_server

    with pytest.raises(RuntimeError, match="leave the Redis configuration out with --configs"), \
            redis_server(binary=str(tmp_path / "no-such-redis-server")):
        pass


@pytest.mark.parametrize("argv", [["--models", "mistral"], ["--configs", "restart"],
                                  ["--turns", "0"], ["--host-memory", "lots"]])
def test_bad_arguments_exit_2_with_the_reason(argv: list[str],
                                             capsys: pytest.CaptureFixture[str]) -> None:
    import vllm_e2e

    with pytest.raises(SystemExit) as exit_info:
        vllm_e2e.main(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


@requires_vllm
def test_the_trace_wrapper_passes_each_call_through_and_sees_it() -> None:
    import e2e_trace  # imports the connector's vLLM-side modules

    class Box:
        def add(self, a: int, b: int) -> int:
            return a + b

    seen: list[tuple[int, tuple[int, ...]]] = []
    e2e_trace.wrap(Box, "add", lambda _self, result, seconds, *args:
                   seen.append((result, args)) if seconds >= 0 else None)
    assert Box().add(2, 3) == 5
    assert Box().add(4, 4) == 8
    assert seen == [(5, (2, 3)), (8, (4, 4))]
    assert Box.add.__name__ == "add"


@pytest.mark.vllm
@requires_vllm
def test_a_short_run_matches_recompute_and_hits(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark on the Llama-shaped model: vLLM alone, host memory, small host
    memory + disk, and a restarted engine on that disk; every answer equal, hits in
    every offloading run, from the disk after the restart."""
    import vllm_e2e

    argv = ["--models", "llama", "--configs", "host,disk,restart", "--json",
            "--workdir", str(tmp_path), "--system-tokens", "64", "--documents", "2",
            "--document-tokens", "448", "--conversations", "2", "--turns", "2",
            "--question-tokens", "16", "--answer-tokens", "4"]
    assert vllm_e2e.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == []
    (model,) = report["models"]
    configs = {c["config"]: c for c in model["configs"]}
    assert list(configs) == ["none", "host", "disk", "restart"]
    assert configs["none"]["hit_tokens"] == 0
    for name in ("host", "disk", "restart"):
        assert configs[name]["hit_tokens"] > 0, name
        assert configs[name]["connector"]["failed_loads"] == 0
    # The restarted engine's host memory started empty: its first loads came from disk.
    assert configs["restart"]["loads_by_tier"].get("disk", 0) > 0
    # Every request of a restarted engine finds its prefix; the first run computed its
    # document once.
    assert all(r["cached_tokens"] > 0 for r in configs["restart"]["requests"])
    assert configs["none"]["requests"][0]["cached_tokens"] == 0
