"""The disk tier end to end: the real planner, a ``CascadeTier``, two real worker ranks with
tier I/O, and a real directory. The engine checks every loaded block byte for byte.

Stories: a prefix pushed out of a small host memory comes back from disk for every group
kind, and revisits sent at once come back in turn; an engine process stores, exits, and a
new process hits what it stored; a corrupted block file is a miss (the hit shrinks to the
blocks before it) and is deleted; a full file system fails stores cleanly and the engine
goes on serving.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.blockfile.framing import HEADER_BYTES
from kvoffload.tiers.config import WriteMode
from kvoffload.tiers.naming import block_path
from tiers.tier_kit import (
    ENV,
    baseline_hits,
    block_files,
    disk_tiers,
    hybrid_config,
    prompt,
    tiered_engine,
)

PREFIX = 40  # tokens: 10 blocks of 4 in every group


def flood(engine: object, seeds: range) -> None:
    engine.run([prompt(s, PREFIX) for s in seeds])  # type: ignore[attr-defined]


def test_a_prefix_evicted_from_host_memory_comes_back_from_disk(tmp_path: Path) -> None:
    config = hybrid_config(host_slots=24)
    query = [*prompt(1, PREFIX), 1, 2, 3]
    (perfect,) = baseline_hits(config, [prompt(1, PREFIX), query])[1:]
    assert perfect >= 32  # the planner stored (almost) the whole prefix
    with tiered_engine(config, disk_tiers(tmp_path, mode=WriteMode.WRITE_BACK)) as engine:
        assert engine.run([prompt(1, PREFIX)]) == 0
        flood(engine, range(2, 5))  # host memory holds 24 blocks: prompt 1 is evicted
        assert engine.tier.lookup(_key(engine, prompt(1, PREFIX), 0, 0)).value == "pending"
        disk = engine.tier.lower("disk")
        assert disk.stats.writes_ok > 0 and len(block_files(tmp_path)) == 2 * len(disk)
        assert engine.run([query]) == perfect
        stats = engine.tier.stats
        # Every group kind was read back from disk: the full-attention blocks, the last
        # sliding-window blocks (window 8 tokens), the Mamba state at the hit.
        fa, window = perfect // 4, 2
        assert {g: n for (t, g), n in stats.loaded_group_blocks.items() if t == "disk"} == \
            {0: fa, 1: window, 2: 1}
        assert stats.promoted["disk"] == fa + window + 1
        assert stats.hit_shares() == {"disk": 1.0}
        # A second request finds them in host memory now.
        assert engine.run([[*prompt(1, PREFIX), 4, 5, 6]]) == perfect
        assert stats.loaded_blocks["host"] == fa + window + 1


def test_revisits_sent_at_once_come_back_from_disk_in_turn(tmp_path: Path) -> None:
    """Host memory has room for one prefix's hit at a time; four revisits sent at once
    each wait for room to promote into while the one before loads, instead of all but
    one recomputing."""
    config = hybrid_config(host_slots=16)
    queries = [[*prompt(s, PREFIX), 1, 2, 3] for s in range(1, 5)]
    (perfect,) = baseline_hits(config, [prompt(1, PREFIX), queries[0]])[1:]
    with tiered_engine(config, disk_tiers(tmp_path, mode=WriteMode.WRITE_BACK)) as engine:
        flood(engine, range(1, 6))  # prompts 1 to 4 are pushed out to disk
        before = engine.sim.hit_tokens
        requests = [engine.sim.add_request(q, 2) for q in queries]
        for _ in range(400):
            if all(r.state == "done" for r in requests):
                break
            engine.step(16)
        assert all(r.state == "done" for r in requests)
        stats = engine.tier.stats
        assert stats.promote_no_room > 0  # they did wait for host room
        assert stats.promote_no_room_miss == {}
        assert engine.sim.hit_tokens - before == 4 * perfect
        assert stats.hit_shares() == {"disk": 1.0}


def test_a_restarted_engine_process_hits_what_the_last_one_stored(tmp_path: Path) -> None:
    stored = subprocess.run(
        [sys.executable, "-m", "tiers.engine_proc", "--disk", str(tmp_path),
         "--prompts", "1,2"], env=ENV, capture_output=True, text=True, timeout=120, check=False)
    assert stored.returncode == 0, stored.stderr
    first = json.loads(stored.stdout)
    assert first["hits"] == [0, 0] and first["demoted"]["disk"] > 0
    files = len(block_files(tmp_path))

    # This test process is the restarted engine: same model, layout and tokens.
    queries = [[*prompt(2, PREFIX), 7, 7, 7], [*prompt(1, PREFIX), 8, 8, 8]]
    config = hybrid_config(host_slots=48)
    perfect = baseline_hits(config, [prompt(1, PREFIX), prompt(2, PREFIX), *queries])[2:]
    assert min(perfect) >= 32
    tiers = disk_tiers(tmp_path, mode=WriteMode.WRITE_THROUGH)
    with tiered_engine(config, tiers) as engine:
        disk = engine.tier.lower("disk")
        assert disk.stats.extra == {"rebuilt_keys": files // 2, "rebuild_garbage": 0}
        assert [engine.run([q]) for q in queries] == perfect
        assert set(engine.tier.stats.loaded_blocks) == {"disk"}
        assert engine.run([prompt(3, PREFIX)]) == 0  # never stored: a miss, not an error


def test_a_corrupted_block_file_is_a_miss_and_is_deleted(tmp_path: Path) -> None:
    tiers = disk_tiers(tmp_path, mode=WriteMode.WRITE_THROUGH)
    config = hybrid_config(host_slots=24)
    with tiered_engine(config, tiers) as engine:
        tokens = prompt(1, PREFIX)
        engine.run([tokens])
        flood(engine, range(2, 5))
        # Flip one payload bit of rank 1's copy of full-attention block 5.
        ns = engine.tier.lower("disk").namespace  # type: ignore[attr-defined]
        victim = _key(engine, tokens, 5, 0)
        path = Path(block_path(tmp_path, ns, 1, victim))
        corrupted = bytearray(path.read_bytes())
        corrupted[3] ^= 0x10  # the payload starts the file, its header follows it
        path.write_bytes(bytes(corrupted))

        hit = engine.run([[*tokens, 9, 9, 9]])
        assert 0 < hit <= 20  # block 5 and later are recomputed, never loaded
        assert engine.tier.stats.promote_failed == {"disk": 1}
        assert engine.tier.stats.deleted["disk"] >= 1  # both ranks' copies
        stores = [w.tier_io.stores["disk"].stats for w in engine.workers.workers]
        assert [s.rejected for s in stores] == [0, 1]
        # The engine recomputed block 5 and wrote it through again, whole.
        assert path.read_bytes() != bytes(corrupted)
        assert engine.run([[*tokens, 5, 5, 5]]) > 20


def _key(engine: object, tokens: list[int], block: int, group: int) -> bytes:
    from kvoffload.keys import make_offload_key

    hashes = engine.sim.hasher.hashes(tokens)  # type: ignore[attr-defined]
    return make_offload_key(hashes[block], group)


@contextlib.contextmanager
def tiny_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A real, small tmpfs at ``path`` (needs root, as on CI); skipped where none can be
    mounted."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                              str(path)], capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}); "
                    "run as root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_fails_stores_cleanly_and_the_engine_goes_on(tmp_path: Path) -> None:
    with tiny_filesystem(tmp_path / "small", "96k") as small:
        # The budget says 1 GiB; the file system holds about 24 files of one page each.
        tiers = disk_tiers(small, mode=WriteMode.WRITE_THROUGH)
        config = hybrid_config(host_slots=48)
        query = [*prompt(4, PREFIX), 1, 2, 3]
        perfect = baseline_hits(config, [prompt(4, PREFIX), query])[1]
        with tiered_engine(config, tiers) as engine:
            for seed in range(1, 5):
                assert engine.run([prompt(seed, PREFIX)]) == 0
            disk = engine.tier.lower("disk")
            assert engine.tier.stats.demote_failed.get("disk", 0) > 0
            assert disk.stats.writes_failed > 0 and disk.stats.writes_ok > 0
            stores = [w.tier_io.stores["disk"].stats for w in engine.workers.workers]
            assert all(s.write_errors > 0 for s in stores)
            assert not list(small.rglob("*.tmp"))  # no half-written leftovers
            # Every block the index counts is whole on every rank.
            ns = disk.namespace  # type: ignore[attr-defined]
            for key in list(disk._policy.items()):  # type: ignore[attr-defined]
                for rank in (0, 1):
                    assert os.path.getsize(block_path(small, ns, rank, key[0])) > HEADER_BYTES
            # Host memory still serves hits, byte-exact.
            assert engine.run([query]) == perfect > 0
            engine.tier.check_integrity()
