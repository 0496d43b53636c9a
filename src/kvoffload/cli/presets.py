"""``kvoffload presets``: the model presets and the cache bytes they imply."""

from __future__ import annotations

import argparse
import json
import textwrap
from typing import Any

from kvoffload.cli.common import format_bytes
from kvoffload.engine.model_presets import PRESETS, ModelPreset
from kvoffload.engine.simulation import auto_block_size

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload presets
      kvoffload presets --verbose          # sources and assumptions of every figure
      kvoffload presets --json

    Bytes are real bf16 KV bytes for one rank holding every KV head (no tensor
    parallelism). "per token" sums the attention layers (full and windowed); a sliding
    window group never holds more than its window per request. "per state" is one Mamba
    snapshot over every Mamba layer. "block" is the engine block size the simulator picks.
    """)


def preset_dict(p: ModelPreset) -> dict[str, Any]:
    bs = auto_block_size(p)
    layout = p.layout(bs)
    return {
        "name": p.name,
        "layers": p.num_layers,
        "bytes_per_token": p.bytes_per_token,
        "bytes_per_state": p.bytes_per_state,
        "block_size": bs,
        "params_per_token": p.params_per_token,
        "prefill_flops_per_token_at_4k": p.prefill_flops_per_token(4096),
        "groups": [{"name": g.spec.name, "kind": g.spec.kind.value,
                    "layers": g.spec.num_layers, "sliding_window": g.spec.sliding_window,
                    "bytes_per_token": g.bytes_per_token, "bytes_per_state": g.bytes_per_state,
                    "block_bytes": g.real_block_bytes} for g in layout.groups],
        "source": p.source,
        "assumptions": p.assumptions,
    }


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("presets", help="list the model presets and their cache bytes",
                            description="List the model presets with their per-token and "
                                        "per-state KV-cache bytes.",
                            epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="also print each preset's sources and assumptions")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    data = [preset_dict(p) for p in PRESETS.values()]
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [["preset", "layers", "per token", "per state", "block", "groups"]]
    for d in data:
        groups = ", ".join(
            f"{g['name']} x{g['layers']}" for g in d["groups"])
        rows.append([d["name"], str(d["layers"]), format_bytes(d["bytes_per_token"]),
                     format_bytes(d["bytes_per_state"]) if d["bytes_per_state"] else "-",
                     str(d["block_size"]), groups])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join([r[0].ljust(widths[0])] + [c.rjust(w) for c, w in
                                                   zip(r[1:5], widths[1:5], strict=True)]
                        + [r[5]]))
    if args.verbose:
        for p in PRESETS.values():
            print()
            print(p.describe())
    return 0
