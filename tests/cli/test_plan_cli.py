"""``kvoffload plan``: sizes that reach 50/90/99 % of the unbounded hit rate, the disk tier,
the ``--kv-transfer-config`` it prints, and errors (``--jobs`` giving the same plan:
``tests/sim/test_plan.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.integrations.vllm.options import ConnectorOptions

# 150 chat requests in a small engine: vLLM's own cache cannot hold the conversations, so
# host memory matters, and each run takes a fraction of a second.
SMALL = ["--workload", "chat", "--limit", "150", "--engine-tokens", "12000", "--quiet",
         "--policy", "lru,value", "--fractions", "0.05,0.2,0.5,1"]


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, object]:
    assert main(["plan", *SMALL, "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def test_memory_needs_grow_with_the_target_and_the_recommendation_starts_vllm(
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--jobs", "1")
    assert plan["unbounded_hit_rate"] > 0  # type: ignore[operator]
    memory = plan["memory"]
    assert isinstance(memory, dict) and set(memory) == {"lru", "value"}
    for needs in memory.values():
        got = [needs[k] for k in ("50%", "90%", "99%")]
        known = [v for v in got if v is not None]
        assert known == sorted(known) and got[0] is not None
    points = plan["points"]
    assert isinstance(points, list) and len(points) == 2 * 4
    # More host memory never serves fewer tokens, for either policy.
    for policy in ("lru", "value"):
        curve = sorted((p for p in points if p["policy"] == policy),
                       key=lambda p: p["host_capacity_bytes"])
        rates = [p["host_hit_rate"] for p in curve]
        assert rates == sorted(rates)
        assert curve[-1]["fraction"] == 1.0
    config = plan["kv_transfer_config"]
    assert isinstance(config, dict) and config["kv_connector"] == "KVOffloadConnector"
    extra = config["kv_connector_extra_config"]
    options = ConnectorOptions.from_extra_config(extra)  # what the connector will accept
    assert options.eviction_policy == plan["recommended_policy"]
    assert options.host_memory_bytes == plan["recommended_host_bytes"]
    assert options.host_memory_bytes % (1 << 30) == 0


def test_a_disk_tier_adds_hits_below_small_host_memory(
        capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_json(capsys, "--jobs", "1", "--disk-capacity", "64GiB")
    points = plan["points"]
    assert isinstance(points, list)
    with_disk = [p for p in points if p["disk"]]
    assert len(with_disk) == 2 * 4
    assert any(p["lower_hit_rate"] > 0 for p in with_disk)
    extra = plan["kv_transfer_config"]["kv_connector_extra_config"]  # type: ignore[index]
    assert extra["tiers"] == ["host", "disk"] and extra["disk_capacity"] == "64GiB"


def test_the_human_report_and_the_plot(capsys: pytest.CaptureFixture[str],
                                       tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    plot = tmp_path / "plan.png"
    assert main(["plan", *SMALL, "--jobs", "1", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "90 % of unbounded" in out and "--kv-transfer-config '" in out
    assert plot.stat().st_size > 10_000


@pytest.mark.parametrize(("argv", "needle"), [
    (["--jobs", "0"], "--jobs: must be between 1"),
    (["--fractions", "0,0.5"], "--fractions: every share must be in (0, 1]"),
    (["--fractions", "half"], "--fractions: give shares"),
    (["--policy", "fifo"], "fifo"),
    (["--remote-capacity", "1TiB"], "kvoffload simulate --engines N"),
])
def test_bad_flags_are_one_clear_error(capsys: pytest.CaptureFixture[str], argv: list[str],
                                       needle: str) -> None:
    assert main(["plan", *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
