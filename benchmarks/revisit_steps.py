"""Where a revisit's time to first token goes: alone, and several at once.

A *revisit* is a prompt whose long prefix (a document) was read before and has left
vLLM's own prefix cache. Without offloading vLLM computes the whole prompt again; with
kvoffload it loads the prefix from host memory and computes only the new tokens. This
script runs vLLM (in this process, the Llama-shaped model of ``vllm_e2e.py``: 8 layers,
hidden 512, random weights) without offloading and with each of ``--configs`` (``host``:
kvoffload's host tier; ``disk``: host memory for about one request, a disk tier behind it,
so most loads come from disk), reads each document once, empties vLLM's own cache, and
then sends revisits (each document with a new question):

  alone      one revisit, nothing else running
  together   ``--together`` revisits at once (of other documents)

It records every engine step (its wall time and the tokens it scheduled) and splits the
time until the last first token into steps that scheduled no token (requests waiting for
their loads), steps with prompt tokens (prefill) and steps with decode tokens only.
Printed per configuration and case: each request's TTFT (vLLM's own metric), that split,
and the ratio of the mean TTFT without offloading to the one with it. Greedy outputs must
be equal with and without kvoffload, and kvoffload must have loaded something; else the
script exits 1.

    python benchmarks/revisit_steps.py                    # about 1 minute
    python benchmarks/revisit_steps.py --configs host,disk --document-tokens 4096 --json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_vllm_env  # noqa: F401  # sets vLLM's environment: before vLLM is imported
from e2e_engine import (
    CONFIGURATIONS,
    RunSettings,
    connector_counters,
    drain,
    engine,
    parse_configurations,
    warm_up,
)
from e2e_models import FIRST_ORDINARY_TOKEN, MODELS, VOCAB, build_model
from e2e_workload import WorkloadShape

CASES = ("alone", "together")
OFFLOADING = ("host", "disk")
"""The kvoffload configurations of ``e2e_engine.CONFIGURATIONS`` this script runs."""


@dataclass(frozen=True)
class Step:
    """One engine step: when ``schedule`` returned (seconds since the case began) and the
    tokens it scheduled per request."""

    at: float
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class CaseResult:
    """One case of one configuration (times in milliseconds)."""

    config: str
    case: str
    ttft_ms: list[float]
    steps: int
    """Engine steps until the last first token."""
    empty_ms: float
    """Time in steps that scheduled no token (every request waiting for its load)."""
    prefill_ms: float
    """Time in steps that scheduled prompt tokens."""
    decode_ms: float
    """Time in steps that scheduled decode tokens only."""
    outputs: list[list[int]]

    @property
    def mean_ttft_ms(self) -> float:
        return sum(self.ttft_ms) / len(self.ttft_ms)


def split_steps(steps: list[Step], until: float) -> tuple[int, float, float, float]:
    """``(steps, empty, prefill, decode)`` seconds of the steps that began before
    ``until``: a step lasts until the next one began (the last one until ``until``);
    it is a prefill step when it scheduled more than one token for some request."""
    empty = prefill = decode = 0.0
    taken = [s for s in steps if s.at < until]
    for i, step in enumerate(taken):
        end = taken[i + 1].at if i + 1 < len(taken) else until
        length = max(0.0, end - step.at)
        if not step.tokens:
            empty += length
        elif max(step.tokens) > 1:
            prefill += length
        else:
            decode += length
    return len(taken), empty, prefill, decode


@dataclass(frozen=True)
class Prompts:
    """The documents, the question each is first read with, and each revisit's new one."""

    documents: list[list[int]]
    questions: list[list[int]]
    new_questions: list[list[int]]

    @classmethod
    def make(cls, count: int, args: argparse.Namespace, seed: int = 0) -> Prompts:
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(n)]

        return cls([tokens(args.document_tokens) for _ in range(count)],
                   [tokens(args.question_tokens) for _ in range(count)],
                   [tokens(args.question_tokens) for _ in range(count)])


def run_config(config_name: str, args: argparse.Namespace, root: Path, prompts: Prompts,
               ) -> tuple[list[CaseResult], dict[str, Any]]:
    """Read every document once, then run each case with new questions; the case
    results and kvoffload's counters."""
    from vllm import SamplingParams

    config = CONFIGURATIONS[config_name]
    shape = WorkloadShape(system_tokens=0, documents=1, document_tokens=args.document_tokens,
                          conversations=1, turns=1, question_tokens=args.question_tokens,
                          answer_tokens=args.answer_tokens)
    spec = MODELS["llama"]
    settings = RunSettings(shape=shape, host_memory_bytes=8 << 30,
                           small_host_memory_bytes=spec.kv_bytes(shape.longest_request),
                           policy=None, disk_root=root / "disk", redis_url=None)
    model = build_model(spec, root / "model")
    read = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    answer = SamplingParams(temperature=0, max_tokens=args.answer_tokens, ignore_eos=True,
                            detokenize=False)
    results = []
    with engine(model, config, settings, cache_requests=args.together + 0.25) as llm:
        warm_up(llm, config.offloads)
        for document, question in zip(prompts.documents, prompts.questions, strict=True):
            llm.generate([{"prompt_token_ids": document + question}], read, use_tqdm=False)
            drain(llm)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        schedule = scheduler.schedule
        batches = {"alone": [0], "together": list(range(1, 1 + args.together))}
        for case in CASES:
            if not llm.reset_prefix_cache():  # vLLM's own cache only
                raise RuntimeError("vLLM did not reset its prefix cache")
            steps: list[Step] = []
            began = time.perf_counter()

            def traced(*a: Any, steps: list[Step] = steps, began: float = began,
                       case: str = case, **k: Any) -> Any:
                out = schedule(*a, **k)
                steps.append(Step(time.perf_counter() - began,
                                  tuple(out.num_scheduled_tokens.values())))
                if args.trace:
                    print(f"  {config_name} {case} step at {1000 * steps[-1].at:.0f} ms: "
                          f"{dict(out.num_scheduled_tokens)} waiting {len(scheduler.waiting)}",
                          file=sys.stderr)
                return out

            scheduler.schedule = traced
            try:
                revisits = [{"prompt_token_ids": prompts.documents[i] + prompts.new_questions[i]}
                            for i in batches[case]]
                outs = llm.generate(revisits, answer, use_tqdm=False)
                drain(llm)
            finally:
                scheduler.schedule = schedule
            ttfts = [float(o.metrics.first_token_latency) for o in outs]
            count, empty, prefill, decode = split_steps(steps, max(ttfts))
            results.append(CaseResult(config_name, case, [1000 * t for t in ttfts], count,
                                      1000 * empty, 1000 * prefill, 1000 * decode,
                                      [list(o.outputs[0].token_ids) for o in outs]))
        counters = connector_counters(llm)
    return results, counters


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="revisit_steps.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--document-tokens", type=int, default=2048,
                        help="tokens of each document, the prefix a revisit reuses "
                             "(default 2048)")
    parser.add_argument("--question-tokens", type=int, default=128,
                        help="new tokens of each revisit (default 128: one vLLM block)")
    parser.add_argument("--answer-tokens", type=int, default=8, help="default 8")
    parser.add_argument("--together", type=int, default=4,
                        help="revisits sent at once in the 'together' case (default 4)")
    parser.add_argument("--configs", default="host",
                        help="kvoffload configurations beside vLLM alone, from "
                             f"{', '.join(OFFLOADING)} (default host)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--trace", action="store_true",
                        help="print every engine step to stderr: when it was scheduled, the "
                             "tokens it scheduled per request, the requests still waiting")
    args = parser.parse_args(argv)
    try:  # the baseline ("none") first, in e2e_engine's order
        configs = [c.name for c in parse_configurations(args.configs)]
    except ValueError:
        configs = []
    if len(configs) < 2 or not set(configs) <= {"none", *OFFLOADING}:
        parser.error(f"--configs: choose from {', '.join(OFFLOADING)} (got {args.configs!r})")
    for flag in ("document_tokens", "question_tokens", "answer_tokens", "together"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")

    prompts = Prompts.make(1 + args.together, args)
    results: dict[str, list[CaseResult]] = {}
    counters: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in configs:  # the baseline, "none", first
            results[name], counters[name] = run_config(name, args, Path(tmp) / name, prompts)
    problems = []
    ratios: dict[str, dict[str, float]] = {}
    for name, runs in results.items():
        if name == "none":
            continue
        for base, ours in zip(results["none"], runs, strict=True):
            if base.outputs != ours.outputs:
                problems.append(f"{name}, {ours.case}: outputs differ with kvoffload")
            ratios.setdefault(name, {})[ours.case] = base.mean_ttft_ms / ours.mean_ttft_ms
        if not counters[name].get("hit_tokens"):
            problems.append(f"{name}: kvoffload loaded nothing")
    if args.json:
        print(json.dumps({"runs": [{k: v for k, v in asdict(r).items() if k != "outputs"}
                                   for rs in results.values() for r in rs],
                          "ttft_ratio": ratios,
                          "connector": {n: c for n, c in counters.items() if n != "none"},
                          "problems": problems}, indent=1))
    else:
        print(f"document {args.document_tokens} tokens, question {args.question_tokens}, "
              f"answer {args.answer_tokens}; 'together': {args.together} revisits at once")
        print(f"{'config':6s} {'case':9s} {'TTFT ms (each request)':28s} {'steps':>5s} "
              f"{'no-token':>9s} {'prefill':>9s} {'decode':>9s}")
        for rs in results.values():
            for r in rs:
                each = ", ".join(f"{t:.0f}" for t in r.ttft_ms)
                print(f"{r.config:6s} {r.case:9s} {each:28s} {r.steps:5d} "
                      f"{r.empty_ms:7.0f}ms {r.prefill_ms:7.0f}ms {r.decode_ms:7.0f}ms")
        for name, by_case in ratios.items():
            for case, ratio in by_case.items():
                print(f"mean TTFT without offloading / with kvoffload ({name}), {case}: "
                      f"{ratio:.1f}x")
        for name, c in counters.items():
            if name == "none":
                continue
            line = f"kvoffload ({name}), both cases: {c.get('load_jobs', 0)} load jobs"
            if "loaded_blocks_by_tier" in c:
                line += f", blocks loaded by tier {c['loaded_blocks_by_tier']}"
            if "blocks_without_room" in c:
                line += (f", {c['blocks_without_room']} blocks recomputed for want of a "
                         "host slot to promote into")
            print(line)
        for problem in problems:
            print(f"PROBLEM: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
