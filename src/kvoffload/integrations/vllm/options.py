"""The connector's options, read from vLLM's ``kv_connector_extra_config``.

Pure Python (no vLLM import), so the validation is tested on its own. Every problem
raises ``ConfigError`` naming the key as ``kv_connector_extra_config.<key>``, what is
wrong and what to write instead. Unknown keys are errors too: a misspelt key would
otherwise be silently ignored.

Keys (all optional except ``host_memory_bytes``):

==========================  ==========================================================
``host_memory_bytes``       Host memory for offloaded blocks, per rank: a size in the
                            grammar of ``kvoffload.sizes`` (an integer, or ``"8GiB"``,
                            ``"512MiB"``, ``"2GB"``).
``eviction_policy``         A registered policy name: ``"value"`` (default), ``"lru"``,
                            ``"arc"`` or ``"hybrid"`` (``value`` is hybrid-aware: window blocks and
                            Mamba states only at likely hit points, eviction by compute
                            saved per byte; see docs/policy.md).
``block_size_factor``       Engine blocks per offloaded block (default 1).
``tiers``                   Storage tiers, fastest first: ``["host"]`` (default), or
                            host followed by ``"disk"`` and/or ``"remote"`` in lookup
                            order, e.g. ``["host", "disk", "remote"]``.
``max_deferred_steps``      Steps a lookup may answer "ask again later" before it settles
                            for what is readable (default 64) ...
``min_deferral_s``          ... and not before this many seconds (default 0.5): an idle
                            vLLM steps faster than a disk or Redis tier answers.
``load_deadline_s``         Seconds vLLM waits for a load before it gives up and
                            recomputes the request (default 30; ``null``: wait for
                            ever). The late copy still lands: its blocks stay reserved
                            until it does, and nobody reads it.
``staging_bytes``           Device memory the CUDA backend stages copies in, per
                            direction (default 64 MiB, ``DEFAULT_STAGING_BYTES`` of
                            ``kvoffload.worker.cuda``): a size. Jobs are split into
                            chunks that fit; it must hold at least one offloaded block
                            (checked when the caches are registered). Ignored on CPU.
``disk_path``, ...          The lower tiers' settings: every option of
                            ``kvoffload.tiers.config.OPTION_HELP`` except ``tier_order``
                            (the ``tiers`` list gives the order). ``"disk"`` in ``tiers``
                            needs ``disk_path`` and ``disk_capacity``; ``"remote"`` needs
                            ``remote_url``. ``model_id`` defaults to the served model,
                            its revision and dtype (see ``KVOffloadConnector``).
                            The tiers' MAC key comes only from a file
                            (``tier_mac_key_file``) or ``$KVOFFLOAD_TIER_MAC_KEY``,
                            never from a value here (vLLM logs this config).
==========================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvoffload.config import (
    DEFAULT_POLICY,
    MAX_BLOCK_SIZE_FACTOR,
    MAX_DEFERRED_STEPS,
    checked_count,
    checked_min_deferral_s,
)
from kvoffload.errors import ConfigError, shown
from kvoffload.policies import RESERVED_NAMES, cache_policy, cache_policy_names
from kvoffload.sizes import parse_size
from kvoffload.tiers.config import MAC_KEY_ENV, OPTION_HELP, TierConfig

PREFIX = "kv_connector_extra_config"
AVAILABLE_TIERS = ("host", "disk", "remote")
TIER_OPTIONS = tuple(key for key in OPTION_HELP if key != "tier_order")
"""Lower-tier keys the connector accepts, passed to ``TierConfig.from_options``."""
_TIER_ENABLER = {"disk": "disk_path", "remote": "remote_url"}
DEFAULT_LOAD_DEADLINE_S = 30.0
"""A load from host memory takes milliseconds and one from disk or Redis well under a
second; one that is still running after 30 s is stuck (a hung disk or network), and
recomputing beats waiting longer."""
MAX_LOAD_DEADLINE_S = 86_400.0

@dataclass(frozen=True)
class ConnectorOptions:
    """Validated connector options (see the module docstring for the keys)."""

    host_memory_bytes: int
    eviction_policy: str = DEFAULT_POLICY
    block_size_factor: int = 1
    tiers: tuple[str, ...] = ("host",)
    max_deferred_steps: int = 64
    min_deferral_s: float = 0.5
    load_deadline_s: float | None = DEFAULT_LOAD_DEADLINE_S
    tier_config: TierConfig = field(default_factory=TierConfig)
    """The lower tiers (none by default); ``model_id`` empty until the connector fills it."""
    staging_bytes: int | None = None
    """The CUDA backend's staging budget per direction; None: the backend's default."""

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorOptions:
        """Parse and validate ``kv_connector_extra_config``; raise ``ConfigError``."""
        extra = dict(extra or {})
        known = {"host_memory_bytes", "eviction_policy", "block_size_factor", "tiers",
                 "max_deferred_steps", "min_deferral_s", "load_deadline_s", "staging_bytes",
                 *TIER_OPTIONS}
        unknown = sorted(set(extra) - known)
        if unknown:
            name = unknown[0] if len(unknown[0]) <= 80 else shown(unknown[0])
            raise ConfigError(f"{PREFIX}.{name}", "is not a kvoffload option",
                              f"Use only {sorted(known)}.")
        if "host_memory_bytes" not in extra:
            raise ConfigError(f"{PREFIX}.host_memory_bytes", "is missing",
                              'Give the host memory per rank for offloaded blocks, e.g. '
                              '"host_memory_bytes": "8GiB".')
        memory = parse_size(extra["host_memory_bytes"], f"{PREFIX}.host_memory_bytes",
                            minimum=1)
        policy = extra.get("eviction_policy", DEFAULT_POLICY)
        policies = cache_policy_names()
        if isinstance(policy, str) and policy in RESERVED_NAMES:
            cache_policy(policy, f"{PREFIX}.eviction_policy")  # says why it is reserved
        if not isinstance(policy, str) or policy not in policies:
            raise ConfigError(f"{PREFIX}.eviction_policy", f"{shown(policy)} is not a policy",
                              f"Use one of {list(policies)}.")
        factor = checked_count(extra.get("block_size_factor", 1),
                               f"{PREFIX}.block_size_factor", MAX_BLOCK_SIZE_FACTOR,
                               "Use 1 to offload engine blocks as they are, or a small "
                               "integer to group several engine blocks per host block.")
        deferred = checked_count(extra.get("max_deferred_steps", 64),
                                 f"{PREFIX}.max_deferred_steps", MAX_DEFERRED_STEPS,
                                 "Use a small positive number of steps, e.g. 64.")
        min_deferral = checked_min_deferral_s(extra.get("min_deferral_s", 0.5),
                                              f"{PREFIX}.min_deferral_s")
        deadline = _load_deadline(extra.get("load_deadline_s", DEFAULT_LOAD_DEADLINE_S))
        staging = extra.get("staging_bytes")
        staging_bytes = None if staging is None \
            else parse_size(staging, f"{PREFIX}.staging_bytes", minimum=1)
        tiers = _tiers(extra.get("tiers", ["host"]))
        tier_config = _tier_config(tiers, {k: v for k, v in extra.items() if k in TIER_OPTIONS})
        return cls(host_memory_bytes=memory, eviction_policy=policy,
                   block_size_factor=factor, tiers=tiers, max_deferred_steps=deferred,
                   min_deferral_s=min_deferral, load_deadline_s=deadline,
                   tier_config=tier_config, staging_bytes=staging_bytes)


def _load_deadline(value: object) -> float | None:
    field = f"{PREFIX}.load_deadline_s"
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0 < value <= MAX_LOAD_DEADLINE_S:
        raise ConfigError(field, f"must be seconds in (0, {MAX_LOAD_DEADLINE_S:g}] or null, "
                          f"got {shown(value)}", "Use e.g. 30, or null to wait for every load.")
    return float(value)


def _tiers(value: object) -> tuple[str, ...]:
    field = f"{PREFIX}.tiers"
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not names or \
            not all(isinstance(n, str) for n in names):
        raise ConfigError(field, f"{shown(value)} is not a list of tier names",
                          'Use a list such as ["host"].')
    if names[0] != "host":
        raise ConfigError(field, f"the first tier must be 'host', got {shown(names[0])}",
                          'Start the list with "host".')
    for name in names:
        if name not in AVAILABLE_TIERS:
            raise ConfigError(field, f"tier {shown(name)} is not available in this connector",
                              f"Use only {list(AVAILABLE_TIERS)}.")
    if len(set(names)) != len(names):
        raise ConfigError(field, f"{shown(list(names))} lists a tier twice", "List each tier once.")
    return tuple(names)


def _tier_config(tiers: tuple[str, ...], options: dict[str, Any]) -> TierConfig:
    """The lower tiers ``tiers`` lists, built from their options; each listed tier needs
    its enabling option and each enabling option needs its tier listed."""
    for name, enabler in _TIER_ENABLER.items():
        if name in tiers and options.get(enabler) is None:  # an empty one: the tier's check
            raise ConfigError(f"{PREFIX}.{enabler}", f"is missing while tiers lists "
                              f"{name!r}", f"Give {enabler}, or remove {name!r} from tiers.")
        if name not in tiers and enabler in options:
            raise ConfigError(f"{PREFIX}.tiers", f"does not list {name!r} while {enabler} "
                              "is set", f'Add "{name}" to tiers, or remove {enabler}.')
    lower = [name for name in tiers if name != "host"]
    if lower:
        options = {**options, "tier_order": ",".join(lower)}
    try:
        return TierConfig.from_options(options)
    except ConfigError as exc:
        if exc.field == MAC_KEY_ENV:  # not an option: the environment variable
            raise
        raise ConfigError(f"{PREFIX}.{exc.field}", exc.problem, exc.fix) from None
