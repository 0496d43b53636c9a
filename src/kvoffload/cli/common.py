"""Shared pieces of the command-line tool: sizes, workload options, progress, formatting.

Every size flag is read by ``kvoffload.sizes.parse_size`` (the one size grammar). The
options shared by the commands are added here and turned into library values here:
``workload_spec`` (a ``kvoffload.workloads.spec.WorkloadSpec``) and ``simulation_config``
(a ``kvoffload.sim.simulation.SimulationConfig``); a wrong value is a ``UsageError`` naming
its option.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NoReturn

from kvoffload.errors import ConfigError, shown
from kvoffload.models.hf_config import is_model_path, resolve_model
from kvoffload.models.presets import PRESETS
from kvoffload.policies import cache_policy_names
from kvoffload.refengine.timing import TimingModel
from kvoffload.sim.oracle.binding import ORACLE
from kvoffload.sim.replay import Arrival
from kvoffload.sim.simulation import Mode, SimulationConfig
from kvoffload.sizes import parse_size
from kvoffload.workloads import BUILTIN_WORKLOADS, DEFAULT_WORKLOAD, default_size
from kvoffload.workloads.spec import WorkloadSpec


class UsageError(Exception):
    """A command-line value is wrong; the message says which option and what to give."""


class CommandLineParser(argparse.ArgumentParser):
    """The tool's argument parser: a flag argparse itself refuses (unknown, missing its
    value, not a number) is one ``error:`` line naming it, exit status 2, like every
    other bad value (no usage dump; an offending value is cut to 80 characters)."""

    def error(self, message: str) -> NoReturn:
        if len(message) > 300:
            message = f"{message[:300]}... ({len(message):,} characters)"
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


_WHOLE_NUMBER = re.compile(r"[+-]?[0-9]{1,30}")


def whole_number(text: str) -> int:
    """argparse type of every count flag: a whole number in ASCII digits. Other digits
    (``'٣'``, ``'³'``, ``'１'``), which Python's ``int`` would take, are refused, as the
    size grammar (``kvoffload.sizes``) refuses them."""
    if not _WHOLE_NUMBER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"not a whole number in ASCII digits: {shown(text)}")
    return int(text)


def real_number(text: str) -> float:
    """argparse type of every number flag: a number in ASCII characters (``0.5``,
    ``1e-3``); other digits are refused as in ``whole_number``. Range checks are the
    command's (``kvoffload.cli.validate``)."""
    try:
        if not text.isascii() or len(text) > 100:
            raise ValueError(text)
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number in ASCII characters: "
                                         f"{shown(text)}") from None


def parse_items(text: str, option: str, example: str) -> list[str]:
    """The items of a comma-separated list flag; ``UsageError`` naming ``option`` when it
    has none (``""``, ``","``): an empty list is refused, never read as the default."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise UsageError(f"{option}: give a comma-separated list, e.g. {example} "
                         f"(got {shown(text)})")
    return items


def parse_shares(text: str, option: str) -> list[float]:
    """A comma-separated list of shares in (0, 1], sorted and without repeats."""
    shares: set[float] = set()
    for item in parse_items(text, option, "0.01,0.1,0.5"):
        try:
            value = real_number(item)
        except argparse.ArgumentTypeError:
            raise UsageError(f"{option}: give shares such as 0.01,0.1,0.5 (got "
                             f"{shown(item)})") from None
        if not 0 < value <= 1:
            raise UsageError(f"{option}: every share must be in (0, 1], got {shown(item)}")
        shares.add(value)
    return sorted(shares)


def parse_count(text: str, option: str) -> int:
    """``"32k"``, ``"32Ki"``, ``"1M"``, ``"4096"`` -> a positive count, read with the size
    grammar (``kvoffload.sizes``); ``UsageError`` naming ``option`` otherwise."""
    try:
        return parse_size(text, option, minimum=1)
    except ConfigError as exc:
        raise UsageError(f"{option}: {exc.problem}; give a positive count such as 32k, "
                         "32Ki or 32768") from None


def parse_sizes(text: str, option: str) -> list[int]:
    """A comma-separated list of sizes (``"4GiB,16GiB"``) in the grammar of
    ``kvoffload.sizes``: ``UsageError`` naming ``option`` for an empty list,
    ``ConfigError`` for a size that is not one."""
    return [parse_size(t, option) for t in parse_items(text, option, "4GiB,16GiB")]


def format_seconds(s: float) -> str:
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


OPTION_OF_FIELD = {
    "engine_capacity_bytes": "--engine-capacity",
    "engine_tokens": "--engine-tokens",
    "engine capacity": "--engine-capacity / --engine-tokens",
    "host_capacity_bytes": "--host-capacity",
    "disk_capacity_bytes": "--disk-capacity / --mode",
    "remote_capacity_bytes": "--remote-capacity",
    "eviction_policy": "--policy",
    "host_accounting": "--host-accounting",
    "block_size": "--block-size",
    "block_size_factor": "--block-size-factor",
    "scale_bytes": "--scale-bytes",
    "model": "--preset / --model",
    "tensor_parallel": "--tp",
    "workload": "--workload",
    "max_num_batched_tokens": "--max-batched-tokens",
    "max_num_seqs": "--max-seqs",
    "decode_tokens_per_step": "--decode-steps",
    "accelerator_flops": "--flops",
    "link_bytes_per_s": "--bandwidth",
    "disk_path": "--disk-path",
    "remote_url": "--remote-url",
    "tier_faults": "--tier-faults",
    "faults": "--faults",
    "engines": "--engines",
    "router": "--router",
    "tier_mac_key_file": "--tier-mac-key-file",
}


def explain_config_error(error: ConfigError) -> str:
    """The error's message, plus the command-line option that sets the field."""
    field = error.field.split("[")[0].split(".")[-1] if error.field else ""
    option = OPTION_OF_FIELD.get(error.field) or OPTION_OF_FIELD.get(field)
    hint = f" (option {option})" if option else ""
    return f"{error}{hint}"


# ----------------------------------------------------------------- shared options


def add_workload_options(parser: argparse.ArgumentParser, *, default_limit: int | None) -> None:
    group = parser.add_argument_group("workload")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--workload", choices=sorted(BUILTIN_WORKLOADS), default=None,
                        help=f"a built-in synthetic workload (default: {DEFAULT_WORKLOAD})")
    source.add_argument("--trace", type=Path, metavar="FILE",
                        help="a Mooncake-format trace (JSON lines with timestamp, "
                             "input_length, output_length, hash_ids)")
    sizes = ", ".join(f"{name} {default_size(name)}" for name in sorted(BUILTIN_WORKLOADS))
    group.add_argument("--sessions", type=whole_number, default=None, metavar="N",
                       help="size of a built-in workload: its sessions (chat, agentic) or "
                            f"users (shared-prefix); more gives steadier figures (default: "
                            f"{sizes})")
    group.add_argument("--limit", type=whole_number, default=default_limit, metavar="N",
                       help="use only the first N requests"
                            + (f" (default {default_limit})" if default_limit else ""))
    group.add_argument("--arrival", choices=[a.value for a in Arrival], default="trace",
                       help="'trace': requests arrive at their timestamps; 'asap': as fast "
                            "as the engine takes them (default: trace)")


class _DefaultPreset(str):
    """A ``--preset`` default, told apart from a ``--preset`` the user gave (``--model``
    refuses to be given with one)."""

    __slots__ = ()


class _ModelAction(argparse.Action):
    """``--model PATH``: the model whose config PATH is replaces the command's ``--preset``
    (``args.preset`` becomes PATH, which ``kvoffload.models.hf_config`` resolves)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        path = str(values)
        given = getattr(namespace, "preset", None)
        if given is not None and not isinstance(given, _DefaultPreset) and given != path:
            namespace.model_conflict = True  # --preset came first; reported by check_model
        namespace.model = path
        if hasattr(namespace, "preset"):
            namespace.preset = path


def add_model_options(parser: argparse.ArgumentParser,
                      group: argparse._ArgumentGroup | None = None) -> None:
    """``--model PATH`` and ``--tp N``, for a command that takes ``--preset`` (or none).

    ``--model`` stands in for ``--preset``: the rest of the command handles the path as a
    preset name (``check_preset``, ``SimulationConfig.preset``); ``check_model`` reports a
    ``--preset`` given beside it. ``--tp`` makes every figure one rank's.
    """
    target = group if group is not None else parser
    default = parser.get_default("preset")
    if isinstance(default, str):
        parser.set_defaults(preset=_DefaultPreset(default))
    target.add_argument("--model", metavar="PATH", action=_ModelAction, default=None,
                        help="a local Hugging Face model directory or its config.json, "
                             "instead of --preset: layer kinds, KV and Mamba bytes and "
                             "prefill FLOPs are derived from the config (docs/models.md)")
    target.add_argument("--tp", type=whole_number, default=1, metavar="N",
                        help="tensor-parallel ranks: KV and Mamba heads are split across N "
                             "ranks and every figure is one rank's (default 1)")


def check_model(args: argparse.Namespace) -> None:
    """``--model`` and ``--preset`` together, or a ``--tp`` below 1: ``UsageError``."""
    model = getattr(args, "model", None)
    preset = getattr(args, "preset", None)
    if model is not None and (getattr(args, "model_conflict", False)
                              or (preset is not None and preset != model)):
        raise UsageError("--model: give either --model PATH or --preset NAME, not both")
    tp = getattr(args, "tp", 1)
    if tp < 1:
        raise UsageError(f"--tp: must be at least 1, got {tp}; give the tensor-parallel "
                         "rank count, e.g. --tp 2")


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine and model")
    add_model_options(parser, group)
    group.add_argument("--block-size", type=whole_number, metavar="TOKENS",
                       help="engine block size (default: 16, or vLLM's page-matching size "
                            "for models with Mamba layers)")
    group.add_argument("--block-size-factor", type=whole_number, default=1, metavar="N",
                       help="engine blocks per offloaded block (default 1)")
    group.add_argument("--host-accounting", choices=("slot", "bytes"), default="slot",
                       help="'slot': every host block takes a slot of the largest group's "
                            "size; 'bytes': each is charged its own group's bytes under one "
                            "budget (accounting mode) (default: slot)")
    cap = group.add_mutually_exclusive_group()
    cap.add_argument("--engine-capacity", metavar="SIZE",
                     help="accelerator memory for KV blocks, e.g. 40GiB")
    cap.add_argument("--engine-tokens", metavar="N",
                     help="engine capacity as N / block-size block ids, shared by all groups "
                          "(e.g. 32k; default: 32768 for built-in workloads, 1M for traces)")
    group.add_argument("--disk-capacity", metavar="SIZE",
                       help="add a disk tier below host memory (write-back); modelled in "
                            "accounting mode, a real directory (--disk-path) in bytes mode")
    group.add_argument("--remote-capacity", metavar="SIZE",
                       help="add a modelled shared remote store below it (write-through; "
                            "accounting mode; in bytes mode give --remote-url instead)")
    group.add_argument("--max-batched-tokens", type=whole_number, default=8192, metavar="N",
                       help="token budget of one engine step (default 8192)")
    group.add_argument("--max-seqs", type=whole_number, default=64, metavar="N",
                       help="requests running at once (default 64)")
    group.add_argument("--decode-steps", type=whole_number, default=None, metavar="K",
                       help="engine iterations one simulated step stands for (default: 1 in "
                            "bytes mode, 16 in accounting mode)")
    group.add_argument("--flops", metavar="FLOP/S", default="400e12",
                       help="modelled accelerator throughput (default 400e12)")
    group.add_argument("--bandwidth", metavar="BYTES/S", default="25e9",
                       help="modelled host<->device bandwidth per direction (default 25e9)")


def add_output_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("output")
    group.add_argument("--json", action="store_true", help="print one JSON object, nothing else")
    group.add_argument("--plot", type=Path, metavar="FILE.png", help="write plots to this file")
    group.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


def simulator_policy_names() -> tuple[str, ...]:
    """The cache policies the simulator runs: the registry's and the ``oracle``
    reference."""
    return (*cache_policy_names(), ORACLE)


def check_policy(name: str) -> str:
    """A cache policy the simulator runs (the ``oracle`` reference included)."""
    if name not in simulator_policy_names():
        raise UsageError(f"--policy: unknown policy {shown(name)}; choose one of "
                         f"{', '.join(simulator_policy_names())}")
    return name


def check_preset(name: str) -> str:
    """A preset name, or a model path (``--model``): its config must derive a layout
    (``ConfigError`` naming the path and field otherwise)."""
    if name in PRESETS:
        return name
    try:
        model_path = is_model_path(name)
    except (OSError, ValueError):  # a name no file can have (too long, a NUL byte)
        model_path = False
    if model_path:
        resolve_model(name)
        return name
    raise UsageError(f"--preset: unknown preset {shown(name)}; choose one of "
                     f"{', '.join(PRESETS)} (see 'kvoffload presets'), or give --model PATH")


MAX_SESSIONS = 10_000
"""The largest built-in workload ``--sessions`` asks for: generating it stays within
seconds (a larger one would keep the command busy before it prints anything)."""


def workload_spec(args: argparse.Namespace, seed: int) -> WorkloadSpec:
    """The workload options (``add_workload_options``, ``add_hint_option``) as a
    ``WorkloadSpec`` with ``seed``; ``UsageError`` naming the option for a wrong value."""
    if args.limit is not None and args.limit < 1:
        raise UsageError("--limit: must be at least 1")
    if args.sessions is not None:
        if args.trace is not None:
            raise UsageError("--sessions: sizes a built-in workload; a trace has its own "
                             "requests (use --limit to take fewer)")
        if args.sessions < 1:
            raise UsageError("--sessions: must be at least 1")
        if args.sessions > MAX_SESSIONS:
            raise UsageError(f"--sessions: at most {MAX_SESSIONS:,} (got {args.sessions:,}); "
                             "replay a trace for more traffic (--trace FILE)")
    accuracy = getattr(args, "hint_accuracy", None)
    if accuracy is not None and not 0.0 <= accuracy <= 1.0:
        raise UsageError(f"--hint-accuracy: a share in [0, 1] (got {accuracy}); leave it "
                         "out for no hints")
    return WorkloadSpec(args.workload or DEFAULT_WORKLOAD, args.trace, args.limit, seed,
                        args.sessions, accuracy)


def add_hint_option(parser: argparse.ArgumentParser) -> None:
    """``--hint-accuracy P``: client hints drawn from the workload's future
    (``kvoffload.workloads.hints``), each right with probability P."""
    parser.add_argument("--hint-accuracy", type=real_number, default=None, metavar="P",
                        help="give each request the client hints 'conversation continues' "
                             "(right with probability P, 0..1, drawn from the workload's "
                             "own future) and its session id; default: no hints")


def simulation_config(args: argparse.Namespace, *, preset: str, policy: str,
                      host_capacity: int, mode: Mode) -> SimulationConfig:
    """A ``SimulationConfig`` from the shared engine options (``--model`` and ``--tp``
    included: the model is checked for ``tp`` ranks here, before anything runs)."""
    check_model(args)
    tensor_parallel = getattr(args, "tp", 1)
    resolve_model(preset, tensor_parallel)
    decode = args.decode_steps if args.decode_steps is not None else (
        1 if mode is Mode.BYTES else 16)
    engine_bytes = (parse_size(args.engine_capacity, "--engine-capacity", minimum=1)
                    if args.engine_capacity is not None else None)
    tokens = (parse_count(args.engine_tokens, "--engine-tokens")
              if args.engine_tokens is not None
              else (1 << 20 if args.trace is not None else 32768))
    flops, bandwidth = float(args.flops), float(args.bandwidth)  # check_common_args read them
    disk = (parse_size(args.disk_capacity, "--disk-capacity", minimum=1)
            if args.disk_capacity is not None else None)
    remote = (parse_size(args.remote_capacity, "--remote-capacity", minimum=1)
              if args.remote_capacity is not None else None)
    return SimulationConfig(
        preset=preset, tensor_parallel=tensor_parallel, mode=mode, block_size=args.block_size,
        disk_capacity_bytes=disk, remote_capacity_bytes=remote,
        block_size_factor=args.block_size_factor, engine_capacity_bytes=engine_bytes,
        engine_tokens=tokens, host_capacity_bytes=host_capacity, eviction_policy=policy,
        host_accounting=getattr(args, "host_accounting", "slot"),
        scale_bytes=getattr(args, "scale_bytes", 64),
        disk_path=getattr(args, "disk_path", None),
        remote_url=getattr(args, "remote_url", None),
        max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_seqs,
        decode_tokens_per_step=decode, arrival=Arrival(args.arrival),
        timing=TimingModel(accelerator_flops=flops, link_bytes_per_s=bandwidth),
        check_integrity=getattr(args, "check", False))


@contextlib.contextmanager
def progress_bar(enabled: bool) -> Iterator[Callable[[str, int], Callable[[int], None]]]:
    """Yields ``start(label, total) -> update(done)``; a rich bar on a TTY, else silent."""
    if not enabled or not sys.stderr.isatty():
        yield lambda label, total: (lambda done: None)
        return
    try:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
        )
    except ImportError:  # the cli extra is not installed: run without a bar
        yield lambda label, total: (lambda done: None)
        return
    from rich.console import Console

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        def start(label: str, total: int) -> Callable[[int], None]:
            task = bar.add_task(label, total=total)
            return lambda done: bar.update(task, completed=done)

        yield start
