"""Faults under load: ``vllm_serve.py --faults``.

One model (the first of ``--models``), the chat workload at the first ``--concurrency``,
vLLM's benchmark client as in the main runs. First a server without offloading gives the
reference outputs; then a server with kvoffload, host memory for about one request, a disk
tier and a Redis tier behind it, while faults are injected by the run's progress (requests
the server has completed, read from its ``/metrics``):

* the Redis server is killed (SIGKILL) after a quarter of the requests and started again,
  empty, after half;
* the disk tier's filesystem (a tmpfs of ``--fault-disk-size``, mounted for the run; needs
  root, otherwise that fault is skipped and said so) is filled to the last byte by another
  file after a third of the requests, and stays full;
* other clients send streaming requests over the same documents and hang up after the
  first tokens, one every ``ABORT_EVERY_S`` seconds for the whole run.

Then the server must still answer, and the script checks: no request of vLLM's client
failed, every greedy output equals the reference, nothing is left pinned in host memory
(``vllm:kvoffload_host_pinned_slots``) and no request is left running. It prints what each
fault did (failed stores and loads, the tiers that served loads) and exits 1 on a problem.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from e2e_models import FIRST_ORDINARY_TOKEN, VOCAB, build_model
from e2e_redis import RedisProcess, free_port, redis_process
from serve_runs import (
    SERVED_NAME,
    ClientRun,
    Metrics,
    Server,
    ServerSettings,
    client_command,
    run_client,
    running_server,
    server_command,
)
from serve_setup import ChatShape, add_word_tokenizer, chat_trace, write_trace

ABORT_EVERY_S = 1.5
ABORT_AFTER_CHUNKS = 2


@dataclass
class FaultLog:
    """What the injector did, with the progress (completed requests) at which."""

    events: list[str] = field(default_factory=list)
    aborted: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, text: str) -> None:
        with self.lock:
            self.events.append(text)


@contextlib.contextmanager
def small_filesystem(path: Path, size_mib: int) -> Iterator[bool]:
    """A tmpfs of ``size_mib`` MiB mounted at ``path`` for the block (True), or nothing
    (False) where this process may not mount one."""
    path.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if os.geteuid() != 0 or mount is None:
        yield False
        return
    done = subprocess.run([mount, "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs",
                           str(path)], capture_output=True, check=False)
    if done.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(directory: Path) -> int:
    """Write a file into ``directory`` until its filesystem has no byte left; its size."""
    written = 0
    chunk = b"\0" * (1 << 20)
    with open(directory / "ballast", "wb", buffering=0) as out:
        with contextlib.suppress(OSError):
            while True:
                written += out.write(chunk)
        with contextlib.suppress(OSError):  # the last partial megabyte
            while out.write(b"\0" * 4096):
                written += 4096
    return written


def completed(server: Server) -> float:
    return server.metrics().total("vllm:request_success_total")


def inject(server: Server, total: int, *, redis: RedisProcess, disk: Path | None,
           log: FaultLog, stop: threading.Event) -> None:
    """Kill Redis at 1/4 of ``total`` requests, restart it at 1/2, fill ``disk`` at 1/3."""
    base = completed(server)
    steps: list[tuple[float, str, Callable[[], object]]] = [
        (total / 4, "Redis killed", redis.kill),
        (total / 2, "Redis started again, empty", redis.start)]
    if disk is not None:
        steps.append((total / 3, "disk filled", lambda: fill(disk)))
    steps.sort(key=lambda s: s[0])
    while steps and not stop.is_set():
        done = completed(server) - base
        while steps and done >= steps[0][0]:
            _, what, action = steps.pop(0)
            action()
            log.add(f"{what} after {done:.0f} of {total} requests")
        time.sleep(0.2)


def abort_streams(server: Server, documents: list[list[int]], log: FaultLog,
                  stop: threading.Event) -> None:
    """Until ``stop``: a streaming request over a document and a new question, dropped
    (the connection closed) after ``ABORT_AFTER_CHUNKS`` chunks."""
    rng = random.Random(7)
    while not stop.wait(ABORT_EVERY_S):
        prompt = rng.choice(documents) + [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB)
                                          for _ in range(32)]
        body = json.dumps({"model": SERVED_NAME, "prompt": prompt, "max_tokens": 64,
                           "temperature": 0, "stream": True})
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request("POST", "/v1/completions", body,
                         {"Content-Type": "application/json"})
            reply = conn.getresponse()
            chunks = 0
            while chunks < ABORT_AFTER_CHUNKS:
                line = reply.readline()
                if not line:
                    break
                chunks += line.startswith(b"data:")
            log.aborted += 1
        except OSError as exc:
            log.add(f"an aborting client could not send: {exc}")
        finally:
            conn.close()


def probe(server: Server) -> str:
    """One short request after the run: the server still answers."""
    body = json.dumps({"model": SERVED_NAME, "prompt": list(range(100, 164)),
                       "max_tokens": 4, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
        if reply.status != 200:
            raise RuntimeError(f"the server answered {reply.status} after the run: {data!r}")
        return str(json.loads(data)["choices"][0]["text"])
    finally:
        conn.close()


def _documents(trace: list[dict[str, Any]], chunk_tokens: int) -> list[list[int]]:
    """Token ids made like no trace's: the abort clients' own documents (each shared by
    the clients that pick it, so their stores and loads run too)."""
    rng = random.Random(11)
    length = len(trace[0]["hash_ids"]) * chunk_tokens
    return [[rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(length)]
            for _ in range(4)]


def main(args: argparse.Namespace) -> int:
    from vllm_serve import make_plan, transfer_config

    plan = make_plan(args)
    spec = plan.models[0]
    load = plan.loads[0]
    shape = plan.chat if args.quick else ChatShape(sessions=16, turns=3, document_chunks=16,
                                                   output_tokens=plan.output_tokens)
    with contextlib.ExitStack() as stack:
        work = args.workdir or Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvoffload-faults-")))
        model = build_model(spec, work / "models")
        add_word_tokenizer(model.path)
        records = chat_trace(shape, plan.chunk_tokens)
        trace = write_trace(records, work / "traces" / "faults.jsonl")
        longest = max(int(r["input_length"]) + int(r["output_length"]) for r in records)
        settings = ServerSettings(model_dir=model.path, max_model_len=longest,
                                  engine_cache_bytes=spec.engine_cache_bytes(longest,
                                                                             1.25 * load),
                                  step_tokens=spec.step_tokens, max_num_seqs=load,
                                  reserve_core=plan.reserve_core)
        logs = work / "logs"
        logs.mkdir(parents=True, exist_ok=True)

        def client(server: Server, name: str) -> ClientRun:
            return run_client(client_command(
                server, model.path, trace, chunk_tokens=plan.chunk_tokens,
                concurrency=load, num_prompts=len(records),
                result=work / f"result-{name}.json"), logs / f"client-{name}.log")

        port = free_port()
        with running_server(server_command(settings, port, None), port,
                            logs / "server-none.log", settings.environment()) as server:
            reference = client(server, "none")

        redis = stack.enter_context(redis_process())
        disk = work / "disk"
        mounted = stack.enter_context(small_filesystem(disk, args.fault_disk_size))
        per_token = spec.kv_bytes(1)
        transfer = transfer_config("disk", (0, int(1.25 * per_token * longest)), plan.policy,
                                   disk, None)
        assert transfer is not None
        extra = transfer["kv_connector_extra_config"]
        extra |= {"tiers": ["host", "disk", "remote"], "remote_url": redis.url,
                  "disk_capacity": f"{max(1, args.fault_disk_size * 3 // 4)}MiB"}
        log = FaultLog()
        if not mounted:
            log.add("disk fill skipped: mounting a tmpfs needs root")
        port = free_port()
        with running_server(server_command(settings, port, transfer), port,
                            logs / "server-faults.log", settings.environment()) as server:
            stop = threading.Event()
            threads = [threading.Thread(target=inject, daemon=True,
                                        args=(server, len(records)),
                                        kwargs={"redis": redis, "log": log, "stop": stop,
                                                "disk": disk if mounted else None}),
                       threading.Thread(target=abort_streams, daemon=True,
                                        args=(server, _documents(records, plan.chunk_tokens),
                                              log, stop))]
            for t in threads:
                t.start()
            try:
                faulty = client(server, "faults")
            finally:
                stop.set()
                for t in threads:
                    t.join(timeout=120)
            probe(server)
            time.sleep(2)
            probe(server)
            metrics = server.metrics()
    return report(args, reference, faulty, metrics, log)


def report(args: argparse.Namespace, reference: ClientRun, faulty: ClientRun,
           metrics: Metrics, log: FaultLog) -> int:
    """Print what happened and what is wrong; 1 on a problem."""
    differ = [i for i, (a, b) in enumerate(zip(reference.outputs, faulty.outputs,
                                               strict=False)) if a != b]
    if len(reference.outputs) != len(faulty.outputs):
        differ.append(-1)
    counters = {name: metrics.total(f"vllm:kvoffload_{name}_total") for name in
                ("failed_stores", "failed_loads", "abandoned_loads", "store_jobs",
                 "load_jobs")}
    figures: dict[str, Any] = {
        "faults": log.events, "aborted_streams": log.aborted,
        "requests": len(faulty.outputs), "failed_requests": faulty.failed,
        "differing_outputs": differ, "pinned_slots_at_end":
            metrics.total("vllm:kvoffload_host_pinned_slots"),
        "running_at_end": metrics.total("vllm:num_requests_running"),
        **{name: metrics.by_label(f"vllm:kvoffload_{name}_total", "tier") for name in
           ("tier_blocks_loaded", "tier_blocks_written", "tier_write_failures",
            "tier_read_failures")},
        **counters}
    problems = []
    if faulty.failed:
        problems.append(f"{faulty.failed} requests of vLLM's client failed")
    if differ:
        problems.append(f"{len(differ)} outputs differ from the run without offloading")
    if figures["pinned_slots_at_end"]:
        problems.append(f"{figures['pinned_slots_at_end']:.0f} host slots still pinned")
    if figures["running_at_end"]:
        problems.append(f"{figures['running_at_end']:.0f} requests still running")
    if not counters["load_jobs"]:
        problems.append("kvoffload loaded nothing: the faults were not under load")
    figures["problems"] = problems
    if args.json:
        print(json.dumps(figures, indent=1))
    else:
        for key, value in figures.items():
            print(f"{key}: {value}")
    return 1 if problems else 0
