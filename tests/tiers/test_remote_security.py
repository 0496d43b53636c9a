"""Credentials and transport of the remote tier, against real ``redis-server`` processes
each test starts: a password on the default user (``--requirepass``), ACL users
(``--user`` lines), TLS with certificates made here by ``openssl``.

Stories: blocks round-trip byte for byte with a password from the URL, a password file or
the environment, as an ACL user, and over TLS with a client certificate; a wrong
password is one clear error (the tier stays off, the server is not asked again), and a
configuration error at the command line's start-up; no log line and no repr shows the
password; an oversized value is a miss, deleted, and costs at most one byte more than a
block; shutdown leaves no client connected.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.blockfile.framing import FINGERPRINT_BYTES, HEADER_BYTES
from kvoffload.cli import main
from kvoffload.cli.validate import check_remote_login
from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import make_offload_key
from kvoffload.tiers.base import LookupResult
from kvoffload.tiers.config import (
    PASSWORD_ENV,
    RemoteTierConfig,
    TierConfig,
    add_cli_arguments,
    check_remote_url,
    masked_url,
    url_without_credentials,
)
from kvoffload.tiers.naming import remote_key
from kvoffload.tiers.remote import RemoteIndex, check_credentials, connection_kwargs
from kvoffload.worker.block_store import TierUnavailable
from kvoffload.worker.remote_store import RemoteStore
from tiers.tier_kit import (
    RedisServer,
    TlsFiles,
    hybrid_config,
    make_tls_files,
    prompt,
    redis_server,
    remote_tiers,
    tiered_engine,
)

pytestmark = pytest.mark.redis

ADMIN = "adm1n-Pa55"
SECRET = "s3cret-Pa55word"
WRONG = "wr0ng-Pa55word"
FP = bytes(range(FINGERPRINT_BYTES))
NS = "ns-security"


# -- servers ---------------------------------------------------------------------------------


@pytest.fixture
def password_srv() -> Iterator[RedisServer]:
    """The default user needs SECRET."""
    with redis_server(extra_args=["--requirepass", SECRET], password=SECRET) as server:
        yield server


@pytest.fixture
def acl_srv() -> Iterator[RedisServer]:
    """ACL users: ``kv`` may do anything on ``kvo:*`` keys; ``peek`` may only ping and
    ask whether keys exist; the default user needs ADMIN."""
    with redis_server(extra_args=["--requirepass", ADMIN,
                                  "--user", "kv", "on", f">{SECRET}", "~kvo:*", "+@all",
                                  "--user", "peek", "on", f">{SECRET}", "~*", "+ping",
                                  "+exists"], password=ADMIN) as server:
        yield server


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def tls_srv(tls_files: TlsFiles) -> Iterator[RedisServer]:
    """TLS only, a client certificate required, and a password."""
    try:
        with redis_server(tls=tls_files, tls_auth_clients="yes", password=SECRET,
                          extra_args=["--requirepass", SECRET]) as server:
            yield server
    except RuntimeError as exc:
        if "exited" not in str(exc):
            raise
        pytest.skip(f"this redis-server does not serve TLS (built without it?): {exc}")


def small_config(workers: int = 2) -> OffloadConfig:
    return OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4, page_bytes=8),),
                         hash_block_size=4, host_capacity_bytes=64, num_workers=workers,
                         eviction_policy="lru")


def with_password(url: str, password: str, user: str = "") -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{user}:{password}@{rest}"


def password_file(tmp_path: Path, password: str) -> str:
    path = tmp_path / "redis-password"
    path.write_text(password + "\n")
    return str(path)


def no_secret_logged(caplog: pytest.LogCaptureFixture, *secrets: str) -> None:
    for record in caplog.records:
        text = record.getMessage() + (str(record.exc_info[1]) if record.exc_info else "")
        for secret in secrets:
            assert secret not in text, f"{secret!r} logged: {text}"


def wait_for(predicate: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def connections(server: RedisServer) -> int:
    """Connections the server accepted so far, the test's own ``INFO`` ones included."""
    return int(server.stats()["total_connections_received"])


def blocks(n: int, size: int = 4096, seed: int = 0) -> list[tuple[bytes, bytes]]:
    return [(make_offload_key(bytes([seed, i]) * 8, 0), os.urandom(size)) for i in range(n)]


def round_trip(store: RemoteStore, items: list[tuple[bytes, bytes]]) -> None:
    assert store.put(items) == [True] * len(items)
    dests = [memoryview(bytearray(len(p))) for _, p in items]
    assert store.get_into([(k, d) for (k, _), d in zip(items, dests, strict=True)]) == \
        [True] * len(items)
    for (_, payload), dest in zip(items, dests, strict=True):
        assert dest.tobytes() == payload


def engine_round_trip(url: str, **remote: Any) -> None:
    """Two prompts through the real planner, cascade and two worker ranks: the second
    loads the first one's prefix from the server (the engine checks every byte)."""
    config = hybrid_config(host_slots=24)
    with tiered_engine(config, remote_tiers(url, **remote)) as engine:
        engine.run([prompt(1, 40)])
        engine.run([prompt(s, 40) for s in range(2, 4)])  # evicts prompt 1 from host memory
        assert engine.run([[*prompt(1, 40), 1, 2, 3]]) > 0
        assert engine.tier.stats.loaded_blocks.get("remote", 0) > 0


# -- masking and options (no server) ---------------------------------------------------------


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://kv:pw@cache:6379/0", "redis://kv:***@cache:6379/0"),
    ("redis://:pw@cache:6379/0", "redis://:***@cache:6379/0"),
    ("rediss://kv:p%40ss:w@cache:6380/1", "rediss://kv:***@cache:6380/1"),
    ("redis://kv@cache:6379/0", "redis://kv@cache:6379/0"),
    ("redis://cache:6379/0", "redis://cache:6379/0"),
    ("unix://:pw@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
    ("redis://cache/0?password=pw&db=1", "redis://cache/0?password=***&db=1"),
])
def test_urls_are_shown_with_the_password_masked(url: str, shown: str) -> None:
    assert masked_url(url) == shown
    assert "pw" not in url_without_credentials(url).split("?")[0]


def test_configs_reprs_and_errors_never_show_the_password() -> None:
    remote = RemoteTierConfig("redis://kv:pw0rd@cache:6379/0")
    tiers = TierConfig(remote=remote)
    for text in (repr(remote), repr(tiers), str(tiers)):
        assert "pw0rd" not in text and "redis://kv:***@cache:6379/0" in text
    with pytest.raises(ConfigError) as info:
        check_remote_url("http://kv:pw0rd@cache:6379/0")
    assert "pw0rd" not in str(info.value) and "***" in str(info.value)
    with pytest.raises(ConfigError) as info:
        RemoteTierConfig("redis://kv:pw0rd@cache:6379/0", tls_ca_file="/etc/hosts")
    assert info.value.field == "remote_tls_ca_file" and "pw0rd" not in str(info.value)


def test_options_override_the_url_and_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    url = "redis://urluser:urlpass@cache:6379/0"
    assert RemoteTierConfig(url).credentials() == ("urluser", "urlpass")
    assert RemoteTierConfig("redis://cache:6379/0").credentials() == (None, None)
    monkeypatch.setenv(PASSWORD_ENV, "envpass")
    assert RemoteTierConfig(url).credentials() == ("urluser", "envpass")
    remote = RemoteTierConfig(url, username="kv",
                              password_file=password_file(tmp_path, "filepass"))
    assert remote.credentials() == ("kv", "filepass")
    assert "filepass" not in repr(remote) and "envpass" not in repr(remote)
    kwargs = connection_kwargs(remote)
    assert kwargs == {"username": "kv", "password": "filepass"}
    assert "remote_password_file" in remote.credential_source()


def test_string_options_carry_credentials_and_tls_files(tmp_path: Path,
                                                        tls_files: TlsFiles) -> None:
    tiers = TierConfig.from_options({
        "remote_url": "rediss://cache:6380/0", "remote_username": "kv",
        "remote_password_file": password_file(tmp_path, "pw"),
        "remote_tls_ca_file": str(tls_files.ca),
        "remote_tls_cert_file": str(tls_files.client_cert),
        "remote_tls_key_file": str(tls_files.client_key)})
    remote = tiers.remote
    assert remote is not None and remote.username == "kv"
    kwargs = connection_kwargs(remote)
    assert kwargs["ssl_ca_certs"] == str(tls_files.ca)
    assert kwargs["ssl_certfile"] == str(tls_files.client_cert)
    assert kwargs["ssl_keyfile"] == str(tls_files.client_key)
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_check_hostname"] is True
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--remote-url", "rediss://cache:6380/0",
                              "--remote-tls-ca-file", str(tls_files.ca),
                              "--remote-username", "kv"])
    assert TierConfig.from_cli_args(args).remote == RemoteTierConfig(
        "rediss://cache:6380/0", tls_ca_file=str(tls_files.ca), username="kv")


@pytest.mark.parametrize(("options", "field", "needle"), [
    ({"remote_tls_ca_file": "/nonexistent/ca.crt"}, "remote_tls_ca_file", "cannot be opened"),
    ({"remote_tls_cert_file": "/"}, "remote_tls_cert_file", "not a regular file"),
    ({"remote_tls_cert_file": "CERT", "remote_tls_key_file": ""}, "remote_tls_key_file",
     "is empty"),
    ({"remote_tls_key_file": "KEY"}, "remote_tls_cert_file", "is missing"),
    ({"remote_url": "redis://cache:6379/0", "remote_tls_ca_file": "CA"},
     "remote_tls_ca_file", "needs a TLS URL"),
    ({"remote_password_file": "/nonexistent/pw"}, "remote_password_file", "cannot be opened"),
    ({"remote_password_file": "EMPTY"}, "remote_password_file", "is empty"),
    ({"remote_password_file": "/tmp"}, "remote_password_file", "not a regular file"),
    ({"remote_password_file": "bad\0path"}, "remote_password_file", "NUL byte"),
    ({"remote_username": " "}, "remote_username", "is empty"),
    ({"remote_username": 7}, "remote_username", "not a string"),
])
def test_bad_credential_and_tls_options_name_the_option(
        options: dict[str, object], field: str, needle: str, tmp_path: Path,
        tls_files: TlsFiles) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    files = {"CA": str(tls_files.ca), "CERT": str(tls_files.client_cert),
             "KEY": str(tls_files.client_key), "EMPTY": str(empty)}
    opts = {"remote_url": "rediss://cache:6380/0",
            **{k: files.get(v, v) if isinstance(v, str) else v for k, v in options.items()}}
    with pytest.raises(ConfigError) as info:
        TierConfig.from_options(opts)
    assert info.value.field == field
    assert needle in str(info.value)


# -- a password on the default user -----------------------------------------------------------


@pytest.mark.parametrize("source", ["url", "file", "env"])
def test_blocks_round_trip_with_a_password_and_none_is_logged(
        password_srv: RedisServer, source: str, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    url, extra = password_srv.url, {}
    if source == "url":
        url = with_password(url, SECRET)
    elif source == "file":
        extra = {"password_file": password_file(tmp_path, SECRET)}
    else:
        monkeypatch.setenv(PASSWORD_ENV, SECRET)
    with caplog.at_level(logging.DEBUG):
        remote = RemoteTierConfig(url, **extra)  # type: ignore[arg-type]
        store = RemoteStore(remote, NS, 0, FP)
        try:
            round_trip(store, blocks(5))
        finally:
            store.close()
        engine_round_trip(url, **extra)
        logging.getLogger("kvoffload").debug("config: %r", remote_tiers(url, **extra))
    no_secret_logged(caplog, SECRET)
    assert wait_for(lambda: password_srv.clients() == 0)


def test_a_wrong_password_is_one_error_and_the_tier_stays_off(
        password_srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    url = with_password(password_srv.url, WRONG, "default")
    remote = RemoteTierConfig(url, retry_interval_s=0.05, negative_ttl_s=0.0,
                              max_connections=5)
    index = RemoteIndex(small_config(), remote, NS)
    keys = [make_offload_key(bytes([i]) * 16, 0) for i in range(8)]
    before = connections(password_srv)
    try:
        with caplog.at_level(logging.DEBUG):
            assert index.status(keys[0]) is LookupResult.PENDING
            assert index.wait_idle()
            assert index.refused and index.is_down
            for _ in range(10):  # many retry intervals: nothing is asked again
                time.sleep(0.06)
                index.mark_unreachable()
                assert all(index.status(k) is LookupResult.MISS for k in keys)
                assert index.begin_write(keys[1]) is False
                assert index.begin_read(keys[2]) is False
            assert index.wait_idle()
        assert connections(password_srv) - before <= 2  # the check, and this INFO's
    finally:
        index.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    message = errors[0].getMessage()
    assert "refused the credentials" in message and "remote_username" in message
    assert "redis://default:***@127.0.0.1" in message
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()
                and r.levelno >= logging.WARNING]
    no_secret_logged(caplog, WRONG, SECRET)


def test_a_missing_password_is_refused_as_well(password_srv: RedisServer,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    index = RemoteIndex(small_config(), RemoteTierConfig(password_srv.url), NS)
    try:
        index.status(make_offload_key(b"\x07" * 16, 0))
        assert index.wait_idle() and index.refused
    finally:
        index.close()


def test_a_worker_with_a_wrong_password_logs_once_and_stops_calling(
        password_srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    remote = RemoteTierConfig(with_password(password_srv.url, WRONG), retry_interval_s=0.0)
    store = RemoteStore(remote, NS, 0, FP)
    items = blocks(4)
    before = connections(password_srv)
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(20):
                with pytest.raises(TierUnavailable) as info:
                    store.put(items)
                assert WRONG not in str(info.value)
                with pytest.raises(TierUnavailable):
                    store.get_into([(k, memoryview(bytearray(len(p)))) for k, p in items])
        assert connections(password_srv) - before <= 2
    finally:
        store.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "refused the credentials" in errors[0].getMessage()
    no_secret_logged(caplog, WRONG, SECRET)


def test_an_engine_with_a_wrong_password_serves_from_host_memory(
        password_srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    config = hybrid_config(host_slots=48)
    url = with_password(password_srv.url, WRONG)
    before = connections(password_srv)
    with caplog.at_level(logging.DEBUG), \
            tiered_engine(config, remote_tiers(url, retry_interval_s=0.05)) as engine:
        engine.run([prompt(1, 40)])
        time.sleep(0.2)
        assert engine.run([[*prompt(1, 40), 1, 2, 3]]) > 0  # host memory serves
        assert engine.run([prompt(s, 40) for s in range(2, 5)]) == 0
        assert engine.tier.lower("remote").is_down
        assert engine.tier.stats.loaded_blocks.get("remote", 0) == 0
    assert connections(password_srv) - before <= 6
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert 1 <= len(errors) <= 3, [r.getMessage() for r in errors]  # index + each rank
    no_secret_logged(caplog, WRONG, SECRET)
    assert wait_for(lambda: password_srv.clients() == 0)


def test_the_command_line_reports_a_wrong_password_as_a_configuration_error(
        password_srv: RedisServer, capsys: pytest.CaptureFixture[str]) -> None:
    url = with_password(password_srv.url, WRONG, "default")
    assert main(["simulate", "--remote-url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --remote-url: ") and "refused the credentials" in err
    assert "redis://default:***@" in err and WRONG not in err
    check_remote_login(with_password(password_srv.url, SECRET))  # the right one passes
    check_remote_login("redis://127.0.0.1:1/0")  # nobody listens: the tier will skip it
    with pytest.raises(ConfigError) as info:
        check_credentials(RemoteTierConfig(password_srv.url), "remote_url")
    assert info.value.field == "remote_url" and "no password" in str(info.value)
    assert wait_for(lambda: password_srv.clients() == 0)


# -- ACL users -------------------------------------------------------------------------------


def test_an_acl_user_round_trips_from_the_url_and_from_options(
        acl_srv: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        engine_round_trip(with_password(acl_srv.url, SECRET, "kv"))
        options = {"username": "kv", "password_file": password_file(tmp_path, SECRET)}
        # the options win over a URL naming another user with another password
        engine_round_trip(with_password(acl_srv.url, WRONG, "nobody"), **options)
        stored = acl_srv.client().keys(b"*")
        assert stored and all(k.startswith(b"kvo:") for k in stored)
    no_secret_logged(caplog, SECRET, WRONG, ADMIN)
    assert wait_for(lambda: acl_srv.clients() == 0)


def test_an_unknown_acl_user_is_refused(acl_srv: RedisServer, monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(PASSWORD_ENV, SECRET)
    remote = RemoteTierConfig(acl_srv.url, username="nobody", retry_interval_s=0.0)
    with caplog.at_level(logging.ERROR):
        index = RemoteIndex(small_config(), remote, NS)
        try:
            index.status(make_offload_key(b"\x03" * 16, 0))
            assert index.wait_idle() and index.refused
        finally:
            index.close()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "remote_username 'nobody'" in errors[0]
    assert f"${PASSWORD_ENV}" in errors[0]
    no_secret_logged(caplog, SECRET)


def test_a_user_without_write_rights_is_refused_once_per_worker(
        acl_srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    """``peek`` may ask whether keys exist (the scheduler's checks work) but not write:
    each rank's first write logs one error; later writes fail at once, unsent."""
    config = hybrid_config(host_slots=48)
    url = with_password(acl_srv.url, SECRET, "peek")
    before = connections(acl_srv)
    with caplog.at_level(logging.DEBUG), \
            tiered_engine(config, remote_tiers(url, retry_interval_s=0.05)) as engine:
        for seed in range(1, 6):
            engine.run([prompt(seed, 40)])
            time.sleep(0.06)  # past the retry interval: the scheduler writes again
        assert engine.tier.stats.loaded_blocks.get("remote", 0) == 0
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2, errors  # one per rank
    assert all("lacks a command or key" in e for e in errors)
    assert connections(acl_srv) - before <= 12
    no_secret_logged(caplog, SECRET, ADMIN)


# -- TLS -------------------------------------------------------------------------------------


def test_blocks_round_trip_over_tls_with_a_client_certificate(
        tls_srv: RedisServer, tls_files: TlsFiles, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    tls = {"tls_ca_file": str(tls_files.ca), "tls_cert_file": str(tls_files.client_cert),
           "tls_key_file": str(tls_files.client_key),
           "password_file": password_file(tmp_path, SECRET)}
    with caplog.at_level(logging.DEBUG):
        store = RemoteStore(RemoteTierConfig(tls_srv.url, **tls), NS, 1, FP)
        try:
            round_trip(store, blocks(6, size=65536))
        finally:
            store.close()
        engine_round_trip(tls_srv.url, **tls)
        # the right password over TLS, but no client certificate: the server hangs up
        index = RemoteIndex(small_config(), RemoteTierConfig(
            tls_srv.url, tls_ca_file=str(tls_files.ca),
            password_file=tls["password_file"]), NS)
        try:
            index.status(make_offload_key(b"\x05" * 16, 0))
            assert index.wait_idle() and index.is_down and not index.refused
        finally:
            index.close()
    no_secret_logged(caplog, SECRET)
    assert wait_for(lambda: tls_srv.clients() == 0)


def test_a_wrong_password_over_tls_is_refused(tls_srv: RedisServer,
                                              tls_files: TlsFiles) -> None:
    remote = RemoteTierConfig(with_password(tls_srv.url, WRONG), tls_ca_file=str(tls_files.ca),
                              tls_cert_file=str(tls_files.client_cert),
                              tls_key_file=str(tls_files.client_key))
    with pytest.raises(ConfigError) as info:
        check_credentials(remote)
    assert "rediss://:***@127.0.0.1" in str(info.value) and WRONG not in str(info.value)


# -- oversized values and shutdown -----------------------------------------------------------


def test_an_oversized_value_is_a_miss_deleted_without_being_fetched_whole(
        password_srv: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    store = RemoteStore(RemoteTierConfig(with_password(password_srv.url, SECRET)), NS, 0, FP)
    admin = password_srv.client()
    items = blocks(3, size=1024)
    try:
        assert store.put(items) == [True] * 3
        big, short = (remote_key(NS, 0, k) for k, _ in items[:2])
        admin.append(big, b"\0" * (8 << 20))  # 8 MiB past the block
        admin.set(short, admin.getrange(short, 0, HEADER_BYTES + 500))
        missing = make_offload_key(b"\x09" * 16, 0)
        dests = [memoryview(bytearray(1024)) for _ in range(4)]
        sent_before = int(password_srv.stats()["total_net_output_bytes"])
        with caplog.at_level(logging.WARNING):
            oks = store.get_into([(items[0][0], dests[0]), (items[1][0], dests[1]),
                                  (items[2][0], dests[2]), (missing, dests[3])])
        sent = int(password_srv.stats()["total_net_output_bytes"]) - sent_before
        assert oks == [False, False, True, False]
        assert dests[2].tobytes() == items[2][1]
        assert sent < 3 * (HEADER_BYTES + 1024) + 64 * 1024  # not the 8 MiB
        assert admin.exists(big) == 0 and admin.exists(short) == 0
        assert store.stats.rejected == 2 and store.stats.misses == 1
        assert any(f"more than {HEADER_BYTES + 1024} bytes" in r.getMessage()
                   for r in caplog.records)
    finally:
        store.close()
        admin.connection_pool.disconnect()


def test_closing_a_store_and_an_index_disconnects_them(password_srv: RedisServer) -> None:
    remote = RemoteTierConfig(with_password(password_srv.url, SECRET), io_threads=2,
                              max_connections=6)
    store = RemoteStore(remote, NS, 0, FP)
    index = RemoteIndex(small_config(), remote, NS)
    round_trip(store, blocks(2))
    index.status(make_offload_key(b"\x01" * 16, 0))
    assert index.wait_idle()
    assert password_srv.clients() == 2
    store.close()
    index.close()
    assert wait_for(lambda: password_srv.clients() == 0)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_credential_files_are_read_within_bounds(tmp_path: Path) -> None:
    """A password or certificate file linked to a device, or larger than any real one, is
    refused without being read whole."""
    from kvoffload.tiers.remote_config import MAX_CREDENTIAL_FILE_BYTES, check_readable_file
    link = tmp_path / "pw"
    link.symlink_to("/dev/zero")
    with pytest.raises(ConfigError, match="is a device, not a regular file"):
        check_readable_file(str(link), "remote_password_file", "the password")
    big = tmp_path / "ca.pem"
    with big.open("wb") as f:
        f.truncate(MAX_CREDENTIAL_FILE_BYTES + 1)
    with pytest.raises(ConfigError, match="is over 16,777,216 bytes"):
        check_readable_file(str(big), "remote_tls_ca_file", "the certificate authorities")
