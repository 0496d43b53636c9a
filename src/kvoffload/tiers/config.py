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
from urllib.parse import parse_qsl, unquote

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

PASSWORD_ENV = "KVOFFLOAD_REMOTE_PASSWORD"
"""Environment variable holding the remote tier's password (read when a client connects)."""

MASK = "***"
"""What a password looks like in every log line, error message and repr."""

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
        raise ConfigError(field, f"{masked_url(url)!r} is not a Redis URL",
                          "Use redis://host:port/db, rediss://host:port/db (TLS) or "
                          "unix:///path/to/redis.sock.")


def _split_url(url: str) -> tuple[str, str, str, str]:
    """``(scheme://, userinfo, host:port, rest)`` of a URL, by plain string cuts (no
    parsing that could fail or re-spell it)."""
    scheme, sep, after = url.partition("://")
    if not sep:
        return "", "", url, ""
    end = min((i for i in (after.find(c) for c in "/?#") if i >= 0), default=len(after))
    userinfo, at, hostport = after[:end].rpartition("@")
    return scheme + sep, userinfo + at, hostport, after[end:]


def masked_url(url: str) -> str:
    """``url`` with its password shown as ``***``: ``redis://user:***@host:port/0``.

    Covers the password of the user part and a ``password=`` query parameter; every log
    line, error message and repr that shows a remote tier's URL goes through here.
    """
    scheme, userinfo, hostport, rest = _split_url(url)
    user, colon, password = userinfo[:-1].partition(":")
    if colon and password:
        userinfo = f"{user}:{MASK}@"
    path, qmark, query = rest.partition("?")
    if qmark:
        query, hash_, fragment = query.partition("#")
        pairs = [(k, MASK if k.lower() == "password" and v else v)
                 for k, v in parse_qsl(query, keep_blank_values=True)]
        if any(v == MASK for _, v in pairs):
            query = "&".join(f"{k}={v}" for k, v in pairs)
        rest = path + qmark + query + hash_ + fragment
    return scheme + userinfo + hostport + rest


def url_without_credentials(url: str) -> str:
    """``url`` without its ``user:password@`` part (what redis-py is given, with the
    resolved credentials as keyword arguments: see ``RemoteTierConfig``)."""
    scheme, _, hostport, rest = _split_url(url)
    return scheme + hostport + rest


def url_credentials(url: str) -> tuple[str | None, str | None]:
    """The (percent-decoded) user and password written in ``url``, None where absent."""
    userinfo = _split_url(url)[1][:-1]
    if not userinfo:
        return None, None
    user, colon, password = userinfo.partition(":")
    return (unquote(user) or None), (unquote(password) if colon and password else None)


def check_readable_file(path: str, field: str, what: str) -> bytes:
    """``path`` must name a regular file this process can read; returns its bytes."""
    if not path.strip():
        raise ConfigError(field, "is empty", f"Give the path of {what}.")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(field, f"{path!r} is not a regular file",
                              f"Give the path of {what}.")
        with open(path, "rb") as f:
            return f.read()
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise ConfigError(field, f"cannot read {path!r}: {reason}",
                          f"Give a file this process can read, holding {what}.") from None


def read_password_file(path: str, field: str = "remote_password_file") -> str:
    """The password held in ``path`` (one line; a trailing newline is dropped)."""
    data = check_readable_file(path, field, "the remote tier's password")
    try:
        text = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ConfigError(field, f"{path!r} is not UTF-8 text",
                          "Write the password as one line of text.") from None
    if not text:
        raise ConfigError(field, f"{path!r} is empty", "Write the password into it, "
                          "as one line.")
    return text


@dataclass(frozen=True, repr=False)
class RemoteTierConfig:
    """A Redis/Valkey server shared by a fleet of engines.

    Credentials. The ACL user is ``username``, else the URL's user, else the server's
    ``default`` user. The password is read from ``password_file``, else from the
    environment variable ``KVOFFLOAD_REMOTE_PASSWORD``, else taken from the URL; none of
    them: no ``AUTH``. The password is read when a client connects and never kept in this
    value; every URL shown (repr, logs, errors) masks it as ``***`` (``masked_url``).

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
        cluster: ``url`` names one node of a Redis Cluster (or Valkey cluster): the tier
            finds the others, spreads blocks over every master by hash slot and follows
            resharding and failover. Standalone server when False (the default).
        username: the ACL user (overrides the URL's user).
        password_file: a file holding the password, one line (overrides the environment
            variable and the URL's password).
        tls_ca_file: PEM certificates of the authorities the server's certificate must
            chain to (default: the system's). Needs a ``rediss://`` URL, as every TLS
            option does; the server's certificate and host name are always verified.
        tls_cert_file: the client's certificate (PEM), for a server that asks for one.
        tls_key_file: the client certificate's private key (PEM), if not in
            ``tls_cert_file``.
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
    cluster: bool = False
    username: str | None = None
    password_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __repr__(self) -> str:
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                          if f.name != "url")
        return f"RemoteTierConfig(url={masked_url(self.url)!r}, {shown})"

    @property
    def shown_url(self) -> str:
        """The URL as logs and errors show it (password masked)."""
        return masked_url(self.url)

    def credentials(self) -> tuple[str | None, str | None]:
        """``(user, password)`` as the class docstring resolves them (reads the password
        file or the environment now)."""
        url_user, url_password = url_credentials(self.url)
        if self.password_file is not None:
            password: str | None = read_password_file(self.password_file)
        else:
            password = os.environ.get(PASSWORD_ENV) or url_password
        return self.username or url_user, password

    def credential_source(self) -> str:
        """Where the user and password come from, for an error message (no secrets)."""
        url_user, url_password = url_credentials(self.url)
        user = (f"remote_username {self.username!r}" if self.username
                else f"the user {url_user!r} in remote_url" if url_user
                else "the default user")
        password = (f"remote_password_file {self.password_file!r}" if self.password_file
                    else f"${PASSWORD_ENV}" if os.environ.get(PASSWORD_ENV)
                    else "the password in remote_url" if url_password
                    else "no password")
        return f"{user} with {password}"

    def __post_init__(self) -> None:
        check_remote_url(self.url)
        if self.cluster and self.url.lower().startswith("unix://"):
            raise ConfigError("remote_cluster", "is true with a unix:// socket URL",
                              "Give one cluster node as redis://host:port, or set "
                              "remote_cluster to false.")
        self._check_credentials()
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

    def _check_credentials(self) -> None:
        if self.username is not None and not self.username.strip():
            raise ConfigError("remote_username", "is empty",
                              "Give the ACL user, or leave the option out.")
        if self.password_file is not None:
            read_password_file(self.password_file)
        tls = {"remote_tls_ca_file": self.tls_ca_file,
               "remote_tls_cert_file": self.tls_cert_file,
               "remote_tls_key_file": self.tls_key_file}
        given = [name for name, path in tls.items() if path is not None]
        if given and not self.url.lower().startswith("rediss://"):
            raise ConfigError(given[0], f"needs a TLS URL, remote_url is "
                              f"{masked_url(self.url)!r}",
                              "Use rediss://host:port/db, or drop the TLS options.")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ConfigError("remote_tls_cert_file", "is missing while remote_tls_key_file "
                              "is set", "Give the client certificate the key belongs to.")
        what = {"remote_tls_ca_file": "the certificate authorities (PEM)",
                "remote_tls_cert_file": "the client certificate (PEM)",
                "remote_tls_key_file": "the client certificate's private key (PEM)"}
        for name in given:
            check_readable_file(tls[name] or "", name, what[name])

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
                if f.name in _REMOTE_TEXT_FIELDS:
                    kwargs[f.name] = _text(opts[key], key)
                    continue
                current = getattr(base, f.name)
                if isinstance(current, bool):
                    kwargs[f.name] = _parse_bool(opts[key], key)
                    continue
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


_REMOTE_TEXT_FIELDS = ("username", "password_file", "tls_ca_file", "tls_cert_file",
                       "tls_key_file")
"""``RemoteTierConfig`` fields given as text (the others are numbers)."""


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
    "remote_url": "redis://[user:password@]host:port/db (rediss:// for TLS) of the shared "
                  "Redis/Valkey tier (enables it)",
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
