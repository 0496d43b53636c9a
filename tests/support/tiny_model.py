"""A tiny model directory for the trace converter's tests, built offline.

``make_model(dir)`` writes ``tokenizer.json`` (a word-level tokenizer over ``WORDS`` and a
few special tokens, split on white space, built with the ``tokenizers`` library) and
``tokenizer_config.json`` (special tokens and a simple chat template). Nothing is
downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = [
    "you", "are", "a", "helpful", "assistant", "that", "answers", "briefly", "and", "politely",
    "hello", "hi", "how", "can", "i", "help", "what", "is", "the", "weather", "today", "in",
    "paris", "tell", "me", "joke", "about", "cats", "dogs", "birds", "please", "thanks",
    "sure", "it", "sunny", "rainy", "cold", "warm", "why", "did", "cross", "road", "to", "get",
    "other", "side", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine",
    "ten", "more", "again", "yes", "no", "maybe",
]

TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }} <|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
"""Each message ``<|role|> content <|end|>``, then the generation prompt."""


def make_model(directory: Path, *, template: str | None = TEMPLATE) -> Path:
    """Write the tiny model into ``directory`` (created) and return it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory.mkdir(parents=True, exist_ok=True)
    vocab = {token: i for i, token in enumerate(SPECIAL + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(directory / "tokenizer.json"))
    config: dict[str, object] = {
        "bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken"},
        "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


def render(messages: list[dict[str, str]]) -> str:
    """``TEMPLATE`` rendered by hand (independently of the converter), with the
    generation prompt."""
    return "<s>" + "".join(f"<|{m['role']}|> {m['content']} <|end|>\n"
                           for m in messages) + "<|assistant|>"

