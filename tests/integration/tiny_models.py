"""Tiny causal LMs with random weights and a locally trained tokenizer, for vLLM e2e tests.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on a few sentences,
and every model comes from a ``transformers`` config with random weights, saved to a
directory vLLM loads with ``LLM(model=path)``. Sizes follow what vLLM's CPU backend
accepts (head_dim >= 32); ``initializer_range`` is large enough that the greedy output
depends on the context, so a corrupted KV cache changes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a hybrid model mixes sliding window attention with full attention layers",
    "mamba layers keep one recurrent state per sequence instead of keys and values",
    "offloading moves cache blocks from the accelerator to host memory and back",
    "every prompt shares a long system prefix before the user turn begins",
]

VOCAB = 1000
SPECIAL = ["<s>", "</s>", "<pad>"]

COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "max_position_embeddings": 1024,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": True,
}


def train_tokenizer(out: Path) -> None:
    """Train a byte-level BPE on ``CORPUS`` and save it as a fast tokenizer in ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(out)


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**COMMON, num_hidden_layers=2, initializer_range=0.2)


def _gemma3() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**COMMON, num_hidden_layers=4, sliding_window=32,
                            layer_types=["sliding_attention", "full_attention"] * 2,
                            initializer_range=0.05)


def _granite_hybrid() -> Any:
    from transformers import GraniteMoeHybridConfig

    return GraniteMoeHybridConfig(
        **COMMON, num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
        mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
        mamba_expand=2, mamba_chunk_size=64, num_local_experts=0,
        position_embedding_type="rope", initializer_range=0.2)


# Qwen3-Next's gated delta-net state: the decay is ``exp(-A * softplus(a + dt_bias))`` per
# token. transformers draws A per head from [0.01, 16], so a head may forget everything
# within a token and a loaded state then hardly reaches the output. A small A keeps it.
GDN_DECAY = 0.01
# Gain of the attention layers' q/k RMSNorms ((1 + weight) * x). At the default 1 the
# normalised q.k logits stay below sqrt(head_dim) and attention over hundreds of random
# tokens is nearly uniform, so no single early token decides the answer.
QK_NORM_GAIN = 3.0


def _qwen3_next() -> Any:
    """Qwen3-Next: gated delta-net (linear attention) and gated full attention alternating,
    a small MoE on every layer. The CPU GDN kernels need bf16 and linear head dims that are
    a multiple of 32 other than 32 (128, as in the real model)."""
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(
        **{**COMMON, "max_position_embeddings": 4096, "tie_word_embeddings": False},
        num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
        decoder_sparse_step=1, initializer_range=0.2)
    config.tie_word_embeddings = False
    return config


def _tune_qwen3_next(model: Any) -> None:
    """Long-lived GDN states and sharp attention (see ``GDN_DECAY``, ``QK_NORM_GAIN``),
    weights in bf16 as vLLM's CPU GDN kernels run them."""
    import torch

    with torch.no_grad():
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                layer.linear_attn.A_log.fill_(math.log(GDN_DECAY))
            if hasattr(layer, "self_attn"):
                layer.self_attn.q_norm.weight.fill_(QK_NORM_GAIN - 1)
                layer.self_attn.k_norm.weight.fill_(QK_NORM_GAIN - 1)
    model.to(torch.bfloat16)


def _two_kv_heads(make: Callable[[], Any]) -> Callable[[], Any]:
    """``make``'s model with two KV heads (and its Mamba heads), so that each of two
    tensor-parallel ranks holds a shard of its own."""
    def build() -> Any:
        config = make()
        config.num_key_value_heads = 2
        return config
    return build


MODELS: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "gemma3": _gemma3,
    "granite_hybrid": _granite_hybrid,
    # for tensor parallelism over two ranks
    "llama_tp2": _two_kv_heads(_llama),
    "gemma3_tp2": _two_kv_heads(_gemma3),
    "granite_hybrid_tp2": _two_kv_heads(_granite_hybrid),
    "qwen3_next": _qwen3_next,
}

# Changes to a model's random weights after ``from_config``, by model name.
TUNE: dict[str, Callable[[Any], None]] = {"qwen3_next": _tune_qwen3_next}


def make_model(name: str, root: Path) -> Path:
    """Create model ``name`` (a key of ``MODELS``) with its tokenizer under ``root/name``."""
    import torch
    from transformers import AutoModelForCausalLM

    out = root / name
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MODELS[name]())
    if name in TUNE:
        TUNE[name](model)
    model.save_pretrained(out)
    train_tokenizer(out)
    return out
