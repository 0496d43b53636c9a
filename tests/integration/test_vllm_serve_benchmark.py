"""The pieces of ``benchmarks/vllm_serve.py``, and its short run against vLLM's real OpenAI
server with vLLM's own benchmark client.

Workloads, metric parsing and the exit-status guard are checked on plain data; the run
starts real servers (the tiny model, no offloading and kvoffload with host memory) and
checks that every request succeeded, that the greedy outputs are equal request by request,
and that kvoffload served loads. No time is asserted: the benchmark prints its ratios.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from integration.markers import requires_vllm

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from serve_report import HEADER, RunFigures, figures, problems, revisits, table_rows
from serve_runs import ClientRun, Metrics
from serve_setup import ChatShape, chat_trace, longest_request, mooncake_excerpt, write_trace


def test_chat_sessions_share_documents_in_pairs_and_resend_their_history() -> None:
    shape = ChatShape(sessions=4, turns=3, document_chunks=5, turn_chunks=2, system_chunks=1)
    records = chat_trace(shape, chunk_tokens=16)
    assert len(records) == shape.num_requests() == 12
    first_round = [list(r["hash_ids"]) for r in records[:4]]
    documents = {tuple(ids[1:6]) for ids in first_round}
    assert len(documents) == 2  # sessions 2k and 2k+1 read the same document
    assert all(ids[0] == 0 for ids in first_round)  # the shared system prompt
    for earlier, later in ((records[i], records[j]) for i in range(4) for j in range(4, 8)):
        a, b = list(earlier["hash_ids"]), list(later["hash_ids"])
        if b[:len(a)] == a:
            assert len(b) == len(a) + shape.turn_chunks
            break
    else:
        pytest.fail("no second turn resends a first turn's prompt")
    assert all(r["input_length"] == len(r["hash_ids"]) * 16 for r in records)
    assert longest_request(records) == max(len(r["hash_ids"]) for r in records) * 16 + 32


def test_the_mooncake_excerpt_keeps_whole_conversations_scaled(tmp_path: Path) -> None:
    trace = write_trace([
        {"timestamp": 0, "input_length": 1500, "output_length": 400, "hash_ids": [0, 5, 6]},
        {"timestamp": 1, "input_length": 900, "output_length": 9, "hash_ids": [0, 9]},
        {"timestamp": 2, "input_length": 100, "output_length": 3, "hash_ids": [0, 7, 1, 2]},
        {"timestamp": 4, "input_length": 9000, "output_length": 3, "hash_ids": [0, 5, 8]},
        {"timestamp": 5, "input_length": 100, "output_length": 3, "hash_ids": [0, 7, 1, 3]},
    ], tmp_path / "t.jsonl")
    records = mooncake_excerpt(trace, requests=5, chunk_tokens=64, output_tokens=16,
                               max_chunks=3)
    # [0, 9] returns never; the conversation of [0, 7, ...] has prompts over 3 chunks.
    assert [r["hash_ids"] for r in records] == [[0, 5, 6], [0, 5, 8]]
    assert [(r["input_length"], r["output_length"]) for r in records] == [(192, 16), (192, 3)]
    with pytest.raises(ValueError, match="no conversation"):
        mooncake_excerpt(trace, requests=1, chunk_tokens=64, output_tokens=16)


def test_a_revisit_returns_to_at_least_half_its_prompt() -> None:
    records = [{"hash_ids": [0, 1, 2, 3]}, {"hash_ids": [0, 1, 2, 3, 4]},
               {"hash_ids": [0, 5, 6, 7]}, {"hash_ids": [0, 1, 8, 9]}, {"hash_ids": [0, 5]}]
    assert revisits(records) == [False, True, False, True, True]


def test_metrics_parse_sum_by_label_and_difference() -> None:
    before = Metrics.parse(
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 10\n')
    after = Metrics.parse(
        '# TYPE vllm:prompt_tokens_by_source counter\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 40\n'
        'vllm:prompt_tokens_by_source_total{engine="0",source="external_kv_transfer"} 60\n'
        '# TYPE vllm:kvoffload_host_pinned_slots gauge\n'
        'vllm:kvoffload_host_pinned_slots{engine="0",model_name="m"} 0\n')
    delta = after.minus(before)
    assert delta.by_label("vllm:prompt_tokens_by_source_total", "source") == {
        "local_compute": 30.0, "external_kv_transfer": 60.0}
    assert after.total("vllm:prompt_tokens_by_source_total") == 100.0
    assert after.total("vllm:prompt_tokens_by_source_total", source="local_compute") == 40.0
    assert after.total("vllm:kvoffload_host_pinned_slots") == 0.0


def _run(config: str, outputs: tuple[str, ...], loaded: float = 0.5,
         failed: int = 0) -> RunFigures:
    return RunFigures(config=config, workload="chat", concurrency=4, requests=len(outputs),
                      failed=failed, duration_s=1.0, request_throughput=2.0,
                      ttft_p50_ms=10, ttft_p90_ms=20, ttft_p99_ms=30,
                      revisit_ttft_p50_ms=5, itl_p50_ms=1,
                      itl_p99_ms=2, cached_share=0.5, loaded_share=loaded,
                      loads_by_tier={"host": 3}, outputs=outputs)


def test_a_run_reads_kvoffloads_waits_loads_and_deferrals_from_the_server() -> None:
    result = {"completed": 2, "failed": 0, "duration": 4.0, "request_throughput": 0.5,
              "p50_ttft_ms": 10, "p90_ttft_ms": 20, "p99_ttft_ms": 30, "p50_itl_ms": 1,
              "p99_itl_ms": 2, "ttfts": [0.01, 0.02], "generated_texts": ["a", "b"]}
    delta = Metrics.parse(
        'vllm:prompt_tokens_by_source_total{source="local_compute"} 40\n'
        'vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} 60\n'
        'vllm:kvoffload_flush_wait_seconds_total{engine="0"} 0.25\n'
        'vllm:kvoffload_load_jobs_total{engine="0"} 3\n'
        'vllm:kvoffload_deferred_lookups_total{engine="0"} 2\n'
        '# TYPE vllm:request_queue_time_seconds histogram\n'
        'vllm:request_queue_time_seconds_sum{engine="0"} 0.5\n'
        'vllm:request_queue_time_seconds_count{engine="0"} 2\n'
        '# TYPE vllm:request_prefill_time_seconds histogram\n'
        'vllm:request_prefill_time_seconds_sum{engine="0"} 3.0\n'
        'vllm:request_prefill_time_seconds_count{engine="0"} 2\n')
    run = figures("host", "chat", 4, ClientRun(result, 4.0), delta=delta,
                  revisit=[False, True])
    assert (run.flush_wait_s, run.load_jobs, run.loaded_tokens, run.deferred_lookups) == (
        0.25, 3, 60, 2)
    assert (run.queue_mean_ms, run.prefill_mean_ms) == (250.0, 1500.0)
    base = figures("none", "chat", 4, ClientRun(result, 4.0), delta=Metrics.parse(""),
                   revisit=[False, True])
    assert math.isnan(base.queue_mean_ms)  # no request counted: no mean
    rows = table_rows("tiny", [base, run])
    wait = HEADER.index("flush wait")
    assert [row[wait] for row in rows] == ["-", "0.25 s"]


def test_the_guard_reports_differing_outputs_failures_and_missing_hits() -> None:
    base = _run("none", ("a", "b"), loaded=0)
    assert problems("tiny", [base, _run("host", ("a", "b"))]) == []
    found = problems("tiny", [base, _run("host", ("a", "x")), _run("disk", ("a", "b"), 0),
                              _run("redis", ("a", "b"), failed=1)])
    assert len(found) == 3
    assert "1 of 2 outputs differ" in found[0] and "requests [1]" in found[0]
    assert "loaded nothing" in found[1]
    assert "1 requests failed" in found[2]


@pytest.mark.parametrize(("argv", "said"), [
    (["--models", "mistral"], "--models: unknown mistral"),
    (["--configs", "cloud"], "--configs: unknown cloud"),
    (["--concurrency", "four"], "--concurrency"),
    (["--concurrency", "0"], "--concurrency"),
    (["--turns", "0"], "--turns"),
    (["--sessions", "0"], "--sessions")])
def test_bad_arguments_stop_with_what_to_change(argv: list[str], said: str) -> None:
    import vllm_serve

    with pytest.raises(SystemExit) as stop:
        vllm_serve.make_plan(vllm_serve.build_parser().parse_args(argv))
    assert said in str(stop.value.code)


def test_chat_sessions_follow_the_load_unless_given() -> None:
    import vllm_serve

    parse = vllm_serve.build_parser().parse_args
    plan = vllm_serve.make_plan(parse(["--concurrency", "4,8"]))
    assert [vllm_serve.chat_shape(plan, load).sessions for load in plan.loads] == [16, 32]
    fixed = vllm_serve.make_plan(parse(["--concurrency", "4,8", "--sessions", "6"]))
    assert [vllm_serve.chat_shape(fixed, load).sessions for load in fixed.loads] == [6, 6]


@requires_vllm
def test_the_word_tokenizer_maps_ids_and_words_one_to_one(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from serve_setup import add_word_tokenizer

    add_word_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    ids = [3, 17, 31999, 5]
    text = tokenizer.decode(ids)
    assert text == "w3 w17 w31999 w5"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    assert sorted(tokenizer.all_special_ids) == [0, 1, 2]


@pytest.mark.vllm
@requires_vllm
def test_a_short_run_against_the_server_matches_and_hits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vllm_serve.py --quick``: the OpenAI server without offloading and with kvoffload's
    host memory, vLLM's benchmark client at concurrency 4; equal outputs, loads served."""
    import vllm_serve

    assert vllm_serve.main(["--quick", "--json", "--workdir", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == []
    runs = {r["config"]: r for r in report["runs"]}
    assert list(runs) == ["none", "host"]
    assert all(r["failed"] == 0 and r["requests"] == 32 for r in runs.values())
    assert runs["none"]["loaded_share"] == 0
    assert runs["host"]["loaded_share"] > 0
    assert runs["host"]["loads_by_tier"].get("host", 0) > 0
    assert runs["host"]["differing_outputs"] == []
    assert runs["host"]["cached_share"] > runs["none"]["cached_share"]


@pytest.mark.vllm
@requires_vllm
@pytest.mark.skipif(os.environ.get("KVOFFLOAD_SERVE_FAULTS") != "1",
                    reason="about 4 minutes: set KVOFFLOAD_SERVE_FAULTS=1 to run the faults "
                           "under load (vllm_serve.py --faults --quick)")
def test_faults_under_load_leave_outputs_right_and_nothing_pinned(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vllm_serve.py --faults --quick``: Redis killed and restarted, the disk filled,
    clients hanging up, while vLLM's client runs; no failure, equal outputs, no pin."""
    import vllm_serve

    assert vllm_serve.main(["--faults", "--quick", "--json", "--workdir",
                            str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["problems"] == []
    assert report["failed_requests"] == 0 and report["differing_outputs"] == []
    assert report["pinned_slots_at_end"] == 0 and report["running_at_end"] == 0
    assert report["aborted_streams"] > 0
    assert any("Redis killed" in event for event in report["faults"])
