"""The tiers' MAC key: a block in a lower tier is served only if it was written by an engine
holding the key.

The attacker of these tests can write to the Redis server and to the disk directory, and
knows the format: the namespace is in every key name and directory name, the layout
fingerprint in every stored value, and ``kvoffload.blockfile.framing`` is public. Without a
MAC key such an attacker's block is served (the limit the docs state); with one it is a
miss and is removed. Blocks MAC'd with another key, or moved under another block's name,
are misses too; genuine blocks round-trip byte for byte. The key shows up in no log line,
repr or error message, and in no name or fingerprint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.blockfile import framing
from kvoffload.blockfile.framing import HEADER_BYTES, MAC_BYTES, MAC_OFFSET, MacKey, encode_header
from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.options import ConnectorOptions
from kvoffload.tiers.config import (
    MAC_KEY_ENV,
    DiskTierConfig,
    RemoteTierConfig,
    TierConfig,
    add_cli_arguments,
    read_mac_key,
)
from kvoffload.tiers.naming import block_path, namespace, remote_key
from kvoffload.worker.block_store import BlockStore, TierUnavailable
from kvoffload.worker.tier_io import build_stores
from tiers.tier_kit import (
    RedisServer,
    baseline_hits,
    disk_tiers,
    hybrid_config,
    prompt,
    tiered_engine,
)

SECRET = b"correct-horse-battery-staple-0123456789"
"""The key of the engines under test (recognisable, to look for it in logs)."""
OTHER_SECRET = b"another-fleet's-secret-key-abcdef"
NS = "6b766f2d746573742d6e616d65737061"
FP = bytes(range(16))
PAYLOAD = bytes(range(256)) * 16  # 4 KiB blocks
BLOCK = b"\x11" * 16 + b"\x00"
TARGET = b"\x22" * 16 + b"\x00"
"""The block the attacker wants to plant (e.g. the first block of a popular prompt)."""


def write_key(path: Path, data: bytes) -> Path:
    """A key file as docs/tiers.md says to make one: only its owner may access it."""
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def tiers_for(tmp_path: Path, redis: RedisServer | None, secret: bytes | None) -> TierConfig:
    disk = DiskTierConfig(str(tmp_path / "disk"), 1 << 30, io_threads=1, fsync=False)
    remote = None if redis is None else RemoteTierConfig(redis.url, io_threads=1,
                                                         max_connections=2, timeout_s=0.5,
                                                         connect_timeout_s=0.5)
    return TierConfig(model_id="m", disk=disk, remote=remote,
                      mac_key=None if secret is None else MacKey(secret))


@pytest.fixture
def open_stores() -> Iterator[list[dict[str, BlockStore]]]:
    opened: list[dict[str, BlockStore]] = []
    yield opened
    for stores in opened:
        for store in stores.values():
            store.close()


def stores_for(opened: list[dict[str, BlockStore]], tiers: TierConfig,
               rank: int = 0) -> dict[str, BlockStore]:
    """The block stores a worker builds from ``tiers`` (``build_stores``: the key goes in
    exactly as in an engine)."""
    stores = build_stores(tiers, NS, rank, FP)
    opened.append(stores)
    return stores


def close(stores: dict[str, BlockStore]) -> None:
    for store in stores.values():
        store.close()


def put(store: BlockStore, key: bytes, payload: bytes = PAYLOAD) -> None:
    assert store.put([(key, payload)]) == [True]


def get(store: BlockStore, key: bytes, size: int = len(PAYLOAD)) -> bytes | None:
    dest = memoryview(bytearray(b"\x5a" * size))
    return bytes(dest) if store.get_into([(key, dest)]) == [True] else None


def disk_file(tiers: TierConfig, key: bytes, rank: int = 0) -> Path:
    assert tiers.disk is not None
    return Path(block_path(tiers.disk.path, NS, rank, key))


def forged_frame(fingerprint: bytes, rank: int, key: bytes, payload: bytes) -> bytes:
    """What an attacker builds with the public framing: a well-formed frame with a correct
    (unkeyed) checksum around a payload of their choice."""
    return encode_header(fingerprint, rank, key, payload) + payload


def as_file(value: bytes) -> bytes:
    """The block file holding the frame ``value`` (a remote value: header, then payload):
    the payload first, at offset 0, then the header (``kvoffload.worker.disk_frames``)."""
    return value[HEADER_BYTES:] + value[:HEADER_BYTES]


# -- the forgery ----------------------------------------------------------------------------


@pytest.mark.redis
@pytest.mark.parametrize("keyed", [False, True], ids=["no key", "with key"])
def test_a_forged_block_is_served_without_a_key_and_dropped_with_one(
        tmp_path: Path, redis_srv: RedisServer, open_stores: list, keyed: bool) -> None:
    tiers = tiers_for(tmp_path, redis_srv, SECRET if keyed else None)
    stores = stores_for(open_stores, tiers)
    put(stores["remote"], BLOCK)
    put(stores["disk"], BLOCK)

    # The attacker reads the namespace off a key name and the layout fingerprint off a
    # stored value, then plants a block of their choice under TARGET's real names.
    client = redis_srv.client()
    (name,) = client.keys(b"kvo:*")  # type: ignore[attr-defined]
    ns = name.split(b":")[1].decode()
    fingerprint = client.get(name)[8:24]  # type: ignore[attr-defined]
    assert (ns, fingerprint) == (NS, FP)
    evil = b"attacker's KV".ljust(len(PAYLOAD), b"!")
    frame = forged_frame(fingerprint, 0, TARGET, evil)
    client.set(remote_key(ns, 0, TARGET), frame)  # type: ignore[attr-defined]
    planted = disk_file(tiers, TARGET)
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(as_file(frame))

    if not keyed:
        # Today's limit, stated in docs/reliability.md: the checksum has no key, so an
        # unkeyed engine serves the forgery as KV data.
        assert get(stores["remote"], TARGET) == evil
        assert get(stores["disk"], TARGET) == evil
        return
    assert get(stores["remote"], TARGET) is None
    assert client.exists(remote_key(ns, 0, TARGET)) == 0  # type: ignore[attr-defined]
    assert get(stores["disk"], TARGET) is None
    assert not planted.exists()
    for store in stores.values():
        assert (store.stats.rejected, store.stats.reads) == (1, 0)
    # The genuine blocks are still served.
    assert get(stores["remote"], BLOCK) == PAYLOAD
    assert get(stores["disk"], BLOCK) == PAYLOAD


@pytest.mark.redis
def test_a_forged_mac_field_is_dropped_too(tmp_path: Path, redis_srv: RedisServer,
                                           open_stores: list) -> None:
    """Random bytes, or a genuine block's MAC, in the MAC field of a forgery."""
    tiers = tiers_for(tmp_path, redis_srv, SECRET)
    stores = stores_for(open_stores, tiers)
    put(stores["remote"], BLOCK)
    client = redis_srv.client()
    genuine = client.get(remote_key(NS, 0, BLOCK))  # type: ignore[attr-defined]
    genuine_mac = genuine[MAC_OFFSET:MAC_OFFSET + MAC_BYTES]
    evil = b"\x00" * len(PAYLOAD)
    for mac in (os.urandom(MAC_BYTES), genuine_mac):
        sealed = encode_header(FP, 0, TARGET, evil)
        header = sealed[:MAC_OFFSET] + mac + sealed[MAC_OFFSET + MAC_BYTES:HEADER_BYTES]
        client.set(remote_key(NS, 0, TARGET), header + evil)  # type: ignore[attr-defined]
        assert get(stores["remote"], TARGET) is None
        assert client.exists(remote_key(NS, 0, TARGET)) == 0  # type: ignore[attr-defined]


# -- other keys, other blocks ---------------------------------------------------------------


@pytest.mark.redis
def test_a_block_macd_with_another_secret_is_a_miss_and_removed(
        tmp_path: Path, redis_srv: RedisServer, open_stores: list) -> None:
    ours = tiers_for(tmp_path, redis_srv, SECRET)
    theirs = tiers_for(tmp_path, redis_srv, OTHER_SECRET)
    # Remote: another fleet (same model, another key) stores into the same server.
    our_remote = stores_for(open_stores, dataclasses.replace(ours, disk=None))["remote"]
    their_remote = build_stores(dataclasses.replace(theirs, disk=None), NS, 0, FP)
    put(their_remote["remote"], BLOCK)
    assert get(their_remote["remote"], BLOCK) == PAYLOAD  # fine for them
    close(their_remote)
    assert get(our_remote, BLOCK) is None
    assert redis_srv.client().exists(remote_key(NS, 0, BLOCK)) == 0  # type: ignore[attr-defined]
    # Disk: an engine with another key wrote the directory before this one (one engine
    # per directory at a time).
    their_disk = build_stores(dataclasses.replace(theirs, remote=None), NS, 0, FP)
    put(their_disk["disk"], BLOCK)
    close(their_disk)
    our_disk = stores_for(open_stores, dataclasses.replace(ours, remote=None))["disk"]
    assert disk_file(ours, BLOCK).exists()
    assert get(our_disk, BLOCK) is None
    assert not disk_file(ours, BLOCK).exists()
    assert our_disk.stats.rejected == 1


@pytest.mark.redis
@pytest.mark.parametrize("reframe", [False, True], ids=["copied", "re-framed"])
def test_a_genuine_block_under_another_blocks_name_is_a_miss(
        tmp_path: Path, redis_srv: RedisServer, open_stores: list, reframe: bool) -> None:
    """A genuine value copied under TARGET's name, or re-framed for TARGET (header's key
    field rewritten, checksum recomputed, genuine MAC kept): the MAC covers the key."""
    tiers = tiers_for(tmp_path, redis_srv, SECRET)
    stores = stores_for(open_stores, tiers)
    put(stores["remote"], BLOCK)
    put(stores["disk"], BLOCK)
    client = redis_srv.client()
    value = client.get(remote_key(NS, 0, BLOCK))  # type: ignore[attr-defined]
    assert as_file(value) == disk_file(tiers, BLOCK).read_bytes()
    if reframe:
        mac = value[HEADER_BYTES - MAC_BYTES:HEADER_BYTES]
        value = encode_header(FP, 0, TARGET, PAYLOAD)[:-MAC_BYTES] + mac + PAYLOAD
    client.set(remote_key(NS, 0, TARGET), value)  # type: ignore[attr-defined]
    disk_file(tiers, TARGET).parent.mkdir(parents=True, exist_ok=True)
    disk_file(tiers, TARGET).write_bytes(as_file(value))
    assert get(stores["remote"], TARGET) is None
    assert get(stores["disk"], TARGET) is None
    assert client.exists(remote_key(NS, 0, TARGET)) == 0  # type: ignore[attr-defined]
    assert not disk_file(tiers, TARGET).exists()
    assert get(stores["remote"], BLOCK) == PAYLOAD


@pytest.mark.redis
def test_a_genuine_block_of_another_rank_is_a_miss(tmp_path: Path, redis_srv: RedisServer,
                                                   open_stores: list) -> None:
    tiers = tiers_for(tmp_path, redis_srv, SECRET)
    rank0 = stores_for(open_stores, tiers)["remote"]
    rank1 = stores_for(open_stores, tiers, rank=1)["remote"]
    put(rank0, BLOCK)
    client = redis_srv.client()
    value = client.get(remote_key(NS, 0, BLOCK))  # type: ignore[attr-defined]
    mac = value[HEADER_BYTES - MAC_BYTES:HEADER_BYTES]
    client.set(remote_key(NS, 1, BLOCK),  # type: ignore[attr-defined]
               encode_header(FP, 1, BLOCK, PAYLOAD)[:-MAC_BYTES] + mac + PAYLOAD)
    assert get(rank1, BLOCK) is None


# -- genuine blocks -------------------------------------------------------------------------


@pytest.mark.redis
def test_genuine_blocks_round_trip_byte_for_byte_with_a_key(
        tmp_path: Path, redis_srv: RedisServer, open_stores: list) -> None:
    tiers = tiers_for(tmp_path, redis_srv, SECRET)
    stores = stores_for(open_stores, tiers)
    blocks = {bytes([i]) * 16 + b"\x01": os.urandom(len(PAYLOAD) + i) for i in range(8)}
    for name in ("remote", "disk"):
        store = stores[name]
        assert store.put(list(blocks.items())) == [True] * len(blocks)
        for key, payload in blocks.items():
            assert get(store, key, len(payload)) == payload, name
        assert (store.stats.reads, store.stats.rejected) == (len(blocks), 0)
    key, payload = next(iter(blocks.items()))
    value = redis_srv.client().get(remote_key(NS, 0, key))  # type: ignore[attr-defined]
    assert len(value) == HEADER_BYTES + len(payload) and value[HEADER_BYTES:] == payload
    assert value[HEADER_BYTES - MAC_BYTES:HEADER_BYTES] != bytes(MAC_BYTES)
    assert disk_file(tiers, key).read_bytes() == as_file(value)


def test_an_engine_with_a_key_hits_its_own_disk_blocks(tmp_path: Path) -> None:
    """End to end: the key goes from ``TierConfig`` through the worker ranks' tier I/O; an
    engine with a key hits what it stored as an engine without one would, and a restarted
    engine with another key hits nothing."""
    config = hybrid_config(host_slots=24)
    query = [*prompt(1, 40), 1, 2, 3]
    perfect = baseline_hits(config, [prompt(1, 40), query])[1]
    keyed = TierConfig(model_id="test-model", disk=disk_tiers(tmp_path / "d").disk,
                       mac_key=MacKey(SECRET))
    with tiered_engine(config, keyed) as engine:
        engine.run([prompt(1, 40)])
        engine.run([prompt(s, 40) for s in range(2, 6)])  # push prompt 1 to the disk
        assert engine.run([query]) == perfect > 0
    other = TierConfig(model_id="test-model", disk=keyed.disk, mac_key=MacKey(OTHER_SECRET))
    with tiered_engine(config, other) as engine:
        assert engine.run([query]) == 0
    assert namespace(config, keyed) == namespace(config, other)


# -- the key stays secret -------------------------------------------------------------------


def secret_forms(secret: bytes) -> list[str]:
    return [secret.decode("latin-1"), secret.hex(), repr(secret), secret[:12].decode("latin-1")]


def assert_hidden(text: str) -> None:
    for form in secret_forms(SECRET):
        assert form not in text


@pytest.mark.redis
def test_the_key_never_appears_in_logs_reprs_or_errors(
        tmp_path: Path, redis_srv: RedisServer, open_stores: list,
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    key_file = write_key(tmp_path / "key", SECRET + b"\n")
    tiers = TierConfig.from_options({"model_id": "m", "disk_path": str(tmp_path / "disk"),
                                     "disk_capacity": "1GiB", "remote_url": redis_srv.url,
                                     "remote_timeout_s": "0.3",
                                     "tier_mac_key_file": str(key_file)}, environ={})
    assert tiers.mac_key == MacKey(SECRET)
    stores = stores_for(open_stores, tiers)
    # Stores, loads, a forged block, a block of another key, a damaged one, a dead server.
    client = redis_srv.client()
    for name, store in stores.items():
        put(store, BLOCK)
        assert get(store, BLOCK) == PAYLOAD
        assert get(store, TARGET) is None  # a plain miss
        if name == "remote":
            client.set(remote_key(NS, 0, TARGET),  # type: ignore[attr-defined]
                       forged_frame(FP, 0, TARGET, PAYLOAD))
        else:
            disk_file(tiers, TARGET).parent.mkdir(parents=True, exist_ok=True)
            disk_file(tiers, TARGET).write_bytes(as_file(forged_frame(FP, 0, TARGET, PAYLOAD)))
        assert get(store, TARGET) is None
    theirs = build_stores(TierConfig(remote=tiers.remote, mac_key=MacKey(OTHER_SECRET)),
                          NS, 0, FP)
    put(theirs["remote"], TARGET)
    close(theirs)
    assert get(stores["remote"], TARGET) is None
    redis_srv.kill()
    with pytest.raises(TierUnavailable) as down:
        stores["remote"].put([(BLOCK, PAYLOAD)])
    assert_hidden(str(down.value))
    assert "dropped block" in caplog.text and "MAC" in caplog.text  # the paths ran
    assert_hidden(caplog.text)
    for thing in (tiers, tiers.mac_key, stores["disk"], stores["remote"]):
        assert_hidden(repr(thing))
        assert_hidden(str(thing))
    assert repr(tiers.mac_key) == "MacKey(<secret>)"
    assert "mac_key=MacKey(<secret>)" in repr(tiers)
    # The option dump a connector logs names the file, not the key.
    opts = ConnectorOptions.from_extra_config({
        "host_memory_bytes": "1GiB", "tiers": ["host", "disk"],
        "disk_path": str(tmp_path / "d2"), "disk_capacity": "1GiB",
        "tier_mac_key_file": str(key_file)})
    assert opts.tier_config.mac_key == MacKey(SECRET)
    assert_hidden(repr(opts))


def test_the_key_is_in_no_name_or_fingerprint(tmp_path: Path) -> None:
    config = hybrid_config(host_slots=24)
    plain = disk_tiers(tmp_path / "d")
    keyed = TierConfig(model_id=plain.model_id, disk=plain.disk, mac_key=MacKey(SECRET))
    assert namespace(config, keyed) == namespace(config, plain)  # names take no key at all
    header = encode_header(FP, 0, BLOCK, PAYLOAD, mac_key=MacKey(SECRET))
    plain_header = encode_header(FP, 0, BLOCK, PAYLOAD)
    assert header[:-MAC_BYTES] == plain_header[:-MAC_BYTES]  # the key changes the MAC only
    assert header[-MAC_BYTES:] != plain_header[-MAC_BYTES:]


def test_the_key_survives_pickling_and_compares_by_value() -> None:
    key = MacKey(SECRET)
    assert pickle.loads(pickle.dumps(key)) == key  # workers may get the config pickled
    assert key == MacKey(bytearray(SECRET)) and key != MacKey(OTHER_SECRET)
    assert hash(key) == hash(MacKey(OTHER_SECRET))  # nothing of the secret in the hash
    assert key != SECRET


# -- framing --------------------------------------------------------------------------------


def test_framing_with_a_key() -> None:
    key = MacKey(SECRET)
    header = encode_header(FP, 0, BLOCK, PAYLOAD, mac_key=key)
    assert len(header) == HEADER_BYTES == 128  # 64-byte aligned payload (format 3)
    assert framing.check(header, PAYLOAD, FP, 0, BLOCK, mac_key=key) is None
    assert framing.check(header, PAYLOAD, FP, 0, BLOCK) is None  # no key: checksum only
    flipped = bytearray(PAYLOAD)
    flipped[1000] ^= 1
    assert "checksum" in str(framing.check(header, flipped, FP, 0, BLOCK, mac_key=key))
    plain = encode_header(FP, 0, BLOCK, PAYLOAD)
    assert plain[-MAC_BYTES:] == bytes(MAC_BYTES)
    assert "no MAC" in str(framing.check(plain, PAYLOAD, FP, 0, BLOCK, mac_key=key))
    assert "MAC mismatch" in str(framing.check(header, PAYLOAD, FP, 0, BLOCK,
                                               mac_key=MacKey(OTHER_SECRET)))
    # Streamed like the disk store reads: piece by piece.
    verify = framing.PayloadCheck(header, mac_key=key)
    for start in range(0, len(PAYLOAD), 1000):
        verify.update(PAYLOAD[start:start + 1000])
    assert verify.problem() is None
    # A secret over BLAKE2b's 64-byte key limit is hashed down; still a key of its own.
    long = MacKey(SECRET * 3)
    assert long != key
    long_header = encode_header(FP, 0, BLOCK, PAYLOAD, mac_key=long)
    assert framing.check(long_header, PAYLOAD, FP, 0, BLOCK, mac_key=long) is None
    assert framing.check(long_header, PAYLOAD, FP, 0, BLOCK, mac_key=key) is not None
    with pytest.raises(ValueError, match="at least 16 bytes, got 15") as short:
        MacKey(SECRET[:15])
    assert SECRET[:15].decode() not in str(short.value)


# -- configuration --------------------------------------------------------------------------


def test_the_key_comes_from_a_file_or_the_environment(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # as `openssl rand -hex 32 > key; chmod 600 key` leaves it
    key_file = write_key(tmp_path / "key", SECRET + b"\n")
    assert read_mac_key(str(key_file), {}) == MacKey(SECRET)
    assert read_mac_key(None, {MAC_KEY_ENV: SECRET.decode()}) == MacKey(SECRET)
    assert read_mac_key(None, {}) is None
    assert TierConfig.from_options({}, environ={}).mac_key is None
    monkeypatch.setenv(MAC_KEY_ENV, SECRET.decode())
    assert TierConfig.from_options({}).mac_key == MacKey(SECRET)  # the process environment
    monkeypatch.delenv(MAC_KEY_ENV)
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--tier-mac-key-file", str(key_file)])
    assert TierConfig.from_cli_args(args).mac_key == MacKey(SECRET)


def config_error(options: dict[str, object], environ: dict[str, str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        TierConfig.from_options(options, environ=environ)
    assert_hidden(str(info.value))
    return info.value


def test_bad_keys_are_config_errors_that_say_what_to_do(tmp_path: Path) -> None:
    missing = config_error({"tier_mac_key_file": str(tmp_path / "nope")}, {})
    assert missing.field == "tier_mac_key_file" and "cannot open" in missing.problem
    assert "openssl rand" in missing.fix
    short = write_key(tmp_path / "short", SECRET[:15] + b"\n")
    too_short = config_error({"tier_mac_key_file": str(short)}, {})
    assert "15 bytes of key, fewer than 16" in too_short.problem
    assert SECRET[:15].decode() not in str(too_short)
    assert "openssl rand -hex 32 >" in too_short.fix
    empty = write_key(tmp_path / "empty", b"\n")
    assert "0 bytes" in config_error({"tier_mac_key_file": str(empty)}, {}).problem
    assert "not a regular file" in config_error({"tier_mac_key_file": str(tmp_path)},
                                                {}).problem
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert "not a regular file" in config_error({"tier_mac_key_file": str(fifo)},
                                                {}).problem  # without waiting for a writer
    big = write_key(tmp_path / "big", b"k" * 5000)
    assert "too big" in config_error({"tier_mac_key_file": str(big)}, {}).problem
    assert config_error({"tier_mac_key_file": ""}, {}).field == "tier_mac_key_file"
    assert config_error({"tier_mac_key_file": 7}, {}).field == "tier_mac_key_file"
    env_short = config_error({}, {MAC_KEY_ENV: SECRET[:9].decode()})
    assert env_short.field == MAC_KEY_ENV and "9 bytes" in env_short.problem
    assert config_error({}, {MAC_KEY_ENV: ""}).field == MAC_KEY_ENV  # fails closed
    key_file = write_key(tmp_path / "key", SECRET)
    both = config_error({"tier_mac_key_file": str(key_file)}, {MAC_KEY_ENV: SECRET.decode()})
    assert MAC_KEY_ENV in both.problem


def test_the_connector_takes_the_key_file_and_no_literal_key(tmp_path: Path) -> None:
    base = {"host_memory_bytes": "1GiB"}
    with pytest.raises(ConfigError) as info:
        ConnectorOptions.from_extra_config({**base, "tier_mac_key_file": str(tmp_path / "x")})
    assert info.value.field == "kv_connector_extra_config.tier_mac_key_file"
    for literal in ("tier_mac_key", "mac_key"):
        with pytest.raises(ConfigError) as info:
            ConnectorOptions.from_extra_config({**base, literal: SECRET.decode()})
        assert "is not a kvoffload option" in str(info.value)
        assert_hidden(str(info.value))


# -- hostile key files and paths (issue 40) -------------------------------------------------


@pytest.mark.parametrize(("mode", "needle"), [
    (0o644, "chmod 600"),  # what `openssl rand -hex 32 > FILE` leaves under umask 022
    (0o640, "chmod 600"),  # readable by the group
    (0o604, "chmod 600"),  # readable by others only
    (0o620, "chmod 600"),  # writable by the group: anyone there could set a key they know
    (0o602, "chmod 600"),  # writable by others
    (0o600, None),
    (0o400, None),
])
def test_a_key_file_other_users_may_access_is_refused(tmp_path: Path, mode: int,
                                                       needle: str | None) -> None:
    key_file = write_key(tmp_path / "key", SECRET + b"\n")
    key_file.chmod(mode)
    if needle is None:
        assert read_mac_key(str(key_file), {}) == MacKey(SECRET)
        return
    error = config_error({"tier_mac_key_file": str(key_file)}, {})
    assert error.field == "tier_mac_key_file"
    assert f"{needle} {key_file}" in error.fix and f"{mode:04o}" in error.problem


@pytest.mark.parametrize(("options", "field"), [
    ({"tier_mac_key_file": "/etc/kvoffload/tier\0.key"}, "tier_mac_key_file"),
    ({"tier_mac_key_file": "\0"}, "tier_mac_key_file"),
    ({"disk_path": "/var/cache/kv\0offload", "disk_capacity": "1GiB"}, "disk_path"),
    ({"disk_path": "\0", "disk_capacity": "1GiB"}, "disk_path"),
    ({"remote_url": "redis://cache:6379/0", "remote_password_file": "/run/pw\0"},
     "remote_password_file"),
    ({"remote_url": "rediss://cache:6380/0", "remote_tls_ca_file": "/ca\0.pem"},
     "remote_tls_ca_file"),
])
def test_a_nul_byte_in_a_path_option_is_a_config_error(options: dict[str, object],
                                                        field: str) -> None:
    error = config_error(options, {})
    assert error.field == field
    assert "NUL byte" in str(error) or "null byte" in str(error)
    with pytest.raises(ConfigError) as info:  # the connector names its own key
        ConnectorOptions.from_extra_config({"host_memory_bytes": "1GiB", "tiers": [
            "host", *(["disk"] if "disk_path" in options else []),
            *(["remote"] if "remote_url" in options else [])], **options})
    assert info.value.field == f"kv_connector_extra_config.{field}"


def simulate_disk_hits(disk: Path, capsys: pytest.CaptureFixture[str],
                       *extra: str) -> float:
    """One ``kvoffload simulate`` on a real disk tier; the share of prompt tokens the disk
    tier served."""
    from kvoffload.cli import main

    status = main(["simulate", "--host-capacity", "64MiB", "--disk-capacity", "1GiB",
                   "--disk-path", str(disk), "--limit", "12", "--no-baseline", "--json",
                   "--quiet", *extra])
    out, err = capsys.readouterr()
    assert status == 0, err
    report = json.loads(out)
    assert report["offload"]["wrong_bytes"] == 0
    assert report["config"]["mac_key"] is True  # a key is used; never shown
    assert_hidden(out + err)
    return float(report["offload"]["tier_hit_rates"].get("disk", 0.0))


def test_simulate_macs_its_real_tiers_like_the_connector(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 40: `simulate --disk-path` ignored KVOFFLOAD_TIER_MAC_KEY, and
    # --tier-mac-key-file (docs/tiers.md) was no option of any subcommand.
    disk = tmp_path / "disk"
    monkeypatch.setenv(MAC_KEY_ENV, SECRET.decode())
    simulate_disk_hits(disk, capsys)
    assert simulate_disk_hits(disk, capsys) > 0  # a restart hits its own blocks
    monkeypatch.delenv(MAC_KEY_ENV)
    other = write_key(tmp_path / "other.key", OTHER_SECRET)
    assert simulate_disk_hits(disk, capsys, "--tier-mac-key-file", str(other)) == 0
