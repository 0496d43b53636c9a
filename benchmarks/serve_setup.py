"""Models and workloads of ``vllm_serve.py``: made at run time, nothing downloaded.

The OpenAI server needs a tokenizer in the model directory, and vLLM's benchmark client
needs one to pick prompt tokens. ``add_word_tokenizer`` writes a word-level tokenizer
whose every id is one word (``w123``), so a prompt of token ids and its text map one to
one. The workloads are Mooncake-format traces (one JSON object a line: ``timestamp``,
``input_length``, ``output_length``, ``hash_ids``), the format of vLLM's ``timed_trace``
dataset, which expands each hash id into ``--timed-trace-chunk-hash-size`` tokens drawn
from a seed of that id: requests that share hash ids share those tokens.

* ``chat_trace``: sessions of a few turns over shared documents (each document read by
  two sessions); a turn's prompt is the session's whole history, so a returning session
  and the second reader of a document can be served from a cache.
* ``mooncake_excerpt``: whole conversations of a Mooncake trace, output lengths capped so
  that two CPU cores can decode them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from e2e_models import MODELS, VOCAB, ModelSpec

SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")
"""Ids 0, 1 and 2, as ``e2e_models`` configures its models."""


def _tiny() -> object:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                       head_dim=64, max_position_embeddings=32768,
                       tie_word_embeddings=True, initializer_range=0.05,
                       bos_token_id=0, eos_token_id=1, pad_token_id=2)


# Two KV heads of 64, as the other models: ``ModelSpec``'s cache sizes count on it.
TINY = ModelSpec("tiny", "Llama-shaped, 2 layers of hidden 64: the engine's step is cheap",
                 _tiny, groups=(("full", 2),))
"""A model whose forward pass costs almost nothing, so the connector's own work and the
server's show."""
SERVE_MODELS: dict[str, ModelSpec] = {"llama": MODELS["llama"], "tiny": TINY}


def add_word_tokenizer(model_dir: Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``model_dir``.

    A word-level tokenizer over ``VOCAB`` ids: ``<s>``, ``</s>``, ``<pad>``, then
    ``w3`` ... ``w{VOCAB-1}``, split on whitespace; decoding joins words with spaces.
    """
    if (model_dir / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), VOCAB)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>",
                                        eos_token="</s>", pad_token="<pad>",
                                        unk_token="<pad>", model_max_length=32768)
    tokenizer.save_pretrained(model_dir)


@dataclass(frozen=True)
class ChatShape:
    """The chat workload: ``sessions`` sessions of ``turns`` turns; sessions ``2k`` and
    ``2k+1`` read the same document of ``document_chunks`` chunks. Every turn adds
    ``turn_chunks`` chunks (the previous answer and a new question) and asks for
    ``output_tokens`` tokens. Turns go out round by round: every session's first turn,
    then every session's second, so a session returns after the others have run."""

    sessions: int = 32
    turns: int = 2
    document_chunks: int = 24
    turn_chunks: int = 1
    output_tokens: int = 32
    system_chunks: int = 2

    def num_requests(self) -> int:
        return self.sessions * self.turns


def chat_trace(shape: ChatShape, chunk_tokens: int, seed: int = 0) -> list[dict[str, object]]:
    """The chat workload as Mooncake-format records (timestamps one second apart).

    Hash ids: ``0 .. system_chunks-1`` the system prompt every request starts with, then
    each document's, then each turn's own; sessions come in a shuffled order each round.
    """
    next_id = shape.system_chunks
    system = list(range(shape.system_chunks))
    documents = []
    for _ in range((shape.sessions + 1) // 2):
        documents.append(list(range(next_id, next_id + shape.document_chunks)))
        next_id += shape.document_chunks
    history = [system + documents[s // 2] for s in range(shape.sessions)]
    rng = random.Random(seed)
    records: list[dict[str, object]] = []
    for _ in range(shape.turns):
        order = list(range(shape.sessions))
        rng.shuffle(order)
        for session in order:
            history[session] = history[session] + list(range(next_id,
                                                             next_id + shape.turn_chunks))
            next_id += shape.turn_chunks
            ids = history[session]
            records.append({"timestamp": len(records) * 1000,
                            "input_length": len(ids) * chunk_tokens,
                            "output_length": shape.output_tokens, "hash_ids": list(ids)})
    return records


def mooncake_excerpt(trace: Path, requests: int, chunk_tokens: int, output_tokens: int,
                     *, max_chunks: int = 40, scan: int = 4000) -> list[dict[str, object]]:
    """Whole conversations of a Mooncake trace, ``requests`` requests in all, in trace
    order, scaled to ``chunk_tokens`` tokens per hash id (``input_length`` cut to that
    many tokens a hash id) and ``output_length`` capped at ``output_tokens``.

    A conversation is the requests (among the first ``scan``) that share their first
    hash id after the system prompt's; those of two requests or more whose prompts have
    at most ``max_chunks`` hash ids are taken in order of their first request. The
    trace's first requests alone share little but the system prompt (4 % of hash ids
    among the first 64): its reuse comes from conversations that return minutes later.
    """
    conversations: dict[int, list[dict[str, object]]] = {}
    with open(trace, encoding="utf-8") as lines:
        for index, line in enumerate(lines):
            if index >= scan:
                break
            if not line.strip():
                continue
            entry = json.loads(line)
            ids = [int(h) for h in entry["hash_ids"]]
            key = ids[1] if len(ids) > 1 else -1 - index
            conversations.setdefault(key, []).append(
                {"timestamp": entry["timestamp"],
                 "input_length": min(int(entry["input_length"]), len(ids) * chunk_tokens),
                 "output_length": max(1, min(int(entry["output_length"]), output_tokens)),
                 "hash_ids": ids})
    chosen: list[dict[str, object]] = []
    for turns in conversations.values():
        fits = all(len(t["hash_ids"]) <= max_chunks for t in turns)
        if len(turns) >= 2 and fits and len(chosen) + len(turns) <= requests:
            chosen.extend(turns)
    if not chosen:
        raise ValueError(f"{trace} holds no conversation of two requests or more")
    return sorted(chosen, key=lambda r: float(str(r["timestamp"])))


def write_trace(records: list[dict[str, object]], path: Path) -> Path:
    """Write ``records`` one JSON object a line; return ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def longest_request(records: list[dict[str, object]]) -> int:
    """Tokens of the longest prompt plus its answer (the server's ``max_model_len``)."""
    return max(int(str(r["input_length"])) + int(str(r["output_length"])) for r in records)
