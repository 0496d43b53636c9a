"""Configuration of the tiers below host memory: a local disk and a shared remote store.

``TierConfig`` says which lower tiers exist, in which order a lookup asks them, and how
each one is written. It is plain data (no I/O happens here); the scheduler side builds its
tier bookkeeping from it (``kvoffload.tiers.factory.make_tier``) and every worker builds
its tier I/O from the same value (``TransferWorker(..., tiers=...)``).

Three ways in, one meaning:

* Python: ``TierConfig(model_id=..., disk=DiskTierConfig(...), remote=RemoteTierConfig(...))``;
* string options (the vLLM connector's ``kv_connector_extra_config``, a simulator's
  config file): ``TierConfig.from_options({"disk_path": "/nvme/kv", "disk_capacity": "64GiB",
  "remote_url": "redis://cache:6379/0"})`` -- ``OPTION_HELP`` lists every key;
* the command line: ``add_cli_arguments(parser)`` then ``TierConfig.from_cli_args(ns)``.

Every invalid value raises ``ConfigError`` naming the option and what to change.

The tiers' MAC key (``TierConfig.mac_key``, see ``kvoffload.tiers.framing``) is a secret:
it comes from a file (option ``tier_mac_key_file``) or the environment variable
``KVOFFLOAD_TIER_MAC_KEY`` (``read_mac_key``), never from an option value (option values
end up in logged configuration dumps), and it is never shown: not in a repr, a log line or
an error message.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum

from kvoffload.errors import ConfigError
from kvoffload.sizes import parse_size
from kvoffload.tiers.framing import MIN_MAC_KEY_BYTES, MacKey


class WriteMode(str, Enum):
    """When a lower tier receives a block."""

    WRITE_BACK = "write_back"
    """When host memory evicts it (the tier holds what host memory could not keep)."""
    WRITE_THROUGH = "write_through"
    """As soon as it is readable in host memory (the tier holds everything stored)."""


REMOTE_SCHEMES = ("redis://", "rediss://", "unix://")
"""URL schemes of the remote tier (what redis-py's ``from_url`` connects to)."""

MAX_IO_THREADS = 256
"""The most I/O threads (and, times 16, pool connections) a tier accepts."""

MAC_KEY_ENV = "KVOFFLOAD_TIER_MAC_KEY"
"""Environment variable holding the tiers' MAC key (when ``tier_mac_key_file`` is not set)."""
MAX_MAC_KEY_FILE_BYTES = 4096
"""The largest key file read (anything bigger is not a key file)."""
_KEY_FIX = (f"Use at least {MIN_MAC_KEY_BYTES} random bytes, the same for every engine "
            "sharing the tiers, e.g. openssl rand -hex 32")


def _parse_bool(value: object, option: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(option, f"cannot read {value!r} as a boolean", "Use true or false.")


def _parse_mode(value: object, option: str) -> WriteMode:
    try:
        return WriteMode(str(value).strip().lower().replace("-", "_"))
    except ValueError:
        raise ConfigError(option, f"unknown write mode {value!r}",
                          "Use write_back or write_through.") from None


@dataclass(frozen=True)
class DiskTierConfig:
    """A local directory holding offloaded blocks, one file per block and rank.

    Attributes:
        path: the directory (created if missing). Blocks live under a sub-directory named
            by the namespace fingerprint, so several models can share one path. One
            engine (all its ranks) per path at a time.
        capacity_bytes: budget for all files of this namespace, all ranks together,
            headers included; the least valuable blocks are deleted to stay under it.
        write_mode: write-back (host evictions land here) or write-through.
        eviction_policy: a registered eviction policy name ("lru", "arc", ...).
        io_threads: threads per worker reading and writing files.
        fsync: flush every file (and its directory entry) to the device before it
            counts as stored. Off: faster, and a power loss may lose recent blocks (a torn
            block is still detected by its checksum and read as a miss).
    """

    path: str
    capacity_bytes: int
    write_mode: WriteMode = WriteMode.WRITE_BACK
    eviction_policy: str = "lru"
    io_threads: int = 4
    fsync: bool = True

    def __post_init__(self) -> None:
        check_disk_path(self.path)
        if self.capacity_bytes <= 0:
            raise ConfigError("disk_capacity", f"must be positive, got {self.capacity_bytes}",
                              "Give the disk budget, e.g. 64GiB.")
        if not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise ConfigError("disk_io_threads", f"must be >= 1 and at most {MAX_IO_THREADS}, "
                              f"got {self.io_threads}", "Use a few threads, e.g. 4.")


def check_disk_path(path: str, field: str = "disk_path") -> None:
    """A disk tier's directory must be named (not empty, not only blanks)."""
    if not path.strip():
        raise ConfigError(field, "is empty", "Give a directory for offloaded blocks, "
                          "e.g. /var/cache/kvoffload.")


def check_remote_url(url: str, field: str = "remote_url") -> None:
    """A shared tier's URL must be one redis-py opens: ``redis://``, ``rediss://`` (TLS)
    or ``unix://``."""
    if not url:
        raise ConfigError(field, "is empty", "Give redis://host:port/db.")
    if not url.lower().startswith(REMOTE_SCHEMES):
        raise ConfigError(field, f"{url!r} is not a Redis URL",
                          "Use redis://host:port/db, rediss://host:port/db (TLS) or "
                          "unix:///path/to/redis.sock.")


@dataclass(frozen=True)
class RemoteTierConfig:
    """A Redis/Valkey server shared by a fleet of engines.

    Attributes:
        url: ``redis://[user:password@]host:port/db`` (``rediss://`` for TLS,
            ``unix:///path.sock`` for a local socket).
        write_mode: write-through (default: every stored block is shared at once) or
            write-back.
        io_threads: threads per worker talking to the server (one connection each).
        max_connections: connection-pool size per process (>= ``io_threads``).
        timeout_s: bound on one command or pipeline round trip; a slower server counts as
            unreachable.
        connect_timeout_s: bound on opening a connection.
        retry_interval_s: after the server was unreachable, skip the tier this long before
            trying again (the engine keeps serving from the other tiers meanwhile).
        negative_ttl_s: how long "not on the server" answers are trusted before a lookup
            asks again (another engine may have stored the block since).
        batch_blocks: blocks per pipelined round trip.
        max_known_keys: existence answers remembered by the scheduler (oldest dropped).
    """

    url: str = "redis://127.0.0.1:6379/0"
    write_mode: WriteMode = WriteMode.WRITE_THROUGH
    io_threads: int = 4
    max_connections: int = 16
    timeout_s: float = 1.0
    connect_timeout_s: float = 0.5
    retry_interval_s: float = 5.0
    negative_ttl_s: float = 1.0
    batch_blocks: int = 16
    max_known_keys: int = 1_000_000

    def __post_init__(self) -> None:
        check_remote_url(self.url)
        if not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise ConfigError("remote_io_threads", f"must be >= 1 and at most "
                              f"{MAX_IO_THREADS}, got {self.io_threads}",
                              "Use a few threads, e.g. 4.")
        if not self.io_threads + 1 <= self.max_connections <= 16 * MAX_IO_THREADS:
            raise ConfigError("remote_max_connections",
                              f"{self.max_connections} is not in [io_threads {self.io_threads}"
                              f" + 1, {16 * MAX_IO_THREADS}]",
                              "Allow one connection per I/O thread plus one for lookups.")
        self._check_seconds()
        if self.batch_blocks <= 0:
            raise ConfigError("remote_batch_blocks", f"must be positive, got "
                              f"{self.batch_blocks}", "Use e.g. 16 blocks per round trip.")
        if self.max_known_keys <= 0:
            raise ConfigError("remote_max_known_keys", f"must be positive, got "
                              f"{self.max_known_keys}", "Use e.g. 1000000 answers.")

    def _check_seconds(self) -> None:
        for name in ("timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"remote_{name}", f"must be positive finite seconds, got "
                                  f"{value!r}", "Bound every round trip, e.g. 1.0 seconds.")
        for name in ("retry_interval_s", "negative_ttl_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"remote_{name}", f"must be finite seconds >= 0, got "
                                  f"{value!r}", "Use seconds, e.g. 1.0.")


LOWER_TIER_NAMES = ("disk", "remote")


@dataclass(frozen=True)
class TierConfig:
    """The lower tiers of one engine. With neither ``disk`` nor ``remote`` set, host
    memory is the only tier and nothing below changes the engine's behaviour.

    Attributes:
        model_id: what produced the KV (model name and revision, dtype, anything that
            changes the bytes). It enters the namespace fingerprint together with the
            cache layout and the key scheme, so different models never share blocks.
        key_scheme: how block hashes are made (hash algorithm and seed); part of the
            namespace, so engines hashing differently never confuse their keys.
        disk: the disk tier, or None.
        remote: the remote tier, or None.
        order: lookup order of the configured lower tiers (host memory always first).
        mac_key: the secret every block in a lower tier is MAC'd with, or None (blocks
            then carry only an unkeyed checksum, and the tiers trust everyone who can
            write to them; see ``kvoffload.tiers.framing``). It is in no fingerprint or
            name: engines with another key (or none) share names with this one, and their
            blocks are misses here. Its repr hides it.
    """

    model_id: str = ""
    key_scheme: str = "xxh3_128:kvoffload"
    disk: DiskTierConfig | None = None
    remote: RemoteTierConfig | None = None
    order: tuple[str, ...] = LOWER_TIER_NAMES
    mac_key: MacKey | None = None

    def __post_init__(self) -> None:
        unknown = [n for n in self.order if n not in LOWER_TIER_NAMES]
        if unknown or len(set(self.order)) != len(self.order):
            raise ConfigError("tier_order", f"{self.order!r} is not an ordering of "
                              f"{LOWER_TIER_NAMES}", "Use e.g. disk,remote.")

    @property
    def enabled(self) -> tuple[str, ...]:
        """Names of the configured lower tiers, in lookup order."""
        present = {"disk": self.disk is not None, "remote": self.remote is not None}
        ordered = [n for n in self.order if present[n]]
        ordered += [n for n in LOWER_TIER_NAMES if present[n] and n not in ordered]
        return tuple(ordered)

    # -- string options ---------------------------------------------------------------

    @classmethod
    def from_options(cls, options: Mapping[str, object],
                     environ: Mapping[str, str] | None = None) -> TierConfig:
        """Build from flat string options (see ``OPTION_HELP``); unknown keys raise.

        ``disk_path`` enables the disk tier (``disk_capacity`` is then required);
        ``remote_url`` enables the remote tier. The MAC key is read from
        ``tier_mac_key_file`` or, without it, from ``KVOFFLOAD_TIER_MAC_KEY`` in
        ``environ`` (default: the process environment); see ``read_mac_key``.
        """
        opts = {k: v for k, v in options.items() if v is not None}
        unknown = sorted(set(opts) - set(OPTION_HELP))
        if unknown:
            raise ConfigError(unknown[0], "is not a tier option",
                              "Known options: " + ", ".join(sorted(OPTION_HELP)) + ".")
        disk = remote = None
        if "disk_path" in opts:
            if "disk_capacity" not in opts:
                raise ConfigError("disk_capacity", "is missing",
                                  "Give a budget for the disk tier, e.g. 64GiB.")
            disk = DiskTierConfig(
                path=_text(opts["disk_path"], "disk_path"),
                capacity_bytes=parse_size(opts["disk_capacity"], "disk_capacity",
                                          minimum=1),
                write_mode=_parse_mode(opts.get("disk_write_mode", "write_back"),
                                       "disk_write_mode"),
                eviction_policy=str(opts.get("disk_eviction_policy", "lru")),
                io_threads=_int(opts.get("disk_io_threads", 4), "disk_io_threads"),
                fsync=_parse_bool(opts.get("disk_fsync", True), "disk_fsync"),
            )
        elif any(k.startswith("disk_") for k in opts):
            raise ConfigError("disk_path", "is missing while other disk options are set",
                              "Give disk_path to enable the disk tier.")
        if "remote_url" in opts:
            base = RemoteTierConfig()
            kwargs: dict[str, object] = {"url": _text(opts["remote_url"], "remote_url")}
            if "remote_write_mode" in opts:
                kwargs["write_mode"] = _parse_mode(opts["remote_write_mode"],
                                                   "remote_write_mode")
            for f in fields(RemoteTierConfig):
                key = f"remote_{f.name}"
                if f.name in ("url", "write_mode") or key not in opts:
                    continue
                current = getattr(base, f.name)
                kwargs[f.name] = (_int(opts[key], key) if isinstance(current, int)
                                  else _float(opts[key], key))
            remote = RemoteTierConfig(**kwargs)  # type: ignore[arg-type]
        elif any(k.startswith("remote_") for k in opts):
            raise ConfigError("remote_url", "is missing while other remote options are set",
                              "Give remote_url to enable the remote tier.")
        order: tuple[str, ...] = LOWER_TIER_NAMES
        if "tier_order" in opts:
            order = tuple(p.strip() for p in str(opts["tier_order"]).split(",") if p.strip())
        key_file = opts.get("tier_mac_key_file")
        mac_key = read_mac_key(None if key_file is None
                               else _text(key_file, "tier_mac_key_file"),
                               os.environ if environ is None else environ)
        return cls(model_id=str(opts.get("model_id", "")),
                   key_scheme=str(opts.get("key_scheme", "xxh3_128:kvoffload")),
                   disk=disk, remote=remote, order=order, mac_key=mac_key)

    # -- command line -----------------------------------------------------------------

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> TierConfig:
        """Build from the arguments ``add_cli_arguments`` added to a parser."""
        return cls.from_options({key: getattr(args, f"tier_{key}", None)
                                 for key in OPTION_HELP})


def read_mac_key(path: str | None, environ: Mapping[str, str]) -> MacKey | None:
    """The tiers' MAC key: the contents of file ``path`` if given, else the value of
    ``KVOFFLOAD_TIER_MAC_KEY`` in ``environ``; None when neither is set. Surrounding
    whitespace (a trailing newline) is not part of the key.

    Raises:
        ConfigError: both are set; the file is missing, unreadable, not a regular file or
            over 4 KiB; the key is shorter than 16 bytes. Messages name the file or the
            variable, never the key.
    """
    from_env = environ.get(MAC_KEY_ENV)
    if path is not None and from_env is not None:
        raise ConfigError("tier_mac_key_file", f"is set and so is {MAC_KEY_ENV}",
                          "Give the key one way: unset the variable or drop the option.")
    if path is not None:
        secret = _read_key_file(path).strip()
        if len(secret) < MIN_MAC_KEY_BYTES:
            raise ConfigError("tier_mac_key_file", f"{path} holds {len(secret)} bytes of "
                              f"key, fewer than {MIN_MAC_KEY_BYTES}",
                              f"{_KEY_FIX} > {path}")
        return MacKey(secret)
    if from_env is None:
        return None
    secret = from_env.encode("utf-8", "surrogateescape").strip()
    if len(secret) < MIN_MAC_KEY_BYTES:
        raise ConfigError(MAC_KEY_ENV, f"holds {len(secret)} bytes, fewer than "
                          f"{MIN_MAC_KEY_BYTES}", f"{_KEY_FIX}, or unset it to run "
                          "without a MAC key")
    return MacKey(secret)


def _read_key_file(path: str) -> bytes:
    """The bytes of key file ``path`` (never waits on a FIFO; refuses anything but a
    regular file of at most ``MAX_MAC_KEY_FILE_BYTES``)."""
    fix = ("Point tier_mac_key_file at a readable file holding the key; make one with "
           "openssl rand -hex 32 > FILE")
    if not path.strip():
        raise ConfigError("tier_mac_key_file", "is empty", fix)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError("tier_mac_key_file", f"cannot open {path} "
                          f"({exc.strerror or type(exc).__name__})", fix) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ConfigError("tier_mac_key_file", f"{path} is not a regular file", fix)
        data = b""
        while len(data) <= MAX_MAC_KEY_FILE_BYTES:
            piece = os.read(fd, MAX_MAC_KEY_FILE_BYTES + 1 - len(data))
            if not piece:
                break
            data += piece
    except OSError as exc:
        raise ConfigError("tier_mac_key_file", f"cannot read {path} "
                          f"({exc.strerror or type(exc).__name__})", fix) from None
    finally:
        os.close(fd)
    if len(data) > MAX_MAC_KEY_FILE_BYTES:
        raise ConfigError("tier_mac_key_file", f"{path} is over {MAX_MAC_KEY_FILE_BYTES} "
                          "bytes, too big for a key file", fix)
    return data


def _text(value: object, option: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(option, f"{value!r} ({type(value).__name__}) is not a string",
                          "Give it as a string.")
    return value


def _int(value: object, option: str) -> int:
    try:
        return int(str(value))
    except ValueError:
        raise ConfigError(option, f"cannot read {value!r} as an integer",
                          "Give a whole number.") from None


def _float(value: object, option: str) -> float:
    try:
        number = float(str(value))
    except ValueError:
        raise ConfigError(option, f"cannot read {value!r} as a number",
                          "Give a number of seconds.") from None
    if not math.isfinite(number):
        raise ConfigError(option, f"{value!r} is not a finite number",
                          "Give a number of seconds, e.g. 1.0.")
    return number


OPTION_HELP: dict[str, str] = {
    "model_id": "model name/revision; part of the namespace so models never share blocks",
    "key_scheme": "block-hash scheme (algorithm:seed); part of the namespace",
    "tier_order": "lookup order below host memory, e.g. disk,remote",
    "tier_mac_key_file": "file holding the secret that MACs every block in the lower "
                         f"tiers (else ${MAC_KEY_ENV}; none: unkeyed checksums only)",
    "disk_path": "directory of the disk tier (enables it)",
    "disk_capacity": "disk budget, all ranks, e.g. 64GiB",
    "disk_write_mode": "write_back (default) or write_through",
    "disk_eviction_policy": "eviction policy of the disk tier (lru, arc, ...)",
    "disk_io_threads": "file I/O threads per worker (default 4)",
    "disk_fsync": "fsync every block before it counts as stored (default true)",
    "remote_url": "redis://host:port/db of the shared Redis/Valkey tier (enables it)",
    "remote_write_mode": "write_through (default) or write_back",
    "remote_io_threads": "threads per worker talking to the server (default 4)",
    "remote_max_connections": "connection pool size per process (default 16)",
    "remote_timeout_s": "bound on one round trip in seconds (default 1.0)",
    "remote_connect_timeout_s": "bound on connecting in seconds (default 0.5)",
    "remote_retry_interval_s": "skip an unreachable server this long (default 5.0)",
    "remote_negative_ttl_s": "trust 'not on the server' answers this long (default 1.0)",
    "remote_batch_blocks": "blocks per pipelined round trip (default 16)",
    "remote_max_known_keys": "existence answers remembered (default 1000000)",
}
"""Every string option ``TierConfig.from_options`` accepts, with a one-line help."""


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--disk-path``, ``--remote-url`` and the other tier options to ``parser``.

    Flags are the option names with dashes; ``model_id`` and ``key_scheme`` become
    ``--tier-model-id`` and ``--tier-key-scheme``.

    Read them back with ``TierConfig.from_cli_args``. Values are parsed and validated
    there, so defaults stay in one place.
    """
    group = parser.add_argument_group("lower tiers (disk, remote)")
    for key, text in OPTION_HELP.items():
        flag = key if key.startswith(("disk_", "remote_", "tier_")) else f"tier_{key}"
        group.add_argument("--" + flag.replace("_", "-"), dest=f"tier_{key}", default=None,
                           metavar=key.split("_")[-1].upper(), help=text)
