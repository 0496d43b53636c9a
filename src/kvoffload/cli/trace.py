"""``kvoffload trace``: traces from real traffic (``convert``) and what they hold (``stats``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.cli.common import UsageError, format_seconds, progress_bar, whole_number
from kvoffload.errors import ConfigError
from kvoffload.workloads.mooncake import (
    MAX_INPUT_TOKENS,
    MAX_OUTPUT_TOKENS,
    MOONCAKE_BLOCK_TOKENS,
    count_trace_lines,
)

if TYPE_CHECKING:
    from kvoffload.workloads.convert import ConvertSummary
    from kvoffload.workloads.trace_stats import Distribution, TraceStats

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload trace convert chat.jsonl --model ~/models/Qwen3-8B -o trace.jsonl
      kvoffload trace convert tokens.jsonl -o trace.jsonl --force --json
      kvoffload trace stats trace.jsonl
      kvoffload simulate --trace trace.jsonl --mode accounting

    Input formats (JSON lines, one request a line; docs/traces.md):
      chat logs   {"messages": [{"role": "user", "content": "..."}], "timestamp": ...,
                   "session_id": ..., "output_tokens": ...}   (or "max_tokens")
      token logs  {"tokens": [1, 2, ...], "timestamp": ..., "output_length": ...}
    """)

CONVERT_EPILOG = textwrap.dedent("""\
    examples:
      kvoffload trace convert chat.jsonl --model ~/models/Qwen3-8B -o trace.jsonl
      kvoffload trace convert chat.jsonl --model DIR --chat-template tmpl.jinja -o t.jsonl
      kvoffload trace convert tokens.jsonl -o trace.jsonl --time-unit ms --force

    Chat logs: each line {"messages": [{"role", "content"}, ...]} with optional
    "timestamp" (seconds, or ISO 8601 like 2025-01-31T12:00:00Z), "session_id",
    "tools" and the output length ("output_length", "output_tokens" or "max_tokens").
    The prompt is rendered with the model's chat template (as transformers'
    apply_chat_template renders it, with the generation prompt) and tokenized with its
    tokenizer.json; nothing is downloaded. Token logs: each line {"tokens": [...]} with
    the same optional fields.

    Every block of --block-size tokens (the last partial one too) gets the chained hash
    of the block and everything before it; hashes are numbered 0, 1, 2, ... in order of
    first appearance. Lines are sorted into arrival order and timestamps written in
    milliseconds from the first arrival. The whole log is checked before anything is
    written, and the trace appears only once complete.
    """)

STATS_EPILOG = textwrap.dedent("""\
    examples:
      kvoffload trace stats trace.jsonl
      kvoffload trace stats ../shared/traces/mooncake_conversation_trace.jsonl --json

    Reuse share: input blocks whose hash id appeared in an earlier request. Prefix reuse:
    those in a prompt's leading run of such blocks (what a prefix cache can serve).
    Ideal hit: prompt tokens in those runs, the most an unbounded cache would serve.
    Reuse distance: requests (or seconds) since a reused block's previous use; a cache
    must keep blocks that long to serve them. Percentiles are nearest-rank.
    """)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "trace", help="convert request logs to traces, and show a trace's reuse",
        description="Traces from real traffic: convert chat or token-id logs into "
                    "Mooncake-format traces, and show how much of a trace repeats.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.set_defaults(run=lambda args: _no_subcommand(parser))
    commands = parser.add_subparsers(dest="trace_command", metavar="COMMAND")

    convert = commands.add_parser(
        "convert", help="chat or token-id logs -> a Mooncake-format trace",
        description="Tokenize a chat log with the model's own tokenizer and chat template "
                    "(or take a log of token ids) and write a Mooncake-format trace of "
                    "chained block hashes that 'kvoffload simulate --trace' replays.",
        epilog=CONVERT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    convert.add_argument("log", type=Path, metavar="LOG",
                         help="the JSON-lines log (chat messages or token ids)")
    convert.add_argument("--output", "-o", type=Path, required=True, metavar="FILE",
                         help="the trace to write")
    convert.add_argument("--force", action="store_true", help="replace FILE if it exists")
    convert.add_argument("--model", type=Path, metavar="DIR",
                         help="a local model directory with tokenizer.json (and its chat "
                              "template in tokenizer_config.json or chat_template.jinja); "
                              "needed for chat logs")
    convert.add_argument("--chat-template", type=Path, metavar="FILE",
                         help="a Jinja chat template to use instead of the model's")
    convert.add_argument("--format", choices=("auto", "chat", "tokens"), default="auto",
                         dest="log_format",
                         help="the log's format (default auto: the first line decides)")
    convert.add_argument("--block-size", type=whole_number, default=MOONCAKE_BLOCK_TOKENS,
                         metavar="TOKENS",
                         help=f"tokens per hash id (default {MOONCAKE_BLOCK_TOKENS}, the "
                              "Mooncake block that simulate reads)")
    convert.add_argument("--output-length", type=whole_number, default=None, metavar="N",
                         help="output tokens of a request whose line gives none "
                              "(default 256)")
    convert.add_argument("--time-unit", choices=("s", "ms"), default="s",
                         help="unit of numeric timestamps (default s)")
    convert.add_argument("--limit", type=whole_number, default=None, metavar="N",
                         help="convert only the first N requests")
    _output_flags(convert)
    convert.set_defaults(run=run_convert)

    stats = commands.add_parser(
        "stats", help="requests, lengths, reuse share and reuse distance of a trace",
        description="Show a Mooncake-format trace's requests, token lengths, how much of "
                    "its input repeats and how long after, so you see whether offloading "
                    "can help before sizing anything.",
        epilog=STATS_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    stats.add_argument("trace", type=Path, metavar="FILE", help="a Mooncake-format trace")
    stats.add_argument("--block-size", type=whole_number, default=MOONCAKE_BLOCK_TOKENS,
                       metavar="TOKENS",
                       help=f"tokens per hash id (default {MOONCAKE_BLOCK_TOKENS})")
    stats.add_argument("--limit", type=whole_number, default=None, metavar="N",
                       help="use only the first N requests")
    _output_flags(stats)
    stats.set_defaults(run=run_stats)


def _output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing "
                        "else")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def _no_subcommand(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def _check_common(args: argparse.Namespace) -> None:
    if not 1 <= args.block_size <= MAX_INPUT_TOKENS:
        raise UsageError(f"--block-size: must be in [1, {MAX_INPUT_TOKENS:,}] tokens, got "
                         f"{args.block_size}")
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit: must be at least 1")


def _check_output(args: argparse.Namespace) -> None:
    from kvoffload.workloads.convert import check_output_path

    out: Path = args.output
    if str(out) == "":
        raise UsageError("--output: is empty; give the trace file to write")
    try:
        check_output_path(out)
    except ConfigError as exc:
        raise UsageError(f"--output: {exc.problem}. {exc.fix}") from None
    if out.is_dir():
        raise UsageError(f"--output: {out} is a directory; give a file name")
    if not out.parent.is_dir():
        raise UsageError(f"--output: the directory {out.parent} does not exist")
    if os.path.lexists(out):
        try:
            same = args.log.exists() and os.path.samefile(args.log, out)
        except OSError:
            same = False
        if same:
            raise UsageError(f"--output: {out} is the log being converted; give another "
                             "file")
        if not args.force:
            raise UsageError(f"--output: {out} exists; give --force to replace it")


def run_convert(args: argparse.Namespace) -> int:
    from kvoffload.workloads.convert import (
        DEFAULT_OUTPUT_LENGTH,
        ModelTokenizer,
        convert_log,
    )

    _check_common(args)
    output_length = (args.output_length if args.output_length is not None
                     else DEFAULT_OUTPUT_LENGTH)
    if not 1 <= output_length <= MAX_OUTPUT_TOKENS:
        raise UsageError(f"--output-length: must be in [1, {MAX_OUTPUT_TOKENS:,}], got "
                         f"{output_length}")
    if args.chat_template is not None and args.model is None:
        raise UsageError("--chat-template: needs --model (the tokenizer the rendered text "
                         "is tokenized with)")
    if args.log_format == "chat" and args.model is None:
        raise UsageError("--model: a chat log is tokenized with the model's own tokenizer; "
                         "give the model directory (with tokenizer.json)")
    _check_output(args)
    try:
        tokenizer = (ModelTokenizer(args.model, args.chat_template)
                     if args.model is not None else None)
        show = not (args.quiet or args.json)
        with progress_bar(show) as start:
            total = count_trace_lines(args.log) if show else 0
            if args.limit is not None:
                total = min(total, args.limit)
            summary = convert_log(args.log, args.output, tokenizer=tokenizer,
                                  block_size=args.block_size, log_format=args.log_format,
                                  default_output_length=output_length,
                                  time_unit=args.time_unit, limit=args.limit,
                                  overwrite=args.force,
                                  progress=start(f"converting {args.log.name}", total))
    except ConfigError as exc:
        option = ("--output" if exc.field == "output" else
                  "--chat-template" if exc.field == "chat_template"
                  and args.chat_template is not None else "--model")
        raise UsageError(f"{option}: {exc.problem}. {exc.fix}") from None
    if args.json:
        print(json.dumps(summary.to_dict(), indent=2))
    else:
        print(convert_text(summary))
    return 0


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def convert_text(s: ConvertSummary) -> str:
    mean = s.input_tokens / s.requests
    lines = [
        f"converted {_count(s.requests, 'request')} ({s.format} log {s.input}) into "
        f"{s.output}",
        f"  input tokens {s.input_tokens:,} (mean {mean:,.1f}), output tokens "
        f"{s.output_tokens:,}",
        f"  {_count(s.blocks, 'block')} of {s.block_size} tokens, {s.unique_blocks:,} "
        "distinct",
    ]
    if s.tokenizer is not None:
        template = (f", chat template from {s.chat_template}" if s.chat_template
                    else ", no chat template (role: content lines)"
                    if s.format == "chat" else "")
        lines.append(f"  tokenizer {s.tokenizer}{template}")
    facts = []
    if s.sessions is not None:
        facts.append(_count(s.sessions, "session"))
    if s.timestamps:
        facts.append(f"{_secs(s.duration_s)} from first to last arrival")
    else:
        facts.append("no timestamps: every request arrives at 0")
    if s.reordered:
        facts.append("lines sorted into arrival order")
    lines.append("  " + "; ".join(facts))
    if s.block_size == MOONCAKE_BLOCK_TOKENS:
        lines.append(f"  next: kvoffload trace stats {s.output}")
        lines.append(f"        kvoffload simulate --trace {s.output}")
    else:
        lines.append(f"  note: simulate reads {MOONCAKE_BLOCK_TOKENS}-token blocks; read "
                     f"this trace with 'kvoffload trace stats --block-size {s.block_size}' "
                     f"or read_mooncake_trace(path, block_tokens={s.block_size})")
    return "\n".join(lines)


def run_stats(args: argparse.Namespace) -> int:
    from kvoffload.workloads.trace_stats import trace_stats

    _check_common(args)
    show = not (args.quiet or args.json)
    with progress_bar(show) as start:
        total = count_trace_lines(args.trace) if show else 0
        if args.limit is not None:
            total = min(total, args.limit)
        stats = trace_stats(args.trace, block_tokens=args.block_size, limit=args.limit,
                            progress=start(f"reading {args.trace.name}", total))
    if args.json:
        print(json.dumps(stats.to_dict(), indent=2))
    else:
        print_stats(stats)
    return 0


def _num(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _secs(value: float | None) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:,.0f} s" if value >= 100 else format_seconds(value)


def _dist_row(label: str, d: Distribution, seconds: bool = False) -> list[str]:
    if seconds:
        return [label, *(_secs(v) for v in (d.mean, d.p50, d.p90, d.p99, d.max))]
    return [label, _num(d.mean, 1), *(_num(v) for v in (d.p50, d.p90, d.p99, d.max))]


def stats_rows(s: TraceStats) -> tuple[list[list[str]], list[tuple[str, str, str]]]:
    """The distribution table's rows and the figure lines' (name, value, meaning)."""
    rows = [_dist_row("input tokens", s.input_tokens),
            _dist_row("output tokens", s.output_tokens),
            _dist_row("reuse distance (req)", s.reuse_distance_requests),
            _dist_row("reuse distance (time)", s.reuse_distance_s, seconds=True)]
    if s.session_requests is not None:
        rows.append(_dist_row("requests per session", s.session_requests))
    figures = [
        ("tokens", f"{s.input_tokens.total:,}",
         f"input tokens, {s.output_tokens.total:,} output"),
        ("reuse share", f"{100 * s.reuse_share:.1f} %",
         "of input blocks were seen in an earlier request"),
        ("prefix reuse", f"{100 * s.prefix_reuse_share:.1f} %",
         "of input blocks lead a prompt's reused prefix"),
        ("ideal hit", f"{100 * s.ideal_hit_share:.1f} %",
         "of prompt tokens an unbounded cache would serve"),
        ("distinct blocks", f"{s.unique_blocks:,}",
         f"of {s.blocks:,} input blocks ({s.unique_blocks * s.block_tokens:,} tokens)"),
    ]
    if s.sessions is not None:
        figures.append(("sessions", f"{s.sessions:,}", "distinct session_id values"))
    return rows, figures


def _requests(n: float | None) -> str:
    return f"{_num(n)} request" + ("" if n == 1 else "s")


def stats_heading(s: TraceStats) -> str:
    rate = f" ({s.request_rate:,.2f} requests/s)" if s.request_rate is not None else ""
    return (f"trace {s.path}: {_count(s.requests, 'request')} over "
            f"{_secs(s.duration_s)}{rate}, "
            f"blocks of {s.block_tokens} tokens")


def stats_reading(s: TraceStats) -> str:
    d = s.reuse_distance_requests
    if d.count == 0:
        return ("No input block repeats: no cache, on the accelerator or offloaded, can "
                "serve this trace.")
    return (f"Half of the reused blocks were last used at most {_requests(d.p50)} "
            f"({_secs(s.reuse_distance_s.p50)}) before, 90 % at most {_requests(d.p90)} "
            f"({_secs(s.reuse_distance_s.p90)}): a cache must keep that many requests' "
            "blocks to serve them; offloading helps where the accelerator's memory holds "
            "fewer.")


HEADERS = ["", "mean", "p50", "p90", "p99", "max"]


def print_stats(s: TraceStats) -> None:
    """The human table (rich where installed, plain text otherwise)."""
    rows, figures = stats_rows(s)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(stats_text(s))
        return
    console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
    console.print(stats_heading(s), markup=False)
    table = Table(*HEADERS, box=None, pad_edge=False, show_edge=False)
    for column in table.columns:
        column.no_wrap = True
        column.justify = "right" if column.header else "left"
    for row in rows:
        table.add_row(*row)
    console.print(table)
    figures_table = Table(show_header=False, box=None, pad_edge=False)
    figures_table.add_column(no_wrap=True)
    figures_table.add_column(justify="right", no_wrap=True)
    figures_table.add_column()
    for figure in figures:
        figures_table.add_row(*figure)
    console.print(figures_table)
    console.print(stats_reading(s), markup=False)


def stats_text(s: TraceStats) -> str:
    """The same figures as plain text."""
    rows, figures = stats_rows(s)
    widths = [max(len(r[i]) for r in [HEADERS, *rows]) for i in range(len(HEADERS))]
    lines = [stats_heading(s)]
    for row in [HEADERS, *rows]:
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    name_w = max(len(n) for n, _, _ in figures)
    value_w = max(len(v) for _, v, _ in figures)
    lines.extend(f"{n.ljust(name_w)}  {v.rjust(value_w)}  {m}" for n, v, m in figures)
    lines.append(stats_reading(s))
    return "\n".join(lines)
