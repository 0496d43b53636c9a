"""Figures of ``vllm_e2e.py``: percentiles, ratios to the run without offloading, checks.

Everything here works on the records of finished runs; nothing imports vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from e2e_engine import BASELINE, RunResult


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass(frozen=True)
class Summary:
    """One configuration's figures on one model."""

    config: str
    label: str
    ttft_p50_s: float
    ttft_p90_s: float
    revisit_ttft_p50_s: float
    revisit_ttft_p90_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_tokens: int
    tier_shares: dict[str, float]
    engine_cache_requests: float


def summarize(result: RunResult) -> Summary:
    ttft = [r.ttft_s for r in result.records]
    revisit = [r.ttft_s for r in result.records if r.turn.kind.is_revisit]
    loaded = result.connector.get("loaded_blocks_by_tier")
    if loaded is None:  # host memory alone: every load came from it
        loaded = {"host": 1} if result.hit_tokens else {}
    total_loaded = sum(loaded.values())
    shares = {t: n / total_loaded for t, n in loaded.items() if n} if total_loaded else {}
    return Summary(result.config.name, result.config.label, percentile(ttft, 50),
                   percentile(ttft, 90), percentile(revisit, 50), percentile(revisit, 90),
                   result.total_s, sum(r.prompt_tokens for r in result.records),
                   sum(r.cached_tokens for r in result.records), result.hit_tokens, shares,
                   result.engine_cache_requests)


@dataclass(frozen=True)
class Ratios:
    """The run without offloading divided by this one: above 1 is faster than recompute."""

    ttft_p50: float
    ttft_p90: float
    revisit_ttft_p50: float
    revisit_ttft_p90: float
    total: float


def _ratio(base: float, value: float) -> float:
    return base / value if value > 0 else math.inf


def ratios(base: Summary, s: Summary) -> Ratios:
    return Ratios(_ratio(base.ttft_p50_s, s.ttft_p50_s), _ratio(base.ttft_p90_s, s.ttft_p90_s),
                  _ratio(base.revisit_ttft_p50_s, s.revisit_ttft_p50_s),
                  _ratio(base.revisit_ttft_p90_s, s.revisit_ttft_p90_s),
                  _ratio(base.total_s, s.total_s))


def output_problems(model: str, results: Sequence[RunResult]) -> list[str]:
    """Every configuration whose greedy answers differ from the baseline's, and every
    offloading configuration that recorded no hit: what makes the benchmark exit 1."""
    problems = []
    base = next(r for r in results if r.config.name == BASELINE)
    for result in results:
        if result is base:
            continue
        differing = [r.turn.index for r, b in zip(result.records, base.records, strict=True)
                     if r.answer != b.answer]
        if differing:
            problems.append(f"{model} {result.config.name}: greedy outputs differ from the "
                            f"run without offloading in requests {differing}")
        if result.config.offloads and result.hit_tokens == 0:
            problems.append(f"{model} {result.config.name}: the connector recorded no hit")
    return problems


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _fmt_x(ratio: float) -> str:
    return "-" if math.isnan(ratio) else f"{ratio:.1f}x"


def _shares(shares: dict[str, float]) -> str:
    return " ".join(f"{tier} {share:.0%}" for tier, share in sorted(shares.items())) or "-"


TABLE_HEADER = ("model", "configuration", "TTFT p50", "TTFT p90", "revisit TTFT p50 (ratio)",
                "revisit TTFT p90 (ratio)", "total (ratio)", "prompt tokens cached",
                "loads by tier")


def table_rows(model: str, summaries: Sequence[Summary]) -> list[tuple[str, ...]]:
    """One row per configuration; ratios are to the first (the run without offloading)."""
    base = summaries[0]
    rows = []
    for s in summaries:
        r = ratios(base, s)
        cached = s.cached_tokens / s.prompt_tokens if s.prompt_tokens else 0.0
        rows.append((model, s.label, f"{_fmt_s(s.ttft_p50_s)} ({_fmt_x(r.ttft_p50)})",
                     f"{_fmt_s(s.ttft_p90_s)} ({_fmt_x(r.ttft_p90)})",
                     f"{_fmt_s(s.revisit_ttft_p50_s)} ({_fmt_x(r.revisit_ttft_p50)})",
                     f"{_fmt_s(s.revisit_ttft_p90_s)} ({_fmt_x(r.revisit_ttft_p90)})",
                     f"{_fmt_s(s.total_s)} ({_fmt_x(r.total)})", f"{cached:.0%}",
                     _shares(s.tier_shares)))
    return rows


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(TABLE_HEADER) + " |",
             "|" + "|".join("---" for _ in TABLE_HEADER) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def result_json(result: RunResult, summary: Summary, base: Summary) -> dict[str, Any]:
    r = ratios(base, summary)
    return {
        "config": summary.config, "label": summary.label,
        "ttft_p50_s": summary.ttft_p50_s, "ttft_p90_s": summary.ttft_p90_s,
        "revisit_ttft_p50_s": summary.revisit_ttft_p50_s,
        "revisit_ttft_p90_s": summary.revisit_ttft_p90_s, "total_s": summary.total_s,
        "ratio_ttft_p50": r.ttft_p50, "ratio_ttft_p90": r.ttft_p90,
        "ratio_revisit_ttft_p50": r.revisit_ttft_p50,
        "ratio_revisit_ttft_p90": r.revisit_ttft_p90, "ratio_total": r.total,
        "startup_s": result.startup_s, "prompt_tokens": summary.prompt_tokens,
        "cached_tokens": summary.cached_tokens, "hit_tokens": summary.hit_tokens,
        "loads_by_tier": summary.tier_shares,
        "engine_cache_requests": summary.engine_cache_requests,
        "connector": result.connector,
        "requests": [{"index": rec.turn.index, "conversation": rec.turn.conversation,
                      "turn": rec.turn.turn, "document": rec.turn.document,
                      "kind": rec.turn.kind.value, "prompt_tokens": rec.prompt_tokens,
                      "cached_tokens": rec.cached_tokens, "ttft_s": rec.ttft_s,
                      "latency_s": rec.latency_s} for rec in result.records],
    }
