"""Hostile ``kv_connector_extra_config`` values: each ends in a ``ConfigError`` naming the
key that is wrong (no vLLM needed); arbitrary JSON-like dicts never raise anything else."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.options import TIER_OPTIONS, ConnectorOptions

P = "kv_connector_extra_config"
DISK = {"host_memory_bytes": "1GiB", "tiers": ["host", "disk"], "disk_path": "/nvme/kv",
        "disk_capacity": "64GiB"}
REMOTE = {"host_memory_bytes": "1GiB", "tiers": ["host", "remote"],
          "remote_url": "redis://cache:6379/0"}


@pytest.mark.parametrize(("extra", "key", "needle"), [
    ({"host_memory_bytes": "16G"}, None, None),
    ({"host_memory_bytes": "16Gi"}, None, None),
    ({"host_memory_bytes": "1e9"}, "host_memory_bytes", "not a size"),
    ({"host_memory_bytes": 1e9}, "host_memory_bytes", "not a size"),
    ({"host_memory_bytes": "-1GiB"}, "host_memory_bytes", "not a size"),
    ({"host_memory_bytes": 2**61}, "host_memory_bytes", "largest size"),
    ({**DISK, "disk_path": ""}, "disk_path", "is empty"),
    ({**DISK, "disk_path": "   "}, "disk_path", "is empty"),
    ({**DISK, "disk_capacity": "0"}, "disk_capacity", "must be positive"),
    ({**DISK, "disk_capacity": "16G"}, None, None),
    ({**DISK, "disk_capacity": "1e9"}, "disk_capacity", "not a size"),
    ({**DISK, "disk_path": 5}, "disk_path", "not a string"),
    ({**DISK, "disk_io_threads": 100000}, "disk_io_threads", "at most"),
    ({**REMOTE, "remote_url": "http://cache:6379/0"}, "remote_url", "not a Redis URL"),
    ({**REMOTE, "remote_url": ""}, "remote_url", "is empty"),
    ({**REMOTE, "remote_url": "rediss://cache:6380/0"}, None, None),
    ({**REMOTE, "remote_url": "unix:///run/redis.sock"}, None, None),
    ({**REMOTE, "remote_timeout_s": "nan"}, "remote_timeout_s", "finite"),
    ({**REMOTE, "remote_timeout_s": float("inf")}, "remote_timeout_s", "finite"),
    ({**REMOTE, "remote_negative_ttl_s": "-inf"}, "remote_negative_ttl_s", "finite"),
    ({**REMOTE, "remote_max_known_keys": 0}, "remote_max_known_keys", "positive"),
    ({**REMOTE, "remote_batch_blocks": 0}, "remote_batch_blocks", "positive"),
    ({**REMOTE, "remote_max_connections": 10**9}, "remote_max_connections", "not in"),
    ({**REMOTE, "remote_password_file": "/nonexistent/pw"}, "remote_password_file",
     "cannot be opened"),
    ({**REMOTE, "remote_username": ""}, "remote_username", "is empty"),
    ({**REMOTE, "remote_tls_ca_file": "/etc/hostname"}, "remote_tls_ca_file",
     "needs a TLS URL"),
    ({**REMOTE, "remote_url": "rediss://cache:6380/0", "remote_tls_ca_file": "/nonexistent"},
     "remote_tls_ca_file", "cannot be opened"),
    ({**REMOTE, "remote_url": "redis://kv:pw@cache:6379/0"}, None, None),
    ({**REMOTE, "remote_url": "rediss://cache:6380/0?ssl_cert_reqs=none"}, "remote_url",
     "always verified"),
    ({**REMOTE, "remote_url": "redis://cache:6379/0?socket_timeout=8"}, "remote_url",
     "remote_timeout_s"),
    ({**REMOTE, "remote_url": "redis://cache:6379?db=notanumber"}, "remote_url",
     "not a number"),
    ({**REMOTE, "remote_url": "redis://kv:pa/ss@cache:6379/0"}, "remote_url", "unescaped"),
    ({**REMOTE, "remote_url": "redis://cache:6379?db=3"}, None, None),
    ({**REMOTE, "remote_url": "redis://cache:6379/3", "remote_cluster": True},
     "remote_cluster", "database 0"),
    ({"host_memory_bytes": "1GiB", "load_deadline_s": 0}, "load_deadline_s", "seconds in"),
    ({"host_memory_bytes": "1GiB", "load_deadline_s": -1}, "load_deadline_s", "seconds in"),
    ({"host_memory_bytes": "1GiB", "load_deadline_s": "30"}, "load_deadline_s", "seconds in"),
    ({"host_memory_bytes": "1GiB", "load_deadline_s": float("nan")}, "load_deadline_s",
     "seconds in"),
    ({"host_memory_bytes": "1GiB", "load_deadline_s": True}, "load_deadline_s", "seconds in"),
    ({"host_memory_bytes": "1GiB", "load_deadline_s": None}, None, None),
    ({"host_memory_bytes": "1GiB", "load_deadline_s": 2.5}, None, None),
    # Issue 40: refused when the options are read, naming the key.
    ({**DISK, "disk_eviction_policy": "nope"}, "disk_eviction_policy", "unknown policy"),
    ({**DISK, "disk_eviction_policy": ["lru"]}, "disk_eviction_policy", "not a string"),
    ({**DISK, "disk_path": "/nvme/kv\0"}, "disk_path", "NUL byte"),
    ({**DISK, "tier_mac_key_file": "/etc/kvoffload/key\0"}, "tier_mac_key_file", "NUL byte"),
    ({"host_memory_bytes": "1GiB", "block_size_factor": 10**9}, "block_size_factor",
     "at most 1,024"),
    ({"host_memory_bytes": "1GiB", "block_size_factor": 1025}, "block_size_factor",
     "at most 1,024"),
    ({"host_memory_bytes": "1GiB", "block_size_factor": 1024}, None, None),
    ({"host_memory_bytes": "1GiB", "max_deferred_steps": 10**12}, "max_deferred_steps",
     "at most 1,048,576"),
    ({**DISK, "disk_io_threads": "\u0663"}, "disk_io_threads", "ASCII digits"),
    ({"host_memory_bytes": "1GiB", "eviction_policy": "v" * 100_000}, "eviction_policy",
     "100,002 characters"),
    ({"host_memory_bytes": "1GiB", "tiers": ["host", "t" * 100_000]}, "tiers",
     "100,002 characters"),
])
def test_hostile_values_name_their_key(extra: dict[str, Any], key: str | None,
                                       needle: str | None) -> None:
    if key is None:
        ConnectorOptions.from_extra_config(extra)
        return
    with pytest.raises(ConfigError) as info:
        ConnectorOptions.from_extra_config(extra)
    assert info.value.field == f"{P}.{key}"
    assert needle is not None and needle in str(info.value)
    assert len(str(info.value)) < 1000  # a huge value is named, never echoed whole


def test_sizes_read_alike_everywhere() -> None:
    opts = ConnectorOptions.from_extra_config({**DISK, "host_memory_bytes": "16Gi",
                                               "disk_capacity": "16G"})
    assert opts.host_memory_bytes == 16 << 30
    assert opts.tier_config.disk is not None
    assert opts.tier_config.disk.capacity_bytes == 16 * 10**9


_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-10, 2**62), st.floats(),
                    st.text(max_size=12), st.sampled_from(["8GiB", "16G", "redis://h:1/0",
                                                           "/tmp/kv", "lru", "host"]),
                    st.lists(st.sampled_from(["host", "disk", "remote", "tape"]), max_size=4))
_KEYS = st.sampled_from(["host_memory_bytes", "eviction_policy", "block_size_factor",
                         "tiers", "max_deferred_steps", "min_deferral_s", "staging_bytes",
                         *TIER_OPTIONS, "bogus"])


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(_KEYS, _VALUES, max_size=8).flatmap(
    lambda e: st.sampled_from([e, {"host_memory_bytes": "1GiB", **e},
                               {"host_memory_bytes": "1GiB", "tiers": ["host", "disk",
                                "remote"], "disk_path": "/x", "disk_capacity": "1G",
                                "remote_url": "redis://h:1/0", **e}])))
def test_any_dict_gives_options_or_a_config_error(extra: dict[str, Any]) -> None:
    try:
        opts = ConnectorOptions.from_extra_config(extra)
    except ConfigError as exc:
        assert exc.field.startswith(P)
    else:
        assert opts.host_memory_bytes >= 1
