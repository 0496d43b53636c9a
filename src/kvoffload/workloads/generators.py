"""Built-in synthetic workloads, deterministic from a seed.

Three shapes of prefix reuse, each a frozen config dataclass with a ``generate()`` method:

* ``ChatWorkload`` (the default): multi-turn conversations. Every session starts with one
  service-wide system prompt; each turn's prompt is the previous prompt + the previous
  answer + new user text. Answers are fixed in advance (``output_tokens``) so the next turn
  repeats exactly what the engine emitted.
* ``SharedPrefixWorkload``: many single-turn users behind one long system prompt,
  optionally split into tenants whose cache salts keep them apart.
* ``AgenticWorkload``: agent sessions whose context grows by an action and a tool output
  each step, and that sometimes branch into sub-agents: each sub-agent starts from the
  parent's whole context plus a sub-task, runs its own steps, and its final answer is
  appended to the parent's context.

Token ids come from ``derive_tokens`` with labels that include the seed; lengths and times
from ``random.Random(seed)``. The same config gives the same requests, token for token.
Arrival times are open loop; ``parent_id`` names the request a prompt extends, for a
replayer that wants to hold a turn until its predecessor finished. Requests are returned
sorted by arrival time (ties keep generation order).
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvoffload.errors import ConfigError
from kvoffload.workloads.request import WorkloadRequest, derive_tokens

Range = tuple[int, int]
"""An inclusive ``(low, high)`` range, drawn uniformly."""


def _check_range(where: str, name: str, value: Range, low: int = 1) -> None:
    lo, hi = value
    if not low <= lo <= hi:
        raise ConfigError(f"{where}.{name}", f"needs {low} <= low <= high, got {value}",
                          f"Give an inclusive (low, high) range with low >= {low}.")


def _check_positive(where: str, name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{where}.{name}", f"must be positive, got {value}",
                          "Give a positive value.")


def _draw(rng: random.Random, value: Range) -> int:
    return rng.randint(value[0], value[1])


def _by_arrival(requests: list[WorkloadRequest]) -> list[WorkloadRequest]:
    return sorted(requests, key=lambda r: r.arrival_s)


@dataclass(frozen=True)
class ChatWorkload:
    """Multi-turn chat sessions (see the module docstring).

    Attributes:
        num_sessions: conversations.
        turns: turns per session.
        system_tokens: the service-wide system prompt every session starts with.
        user_tokens: new user text per turn.
        output_tokens: answer length per turn.
        session_rate_per_s: Poisson arrival rate of new sessions.
        think_time_s: mean (exponential) gap between a turn's arrival and the next.
        seed: the seed of every draw and token.
    """

    num_sessions: int = 32
    turns: Range = (2, 8)
    system_tokens: int = 256
    user_tokens: Range = (32, 512)
    output_tokens: Range = (32, 512)
    session_rate_per_s: float = 0.5
    think_time_s: float = 20.0
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive("chat", "num_sessions", self.num_sessions)
        _check_range("chat", "turns", self.turns)
        _check_range("chat", "user_tokens", self.user_tokens)
        _check_range("chat", "output_tokens", self.output_tokens)
        _check_positive("chat", "session_rate_per_s", self.session_rate_per_s)
        _check_positive("chat", "think_time_s", self.think_time_s)
        if self.system_tokens < 0:
            raise ConfigError("chat.system_tokens", f"must be >= 0, got {self.system_tokens}",
                              "Use 0 for no system prompt.")

    def generate(self) -> list[WorkloadRequest]:
        rng = random.Random(self.seed)
        label = f"chat/{self.seed}"
        system = derive_tokens(f"{label}/system", self.system_tokens)
        requests: list[WorkloadRequest] = []
        start = 0.0
        for s in range(self.num_sessions):
            start += rng.expovariate(self.session_rate_per_s)
            at = start
            context = array(system.typecode, system)
            parent: str | None = None
            for turn in range(_draw(rng, self.turns)):
                prompt = context + derive_tokens(f"{label}/{s}/{turn}/user",
                                                 _draw(rng, self.user_tokens))
                answer = derive_tokens(f"{label}/{s}/{turn}/answer",
                                       _draw(rng, self.output_tokens))
                rid = f"chat-s{s}-t{turn}"
                requests.append(WorkloadRequest(
                    request_id=rid, arrival_s=at, prompt=prompt, output_length=len(answer),
                    session_id=f"chat-s{s}", turn=turn, output_tokens=answer,
                    parent_id=parent))
                context = prompt + answer
                parent = rid
                at += rng.expovariate(1.0 / self.think_time_s)
        return _by_arrival(requests)


@dataclass(frozen=True)
class SharedPrefixWorkload:
    """Single-turn users behind one long system prompt (see the module docstring).

    Attributes:
        num_requests: users (one request each).
        system_tokens: the shared system prompt.
        user_tokens: each user's own text.
        output_tokens: answer length.
        rate_per_s: Poisson arrival rate.
        num_tenants: tenants, assigned round robin; with more than one, request ``i``
            carries cache salt ``f"tenant-{i % num_tenants}"`` so tenants share nothing.
        seed: the seed of every draw and token.
    """

    num_requests: int = 200
    system_tokens: int = 4096
    user_tokens: Range = (16, 512)
    output_tokens: Range = (16, 256)
    rate_per_s: float = 2.0
    num_tenants: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        _check_positive("shared_prefix", "num_requests", self.num_requests)
        _check_positive("shared_prefix", "system_tokens", self.system_tokens)
        _check_range("shared_prefix", "user_tokens", self.user_tokens)
        _check_range("shared_prefix", "output_tokens", self.output_tokens)
        _check_positive("shared_prefix", "rate_per_s", self.rate_per_s)
        _check_positive("shared_prefix", "num_tenants", self.num_tenants)

    def generate(self) -> list[WorkloadRequest]:
        rng = random.Random(self.seed)
        label = f"shared/{self.seed}"
        system = derive_tokens(f"{label}/system", self.system_tokens)
        requests: list[WorkloadRequest] = []
        at = 0.0
        for i in range(self.num_requests):
            at += rng.expovariate(self.rate_per_s)
            user = derive_tokens(f"{label}/{i}/user", _draw(rng, self.user_tokens))
            salt = f"tenant-{i % self.num_tenants}" if self.num_tenants > 1 else None
            requests.append(WorkloadRequest(
                request_id=f"shared-{i}", arrival_s=at, prompt=system + user,
                output_length=_draw(rng, self.output_tokens), session_id=f"user-{i}",
                turn=0, cache_salt=salt))
        return requests


@dataclass(frozen=True)
class AgenticWorkload:
    """Agent sessions that grow with tool output and branch (see the module docstring).

    Attributes:
        num_sessions: root agents.
        system_tokens: tool definitions and instructions, shared by every agent.
        task_tokens: a root task, or a sub-agent's sub-task.
        steps: steps of a root agent (one request each).
        subagent_steps: steps of a sub-agent.
        action_tokens: the model's output per step (a tool call).
        tool_output_tokens: the tool result appended after each step.
        answer_tokens: a sub-agent's final answer (its last step's output).
        branch_probability: chance that a step spawns sub-agents instead of a tool call.
        subagents: sub-agents per branch.
        max_depth: nesting limit (1: sub-agents do not branch themselves).
        session_rate_per_s: Poisson arrival rate of root agents.
        step_latency_s: mean (exponential) time from one step's arrival to the next.
        seed: the seed of every draw and token.
    """

    num_sessions: int = 4
    system_tokens: int = 2048
    task_tokens: Range = (128, 1024)
    steps: Range = (4, 10)
    subagent_steps: Range = (2, 5)
    action_tokens: Range = (16, 256)
    tool_output_tokens: Range = (128, 2048)
    answer_tokens: Range = (64, 256)
    branch_probability: float = 0.3
    subagents: Range = (2, 3)
    max_depth: int = 1
    session_rate_per_s: float = 0.1
    step_latency_s: float = 3.0
    seed: int = 0

    def __post_init__(self) -> None:
        where = "agentic"
        _check_positive(where, "num_sessions", self.num_sessions)
        for name in ("task_tokens", "steps", "subagent_steps", "action_tokens",
                     "tool_output_tokens", "answer_tokens", "subagents"):
            _check_range(where, name, getattr(self, name))
        if not 0.0 <= self.branch_probability <= 1.0:
            raise ConfigError(f"{where}.branch_probability",
                              f"must be in [0, 1], got {self.branch_probability}",
                              "Give a probability.")
        if self.max_depth < 0 or self.system_tokens < 0:
            raise ConfigError(f"{where}.max_depth", "max_depth and system_tokens must be "
                              ">= 0", "Use 0 for agents that never branch.")
        _check_positive(where, "session_rate_per_s", self.session_rate_per_s)
        _check_positive(where, "step_latency_s", self.step_latency_s)

    def generate(self) -> list[WorkloadRequest]:
        run = _AgentRun(self)
        start = 0.0
        for s in range(self.num_sessions):
            start += run.rng.expovariate(self.session_rate_per_s)
            task = derive_tokens(f"{run.label}/{s}/task", _draw(run.rng, self.task_tokens))
            run.agent(run.system + task, f"agent{s}", 0, start,
                      steps=_draw(run.rng, self.steps), parent=None)
        return _by_arrival(run.requests)


class _AgentRun:
    """The state of one ``AgenticWorkload.generate`` call."""

    def __init__(self, cfg: AgenticWorkload) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.label = f"agentic/{cfg.seed}"
        self.system = derive_tokens(f"{self.label}/system", cfg.system_tokens)
        self.requests: list[WorkloadRequest] = []

    def agent(self, context: array[int], session: str, depth: int, at: float, *,
              steps: int, parent: str | None) -> tuple[array[int], float]:
        """Run one agent from ``context``; returns its final output and its end time."""
        cfg, rng = self.cfg, self.rng
        output: array[int] = array(context.typecode)
        for step in range(steps):
            last = step == steps - 1
            length = _draw(rng, cfg.answer_tokens if last and depth else cfg.action_tokens)
            output = derive_tokens(f"{self.label}/{session}/{step}/out", length)
            rid = f"{session}-s{step}"
            self.requests.append(WorkloadRequest(
                request_id=rid, arrival_s=at, prompt=context, output_length=length,
                session_id=session, turn=step, output_tokens=output, parent_id=parent))
            context = context + output
            parent = rid
            at += rng.expovariate(1.0 / cfg.step_latency_s)
            if last:
                break
            if depth < cfg.max_depth and rng.random() < cfg.branch_probability:
                end = at
                answers = []
                for j in range(_draw(rng, cfg.subagents)):
                    sub = f"{session}.{step}.{j}"
                    task = derive_tokens(f"{self.label}/{sub}/task",
                                         _draw(rng, cfg.task_tokens))
                    answer, sub_end = self.agent(context + task, sub, depth + 1, at,
                                                 steps=_draw(rng, cfg.subagent_steps),
                                                 parent=rid)
                    answers.append(answer)
                    end = max(end, sub_end)
                for answer in answers:
                    context = context + answer
                at = end
            else:
                context = context + derive_tokens(f"{self.label}/{session}/{step}/tool",
                                                  _draw(rng, cfg.tool_output_tokens))
        return output, at


DEFAULT_WORKLOAD = "chat"

_Workload = ChatWorkload | SharedPrefixWorkload | AgenticWorkload

BUILTIN_WORKLOADS: Mapping[str, tuple[type[_Workload], str]] = MappingProxyType({
    "chat": (ChatWorkload, "num_sessions"),
    "shared-prefix": (SharedPrefixWorkload, "num_requests"),
    "agentic": (AgenticWorkload, "num_sessions"),
})
"""Each built-in workload by name: its config class (defaults as the class gives them) and
the field that sets its size (``builtin_workload``'s ``size``)."""


def builtin_workload(name: str = DEFAULT_WORKLOAD, seed: int = 0,
                     size: int | None = None) -> list[WorkloadRequest]:
    """The built-in workload ``name`` generated with ``seed``.

    ``size`` replaces the default number of sessions (chat, agentic) or users
    (shared-prefix); ``None`` keeps it. Raises ``ConfigError`` for an unknown name or a
    size below 1.
    """
    config, size_field = _builtin(name)
    sized = {} if size is None else {size_field: size}
    return config(seed=seed, **sized).generate()  # type: ignore[arg-type]


def default_size(name: str) -> int:
    """The default size of built-in workload ``name`` (sessions or users)."""
    config, size_field = _builtin(name)
    return int(getattr(config(), size_field))


def size_unit(name: str) -> str:
    """What the size of built-in workload ``name`` counts: "sessions" or "users"."""
    return "sessions" if _builtin(name)[1] == "num_sessions" else "users"


def _builtin(name: str) -> tuple[type[_Workload], str]:
    try:
        return BUILTIN_WORKLOADS[name]
    except KeyError:
        raise ConfigError("workload", f"unknown workload {name!r}",
                          f"Choose one of: {', '.join(BUILTIN_WORKLOADS)}.") from None
