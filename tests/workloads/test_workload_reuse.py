"""Which prompts later requests continue (``reuse_report``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from kvoffload.workloads.request import WorkloadRequest
from reuse_report import (
    MIN_BUCKET_REQUESTS,
    Bucket,
    ReuseReport,
    continuation_report,
    format_report,
    quantile,
)

B = 4  # tokens per block in these tests


def blocks(*ids: int, extra: int = 0) -> list[int]:
    """A prompt of one block per id (block ``i`` is ``B`` tokens equal to ``i``), plus
    ``extra`` tokens of a partial last block."""
    return [t for i in ids for t in [i] * B] + [999] * extra


def req(name: str, prompt: list[int], at: float = 0.0, out: int = 1,
        salt: str | None = None) -> WorkloadRequest:
    return WorkloadRequest(request_id=name, arrival_s=at, prompt=prompt, output_length=out,
                           cache_salt=salt)


def continued_and_counted(requests: list[WorkloadRequest]) -> list[int]:
    """Per counted request, 1 if continued: read off the turn buckets' totals."""
    report = continuation_report(requests, B)
    return [report.continued, report.requests]


def test_a_conversation_continues_its_last_turn_not_an_earlier_one() -> None:
    requests = [
        req("a", blocks(1, 2), at=0.0),           # turn 0, continued by b
        req("b", blocks(1, 2, 3), at=1.0),         # turn 1, continued by d
        req("c", blocks(1, 7), at=2.0),            # shares block 1 only: continues nobody
        req("d", blocks(1, 2, 3, 4), at=5.0),      # passes a's end too, but b's is deeper
    ]
    report = continuation_report(requests, B)
    assert (report.requests, report.continued) == (4, 2)
    turns = {b.label: (b.requests, b.continued) for b in report.features[
        "turn in its conversation"]}
    assert turns == {"0": (2, 1), "1": (1, 1), "2": (1, 0)}
    assert report.gap_requests == (1, 2)  # a -> b, b -> d
    assert report.gap_seconds == (1.0, 4.0)


def test_exact_repeat_and_partial_last_block() -> None:
    # The prompt end is the last *full* block: "b" repeats a's two full blocks and goes on.
    requests = [req("a", blocks(1, 2, extra=3)), req("b", blocks(1, 2, 5)),
                req("c", blocks(1, 2, 5))]
    report = continuation_report(requests, B)
    assert (report.continued, report.requests) == (2, 3)
    assert report.gap_requests == (1, 1)


def test_prompts_without_a_full_block_are_not_counted() -> None:
    report = continuation_report([req("a", [1, 2]), req("b", [1, 2, 3])], B)
    assert (report.requests, report.continued) == (0, 0)
    assert report.rate == 0.0
    assert report.gap_requests == ()


def test_a_different_salt_never_continues() -> None:
    requests = [req("a", blocks(1, 2), salt="x"), req("b", blocks(1, 2, 3), salt="y"),
                req("c", blocks(1, 2, 3), salt="x")]
    report = continuation_report(requests, B)
    assert report.continued == 1  # only c continues a
    assert report.gap_requests == (2,)


def test_a_shared_block_that_is_nobodys_prompt_end_is_not_a_continuation() -> None:
    requests = [req(f"r{i}", blocks(1, 10 + i)) for i in range(5)]
    assert continued_and_counted(requests) == [0, 5]


def test_quartile_buckets_split_prompt_and_output_lengths() -> None:
    # Eight one-off prompts of 1..8 blocks; outputs 1..8 tokens.
    requests = [req(f"r{n}", blocks(*range(100 * n, 100 * n + n)), out=n) for n in range(1, 9)]
    report = continuation_report(requests, B)
    prompt = report.features["prompt tokens"]
    assert [b.label for b in prompt] == ["up to 8", "9-16", "17-24", "over 24"]
    assert [b.requests for b in prompt] == [2, 2, 2, 2]
    output = report.features["output tokens"]
    assert [b.label for b in output] == ["up to 2", "3-4", "5-6", "over 6"]
    # All equal values: a single bucket.
    same = continuation_report([req(f"s{i}", blocks(i)) for i in range(3)], B)
    assert [b.label for b in same.features["prompt tokens"]] == ["all"]


def test_spread_skips_small_buckets() -> None:
    n = MIN_BUCKET_REQUESTS
    report = ReuseReport(
        requests=2 * n + 1, continued=n // 2 + n // 5 + 1,
        features={"a": (Bucket("big", n, n // 2), Bucket("tiny", 1, 1)),
                  "b": (Bucket("other", n, n // 5),)},
        gap_requests=(), gap_seconds=())
    assert report.spread() == (pytest.approx((n // 5) / n), pytest.approx((n // 2) / n))
    few = ReuseReport(requests=3, continued=1, features={"a": (Bucket("tiny", 3, 1),)},
                      gap_requests=(), gap_seconds=())
    assert few.spread() == (pytest.approx(1 / 3), pytest.approx(1 / 3))


def test_quantile_is_nearest_rank() -> None:
    assert quantile([], 0.5) == 0.0
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert quantile(values, 0.5) == 5.0
    assert quantile(values, 0.9) == 9.0
    assert quantile(values, 1.0) == 10.0
    assert quantile([3.0], 0.1) == 3.0


def test_bucket_rate_and_report_text() -> None:
    assert Bucket("x", 0, 0).rate == 0.0
    assert Bucket("x", 4, 1).rate == pytest.approx(0.25)
    requests = [req("a", blocks(1, 2), at=0.0), req("b", blocks(1, 2, 3), at=10.0)]
    text = "\n".join(format_report(continuation_report(requests, B)))
    assert "1 of 2 prompts (50.0 %) were continued" in text
    assert "| 0 | 1 | 100.0 % | 100 % |" in text  # turn 0: a, continued
    assert "median 1 requests (10 s)" in text


def test_passing_through_a_shallower_prompt_end_is_not_continuing_it() -> None:
    # c shares all of x with x; a's end (block 1) lies on its path, but a hit for c is at
    # x's end, where a's state or window would not serve.
    requests = [req("x", blocks(1, 2, 3)), req("a", blocks(1)), req("c", blocks(1, 2, 3, 4))]
    report = continuation_report(requests, B)
    assert report.continued == 1
    assert report.gap_requests == (2,)  # x -> c


def test_the_first_continuation_sets_the_gap_and_the_highest_turn_the_next() -> None:
    # p is repeated exactly by r (its continuation, turn 1); s continues both at the same
    # end, so it is turn 2, and p's gap runs to r, not to s.
    requests = [req("p", blocks(1, 2)), req("q", blocks(1)), req("r", blocks(1, 2)),
                req("s", blocks(1, 2, 9))]
    report = continuation_report(requests, B)
    turns = {b.label: b.requests for b in report.features["turn in its conversation"]}
    assert turns == {"0": 2, "1": 1, "2": 1}
    assert report.gap_requests == (1, 2)  # r -> s, p -> r


def test_single_value_quartile_buckets_are_named_by_their_value() -> None:
    requests = [req(f"r{n}", blocks(10 * n), out=n) for n in range(1, 5)]
    output = continuation_report(requests, B).features["output tokens"]
    assert [b.label for b in output] == ["up to 1", "2", "3", "over 3"]
