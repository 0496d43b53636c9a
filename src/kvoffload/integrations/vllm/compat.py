"""What the installed vLLM offers that the connector must honour or refuse (0.32 to 0.34).

Detected from the objects vLLM hands over, not from its version number, so a patch
release or a backport is handled by what it does. ``docs/vllm.md`` ("What changed in
vLLM 0.33", "What changed in vLLM 0.34") lists every change a connector sees and what
kvoffload does about each; the ones refused at start-up are checked here, each with what
to change:

* **Draft-model KV of speculative decoding** (EAGLE, MTP, a draft model): vLLM 0.33 marks
  draft layers (``KVCacheSpec.is_draft``) but merges them into the target's groups when
  their specs match, and the last block of a draft layer changes while it decodes. Stored
  as the target's, such blocks would load draft KV that no longer matches. Speculative
  methods without draft KV (n-gram, suffix) are fine.
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

from typing import Any

from kvoffload.errors import ConfigError

_NO_DRAFT_KV_METHODS = frozenset({"ngram", "ngram_gpu", "suffix"})
"""Speculative methods that propose tokens without a draft model's KV cache."""


def check_engine_features(vllm_config: Any, kv_cache_config: Any) -> None:
    """Raise ``ConfigError`` for an engine feature the connector cannot honour."""
    _check_speculative(vllm_config, kv_cache_config)
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


def runner_writes_before_flush(vllm_config: Any) -> bool:
    """Whether vLLM's model runner may write engine blocks before it calls the connector's
    ``handle_preemptions``: the V2 runner zeroes newly allocated blocks, applies
    copy-on-write block copies and copies Mamba states across block boundaries first, then
    calls the connector. It is the only runner of vLLM 0.34 (which has no
    ``use_v2_model_runner`` to ask) and optional in 0.32 and 0.33 (on CUDA with Triton by
    default). The V1 runner calls ``handle_preemptions`` first."""
    return bool(getattr(vllm_config, "use_v2_model_runner", True))


def draft_layers(kv_cache_config: Any) -> list[str]:
    """Layers vLLM marks as a draft model's (``is_draft``, from vLLM 0.33), in group order."""
    found: list[str] = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        if isinstance(per_layer, dict):
            found.extend(name for name, s in per_layer.items() if getattr(s, "is_draft", False))
        elif getattr(spec, "is_draft", False) or getattr(group, "is_eagle_group", False):
            found.extend(group.layer_names)
    return found


def _check_speculative(vllm_config: Any, kv_cache_config: Any) -> None:
    spec = getattr(vllm_config, "speculative_config", None)
    drafts = draft_layers(kv_cache_config)
    if spec is None and not drafts:
        return
    method = getattr(spec, "method", None)
    uses_draft_kv = getattr(spec, "uses_draft_kv_cache", None)
    if drafts or (callable(uses_draft_kv) and uses_draft_kv()) \
            or (not callable(uses_draft_kv) and method not in _NO_DRAFT_KV_METHODS):
        shown = ", ".join(drafts[:4]) + (", ..." if len(drafts) > 4 else "")
        layers = f" (draft layers: {shown})" if drafts else ""
        raise ConfigError("speculative_config", f"method {method!r} gives the draft model "
                          f"KV-cache layers{layers}, which kvoffload cannot keep apart from "
                          "the target model's",
                          "Use speculative decoding without a draft model "
                          "(method 'ngram' or 'suffix'), or turn it off.")
