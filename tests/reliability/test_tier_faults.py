"""Faults of a lower tier under a running engine: I/O errors, blocks damaged at rest and
outages (``FaultyBlockStore`` around each rank's real disk store). The simulated engine
checks every loaded block byte for byte: a damaged block must be a miss (and be removed),
never data, and the engine must keep serving."""

from __future__ import annotations

from pathlib import Path

from kvoffload.faults.store import FaultyBlockStore, disk_tamper
from kvoffload.tiers.naming import block_path
from tiers.tier_kit import disk_tiers, hybrid_config, prompt, tiered_engine

PREFIX = 48
RATE = 0.05


def test_io_errors_damaged_blocks_and_outages_never_reach_the_engine(tmp_path: Path) -> None:
    config = hybrid_config(host_slots=24)
    with tiered_engine(config, disk_tiers(tmp_path / "disk")) as engine:
        stores: list[FaultyBlockStore] = []
        for rank, worker in enumerate(engine.workers.workers):
            io = worker.tier_io
            assert io is not None
            inner = io.stores["disk"]
            faulty = FaultyBlockStore(inner, rate=RATE, seed=rank, tamper=disk_tamper(inner),
                                      outage_calls=4)
            io.stores["disk"] = faulty
            stores.append(faulty)
        hits = 0
        for round_ in range(4):
            for seed in range(8):  # more prefixes than host memory holds: demotes to disk
                hits += engine.run([[*prompt(seed, PREFIX), round_, seed]])
        engine.tier.check_integrity()
        injected = sum((s.injected for s in stores), start=type(stores[0].injected)())
        assert injected["corrupt"] > 0 and injected["io_error"] > 0
        assert injected["outage"] > 0
        disk = engine.tier.lower("disk").stats
        assert disk.reads_failed > 0 and disk.reads_ok > 0
        assert hits > 0  # the disk still served what was intact
        # Damaged blocks read back were rejected and removed: a miss, never data (every
        # loaded block was compared byte for byte by the engine).
        assert sum(s.stats.rejected for s in stores) > 0
        for s in stores:
            for key in s.tampered:
                inner = s.inner
                path = Path(block_path(inner.root, inner.namespace,  # type: ignore[attr-defined]
                                       inner.rank, key))  # type: ignore[attr-defined]
                if path.exists():  # never read since: a read now rejects and removes it
                    view = memoryview(bytearray(path.stat().st_size))
                    assert inner.get_into([(key, view[:0])]) == [False]
