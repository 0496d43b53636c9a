"""The block checksum and the hashed block-file I/O (``kvoffload.blockfile.checksum``).

The native extension must give the digests of the ``xxhash`` package (XXH3-64, seed 0) for
every length and every way of splitting the input, with each of its stripe loops; the
native and the Python implementations must read and write the same frames with the same
outcomes; the native calls must not hold the GIL; and a disk store using either reads a
block with one damaged byte anywhere -- header or payload -- as a miss.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash

from kvoffload.blockfile import checksum as cs
from kvoffload.blockfile.checksum import NATIVE, PIECE_BYTES, PYTHON, WRITE_PIECE_BYTES, Checksums
from kvoffload.blockfile.framing import (
    FIELDS_BYTES,
    HEADER_BYTES,
    MAC_BYTES,
    MAC_OFFSET,
    MacKey,
    encode_header,
    header_fields,
)
from kvoffload.tiers.naming import BLOCK_SUFFIX
from kvoffload.worker.disk_store import DiskStore

needs_native = pytest.mark.skipif(NATIVE is None, reason="the checksum extension is not built")
IMPLEMENTATIONS = [PYTHON] + ([NATIVE] if NATIVE is not None else [])
LENGTHS = [*range(0, 300), 511, 512, 513, 1023, 1024, 1025, 1087, 1088, 1089, 2047, 2048,
           4096, 16383, 16384, 16385, 65535, 65536, 65537, PIECE_BYTES - 1, PIECE_BYTES,
           PIECE_BYTES + 1, 3 * PIECE_BYTES + 123]
DATA = random.Random(7).randbytes(2 * WRITE_PIECE_BYTES + 4 * PIECE_BYTES)


def test_the_checksum_extension_is_built_where_required() -> None:
    # CI sets KVOFFLOAD_REQUIRE_NATIVE_COPY=1 for every native piece, so a build that
    # silently lost the extension fails here instead of testing only the fallback.
    if os.environ.get("KVOFFLOAD_REQUIRE_NATIVE_COPY") != "1":
        pytest.skip("set KVOFFLOAD_REQUIRE_NATIVE_COPY=1 to require the native pieces")
    assert NATIVE is not None, "kvoffload.blockfile._checksum was not built: is a C compiler there?"


@pytest.fixture(params=[c.name for c in IMPLEMENTATIONS])
def impl(request: pytest.FixtureRequest) -> Checksums:
    return next(c for c in IMPLEMENTATIONS if c.name == request.param)


@pytest.fixture(params=NATIVE.kernels() if NATIVE is not None else [])
def kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    assert NATIVE is not None
    before = NATIVE.kernel()
    NATIVE.use_kernel(request.param)
    yield request.param
    NATIVE.use_kernel(before)


def digest_of(impl: Checksums, *pieces: bytes | memoryview) -> int:
    digest = impl.new()
    for piece in pieces:
        digest.update(piece)
    return digest.intdigest()


# -- the digest ------------------------------------------------------------------------------


@needs_native
def test_every_stripe_loop_gives_xxhash_digests_for_every_length(kernel: str) -> None:
    assert NATIVE is not None
    wrong = [n for n in LENGTHS
             if digest_of(NATIVE, DATA[:n]) != xxhash.xxh3_64_intdigest(DATA[:n])]
    assert wrong == []


@needs_native
def test_every_split_of_the_input_gives_the_same_digest(kernel: str) -> None:
    assert NATIVE is not None
    rnd = random.Random(11)
    steps = [1, 3, 16, 63, 64, 65, 98, 122, 128, 200, 255, 256, 257, 1000, 1024, 5000, 70000]
    for _ in range(300):
        n = rnd.choice([rnd.randrange(0, 3000), rnd.randrange(0, len(DATA))])
        view, digest, at = memoryview(DATA), NATIVE.new(), 0
        while at < n:
            step = min(n - at, rnd.choice(steps))
            digest.update(view[at:at + step])
            at += step
        assert digest.intdigest() == xxhash.xxh3_64_intdigest(DATA[:n]), n


def test_a_digest_reads_without_consuming(impl: Checksums) -> None:
    digest = impl.new()
    digest.update(DATA[:1000])
    assert digest.intdigest() == digest.intdigest() == xxhash.xxh3_64_intdigest(DATA[:1000])
    digest.update(DATA[1000:5000])
    assert digest.intdigest() == xxhash.xxh3_64_intdigest(DATA[:5000])


@needs_native
def test_the_extension_refuses_what_is_not_a_state() -> None:
    from kvoffload.blockfile import _checksum  # type: ignore[attr-defined]

    with pytest.raises(ValueError, match="checksum state is"):
        _checksum.xxh3_update(bytearray(10), b"x")
    with pytest.raises(ValueError, match="not an initialized"):
        _checksum.xxh3_update(bytearray(_checksum.STATE_BYTES), b"x")
    state = bytearray(_checksum.STATE_BYTES)
    _checksum.xxh3_init(state)
    with pytest.raises(ValueError, match="offset must be >= 0"):
        _checksum.pread_hashed(0, bytearray(4), -1, state, 16)
    with pytest.raises(ValueError, match="piece must be > 0"):
        _checksum.pwrite_hashed(0, b"abcd", 0, state, 0)
    with pytest.raises(ValueError, match="no checksum kernel"):
        _checksum.use_kernel("avx9000")
    with pytest.raises(TypeError, match="digest from its own new"):
        assert NATIVE is not None
        NATIVE.read_hashed(0, memoryview(bytearray(4)), 0, PYTHON.new())


# -- hashed reads and writes -----------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 97, PIECE_BYTES - 1, PIECE_BYTES, 2 * PIECE_BYTES + 5,
                                  WRITE_PIECE_BYTES, 2 * WRITE_PIECE_BYTES + 7])
def test_hashed_writes_and_reads_move_and_hash_the_same_bytes(
        impl: Checksums, tmp_path: Path, size: int) -> None:
    payload = DATA[:size]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        written = impl.new()
        impl.write_hashed(fd, payload, 10, written)
        assert written.intdigest() == xxhash.xxh3_64_intdigest(payload)
        dest = memoryview(bytearray(size))
        read = impl.new()
        assert impl.read_hashed(fd, dest, 10, read)
        assert dest.tobytes() == payload
        assert read.intdigest() == xxhash.xxh3_64_intdigest(payload)
        if size:  # a file shorter than asked for reads as short
            assert not impl.read_hashed(fd, memoryview(bytearray(size + 1)), 10, impl.new())
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [0, 5, PIECE_BYTES - HEADER_BYTES, PIECE_BYTES, PIECE_BYTES + 1,
                                  2 * PIECE_BYTES, 3 * PIECE_BYTES + 77, 2 * WRITE_PIECE_BYTES + 9])
def test_both_implementations_write_and_read_identical_frames(tmp_path: Path, size: int) -> None:
    fields = header_fields(bytes(range(16)), 3, b"key-" * 4, size)
    payload = DATA[:size]
    files = {}
    for impl in IMPLEMENTATIONS:
        path = tmp_path / f"{impl.name}.blk"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            impl.write_frame(fd, fields, payload, HEADER_BYTES)
        finally:
            os.close(fd)
        files[impl.name] = path.read_bytes()
    expected_checksum = xxhash.xxh3_64_intdigest(fields + payload)
    for name, content in files.items():
        assert content == (payload + fields + expected_checksum.to_bytes(8, "little")
                           + bytes(HEADER_BYTES - FIELDS_BYTES - 8)), name
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for impl in IMPLEMENTATIONS:
            for name, content in files.items():
                header, dest = bytearray(HEADER_BYTES), memoryview(bytearray(size))
                frame = impl.read_frame(dir_fd, f"{name}.blk", fields, header, dest)
                assert frame == (cs.FRAME_READ, 0, expected_checksum)
                assert dest.tobytes() + bytes(header) == content
    finally:
        os.close(dir_fd)


@pytest.mark.parametrize("sync", [False, True])
def test_store_frame_writes_the_frame_atomically_and_leaves_no_temporary_file(
        tmp_path: Path, sync: bool) -> None:
    size = WRITE_PIECE_BYTES + 3 * PIECE_BYTES + 5
    fields = header_fields(bytes(range(16)), 1, b"k" * 20, size)
    payload = DATA[:size]
    checksum = xxhash.xxh3_64_intdigest(fields + payload)
    expected = (payload + fields + checksum.to_bytes(8, "little")
                + bytes(HEADER_BYTES - FIELDS_BYTES - 8))
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for impl in IMPLEMENTATIONS:
            final, tmp = f"{impl.name}.blk", f"{impl.name}.tmp"
            (tmp_path / final).write_bytes(b"an older block")  # replaced whole
            (tmp_path / tmp).write_bytes(b"left by a crash")  # removed, then made anew
            assert impl.store_frame(dir_fd, tmp, final, fields, payload,
                                    header_bytes=HEADER_BYTES, sync=sync) == (cs.STORED, 0)
            assert (tmp_path / final).read_bytes() == expected, impl.name
            assert not (tmp_path / tmp).exists()
    finally:
        os.close(dir_fd)


def test_store_frame_reports_the_failing_step_and_removes_its_temporary_file(
        tmp_path: Path) -> None:
    fields = header_fields(bytes(16), 0, b"k", 3)
    (tmp_path / "a-directory.blk").mkdir()
    (tmp_path / "a-directory.blk" / "inside").write_bytes(b"x")  # rename cannot replace it
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    gone = os.open(tmp_path / "a-directory.blk", os.O_RDONLY | os.O_DIRECTORY)
    os.unlink(tmp_path / "a-directory.blk" / "inside")
    os.rmdir(tmp_path / "a-directory.blk")  # ``gone`` now names a removed directory
    (tmp_path / "a-directory.blk").mkdir()
    (tmp_path / "a-directory.blk" / "inside").write_bytes(b"x")
    try:
        for impl in IMPLEMENTATIONS:
            stage = impl.store_frame(gone, "t.tmp", "f.blk", fields, b"abc",
                                     header_bytes=HEADER_BYTES, sync=False)
            assert stage == (cs.CREATE_FAILED, errno.ENOENT), impl.name
            stage = impl.store_frame(dir_fd, "t.tmp", "a-directory.blk", fields, b"abc",
                                     header_bytes=HEADER_BYTES, sync=True)
            assert stage[0] == cs.RENAME_FAILED and stage[1] in (errno.EISDIR, errno.ENOTEMPTY)
            assert sorted(p.name for p in tmp_path.iterdir()) == ["a-directory.blk"]
            with pytest.raises(ValueError, match="header_bytes"):
                impl.store_frame(dir_fd, "t.tmp", "f.blk", fields, b"abc",
                                 header_bytes=FIELDS_BYTES, sync=False)
    finally:
        os.close(gone)
        os.close(dir_fd)


def _outcomes(tmp_path: Path) -> dict[str, tuple[int, int, int]]:
    """The ``read_frame`` outcome of each hostile entry, per implementation (all equal)."""
    (tmp_path / "short.blk").write_bytes(bytes(HEADER_BYTES + 10))
    (tmp_path / "long.blk").write_bytes(bytes(HEADER_BYTES + 12))
    (tmp_path / "good.blk").write_bytes(bytes(HEADER_BYTES + 11))
    os.symlink(tmp_path / "good.blk", tmp_path / "link.blk")
    os.mkfifo(tmp_path / "fifo.blk")
    (tmp_path / "dir.blk").mkdir()
    results: dict[str, tuple[int, int, int]] = {}
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for impl in IMPLEMENTATIONS:
            for name in ("missing", "short", "long", "good", "link", "fifo", "dir"):
                outcome = impl.read_frame(dir_fd, f"{name}.blk", bytes(FIELDS_BYTES),
                                          bytearray(HEADER_BYTES), memoryview(bytearray(11)))
                assert results.setdefault(name, outcome) == outcome, (impl.name, name)
    finally:
        os.close(dir_fd)
    return results


def test_read_frame_reports_hostile_and_wrong_entries_alike(tmp_path: Path) -> None:
    outcomes = _outcomes(tmp_path)
    assert outcomes["missing"] == (cs.NO_FILE, errno.ENOENT, 0)
    assert outcomes["short"] == (cs.WRONG_SIZE, HEADER_BYTES + 10, 0)
    assert outcomes["long"] == (cs.WRONG_SIZE, HEADER_BYTES + 12, 0)
    assert outcomes["link"] == (cs.OPEN_ERROR, errno.ELOOP, 0)
    assert outcomes["fifo"] == (cs.NOT_REGULAR, 0, 0)  # opened without waiting for a writer
    assert outcomes["dir"] == (cs.NOT_REGULAR, 0, 0)
    good = outcomes["good"]
    assert good[:2] == (cs.FRAME_READ, 0)
    assert good[2] == xxhash.xxh3_64_intdigest(bytes(FIELDS_BYTES + 11))


def test_write_frame_refuses_a_header_too_small_for_its_fields(impl: Checksums) -> None:
    with pytest.raises(ValueError, match="header_bytes must be in"):
        impl.write_frame(0, bytes(FIELDS_BYTES), b"x", FIELDS_BYTES + 7)


# -- the GIL ---------------------------------------------------------------------------------


def _python_runs_during(call: Callable[[], object]) -> int:
    """How many times the main thread ran Python while ``call()`` ran on another thread,
    counted in the middle 60 % of the call (0 when the call holds the GIL: no bytecode runs
    meanwhile; the margins leave out the GIL hand-overs around the call)."""
    window: list[float] = []
    stamps: list[float] = []
    done = threading.Event()

    def run() -> None:
        window.append(time.perf_counter())
        call()
        window.append(time.perf_counter())
        done.set()

    worker = threading.Thread(target=run)
    worker.start()
    while not done.is_set():
        stamps.append(time.perf_counter())
    worker.join()
    start, end = window
    margin = 0.2 * (end - start)
    return sum(start + margin < t < end - margin for t in stamps)


@needs_native
def test_native_hashing_and_reading_release_the_gil(tmp_path: Path) -> None:
    assert NATIVE is not None
    big = bytearray(128 << 20)
    digest = NATIVE.new()

    def hash_big() -> None:
        for _ in range(4):
            digest.update(big)

    assert _python_runs_during(hash_big) > 0

    path = tmp_path / "big.blk"
    path.write_bytes(bytes(64 << 20) + bytes(HEADER_BYTES))
    dest = memoryview(bytearray(64 << 20))
    dir_fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        def read() -> None:
            for _ in range(4):
                frame = NATIVE.read_frame(dir_fd, "big.blk", bytes(FIELDS_BYTES),
                                          bytearray(HEADER_BYTES), dest)
                assert frame[0] == cs.FRAME_READ

        assert _python_runs_during(read) > 0
    finally:
        os.close(dir_fd)


# -- the disk store: a damaged byte anywhere is a miss ---------------------------------------


def _positions(size: int, *, mac: bool) -> list[int]:
    """Payload bytes at its start, around piece and stripe boundaries and at its end, and
    every byte of the header after it (without a MAC key, all but the MAC field, which a
    reader without a key ignores by design: ``kvoffload.blockfile.framing``)."""
    payload = [0, 1, 63, 64, 1023, 1024, PIECE_BYTES - 1, PIECE_BYTES, WRITE_PIECE_BYTES - 1,
               WRITE_PIECE_BYTES, size // 2, size - 64, size - 1]
    header = [size + p for p in range(HEADER_BYTES)
              if mac or not MAC_OFFSET <= p < MAC_OFFSET + MAC_BYTES]
    return sorted({p for p in payload if 0 <= p < size}) + header


@pytest.mark.parametrize("mac", [False, True], ids=["no-mac", "mac"])
@pytest.mark.parametrize("size", [100, PIECE_BYTES + 3000, WRITE_PIECE_BYTES + PIECE_BYTES + 9])
def test_a_damaged_byte_anywhere_in_a_block_file_is_a_miss(
        impl: Checksums, tmp_path: Path, size: int, mac: bool) -> None:
    store = DiskStore(str(tmp_path), "ns", 0, bytes(range(16)), fsync=False, using=impl,
                      mac_key=MacKey(b"k" * 32) if mac else None)
    try:
        payload = memoryview(bytearray(DATA[:size]))
        key = bytes(range(32, 48))
        path = tmp_path / "ns" / "rank0" / key.hex()[:2] / f"{key.hex()}{BLOCK_SUFFIX}"
        assert store.put([(key, payload)]) == [True]
        pristine = path.read_bytes()
        assert len(pristine) == size + HEADER_BYTES
        dest = memoryview(bytearray(size))
        assert store.get_into([(key, dest)]) == [True]
        assert dest.tobytes() == payload.tobytes()
        served = []
        positions = _positions(size, mac=mac)
        for position in positions:
            damaged = bytearray(pristine)
            damaged[position] ^= 0x04
            path.write_bytes(bytes(damaged))
            if store.get_into([(key, memoryview(bytearray(size)))]) != [False] \
                    or path.exists():
                served.append(position)
        assert served == []
        assert store.stats.rejected == len(positions)
        path.write_bytes(pristine)  # and the intact file is still served
        assert store.get_into([(key, dest)]) == [True]
        assert dest.tobytes() == payload.tobytes()
    finally:
        store.close()


def test_a_block_in_the_previous_format_is_dropped_never_served(
        impl: Checksums, tmp_path: Path) -> None:
    """Format 2 (a 122-byte header, the payload unaligned) is read as damaged and removed."""
    store = DiskStore(str(tmp_path), "ns", 0, bytes(range(16)), fsync=False, using=impl)
    try:
        key, payload = bytes(range(32, 48)), DATA[:5000]
        fields = bytearray(header_fields(bytes(range(16)), 0, key, len(payload)))
        fields[4:6] = (2).to_bytes(2, "little")
        checksum = xxhash.xxh3_64_intdigest(bytes(fields) + payload)
        old = bytes(fields) + checksum.to_bytes(8, "little") + bytes(MAC_BYTES) + payload
        path = tmp_path / "ns" / "rank0" / key.hex()[:2] / f"{key.hex()}{BLOCK_SUFFIX}"
        path.parent.mkdir(parents=True)
        path.write_bytes(old)
        assert store.get_into([(key, memoryview(bytearray(len(payload))))]) == [False]
        assert store.stats.rejected == 1
        assert not path.exists()
    finally:
        store.close()


def test_a_block_with_its_header_first_is_dropped_never_served(
        impl: Checksums, tmp_path: Path) -> None:
    """A file of the right size with its header first (the disk layout of earlier releases)
    is read as damaged and removed: its last 128 bytes are payload, not a header."""
    store = DiskStore(str(tmp_path), "ns", 0, bytes(range(16)), fsync=False, using=impl)
    try:
        key, payload = bytes(range(32, 48)), DATA[:5000]
        fields = header_fields(bytes(range(16)), 0, key, len(payload))
        old = encode_header(bytes(range(16)), 0, key, payload) + payload
        assert old[:FIELDS_BYTES] == fields
        path = tmp_path / "ns" / "rank0" / key.hex()[:2] / f"{key.hex()}{BLOCK_SUFFIX}"
        path.parent.mkdir(parents=True)
        path.write_bytes(old)
        dest = memoryview(bytearray(len(payload)))
        assert store.get_into([(key, dest)]) == [False]
        assert store.stats.rejected == 1
        assert not path.exists()
    finally:
        store.close()
