"""Byte verification in the reference engine, and the recompute fallbacks.

A corrupted host block must be caught when it is loaded (counted, never used: the request
recomputes) and by the end-of-run audit of the host arena; a failed load must make the
request recompute; both modes must make the same decisions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_kit import BS, Recorder, key_at, make_engine, record, req, tiny_preset, toks

from kvoffload.blockfile.framing import HEADER_BYTES
from kvoffload.jobs import Direction, TransferJob
from kvoffload.refengine.context import EngineConfig
from kvoffload.refengine.device import WorkerExecutor
from kvoffload.refengine.engine import offload_for
from kvoffload.refengine.executors import AccountingExecutor
from kvoffload.sim.replay import replay
from kvoffload.sim.simulation import Mode, SimulationConfig, assemble, run_one
from kvoffload.workloads import AgenticWorkload, ChatWorkload

PROMPT = toks(12)
FLUSH = toks(31, base=5000)


def test_a_corrupted_host_byte_is_counted_and_the_request_recomputes() -> None:
    engine = make_engine(tiny_preset(), num_blocks=9)
    replay(engine, [req("a", PROMPT), req("flush", FLUSH, at=10.0)])
    assert engine.tier is not None and isinstance(engine.executor, WorkerExecutor)
    slot = engine.tier.slot_of(key_at(PROMPT, 1, 0))
    assert slot is not None
    engine.executor.arena[slot, 5] ^= 0xFF  # one byte of a's second block, first layer

    rec = Recorder().attach(engine)
    replay(engine, [req("b", PROMPT, output=2)])
    m = engine.metrics
    b = record(engine, "b")
    assert m.wrong_loaded_bytes == 1  # caught at load time ...
    assert m.wrong_host_bytes == 1  # ... and by the audit of the arena at the end
    assert m.wrong_cached_bytes == 0
    assert b.corrupt_loads == 1
    # The engine did not use the load: b recomputed all 12 prompt tokens and accepted no
    # external tokens afterwards, although the tier still offers them.
    assert len(rec.loads("b")) == 1
    assert (b.engine_hit_tokens, b.host_hit_tokens, b.prefill_tokens) == (0, 0, 12)
    assert rec.scheduled("b")[0] == (0, 12)
    assert b.output_tokens == 2 and b.finish_s is not None


def test_without_corruption_the_same_story_has_no_wrong_bytes() -> None:
    engine = make_engine(tiny_preset(), num_blocks=9)
    replay(engine, [req("a", PROMPT), req("flush", FLUSH, at=10.0),
                    req("b", PROMPT, output=2, at=20.0)])
    m = engine.metrics
    assert (m.wrong_loaded_bytes, m.wrong_host_bytes, m.wrong_cached_bytes) == (0, 0, 0)
    assert m.audited_host_blocks >= 3
    assert record(engine, "b").host_hit_tokens == 12


def test_a_failed_load_frees_the_request_and_it_recomputes() -> None:
    def fail_loads(job: TransferJob) -> bool:
        return job.direction is Direction.LOAD

    layout = tiny_preset().layout(BS)
    donor = make_engine(tiny_preset(), mode=Mode.ACCOUNTING)
    assert donor.offload is not None
    engine = assemble(layout, EngineConfig(num_blocks=9, check_integrity=True),
                      offload_for(layout, donor.offload), mode=Mode.ACCOUNTING,
                      executor=AccountingExecutor(fail=fail_loads))
    replay(engine, [req("a", PROMPT), req("flush", FLUSH, at=10.0),
                    req("b", PROMPT, at=20.0)])
    b = record(engine, "b")
    assert b.failed_loads >= 1
    assert b.host_hit_tokens == 0 and b.prefill_tokens == 12
    assert engine.metrics.traffic[0].failed_jobs >= 1
    assert engine.planner is not None and engine.planner.num_jobs == 0


def test_without_offloading_a_preempted_request_recomputes() -> None:
    layout = tiny_preset().layout(BS)
    engine = assemble(layout, EngineConfig(num_blocks=9, max_num_batched_tokens=64), None)
    replay(engine, [req("a", toks(12), output=12), req("b", toks(12, base=3000), output=12)])
    b = record(engine, "b")
    assert b.preemptions >= 1 and b.recomputed_tokens > 0


def _chat() -> list:  # type: ignore[type-arg]
    return ChatWorkload(num_sessions=5, turns=(2, 4), system_tokens=64, user_tokens=(16, 120),
                        output_tokens=(8, 40), seed=3).generate()


def _long_chat() -> list:  # type: ignore[type-arg]
    return ChatWorkload(num_sessions=4, turns=(2, 4), system_tokens=1100,
                        user_tokens=(200, 900), output_tokens=(8, 40), seed=3).generate()


def test_mamba_states_are_stored_only_where_a_step_ended() -> None:
    """Prefill chunks of 2048 tokens cross 1040-token Mamba blocks mid-step: no state
    exists at those block ends, so none may be stored -- loading one would hand the
    engine a state from another position (wrong bytes, caught here)."""
    config = SimulationConfig(preset="nemotron-h-8b", engine_tokens=16000,
                              host_capacity_bytes=4 << 30, max_num_batched_tokens=2048,
                              max_num_seqs=4, scale_bytes=16, baseline=False, eviction_policy="lru")
    summary = run_one(config, _long_chat())
    assert summary.wrong_bytes == 0 and summary.corrupt_loads == 0
    aligned = run_one(SimulationConfig(**{**config.__dict__,
                                          "max_num_batched_tokens": 1040}), _long_chat())
    assert aligned.wrong_bytes == 0 and aligned.host_hit_rate > 0


def test_bytes_and_accounting_modes_make_the_same_decisions() -> None:
    base = SimulationConfig(preset="gpt-oss-20b", engine_tokens=1200, max_num_batched_tokens=256,
                            max_num_seqs=4, scale_bytes=16, baseline=False, eviction_policy="lru")
    runs = {mode: run_one(SimulationConfig(**{**base.__dict__, "mode": mode}), _chat())
            for mode in Mode}
    moved, counted = runs[Mode.BYTES], runs[Mode.ACCOUNTING]
    assert moved.host_hit_tokens > 0  # the story exercises the host tier
    for field in ("engine_hit_tokens", "host_hit_tokens", "prefill_tokens_computed",
                  "stored_bytes", "loaded_bytes", "steps", "preemptions", "makespan_s"):
        assert getattr(moved, field) == getattr(counted, field), field
    assert moved.groups == counted.groups
    assert moved.wrong_bytes == 0 and moved.verified_blocks > 0
    assert moved.moved_loaded_bytes > 0 and counted.moved_loaded_bytes == 0


@pytest.mark.parametrize("preset", ["llama3-8b", "gemma3-27b", "nemotron-h-8b"])
def test_every_preset_runs_clean_in_bytes_mode(preset: str) -> None:
    config = SimulationConfig(preset=preset, block_size=16 if preset != "nemotron-h-8b" else 32,
                              engine_tokens=1500, host_capacity_bytes=32 << 30,
                              max_num_batched_tokens=256, max_num_seqs=4, scale_bytes=16,
                              baseline=False, check_integrity=True, eviction_policy="lru")
    summary = run_one(config, _chat())
    assert summary.requests == len(_chat())
    assert summary.wrong_bytes == 0 and summary.same_step_flushes == 0
    assert summary.verified_blocks > 0 and summary.audited_host_blocks > 0


def test_agents_sharing_a_prefix_with_factor_2_store_only_written_blocks() -> None:
    agents = AgenticWorkload(num_sessions=2, system_tokens=300, task_tokens=(32, 128),
                             tool_output_tokens=(32, 300), action_tokens=(8, 40),
                             answer_tokens=(8, 40), seed=2).generate()
    config = SimulationConfig(preset="gpt-oss-20b", block_size=16, block_size_factor=2,
                              engine_tokens=20000, host_capacity_bytes=4 << 30,
                              max_num_batched_tokens=256, max_num_seqs=8, scale_bytes=16,
                              baseline=False, eviction_policy="lru")
    summary = run_one(config, agents)
    assert summary.same_step_flushes == 0
    assert summary.wrong_bytes == 0


def test_store_transfers_name_the_positions_of_their_blocks() -> None:
    config = SimulationConfig(preset="gpt-oss-20b", block_size=16, engine_tokens=4000,
                              host_capacity_bytes=64 << 20, eviction_policy="arc",
                              max_num_batched_tokens=256, max_num_seqs=8, scale_bytes=16,
                              baseline=False)
    agents = AgenticWorkload(num_sessions=2, system_tokens=300, task_tokens=(32, 128),
                             tool_output_tokens=(32, 300), action_tokens=(8, 40),
                             answer_tokens=(8, 40), seed=2).generate()
    summary = run_one(config, agents)
    assert summary.misplaced_store_blocks == 0


def test_a_disk_tier_below_host_memory_serves_what_host_memory_evicted() -> None:
    base = SimulationConfig(preset="gpt-oss-20b", mode=Mode.ACCOUNTING, engine_tokens=1200,
                            host_capacity_bytes=8 << 20, max_num_batched_tokens=256,
                            max_num_seqs=4, baseline=False, check_integrity=True,
                            eviction_policy="lru")
    alone = run_one(base, _chat())
    cascade = run_one(SimulationConfig(**{**base.__dict__, "disk_capacity_bytes": 8 << 30}),
                      _chat())
    assert set(cascade.lower_tier_bytes) == {"disk"} and cascade.lower_tier_bytes["disk"] > 0
    disk = cascade.tier_hit_rates.get("disk", 0.0)
    assert disk > 0  # blocks host memory evicted came back from disk ...
    assert cascade.host_hit_rate > alone.host_hit_rate  # ... on top of what host memory had
    assert sum(cascade.tier_hit_rates.values()) == pytest.approx(cascade.host_hit_rate)
    assert cascade.prefill_tokens_computed < alone.prefill_tokens_computed


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "nemotron-h-8b"])
def test_a_real_disk_tier_serves_a_second_run_verified(preset: str, tmp_path: Path) -> None:
    """Bytes mode with a real directory: the second run (a restarted engine) promotes
    what the first stored, every loaded byte checked; damaged files are misses."""
    hybrid = preset == "nemotron-h-8b"  # 1040-token blocks, ~100 MiB Mamba states
    config = SimulationConfig(preset=preset, engine_tokens=16000 if hybrid else 1200,
                              host_capacity_bytes=400 << 20 if hybrid else 8 << 20,
                              max_num_batched_tokens=1040 if hybrid else 2048,
                              max_num_seqs=4, scale_bytes=16,
                              baseline=False, disk_capacity_bytes=64 << 30,
                              disk_path=str(tmp_path), eviction_policy="lru")
    chat = _long_chat if hybrid else _chat
    first = run_one(config, chat())
    assert first.lower_tier_blocks["disk"] > 0
    second = run_one(config, chat())
    assert second.tier_hit_rates.get("disk", 0.0) > 0
    assert second.wrong_bytes == 0 and second.failed_loads == 0
    assert second.prefill_tokens_computed < first.prefill_tokens_computed
    files = list(tmp_path.rglob("*.kvb"))
    assert files
    for path in files:  # flip the last payload byte of every block file (its header follows)
        data = bytearray(path.read_bytes())
        data[-HEADER_BYTES - 1] ^= 0xFF
        path.write_bytes(bytes(data))
    third = run_one(config, chat())
    # Every damaged file is a miss (dropped); only blocks this run wrote back itself hit.
    assert third.tier_hit_rates.get("disk", 0.0) < second.tier_hit_rates["disk"]
    assert third.prefill_tokens_computed > second.prefill_tokens_computed
    assert third.wrong_bytes == 0 and third.failed_loads == 0


def test_a_real_redis_tier_is_shared_by_two_engines() -> None:
    from tiers.tier_kit import redis_server

    with redis_server() as server:
        config = SimulationConfig(preset="gpt-oss-20b", engine_tokens=1200,
                                  host_capacity_bytes=8 << 20, max_num_batched_tokens=256,
                                  max_num_seqs=4, scale_bytes=16, baseline=False,
                                  remote_url=server.url, eviction_policy="lru")
        first = run_one(config, _chat())
        second = run_one(config, _chat())  # a second engine, empty host memory
    assert second.tier_hit_rates.get("remote", 0.0) > first.tier_hit_rates.get("remote", 0.0)
    assert second.prefill_tokens_computed < first.prefill_tokens_computed
    assert second.wrong_bytes == 0 and second.failed_loads == 0


@pytest.mark.parametrize(("changes", "field"), [
    ({"disk_capacity_bytes": 1 << 30}, "disk_path"),
    ({"disk_path": "/tmp/x"}, "disk_capacity_bytes"),
    ({"remote_capacity_bytes": 1 << 30}, "remote_capacity_bytes"),
    ({"mode": Mode.ACCOUNTING, "disk_path": "/tmp/x", "disk_capacity_bytes": 1}, "disk_path"),
    ({"mode": Mode.ACCOUNTING, "remote_url": "redis://127.0.0.1:1/0"}, "remote_url"),
])
def test_tier_settings_that_cannot_work_are_refused(changes: dict[str, object],
                                                   field: str) -> None:
    from kvoffload.errors import ConfigError

    base = SimulationConfig(baseline=False, eviction_policy="lru")
    config = SimulationConfig(**{**base.__dict__, **changes})
    with pytest.raises(ConfigError) as info:
        run_one(config, _chat())
    assert info.value.field == field and info.value.fix
