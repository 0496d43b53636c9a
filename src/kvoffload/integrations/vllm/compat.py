"""What the installed vLLM offers that the connector must honour or refuse (0.32 to 0.34).

Detected from the objects vLLM hands over, not from its version number, so a patch
release or a backport is handled by what it does. ``docs/vllm.md`` ("What changed in
vLLM 0.33", "What changed in vLLM 0.34") lists every change a connector sees and what
kvoffload does about each; the ones refused at start-up are checked here, each with what
to change:

* **Draft-model KV of speculative decoding** (``speculative_draft_kv``): the layers of
  an EAGLE, EAGLE-3 or MTP drafter hold at a position KV computed from the token after it,
  rewritten until the speculated tokens after it are verified; a separate draft model's
  KV is rewritten in the same way. vLLM 0.33 and 0.34 mark an EAGLE or MTP drafter's
  layers (``KVCacheSpec.is_draft``; with the trailing-block drop on, every group holding
  one is ``is_eagle_group``, also when they are merged into a target group); kvoffload
  keys, stores and hits such a group's blocks ``num_speculative_tokens + 1`` tokens late
  (``GroupSpec.proof_tokens``). Where vLLM marks none (0.32, a separate draft model,
  ``disable_eagle_block_drop``) every group is keyed late (``DraftKV.every_group``), which
  ``translate`` accepts only where every group is full attention. Refused, each with what
  to change: drafters kvoffload has no rule for (DFlash, DSpark, hidden-state extraction,
  a custom method) and a proof longer than one block (in ``translate``). Speculative
  methods without draft KV (n-gram, suffix) need nothing.
* **Sleep mode** (``enable_sleep_mode``): vLLM 0.33 and 0.34 ask ``supports_sleep_mode``
  and call ``unregister_kv_caches`` / ``restore_kv_caches`` around it; the worker role keeps
  views of vLLM's cache tensors for the transfers it has in flight, so kvoffload answers
  False there and refuses the option on 0.32, which asks nothing. vLLM 0.34's extensible
  KV cache also gives the caches' memory back without sleep mode
  (``release_kv_cache_memory``, a weight update that borrows it); it calls the same two
  hooks, and the connector follows them: every transfer is waited for and none runs until
  the memory is restored (``WorkerSide.unregister``).
* **Lookahead block hashes** (``num_hash_lookahead_tokens``): 0.33 can publish a block's
  hash only once the tokens after it exist, and such hashes differ from the ones kvoffload
  keys blocks by. vLLM 0.33 turns them off whenever a KV connector is configured; 0.34
  turns them off because the connector declares no support
  (``KVOffloadConnector.supports_lookahead_block_hashes``). An engine where they are on
  anyway is refused rather than offloaded under the wrong keys.

And one difference the worker role adapts to rather than refuses: which model runner calls
it, and so in which order vLLM writes blocks and flushes (``runner_writes_before_flush``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kvoffload.errors import ConfigError

_NO_DRAFT_KV_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})
"""Speculative methods that propose tokens without a draft model's KV cache."""

DRAFT_KV_METHODS = frozenset({"eagle", "eagle3", "mtp", "draft_model"})
"""Speculative methods whose draft KV kvoffload offloads. An EAGLE, EAGLE-3 or MTP
drafter's KV at a position is computed from the target's hidden state there and the token
after it; a separate draft model's from the tokens up to it. Either is final once the
speculated tokens after it are verified (``num_speculative_tokens + 1`` tokens)."""


@dataclass(frozen=True)
class DraftKV:
    """What speculative decoding means for the engine's KV-cache groups.

    Attributes:
        proof_tokens: tokens after a position its draft KV depends on or may still be
            rewritten by (``num_speculative_tokens + 1``); 0 without draft KV.
        every_group: vLLM marks no group as the drafter's (vLLM 0.32, a separate draft
            model, ``disable_eagle_block_drop``): every group is treated as one, which
            is safe where all are full attention and costs the target one block of
            every hit.
    """

    proof_tokens: int = 0
    every_group: bool = False


NO_DRAFT_KV = DraftKV()

_UNSUPPORTED_DRAFTERS = {
    "dflash": "DFlash builds its draft KV from the target's hidden states alone and "
              "vLLM marks none of its groups",
    "dspark": "DSpark builds its draft KV from the target's hidden states alone and "
              "vLLM marks none of its groups",
    "extract_hidden_states": "it keeps the target's hidden states in a KV-cache layer, "
                             "which is not a prefix cache",
}


def check_engine_features(vllm_config: Any, kv_cache_config: Any) -> DraftKV:
    """Raise ``ConfigError`` for an engine feature the connector cannot honour; return what
    speculative decoding means for the groups (``speculative_draft_kv``)."""
    draft = speculative_draft_kv(vllm_config, kv_cache_config)
    model = getattr(vllm_config, "model_config", None)
    if getattr(model, "enable_sleep_mode", False):
        raise ConfigError("enable_sleep_mode", "is on, and kvoffload's connector does not "
                          "follow vLLM's sleep and wake-up of the KV cache",
                          "Start vLLM without --enable-sleep-mode, or without the "
                          "kvoffload connector.")
    lookahead = getattr(vllm_config, "num_hash_lookahead_tokens", 0)
    if isinstance(lookahead, int) and lookahead > 0:
        raise ConfigError("num_hash_lookahead_tokens", f"is {lookahead}: vLLM publishes "
                          "lookahead block hashes, which kvoffload does not key blocks by",
                          "Set speculative_config.disable_lookahead_block_hashes to true.")
    return draft


def runner_writes_before_flush(vllm_config: Any) -> bool:
    """Whether vLLM's model runner may write engine blocks before it calls the connector's
    ``handle_preemptions``: the V2 runner zeroes newly allocated blocks, applies
    copy-on-write block copies and copies Mamba states across block boundaries first, then
    calls the connector. It is the only runner of vLLM 0.34 (which has no
    ``use_v2_model_runner`` to ask) and optional in 0.32 and 0.33 (on CUDA with Triton by
    default). The V1 runner calls ``handle_preemptions`` first."""
    return bool(getattr(vllm_config, "use_v2_model_runner", True))


def marks_draft_layers() -> bool:
    """Whether the installed vLLM marks a draft model's layers (``KVCacheSpec.is_draft``,
    from 0.33). vLLM 0.32 sets ``is_eagle_group`` only by guesses (the model's last layer,
    a non-causal spec), which may miss a draft layer merged into a target group."""
    try:
        from vllm.v1.kv_cache_interface import KVCacheSpec
    except ImportError:  # pragma: no cover - the connector needs vLLM anyway
        return False
    return "is_draft" in {f.name for f in dataclasses.fields(KVCacheSpec)}


def is_draft_group(group: Any) -> bool:
    """Whether a KV-cache group holds a draft model's layers: vLLM marks it
    ``is_eagle_group``, or its spec (or one of its per-layer specs) is ``is_draft``. A
    group with one draft layer is a draft group as a whole (vLLM 0.33 and 0.34 merge
    draft layers into a target group when their specs match)."""
    if getattr(group, "is_eagle_group", False):
        return True
    spec = group.kv_cache_spec
    if getattr(spec, "is_draft", False):
        return True
    per_layer = getattr(spec, "kv_cache_specs", None)
    return isinstance(per_layer, dict) and any(getattr(s, "is_draft", False)
                                               for s in per_layer.values())


def draft_layers(kv_cache_config: Any) -> list[str]:
    """Layers of the groups that hold a draft model's layers (``is_draft_group``), in
    group order; of a group with per-layer specs, the layers marked ``is_draft``."""
    found: list[str] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        if isinstance(per_layer, dict) and any(getattr(s, "is_draft", False)
                                               for s in per_layer.values()):
            found.extend(name for name, s in per_layer.items() if getattr(s, "is_draft", False))
        elif is_draft_group(group):
            found.extend(group.layer_names)
    return found


def speculative_draft_kv(vllm_config: Any, kv_cache_config: Any) -> DraftKV:
    """What the engine's speculative decoding means for its KV-cache groups (``DraftKV``):
    with an EAGLE, EAGLE-3 or MTP drafter or a separate draft model, proof tokens
    ``num_speculative_tokens + 1`` for the groups vLLM marks as the drafter's, which
    ``translate`` then keys, stores and hits that many tokens late; or, where vLLM marks
    none, for every group. ``NO_DRAFT_KV`` without draft KV (no speculation, n-gram,
    suffix).

    Raises:
        ConfigError: draft KV kvoffload cannot prove final (the message says which and
            why, and what to change).
    """
    spec = getattr(vllm_config, "speculative_config", None)
    drafts = draft_layers(kv_cache_config)
    shown = ", ".join(drafts[:4]) + (", ..." if len(drafts) > 4 else "")
    layers = f" (draft layers: {shown})" if drafts else ""
    method = getattr(spec, "method", None)
    if spec is None:
        if drafts:
            raise ConfigError("speculative_config", f"is not set, yet vLLM marks draft-model "
                              f"KV-cache layers{layers}",
                              "Report this configuration; kvoffload cannot tell which "
                              "blocks a drafter rewrites.")
        return NO_DRAFT_KV
    uses_draft_kv = getattr(spec, "uses_draft_kv_cache", None)
    has_draft_kv = (uses_draft_kv() if callable(uses_draft_kv)
                    else method not in _NO_DRAFT_KV_METHODS)
    if not has_draft_kv and not drafts:
        return NO_DRAFT_KV
    fix = ("Use speculative decoding without a draft model (method 'ngram' or 'suffix'), "
           "an EAGLE, EAGLE-3 or MTP drafter, a separate draft model, or none.")
    custom = getattr(spec, "custom_method", None)
    if custom:
        raise ConfigError("speculative_config.method",
                          f"is the custom method {custom!r} (based on {method!r}): kvoffload "
                          f"has no rule for when its draft KV-cache layers{layers} are final",
                          fix)
    if method not in DRAFT_KV_METHODS:
        why = _UNSUPPORTED_DRAFTERS.get(str(method), "kvoffload has no rule for when its "
                                        "draft KV is final")
        raise ConfigError("speculative_config.method",
                          f"method {method!r} gives the draft model KV-cache layers{layers}, "
                          f"which kvoffload cannot prove final: {why}", fix)
    proof = int(spec.num_speculative_tokens) + 1
    drop = getattr(spec, "use_eagle_block_drop", None)
    marked = bool(drafts) and marks_draft_layers() and not (callable(drop) and not drop())
    # Unmarked (vLLM 0.32 has no is_draft; a separate draft model's groups, or those
    # under disable_eagle_block_drop, carry no is_eagle_group): the drafter's layers may
    # sit in any group, so every group is keyed late.
    return DraftKV(proof, every_group=not marked)
