"""Isolation: tenants with different cache salts never hit each other's blocks; blocks of
another model or layout are never served; a crafted or damaged block in a shared tier is
a miss (and is removed), never data."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from kvoffload.blockfile.framing import HEADER_BYTES, check, encode_header
from kvoffload.config import GroupKind, OffloadConfig
from kvoffload.sim.replay import Arrival, replay
from kvoffload.tiers.config import TierConfig
from kvoffload.tiers.naming import namespace
from kvoffload.workloads import WorkloadRequest
from refengine.engine_kit import make_engine, tiny_preset, toks
from tiers.tier_kit import block_files, disk_tiers, hybrid_config, prompt, tiered_engine


def tenant(rid: str, tokens: list[int], salt: str | None, at: float) -> WorkloadRequest:
    return WorkloadRequest(request_id=rid, arrival_s=at, prompt=tokens, output_length=1,
                           cache_salt=salt)


def test_different_cache_salts_never_share_a_block() -> None:
    """Tenant a computes a prefix; filler evicts it from the engine; then tenants b, c (and
    an unsalted request) ask for the same tokens: only tenant a hits, from host memory."""
    engine = make_engine(tiny_preset(window=8, mamba=True), num_blocks=48, budget=32)
    shared = toks(32)
    workload = [tenant("a1", [*shared, 1, 2, 3, 4], "a", 0.0),
                tenant("fill", toks(140, base=50_000), None, 1.0),
                tenant("b1", [*shared, 1, 2, 3, 4], "b", 2.0),
                tenant("plain", [*shared, 1, 2, 3, 4], None, 3.0),
                tenant("a2", [*shared, 5, 6, 7, 8], "a", 4.0)]
    metrics = replay(engine, workload, arrival=Arrival.TRACE)
    hits = {r.request_id: r.engine_hit_tokens + r.host_hit_tokens for r in metrics.records}
    assert hits["b1"] == 0 and hits["plain"] == 0
    assert hits["a2"] >= 28
    assert {r.request_id: r.host_hit_tokens for r in metrics.records}["a2"] > 0
    assert metrics.wrong_bytes == 0


@pytest.mark.parametrize("change", [
    {"model_id": "another-model"},
    {"key_scheme": "xxh3_128:another-seed"},
    {"groups": "page_bytes"},
    {"groups": "block_size"},
    {"block_size_factor": 2},
    {"num_workers": 1},
    {"groups": "proof_tokens"},
], ids=["model", "key scheme", "page bytes", "block size", "factor", "tensor parallel",
        "draft proof tokens"])
def test_anything_that_changes_a_block_changes_the_namespace(change: dict) -> None:
    config = hybrid_config(host_slots=24)
    tiers = TierConfig(model_id="test-model")
    base = namespace(config, tiers)
    key, value = next(iter(change.items()))
    if key in ("model_id", "key_scheme"):
        tiers = dataclasses.replace(tiers, **{key: value})
    elif value == "page_bytes":
        config = _replace_groups(config, page_bytes=config.groups[0].page_bytes * 2)
    elif value == "block_size":
        config = _replace_groups(config, block_size=8)
    elif value == "proof_tokens":  # the full-attention group holds a drafter's layers
        groups = tuple(dataclasses.replace(g, proof_tokens=3)
                       if g.kind is GroupKind.FULL_ATTENTION else g for g in config.groups)
        config = dataclasses.replace(config, groups=groups)
    else:
        config = dataclasses.replace(config, **{key: value})
    assert namespace(config, tiers) != base


def test_a_layout_without_proof_tokens_keeps_the_namespace_of_earlier_releases() -> None:
    """Disk and Redis blocks written before draft groups existed still hit: the
    fingerprint names ``proof_tokens`` only where a group sets it."""
    import hashlib
    import json

    config, tiers = hybrid_config(host_slots=24), TierConfig(model_id="test-model")
    earlier = {"format": 1, "model": "test-model", "key_scheme": tiers.key_scheme,
               "hash_block_size": config.hash_block_size,
               "block_size_factor": config.block_size_factor,
               "num_workers": config.num_workers,
               "groups": [[g.kind.value, g.block_size, g.sliding_window, g.num_layers,
                           g.page_bytes, g.state_alignment] for g in config.groups]}
    blob = json.dumps(earlier, sort_keys=True, separators=(",", ":")).encode()
    assert namespace(config, tiers) == hashlib.sha256(blob).hexdigest()[:32]


def _replace_groups(config: OffloadConfig, **fields: int) -> OffloadConfig:
    groups = tuple(dataclasses.replace(g, **fields) for g in config.groups)
    return dataclasses.replace(config, groups=groups, host_capacity_bytes=1 << 30)


def test_blocks_on_a_shared_disk_are_served_only_to_the_same_model(tmp_path: Path) -> None:
    config = hybrid_config(host_slots=24)
    query = [*prompt(1, 48), 1, 2, 3]
    with tiered_engine(config, disk_tiers(tmp_path / "d", capacity=1 << 30)) as engine:
        engine.run([prompt(1, 48)])
        engine.run([prompt(s, 48) for s in range(2, 6)])  # push prompt 1 to the disk
    tiers = disk_tiers(tmp_path / "d")
    other = dataclasses.replace(tiers, model_id="another-model")
    with tiered_engine(config, other) as engine:
        assert engine.run([query]) == 0
    with tiered_engine(config, tiers) as engine:  # the same model, after a restart
        assert engine.run([query]) > 0


def test_crafted_blocks_are_rejected_field_by_field() -> None:
    fp, key, payload = b"F" * 16, b"k" * 20, bytes(range(256)) * 4
    header = encode_header(fp, 0, key, payload)
    assert check(header, payload, fp, 0, key) is None
    flipped = bytearray(payload)
    flipped[100] ^= 1
    cases = {
        "bad magic": (b"XXXX" + header[4:], payload),
        "version": (header[:4] + b"\x09\x00" + header[6:], payload),
        "foreign": (encode_header(b"G" * 16, 0, key, payload), payload),
        "rank": (encode_header(fp, 1, key, payload), payload),
        "another key": (encode_header(fp, 0, b"j" * 20, payload), payload),
        "corrupt": (header, bytes(flipped)),
        "truncated header": (header[:HEADER_BYTES - 1], payload),
    }
    for name, (head, body) in cases.items():
        assert check(head, body, fp, 0, key) is not None, name


def test_damaged_and_planted_files_in_the_shared_tier_never_reach_the_engine(
        tmp_path: Path) -> None:
    """Files of one engine's disk tier are damaged or swapped for other blocks; a second
    engine of the same model asks for them: every loaded byte is checked by the engine,
    the bad files are misses and are removed."""
    config = hybrid_config(host_slots=24)
    root = tmp_path / "d"
    with tiered_engine(config, disk_tiers(root)) as engine:
        engine.run([prompt(1, 48)])
        engine.run([prompt(s, 48) for s in range(2, 6)])
    files = block_files(root)
    assert len(files) >= 6
    damaged = files[:: max(1, len(files) // 6)][:6]
    planted: dict[Path, bytes] = {}
    for i, path in enumerate(damaged):
        data = bytearray(path.read_bytes())
        if i % 3 == 0:
            data[len(data) // 3] ^= 0xFF  # a flipped payload bit (the payload starts the file)
        elif i % 3 == 1:
            data = data[: len(data) // 2]  # truncated
        else:
            shutil.copyfile(files[-1], path)  # another block planted under this name
            planted[path] = path.read_bytes()
            continue
        path.write_bytes(bytes(data))
        planted[path] = bytes(data)
    with tiered_engine(config, disk_tiers(root)) as engine:
        hits = sum(engine.run([[*prompt(s, 48), 7, 7, 7]]) for s in range(1, 6))
        rejected = sum(w.tier_io.stores["disk"].stats.rejected  # type: ignore[union-attr]
                       for w in engine.workers.workers)
        disk = engine.tier.lower("disk").stats
    assert hits > 0  # the intact blocks still serve (every loaded byte was compared)
    assert rejected > 0 and disk.reads_failed > 0
    # Read, rejected and removed (and maybe stored again, whole, after the recompute).
    assert any(not p.exists() or p.read_bytes() != bad for p, bad in planted.items())
