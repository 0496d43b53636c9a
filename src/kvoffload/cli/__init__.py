"""The ``kvoffload`` command: ``simulate``, ``sweep``, ``plan``, ``presets``, ``trace``.

This package only parses arguments, checks them, calls the library (``kvoffload.sim``,
``kvoffload.workloads``, ``kvoffload.models``) and prints what it returns: tables, JSON,
plots. Each command is one module (``add_parser`` and ``run``); ``common`` holds the shared
options and formatting, ``tables``, ``report`` and ``plots`` the output.

Errors a user can fix (a bad option, a malformed trace line, a configuration that cannot
work) print one ``error:`` line naming what to change and exit with status 2; no traceback.
``simulate`` exits with 1 when the byte verification found wrong bytes.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Sequence
from typing import cast

from kvoffload.cli import plan, presets, simulate, sweep, trace
from kvoffload.cli.common import CommandLineParser, UsageError, explain_config_error
from kvoffload.errors import ConfigError, InvariantError, KVOffloadError, shown

EPILOG = textwrap.dedent("""\
    examples:
      kvoffload simulate                 # the built-in chat workload on gpt-oss-20b
      kvoffload simulate --help          # presets, workloads, traces, capacities
      kvoffload sweep --preset all --host-capacity 4GiB,16GiB,64GiB --plot sweep.png
      kvoffload plan --model DIR --trace trace.jsonl   # host memory for your model and traffic
      kvoffload presets
      kvoffload trace convert chat.jsonl --model DIR -o trace.jsonl   # traces from real traffic
    """)


def build_parser() -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = CommandLineParser(
        prog="kvoffload",
        description="Simulate KV-cache offloading for hybrid LLMs: replay workloads and "
                    "traces through kvoffload's planner, host tier and transfer worker.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Every command's parser is a CommandLineParser too (one-line errors).
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               parser.add_subparsers(dest="command", metavar="COMMAND",
                                     parser_class=CommandLineParser))
    simulate.add_parser(sub)
    sweep.add_parser(sub)
    plan.add_parser(sub)
    presets.add_parser(sub)
    trace.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        status: int = args.run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except InvariantError:
        raise  # a bug, not a user error: keep the traceback
    except ConfigError as exc:
        print(f"error: {explain_config_error(exc)}", file=sys.stderr)
        return 2
    except KVOffloadError as exc:  # TraceError, LayoutError, ...
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        where = "" if exc.filename is None else shown(str(exc.filename))
        print(f"error: {exc.strerror or exc}: {where}".rstrip(": "), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return status


if __name__ == "__main__":
    sys.exit(main())
