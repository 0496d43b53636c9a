"""Time to first token in a real vLLM engine, with kvoffload and without it.

Runs a multi-turn workload on vLLM (in this process) for each model and each
configuration, and prints TTFT p50/p90 and the total time of each, as ratios to the run
without offloading measured in the same invocation:

  none     vLLM alone: what its own prefix cache has lost is recomputed
  host     kvoffload, host memory large enough for the whole workload
  disk     kvoffload, host memory for about one request, a disk tier behind it
  redis    kvoffload, host memory for about one request, a local Redis behind it
  restart  a fresh engine (empty host memory, empty vLLM cache) on the disk the
           'disk' run filled: what a restart on the same machine finds

The models are made here with random weights and realistic shapes (8 layers, hidden 512):
a Llama-shaped one (full attention), a Gemma-3-like one (sliding window) and a
Granite-4.0-hybrid-like one (Mamba2 + attention). The workload: a system prompt, a few
long documents, several conversations per document, each a few turns long; requests go
out one at a time, turn by turn, and vLLM's own cache holds little more than one request,
so a returning conversation has been pushed out of it. TTFT is vLLM's own per-request
metric (RequestOutput.metrics.first_token_latency).

Greedy outputs of every configuration must equal those of the run without offloading,
and every offloading configuration must record hits; otherwise the script exits 1.

Examples:
  python benchmarks/vllm_e2e.py                      # the default run (about 6 min)
  python benchmarks/vllm_e2e.py --quick              # 2k-token prompts, a few minutes
  python benchmarks/vllm_e2e.py --models llama --configs none,host --json > llama.json
  python benchmarks/vllm_e2e.py --quick --plot e2e.png
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import offline_vllm_env  # noqa: F401  # sets vLLM's environment: before vLLM is imported
from bench_progress import Progress
from e2e_engine import (
    CONFIGURATIONS,
    ENGINE_CACHE_REQUESTS,
    Configuration,
    RequestRecord,
    RunResult,
    RunSettings,
    parse_configurations,
    run_configuration,
)
from e2e_models import MODELS, BuiltModel, ModelSpec, build_model, parse_models
from e2e_redis import redis_server
from e2e_report import (
    Summary,
    markdown_table,
    output_problems,
    result_json,
    summarize,
    table_rows,
)
from e2e_workload import QUICK, WorkloadShape
from kvoffload.sizes import parse_size

MIN_HOST_MEMORY = 64 << 20


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm_e2e.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="all", metavar="NAMES",
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--configs", default="all", metavar="NAMES",
                        help=f"comma-separated, from {', '.join(CONFIGURATIONS)} (default: "
                             "all; 'none' always runs, every ratio is to it)")
    parser.add_argument("--quick", action="store_true",
                        help=f"a short run: {QUICK.documents} documents of "
                             f"{QUICK.document_tokens} tokens, {QUICK.conversations} "
                             f"conversations of {QUICK.turns} turns (the workload flags "
                             "below still apply on top)")
    work = parser.add_argument_group(
        "workload (defaults: the default run; --quick changes them)")
    defaults = WorkloadShape()
    for field in dataclasses.fields(WorkloadShape):
        flag = "--" + field.name.replace("_", "-")
        work.add_argument(flag, type=int, default=None, metavar="N",
                          help=f"default {getattr(defaults, field.name)}")
    cache = parser.add_argument_group("kvoffload")
    cache.add_argument("--host-memory", default="auto", metavar="SIZE",
                       help="host memory of the 'host' run, e.g. 1GiB (default: twice the "
                            "KV of every conversation's longest prompt, at least 64MiB)")
    cache.add_argument("--small-host-memory", default="auto", metavar="SIZE",
                       help="host memory of the 'disk', 'redis' and 'restart' runs "
                            "(default: 1.25 times the KV of the longest prompt)")
    cache.add_argument("--policy", default=None, metavar="NAME",
                       help="the connector's eviction_policy (default: the connector's "
                            "default, 'value')")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object (every figure and request), nothing else")
    out.add_argument("--plot", type=Path, metavar="FILE.png",
                     help="write a bar chart of the TTFT ratios (needs matplotlib)")
    out.add_argument("--quiet", "-q", action="store_true", help="no progress bar")
    out.add_argument("--workdir", type=Path, metavar="DIR",
                     help="keep models and disk tiers here (default: a temporary directory, "
                          "removed at exit)")
    return parser


def workload_shape(args: argparse.Namespace) -> WorkloadShape:
    base = QUICK if args.quick else WorkloadShape()
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(WorkloadShape)
             if getattr(args, f.name) is not None}
    return dataclasses.replace(base, **given)


def host_sizes(args: argparse.Namespace, spec: ModelSpec, shape: WorkloadShape,
               ) -> tuple[int, int]:
    prompt_kv = spec.kv_bytes(shape.longest_prompt)
    big = (max(MIN_HOST_MEMORY, 2 * shape.conversations * prompt_kv)
           if args.host_memory == "auto"
           else parse_size(args.host_memory, "--host-memory", minimum=1))
    small = (int(1.25 * prompt_kv) if args.small_host_memory == "auto"
             else parse_size(args.small_host_memory, "--small-host-memory", minimum=1))
    return big, small


def run_model(model: BuiltModel, configs: list[Configuration], settings: RunSettings,
              progress: Progress) -> list[RunResult]:
    results = []
    n = settings.shape.num_requests
    for config in configs:
        done = [0]

        def on_request(record: RequestRecord, config: Configuration = config,
                       done: list[int] = done) -> None:
            done[0] += 1
            progress.advance()
            progress.describe(f"{model.spec.name} · {config.name} · request {done[0]}/{n}")

        progress.describe(f"{model.spec.name} · {config.name} · starting the engine")
        result = run_configuration(model, config, settings, on_request)
        results.append(result)
        s = summarize(result)
        progress.note(f"{model.spec.name:8s} {config.name:8s} TTFT p50 {s.ttft_p50_s:7.3f} s, "
                      f"p90 {s.ttft_p90_s:7.3f} s, total {s.total_s:7.1f} s, "
                      f"{s.hit_tokens} tokens loaded by kvoffload")
    return results


def plot(path: Path, per_model: dict[str, list[Summary]]) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from e2e_report import ratios

    models = list(per_model)
    configs = [s.config for s in per_model[models[0]][1:]]
    fig, ax = plt.subplots(figsize=(1.6 + 1.8 * len(models), 3.6))
    width = 0.8 / max(1, len(configs))
    for i, name in enumerate(configs):
        values = []
        for m in models:
            base = per_model[m][0]
            s = next(x for x in per_model[m] if x.config == name)
            values.append(ratios(base, s).revisit_ttft_p50)
        xs = [j + (i - (len(configs) - 1) / 2) * width for j in range(len(models))]
        ax.bar(xs, values, width, label=name)
    ax.set_xticks(range(len(models)), models)
    ax.set_yscale("log")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("revisit TTFT p50: recompute / this")
    ax.set_title("TTFT of revisited prompts in vLLM, as a ratio to recompute")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        specs = parse_models(args.models)
        configs = parse_configurations(args.configs)
        shape = workload_shape(args)
        sizes = {s.name: host_sizes(args, s, shape) for s in specs}
    except ValueError as err:
        parser.error(str(err))
    needs_redis = any("remote" in c.tiers for c in configs)
    progress = Progress(len(specs) * len(configs) * shape.num_requests,
                        enabled=not (args.quiet or args.json))
    began = time.perf_counter()
    per_model: dict[str, list[Summary]] = {}
    report: dict[str, Any] = {"workload": dataclasses.asdict(shape),
                              "engine_cache_requests_target": ENGINE_CACHE_REQUESTS,
                              "models": []}
    problems: list[str] = []
    rows: list[tuple[str, ...]] = []
    with contextlib.ExitStack() as stack:
        root = args.workdir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvoffload-e2e-")))
        redis_url = stack.enter_context(redis_server()) if needs_redis else None
        with progress.running():
            for spec in specs:
                progress.describe(f"{spec.name} · building the model")
                model = build_model(spec, root / "models")
                big, small = sizes[spec.name]
                settings = RunSettings(shape, big, small, args.policy,
                                       root / "disk" / spec.name, redis_url)
                results = run_model(model, configs, settings, progress)
                summaries = [summarize(r) for r in results]
                per_model[spec.name] = summaries
                rows += table_rows(spec.name, summaries)
                problems += output_problems(spec.name, results)
                report["models"].append({
                    "name": spec.name, "summary": spec.summary,
                    "parameters": model.parameters,
                    "embedding_parameters": model.embedding_parameters,
                    "host_memory_bytes": big, "small_host_memory_bytes": small,
                    "configs": [result_json(r, s, summaries[0])
                                for r, s in zip(results, summaries, strict=True)]})
    report["wall_s"] = time.perf_counter() - began
    report["problems"] = problems
    if args.plot:
        plot(args.plot, per_model)
    if args.json:
        print(json.dumps(_json_safe(report), indent=2))
    else:
        print(f"workload: {shape.documents} documents of {shape.document_tokens} tokens, "
              f"{shape.conversations} conversations x {shape.turns} turns "
              f"({shape.num_requests} requests per run, prompts up to "
              f"{shape.longest_prompt} tokens), answers of {shape.answer_tokens} tokens; "
              f"ratios: the run without offloading / this run")
        print(markdown_table(rows))
        print(f"wall time {report['wall_s']:.0f} s")
        for line in problems:
            print(f"FAILED: {line}")
    if problems:
        print(f"{len(problems)} check(s) failed: see above", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
