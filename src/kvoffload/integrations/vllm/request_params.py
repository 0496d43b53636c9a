"""Per-request controls read from a vLLM request's ``kv_transfer_params``.

An OpenAI-compatible request to ``vllm serve`` carries them in its body
(``"kv_transfer_params": {...}``); ``LLM.generate`` takes them as
``SamplingParams(extra_args={"kv_transfer_params": {...}})``. The names are those of vLLM's
own ``OffloadingConnector``, so a client works with either connector:

* ``max_offload_tokens``: store at most the first this many tokens of the request (whole
  blocks); ``0`` stores nothing: the request leaves no trace in any tier.
* ``max_load_tokens``: load at most this many tokens beyond vLLM's own prefix-cache hit;
  ``0`` loads nothing.

Two hints say what the client knows of the conversation (``RequestControls.continues`` and
``session_id``; kvoffload's own names, which other connectors ignore). They change only
what the ``hybrid`` and ``value`` policies store and keep, never what a hit loads:

* ``conversation_continues``: ``true``: a later request will continue this one (its end
  state is kept); ``false``: none will (only what other requests may share is stored).
* ``session_id``: the conversation's id, a non-empty string of at most
  ``MAX_SESSION_ID_CHARS`` (256) characters: a request of a session seen before is taken
  as continuing unless it says ``conversation_continues``. A longer id is ignored with a
  warning (the planner remembers up to 65,536 sessions; an id of any length would let a
  client hold any memory).

A tenant's salt is vLLM's own request field ``cache_salt``: it enters vLLM's block hashes,
which kvoffload's keys are made from, so tenants with different salts never share a block
in any tier (nothing to read here).

A value that is not a whole number >= 0 cannot be refused at this point (the request is
already admitted, and an exception would stop the engine), so it is read the safe way: a
bad ``max_offload_tokens`` stores nothing and a bad ``max_load_tokens`` loads nothing, and
a warning names the key and the fix. A private request is never stored by mistake. A bad
hint is read as no hint (the policy learns as without one), with a warning naming the key.
``kv_transfer_params`` that is not a JSON object (a string, a list, a number) is read as
empty (no controls), with a warning naming the request: vLLM passes it on unchecked, and
an exception here would answer the client with an HTTP 500. Warnings show at most 80
characters of a value (``kvoffload.errors.shown``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, TypeVar

from kvoffload.errors import shown
from kvoffload.planner.contract import NO_CONTROLS, RequestControls

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

MAX_STORE_KEY = "max_offload_tokens"
"""``kv_transfer_params`` key: tokens of the request that may be stored."""
MAX_LOAD_KEY = "max_load_tokens"
"""``kv_transfer_params`` key: tokens that may be loaded beyond vLLM's own hit."""
CONTINUES_KEY = "conversation_continues"
"""``kv_transfer_params`` key: whether a later request continues this one (a bool)."""
SESSION_KEY = "session_id"
"""``kv_transfer_params`` key: the request's conversation or session (a string)."""
MAX_SESSION_ID_CHARS = 256
"""The longest ``session_id`` taken; a longer one is no hint (with a warning)."""


def request_controls(request_id: str, params: object) -> RequestControls:
    """The controls ``params`` (a request's ``kv_transfer_params``) ask for.

    Keys other than the four above belong to other connectors and are left alone. Never
    raises: ``params`` that is not a mapping (any JSON value a client may send) is read as
    empty, with a warning.
    """
    if params is None:
        return NO_CONTROLS
    if not isinstance(params, Mapping):
        logger.warning("kvoffload: request %s: kv_transfer_params must be a JSON object, "
                       "got %s %s; it is read as empty (no offload controls). Send an "
                       "object such as {\"max_offload_tokens\": 0}.", request_id,
                       type(params).__name__, shown(params))
        return NO_CONTROLS
    if not params:
        return NO_CONTROLS
    store = _token_count(request_id, params, MAX_STORE_KEY, "stores nothing")
    load = _token_count(request_id, params, MAX_LOAD_KEY, "loads nothing")
    continues = _hint(request_id, params, CONTINUES_KEY, bool, "true or false")
    session = _hint(request_id, params, SESSION_KEY, str, "a non-empty string of at most "
                    f"{MAX_SESSION_ID_CHARS} characters such as \"chat-42\"")
    if store is None and load is None and continues is None and session is None:
        return NO_CONTROLS
    return RequestControls(max_store_tokens=store, max_load_tokens=load,
                           continues=continues, session_id=session)


def _hint(request_id: str, params: Mapping[str, Any], key: str, kind: type[_T],
          expected: str) -> _T | None:
    """``params[key]`` if it is a ``kind`` (for a string: a non-empty one of at most
    ``MAX_SESSION_ID_CHARS`` characters); None, with a warning, for any other value: the
    request then carries no such hint."""
    value = params.get(key)
    if value is None:
        return None
    if type(value) is kind and (not isinstance(value, str)
                                or 0 < len(value) <= MAX_SESSION_ID_CHARS):
        return value
    logger.warning("kvoffload: request %s: kv_transfer_params.%s must be %s, got %s; the "
                   "hint is ignored (the cache policy learns as without it).",
                   request_id, key, expected, shown(value))
    return None


def _token_count(request_id: str, params: Mapping[str, Any], key: str,
                 fallback: str) -> int | None:
    """``params[key]`` as a token count; 0 (with a warning) for a value that is not one."""
    if key not in params or params[key] is None:
        return None
    value = params[key]
    if type(value) is int and value >= 0:
        return value
    logger.warning("kvoffload: request %s: kv_transfer_params.%s must be a whole number "
                   ">= 0 (tokens), got %s; the request %s. Send an integer such as "
                   "{\"%s\": 0}.", request_id, key, shown(value), fallback, key)
    return 0
