"""Group specs and the offload configuration.

A model's KV cache is split into *groups*; every layer of a group shares one block table.
Each group is one of three kinds (see ``GroupKind``). ``OffloadConfig`` holds the groups
and the global offload settings, validates them at construction and derives the numbers
the planner and the worker use (``ResolvedGroup``).

Every invalid value raises ``ConfigError`` naming the field and what to change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvoffload.errors import ConfigError, shown
from kvoffload.group_kinds import KIND_RULES, GroupKind, KindRules

__all__ = ["DEFAULT_POLICY", "GroupKind", "GroupSpec", "OffloadConfig", "ResolvedGroup"]

DEFAULT_POLICY = "value"
"""The cache policy every entry point uses unless told otherwise: the library's
``OffloadConfig``, the vLLM connector, ``kvoffload simulate`` and the simulator's
``SimulationConfig``. The hybrid-aware policy: in every sweep of ``docs/policy.md`` ("The
default") it serves at most 0.26 points fewer prompt tokens than LRU, and reaches 90 % of
the unbounded hit rate with 0.34x to 1.00x LRU's host memory."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group as the engine lays it out.

    Attributes:
        kind: the group kind.
        block_size: tokens per engine block of this group.
        sliding_window: window length in tokens (sliding-window groups only).
        num_layers: layers in the group (each holds one page per engine block).
        page_bytes: bytes of one engine block of one layer on one rank. For a Mamba group,
            one page is one state snapshot (conv and SSM states together, possibly padded).
        state_alignment: Mamba only: a hit must land on a multiple of this many tokens
            (the engine's state checkpoint interval). Defaults to ``block_size``.
        proof_tokens: full attention only; 0 for a model's own layers. Tokens after a
            position that the group's KV at that position depends on, or that may still
            change it once computed: a draft model's layers under speculative decoding
            (EAGLE, MTP), whose KV at a position is computed from the token after it and
            rewritten once the speculated tokens after it are verified
            (``num_speculative_tokens + 1``). Each offloaded block is keyed by the prefix
            that covers those tokens as well, ``ResolvedGroup.key_lag_blocks`` blocks
            further: it is stored only once they are computed, and hit only by a request
            that shares them (``docs/architecture.md``, rule 5).
        name: a label for reports.
    """

    kind: GroupKind
    block_size: int
    sliding_window: int | None = None
    num_layers: int = 1
    page_bytes: int = 0
    state_alignment: int | None = None
    proof_tokens: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        where = f"groups[{self.name or self.kind.value}]"
        if self.block_size <= 0:
            raise ConfigError(f"{where}.block_size", f"must be positive, got {self.block_size}",
                              "Use the engine's block size in tokens, e.g. 16.")
        rules = KIND_RULES[self.kind]
        if rules.takes_window:
            if self.sliding_window is None or self.sliding_window <= 0:
                raise ConfigError(f"{where}.sliding_window",
                                  f"must be a positive token count, got {self.sliding_window}",
                                  "Give the model's attention window, e.g. 128.")
        elif self.sliding_window is not None:
            raise ConfigError(f"{where}.sliding_window",
                              f"is set on a {self.kind.value} group",
                              "Only sliding_window groups take a window; drop it or change kind.")
        if self.num_layers <= 0:
            raise ConfigError(f"{where}.num_layers", f"must be positive, got {self.num_layers}",
                              "Count the layers that share this group's block table.")
        if self.page_bytes < 0:
            raise ConfigError(f"{where}.page_bytes", f"must be >= 0, got {self.page_bytes}",
                              "Give the bytes of one block of one layer on one rank.")
        if self.proof_tokens:
            if self.proof_tokens < 0:
                raise ConfigError(f"{where}.proof_tokens",
                                  f"must be >= 0, got {self.proof_tokens}",
                                  "Give num_speculative_tokens + 1 for a draft model's layers, "
                                  "0 otherwise.")
            if not rules.takes_proof_tokens:
                raise ConfigError(f"{where}.proof_tokens",
                                  f"is set on a {self.kind.value} group",
                                  "Only full-attention groups (a draft model's layers) take "
                                  "proof_tokens.")
        if self.state_alignment is not None:
            if not rules.takes_state_alignment:
                raise ConfigError(f"{where}.state_alignment", "is set on a non-Mamba group",
                                  "Only Mamba groups checkpoint states; drop it.")
            if self.state_alignment <= 0 or self.state_alignment % self.block_size:
                raise ConfigError(f"{where}.state_alignment",
                                  f"{self.state_alignment} is not a positive multiple of "
                                  f"block_size {self.block_size}",
                                  "Use the engine's Mamba checkpoint interval in tokens.")


@dataclass(frozen=True)
class ResolvedGroup:
    """Numbers derived from a ``GroupSpec`` under one ``OffloadConfig``.

    Attributes:
        index: the group's position in ``OffloadConfig.groups``.
        spec: the group spec.
        factor: engine blocks per offloaded block (``block_size_factor``).
        offloaded_block_size: tokens per offloaded block.
        hashes_per_block: hash blocks per offloaded block (>= 1).
        window_blocks: offloaded blocks a hit needs at its end; ``None`` for full attention.
        key_lag_blocks: ``ceil(proof_tokens / offloaded_block_size)``: offloaded block ``b``
            is keyed by the hash at the end of block ``b + key_lag_blocks`` (0: its own).
        alignment: a hit must be a multiple of this many tokens for this group.
        block_bytes: bytes of one offloaded block across the group's layers, on one rank.
        rules: the rules of the group's kind (``kvoffload.group_kinds.KIND_RULES``).
    """

    index: int
    spec: GroupSpec
    factor: int
    offloaded_block_size: int
    hashes_per_block: int
    window_blocks: int | None
    alignment: int
    block_bytes: int
    rules: KindRules = field(repr=False, compare=False)
    key_lag_blocks: int = 0

    def key_hash_index(self, block: int) -> int:
        """The index, in a request's block hashes, of the hash offloaded block ``block``
        is keyed by."""
        return (block + 1 + self.key_lag_blocks) * self.hashes_per_block - 1

    def num_keys(self, num_hashes: int) -> int:
        """Offloaded blocks that have a key once ``num_hashes`` block hashes exist."""
        return max(0, num_hashes // self.hashes_per_block - self.key_lag_blocks)

    @property
    def kind(self) -> GroupKind:
        return self.spec.kind

    @property
    def is_windowed(self) -> bool:
        """True for groups whose old blocks the engine frees while a request runs."""
        return self.window_blocks is not None


HOST_ACCOUNTING = ("slot", "bytes")
"""Accepted ``OffloadConfig.host_accounting`` values."""


MAX_DEFERRAL_S = 60.0

MAX_BLOCK_SIZE_FACTOR = 1024
"""The most engine blocks one offloaded block may group (``block_size_factor``): 16,384
tokens per offloaded block at block size 16. Larger values are typos (a factor beyond any
prompt makes every block partial, so nothing is ever stored)."""
MAX_NUM_WORKERS = 4096
"""The most tensor-parallel ranks (``num_workers``) a configuration may count."""
MAX_DEFERRED_STEPS = 1 << 20
"""The most engine steps a lookup may be deferred in a row (``max_deferred_steps``)."""


def checked_count(value: object, field: str, maximum: int, fix: str) -> int:
    """``value`` as a whole number in ``[1, maximum]``; ``ConfigError`` naming ``field``
    (with ``fix``) for anything else, a bool and a float included."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigError(field, f"must be a positive whole number, at most {maximum:,}, "
                          f"got {shown(value)}", fix)
    return value


def checked_min_deferral_s(value: object, field: str = "min_deferral_s") -> float:
    """``value`` as seconds a deferred lookup waits at least, in ``[0, MAX_DEFERRAL_S]``;
    ``ConfigError`` naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 <= value <= MAX_DEFERRAL_S:
        raise ConfigError(field, f"must be seconds in [0, {MAX_DEFERRAL_S:g}], got {shown(value)}",
                          "Use e.g. 0.5, or 0 to bound by steps only.")
    return float(value)


@dataclass(frozen=True)
class OffloadConfig:
    """Everything the planner and the host tier need to know.

    Attributes:
        groups: the model's KV-cache groups, in the engine's group order.
        hash_block_size: tokens per chained hash block; every group's offloaded block size
            must be a multiple of it.
        block_size_factor: engine blocks per offloaded block (same for every group).
        num_workers: tensor-parallel ranks; a job completes when all have reported it.
        host_capacity_bytes: host memory for offloaded blocks, all groups together, per rank.
        eviction_policy: name of a registered cache policy (``kvoffload.policies``:
            "value", the default, "lru", "arc", "hybrid"); it selects both the tier's
            eviction and what the planner stores. ``kvoffload.offload.build_offload``
            reads it (an unknown name raises ``ConfigError`` there).
        max_deferred_steps: a request told "ask again later" this many times in a row gets
            what is readable instead (no request waits forever). Deferrals that wait on
            a lower tier's outstanding answers (a Redis existence check), or on host room
            to promote into, are bounded in seconds instead (that tier's call timeout,
            the cascade's room wait) and do not count here (``Planner``,
            ``Tier.answer_wait_s``).
        min_deferral_s: and not before this many seconds of the planner's clock (wall
            time under vLLM, modelled time in the simulator) since its first
            "ask again later": an engine with nothing else to do steps every few hundred
            microseconds, faster than a lower tier answers an existence check; 0 (the
            default) bounds deferral by steps alone.
        mamba_states_every_block: Mamba groups only. False (the default; vLLM's "align"
            cache mode): a block holds the state after its last token only if one of the
            request's steps ended exactly there, so that is the only state the planner
            stores. True: the engine checkpoints the state at every block boundary it
            computes, so every real Mamba block of the table holds its boundary state.
        host_accounting: how the host budget is charged. ``"slot"`` (default): every
            offloaded block of any group takes one slot of ``slot_bytes`` (the worker's host
            arena is laid out that way). ``"bytes"``: every block is charged its own group's
            ``block_bytes`` against one budget of ``host_capacity_bytes``, so a small
            full-attention block costs less than a large window block or Mamba state
            (capacity planning; the tier then holds up to ``num_host_slots`` keys).
    """

    groups: tuple[GroupSpec, ...]
    hash_block_size: int
    host_capacity_bytes: int
    block_size_factor: int = 1
    num_workers: int = 1
    eviction_policy: str = DEFAULT_POLICY
    max_deferred_steps: int = 64
    min_deferral_s: float = 0.0
    mamba_states_every_block: bool = False
    host_accounting: str = "slot"
    resolved: tuple[ResolvedGroup, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("groups", "is empty",
                              "Give at least one group (e.g. one full-attention group).")
        if self.hash_block_size <= 0:
            raise ConfigError("hash_block_size", f"must be positive, got {self.hash_block_size}",
                              "Use the engine's prefix-hash block size in tokens.")
        checked_count(self.block_size_factor, "block_size_factor", MAX_BLOCK_SIZE_FACTOR,
                      "Use 1 to offload engine blocks as they are, or a small factor.")
        checked_count(self.num_workers, "num_workers", MAX_NUM_WORKERS,
                      "Use the tensor-parallel size.")
        checked_min_deferral_s(self.min_deferral_s)
        checked_count(self.max_deferred_steps, "max_deferred_steps", MAX_DEFERRED_STEPS,
                      "Bound how many steps a lookup may be deferred, e.g. 64.")
        if self.host_accounting not in HOST_ACCOUNTING:
            raise ConfigError("host_accounting",
                              f"unknown accounting {shown(self.host_accounting)}",
                              f"Use one of {list(HOST_ACCOUNTING)}.")
        resolved = tuple(self._resolve(i, g) for i, g in enumerate(self.groups))
        object.__setattr__(self, "resolved", resolved)
        slot = self.slot_bytes
        if self.host_capacity_bytes < max(slot, 1):
            raise ConfigError("host_capacity_bytes",
                              f"{self.host_capacity_bytes} bytes cannot hold one offloaded block "
                              f"({slot} bytes)",
                              f"Give at least {max(slot, 1)} bytes, typically many GiB.")

    def _resolve(self, index: int, spec: GroupSpec) -> ResolvedGroup:
        factor = self.block_size_factor
        obs = spec.block_size * factor
        where = f"groups[{index}].block_size"
        if obs < self.hash_block_size:
            raise ConfigError(where,
                              f"offloaded block size {obs} is finer than hash_block_size "
                              f"{self.hash_block_size}",
                              "Lower hash_block_size to a common divisor of all block sizes.")
        if obs % self.hash_block_size:
            raise ConfigError(where,
                              f"offloaded block size {obs} (block_size {spec.block_size} x "
                              f"block_size_factor {factor}) is not a multiple of hash_block_size "
                              f"{self.hash_block_size}",
                              "Make hash_block_size a common divisor of every group's block size.")
        rules = KIND_RULES[spec.kind]
        window = rules.window_blocks(spec, obs)
        alignment = rules.alignment(spec, obs)
        return ResolvedGroup(
            index=index, spec=spec, factor=factor, offloaded_block_size=obs,
            hashes_per_block=obs // self.hash_block_size, window_blocks=window,
            alignment=alignment, block_bytes=spec.page_bytes * spec.num_layers * factor,
            rules=rules, key_lag_blocks=-(-spec.proof_tokens // obs),
        )

    @property
    def slot_bytes(self) -> int:
        """Bytes of one host slot: the largest offloaded block of any group (per rank)."""
        return max(g.block_bytes for g in self.resolved)

    @property
    def num_host_slots(self) -> int:
        """Slots the host tier holds; every offloaded block of any group takes one.

        Under ``host_accounting="bytes"`` this is the most keys the byte budget can hold
        (the budget over the smallest non-empty block); the budget itself is enforced by
        the tier.
        """
        slot = self.slot_bytes
        if slot == 0:
            # Accounting-only layouts (no page sizes): capacity counts blocks directly.
            return self.host_capacity_bytes
        if self.host_accounting == "bytes":
            return self.host_capacity_bytes // min(g.block_bytes for g in self.resolved
                                                   if g.block_bytes > 0)
        return self.host_capacity_bytes // slot

    @property
    def charges_bytes(self) -> bool:
        """Whether the host tier charges each key its group's block bytes (see
        ``host_accounting``); false for slot accounting and layouts without page sizes."""
        return self.host_accounting == "bytes" and self.slot_bytes > 0

    @property
    def hit_alignment(self) -> int:
        """Tokens every combined hit is a multiple of (LCM of the groups' alignments)."""
        return math.lcm(*(g.alignment for g in self.resolved))

    @property
    def has_windowed_group(self) -> bool:
        return any(g.is_windowed for g in self.resolved)

    @property
    def states_at_step_ends(self) -> bool:
        """A Mamba group's block holds its boundary state only where a step of the request
        ended there (``mamba_states_every_block`` off and a Mamba group present): the
        planner stores states, and places resume points, only at step ends."""
        return (not self.mamba_states_every_block
                and any(g.rules.holds_state for g in self.resolved))
