"""A hostile or careless disk directory: what the disk store does with each case.

Only ``disk_path`` itself is trusted. Below it: a FIFO in a block's place is a miss at once
(no I/O thread waits for a writer, and shutdown returns); a symlinked block file or fan-out
directory is never read, written or deleted through; a second engine on the directory is
refused at start-up with the holder named; a purge that cannot remove everything says so,
and what it left is never served again -- fenced by the purge's epoch, or, on a read-only
disk that cannot even hold the marker, by refusing the directory at start-up.
See docs/tiers.md (disk tier) and docs/reliability.md (hostile input).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.errors import ConfigError
from kvoffload.jobs import StepPlan, TierOp
from kvoffload.tiers.naming import block_path
from kvoffload.worker.block_store import BlockStore, StoreError
from kvoffload.worker.disk_store import EPOCH_FILE, DiskStore
from kvoffload.worker.tier_io import TierIO
from tiers.test_tier_io import caches, demote_one, key, tier_job
from tiers.tier_kit import disk_tiers
from worker.worker_kit import make_worker

NS = "5e" * 16
FP = b"layout-print-16b"
BLOCK = 4096


def payload(seed: int) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(BLOCK))


def read(store: DiskStore, k: bytes) -> bytes | None:
    """The block's bytes, or None for a miss; fails the test if the read takes > 1 s."""
    dest = bytearray(b"\x5a" * BLOCK)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(
        store.get_into([(k, memoryview(dest))])[0]), daemon=True)
    thread.start()
    thread.join(1.0)
    assert not thread.is_alive(), "a read blocked"
    return bytes(dest) if result[0] else None


@pytest.fixture
def open_store(tmp_path: Path) -> Iterator[Callable[..., DiskStore]]:
    opened: list[DiskStore] = []

    def make(root: Path = tmp_path / "disk") -> DiskStore:
        store = DiskStore(str(root), NS, 0, FP, fsync=False)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


K = bytes.fromhex("ab") + bytes(15) + b"\x02"  # fan-out directory "ab"


def test_a_fifo_in_place_of_a_block_is_a_miss_at_once(
        open_store: Callable[..., DiskStore], caplog: pytest.LogCaptureFixture) -> None:
    store = open_store()
    assert store.put([(K, payload(1))]) == [True]
    path = block_path(store.root, NS, 0, K)
    os.unlink(path)
    os.mkfifo(path)
    with caplog.at_level(logging.WARNING):
        assert read(store, K) is None
        assert read(store, K) is None
    assert store.stats.refused == 2
    assert len([r for r in caplog.records if path in r.getMessage()]) == 1  # warned once
    assert store.put([(K, payload(2))]) == [True]  # the rename replaces the FIFO
    assert read(store, K) == payload(2)


def test_a_fifo_promote_fails_and_the_worker_shuts_down(tmp_path: Path) -> None:
    worker = make_worker(caches(), num_slots=12, tiers=disk_tiers(tmp_path / "disk"),
                         pin_memory=False)
    done = threading.Event()
    try:
        io = worker.tier_io
        assert io is not None
        demote_one(worker, "disk", key(1, 2))
        path = block_path(str(tmp_path / "disk"), io.namespace, 0, key(1, 2))
        os.unlink(path)
        os.mkfifo(path)
        job = tier_job(TierOp.PROMOTE, "disk", key(1, 2), 9)
        worker.begin_step(StepPlan(tier_jobs=(job,)))
        worker.end_step()
        deadline = time.monotonic() + 1.0
        failed: tuple[object, ...] = ()
        while not failed and time.monotonic() < deadline:
            failed = worker.poll().tier_failed
            time.sleep(0.01)
        assert failed == (job.job_id,)
    finally:
        thread = threading.Thread(target=lambda: (worker.shutdown(), done.set()), daemon=True)
        thread.start()
        thread.join(2.0)
    assert done.is_set(), "shutdown did not return"


def test_a_symlinked_block_file_is_never_read_or_written_through(
        open_store: Callable[..., DiskStore], tmp_path: Path) -> None:
    store = open_store()
    assert store.put([(K, payload(1))]) == [True]
    path = block_path(store.root, NS, 0, K)
    outside = tmp_path / "outside.kvb"
    os.replace(path, outside)  # a valid block: following the link would read it as data
    os.symlink(outside, path)
    before = outside.read_bytes()
    assert read(store, K) is None
    assert store.stats.refused == 1 and store.stats.reads == 0
    store.delete([K])  # removes the link, never the target
    assert not os.path.lexists(path) and outside.read_bytes() == before
    os.symlink(outside, path)
    assert store.put([(K, payload(2))]) == [True]
    assert outside.read_bytes() == before  # the write replaced the link, not its target
    assert not os.path.islink(path) and read(store, K) == payload(2)


def test_a_symlinked_fan_out_directory_is_never_entered(
        open_store: Callable[..., DiskStore], tmp_path: Path) -> None:
    store = open_store()
    assert store.put([(K, payload(1))]) == [True]
    fan = os.path.dirname(block_path(store.root, NS, 0, K))
    outside = tmp_path / "outside"
    os.replace(fan, outside)  # holds a valid block file under K's name
    os.symlink(outside, fan)
    listing = {p.name: p.read_bytes() for p in outside.iterdir()}
    store.close()  # a running store keeps the fd of the directory it opened (docs/tiers.md)
    store = open_store()
    assert read(store, K) is None
    assert store.put([(K, payload(2))]) == [False]
    store.delete([K])
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == listing
    assert store.stats.refused >= 2 and store.stats.write_errors == 1


def test_a_symlinked_namespace_directory_is_refused_at_start(tmp_path: Path) -> None:
    root = tmp_path / "disk"
    root.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", root / NS)
    with pytest.raises(ConfigError, match="symbolic link"):
        DiskStore(str(root), NS, 0, FP)
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_second_engine_on_the_directory_is_refused_with_the_holder_named(
        open_store: Callable[..., DiskStore], tmp_path: Path) -> None:
    first = open_store()
    assert first.put([(K, payload(1))]) == [True]
    with pytest.raises(ConfigError, match=f"in use by another engine \\(pid {os.getpid()} "
                                          f"on host {os.uname().nodename}") as info:
        DiskStore(str(tmp_path / "disk"), "another-model-ns", 0, FP)
    assert str(tmp_path / "disk") in str(info.value)
    assert read(first, K) == payload(1)  # the refused engine touched nothing
    first.close()
    second = open_store()
    assert read(second, K) == payload(1)


def test_a_lock_held_by_another_process_names_it_and_is_taken_over_when_it_dies(
        open_store: Callable[..., DiskStore], tmp_path: Path) -> None:
    root = tmp_path / "disk"
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from kvoffload.worker.disk_store import DiskStore; "
         f"s = DiskStore({str(root)!r}, {NS!r}, 0, b'x' * 16); print('ready', flush=True); "
         "time.sleep(60)"], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        with pytest.raises(ConfigError, match=f"pid {child.pid} on host"):
            DiskStore(str(root), NS, 0, FP)
    finally:
        child.kill()
        child.wait()
    lock = root / ".kvoffload-rank0.lock"
    assert lock.read_text().startswith(f"pid {child.pid} ")  # left behind by the dead child
    store = open_store(root)  # ... whose lock died with it: taken over
    assert lock.read_text().startswith(f"pid {os.getpid()} ")
    assert store.put([(K, payload(1))]) == [True] and read(store, K) == payload(1)


def test_a_purge_that_cannot_delete_fences_what_is_left(
        open_store: Callable[..., DiskStore], monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store()
    other = bytes.fromhex("cd") + bytes(15) + b"\x02"
    assert store.put([(K, payload(1)), (other, payload(3))]) == [True, True]
    path = block_path(store.root, NS, 0, K)
    real_unlink = os.unlink

    def stuck(name: object, *args: object, **kwargs: object) -> None:
        if str(name).endswith(os.path.basename(path)):
            raise PermissionError(errno.EPERM, "Operation not permitted", name)
        real_unlink(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", stuck)
    with pytest.raises(StoreError, match=r"entries could not be removed.*they are fenced"):
        store.purge()
    monkeypatch.undo()
    assert os.path.exists(path)  # still on disk ...
    assert not os.path.exists(block_path(store.root, NS, 0, other))
    assert read(store, K) is None  # ... and never served again: foreign to this store
    assert store.put([(K, payload(1))]) == [True]
    store.close()
    restarted = open_store()
    assert read(restarted, K) == payload(1)  # written after the purge: readable
    restarted.purge()  # a complete purge drops the marker and the epoch
    assert not os.path.exists(os.path.join(restarted.directory, EPOCH_FILE))
    assert restarted.put([(K, payload(4))]) == [True] and read(restarted, K) == payload(4)


def test_a_purge_stopped_by_an_immutable_file_fences_it_across_a_restart(
        open_store: Callable[..., DiskStore]) -> None:
    """The same on a real file system: ``chattr +i`` (ext4 and others; root only)."""
    store = open_store()
    assert store.put([(K, payload(1))]) == [True]
    path = block_path(store.root, NS, 0, K)
    if subprocess.run(["chattr", "+i", path], capture_output=True,
                      check=False).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        with pytest.raises(StoreError, match=r"Operation not permitted.*they are fenced"):
            store.purge()
        store.close()
        restarted = open_store()
        assert os.path.exists(path) and read(restarted, K) is None
    finally:
        subprocess.run(["chattr", "-i", path], check=False)


def _purged_without_deleting(open_store: Callable[..., DiskStore],
                             monkeypatch: pytest.MonkeyPatch) -> DiskStore:
    """A store holding block ``K`` whose purge could delete nothing (and said so)."""
    store = open_store()
    assert store.put([(K, payload(1))]) == [True]
    monkeypatch.setattr(os, "unlink", _raise(errno.EPERM))
    with pytest.raises(StoreError):
        store.purge()
    monkeypatch.undo()
    return store


def test_a_removed_epoch_marker_is_forgotten_with_its_directory(
        open_store: Callable[..., DiskStore], monkeypatch: pytest.MonkeyPatch) -> None:
    store = _purged_without_deleting(open_store, monkeypatch)
    shutil.rmtree(store.directory)  # the leftovers and the marker, by hand
    assert store.put([(K, payload(2))]) == [True]
    store.close()
    assert read(open_store(), K) == payload(2)  # written without the vanished epoch


def test_a_block_left_by_a_failed_purge_is_not_served_after_a_restart(
        open_store: Callable[..., DiskStore], monkeypatch: pytest.MonkeyPatch) -> None:
    store = _purged_without_deleting(open_store, monkeypatch)
    store.close()
    restarted = open_store()
    assert read(restarted, K) is None
    assert restarted.stats.rejected == 1  # foreign: the restarted store read the epoch


def _raise(code: int) -> Callable[..., None]:
    def fail(name: object, *args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code), name)
    return fail


def test_a_purge_on_a_read_only_disk_reports_it_and_a_restart_refuses_the_disk(
        open_store: Callable[..., DiskStore], tmp_path: Path) -> None:
    """A real read-only mount (a read-only bind mount; needs root and mount rights)."""
    real, mounted = tmp_path / "real", tmp_path / "disk"
    real.mkdir()
    mounted.mkdir()
    if subprocess.run(["mount", "--bind", str(real), str(mounted)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("cannot bind-mount here (needs root and CAP_SYS_ADMIN)")
    try:
        store = open_store(mounted)
        assert store.put([(K, payload(1))]) == [True]
        subprocess.run(["mount", "-o", "remount,bind,ro", str(mounted)], check=True)
        with pytest.raises(StoreError, match="NOTHING fences them"):
            store.purge()
        assert store.put([(K, payload(2))]) == [False]  # EROFS: a clean write failure
        store.close()
        with pytest.raises(ConfigError, match=r"unusable.*Read-only file system"):
            DiskStore(str(mounted), NS, 0, FP)
    finally:
        subprocess.run(["umount", str(mounted)], check=False)
    assert os.path.exists(block_path(str(real), NS, 0, K))  # nothing could be deleted


def test_a_read_only_disk_refuses_to_start_even_when_injected(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same refusal without mount rights: the lock file's write fails with EROFS."""
    DiskStore(str(tmp_path / "disk"), NS, 0, FP).close()
    real_open = os.open

    def read_only(path: object, flags: int, *args: object, **kwargs: object) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(ConfigError, match=r"unusable.*Read-only file system"):
        DiskStore(str(tmp_path / "disk"), NS, 0, FP)


class _Stuck(BlockStore):
    """A store whose reads never return until released."""

    name = "disk"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.closed = False

    def put(self, items: object) -> list[bool]:
        return []

    def get_into(self, items: object) -> list[bool]:  # type: ignore[override]
        self.release.wait()
        return [False] * len(items)  # type: ignore[arg-type]

    def delete(self, keys: object) -> None:
        pass

    def purge(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_shutdown_returns_even_if_an_io_thread_is_stuck(tmp_path: Path) -> None:
    worker = make_worker(caches(), num_slots=12, tiers=disk_tiers(tmp_path / "disk"),
                         pin_memory=False)
    io = worker.tier_io
    assert isinstance(io, TierIO)
    real, stuck = io.stores["disk"], _Stuck()
    io.stores["disk"] = stuck
    io.begin([], [tier_job(TierOp.PROMOTE, "disk", key(1, 2), 9)])
    start = time.monotonic()
    io.shutdown(timeout_s=0.3)
    assert time.monotonic() - start < 2.0
    assert not stuck.closed  # never closed under the stuck thread
    stuck.release.set()
    real.close()
    worker.shutdown()


def test_a_directory_removed_under_a_running_store_is_made_again(
        open_store: Callable[..., DiskStore]) -> None:
    store = open_store()
    assert store.put([(K, payload(1))]) == [True]
    shutil.rmtree(os.path.join(store.root, NS))  # by hand, with the fan-out fd cached
    assert read(store, K) is None
    assert store.put([(K, payload(2))]) == [True] and read(store, K) == payload(2)
    assert os.path.isfile(block_path(store.root, NS, 0, K))
    shutil.rmtree(store.root)  # the whole directory, lock file included
    assert store.put([(K, payload(3))]) == [True] and read(store, K) == payload(3)
    with pytest.raises(ConfigError, match="in use by another engine"):
        DiskStore(store.root, NS, 0, FP)  # the lock was taken again


def test_a_purge_removes_a_symlinked_fan_out_directory_but_never_its_target(
        open_store: Callable[..., DiskStore], tmp_path: Path) -> None:
    """The purge walks the rank directory without following links: a fan-out directory
    replaced by a link loses the link; what it points at keeps every byte."""
    store = open_store()
    assert store.put([(K, payload(1))]) == [True]
    fan = os.path.dirname(block_path(store.root, NS, 0, K))
    outside = tmp_path / "outside"
    os.replace(fan, outside)
    os.symlink(outside, fan)
    listing = {p.name: p.read_bytes() for p in outside.iterdir()}
    store.purge()
    assert not os.path.lexists(fan)
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == listing
