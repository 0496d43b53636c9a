"""Chained block hashes and offload keys (keys.py): what identifies a
prefix, and hashes that agree across processes (a disk or shared tier needs them).

A block hash identifies a whole prefix: tokens, LoRA adapter, multimodal inputs and the
tenant salt all change it, and it must be the same in every process (disk and shared tiers
serve blocks stored by another process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvoffload.keys import (
    BlockHash,
    BlockHasher,
    HashAlgorithm,
    HashContext,
    MultiModalSpan,
    hash_block,
    key_block_hash,
    key_group,
    make_offload_key,
    root_hash,
)

TOKENS = list(range(100, 164))  # 4 blocks of 16


def hex_hashes(hashes: list[BlockHash]) -> list[str]:
    return [h.hex() for h in hashes]


def test_hashes_are_identical_across_processes_with_different_hash_seeds() -> None:
    # Python's hash() is salted per process; block hashes must not be.
    code = textwrap.dedent("""
        from kvoffload.keys import BlockHasher, HashAlgorithm, HashContext, MultiModalSpan
        ctx = HashContext(lora_name="ad", cache_salt="t1",
                          multimodal=(MultiModalSpan(20, 8, "img"),))
        for algo in HashAlgorithm:
            hasher = BlockHasher(16, algo=algo)
            print(",".join(h.hex() for h in hasher.hashes(list(range(100, 164)), ctx)))
    """)
    outputs = set()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout
        outputs.add(out)
    assert len(outputs) == 1
    ctx = HashContext(lora_name="ad", cache_salt="t1", multimodal=(MultiModalSpan(20, 8, "img"),))
    here = "".join(",".join(hex_hashes(BlockHasher(16, algo=a).hashes(TOKENS, ctx))) + "\n"
                   for a in HashAlgorithm)
    assert outputs == {here}


def test_only_full_blocks_are_hashed_and_extend_is_incremental() -> None:
    hasher = BlockHasher(16)
    assert len(hasher.hashes(TOKENS[:15])) == 0
    assert len(hasher.hashes(TOKENS[:47])) == 2
    grown: list[BlockHash] = []
    for n in (3, 16, 17, 40, 64):
        hasher.extend(grown, TOKENS[:n])
    assert grown == hasher.hashes(TOKENS)


def test_a_hash_names_the_whole_prefix() -> None:
    hasher = BlockHasher(16)
    base = hasher.hashes(TOKENS)
    changed = list(TOKENS)
    changed[20] = 0  # a token in block 1
    other = hasher.hashes(changed)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:], strict=True))
    # Two prompts that differ only in their last token share every block but the last.
    last = [*TOKENS[:-1], 0]
    assert hasher.hashes(last)[:3] == base[:3] and hasher.hashes(last)[3] != base[3]


def test_salt_enters_the_first_block_only_and_the_chain_carries_it() -> None:
    ctx = HashContext(cache_salt="tenant-a")
    assert ctx.extra_keys(0, 16) != b""
    assert ctx.extra_keys(16, 32) == b""  # later blocks do not see the salt ...
    hasher = BlockHasher(16)
    plain = hasher.hashes(TOKENS)
    salted = hasher.hashes(TOKENS, ctx)
    other = hasher.hashes(TOKENS, HashContext(cache_salt="tenant-b"))
    # ... yet every hash differs, because each block chains on its parent.
    assert all(len({p, s, o}) == 3 for p, s, o in zip(plain, salted, other, strict=True))


def test_lora_changes_every_block() -> None:
    hasher = BlockHasher(16)
    plain = hasher.hashes(TOKENS)
    a = hasher.hashes(TOKENS, HashContext(lora_name="a"))
    b = hasher.hashes(TOKENS, HashContext(lora_name="b"))
    assert all(len({p, x, y}) == 3 for p, x, y in zip(plain, a, b, strict=True))


def test_multimodal_input_changes_blocks_from_the_first_it_overlaps() -> None:
    hasher = BlockHasher(16)
    plain = hasher.hashes(TOKENS)
    image = hasher.hashes(TOKENS, HashContext(multimodal=(MultiModalSpan(20, 20, "cat"),)))
    other = hasher.hashes(TOKENS, HashContext(multimodal=(MultiModalSpan(20, 20, "dog"),)))
    moved = hasher.hashes(TOKENS, HashContext(multimodal=(MultiModalSpan(21, 20, "cat"),)))
    assert image[0] == plain[0]  # tokens 0-16: before the image
    assert all(len({p, i, o, m}) == 4
               for p, i, o, m in zip(plain[1:], image[1:], other[1:], moved[1:], strict=True))


def test_seed_and_algorithm_give_separate_hash_spaces() -> None:
    xxh = BlockHasher(16).hashes(TOKENS)
    sha = BlockHasher(16, algo=HashAlgorithm.SHA256).hashes(TOKENS)
    seeded = BlockHasher(16, seed="model-b").hashes(TOKENS)
    assert {len(h) for h in xxh} == {16}  # xxh3-128
    assert {len(h) for h in sha} == {32}  # sha-256
    assert not set(xxh) & set(sha) and not set(xxh) & set(seeded)
    assert root_hash("x") != root_hash("y")
    assert root_hash("x", HashAlgorithm.SHA256) != root_hash("x")


def test_encoding_is_unambiguous() -> None:
    # Length prefixes: moving bytes between tokens and extra keys changes the hash.
    root = root_hash()
    assert hash_block(root, [1, 2]) != hash_block(root, [1], b"\x02" + b"\x00" * 7)
    assert hash_block(root, [1, 2], b"x") != hash_block(root, [1, 2])
    # Token ids are 64-bit: large and negative ids hash without collision.
    assert hash_block(root, [2**40]) != hash_block(root, [0])
    assert hash_block(root, [-1]) != hash_block(root, [2**63 - 1])


def test_offload_keys_pack_hash_and_group() -> None:
    h = BlockHasher(16).hashes(TOKENS)[0]
    keys = [make_offload_key(h, g) for g in (0, 1, 65535)]
    assert len(set(keys)) == 3  # one prefix, a separate key per group
    assert [key_group(k) for k in keys] == [0, 1, 65535]
    assert {key_block_hash(k) for k in keys} == {h}
    for bad in (-1, 65536):
        with pytest.raises(ValueError, match="group index"):
            make_offload_key(h, bad)


def test_block_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BlockHasher(0)
