"""Recomputing after a preemption is prefill, not decode: a step recomputing a chunk of
an already-decoding request must not be modelled as one decode iteration per token (a
8192-token recompute chunk would otherwise last 8192 x 15 ms = 123 s)."""

from __future__ import annotations

from kvoffload.refengine.requests import EngineRequest
from kvoffload.refengine.scheduler import StepEntry
from kvoffload.sim.simulation import Mode
from refengine.engine_kit import make_engine, req, tiny_preset, toks


def entry(engine: object, start: int, count: int, high_water: int) -> StepEntry:
    request = EngineRequest(req("r", toks(200), output=50), engine.hasher)  # type: ignore[attr-defined]
    request.num_emitted = 1
    request.high_water = high_water
    return StepEntry(request, start, count, None)  # type: ignore[arg-type]


def test_a_recomputed_chunk_of_a_decoding_request_is_prefill_not_decode() -> None:
    engine = make_engine(tiny_preset(), mode=Mode.ACCOUNTING)
    _, iterations = engine._forward([entry(engine, 0, 64, high_water=120)])
    assert iterations == 1


def test_decode_iterations_count_only_the_new_tokens() -> None:
    engine = make_engine(tiny_preset(), mode=Mode.ACCOUNTING)
    assert engine._forward([entry(engine, 120, 16, high_water=120)])[1] == 16
    assert engine._forward([entry(engine, 100, 30, high_water=120)])[1] == 10
