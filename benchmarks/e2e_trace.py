"""``vllm_e2e.py`` with a time-stamped line for each step of the connector on stderr.

Runs ``benchmarks/vllm_e2e.py`` with the same arguments, in this process, and writes one
``TRACE <seconds> <event> ...`` line to stderr for each connector event that matters to
a revisit's wait:

  lookup      the scheduler's answer to vLLM (``None``: "ask again later")
  defer       a deferred lookup: how many times in a row, and what it falls back to
  prefetch    the keys a deferred lookup asks the lower tiers for, and how many they hold
  step        a step plan with something in it: tokens vLLM scheduled, loads (blocks
              each), stores, tier jobs, loads resolved without a worker
  submit      the worker submitting a step's loads: how long that took, the copy backend
              and its copy threads
  poll        the worker's poll while a load is in flight: loads still in flight, loads
              finished, seconds since the previous poll
  report      the workers' reports reaching the scheduler: finished and failed loads and
              tier jobs, loaded bytes

Seconds count from the start of this script. A load's wait is the time from its ``step``
line to the ``poll`` that finishes it; ``poll`` lines between them show how often the
engine stepped meanwhile. The wrappers only read: figures and outputs are those of
``vllm_e2e.py`` (a little slower per step for the printing)::

    python benchmarks/e2e_trace.py --models llama --configs none,host 2> trace.txt
    grep 'TRACE.* \\(step\\|poll\\)' trace.txt
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_e2e  # sets vLLM's environment before vLLM is imported
from kvoffload.integrations.vllm.scheduler_side import SchedulerSide
from kvoffload.integrations.vllm.worker_side import WorkerSide
from kvoffload.planner.planner import Planner
from kvoffload.tiers.cascade import CascadeTier

START = time.monotonic()


def trace(*fields: object) -> None:
    """One ``TRACE`` line on stderr, stamped with the seconds since the script started."""
    print(f"TRACE {time.monotonic() - START:9.4f}", *fields, file=sys.stderr, flush=True)


def wrap(cls: type, name: str, after: Callable[..., None]) -> None:
    """Replace ``cls.name`` by a call of the original followed by
    ``after(self, result, seconds, *args)``."""
    original = getattr(cls, name)

    @functools.wraps(original)
    def traced(self: Any, *args: Any) -> Any:
        began = time.monotonic()
        result = original(self, *args)
        after(self, result, time.monotonic() - began, *args)
        return result

    setattr(cls, name, traced)


def _lookup(side: SchedulerSide, result: Any, _s: float, request: Any, computed: int) -> None:
    trace("lookup", request.request_id, "computed", computed, "->", result)


def _defer(planner: Planner, result: Any, _s: float, st: Any, fallback: int) -> None:
    trace("defer", st.request.request_id, "times", st.deferred_steps, "fallback", fallback,
          "->", result.num_tokens)


def _prefetch(tier: CascadeTier, _r: Any, _s: float, hints: Any) -> None:
    if hints.prefetch:
        trace("prefetch", len(hints.prefetch), "keys, wanted from lower tiers",
              len(tier._want))


def _step(side: SchedulerSide, meta: Any, _s: float, so: Any) -> None:
    plan = meta.plan
    tokens = sum(so.num_scheduled_tokens.values())
    if tokens or plan.loads or plan.stores or plan.tier_jobs or meta.resolved_loads:
        trace("step tokens", tokens, "loads", [job.num_blocks for job in plan.loads],
              "stores", len(plan.stores), "tier_jobs", len(plan.tier_jobs),
              "resolved", list(meta.resolved_loads))


def _report(side: SchedulerSide, _r: Any, _s: float, worker_meta: Any) -> None:
    for r in getattr(worker_meta, "reports", None) or ():
        if r.finished or r.failed or r.tier_finished or r.tier_failed:
            trace("report finished", len(r.finished), "failed", len(r.failed),
                  "tier_finished", len(r.tier_finished), "tier_failed", len(r.tier_failed),
                  "loaded_bytes", r.stats.loaded_bytes)


def _submit(side: WorkerSide, _r: Any, seconds: float, meta: Any) -> None:
    if meta.plan.loads:
        backend = side.worker.backend
        trace("submit loads", len(meta.plan.loads), f"in {seconds * 1e3:.2f} ms",
              type(backend).__name__, "copy_threads", getattr(backend, "copy_threads", "?"))


_last_poll = [START]


def _poll(side: WorkerSide, result: Any, _s: float, meta: Any) -> None:
    now = time.monotonic()
    finished, failed = result
    if side._loads or finished:
        trace("poll in_flight", len(side._loads), "finished", sorted(finished),
              "failed", sorted(failed), f"gap {(now - _last_poll[0]) * 1e3:.2f} ms")
    _last_poll[0] = now


def install() -> None:
    """Put the tracing wrappers on the connector's classes."""
    wrap(SchedulerSide, "get_num_new_matched_tokens", _lookup)
    wrap(SchedulerSide, "build_meta", _step)
    wrap(SchedulerSide, "update_connector_output", _report)
    wrap(Planner, "_defer_or", _defer)
    wrap(CascadeTier, "hint", _prefetch)
    wrap(WorkerSide, "start_loads", _submit)
    wrap(WorkerSide, "transfer_results", _poll)


if __name__ == "__main__":
    install()
    sys.exit(vllm_e2e.main(sys.argv[1:]))
