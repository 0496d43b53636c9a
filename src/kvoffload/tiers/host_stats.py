"""The host tier's cumulative counters (``HostTier.stats``), kept apart from its
bookkeeping so metrics and reports read them without the tier's logic."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class HostTierStats:
    """Cumulative counters of one ``HostTier`` (plain data; ``reset`` keeps them).

    Attributes:
        lookup_hits / lookup_misses / lookup_pending: ``lookup`` answers.
        keys_loaded: keys pinned by ``prepare_load``.
        keys_deduped: ``prepare_store`` input keys skipped as already present.
        keys_reserved: keys given a slot by ``prepare_store``.
        stores_rejected: ``prepare_store`` calls answered ``None`` (no room).
        keys_stored: keys made readable by ``complete_store``.
        keys_store_failed: keys dropped by ``complete_store(success=False)``.
        keys_evicted: keys evicted to make room.
    """

    lookup_hits: int = 0
    lookup_misses: int = 0
    lookup_pending: int = 0
    keys_loaded: int = 0
    keys_deduped: int = 0
    keys_reserved: int = 0
    stores_rejected: int = 0
    keys_stored: int = 0
    keys_store_failed: int = 0
    keys_evicted: int = 0
