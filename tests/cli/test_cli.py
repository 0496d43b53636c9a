"""The ``kvoffload`` command: outputs, JSON, plots, and clean errors (exit 2, no traceback)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.cli import main
from kvoffload.models.presets import PRESETS
from kvoffload.workloads import builtin_workload, count_trace_lines

TRACE = Path(os.environ.get(
    "KVOFFLOAD_TRACE",
    Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
    / "mooncake_conversation_trace.jsonl"))

SMALL = ["--workload", "chat", "--limit", "12", "--engine-tokens", "6000", "--quiet"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_simulate_prints_both_runs_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "simulate", *SMALL)
    assert status == 0, err
    assert "without offload" in out and "with offload" in out
    assert "prompt tokens from host tier" in out
    assert "wrong bytes 0 [OK]" in out
    assert "pages scaled to" in out  # the report says what was moved


def test_simulate_json_has_both_runs_and_real_sizes(capsys: pytest.CaptureFixture[str],
                                                     tmp_path: Path) -> None:
    plot = tmp_path / "run.png"
    status, out, _ = run(capsys, "simulate", *SMALL, "--json", "--plot", str(plot),
                         "--preset", "nemotron-h-8b", "--block-size", "32")
    assert status == 0
    data = json.loads(out)
    assert data["layout"]["preset"] == "nemotron-h-8b"
    assert data["layout"]["scaled"] is True
    groups = {g["kind"]: g for g in data["layout"]["groups"]}
    assert groups["mamba"]["real_page_bytes"] > groups["mamba"]["moved_page_bytes"]
    offload, baseline = data["offload"], data["baseline"]
    assert offload["requests"] == baseline["requests"] == 12
    assert offload["wrong_bytes"] == 0 and offload["verified_blocks"] > 0
    assert baseline["host_hit_tokens"] == 0
    assert [g["kind"] for g in offload["groups"]] == ["full_attention", "mamba"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_simulate_accounting_mode_on_a_trace_slice(capsys: pytest.CaptureFixture[str]) -> None:
    if not TRACE.exists():
        pytest.skip("shared trace not present")
    status, out, _ = run(capsys, "simulate", "--trace", str(TRACE), "--limit", "100",
                         "--engine-tokens", "200k", "--json", "--no-baseline",
                         "--host-capacity", "64GiB")
    assert status == 0
    data = json.loads(out)
    assert data["config"]["mode"] == "accounting"
    assert data["baseline"] is None
    assert data["offload"]["requests"] == 100
    assert data["offload"]["host_hit_tokens"] > 0


def test_simulate_with_a_disk_tier_reports_its_hits(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "simulate", *SMALL, "--host-capacity", "64MiB",
                         "--disk-capacity", "8GiB")
    assert status == 0
    assert "accounting mode" in out  # lower tiers switch the default mode
    assert "prompt tokens from disk tier (promoted)" in out and "disk tier holds" in out


def test_sweep_runs_the_grid_and_plots(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    plot = tmp_path / "sweep.png"
    status, out, _ = run(capsys, "sweep", *SMALL, "--policy", "lru,arc",
                         "--host-capacity", "64MiB,1GiB", "--json", "--plot", str(plot))
    assert status == 0
    points = json.loads(out)["points"]
    assert [(p["policy"], p["host_capacity_bytes"]) for p in points] == [
        ("lru", 64 << 20), ("lru", 1 << 30), ("arc", 64 << 20), ("arc", 1 << 30)]
    small, large = points[0], points[1]
    assert large["host_hit_rate"] >= small["host_hit_rate"]
    assert large["baseline_ttft_mean_s"] == small["baseline_ttft_mean_s"]
    assert plot.exists()
    status, out, _ = run(capsys, "sweep", *SMALL, "--policy", "lru", "--host-capacity", "1GiB")
    assert status == 0 and "speed-up" in out and "gpt-oss-20b" in out


def test_sweep_capacity_fractions_of_the_working_set_and_the_90_percent_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "sweep", *SMALL, "--preset", "gemma3-27b",
                           "--policy", "lru,arc,value", "--capacity-fraction", "0.5,0.05,1",
                           "--host-accounting", "bytes", "--json")
    assert status == 0, err
    data = json.loads(out)
    assert data["host_accounting"] == "bytes"
    ref = data["references"]["gemma3-27b"]
    points = data["points"]
    assert [(p["policy"], p["capacity_fraction"]) for p in points] == [
        (policy, f) for policy in ("lru", "arc", "value") for f in (0.05, 0.5, 1.0)]
    for p in points:
        assert p["host_capacity_bytes"] >= int(p["capacity_fraction"] * ref["working_set_bytes"])
        assert p["host_bytes_peak"] <= p["host_capacity_bytes"]
        assert p["prefill_tokens_saved"] == pytest.approx(
            p["baseline_prefill_tokens_computed"] - p["prefill_tokens_computed"])
    # The whole working set holds everything: LRU there is the unbounded run again.
    full_lru = points[2]
    assert full_lru["host_hit_rate"] == pytest.approx(ref["host_hit_rate"])
    status, out, _ = run(capsys, "sweep", *SMALL, "--preset", "gemma3-27b", "--policy",
                         "lru,value", "--capacity-fraction", "0.1,1", "--host-accounting",
                         "bytes")
    assert status == 0
    assert "of working set" in out and "90 % of the unbounded" in out and "vs lru" in out


def test_sweep_sessions_size_the_workload_and_the_label_names_every_seed(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sweep", "--workload", "agentic", "--engine-tokens", "32k", "--quiet",
            "--policy", "lru", "--host-capacity", "1GiB", "--seeds", "0,1", "--json"]
    status, out, _ = run(capsys, *argv)
    assert status == 0
    default = json.loads(out)
    assert default["workload"] == "agentic (mean of seeds 0, 1)"
    status, out, _ = run(capsys, *argv, "--sessions", "6")
    assert status == 0
    sized = json.loads(out)
    assert sized["workload"] == "agentic, 6 sessions (mean of seeds 0, 1)"
    assert (default["sessions"], sized["sessions"]) == (None, 6)
    assert sized["points"][0]["requests"] > default["points"][0]["requests"]
    # Seeds differ in their number of requests: a point gives the mean.
    one = [len(builtin_workload("agentic", seed, 6)) for seed in (0, 1)]
    assert one[0] != one[1]
    assert sized["points"][0]["requests"] == round(sum(one) / 2)


def test_presets_lists_per_token_and_per_state_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "presets")
    assert status == 0
    for name in PRESETS:
        assert name in out
    assert "per token" in out and "per state" in out
    status, out, _ = run(capsys, "presets", "--json")
    data = {p["name"]: p for p in json.loads(out)}
    assert data["llama3-8b"]["bytes_per_token"] == 32 * 8 * 128 * 2 * 2
    assert data["nemotron-h-8b"]["bytes_per_state"] == PRESETS["nemotron-h-8b"].bytes_per_state
    assert data["nemotron-h-8b"]["block_size"] % 16 == 0


@pytest.mark.parametrize(("argv", "needle"), [
    (["simulate", "--preset", "gpt-5"], "--preset: unknown preset 'gpt-5'"),
    (["simulate", "--host-capacity", "lots"], "--host-capacity: 'lots' is not a size"),
    (["simulate", "--policy", "fifo"], "--policy: unknown policy 'fifo'"),
    (["simulate", "--host-capacity", "1KiB", "--limit", "2"],
     "host_capacity_bytes: 1024 bytes cannot hold one offloaded block"),
    (["simulate", "--engine-tokens", "64", "--limit", "3"], "Raise the engine capacity"),
    (["simulate", "--trace", "/nonexistent/trace.jsonl"],
     "/nonexistent/trace.jsonl:0: field '<file>': cannot be opened"),
    (["sweep", "--seeds", "x"], "--seeds: give integers"),
    (["sweep", "--capacity-fraction", "2"], "--capacity-fraction: every share"),
    (["sweep", "--workload", "agentic", "--sessions", "0"], "--sessions: must be at least 1"),
    (["simulate", "--trace", str(TRACE), "--sessions", "8"],
     "--sessions: sizes a built-in workload"),
])
def test_mistakes_exit_2_with_one_clear_line(capsys: pytest.CaptureFixture[str],
                                             argv: list[str], needle: str) -> None:
    status, out, err = run(capsys, *argv, "--quiet")
    assert status == 2
    assert needle in err
    assert "Traceback" not in err and out == ""
    if "host_capacity_bytes" in needle:
        assert "(option --host-capacity)" in err


def test_a_malformed_trace_line_is_named(capsys: pytest.CaptureFixture[str],
                                         tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 20, "output_length": 2, "hash_ids": [1]}
    bad = {"timestamp": 5, "input_length": 600, "output_length": 2, "hash_ids": [1]}
    trace.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    status, _, err = run(capsys, "simulate", "--trace", str(trace), "--quiet")
    assert status == 2
    assert f"{trace}:2: field 'input_length'" in err and "Traceback" not in err


def test_help_teaches_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["simulate", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and "kvoffload simulate --trace" in out


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=st.sampled_from("a\n \t\r\x1c\u00a0\u00e9"), max_size=40),
       chunk=st.integers(1, 9))
def test_the_progress_total_counts_the_lines_the_reader_reads(
        tmp_path_factory: pytest.TempPathFactory, text: str, chunk: int) -> None:
    """The progress bar's total reads a trace in chunks (a file without line breaks
    costs one chunk of memory, a character may straddle two chunks) and counts exactly
    the lines the trace reader takes for requests (Unicode blanks included)."""
    path = tmp_path_factory.mktemp("count") / "t.jsonl"
    path.write_text(text, encoding="utf-8")
    expected = sum(1 for line in text.split("\n") if line.strip())
    assert count_trace_lines(path, chunk) == expected
