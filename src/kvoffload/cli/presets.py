"""``kvoffload presets``: the model presets and the cache bytes they imply."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from typing import Any

from kvoffload.cli.common import add_model_options, check_model
from kvoffload.errors import ConfigError
from kvoffload.models.hf_config import resolve_model
from kvoffload.models.preset import ModelPreset
from kvoffload.models.presets import PRESETS
from kvoffload.sim.simulation import auto_block_size
from kvoffload.sizes import format_bytes

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload presets
      kvoffload presets --verbose          # sources and assumptions of every figure
      kvoffload presets --json
      kvoffload presets --tp 2             # per rank, KV and Mamba heads over 2 ranks
      kvoffload presets --model ~/models/Qwen3-8B   # a local model's own config.json

    Bytes are real KV bytes (the model's dtype, bf16 for most) of one rank: every KV head
    without --tp. "per token" sums the attention layers (full and windowed); a sliding
    window group never holds more than its window per request. "per state" is one Mamba
    (or gated delta-net) snapshot over every such layer. "block" is the engine block size
    the simulator picks. The presets are data: src/kvoffload/models/presets.json holds each
    model's public config.json fields (docs/models.md says how to add one).
    """)


def preset_dict(p: ModelPreset) -> dict[str, Any]:
    bs = auto_block_size(p)
    layout = p.layout(bs)
    return {
        "name": p.name,
        "family": p.family,
        "tensor_parallel": p.tensor_parallel,
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
    add_model_options(parser)
    parser.set_defaults(run=run)


def selected_presets(args: argparse.Namespace) -> list[ModelPreset]:
    """``--model``'s model, or every preset, for ``--tp`` ranks. A preset whose heads do
    not split over that many ranks is left out with a note on stderr."""
    check_model(args)
    if args.model is not None:
        return [resolve_model(args.model, args.tp)]
    out = []
    for name in PRESETS:
        try:
            out.append(resolve_model(name, args.tp))
        except ConfigError as exc:
            if exc.field != "tensor_parallel":
                raise
            print(f"note: {exc.problem}", file=sys.stderr)
    if not out:
        raise ConfigError("tensor_parallel", f"no preset splits over {args.tp} ranks",
                          "Give a rank count such as 2, 4 or 8.")
    return out


def run(args: argparse.Namespace) -> int:
    presets = selected_presets(args)
    data = [preset_dict(p) for p in presets]
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    rows = [["preset", "family", "layers", "per token", "per state", "block", "groups"]]
    for d in data:
        groups = ", ".join(
            f"{g['name']} x{g['layers']}" for g in d["groups"])
        rows.append([d["name"], d["family"], str(d["layers"]),
                     format_bytes(d["bytes_per_token"]),
                     format_bytes(d["bytes_per_state"]) if d["bytes_per_state"] else "-",
                     str(d["block_size"]), groups])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join([r[0].ljust(widths[0]), r[1].ljust(widths[1])]
                        + [c.rjust(w) for c, w in zip(r[2:6], widths[2:6], strict=True)]
                        + [r[6]]))
    if args.verbose:
        for p in presets:
            print()
            print(p.describe())
    return 0
