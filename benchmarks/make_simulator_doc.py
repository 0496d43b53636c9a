"""Regenerate docs/simulator.md and its plots: one sweep over the shared Mooncake trace for
four presets (``DOC_PRESETS``), plus one run's time series.

    .venv/bin/python benchmarks/make_simulator_doc.py              # first 1000 requests
    .venv/bin/python benchmarks/make_simulator_doc.py --limit 3000

Everything runs in accounting mode through the same code as ``kvoffload sweep`` and
``kvoffload simulate``. Attention-only presets use engine blocks of 64 tokens and
offloaded blocks of 256 (block_size_factor 4); Nemotron-H uses vLLM's page-matching block
size, offloaded as is. The trace is looked up at ``$KVOFFLOAD_TRACE`` or at
``../shared/traces/`` beside the checkout.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

from kvoffload.cli.common import format_seconds
from kvoffload.cli.plots import plot_simulation, plot_sweep
from kvoffload.cli.tables import format_rows, sweep_table
from kvoffload.models.presets import PRESETS
from kvoffload.sim.replay import Arrival
from kvoffload.sim.simulation import (
    Mode,
    SimulationConfig,
    auto_block_size,
    describe_groups,
    resolve,
    simulate,
)
from kvoffload.sim.sweep import SweepPoint, run_sweep
from kvoffload.sizes import format_bytes
from kvoffload.workloads import read_mooncake_trace
from kvoffload.workloads.mooncake import (
    MAX_HASH_ID,
    MAX_INPUT_TOKENS,
    MAX_LINE_BYTES,
    MAX_NESTING,
    MAX_OUTPUT_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
)
from kvoffload.workloads.spec import WorkloadSpec

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", ROOT.parent / "shared" / "traces"
                            / "mooncake_conversation_trace.jsonl"))
DOCS = ROOT / "docs"
CAPACITIES = (16 << 30, 64 << 30, 256 << 30)
POLICIES = ("lru", "arc", "hybrid")
GiB = 1 << 30
ENGINE_BYTES = 80 * GiB
"""Accelerator memory for KV blocks in every run (an 80-141 GB H100/H200-class device)."""
DOC_PRESETS = ("llama3-8b", "gpt-oss-20b", "gemma3-27b", "nemotron-h-8b")
"""The presets the page sweeps: dense, sliding window, interleaved windows, Mamba hybrid."""


ORACLE = (
    "`--policy oracle` (in `simulate`, `sweep` and `plan`) runs the reference that knows "
    "the future of the workload it replays: it stores window blocks and Mamba states only"
    " where a later request hits, and evicts the key whose next use lies furthest ahead "
    "per byte. It goes through the same planner, engine and byte accounting as every "
    "other policy, so a sweep shows how far a policy is from what foresight would give "
    "(`docs/policy.md`, \"Distance to the oracle\"). It is a heuristic bound, and a "
    "reference only: a deployment (`OffloadConfig`, the vLLM connector) cannot select it.")
"""The simulator-only reference policy, in a sentence or three."""

HINTS = (
    "`--hint-accuracy P` (`simulate` and `sweep`) gives every request the client hints a "
    "vLLM client sends in `kv_transfer_params` (`docs/vllm.md`, \"Hints from clients\"): "
    "whether its conversation continues, taken from the workload's own future "
    "(`kvoffload.workloads.hints`: a later prompt contains its whole prompt, compared at "
    "16-token blocks, or at a trace's 512-token hash blocks, whose last partial block is "
    "never shared) and right with probability P (a seeded draw per request, "
    "`--seed`/`--seeds`), and its session id where the workload has one. The trace is then "
    "read whole before the run. Unset: no hints.")
"""What ``--hint-accuracy`` gives the requests of a run."""


def preset_config(name: str, limit: int) -> SimulationConfig:
    mamba = PRESETS[name].mamba is not None
    return SimulationConfig(
        preset=name, mode=Mode.ACCOUNTING, block_size=None if mamba else 64,
        block_size_factor=1 if mamba else 4, engine_capacity_bytes=ENGINE_BYTES,
        host_capacity_bytes=CAPACITIES[0], decode_tokens_per_step=16, arrival=Arrival.TRACE,
        baseline=False, sample_interval_s=5.0, eviction_policy="lru")


def layout_table(limit: int) -> list[str]:
    rows = ["| preset | groups | engine block | engine KV memory | host slot |",
            "|---|---|---|---|---|"]
    for name in DOC_PRESETS:
        config = preset_config(name, limit)
        layout = config.layout()
        caps, _ = resolve(config, layout)
        rows.append(f"| {name} | {'; '.join(describe_groups(layout))} | "
                    f"{layout.block_size} tokens x {config.block_size_factor} | "
                    f"{format_bytes((caps.engine_blocks - 1) * caps.engine_block_bytes)} "
                    f"({caps.engine_blocks - 1:,} blocks) | {format_bytes(caps.host_slot_bytes)} |")
    return rows


def slot_notes() -> list[str]:
    """How much of a host slot each group's offloaded block fills, per preset."""
    out = []
    for name in DOC_PRESETS:
        config = preset_config(name, 0)
        layout = config.layout()
        caps, _ = resolve(config, layout)
        factor, slot = config.block_size_factor, caps.host_slot_bytes
        fills = [f"{g.spec.name} {100 * g.real_block_bytes * factor / slot:.0f} %"
                 for g in layout.groups]
        out.append(f"  {name}: {', '.join(fills)}")
    return out


def markdown_table(points: list[SweepPoint]) -> list[str]:
    rows = sweep_table(points)
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--limit", type=int, default=1000, help="trace requests (default 1000)")
    parser.add_argument("--trace", type=Path, default=TRACE)
    args = parser.parse_args()
    if not args.trace.exists():
        print(f"trace not found: {args.trace} (set KVOFFLOAD_TRACE)", file=sys.stderr)
        return 2
    (DOCS / "img").mkdir(parents=True, exist_ok=True)
    spec = WorkloadSpec("trace", args.trace, args.limit, 0)
    started = time.perf_counter()
    points: list[SweepPoint] = []
    for name in DOC_PRESETS:
        print(f"sweeping {name} ...", file=sys.stderr)
        points += run_sweep(preset_config(name, args.limit), spec, presets=[name],
                            policies=POLICIES, capacities=CAPACITIES, seeds=[0])
    sweep_png = DOCS / "img" / "simulator_sweep.png"
    plot_sweep(points, sweep_png, f"Mooncake conversation trace, first {args.limit} requests")
    print("time series run ...", file=sys.stderr)
    run_config = replace(preset_config("gpt-oss-20b", args.limit),
                         host_capacity_bytes=64 * GiB, baseline=True)
    result = simulate(run_config, _Trace(args.trace, args.limit))
    run_png = DOCS / "img" / "simulator_run.png"
    plot_simulation(result, run_png, f"gpt-oss-20b, 64 GiB host, LRU, first {args.limit} "
                                     "requests of the Mooncake trace")
    elapsed = time.perf_counter() - started
    text = render(points, result, args.limit, elapsed)
    (DOCS / "simulator.md").write_text(text)
    print(format_rows(sweep_table(points)))
    print(f"wrote {DOCS / 'simulator.md'} in {elapsed:.0f} s", file=sys.stderr)
    return 0


class _Trace:
    """The trace, readable once per run."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit

    def __iter__(self):  # type: ignore[no-untyped-def]
        return read_mooncake_trace(self.path, limit=self.limit)


MODELS = [
    "## Models: presets, `--model` and `--tp`",
    "",
    "`kvoffload presets` lists the built-in models: "
    + ", ".join(f"`{name}`" for name in PRESETS) + ". They are data: "
    "`src/kvoffload/models/presets.json` holds each model's public config.json fields (with "
    "the Hugging Face repo they come from), and every figure (layer kinds, KV bytes per "
    "token, Mamba or gated delta-net state bytes, prefill FLOPs) is derived from them by "
    "`kvoffload.models.hf_config`, the same code that reads a local model:",
    "",
    "```bash",
    "kvoffload simulate --model ~/models/Qwen3-8B            # a model directory (or its "
    "config.json)",
    "kvoffload sweep --model ~/models/granite-4.0-h-small --tp 4 --host-capacity 4GiB,16GiB",
    "kvoffload presets --model ~/models/Qwen3-8B --tp 2 --verbose",
    "```",
    "",
    "`--model PATH` replaces `--preset` (`sweep` takes several, comma-separated). `--tp N` "
    "makes every figure one tensor-parallel rank's: KV heads are split over N ranks (at "
    "least one each), and so are query, Mamba and gated delta-net heads; a rank count the "
    "heads do not split over is refused in one line naming the count to change. "
    "[docs/models.md](models.md) lists the families kvoffload reads, what each layer kind "
    "holds, the approximations of the FLOPs count, and how to add a model.",
    "",
]

TRACE_FORMAT = [
    "`--trace` reads Mooncake-format JSON lines: one object per line with `timestamp` "
    "(arrival in milliseconds, finite, >= 0, never decreasing), `input_length` (1 to "
    f"{MAX_INPUT_TOKENS:,} tokens), `output_length` (1 to {MAX_OUTPUT_TOKENS:,} tokens) and "
    f"`hash_ids` (integers from 0 to {MAX_HASH_ID:,}, one per {MOONCAKE_BLOCK_TOKENS}-token "
    f"block: exactly ceil(input_length / {MOONCAKE_BLOCK_TOKENS}) of them); blank lines are "
    "skipped and other fields ignored. "
    f"Each line is checked with bounded work before it is trusted: at most {MAX_LINE_BYTES:,} "
    "bytes (over 100 times the shared trace's longest line, 2,053 bytes; no more than that is "
    "read), UTF-8, brackets nested at most "
    f"{MAX_NESTING} deep (checked before the JSON parser sees the line), and a prompt is built "
    "only once its lengths agree. The trace must be a regular file (a directory, FIFO or device "
    "is refused without reading from it) holding at least one request. The first problem stops "
    "the run with one line, `error: FILE:LINE: field 'NAME': what to change`, and exit status "
    "2; line 0 with field `<file>` is about the file as a whole, `<line>` about a line's length "
    "or encoding, `<json>` about its syntax, nesting or type.",
    "",
    "To make such a trace from your own request logs (chat messages or token ids, tokenized "
    "with the model's own tokenizer and chat template), and to see how much of a trace "
    "repeats and how long after before sizing anything: `kvoffload trace convert` and "
    "`kvoffload trace stats` ([traces.md](traces.md)).",
    "",
]


def render(points: list[SweepPoint], result: object, limit: int, elapsed: float) -> str:
    from kvoffload.sim.simulation import SimulationResult

    assert isinstance(result, SimulationResult)
    o, b = result.offload, result.baseline
    assert b is not None
    t = result.config.timing
    lines = [
        "# The simulator",
        "",
        "`kvoffload simulate` and `kvoffload sweep` replay a workload through a reference "
        "engine (`kvoffload.refengine`): a small model of a vLLM-style scheduler with a hybrid "
        "prefix-caching block pool (per-group block tables, null blocks outside a window, "
        "one Mamba state kept where the engine keeps it, chunked prefill under a token "
        "budget, decode, preemption when blocks run out). It calls kvoffload's planner "
        "exactly as an engine adapter does, and the planner's jobs go to the real "
        "`TransferWorker` on real tensors (`bytes` mode) or to an executor that completes "
        "them in modelled time (`accounting` mode). Every run is done twice, with and "
        "without offloading.",
        "",
        "What is modelled, and how:",
        "",
        "* **Bytes.** Every figure uses the model's real page sizes. Bytes mode moves pages "
        "scaled down (the smallest to 64 B) so that runs are quick, and says so. Block "
        "contents are a function of (prefix hash, group, layer, position): every block the "
        "engine adopts from its prefix cache or loads is compared byte for byte, and at the "
        "end every block the host tier can serve is audited; the wrong-byte count must be 0.",
        f"* **Time.** A step lasts `max(FLOPs / {t.accelerator_flops:.0e} FLOP/s, decode "
        f"iterations x {t.decode_step_s * 1e3:g} ms)`; a transfer occupies a "
        f"{t.link_bytes_per_s / 1e9:g} GB/s link per direction. *Modelled TTFT* is a "
        "request's own prefill FLOPs at that throughput plus its loaded bytes over the "
        "link (no queueing); *clock TTFT* adds queueing on the simulated clock.",
        "* **Engine memory.** Block ids are shared by all groups and each costs the largest "
        "group's block (vLLM pads pages to one size). Host slots likewise fit the largest "
        "group's offloaded block.",
        "* **Long replays** (accounting mode) let one simulated step stand for 16 engine "
        "iterations: decoding requests compute 16 tokens per step, the step budget is 16 x "
        "8192 tokens with at most 8192 per request. Blocks fill in the same order.",
        "* **Hits** are counted when a request first starts to run (a preempted request "
        "that comes back hits its own blocks, which is no reuse).",
        "",
        f"## One sweep over the Mooncake trace (first {limit:,} requests)",
        "",
        "The shared conversation trace (Mooncake, FAST 2025) arrives at its own timestamps. "
        "Each preset runs with 80 GiB of engine KV memory, 64 sequences at once, and host "
        "capacities of 16, 64 and 256 GiB under LRU, ARC and kvoffload's hybrid-aware "
        "policy (`hybrid`: window blocks and Mamba states only at likely hit points). "
        "Regenerate with `python benchmarks/make_simulator_doc.py` "
        f"(this one took {elapsed / 60:.0f} min on two cores).",
        "",
        *layout_table(limit),
        "",
        *markdown_table(points),
        "",
        "Columns: share of prompt tokens served by the engine's prefix cache and by "
        "offloading (loaded from host memory); prefill tokens computed with offloading "
        "and as a share of those computed without; mean modelled TTFT with and without "
        "offloading and their ratio; the most host memory the blocks held (real bytes).",
        "",
        "![sweep](img/simulator_sweep.png)",
        "",
        "Reading it:",
        "",
        "* *Prefill computed* also counts tokens computed again after a preemption (before "
        "the first token). With offloading a preempted request reloads its own blocks from "
        "host memory instead, so *vs no offload* can drop below 100 % where few prompt "
        "tokens hit other requests' blocks.",
        "* Nemotron-H runs at vLLM's page-matching block size (over 1000 tokens), while the "
        "trace's requests share prefixes in 512-token units: a shared system prompt shorter "
        "than one block never hits, in the engine or in any tier.",
        "* Gemma 3 holds about half a MiB of KV per token (52 window layers of 1024 tokens), "
        "and its full-attention blocks fill a fifth of a host slot (below), so host memory "
        "holds few prefixes.",
        "* Under LRU and ARC the window group stores every block (each could end some hit's "
        "window) but loads only the last window of a hit; the run below shows the ratio. "
        "The `hybrid` policy stores window blocks only near likely hit points.",
        "",
        "Every host slot is as large as the largest group's offloaded block, so a smaller "
        "group's block leaves part of its slot unused. Share of a slot each group's block "
        "fills:",
        "",
        "```",
        *slot_notes(),
        "```",
        "",
        "## One run over time",
        "",
        f"gpt-oss-20b, 64 GiB host, LRU: the engine's prefix cache serves "
        f"{100 * o.engine_hit_rate:.1f} % of prompt tokens and the host tier "
        f"{100 * o.host_hit_rate:.1f} % more (without offloading the engine serves "
        f"{100 * b.engine_hit_rate:.1f} %). Prefill tokens computed: "
        f"{o.prefill_tokens_computed:,} instead of {b.prefill_tokens_computed:,}; mean "
        f"modelled TTFT {format_seconds(o.ttft.mean)} instead of "
        f"{format_seconds(b.ttft.mean)}; {format_bytes(o.stored_bytes)} stored and "
        f"{format_bytes(o.loaded_bytes)} loaded ("
        + ", ".join(f"{g.name}: {format_bytes(g.stored_bytes)} / {format_bytes(g.loaded_bytes)}"
                    for g in o.groups) + ").",
        "",
        "![run](img/simulator_run.png)",
        "",
        "## Reproduce by hand",
        "",
        "```bash",
        "kvoffload simulate                      # built-in chat workload, bytes mode, verified",
        f"kvoffload sweep --preset {','.join(DOC_PRESETS)} \\",
        "    --trace ../shared/traces/mooncake_conversation_trace.jsonl"
        f" --limit {limit} --block-size 64 --block-size-factor 4 \\",
        "    --policy lru,arc,hybrid --host-capacity 16GiB,64GiB,256GiB --plot sweep.png",
        "python benchmarks/replay_speed.py       # the whole trace, accounting mode",
        "```",
        "",
        "(`--block-size 64` applies to every preset in that command; the table above runs "
        f"Nemotron-H at its page-matching block size {auto_block_size(PRESETS['nemotron-h-8b'])}.)",
        "",
        HINTS,
        "",
        ORACLE,
        "",
        *MODELS,
        "## Trace format",
        "",
        *TRACE_FORMAT,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
