"""Hostile ``remote_url`` values: passwords that hold the URL's own separators, query
parameters that would weaken TLS or override a documented option, numbers that are not.

Stories: a password with ``@``, ``:``, ``%`` or non-ASCII letters works and is never shown,
in part, in a repr, a ``str``, the start-up check's warning, the index's "unreachable"
warning, a worker's error or any DEBUG line; one with an unescaped ``/``, ``?``, ``#``, a
control character or a character that Unicode normalisation turns into a separator is
refused at start with a message that shows none of it; every query parameter but
``?db=N`` is refused naming the parameter and the option to use instead, from Python,
string options and the command line; the URL is split exactly as redis-py splits it
(Hypothesis, any password).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from urllib.parse import unquote

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.blockfile.framing import FINGERPRINT_BYTES
from kvoffload.cli import main
from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import make_offload_key
from kvoffload.tiers.config import (
    RemoteTierConfig,
    TierConfig,
    check_remote_url,
    masked_url,
    url_without_credentials,
)
from kvoffload.tiers.remote import RemoteIndex, check_credentials
from kvoffload.worker.block_store import TierUnavailable
from kvoffload.worker.remote_store import RemoteStore
from tiers.tier_kit import RedisServer

redis_connection = pytest.importorskip("redis.connection")

PIECES = ("SEKRIT", "HUSH", "ZQXJ", "SËKRIT", "HÜSH")
"""Fragments of the passwords below; none may ever be shown."""

ACCEPTED_PASSWORDS = ["SEKRIT@HUSH", "SEKRIT:HUSH", "SEKRIT%HUSH", "SËKRIT@HÜSH",
                      "@SEKRIT@HUSH@", "SEKRIT%2FHUSH%3F", "SEKRIT%40HUSH", "SEKRIT:@:HUSH"]
REFUSED_PASSWORDS = ["SEKRIT/HUSH", "SEKRIT?HUSH", "SEKRIT#HUSH", "SEKRIT@HUSH/ZQXJ",
                     "SEKRIT／HUSH", "SEKRIT\nHUSH", "SEKRIT\tHUSH", "SEKRIT@HUSH?ZQXJ@x",
                     "SEKRIT#HUSH@ZQXJ/x"]
FP = bytes(range(FINGERPRINT_BYTES))


@pytest.fixture(scope="module")
def closed_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]  # bound, never listening: connections are refused


def url_forms(password: str, port: int) -> list[str]:
    return [f"redis://kv:{password}@127.0.0.1:{port}/0",
            f"redis://:{password}@127.0.0.1:{port}",
            f"rediss://kv:{password}@127.0.0.1:{port}/1",
            f"unix://:{password}@/nonexistent/redis.sock?db=2"]


def assert_hidden(*texts: str) -> None:
    for text in texts:
        for piece in PIECES:
            assert piece not in text, f"{piece!r} shown in {text!r}"


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "")
            for r in caplog.records]


def small_config() -> OffloadConfig:
    return OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 4, page_bytes=8),),
                         hash_block_size=4, host_capacity_bytes=64, num_workers=1,
                         eviction_policy="lru")


@pytest.mark.parametrize("password", ACCEPTED_PASSWORDS)
def test_an_accepted_password_is_used_and_never_shown(
        password: str, closed_port: int, caplog: pytest.LogCaptureFixture) -> None:
    for url in url_forms(password, closed_port):
        remote = RemoteTierConfig(url, timeout_s=0.3, connect_timeout_s=0.3)
        assert remote.credentials()[1] == unquote(password)
        assert redis_connection.parse_url(url)["password"] == unquote(password)
        tiers = TierConfig(remote=remote)
        assert_hidden(repr(remote), str(remote), repr(tiers), str(tiers), remote.shown_url,
                      masked_url(url), url_without_credentials(url))
        if url.startswith("rediss"):
            continue  # no TLS handshake against a closed port needed
        with caplog.at_level(logging.DEBUG):
            check_credentials(remote)  # unreachable: passes with a warning
            index = RemoteIndex(small_config(), remote, "ns")
            index.status(make_offload_key(b"k" * 16, 0))
            assert index.wait_idle(5.0) and index.is_down
            index.close()
            store = RemoteStore(remote, "ns", 0, FP)
            with pytest.raises(TierUnavailable) as info:
                store.put([(make_offload_key(b"b" * 16, 0), os.urandom(64))])
            store.close()
        assert_hidden(str(info.value), *logged(caplog))
        assert any("unreachable" in line for line in logged(caplog))


@pytest.mark.parametrize("password", REFUSED_PASSWORDS)
def test_a_password_the_parser_would_cut_elsewhere_is_refused_unshown(
        password: str, closed_port: int, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    for url in url_forms(password, closed_port):
        assert_hidden(masked_url(url))
        with pytest.raises(ConfigError) as info:
            RemoteTierConfig(url)
        assert info.value.field == "remote_url"
        with pytest.raises(ConfigError) as from_options:
            TierConfig.from_options({"remote_url": url})
        assert_hidden(str(info.value), str(from_options.value))
        with caplog.at_level(logging.DEBUG):
            status = main(["simulate", "--limit", "3", "--no-baseline", "--remote-url", url])
        out, err = capsys.readouterr()
        assert status == 2 and err.startswith("error: --remote-url: "), err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert_hidden(out, err, *logged(caplog))


# -- query parameters ---------------------------------------------------------------------

QUERIES = [
    ("ssl_cert_reqs=none", "ssl_cert_reqs", "always verified"),
    ("ssl_check_hostname=false", "ssl_check_hostname", "always verified"),
    ("ssl_validate_ocsp=false", "ssl_validate_ocsp", "always verified"),
    ("ssl_min_version=2", "ssl_min_version", "always verified"),
    ("ssl_ca_certs=/tmp/ca.pem", "ssl_ca_certs", "remote_tls_ca_file"),
    ("ssl_ca_path=/tmp", "ssl_ca_path", "remote_tls_ca_file"),
    ("ssl_certfile=/tmp/c.pem", "ssl_certfile", "remote_tls_cert_file"),
    ("ssl_keyfile=/tmp/k.pem", "ssl_keyfile", "remote_tls_key_file"),
    ("socket_timeout=8", "socket_timeout", "remote_timeout_s"),
    ("socket_timeout=nan", "socket_timeout", "remote_timeout_s"),
    ("timeout=5", "timeout", "remote_timeout_s"),
    ("socket_connect_timeout=9", "socket_connect_timeout", "remote_connect_timeout_s"),
    ("max_connections=1", "max_connections", "remote_max_connections"),
    ("password=SEKRIT", "password", "remote_password_file"),
    ("username=kv", "username", "remote_username"),
    ("retry_on_timeout=true", "retry_on_timeout", "remote_retry_interval_s"),
    ("health_check_interval=abc", "health_check_interval", "remote_"),
    ("health_check_interval=5", "health_check_interval", "remote_"),
    ("protocol=3", "protocol", "remote_"),
    ("client_name=x", "client_name", "remote_"),
    ("SSL_CERT_REQS=none", "SSL_CERT_REQS", "remote_"),
    ("db=notanumber", "db", "?db=N"),
    ("db=-1", "db", "?db=N"),
    ("db=1e3", "db", "?db=N"),
    ("db=٣", "db", "?db=N"),
    ("db=", "db", "?db=N"),
    ("db=99999999999", "db", "?db=N"),
    ("db=1&db=2", "twice", "once"),
]


@pytest.mark.parametrize(("query", "name", "fix"), QUERIES)
def test_query_parameters_other_than_db_are_refused_naming_the_option(
        query: str, name: str, fix: str, capsys: pytest.CaptureFixture[str]) -> None:
    url = f"rediss://kv:SEKRIT@127.0.0.1:1?{query}"
    for make in (RemoteTierConfig, lambda u: TierConfig.from_options({"remote_url": u})):
        with pytest.raises(ConfigError) as info:
            make(url)
        assert info.value.field == "remote_url"
        assert name in str(info.value) and fix in str(info.value), str(info.value)
        assert_hidden(str(info.value))
    assert main(["simulate", "--limit", "3", "--no-baseline", "--remote-url", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --remote-url: ") and name in err and "Traceback" not in err
    assert_hidden(err)


@pytest.mark.parametrize(("url", "needle"), [
    ("redis://cache:6379/abc", "not a number"),
    ("redis://cache:6379/-1", "not a number"),
    ("redis://cache:6379/0/1", "not a number"),
    ("redis://cache:6379/" + "9" * 5000, "not a number"),
    ("redis://cache:6379/0?db=1", "both in its path"),
    ("redis://cache:port/0", "port"),
    ("redis://cache:99999/0", "port"),
    ("redis://[::1/0", "cannot be read"),
    ("redis://cache:6379/0#frag", "fragment"),
    ("redis://cache:6379/0\r\nINFO", "control character"),
    ("redis://cache:6379/0?" + "x" * 1_000_000 + "=1", "not accepted"),
    ("redis://" + "h" * 1_000_000 + ":x/0", "port"),
])
def test_paths_ports_and_fragments_redis_py_would_misread_are_refused(
        url: str, needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_remote_url(url)
    assert needle in str(info.value) and len(str(info.value)) < 600


@pytest.mark.parametrize("url", [
    "redis://cache:6379/0", "redis://cache:6379", "redis://cache:6379/", "redis://cache/15",
    "redis://cache:6379?db=3", "unix:///run/redis.sock?db=2", "unix:///run/redis.sock",
    "rediss://kv:p%2Fw@cache:6380/0", "REDIS://cache:6379/0",
])
def test_plain_urls_and_db_numbers_are_accepted(url: str) -> None:
    RemoteTierConfig(url)


@pytest.mark.redis
def test_db_in_the_query_selects_that_database(redis_srv: RedisServer) -> None:
    port = redis_srv.url.rsplit(":", 1)[1].split("/")[0]
    store = RemoteStore(RemoteTierConfig(f"redis://127.0.0.1:{port}?db=3"), "ns", 0, FP)
    key = make_offload_key(b"q" * 16, 0)
    try:
        assert store.put([(key, os.urandom(64))]) == [True]
    finally:
        store.close()
    import redis

    client = redis.Redis(host="127.0.0.1", port=int(port), db=3)
    try:
        assert len(client.keys(b"*")) == 1
    finally:
        client.close()


# -- fuzzing: any password is split as redis-py splits it, and never shown ----------------

@settings(max_examples=400, deadline=None)
@given(st.text(max_size=24), st.sampled_from(["redis://kv:", "redis://:", "rediss://u:"]))
def test_any_password_is_read_as_redis_py_reads_it_and_never_shown(
        text: str, prefix: str) -> None:
    password = "ZQXJ" + text
    url = f"{prefix}{password}@cache:6379/0"
    try:
        remote = RemoteTierConfig(url)
    except ConfigError as exc:
        assert exc.field == "remote_url"
        assert "ZQXJ" not in str(exc)
        return
    assert "ZQXJ" not in repr(remote) and "ZQXJ" not in remote.shown_url
    parsed = redis_connection.parse_url(url)
    assert remote.credentials()[1] == parsed.get("password")
    assert parsed.get("host") == "cache" and parsed.get("db") == 0
    bare = redis_connection.parse_url(url_without_credentials(url))
    assert "password" not in bare and "username" not in bare


_NO_MARK = st.text(alphabet=st.characters(blacklist_characters="Z"), max_size=16)


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(["redis://", "rediss://", "unix://", "", "http://"]), _NO_MARK,
       st.text(max_size=16), _NO_MARK, st.booleans())
def test_masking_hides_a_password_in_any_string(scheme: str, user: str, text: str,
                                                rest: str, in_query: bool) -> None:
    """Checked or not, accepted or not: the password part of any string never shows
    (``ZQXJ`` marks its start; the other parts cannot hold a ``Z``)."""
    if in_query:
        url = f"{scheme}{user}@host/0?password=ZQXJ{text}"
    else:
        url = f"{scheme}{user}:ZQXJ{text}@{rest}"
    assert "ZQXJ" not in masked_url(url)
    try:
        check_remote_url(url)
    except ConfigError as exc:
        assert "ZQXJ" not in str(exc)
