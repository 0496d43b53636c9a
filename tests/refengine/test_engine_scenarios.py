"""The reference engine's step loop against hand-computed scenarios, one per group kind.

Tiny models, block size 4 (``engine_kit``). Each story runs a request, pushes its blocks out
of the engine's own prefix cache with another request, and brings the prefix back: the
numbers asserted (positions, nulls, hit lengths, tokens computed) are worked out by hand in
the comments. Every run is in bytes mode, so every block read or loaded is also compared
byte for byte, and the pool's and planner's bookkeeping is checked after every step.
"""

from __future__ import annotations

import pytest
from engine_kit import BS, Recorder, make_engine, record, req, tiny_preset, toks

from kvoffload.errors import ConfigError
from kvoffload.refengine.context import EngineConfig
from kvoffload.refengine.engine import ReferenceEngine
from kvoffload.sim.replay import Arrival, replay
from kvoffload.sim.simulation import Mode

A = toks(24)
FLUSH = toks(31, base=5000)  # 31 tokens + 1 output = 8 blocks: evicts whatever is cached


def _no_wrong_bytes(engine: ReferenceEngine) -> None:
    m = engine.metrics
    assert (m.wrong_loaded_bytes, m.wrong_cached_bytes, m.wrong_host_bytes) == (0, 0, 0)
    assert m.same_step_flushes == 0


def test_full_attention_chunked_prefill_store_evict_and_load_back() -> None:
    engine = make_engine(tiny_preset(), num_blocks=9, budget=8)  # 8 usable blocks
    rec = Recorder().attach(engine)
    prompt = A[:12]
    replay(engine, [req("a", prompt, output=2, at=0.0), req("flush", FLUSH, at=10.0),
                    req("b", prompt, output=1, at=20.0)])
    # a: chunks of 8 then 4 tokens, one decode step for its second output token.
    assert rec.scheduled("a") == [(0, 8), (8, 4), (12, 1)]
    # Full blocks only are stored: positions 0-2 (tokens 0-12); position 3 held 1 token.
    assert rec.stored_positions("a", 0) == [0, 1, 2]
    # "flush" took all 8 blocks, so b finds nothing in the engine and all 12 tokens in the
    # host tier (full attention only: the hit may reach the last token) ...
    b = record(engine, "b")
    assert (b.engine_hit_tokens, b.host_hit_tokens) == (0, 12)
    [(group, ids, first)] = rec.loads("b")
    assert (group, len(ids), first) == (0, 3, 0)
    # ... and recomputes only the last token to get its logits.
    assert rec.scheduled("b") == [(11, 1)]
    assert b.prefill_tokens == 1
    assert b.loaded_bytes == 3 * 2 * 4 * BS * 4  # 3 blocks x 2 layers x 64 B pages
    assert engine.metrics.verified_blocks >= 3
    _no_wrong_bytes(engine)


def test_sliding_window_frees_old_blocks_and_loads_only_the_window() -> None:
    engine = make_engine(tiny_preset(window=8), num_blocks=17, budget=8)
    rec = Recorder().attach(engine)
    # "flush": 12 attention blocks plus up to 4 window blocks at once, 24 allocations in
    # all: it cycles through the whole free queue and evicts every cached block of a.
    replay(engine, [req("a", A, at=0.0), req("flush", toks(47, base=7000), at=10.0),
                    req("b", [*A, 1, 2, 3], at=20.0)])
    # W = 8, block 4: before step c -> c+8 the engine frees positions < (c - 7) // 4.
    freed = [s.num_freed_blocks for step in rec.inputs for s in step.scheduled
             if s.request.request_id == "a"]
    assert freed == [(0, 0), (0, 0), (0, 2)]
    # Window blocks are stored too (each can end a hit's window): positions 0-5.
    assert rec.stored_positions("a", 1) == [0, 1, 2, 3, 4, 5]
    # b (27 tokens) hits at 24 = every full block of a; the window group needs only the
    # blocks covering tokens [16, 24): positions 4 and 5, so positions 0-3 stay null.
    b = record(engine, "b")
    assert (b.engine_hit_tokens, b.host_hit_tokens) == (0, 24)
    loads = {g: (len(ids), first) for g, ids, first in rec.loads("b")}
    assert loads == {0: (6, 0), 1: (2, 4)}
    first_table = next(s.new_block_ids for step in rec.inputs for s in step.scheduled
                       if s.request.request_id == "b")
    assert first_table[1][:4] == (0, 0, 0, 0) and 0 not in first_table[1][4:]
    assert rec.scheduled("b") == [(24, 3)]
    _no_wrong_bytes(engine)


def test_mamba_keeps_one_state_and_loads_exactly_the_state_at_the_hit() -> None:
    engine = make_engine(tiny_preset(mamba=True), num_blocks=17, budget=8)
    rec = Recorder().attach(engine)
    replay(engine, [req("a", A, at=0.0), req("flush", toks(55, base=7000), at=10.0),
                    req("b", [*A, 1, 2, 3, 4], at=20.0)])
    # Prefill steps end at 8, 16 and 20 (the last block end before the prompt's last
    # token, where vLLM's align mode stops a chunk), decode passes 24: the states after
    # positions 1, 3, 4 and 5 are stored; states inside a chunk never exist.
    assert rec.stored_positions("a", 1) == [1, 3, 4, 5]
    # The table holds at most the state read and the state written: never more than two
    # real Mamba blocks at once.
    for step in rec.inputs:
        for s in step.scheduled:
            if s.request.request_id == "a" and s.new_block_ids[1]:
                assert sum(1 for b in s.new_block_ids[1] if b) <= 2
    # b (28 tokens) hits at 24: six attention blocks and exactly one state, position 5.
    b = record(engine, "b")
    assert b.host_hit_tokens == 24
    loads = {g: (len(ids), first) for g, ids, first in rec.loads("b")}
    assert loads == {0: (6, 0), 1: (1, 5)}
    assert rec.scheduled("b") == [(24, 4)]
    _no_wrong_bytes(engine)


def test_engine_prefix_cache_serves_before_the_host_tier() -> None:
    engine = make_engine(tiny_preset(window=8), num_blocks=64)
    rec = Recorder().attach(engine)
    replay(engine, [req("a", A, at=0.0), req("b", [*A, 9, 9], at=1.0)])
    b = record(engine, "b")
    # The engine still holds a's blocks: it serves 24 tokens itself; nothing is loaded.
    assert (b.engine_hit_tokens, b.host_hit_tokens) == (24, 0)
    assert rec.loads("b") == []
    assert engine.metrics.verified_blocks >= 6  # the adopted blocks were checked
    _no_wrong_bytes(engine)


def test_preemption_frees_the_last_request_and_it_resumes_with_a_fresh_table() -> None:
    # 8 usable blocks; a and b take 3 each, then grow one block per 4 decode tokens.
    engine = make_engine(tiny_preset(), num_blocks=9, budget=64)
    rec = Recorder().attach(engine)
    replay(engine, [req("a", toks(12), output=12), req("b", toks(12, base=3000), output=12)])
    m = engine.metrics
    assert m.preemptions >= 1 and record(engine, "b").preemptions >= 1
    assert record(engine, "a").preemptions == 0  # the last running request goes first
    assert "b" in [rid for step in rec.inputs for rid in step.preempted]
    resumed = [s for step in rec.inputs for s in step.scheduled
               if s.request.request_id == "b" and s.resumed]
    assert resumed and resumed[0].new_block_ids[0]  # the whole new table came with it
    assert {r.request_id for r in m.records} == {"a", "b"}
    assert all(r.output_tokens == 12 for r in m.records)
    # b comes back from its own blocks: the engine still caches its first two, the host
    # tier holds the next two (stored before the preemption) and loads them; nothing is
    # computed twice. Hits count at a request's first start only, so b shows none.
    b = record(engine, "b")
    [(group, ids, first)] = rec.loads("b")
    assert (group, len(ids), first) == (0, 2, 2)
    assert resumed[0].num_computed_tokens == 16
    assert (b.prefill_tokens, b.recomputed_tokens) == (12, 0)
    assert (b.engine_hit_tokens, b.host_hit_tokens) == (0, 0)
    _no_wrong_bytes(engine)


def test_a_request_larger_than_the_engine_is_a_config_error() -> None:
    engine = make_engine(tiny_preset(), num_blocks=4)  # 3 blocks = 12 tokens
    with pytest.raises(ConfigError, match="engine capacity"):
        replay(engine, [req("big", toks(20))])


def test_asap_arrival_holds_a_turn_until_its_parent_finished() -> None:
    engine = make_engine(tiny_preset(), mode=Mode.ACCOUNTING)
    first = req("t0", toks(8), output=4, at=5.0)
    second = req("t1", toks(16), output=1, at=0.0)
    second = type(second)(**{**second.__dict__, "parent_id": "t0"})
    replay(engine, [first, second], arrival=Arrival.ASAP)
    t0, t1 = record(engine, "t0"), record(engine, "t1")
    assert t0.finish_s is not None and t1.first_token_s is not None
    assert t1.arrival_s >= t0.finish_s  # held back, then served from t0's blocks
    assert t1.engine_hit_tokens == 8


def test_engine_config_rejects_nonsense() -> None:
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig(num_blocks=8, max_num_seqs=0)
    with pytest.raises(ConfigError, match="engine capacity"):
        EngineConfig(num_blocks=1)
