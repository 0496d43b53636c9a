"""The multi-turn workload of ``vllm_e2e.py``: shared documents, conversations that return.

Every prompt is ``system prompt + document + question``, and each later turn of a
conversation appends the model's previous answer and a new question, as a chat client
resends its history. Several conversations ask about the same document. Requests go out
turn by turn, the conversations of a turn interleaved so that two in a row never share a
document: with vLLM's own prefix cache sized for little more than one request, a
conversation's next turn, and the next conversation about a document, arrive after other
requests have pushed their prefix out of it. That is the case an offloading cache is for.

Prompts are token ids drawn from a seeded generator (no tokenizer): the same shape and
seed give the same documents and questions in every run, and a later turn's prompt holds
the answers that run produced, so outputs that differ between runs show up as differing
prompts too.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from e2e_models import FIRST_ORDINARY_TOKEN, VOCAB


class Kind(Enum):
    """Why a request's prefix may be cached somewhere."""

    NEW_DOCUMENT = "new document"
    """The first request about its document: only the system prompt was seen before."""
    SHARED_DOCUMENT = "shared document"
    """A new conversation about a document an earlier conversation sent."""
    NEXT_TURN = "next turn"
    """A later turn: the whole previous turn (prompt and answer) was seen before."""

    @property
    def is_revisit(self) -> bool:
        """A prefix of thousands of tokens was computed before."""
        return self is not Kind.NEW_DOCUMENT


@dataclass(frozen=True)
class WorkloadShape:
    """Sizes of the workload, in tokens and counts (validated on construction)."""

    system_tokens: int = 256
    documents: int = 2
    document_tokens: int = 3800
    conversations: int = 4
    turns: int = 3
    question_tokens: int = 64
    answer_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        positive = {"--documents": self.documents, "--document-tokens": self.document_tokens,
                    "--conversations": self.conversations, "--turns": self.turns,
                    "--question-tokens": self.question_tokens,
                    "--answer-tokens": self.answer_tokens}
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        if self.system_tokens < 0:
            raise ValueError(f"--system-tokens must be 0 or more, got {self.system_tokens}")
        if self.conversations < self.documents:
            raise ValueError(f"--conversations ({self.conversations}) must be at least "
                             f"--documents ({self.documents}): every document is asked about")

    @property
    def longest_prompt(self) -> int:
        """Tokens of the last turn's prompt."""
        return (self.system_tokens + self.document_tokens + self.turns * self.question_tokens
                + (self.turns - 1) * self.answer_tokens)

    @property
    def longest_request(self) -> int:
        """The last turn's prompt and its answer: what ``max_model_len`` must hold."""
        return self.longest_prompt + self.answer_tokens

    @property
    def num_requests(self) -> int:
        return self.conversations * self.turns


@dataclass(frozen=True)
class Turn:
    """One request of the schedule."""

    index: int
    conversation: int
    turn: int
    document: int
    kind: Kind


def schedule(shape: WorkloadShape) -> list[Turn]:
    """The requests in the order they are sent.

    Conversation ``c`` is about document ``c % documents``; turn ``t`` of every
    conversation goes out before turn ``t + 1`` of any, conversations in order, so that
    neighbours ask about different documents (when there are two or more).
    """
    turns: list[Turn] = []
    seen: set[int] = set()
    for t in range(shape.turns):
        for c in range(shape.conversations):
            doc = c % shape.documents
            if t > 0:
                kind = Kind.NEXT_TURN
            elif doc in seen:
                kind = Kind.SHARED_DOCUMENT
            else:
                kind = Kind.NEW_DOCUMENT
            seen.add(doc)
            turns.append(Turn(len(turns), c, t, doc, kind))
    return turns


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, VOCAB) for _ in range(n)]


@dataclass
class Conversations:
    """Builds each request's prompt from the shape and the answers given so far."""

    shape: WorkloadShape
    _system: list[int] = field(init=False)
    _documents: list[list[int]] = field(init=False)
    _history: dict[int, list[int]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        rng = random.Random(self.shape.seed)
        self._system = _tokens(rng, self.shape.system_tokens)
        self._documents = [_tokens(rng, self.shape.document_tokens)
                           for _ in range(self.shape.documents)]

    def question(self, turn: Turn) -> list[int]:
        rng = random.Random(f"{self.shape.seed}:question:{turn.conversation}:{turn.turn}")
        return _tokens(rng, self.shape.question_tokens)

    def prompt(self, turn: Turn) -> list[int]:
        """``turn``'s prompt: its conversation's history so far plus a new question."""
        history = self._history.get(turn.conversation)
        if history is None:
            if turn.turn != 0:
                raise ValueError(f"conversation {turn.conversation}: turn {turn.turn} "
                                 "before its first turn was answered")
            history = self._system + self._documents[turn.document]
        return history + self.question(turn)

    def record(self, turn: Turn, prompt: Sequence[int], answer: Sequence[int]) -> None:
        """Append ``prompt`` and its ``answer`` to ``turn``'s conversation."""
        self._history[turn.conversation] = list(prompt) + list(answer)


QUICK = WorkloadShape(system_tokens=128, documents=2, document_tokens=1800, conversations=3,
                      turns=2, question_tokens=32, answer_tokens=16)
"""The ``--quick`` shape: 2k-token prompts, 6 requests per model."""
