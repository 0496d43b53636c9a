"""vLLM's OpenAI server under load, with kvoffload and without it, measured with vLLM's
own benchmark client.

For each model and each configuration the script starts vLLM's OpenAI-compatible server
(``python -m vllm.entrypoints.openai.api_server``, the entry point that works on the CPU
build too) and drives it with vLLM's benchmark client (``vllm bench serve``'s code, see
``serve_client.py``) at each load: streaming, greedy, ``--max-concurrency`` requests in
flight, every answer of its trace's length. Configurations:

  none    vLLM alone: what its own prefix cache has lost is recomputed
  host    kvoffload, host memory for the whole workload
  disk    kvoffload, host memory for about one request, a disk tier behind it
  redis   kvoffload, host memory for about one request, a local Redis behind it

Workloads (Mooncake-format traces replayed by the client's ``timed_trace`` dataset, each
hash id expanded to ``--chunk-tokens`` tokens; every load gets prompts of its own, so a
server's second load finds nothing of its first):

  chat      sessions of four turns over documents each read by two sessions, four
            sessions per request in flight (16 at concurrency 4, 32 at 8)
  mooncake  whole conversations of the shared Mooncake conversation trace (those of two
            requests or more, in trace order), answers capped

Models are made here with random weights: ``llama`` (8 layers, hidden 512: a prefill
costs real time) and ``tiny`` (2 layers, hidden 64: the engine's step is cheap, so the
connector's and the server's own work show). Every configuration at every load gets a
server of its own, vLLM's own cache sized for 1.25 longest requests per request in flight:
enough to run them, too small to keep what the workload comes back to.

Printed for every run: request throughput, TTFT p50/p90/p99 and ITL p50 as ratios to the
run without offloading at the same load in the same invocation (above 1 is better), the
share of prompt tokens the server did not compute, which tier served kvoffload's loads,
and how long the server's steps waited before their forward pass for transfers still
using blocks vLLM handed out again (``flush wait``); ``--json`` adds kvoffload's load
jobs, loaded tokens and deferred lookups, and the server's mean queue time (arrival to
first scheduling, a load's wait included) and prefill time (first scheduling to first
token). The script exits 1 when a request fails, when
a greedy output differs from the run without offloading, or when an offloading run
loads nothing.

Examples:
  python benchmarks/vllm_serve.py                      # both models, two loads (~40 min)
  python benchmarks/vllm_serve.py --quick              # the CI smoke run (~2 min)
  python benchmarks/vllm_serve.py --models tiny --busy 2 --configs none,host
  python benchmarks/vllm_serve.py --models tiny --policy lru --json > tiny-lru.json
  python benchmarks/vllm_serve.py --faults             # faults under load (serve_faults.py)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_progress import Progress
from e2e_models import ModelSpec, build_model
from e2e_redis import free_port, redis_process
from serve_report import (
    HEADER,
    RunFigures,
    figures,
    markdown_table,
    problems,
    revisits,
    run_json,
    table_rows,
)
from serve_runs import (
    ServerSettings,
    client_command,
    run_client,
    running_server,
    server_command,
)
from serve_setup import (
    SERVE_MODELS,
    ChatShape,
    add_word_tokenizer,
    chat_trace,
    longest_request,
    mooncake_excerpt,
    write_trace,
)

CONFIGS = ("none", "host", "disk", "redis")
WORKLOADS = ("chat", "mooncake")
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", Path(__file__).resolve().parents[2] / "shared"
                            / "traces" / "mooncake_conversation_trace.jsonl"))
ENGINE_CACHE_PER_REQUEST_IN_FLIGHT = 1.25
SESSIONS_PER_REQUEST_IN_FLIGHT = 4
MIN_HOST_MEMORY = 64 << 20
HASH_ID_STRIDE = 10_000_000
"""Added to every hash id of a load's trace, once per load before it: loads share no
prompt token (a Redis tier outlives the servers of one invocation)."""


@dataclass(frozen=True)
class Plan:
    """What one invocation runs."""

    models: tuple[ModelSpec, ...]
    configs: tuple[str, ...]
    workloads: tuple[str, ...]
    loads: tuple[int, ...]
    chat: ChatShape
    """The chat workload; its ``sessions`` apply to every load when
    ``fixed_sessions``, else each load gets ``SESSIONS_PER_REQUEST_IN_FLIGHT`` per
    request in flight (``chat_shape``)."""
    fixed_sessions: bool
    mooncake_requests: int
    chunk_tokens: int
    output_tokens: int
    policy: str | None
    busy: int
    reserve_core: bool = True


def _names(text: str, known: Sequence[str], flag: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"{flag}: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(known)}")
    return tuple(dict.fromkeys(names))


def _loads(text: str) -> tuple[int, ...]:
    try:
        loads = tuple(int(n) for n in text.split(",") if n.strip())
    except ValueError:
        raise SystemExit(f"--concurrency: {text!r} is not a list of whole numbers, "
                         "e.g. 4,8") from None
    if not loads or any(n < 1 or n > 64 for n in loads):
        raise SystemExit("--concurrency: give requests in flight from 1 to 64, e.g. 4,8")
    return loads


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm_serve.py", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="llama,tiny", metavar="NAMES",
                        help=f"from {', '.join(SERVE_MODELS)} (default: llama,tiny)")
    parser.add_argument("--configs", default=",".join(CONFIGS), metavar="NAMES",
                        help=f"from {', '.join(CONFIGS)} (default: all; 'none' always "
                             "runs: every ratio is to it)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), metavar="NAMES",
                        help=f"from {', '.join(WORKLOADS)} (default: both)")
    parser.add_argument("--concurrency", default="4,8", metavar="N,N",
                        help="the loads: requests in flight (default: 4,8)")
    parser.add_argument("--quick", action="store_true",
                        help="the CI smoke run: tiny model, chat workload of 16 sessions, "
                             "concurrency 4, configurations none and host")
    parser.add_argument("--sessions", type=int, default=None, metavar="N",
                        help="chat sessions at every load (default: "
                             f"{SESSIONS_PER_REQUEST_IN_FLIGHT} per request in flight; two "
                             "share each document)")
    parser.add_argument("--turns", type=int, default=4, metavar="N",
                        help="turns per chat session (default 4)")
    parser.add_argument("--document-chunks", type=int, default=32, metavar="N",
                        help="hash ids (of --chunk-tokens tokens) per chat document "
                             "(default 32: 2,048 tokens)")
    parser.add_argument("--mooncake-requests", type=int, default=64, metavar="N",
                        help="requests replayed from the Mooncake trace, whole "
                             "conversations (default 64)")
    parser.add_argument("--chunk-tokens", type=int, default=64, metavar="N",
                        help="tokens per trace hash id (default 64; Mooncake's own is 512, "
                             "which two CPU cores cannot prefill at any useful rate)")
    parser.add_argument("--output-tokens", type=int, default=32, metavar="N",
                        help="tokens per answer (the Mooncake trace's are capped at this; "
                             "default 32)")
    parser.add_argument("--policy", default=None, metavar="NAME",
                        help="kvoffload's eviction_policy (default: the connector's, value)")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="processes spinning on the CPU beside every server, as on a "
                             "shared host (default 0)")
    parser.add_argument("--vllm-reservation", action="store_true",
                        help="leave VLLM_CPU_NUM_OF_RESERVED_CPU unset: on two cores vLLM then "
                             "keeps no core for its engine process once a connector is set "
                             "(docs/vllm.md, Cores on a small CPU host); the default sets it "
                             "to 1 for every server, as the connector advises")
    parser.add_argument("--faults", action="store_true",
                        help="run the faults under load instead (see serve_faults.py): "
                             "Redis killed and restarted, the disk filled, clients hanging "
                             "up mid-stream")
    parser.add_argument("--fault-disk-size", type=int, default=256, metavar="MIB",
                        help="size of the tmpfs the disk tier fills in --faults (default "
                             "256; the tier's own capacity is three quarters of it)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object (every figure), nothing else")
    out.add_argument("--quiet", "-q", action="store_true", help="no progress lines")
    out.add_argument("--workdir", type=Path, metavar="DIR",
                     help="keep models, traces, logs and disk tiers here (default: a "
                          "temporary directory, removed at exit)")
    return parser


def make_plan(args: argparse.Namespace) -> Plan:
    if args.quick:
        return Plan(models=(SERVE_MODELS["tiny"],), configs=("none", "host"),
                    workloads=("chat",), loads=(4,),
                    chat=ChatShape(sessions=16, turns=2, document_chunks=16),
                    fixed_sessions=True,
                    mooncake_requests=0, chunk_tokens=args.chunk_tokens,
                    output_tokens=16, policy=args.policy, busy=args.busy,
                    reserve_core=not args.vllm_reservation)
    sessions = args.sessions
    given_sessions = () if sessions is None else (("--sessions", sessions),)
    for flag, value in (*given_sessions, ("--turns", args.turns),
                        ("--document-chunks", args.document_chunks),
                        ("--chunk-tokens", args.chunk_tokens),
                        ("--output-tokens", args.output_tokens)):
        if not 1 <= value <= 4096:
            raise SystemExit(f"{flag}: give a whole number from 1 to 4096 (got {value})")
    configs = _names(args.configs, CONFIGS, "--configs")
    return Plan(models=tuple(SERVE_MODELS[n] for n in
                             _names(args.models, tuple(SERVE_MODELS), "--models")),
                configs=("none", *(c for c in configs if c != "none")),
                workloads=_names(args.workloads, WORKLOADS, "--workloads"),
                loads=_loads(args.concurrency),
                chat=ChatShape(sessions=sessions or SESSIONS_PER_REQUEST_IN_FLIGHT,
                               turns=args.turns, document_chunks=args.document_chunks,
                               output_tokens=args.output_tokens),
                fixed_sessions=sessions is not None,
                mooncake_requests=args.mooncake_requests, chunk_tokens=args.chunk_tokens,
                output_tokens=args.output_tokens, policy=args.policy, busy=args.busy,
                reserve_core=not args.vllm_reservation)


def _offset(records: list[dict[str, Any]], by: int) -> list[dict[str, Any]]:
    return [{**r, "hash_ids": [h + by for h in r["hash_ids"]]} for r in records]


def chat_shape(plan: Plan, load: int) -> ChatShape:
    """The chat workload at ``load`` requests in flight."""
    if plan.fixed_sessions:
        return plan.chat
    return dataclasses.replace(plan.chat, sessions=SESSIONS_PER_REQUEST_IN_FLIGHT * load)


def make_traces(plan: Plan, directory: Path) -> dict[tuple[str, int], Path]:
    """One trace file per (workload, load), hash ids offset so that loads share none."""
    traces = {}
    for w, workload in enumerate(plan.workloads):
        if workload == "mooncake" and not TRACE.is_file():
            raise SystemExit(f"the mooncake workload reads {TRACE}, which is missing; "
                             "leave it out with --workloads chat")
        for i, load in enumerate(plan.loads):
            if workload == "chat":
                records = chat_trace(chat_shape(plan, load), plan.chunk_tokens)
            else:
                records = mooncake_excerpt(TRACE, plan.mooncake_requests,
                                           plan.chunk_tokens, plan.output_tokens)
            shifted = _offset(records, (w * len(plan.loads) + i) * HASH_ID_STRIDE)
            traces[(workload, load)] = write_trace(shifted,
                                                   directory / f"{workload}-{load}.jsonl")
    return traces


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def host_sizes(spec: ModelSpec, traces: dict[tuple[str, int], Path],
               chunk_tokens: int) -> tuple[int, int]:
    """Host memory of the ``host`` run (1.5x the KV of every distinct prompt token) and
    of the ``disk``/``redis`` runs (1.25x the KV of the longest request)."""
    distinct: set[int] = set()
    longest = 0
    for path in traces.values():
        records = _records(path)
        longest = max(longest, longest_request(records))
        for r in records:
            distinct.update(r["hash_ids"])
    big = max(MIN_HOST_MEMORY, int(1.5 * spec.kv_bytes(len(distinct) * chunk_tokens)))
    return big, int(1.25 * spec.kv_bytes(longest))


def transfer_config(config: str, host_bytes: tuple[int, int], policy: str | None,
                    disk_dir: Path, redis_url: str | None) -> dict[str, Any] | None:
    """``--kv-transfer-config`` of ``config``; None without offloading."""
    if config == "none":
        return None
    big, small = host_bytes
    extra: dict[str, Any] = {"host_memory_bytes": big if config == "host" else small}
    if policy is not None:
        extra["eviction_policy"] = policy
    if config == "disk":
        extra |= {"tiers": ["host", "disk"], "disk_path": str(disk_dir),
                  "disk_capacity": "8GiB"}
    if config == "redis":
        extra |= {"tiers": ["host", "remote"], "remote_url": redis_url}
    return {"kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """``count`` processes spinning on the CPU until the block ends."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(count)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def run_model(plan: Plan, spec: ModelSpec, work: Path, redis_url: str | None,
              progress: Progress) -> list[RunFigures]:
    """Every configuration of ``plan`` on ``spec`` at every load: one server per
    configuration and load (vLLM's own cache sized for that load), the workloads run
    against it one after another."""
    model = build_model(spec, work / "models")
    add_word_tokenizer(model.path)
    traces = make_traces(plan, work / "traces" / spec.name)
    longest = max(longest_request(_records(p)) for p in traces.values())
    hosts = host_sizes(spec, traces, plan.chunk_tokens)
    logs = work / "logs" / spec.name
    logs.mkdir(parents=True, exist_ok=True)
    results = []
    for load in plan.loads:
        settings = ServerSettings(
            model_dir=model.path, max_model_len=longest, step_tokens=spec.step_tokens,
            max_num_seqs=load, reserve_core=plan.reserve_core,
            engine_cache_bytes=spec.engine_cache_bytes(
                longest, ENGINE_CACHE_PER_REQUEST_IN_FLIGHT * load))
        for config in plan.configs:
            progress.describe(f"{spec.name}: {config} at concurrency {load}: starting")
            transfer = transfer_config(config, hosts, plan.policy,
                                       work / "disk" / spec.name / f"{config}-{load}",
                                       redis_url)
            port = free_port()
            with running_server(server_command(settings, port, transfer), port,
                                logs / f"server-{config}-{load}.log",
                                settings.environment()) as server:
                for workload in plan.workloads:
                    progress.describe(f"{spec.name}: {config}: {workload} at concurrency "
                                      f"{load}")
                    trace = traces[(workload, load)]
                    before = server.metrics()
                    name = f"{spec.name}-{config}-{workload}-{load}"
                    run = run_client(client_command(
                        server, model.path, trace, chunk_tokens=plan.chunk_tokens,
                        concurrency=load, num_prompts=len(_records(trace)),
                        result=work / "results" / f"{name}.json"),
                        logs / f"client-{name}.log")
                    results.append(figures(config, workload, load, run,
                                           delta=server.metrics().minus(before),
                                           revisit=revisits(_records(trace))))
                    progress.advance()
    order = {c: i for i, c in enumerate(plan.configs)}
    return sorted(results, key=lambda r: (plan.workloads.index(r.workload),
                                          plan.loads.index(r.concurrency), order[r.config]))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.faults:
        from serve_faults import main as faults_main
        return faults_main(args)
    plan = make_plan(args)
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvoffload-serve-")))
        (work / "results").mkdir(parents=True, exist_ok=True)
        redis_url = (stack.enter_context(redis_process()).url
                     if "redis" in plan.configs else None)
        stack.enter_context(busy_processes(plan.busy))
        total = len(plan.models) * len(plan.configs) * len(plan.workloads) * len(plan.loads)
        progress = stack.enter_context(Progress(total, not (args.quiet or args.json))
                                       .running())
        report: dict[str, Any] = {"plan": {"models": [m.name for m in plan.models],
                                           "configs": plan.configs,
                                           "workloads": plan.workloads,
                                           "concurrency": plan.loads, "busy": plan.busy,
                                           "policy": plan.policy or "value",
                                           "reserve_core": plan.reserve_core,
                                           "chunk_tokens": plan.chunk_tokens},
                                  "runs": []}
        rows: list[tuple[str, ...]] = []
        found: list[str] = []
        for spec in plan.models:
            runs = run_model(plan, spec, work, redis_url, progress)
            bases = {(r.workload, r.concurrency): r for r in runs if r.config == "none"}
            report["runs"] += [run_json(spec.name, r, bases.get((r.workload, r.concurrency)))
                               for r in runs]
            rows += table_rows(spec.name, runs)
            found += problems(spec.name, runs)
    report["problems"] = found
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(markdown_table(rows))
        print(f"\nRatios to 'none' at the same load: above 1 is better ({', '.join(HEADER[5:11])}"
              f"). Busy processes beside the server: {plan.busy}.")
        for line in found:
            print("PROBLEM: " + line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
