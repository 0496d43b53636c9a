"""``kvoffload simulate --engines N --router R``: the fleet's summary and JSON, the one-engine
fleet equal to the plain run, and clear errors for bad fleet flags."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvoffload.cli import main

TRACE = Path(os.environ.get(
    "KVOFFLOAD_TRACE",
    Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
    / "mooncake_conversation_trace.jsonl"))

SMALL = ["simulate", "--workload", "chat", "--limit", "24", "--engine-tokens", "8k",
         "--host-capacity", "128MiB", "--quiet"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_fleet_summary_has_hits_per_tier_and_per_engine(
        capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, *SMALL, "--engines", "2", "--router", "prefix",
                           "--remote-capacity", "1GiB")
    assert status == 0, err
    assert "2 engines" in out and "accounting mode" in out
    assert "router prefix:" in out and "session id" in out
    for row in ("prefix caches (device)", "from host tiers", "from the shared tier",
                "prefill tokens saved", "without offload", "with offload"):
        assert row in out
    assert "engine  requests  prompt tokens" in out and "shared" in out
    assert "shared tier holds" in out


def test_fleet_json_has_the_per_engine_fields(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, *SMALL, "--engines", "3", "--remote-capacity", "1GiB",
                         "--json")
    assert status == 0
    data = json.loads(out)
    assert data["fleet"]["engines"] == 3 and data["fleet"]["router"] == "round-robin"
    assert data["fleet"]["shared_tier_capacity_bytes"] == 1 << 30
    assert data["config"]["mode"] == "accounting"
    offload = data["offload"]
    assert offload["requests"] == 24 and data["baseline"]["requests"] == 24
    assert len(offload["engines"]) == 3
    for i, engine in enumerate(offload["engines"]):
        assert engine["engine"] == i and engine["routed"] == 8
        for field in ("requests", "prompt_tokens", "engine_hit_rate", "host_hit_rate",
                      "tier_hit_rates", "tier_hit_tokens", "prefill_tokens_saved",
                      "deferral_timeouts"):
            assert field in engine
    assert offload["prefill_tokens_saved"] == sum(
        e["prefill_tokens_saved"] for e in offload["engines"])
    assert set(offload["tier_hit_rates"]) <= {"host", "remote"}
    assert offload["shared_blocks"] > 0


def test_one_engine_fleet_matches_the_plain_run_on_the_trace(
        capsys: pytest.CaptureFixture[str]) -> None:
    if not TRACE.exists():
        pytest.skip("shared trace not present")
    args = ["simulate", "--trace", str(TRACE), "--limit", "40", "--engine-tokens", "200k",
            "--block-size", "64", "--block-size-factor", "4", "--host-capacity", "4GiB",
            "--remote-capacity", "64GiB", "--json", "--quiet", "--no-baseline"]
    status, plain, _ = run(capsys, *args)
    assert status == 0
    for router in ("round-robin", "prefix"):
        status, out, _ = run(capsys, *args, "--engines", "1", "--router", router)
        assert status == 0
        one, fleet = json.loads(plain)["offload"], json.loads(out)["offload"]
        for field in ("engine_hit_tokens", "host_hit_tokens", "prefill_tokens_computed"):
            assert fleet[field] == one[field]
        assert fleet["tier_hit_rates"] == pytest.approx(one["tier_hit_rates"])
        assert fleet["host_hit_tokens"] > 0 and json.loads(out)["baseline"] is None


@pytest.mark.parametrize(("extra", "flag", "needle"), [
    (["--engines", "0"], "--engines", "from 1 to 64"),
    (["--engines", "65"], "--engines", "from 1 to 64"),
    (["--engines", "two"], "--engines", "whole number"),
    (["--engines", "2.5"], "--engines", "whole number"),
    (["--engines", "2", "--router", "random"], "--router", "round-robin or prefix"),
    (["--router", "prefix"], "--router", "add --engines N"),
    (["--engines", "2", "--faults", "0.1"], "--faults", "one engine"),
    (["--engines", "2", "--disk-path", "/tmp/kv", "--disk-capacity", "1GiB"], "--disk-path",
     "--disk-capacity SIZE instead"),
    (["--engines", "2", "--remote-url", "redis://127.0.0.1:6379/0"], "--remote-url",
     "--remote-capacity SIZE instead"),
    (["--engines", "2", "--mode", "bytes"], "--mode", "accounting"),
    (["--engines", "2", "--plot", "fleet.png"], "--plot", "make_fleet_doc.py"),
])
def test_bad_fleet_flags_exit_2_naming_the_flag_and_the_fix(
        capsys: pytest.CaptureFixture[str], extra: list[str], flag: str, needle: str) -> None:
    status = main(["simulate", "--limit", "3", "--quiet", *extra])
    out, err = capsys.readouterr()
    assert status == 2, err
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert flag in lines[0] and needle in lines[0], err
