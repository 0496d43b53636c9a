"""Where a block lives in a lower tier: the namespace fingerprint, file paths, remote keys.

Shared by the scheduler side (which scans the disk directory and asks the remote server
which blocks exist) and the workers (which read and write them), so both always agree.

The *namespace* is a fingerprint of everything that decides a block's bytes and key:
the model (``TierConfig.model_id``), the cache layout (groups, block sizes, windows, page
sizes, ``block_size_factor``, tensor-parallel size) and the key scheme. Engines that
differ in any of these never see each other's blocks; engines that agree share them,
across processes and restarts (block hashes are reproducible, see ``kvoffload.keys``).
"""

from __future__ import annotations

import hashlib
import json
import os

from kvoffload.config import OffloadConfig
from kvoffload.tiers.config import TierConfig

BLOCK_SUFFIX = ".kvb"
"""File name suffix of a stored block; temporary files add ``.<pid>.<thread>.tmp``."""
TMP_SUFFIX = ".tmp"


def namespace(config: OffloadConfig, tiers: TierConfig) -> str:
    """A 32-hex-digit fingerprint of model, layout and key scheme (see module docstring)."""
    # A draft group's proof tokens decide which block a key names (``key_lag_blocks``);
    # named only where set, so that every other layout keeps the namespace it had.
    groups = [[g.kind.value, g.block_size, g.sliding_window, g.num_layers, g.page_bytes,
               g.state_alignment, *([g.proof_tokens] if g.proof_tokens else [])]
              for g in config.groups]
    description = {
        "format": 1,
        "model": tiers.model_id,
        "key_scheme": tiers.key_scheme,
        "hash_block_size": config.hash_block_size,
        "block_size_factor": config.block_size_factor,
        "num_workers": config.num_workers,
        "groups": groups,
    }
    blob = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def rank_dir(root: str | os.PathLike[str], ns: str, rank: int) -> str:
    """The directory holding one rank's block files of namespace ``ns``."""
    return os.path.join(os.fspath(root), ns, f"rank{rank}")


def block_path(root: str | os.PathLike[str], ns: str, rank: int, key: bytes) -> str:
    """The file of ``key`` for ``rank``: ``<root>/<ns>/rank<r>/<2 hex>/<key hex>.kvb``.

    The two-hex-digit fan-out keeps directories small with millions of blocks.
    """
    name = key.hex()
    return os.path.join(rank_dir(root, ns, rank), name[:2], name + BLOCK_SUFFIX)


def key_of_file_name(name: str) -> bytes | None:
    """The key a block file name encodes, or None for anything else (temporary files)."""
    if not name.endswith(BLOCK_SUFFIX):
        return None
    try:
        return bytes.fromhex(name[: -len(BLOCK_SUFFIX)])
    except ValueError:
        return None


def remote_key(ns: str, rank: int, key: bytes) -> bytes:
    """The Redis key of ``key`` for ``rank``: ``kvo:<ns>:{<key hex>}:<rank>``.

    The braces are a Redis Cluster hash tag: every rank's copy of one block hashes to the
    same slot, so one multi-key ``EXISTS`` can ask for all of them on one shard, while
    different blocks spread evenly over the slots (and so over every master).
    """
    return b"kvo:%s:{%s}:%d" % (ns.encode(), key.hex().encode(), rank)
