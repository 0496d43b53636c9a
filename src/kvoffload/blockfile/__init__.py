"""The stored block's format: what the disk tier's files and the remote tier's values hold.

* ``framing``: the 128-byte header (what the block is, its checksum and MAC) and its
  checks; ``MacKey``.
* ``checksum``: the checksum (XXH3-64), natively fused with the disk reads and writes
  (``_checksum.c``) or from the ``xxhash`` package, and the atomic file store.

The worker writes and reads frames (``kvoffload.worker.disk_frames``, ``remote_store``);
the tiers' bookkeeping only reads the format's sizes. Importable without torch.
"""
