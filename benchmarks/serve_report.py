"""Figures of ``vllm_serve.py``: one client run summed up, ratios to the run without
offloading, the tables printed and the problems that fail the run."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from serve_runs import ClientRun, Metrics


@dataclass(frozen=True)
class RunFigures:
    """One configuration's run of one workload at one load.

    Latencies in milliseconds, as vLLM's client reports them; ``cached_share`` is the
    share of prompt tokens the server did not compute (vLLM's own prefix cache plus what
    kvoffload loaded), from the server's ``vllm:prompt_tokens_by_source`` counters.
    """

    config: str
    workload: str
    concurrency: int
    requests: int
    failed: int
    duration_s: float
    request_throughput: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    revisit_ttft_p50_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    cached_share: float
    loaded_share: float
    loads_by_tier: dict[str, float]
    outputs: tuple[str, ...]
    flush_wait_s: float = 0.0
    """Seconds the server's steps waited, before their forward pass, for transfer jobs
    still using engine blocks vLLM handed out again (``vllm:kvoffload_flush_wait_seconds``,
    summed over ranks)."""
    loaded_tokens: int = 0
    """Prompt tokens kvoffload loaded (``external_kv_transfer``)."""
    load_jobs: int = 0
    """kvoffload's loads (each makes its request wait for it, at least one engine step)."""
    deferred_lookups: int = 0
    """Lookups kvoffload answered "ask again later" (a block the hit needs in flight)."""
    queue_mean_ms: float = math.nan
    """Mean time from a request's arrival at the engine to its first scheduling (vLLM's
    ``vllm:request_queue_time_seconds``): a load kvoffload makes it wait for counts here."""
    prefill_mean_ms: float = math.nan
    """Mean time from a request's first scheduling to its first token
    (``vllm:request_prefill_time_seconds``): the steps its prefill took."""


def revisits(records: Sequence[dict[str, Any]]) -> list[bool]:
    """For each request of a trace, whether at least half of its prompt's hash ids are a
    prefix some earlier request sent (a returning session, a document read again)."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for record in records:
        ids = tuple(int(h) for h in record["hash_ids"])
        known = 0
        while known < len(ids) and ids[:known + 1] in seen:
            known += 1
        out.append(bool(ids) and 2 * known >= len(ids))
        seen.update(ids[:n] for n in range(1, len(ids) + 1))
    return out


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def figures(config: str, workload: str, concurrency: int, run: ClientRun, *,
            delta: Metrics, revisit: Sequence[bool]) -> RunFigures:
    """Sum up ``run`` and the server's counters over it (``delta``); ``revisit`` marks
    the trace's requests that return to an earlier prefix (``revisits``)."""
    r = run.result
    ttfts = [float(t) for t in r.get("ttfts", [])]
    sources = delta.by_label("vllm:prompt_tokens_by_source_total", "source")
    prompt = sum(sources.values())
    computed = sources.get("local_compute", 0.0)
    loaded = sources.get("external_kv_transfer", 0.0)
    tiers = delta.by_label("vllm:kvoffload_tier_blocks_loaded_total", "tier")
    return RunFigures(
        config=config, workload=workload, concurrency=concurrency,
        requests=int(r["completed"]), failed=int(r["failed"]),
        duration_s=float(r["duration"]), request_throughput=float(r["request_throughput"]),
        ttft_p50_ms=float(r["p50_ttft_ms"]), ttft_p90_ms=float(r["p90_ttft_ms"]),
        ttft_p99_ms=float(r["p99_ttft_ms"]),
        revisit_ttft_p50_ms=1000 * median([t for t, again in zip(ttfts, revisit, strict=False)
                                           if again and t > 0]),
        itl_p50_ms=float(r["p50_itl_ms"]),
        itl_p99_ms=float(r["p99_itl_ms"]),
        cached_share=(prompt - computed) / prompt if prompt else 0.0,
        loaded_share=loaded / prompt if prompt else 0.0,
        loads_by_tier={t: n for t, n in tiers.items() if n > 0},
        outputs=tuple(run.outputs),
        flush_wait_s=delta.total("vllm:kvoffload_flush_wait_seconds_total"),
        loaded_tokens=int(loaded),
        load_jobs=int(delta.total("vllm:kvoffload_load_jobs_total")),
        deferred_lookups=int(delta.total("vllm:kvoffload_deferred_lookups_total")),
        queue_mean_ms=_mean_ms(delta, "vllm:request_queue_time_seconds"),
        prefill_mean_ms=_mean_ms(delta, "vllm:request_prefill_time_seconds"))


def _mean_ms(delta: Metrics, histogram: str) -> float:
    """Mean of a server histogram over the run, in milliseconds (NaN: no sample)."""
    count = delta.total(histogram + "_count")
    return 1000 * delta.total(histogram + "_sum") / count if count > 0 else math.nan


def _ratio(base: float, value: float) -> float:
    return value / base if base > 0 else math.nan


@dataclass(frozen=True)
class Ratios:
    """``run`` against the run without offloading: above 1 is better for every field
    (throughput ours/theirs; latencies theirs/ours)."""

    throughput: float
    ttft_p50: float
    ttft_p90: float
    ttft_p99: float
    revisit_ttft_p50: float
    itl_p50: float


def ratios(base: RunFigures, run: RunFigures) -> Ratios:
    return Ratios(throughput=_ratio(base.request_throughput, run.request_throughput),
                  ttft_p50=_ratio(run.ttft_p50_ms, base.ttft_p50_ms),
                  ttft_p90=_ratio(run.ttft_p90_ms, base.ttft_p90_ms),
                  ttft_p99=_ratio(run.ttft_p99_ms, base.ttft_p99_ms),
                  revisit_ttft_p50=_ratio(run.revisit_ttft_p50_ms, base.revisit_ttft_p50_ms),
                  itl_p50=_ratio(run.itl_p50_ms, base.itl_p50_ms))


def differing_outputs(base: RunFigures, run: RunFigures) -> list[int]:
    """Indices of the requests whose greedy output differs from the base run's."""
    if len(base.outputs) != len(run.outputs):
        return list(range(max(len(base.outputs), len(run.outputs))))
    return [i for i, (a, b) in enumerate(zip(base.outputs, run.outputs, strict=True))
            if a != b]


def problems(model: str, runs: Sequence[RunFigures]) -> list[str]:
    """What fails the benchmark: failed requests, outputs that differ from the run
    without offloading, an offloading run with nothing loaded."""
    out = []
    bases = {(r.workload, r.concurrency): r for r in runs if r.config == "none"}
    for run in runs:
        where = f"{model} {run.workload} at concurrency {run.concurrency}, {run.config}"
        if run.failed:
            out.append(f"{where}: {run.failed} requests failed")
        base = bases.get((run.workload, run.concurrency))
        if base is None or run is base:
            continue
        differ = differing_outputs(base, run)
        if differ:
            out.append(f"{where}: {len(differ)} of {len(run.outputs)} outputs differ from "
                       f"the run without offloading (requests {differ[:8]})")
        if run.loaded_share <= 0:
            out.append(f"{where}: kvoffload loaded nothing (no hit)")
    return out


def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _tiers(loads: dict[str, float]) -> str:
    total = sum(loads.values())
    if not total:
        return "-"
    return " ".join(f"{t} {n / total:.0%}" for t, n in sorted(loads.items()))


HEADER = ("model", "workload", "conc.", "config", "req/s", "throughput", "TTFT p50",
          "TTFT p90", "TTFT p99", "revisit TTFT p50", "ITL p50", "cached", "loads by tier",
          "flush wait")


def table_rows(model: str, runs: Sequence[RunFigures]) -> list[tuple[str, ...]]:
    """One row a run: absolute figures for the base, ratios to it for the others."""
    bases = {(r.workload, r.concurrency): r for r in runs if r.config == "none"}
    rows = []
    for run in runs:
        base = bases.get((run.workload, run.concurrency))
        if base is None or run is base:
            cells = (f"{run.ttft_p50_ms:.0f} ms", f"{run.ttft_p90_ms:.0f} ms",
                     f"{run.ttft_p99_ms:.0f} ms", f"{run.revisit_ttft_p50_ms:.0f} ms",
                     f"{run.itl_p50_ms:.1f} ms")
            throughput = "1.00x"
        else:
            q = ratios(base, run)
            cells = (_x(q.ttft_p50), _x(q.ttft_p90), _x(q.ttft_p99), _x(q.revisit_ttft_p50),
                     _x(q.itl_p50))
            throughput = _x(q.throughput)
        rows.append((model, run.workload, str(run.concurrency), run.config,
                     f"{run.request_throughput:.2f}", throughput, *cells,
                     f"{run.cached_share:.0%}", _tiers(run.loads_by_tier),
                     f"{run.flush_wait_s:.2f} s" if run.config != "none" else "-"))
    return rows


def markdown_table(rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def run_json(model: str, run: RunFigures, base: RunFigures | None) -> dict[str, Any]:
    """One run for ``--json``: its figures, its ratios to the base, differing outputs."""
    out: dict[str, Any] = {"model": model, **{k: v for k, v in vars(run).items()
                                               if k != "outputs"}}
    if base is not None and base is not run:
        out["ratios"] = vars(ratios(base, run))
        out["differing_outputs"] = differing_outputs(base, run)
    return out
