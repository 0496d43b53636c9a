"""Configuration of the tiers below host memory: a local disk and a shared remote store.

``TierConfig`` says which lower tiers exist, in which order a lookup asks them, and how
each one is written. It is plain data (no I/O happens here); the scheduler side builds its
tier bookkeeping from it (``kvoffload.offload.build_offload``) and every worker builds
its tier I/O from the same value (``TransferWorker(..., tiers=...)``).

Three ways in, one meaning:

* Python: ``TierConfig(model_id=..., disk=DiskTierConfig(...), remote=RemoteTierConfig(...))``;
* string options (the vLLM connector's ``kv_connector_extra_config``, a simulator's
  config file): ``TierConfig.from_options({"disk_path": "/nvme/kv", "disk_capacity": "64GiB",
  "remote_url": "redis://cache:6379/0"})`` -- ``OPTION_HELP`` lists every key;
* the command line: ``add_cli_arguments(parser)`` then ``TierConfig.from_cli_args(ns)``.

Every invalid value raises ``ConfigError`` naming the option and what to change.

The tiers' MAC key (``TierConfig.mac_key``, see ``kvoffload.blockfile.framing``) is a secret:
it comes from a file (option ``tier_mac_key_file``) or the environment variable
``KVOFFLOAD_TIER_MAC_KEY`` (``read_mac_key``), never from an option value (option values
end up in logged configuration dumps), and it is never shown: not in a repr, a log line or
an error message.

The pieces live beside this module and are re-exported here: ``option_values``
(``WriteMode``, the option parsers), ``remote_config`` (``RemoteTierConfig``, URL masking
and credentials) and ``mac_key`` (``read_mac_key``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

from kvoffload.blockfile.framing import MacKey
from kvoffload.errors import ConfigError, shown
from kvoffload.policies import cache_policy
from kvoffload.sizes import parse_size
from kvoffload.tiers.mac_key import MAC_KEY_ENV, MAX_MAC_KEY_FILE_BYTES, read_mac_key
from kvoffload.tiers.option_values import (
    MAX_IO_THREADS,
    WriteMode,
    parse_bool,
    parse_int,
    parse_seconds,
    parse_text,
    parse_write_mode,
)
from kvoffload.tiers.remote_config import (
    MASK,
    PASSWORD_ENV,
    REMOTE_SCHEMES,
    RemoteTierConfig,
    check_readable_file,
    check_remote_url,
    masked_url,
    read_password_file,
    url_credentials,
    url_without_credentials,
)

__all__ = [
    "LOWER_TIER_NAMES", "MAC_KEY_ENV", "MASK", "MAX_IO_THREADS", "MAX_MAC_KEY_FILE_BYTES",
    "OPTION_HELP", "PASSWORD_ENV", "REMOTE_SCHEMES", "DiskTierConfig", "RemoteTierConfig",
    "TierConfig", "WriteMode", "add_cli_arguments", "check_disk_path",
    "check_readable_file", "check_remote_url", "masked_url", "read_mac_key",
    "read_password_file", "url_credentials", "url_without_credentials",
]


DISK_EVICTION_POLICY = "lru"
"""The disk tier's default eviction order: least recently used. The cache policy
(``OffloadConfig.eviction_policy``, ``value`` by default) decides what host memory keeps
and what goes down; the disk tier receives no value hints, so recency is the order that
carries information there (``docs/tiers.md``)."""


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
        eviction_policy: a registered cache policy whose eviction half orders the disk
            tier's deletions ("lru", the default, "arc", ...; ``DISK_EVICTION_POLICY``).
        io_threads: threads per worker reading and writing files.
        fsync: flush every file (and its directory entry) to the device before it
            counts as stored. Off: faster, and a power loss may lose recent blocks (a torn
            block is still detected by its checksum and read as a miss).
    """

    path: str
    capacity_bytes: int
    write_mode: WriteMode = WriteMode.WRITE_BACK
    eviction_policy: str = DISK_EVICTION_POLICY
    io_threads: int = 4
    fsync: bool = True

    def __post_init__(self) -> None:
        check_disk_path(self.path)
        if not isinstance(self.eviction_policy, str):
            raise ConfigError("disk_eviction_policy", f"{shown(self.eviction_policy)} is not "
                              "a policy name", "Give a name such as lru or arc.")
        cache_policy(self.eviction_policy, "disk_eviction_policy")
        if self.capacity_bytes <= 0:
            raise ConfigError("disk_capacity", f"must be positive, got {self.capacity_bytes}",
                              "Give the disk budget, e.g. 64GiB.")
        if not 1 <= self.io_threads <= MAX_IO_THREADS:
            raise ConfigError("disk_io_threads", f"must be >= 1 and at most {MAX_IO_THREADS}, "
                              f"got {self.io_threads}", "Use a few threads, e.g. 4.")


def check_disk_path(path: str, field: str = "disk_path") -> None:
    """A disk tier's directory must be named (not empty, not only blanks) by a path the
    system can open (no NUL byte)."""
    if not path.strip():
        raise ConfigError(field, "is empty", "Give a directory for offloaded blocks, "
                          "e.g. /var/cache/kvoffload.")
    if "\0" in path:
        raise ConfigError(field, f"{shown(path)} holds a NUL byte, which no path can",
                          "Give a directory for offloaded blocks, e.g. /var/cache/kvoffload.")


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
            write to them; see ``kvoffload.blockfile.framing``). It is in no fingerprint or
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
            raise ConfigError("tier_order", f"{shown(self.order)} is not an ordering of "
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
            name = unknown[0] if len(unknown[0]) <= 80 else shown(unknown[0])
            raise ConfigError(name, "is not a tier option",
                              "Known options: " + ", ".join(sorted(OPTION_HELP)) + ".")
        disk = remote = None
        if "disk_path" in opts:
            if "disk_capacity" not in opts:
                raise ConfigError("disk_capacity", "is missing",
                                  "Give a budget for the disk tier, e.g. 64GiB.")
            disk = DiskTierConfig(
                path=parse_text(opts["disk_path"], "disk_path"),
                capacity_bytes=parse_size(opts["disk_capacity"], "disk_capacity",
                                          minimum=1),
                write_mode=parse_write_mode(opts.get("disk_write_mode", "write_back"),
                                       "disk_write_mode"),
                eviction_policy=parse_text(opts.get("disk_eviction_policy",
                                                    DISK_EVICTION_POLICY),
                                           "disk_eviction_policy"),
                io_threads=parse_int(opts.get("disk_io_threads", 4), "disk_io_threads"),
                fsync=parse_bool(opts.get("disk_fsync", True), "disk_fsync"),
            )
        elif any(k.startswith("disk_") for k in opts):
            raise ConfigError("disk_path", "is missing while other disk options are set",
                              "Give disk_path to enable the disk tier.")
        if "remote_url" in opts:
            base = RemoteTierConfig()
            kwargs: dict[str, object] = {"url": parse_text(opts["remote_url"], "remote_url")}
            if "remote_write_mode" in opts:
                kwargs["write_mode"] = parse_write_mode(opts["remote_write_mode"],
                                                   "remote_write_mode")
            for f in fields(RemoteTierConfig):
                key = f"remote_{f.name}"
                if f.name in ("url", "write_mode") or key not in opts:
                    continue
                if f.name in _REMOTE_TEXT_FIELDS:
                    kwargs[f.name] = parse_text(opts[key], key)
                    continue
                current = getattr(base, f.name)
                if isinstance(current, bool):
                    kwargs[f.name] = parse_bool(opts[key], key)
                    continue
                kwargs[f.name] = (parse_int(opts[key], key) if isinstance(current, int)
                                  else parse_seconds(opts[key], key))
            remote = RemoteTierConfig(**kwargs)  # type: ignore[arg-type]
        elif any(k.startswith("remote_") for k in opts):
            raise ConfigError("remote_url", "is missing while other remote options are set",
                              "Give remote_url to enable the remote tier.")
        order: tuple[str, ...] = LOWER_TIER_NAMES
        if "tier_order" in opts:
            order = tuple(p.strip() for p in str(opts["tier_order"]).split(",") if p.strip())
        key_file = opts.get("tier_mac_key_file")
        mac_key = read_mac_key(None if key_file is None
                               else parse_text(key_file, "tier_mac_key_file"),
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


_REMOTE_TEXT_FIELDS = ("username", "password_file", "tls_ca_file", "tls_cert_file",
                       "tls_key_file")
"""``RemoteTierConfig`` fields given as text (the others are numbers)."""


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
    "remote_url": "redis://[user:password@]host:port/db (rediss:// for TLS) of the shared "
                  "Redis/Valkey tier (enables it); the only query parameter is ?db=N",
    "remote_write_mode": "write_through (default) or write_back",
    "remote_io_threads": "threads per worker talking to the server (default 4)",
    "remote_max_connections": "connection pool size per process (default 16)",
    "remote_timeout_s": "bound on one round trip in seconds (default 1.0)",
    "remote_connect_timeout_s": "bound on connecting in seconds (default 0.5)",
    "remote_retry_interval_s": "skip an unreachable server this long (default 5.0)",
    "remote_negative_ttl_s": "trust 'not on the server' answers this long (default 1.0)",
    "remote_batch_blocks": "blocks per pipelined round trip (default 16)",
    "remote_max_known_keys": "existence answers remembered (default 1000000)",
    "remote_username": "ACL user on the server (overrides the URL's user)",
    "remote_password_file": "file holding the server's password (overrides "
                            f"${PASSWORD_ENV} and the URL's password)",
    "remote_tls_ca_file": "CA certificates (PEM) the server's certificate must chain to "
                          "(rediss:// URLs)",
    "remote_tls_cert_file": "client certificate (PEM) for TLS client authentication",
    "remote_tls_key_file": "private key (PEM) of the client certificate",
    "remote_cluster": "true: remote_url is one node of a Redis/Valkey Cluster (default false)",
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
