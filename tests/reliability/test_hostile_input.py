"""Hostile input: malformed traces, absurd settings, layouts the library does not handle
and oversize requests each get one clear error (exit status 2 on the command line, no
traceback) or a clean refusal, and nothing already cached is lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from core.planner_kit import Harness, full, make_config, prompt
from kvoffload.cli import main
from kvoffload.errors import ConfigError, LayoutError, TraceError
from kvoffload.keys import key_group
from kvoffload.sim.replay import Arrival, replay
from kvoffload.worker import GroupTensors, TransferWorker
from kvoffload.workloads import read_mooncake_trace
from refengine.engine_kit import make_engine, req, tiny_preset, toks
from worker.worker_kit import kv_separate
from worker.worker_kit import make_config as worker_config

GOOD = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}

TRACES = {
    "not json": ("{timestamp: 0", "<json>"),
    "not an object": ("[1, 2, 3]", "<json>"),
    "missing field": (json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}),
                      "hash_ids"),
    "negative time": (json.dumps({**GOOD, "timestamp": -5}), "timestamp"),
    "time not a number": (json.dumps({**GOOD, "timestamp": "noon"}), "timestamp"),
    "zero length": (json.dumps({**GOOD, "input_length": 0}), "input_length"),
    "fractional length": (json.dumps({**GOOD, "output_length": 2.5}), "output_length"),
    "hash ids not a list": (json.dumps({**GOOD, "hash_ids": "abc"}), "hash_ids"),
    "empty hash ids": (json.dumps({**GOOD, "hash_ids": []}), "hash_ids"),
    "length beyond its blocks": (json.dumps({**GOOD, "input_length": 10**9}), "input_length"),
}


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return status, err


@pytest.mark.parametrize("name", list(TRACES))
def test_a_malformed_trace_line_is_named_by_line_and_field(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line, field = TRACES[name]
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps(GOOD) + "\n" + line + "\n")
    with pytest.raises(TraceError) as info:
        list(read_mooncake_trace(trace))
    assert info.value.line == 2 and info.value.field == field
    status, err = cli(capsys, "simulate", "--trace", str(trace), "--quiet")
    assert status == 2 and f"{trace}:2: field {field!r}" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize(("argv", "needle"), [
    (["--host-capacity", "0"], "--host-capacity"),
    (["--host-capacity=-4GiB"], "--host-capacity"),
    (["--engine-tokens", "0"], "engine"),
    (["--block-size-factor", "0"], "--block-size-factor"),
    (["--max-seqs", "0"], "--max-seqs"),
    (["--max-batched-tokens=-1"], "--max-batched-tokens"),
    (["--flops", "fast"], "--flops"),
    (["--faults", "1.5"], "rate 1.5"),
    (["--faults", "0.1,meteor"], "unknown fault kind 'meteor'"),
    (["--faults", "0.1", "--load-deadline", "0"], "--load-deadline"),
    (["--limit", "0"], "--limit"),
])
def test_absurd_settings_exit_2_with_one_clear_line(
        argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    status, err = cli(capsys, "simulate", "--workload", "chat", "--limit", "3", *argv,
                      "--quiet")
    assert status == 2, err
    assert needle in err
    assert len(err.strip().splitlines()) == 1


def test_layouts_the_worker_cannot_handle_are_refused_by_name() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = kv_separate(8, gen)
    config = worker_config([cache])
    bad = {
        "too few blocks": [GroupTensors(0, [("l0", torch.zeros(3, 16, dtype=torch.uint8))])],
        "rows not contiguous": [GroupTensors(0, [("l0", torch.zeros(8, 64, 4).transpose(1, 2))])],
        "a group missing": [],
        "an unknown group": [cache.tensors(0), GroupTensors(5, cache.layers)],
    }
    for name, groups in bad.items():
        worker = TransferWorker(config, pin_memory=False)
        with pytest.raises((LayoutError, ValueError)):
            worker.register_kv_caches(groups)
        del name


def test_an_oversize_request_is_refused_and_the_cache_keeps_what_it_held() -> None:
    engine = make_engine(tiny_preset(), num_blocks=32)
    replay(engine, [req("a", toks(40), output=1)], arrival=Arrival.ASAP)
    host = engine.host
    assert host is not None
    held = {k: host.slot_of(k) for k in host}
    assert held
    with pytest.raises(ConfigError, match="Raise the engine capacity"):
        replay(engine, [req("huge", toks(400, base=9000), output=1)], arrival=Arrival.ASAP)
    assert {k: host.slot_of(k) for k in host if k in held} == held
    assert host.usage().pinned_slots == 0
    host.check_integrity()


def test_a_store_larger_than_host_memory_is_refused_without_evicting_anything() -> None:
    h = Harness(make_config(full(), slots=8))
    cached = h.request("a", prompt(24))
    h.put(cached, 0, range(6))
    before = set(h.tier)
    big = h.request("big", prompt(64, base=5000))
    h.admit(big, [tuple(range(1, 17))])
    plan = h.step(h.sched(big, [tuple(range(1, 17))], 0, 64))
    assert plan.stores == ()  # 16 blocks never fit in 8 slots: refused, retried later
    assert set(h.tier) == before
    assert h.planner.stats.store_retries >= 1
    assert all(key_group(k) == 0 for k in h.tier)


def test_a_request_id_used_twice_is_an_error_not_a_mixup() -> None:
    h = Harness(make_config(full()))
    first = h.request("same", prompt(8))
    h.admit(first, [(1, 2)])
    h.step(h.sched(first, [(1, 2)], 0, 8))
    h.planner.request_finished(first)
    with pytest.raises(ValueError, match="unique"):
        h.lookup(h.request("same", prompt(8, base=77)))
