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
import importlib.util
import math
import os
import stat
from pathlib import Path

from kvoffload.blockfile.framing import MacKey
from kvoffload.cli.common import UsageError
from kvoffload.config import MAX_BLOCK_SIZE_FACTOR
from kvoffload.errors import shown
from kvoffload.files import file_kind
from kvoffload.sim.fleet import MAX_ENGINES, Router
from kvoffload.tiers.config import check_disk_path, check_remote_url, read_mac_key

PLOT_SUFFIXES = (".png", ".svg", ".pdf")
"""File types ``--plot`` writes (matplotlib picks the format from the suffix)."""

MAX_TOKENS = 1 << 30
"""Bound on every token, block and request count flag (larger is a typo)."""

_POSITIVE_INTS = (
    ("block_size", "--block-size", "e.g. 16", MAX_TOKENS),
    ("block_size_factor", "--block-size-factor", "e.g. 1", MAX_BLOCK_SIZE_FACTOR),
    ("max_batched_tokens", "--max-batched-tokens", "e.g. 8192", MAX_TOKENS),
    ("max_seqs", "--max-seqs", "e.g. 64", MAX_TOKENS),
    ("decode_steps", "--decode-steps", "e.g. 16", MAX_TOKENS),
    ("scale_bytes", "--scale-bytes", "e.g. 64", MAX_TOKENS),
)


def check_positive_int(value: int | None, flag: str, example: str,
                       maximum: int = MAX_TOKENS) -> None:
    """``value`` (None: not given) must be in ``[1, maximum]``."""
    if value is not None and not 1 <= value <= maximum:
        raise UsageError(f"{flag}: must be at least 1 and at most {maximum}, got "
                         f"{shown(value)}; give {example}")


def positive_float(text: str, flag: str, example: str) -> float:
    """``text`` as a finite positive number (exponents allowed: ``400e12``)."""
    try:
        if not text.isascii():  # Python's float() takes other digits too: refused alike
            raise ValueError(text)
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag}: cannot read {shown(text)} as a number; give "
                         f"{example}") from None
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag}: must be a finite positive number, got {shown(text)}; "
                         f"give {example}")
    return value


def check_plot_path(path: Path | None, flag: str = "--plot") -> None:
    """A plot file must be one this process can write, checked before the run (a plot
    that cannot be written would throw the run's results away): a suffix matplotlib
    writes, matplotlib installed, and either a writable regular file or a new name in an
    existing directory where a file can be made (it is made and removed again)."""
    if path is None:
        return
    name = str(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise UsageError(f"{flag}: cannot write a plot to {shown(name)}; give a file ending "
                         f"in {', '.join(PLOT_SUFFIXES)}, e.g. run.png")
    if importlib.util.find_spec("matplotlib") is None:
        raise UsageError(f"{flag} needs matplotlib: pip install 'kvoffload[cli]'")
    fix = "give a file in a directory you can write, e.g. --plot run.png"
    if "\0" in name:
        raise UsageError(f"{flag}: {shown(name)} holds a NUL byte; {fix}")
    try:
        mode = os.stat(name).st_mode
    except FileNotFoundError:
        mode = None
    except OSError as exc:
        raise UsageError(f"{flag}: cannot write {shown(name)} ({exc.strerror}); {fix}") \
            from None
    if mode is not None and not stat.S_ISREG(mode):
        raise UsageError(f"{flag}: {shown(name)} is {file_kind(mode)}; {fix}")
    parent = path.parent
    if mode is None and not parent.is_dir():
        raise UsageError(f"{flag}: the directory {shown(str(parent))} of {shown(name)} does "
                         f"not exist; create it or {fix}")
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        if mode is None:  # make the file, then remove it: the run writes it at the end
            os.close(os.open(name, flags | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(name)
        else:
            os.close(os.open(name, flags))  # no O_TRUNC: the file is left as it is
    except OSError as exc:
        raise UsageError(f"{flag}: cannot write {shown(name)} ({exc.strerror}); {fix}") \
            from None


def check_remote_login(url: str) -> None:
    """Log in to the ``--remote-url`` server once: refused credentials raise
    ``ConfigError`` naming the flag (the password shown as ``***``)."""
    from kvoffload.tiers.config import RemoteTierConfig
    from kvoffload.tiers.remote import check_credentials

    check_credentials(RemoteTierConfig(url, timeout_s=2.0, connect_timeout_s=1.0),
                      "--remote-url")


def check_common_args(args: argparse.Namespace) -> None:
    """The engine and output flags ``add_engine_options`` / ``add_output_options`` add."""
    for dest, flag, example, maximum in _POSITIVE_INTS:
        check_positive_int(getattr(args, dest, None), flag, example, maximum)
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
            raise UsageError(f"{flag}: must be finite positive seconds, got {shown(value)}")
    rate = args.tier_faults
    if not (math.isfinite(rate) and 0 <= rate <= 1):
        raise UsageError(f"--tier-faults: must be a share in [0, 1], got {shown(rate)}")
    if rate > 0 and not (args.disk_path or args.remote_url):
        raise UsageError("--tier-faults: needs a real tier; add --disk-path DIR "
                         "--disk-capacity SIZE or --remote-url URL")
    if rate > 0 and args.faults is None:
        raise UsageError("--tier-faults: works in a soak only; add --faults RATE")


def simulate_mac_key(args: argparse.Namespace) -> MacKey | None:
    """The MAC key of ``simulate``'s real tiers (``--disk-path``, ``--remote-url``): from
    ``--tier-mac-key-file`` or ``$KVOFFLOAD_TIER_MAC_KEY``, read as the connector reads
    it (``read_mac_key``: a ``ConfigError`` naming the file or the variable). None
    without real tiers; ``--tier-mac-key-file`` without them is a ``UsageError``."""
    key_file = getattr(args, "tier_mac_key_file", None)
    if not (args.disk_path or args.remote_url):
        if key_file is not None:
            raise UsageError("--tier-mac-key-file: MACs the blocks of real tiers; add "
                             "--disk-path DIR --disk-capacity SIZE or --remote-url URL")
        return None
    return read_mac_key(key_file, os.environ)


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
    if not (text.isascii() and text.isdigit() and len(text) <= 9
            and 1 <= int(text) <= MAX_ENGINES):
        raise UsageError(f"--engines: give a whole number of engines from 1 to "
                         f"{MAX_ENGINES} in ASCII digits, e.g. 4; got {shown(args.engines)}")
    names = [r.value for r in Router]
    router = args.router if args.router is not None else Router.ROUND_ROBIN.value
    if router not in names:
        raise UsageError(f"--router: unknown router {shown(router)}; give one of "
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
