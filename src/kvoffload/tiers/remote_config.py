"""Configuration of the remote tier: ``RemoteTierConfig`` and its URL and credentials.

A remote tier is a Redis/Valkey server (or cluster) named by a ``redis://``, ``rediss://``
or ``unix://`` URL (checked, shown and split by ``kvoffload.tiers.remote_url``). Its
password is a secret: it is read when a client connects (``RemoteTierConfig.credentials``),
never kept in the value, and every URL shown in a repr, a log line or an error message is
masked (``masked_url``). Plain data: nothing here connects.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

from kvoffload.errors import ConfigError, shown
from kvoffload.files import UnreadableFileError, read_regular_file
from kvoffload.tiers.option_values import MAX_IO_THREADS, WriteMode
from kvoffload.tiers.remote_url import (
    MASK,
    REMOTE_SCHEMES,
    check_remote_url,
    masked_url,
    url_credentials,
    url_db,
    url_without_credentials,
)

__all__ = ["MASK", "PASSWORD_ENV", "REMOTE_SCHEMES", "RemoteTierConfig", "check_readable_file",
           "check_remote_url", "masked_url", "read_password_file", "url_credentials",
           "url_without_credentials"]

PASSWORD_ENV = "KVOFFLOAD_REMOTE_PASSWORD"
"""Environment variable holding the remote tier's password (read when a client connects)."""


MAX_CREDENTIAL_FILE_BYTES = 16 << 20
"""Largest password, certificate or key file read (a CA bundle is a few hundred KB)."""


def check_readable_file(path: str, field: str, what: str) -> bytes:
    """``path`` must name a regular file this process can read, of at most
    ``MAX_CREDENTIAL_FILE_BYTES``; returns its bytes (``kvoffload.files``: a FIFO is refused
    without waiting, a device or a huge file without reading it whole)."""
    if not path.strip():
        raise ConfigError(field, "is empty", f"Give the path of {what}.")
    try:
        return read_regular_file(path, max_bytes=MAX_CREDENTIAL_FILE_BYTES)
    except UnreadableFileError as exc:
        fix = (f"Give a file this process can read, holding {what}."
               if exc.reason.startswith("cannot") else f"Give the path of {what}.")
        raise ConfigError(field, f"{shown(path)} {exc.reason}", fix) from None


def read_password_file(path: str, field: str = "remote_password_file") -> str:
    """The password held in ``path`` (one line; a trailing newline is dropped)."""
    data = check_readable_file(path, field, "the remote tier's password")
    try:
        text = data.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise ConfigError(field, f"{shown(path)} is not UTF-8 text",
                          "Write the password as one line of text.") from None
    if not text:
        raise ConfigError(field, f"{shown(path)} is empty", "Write the password into it, "
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
        if self.cluster and url_db(self.url) != 0:
            raise ConfigError("remote_cluster", f"is true while remote_url names the database "
                              f"{url_db(self.url)}; a cluster has only database 0",
                              "Drop the database from the URL, or set remote_cluster to "
                              "false.")
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
                              f"{shown(masked_url(self.url))}",
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
