"""Client hints drawn from a workload's future (``kvoffload.workloads.hints``), and the path
from a workload request's ``controls`` to the planner in the reference engine."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvoffload.cli import main
from kvoffload.planner.contract import RequestControls
from kvoffload.sim.replay import replay
from kvoffload.workloads import WorkloadRequest
from kvoffload.workloads.hints import continuations, with_hints
from refengine.engine_kit import make_engine, req, tiny_preset, toks


def workload() -> list[WorkloadRequest]:
    """a: 40 tokens; b repeats a's prompt and extends it (b continues a); c shares only
    a's first 16 tokens (a branch: continues nothing); d is an exact repeat of c; e is
    alone and last; f is shorter than one 16-token block."""
    a = toks(40)
    c = [*a[:16], *toks(30, base=5000)]
    return [req("a", a), req("b", [*a, *toks(10, base=9000)]), req("c", c), req("d", c),
            req("e", toks(50, base=7000)), req("f", toks(8, base=8000))]


def test_a_request_continues_when_a_later_prompt_contains_its_whole_prompt() -> None:
    assert continuations(workload()) == [True, False, True, False, False, False]


def test_the_truth_is_compared_at_the_given_block_size() -> None:
    """A later prompt shares all of x's full 16-token blocks but not its last 8 tokens (a
    trace's partial hash block): x continues at 16-token blocks, not at 8-token ones."""
    x = toks(40)
    later = [*x[:32], *toks(20, base=3000)]
    pair = [req("x", x), req("y", later)]
    assert continuations(pair) == [True, False]
    assert continuations(pair, block_tokens=8) == [False, False]


def test_full_accuracy_tells_the_truth_and_zero_tells_the_opposite() -> None:
    truth = continuations(workload())
    told = [r.controls.continues for r in with_hints(workload(), 1.0) if r.controls]
    assert told == truth
    told = [r.controls.continues for r in with_hints(workload(), 0.0) if r.controls]
    assert told == [not t for t in truth]


def test_partial_accuracy_flips_a_seeded_share() -> None:
    many = [req(f"r{i}", toks(32, base=100 * i)) for i in range(2000)]
    flips = [sum(r.controls is not None and r.controls.continues is True
                 for r in with_hints(many, 0.7, seed)) for seed in (0, 1)]
    # None of them continues: every True is a flip, ~30 % of 2000.
    assert all(500 < n < 700 for n in flips) and flips[0] != flips[1]
    again = [r.controls for r in with_hints(many, 0.7, 0)]
    assert again == [r.controls for r in with_hints(many, 0.7, 0)]


def test_hints_keep_caps_and_carry_the_session() -> None:
    base = [replace(req("a", toks(40)), session_id="chat-1",
                    controls=RequestControls(max_store_tokens=16)),
            req("b", toks(40))]
    hinted = with_hints(base, 1.0)
    assert hinted[0].controls == RequestControls(max_store_tokens=16, continues=True,
                                                 session_id="chat-1")
    assert hinted[1].controls == RequestControls(continues=False)


@pytest.mark.parametrize("accuracy", [-0.1, 1.5, float("nan"), True])
def test_a_bad_accuracy_is_refused(accuracy: float) -> None:
    with pytest.raises(ValueError, match="accuracy"):
        with_hints(workload(), accuracy)


def test_a_workload_requests_controls_reach_the_planner() -> None:
    """The engine sets a request's ``controls`` on the planner when it receives it: a
    request that may store nothing leaves the host tier empty, and a hint reaches the
    value policy's view of the request."""
    seen: dict[str, RequestControls] = {}
    for name, controls in [("capped", RequestControls(max_store_tokens=0)),
                           ("hinted", RequestControls(continues=False, session_id="s"))]:
        engine = make_engine(tiny_preset(window=8), policy="value")
        assert engine.planner is not None
        real = engine.planner.set_controls

        def spy(request: object, given: RequestControls, real: Any = real) -> None:
            seen[request.request_id] = given  # type: ignore[attr-defined]
            real(request, given)  # type: ignore[arg-type]

        engine.planner.set_controls = spy  # type: ignore[method-assign]
        replay(engine, [replace(req(name, toks(64), output=4), controls=controls)])
        stored = engine.tier.usage().used_slots if engine.tier is not None else 0
        assert (stored == 0) == (name == "capped")
    assert seen == {"capped": RequestControls(max_store_tokens=0),
                    "hinted": RequestControls(continues=False, session_id="s")}


def test_the_cli_refuses_an_accuracy_outside_0_to_1(capsys: pytest.CaptureFixture[str]
                                                    ) -> None:
    assert main(["simulate", "--limit", "3", "--no-baseline", "--hint-accuracy", "1.5"]) == 2
    assert "--hint-accuracy" in capsys.readouterr().err
