"""Start-up checks of the command line's numbers, paths and URLs.

``check_common_args`` (every command that runs simulations) and ``check_simulate_args``
run before anything is simulated. A ``--remote-url`` server is asked once whether it takes
the URL's credentials (a refused login is a ``ConfigError``; an unreachable server passes:
the tier skips it while it is down). Each raises ``UsageError`` naming the flag and what to
give, so ``kvoffload.cli.main`` prints one ``error:`` line and exits with status 2. Sizes
are read later by ``kvoffload.sizes.parse_size`` (which raises ``ConfigError`` naming the
flag, handled the same way).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from kvoffload.cli.common import UsageError
from kvoffload.sim.fleet import MAX_ENGINES, Router
from kvoffload.tiers.config import check_disk_path, check_remote_url

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
"""File types ``--plot`` writes (matplotlib picks the format from the suffix)."""

MAX_TOKENS = 1 << 30
"""Bound on every token, block and request count flag (larger is a typo)."""

_POSITIVE_INTS = (
    ("block_size", "--block-size", "e.g. 16"),
    ("block_size_factor", "--block-size-factor", "e.g. 1"),
    ("max_batched_tokens", "--max-batched-tokens", "e.g. 8192"),
    ("max_seqs", "--max-seqs", "e.g. 64"),
    ("decode_steps", "--decode-steps", "e.g. 16"),
    ("scale_bytes", "--scale-bytes", "e.g. 64"),
)


def check_positive_int(value: int | None, flag: str, example: str) -> None:
    """``value`` (None: not given) must be in ``[1, MAX_TOKENS]``."""
    if value is not None and not 1 <= value <= MAX_TOKENS:
        raise UsageError(f"{flag}: must be at least 1 and at most {MAX_TOKENS}, got {value}; "
                         f"give {example}")


def positive_float(text: str, flag: str, example: str) -> float:
    """``text`` as a finite positive number (exponents allowed: ``400e12``)."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag}: cannot read {text!r} as a number; give {example}") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag}: must be a finite positive number, got {text!r}; "
                         f"give {example}")
    return value


def check_plot_path(path: Path | None, flag: str = "--plot") -> None:
    """A plot file must end in a suffix matplotlib writes (checked before the run)."""
    if path is not None and path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"{flag}: cannot write a plot to {str(path)!r}; give a file ending "
                         f"in {', '.join(PLOT_SUFFIXES)}, e.g. run.png")


def check_remote_login(url: str) -> None:
    """Log in to the ``--remote-url`` server once: refused credentials raise
    ``ConfigError`` naming the flag (the password shown as ``***``)."""
    from kvoffload.tiers.config import RemoteTierConfig
    from kvoffload.tiers.remote import check_credentials

    check_credentials(RemoteTierConfig(url, timeout_s=2.0, connect_timeout_s=1.0),
                      "--remote-url")


def check_common_args(args: argparse.Namespace) -> None:
    """The engine and output flags ``add_engine_options`` / ``add_output_options`` add."""
    for dest, flag, example in _POSITIVE_INTS:
        check_positive_int(getattr(args, dest, None), flag, example)
    positive_float(args.flops, "--flops", "400e12")
    positive_float(args.bandwidth, "--bandwidth", "25e9")
    check_plot_path(args.plot)


def check_simulate_args(args: argparse.Namespace) -> None:
    """``simulate``'s own flags: the real tiers, the soak's seconds and rates."""
    check_common_args(args)
    if args.disk_path is not None:
        check_disk_path(args.disk_path, "--disk-path")
    if args.remote_url is not None:
        check_remote_url(args.remote_url, "--remote-url")
        check_remote_login(args.remote_url)
    for value, flag in ((args.load_deadline, "--load-deadline"), (args.hang, "--hang")):
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"{flag}: must be finite positive seconds, got {value!r}")
    rate = args.tier_faults
    if not (math.isfinite(rate) and 0 <= rate <= 1):
        raise UsageError(f"--tier-faults: must be a share in [0, 1], got {rate!r}")
    if rate > 0 and not (args.disk_path or args.remote_url):
        raise UsageError("--tier-faults: needs a real tier; add --disk-path DIR "
                         "--disk-capacity SIZE or --remote-url URL")
    if rate > 0 and args.faults is None:
        raise UsageError("--tier-faults: works in a soak only; add --faults RATE")


def check_fleet_args(args: argparse.Namespace) -> tuple[int, Router] | None:
    """``--engines`` and ``--router``: the fleet's size and router, or None for the
    one-engine simulation (neither given). A fleet is modelled: it refuses the flags of
    real tiers, bytes mode, soaks and plots."""
    if args.engines is None:
        if args.router is not None:
            raise UsageError("--router: assigns requests to several engines; add "
                             "--engines N (e.g. --engines 4)")
        return None
    text = str(args.engines).strip()
    if not (text.isdigit() and 1 <= int(text) <= MAX_ENGINES):
        raise UsageError(f"--engines: give a whole number of engines from 1 to "
                         f"{MAX_ENGINES}, e.g. 4; got {args.engines!r}")
    names = [r.value for r in Router]
    router = args.router if args.router is not None else Router.ROUND_ROBIN.value
    if router not in names:
        raise UsageError(f"--router: unknown router {router!r}; give one of "
                         f"{' or '.join(names)}")
    refused = (
        (args.faults is not None, "--faults", "a soak runs one engine; drop --engines or "
                                              "--faults"),
        (args.disk_path is not None, "--disk-path", "a fleet models its tiers; give "
                                                    "--disk-capacity SIZE instead"),
        (args.remote_url is not None, "--remote-url", "a fleet models its shared tier; "
                                                      "give --remote-capacity SIZE instead"),
        (args.mode == "bytes", "--mode", "a fleet (--engines) runs in accounting mode; drop "
                                         "--mode bytes"),
        (args.plot is not None, "--plot", "not drawn for a fleet (--engines); "
                                          "benchmarks/make_fleet_doc.py plots fleets"),
    )
    for bad, flag, why in refused:
        if bad:
            raise UsageError(f"{flag}: {why}")
    return int(text), Router(router)
