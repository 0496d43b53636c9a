"""Tier configuration from Python, string options and the command line; the namespace
fingerprint; block framing; and the core tier modules importing without torch."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from core.test_core_imports import run_blocked
from kvoffload.blockfile import framing
from kvoffload.config import GroupKind, GroupSpec, OffloadConfig
from kvoffload.errors import ConfigError
from kvoffload.keys import make_offload_key
from kvoffload.sizes import parse_size
from kvoffload.tiers.config import (
    OPTION_HELP,
    DiskTierConfig,
    RemoteTierConfig,
    TierConfig,
    WriteMode,
    add_cli_arguments,
)
from kvoffload.tiers.naming import block_path, key_of_file_name, namespace, remote_key


def config(**changes: object) -> OffloadConfig:
    base = OffloadConfig(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, page_bytes=64),
                                 GroupSpec(GroupKind.MAMBA, 16, page_bytes=256)),
                         hash_block_size=16, host_capacity_bytes=1 << 20, eviction_policy="lru")
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


# -- configuration --------------------------------------------------------------------------


def test_string_options_build_both_tiers_with_defaults_and_overrides() -> None:
    tiers = TierConfig.from_options({
        "model_id": "llama-3-8b@main", "disk_path": "/nvme/kv", "disk_capacity": "64GiB",
        "disk_fsync": "false", "remote_url": "redis://cache:6379/1",
        "remote_timeout_s": "0.25", "remote_io_threads": "8", "remote_max_connections": "12",
        "tier_order": "remote, disk"})
    assert tiers.disk == DiskTierConfig("/nvme/kv", 64 << 30, fsync=False)
    assert tiers.remote is not None
    assert tiers.remote.url == "redis://cache:6379/1"
    assert tiers.remote.timeout_s == 0.25 and tiers.remote.io_threads == 8
    assert tiers.remote.write_mode is WriteMode.WRITE_THROUGH
    assert tiers.enabled == ("remote", "disk")
    assert TierConfig.from_options({}).enabled == ()


@pytest.mark.parametrize(("options", "field"), [
    ({"disk_path": "/x"}, "disk_capacity"),
    ({"disk_capacity": "1GiB"}, "disk_path"),
    ({"remote_timeout_s": "1"}, "remote_url"),
    ({"disk_path": "/x", "disk_capacity": "lots"}, "disk_capacity"),
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_write_mode": "sometimes"},
     "disk_write_mode"),
    ({"remote_url": "redis://h", "remote_io_threads": "20"}, "remote_max_connections"),
    ({"tier_order": "disk,tape"}, "tier_order"),
    ({"dsk_path": "/x"}, "dsk_path"),
    ({"remote_url": "redis://h", "remote_cluster": "maybe"}, "remote_cluster"),
    ({"remote_url": "unix:///run/redis.sock", "remote_cluster": "true"}, "remote_cluster"),
    # Issue 40: refused when the options are read, not when the tier is built.
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_eviction_policy": "nope"},
     "disk_eviction_policy"),
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_eviction_policy": "oracle"},
     "disk_eviction_policy"),
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_eviction_policy": 5},
     "disk_eviction_policy"),
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_eviction_policy": "x" * 100_000},
     "disk_eviction_policy"),
    # Digits other than ASCII are refused by count options as by sizes (issue 40).
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_io_threads": "\u0663"},
     "disk_io_threads"),
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_io_threads": "\u00b3"},
     "disk_io_threads"),
    ({"remote_url": "redis://h", "remote_batch_blocks": "\uff11\uff16"}, "remote_batch_blocks"),
    ({"remote_url": "redis://h", "remote_timeout_s": "\u0661"}, "remote_timeout_s"),
    ({"remote_url": "redis://h", "remote_io_threads": "9" * 100_000}, "remote_io_threads"),
    ({"remote_url": "redis://h", "remote_cluster": "y" * 100_000}, "remote_cluster"),
    ({"disk_path": "/x", "disk_capacity": "1GiB", "disk_write_mode": "w" * 100_000},
     "disk_write_mode"),
    ({"tier_order": "disk," * 50_000}, "tier_order"),
])
def test_bad_options_name_the_option_to_fix(options: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        TierConfig.from_options(options)
    assert err.value.field == field
    assert len(str(err.value)) < 1000  # a huge value is named, never echoed whole


def test_the_disk_eviction_policy_is_checked_with_the_config() -> None:
    with pytest.raises(ConfigError) as err:
        DiskTierConfig("/x", 1 << 30, eviction_policy="nope")
    assert err.value.field == "disk_eviction_policy" and "'lru'" in err.value.fix
    assert DiskTierConfig("/x", 1 << 30, eviction_policy="arc").eviction_policy == "arc"


def test_command_line_flags_round_trip() -> None:
    parser = argparse.ArgumentParser()
    add_cli_arguments(parser)
    args = parser.parse_args(["--disk-path", "/tmp/kv", "--disk-capacity", "500MB",
                              "--disk-write-mode", "write-through",
                              "--remote-url", "redis://127.0.0.1:7000/0",
                              "--tier-model-id", "m1"])
    tiers = TierConfig.from_cli_args(args)
    assert tiers.model_id == "m1"
    assert tiers.disk == DiskTierConfig("/tmp/kv", 500_000_000, WriteMode.WRITE_THROUGH)
    assert tiers.remote == RemoteTierConfig("redis://127.0.0.1:7000/0")
    assert len(OPTION_HELP) == len([a for a in parser._actions if a.dest.startswith("tier_")])


@pytest.mark.parametrize(("value", "cluster"), [("true", True), ("yes", True), (True, True),
                                              ("false", False), ("0", False)])
def test_cluster_mode_is_an_option(value: object, cluster: bool) -> None:
    tiers = TierConfig.from_options({"remote_url": "redis://10.0.0.5:7000",
                                     "remote_cluster": value})
    assert tiers.remote is not None and tiers.remote.cluster is cluster
    assert not TierConfig.from_options({"remote_url": "redis://h"}).remote.cluster  # type: ignore[union-attr]


def test_sizes_parse_with_units() -> None:
    assert parse_size("4096", "x") == 4096
    assert parse_size("1.5 KiB", "x") == 1536
    assert parse_size("2G", "x") == 2 * 10**9
    assert parse_size(7, "x") == 7


# -- namespace and names --------------------------------------------------------------------


def test_namespace_separates_models_layouts_and_key_schemes() -> None:
    tiers = TierConfig(model_id="m")
    base = namespace(config(), tiers)
    assert base == namespace(config(), TierConfig(model_id="m"))  # stable across processes
    others = {
        namespace(config(), TierConfig(model_id="m2")),
        namespace(config(), TierConfig(model_id="m", key_scheme="sha256:x")),
        namespace(config(num_workers=2), tiers),
        namespace(config(block_size_factor=2), tiers),
        namespace(config(groups=(GroupSpec(GroupKind.FULL_ATTENTION, 16, page_bytes=128),
                                 GroupSpec(GroupKind.MAMBA, 16, page_bytes=256))), tiers),
    }
    assert base not in others and len(others) == 5
    # Host capacity and eviction policy do not change a block's bytes: still shared.
    assert base == namespace(config(host_capacity_bytes=1 << 30, eviction_policy="arc"), tiers)


def test_block_names_round_trip() -> None:
    key = make_offload_key(b"\x01" * 16, 3)  # type: ignore[arg-type]
    path = block_path("/root", "ns", 1, key)
    assert path == f"/root/ns/rank1/01/{key.hex()}.kvb"
    assert key_of_file_name(path.rsplit("/", 1)[1]) == key
    assert key_of_file_name(f"{key.hex()}.kvb.12.34.tmp") is None
    assert remote_key("ns", 1, key) == b"kvo:ns:{" + key.hex().encode() + b"}:1"


# -- framing --------------------------------------------------------------------------------


FP = b"F" * framing.FINGERPRINT_BYTES
KEY = make_offload_key(b"\x07" * 16, 1)  # type: ignore[arg-type]


def test_a_framed_block_checks_out_and_every_kind_of_damage_is_named() -> None:
    payload = bytes(range(256)) * 4
    header = framing.encode_header(FP, 0, KEY, payload)
    assert len(header) == framing.HEADER_BYTES
    assert framing.check(header, payload, FP, 0, KEY) is None

    flipped = bytearray(payload)
    flipped[500] ^= 1
    assert "checksum" in str(framing.check(header, flipped, FP, 0, KEY))
    bad_header = bytearray(header)
    bad_header[80] ^= 1  # inside the key padding: the checksum catches it
    assert framing.check(bad_header, payload, FP, 0, KEY) is not None
    assert "foreign" in str(framing.check(header, payload, b"G" * 16, 0, KEY))
    assert "rank" in str(framing.check(header, payload, FP, 1, KEY))
    other = make_offload_key(b"\x08" * 16, 1)  # type: ignore[arg-type]
    assert "another key" in str(framing.check(header, payload, FP, 0, other))
    assert "payload of" in str(framing.check(header, payload[:-1], FP, 0, KEY))
    assert "magic" in str(framing.check(b"X" + header[1:], payload, FP, 0, KEY))


# -- no torch in the core -------------------------------------------------------------------


def test_scheduler_side_tier_modules_import_without_torch() -> None:
    modules = ["kvoffload.tiers.cascade", "kvoffload.tiers.disk", "kvoffload.tiers.remote",
               "kvoffload.offload", "kvoffload.blockfile.framing", "kvoffload.tiers.config"]
    result = run_blocked(modules)
    assert result["blocker_works"] is True
    assert result["errors"] == {}
    assert result["loaded"] == []
