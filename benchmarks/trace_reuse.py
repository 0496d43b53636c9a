"""How predictable prefix reuse is in a Mooncake-format trace.

Reports how many prompts a later request continues (so that a Mamba state or window kept
at the prompt's end serves a hit), whether a prompt's turn, length or output length tells
which, and how long the continuations take to come. See
``reuse_report`` for the definitions.

    .venv/bin/python benchmarks/trace_reuse.py                       # shared trace, 2000
    .venv/bin/python benchmarks/trace_reuse.py --preset gemma3-27b --limit 5000
    .venv/bin/python benchmarks/trace_reuse.py --trace my.jsonl --block-tokens 512 --json

Blocks default to the hit alignment of ``--preset`` (its engine block size as the
simulator picks it: vLLM's page-matching size for Mamba hybrids), since a hit can only
land on such a block's end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from kvoffload.errors import ConfigError, TraceError
from kvoffload.models.presets import get_preset
from kvoffload.sim.simulation import auto_block_size
from kvoffload.workloads.mooncake import read_mooncake_trace
from reuse_report import continuation_report, format_report

ROOT = Path(__file__).resolve().parents[1]
TRACE = Path(os.environ.get("KVOFFLOAD_TRACE", ROOT.parent / "shared" / "traces"
                            / "mooncake_conversation_trace.jsonl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path, default=TRACE,
                        help=f"Mooncake-format JSON lines (default {TRACE})")
    parser.add_argument("--limit", type=int, default=2000,
                        help="use the first N requests; 0: all (default 2000)")
    parser.add_argument("--preset", default="nemotron-h-8b",
                        help="model whose block size sets the hit alignment "
                             "(default nemotron-h-8b)")
    parser.add_argument("--block-tokens", type=int, default=None,
                        help="tokens per block instead of the preset's block size")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    if args.limit < 0:
        parser.error("--limit: must be 0 (all) or more")
    if args.block_tokens is not None and args.block_tokens < 1:
        parser.error("--block-tokens: must be at least 1")
    try:
        preset = get_preset(args.preset)
        block = args.block_tokens or auto_block_size(preset)
        report = continuation_report(
            read_mooncake_trace(args.trace, limit=args.limit or None), block)
    except (ConfigError, TraceError, OSError) as error:
        print(f"trace_reuse: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"block_tokens": block, **asdict(report)}, indent=1))
    else:
        print(f"{args.trace.name}, {report.requests:,} prompts of at least one "
              f"{block}-token block\n")
        print("\n".join(format_report(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
