"""The models of ``vllm_e2e.py``: realistic shapes, random weights, made at run time.

Nothing is downloaded. Each model is a ``transformers`` config with random weights, saved
to a directory vLLM loads with ``LLM(model=path, skip_tokenizer_init=True)``: prompts are
token ids, so no tokenizer is needed. The shapes are those of small production models
scaled to 8 layers and a hidden size of 512 (24M to 30M parameters outside the embedding),
large enough that a 4k-token prefill takes seconds on vLLM's CPU backend:

* ``llama``: Llama-shaped, full attention only (8 query heads, 2 KV heads of 64).
* ``gemma3``: Gemma-3-like, sliding-window layers (a 512-token window) with a full-attention
  layer after every five, one KV head of 128.
* ``granite``: Granite-4.0-hybrid-like, Mamba2 layers with an attention layer after every
  three.

``initializer_range`` is large enough that greedy outputs depend on the whole context, so
KV loaded from the wrong place, or damaged, changes them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 32000
HIDDEN = 512
LAYERS = 8
INTERMEDIATE = 1536
MAMBA_CHUNK = 256

_SPECIAL_IDS = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
FIRST_ORDINARY_TOKEN = 3
"""Prompts use token ids from here up to ``VOCAB``: below are the special tokens."""


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                       num_hidden_layers=LAYERS, num_attention_heads=8,
                       num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                       tie_word_embeddings=True, initializer_range=0.05, **_SPECIAL_IDS)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    # Gemma 3's five sliding layers per full one, cut to 8 layers: 6 sliding, 2 full.
    layer_types = ["sliding_attention"] * 5 + ["full_attention", "sliding_attention",
                                                "full_attention"]
    return Gemma3TextConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                            intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                            num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                            query_pre_attn_scalar=128, sliding_window=512,
                            layer_types=layer_types,
                            max_position_embeddings=32768, initializer_range=0.05,
                            **_SPECIAL_IDS)


def _granite() -> Any:
    from transformers import GraniteMoeHybridConfig

    layer_types = (["mamba"] * 3 + ["attention"]) * (LAYERS // 4)
    return GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, shared_intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2,
        layer_types=layer_types, num_local_experts=0, position_embedding_type="rope",
        mamba_n_heads=16, mamba_d_head=64, mamba_d_state=64, mamba_n_groups=1,
        mamba_expand=2, mamba_chunk_size=MAMBA_CHUNK, max_position_embeddings=32768,
        tie_word_embeddings=True, initializer_range=0.05, **_SPECIAL_IDS)


ATTENTION_BYTES_PER_TOKEN_LAYER = 2 * 128 * 4
"""Keys and values of one token in one attention layer, float32: the same in all three
models (2 KV heads of 64, or 1 of 128)."""


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: how to build it, and the KV-cache groups vLLM makes of it.

    ``groups`` lists vLLM's KV-cache groups as ``(kind, layers)``, kind ``"full"``,
    ``"sliding"`` or ``"mamba"``; ``block_size`` is the block size vLLM picks (its CPU
    default of 128 tokens, or for the Mamba hybrid the smallest multiple of 128 whose
    attention page holds a Mamba state). The benchmark checks both against the engine it
    starts. ``step_tokens`` is ``max_num_batched_tokens``: a Mamba hybrid with prefix
    caching on the CPU backend needs steps of exactly one block.
    """

    name: str
    summary: str
    make_config: Callable[[], Any]
    groups: tuple[tuple[str, int], ...]
    block_size: int = 128
    step_tokens: int = 2048
    sliding_window: int = 0

    def engine_cache_bytes(self, max_model_len: int, requests: float) -> int:
        """``kv_cache_memory_bytes`` for a vLLM cache that holds ``requests`` requests of
        ``max_model_len`` tokens, counted as vLLM counts them: every group draws blocks
        from one pool, a full-attention group needs the whole request, a sliding-window
        group its window plus one step, a Mamba group (``align`` mode) three blocks."""
        blocks = 0
        for kind, _ in self.groups:
            if kind == "full":
                blocks += -(-max_model_len // self.block_size)
            elif kind == "sliding":
                window = min(self.sliding_window - 1 + self.step_tokens, max_model_len)
                blocks += -(-window // self.block_size) + 1
            else:
                blocks += 3
        layers_per_group = max(n for _, n in self.groups)
        bytes_per_block = self.block_size * ATTENTION_BYTES_PER_TOKEN_LAYER * layers_per_group
        return int(-(-blocks * requests // 1)) * bytes_per_block

    def kv_bytes(self, tokens: int) -> int:
        """Bytes kvoffload keeps for a ``tokens``-token prefix stored for one hit at its
        end: every full-attention block, the window of each sliding layer, one state of
        each Mamba layer (the Mamba state is as large as one attention block)."""
        total = 0
        for kind, layers in self.groups:
            if kind == "full":
                span = tokens
            elif kind == "sliding":
                span = min(tokens, self.sliding_window + self.block_size)
            else:
                span = self.block_size
            total += span * layers * ATTENTION_BYTES_PER_TOKEN_LAYER
        return total


MODELS: dict[str, ModelSpec] = {
    spec.name: spec for spec in (
        ModelSpec("llama", "Llama-shaped, 8 full-attention layers", _llama,
                  groups=(("full", 8),)),
        ModelSpec("gemma3", "Gemma-3-like, 6 sliding-window (512) + 2 full-attention layers",
                  _gemma3, groups=(("sliding", 2),) * 3 + (("full", 2),),
                  sliding_window=512),
        ModelSpec("granite", "Granite-4.0-hybrid-like, 6 Mamba2 + 2 attention layers",
                  _granite, groups=(("mamba", 2),) * 3 + (("full", 2),), block_size=384,
                  step_tokens=384),
    )
}


def parse_models(text: str) -> list[ModelSpec]:
    """``"llama,granite"`` (or ``"all"``) as specs; a clear error for an unknown name."""
    names = list(MODELS) if text.strip() == "all" else [n.strip() for n in text.split(",")
                                                        if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown or not names:
        raise ValueError(f"--models: unknown model {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(MODELS)} or 'all'")
    return [MODELS[n] for n in dict.fromkeys(names)]


@dataclass(frozen=True)
class BuiltModel:
    """A model directory on disk and what it holds."""

    spec: ModelSpec
    path: Path
    parameters: int
    embedding_parameters: int


def build_model(spec: ModelSpec, root: Path) -> BuiltModel:
    """Create ``spec``'s model with random weights (seed 0) under ``root/spec.name``.

    A directory made earlier (its ``config.json`` and ``e2e_model.json`` exist) is
    reused as it is.
    """
    out = root / spec.name
    info = out / "e2e_model.json"
    if not info.exists():
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        out.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(spec.make_config())
        model.save_pretrained(out)
        embedding = model.get_input_embeddings().weight.numel()
        info.write_text(json.dumps({"parameters": sum(p.numel() for p in model.parameters()),
                                    "embedding_parameters": embedding}))
        del model
    counts = json.loads(info.read_text())
    return BuiltModel(spec, out, counts["parameters"], counts["embedding_parameters"])
