"""Soak runs on real model presets: faults at a high rate, every byte verified, the
bookkeeping checked at intervals, and a clean verdict (``SoakReport.ok``).

The fast runs here take seconds. ``KVOFFLOAD_SOAK=1`` adds the long suite: every preset,
several seeds and workloads, and the first 1,500 requests of the shared trace.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.faults.plan import FaultPlan
from kvoffload.faults.soak import SoakConfig, SoakReport, run_soak
from kvoffload.sim.simulation import Mode, SimulationConfig
from kvoffload.workloads import builtin_workload, read_mooncake_trace

LONG = os.environ.get("KVOFFLOAD_SOAK") == "1"
long_only = pytest.mark.skipif(not LONG, reason="long soak suite: set KVOFFLOAD_SOAK=1")
TRACE = Path(os.environ.get(
    "KVOFFLOAD_TRACE", Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"
    / "mooncake_conversation_trace.jsonl"))


def soak(preset: str, workload: list, *, rate: float, seed: int = 0,
         mode: Mode = Mode.BYTES, engine_tokens: int = 65536) -> SoakReport:
    sim = SimulationConfig(preset=preset, mode=mode, engine_tokens=engine_tokens,
                           host_capacity_bytes=8 << 30, baseline=False,
                           decode_tokens_per_step=16, eviction_policy="lru")
    plan = FaultPlan(rate, seed=seed, hang_s=10.0, min_reset_interval_s=60.0)
    report = run_soak(SoakConfig(sim, plan, load_deadline_s=2.0, check_interval_s=10.0),
                      workload)
    assert report.ok, report.text()
    assert report.faults_injected > 0
    assert report.integrity_checks > 0
    return report


def test_a_hybrid_window_model_soaks_clean() -> None:
    report = soak("gpt-oss-20b", builtin_workload("agentic", 1)[:40], rate=0.15, seed=1)
    assert report.verified_blocks > 0 and report.audited_host_blocks > 0


def test_a_hybrid_mamba_model_soaks_clean() -> None:
    report = soak("nemotron-h-8b", builtin_workload("agentic", 0)[:40], rate=0.2, seed=2)
    assert report.verified_blocks > 0


def test_an_accounting_soak_on_the_trace_start_is_clean() -> None:
    if not TRACE.is_file():
        pytest.skip(f"no trace at {TRACE}")
    soak("gpt-oss-20b", list(read_mooncake_trace(TRACE, limit=120)), rate=0.1,
         mode=Mode.ACCOUNTING, engine_tokens=1 << 20)


def test_simulate_faults_prints_the_soak_figures(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["simulate", "--faults", "0.2", "--workload", "agentic", "--limit", "20",
                   "--engine-tokens", "64k", "--load-deadline", "2", "--hang", "10",
                   "--json"])
    out, err = capsys.readouterr()
    data = json.loads(out)
    assert status == 0 and data["ok"] is True, err
    assert data["wrong_bytes"] == 0 and data["faults_injected"] > 0
    assert data["pinned"]["final"] == 0 and data["pending"]["final"] == 0
    # The text form shows the same figures, one per line, ending with the verdict.
    status = main(["simulate", "--faults", "0.2", "--workload", "agentic", "--limit", "20",
                   "--engine-tokens", "64k", "--load-deadline", "2", "--hang", "10"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert status == 0 and lines[0] == "soak:"
    assert lines[-1].split() == ["verdict", "OK"]
    wrong = next(line for line in lines if line.strip().startswith("wrong bytes"))
    assert wrong.split()[2] == "0"


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "nemotron-h-8b"])
def test_a_soak_with_real_disk_and_redis_tiers_and_tier_faults_is_clean(
        preset: str, tmp_path: Path) -> None:
    """Transfer faults plus tier I/O errors, blocks damaged at rest and tier outages, on
    a real directory and a real redis-server behind a small host tier."""
    from tiers.tier_kit import redis_server

    hybrid = preset == "nemotron-h-8b"
    with redis_server() as server:
        sim = SimulationConfig(preset=preset, engine_tokens=16384,
                               baseline=False,
                               host_capacity_bytes=(400 << 20) if hybrid else (64 << 20),
                               decode_tokens_per_step=16, disk_capacity_bytes=64 << 30,
                               disk_path=str(tmp_path), remote_url=server.url,
                               eviction_policy="lru")
        plan = FaultPlan(0.1, seed=3, hang_s=10.0, min_reset_interval_s=60.0)
        report = run_soak(SoakConfig(sim, plan, load_deadline_s=2.0, check_interval_s=10.0,
                                     tier_faults=0.1, num_workers=1),
                          builtin_workload("agentic", 2)[:40])
    assert report.ok, report.text()
    tier_faults = {k: n for k, n in report.faults.items() if k.startswith(("disk", "remote"))}
    assert sum(tier_faults.values()) > 0, report.faults
    assert report.wrong_bytes == 0 and report.verified_blocks > 0
    assert report.host_hit_rate > 0  # blocks came back through the faulty tiers


@long_only
@pytest.mark.parametrize("preset", ["llama3-8b", "gpt-oss-20b", "gemma3-27b",
                                    "nemotron-h-8b"])
@pytest.mark.parametrize("workload", ["agentic", "chat", "shared-prefix"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_long_soak_every_preset_workload_and_seed(preset: str, workload: str,
                                                  seed: int) -> None:
    soak(preset, builtin_workload(workload, seed)[:150], rate=0.05, seed=seed)


@long_only
def test_long_soak_on_the_trace_in_bytes_mode() -> None:
    if not TRACE.is_file():
        pytest.skip(f"no trace at {TRACE}")
    soak("gpt-oss-20b", list(read_mooncake_trace(TRACE, limit=1500)), rate=0.02,
         engine_tokens=1 << 20)
