"""``kv_transfer_params`` read into ``RequestControls`` (the vLLM connector's request side).

Caps (``max_offload_tokens``, ``max_load_tokens``) and client hints
(``conversation_continues``, ``session_id``): a good value is taken as sent; a bad one is
read the safe way (a cap stores or loads nothing, a hint is no hint) with a warning that
names the key.
"""

from __future__ import annotations

import logging

import pytest

from kvoffload.integrations.vllm.request_params import request_controls
from kvoffload.planner.contract import NO_CONTROLS, RequestControls


def test_no_params_and_foreign_keys_set_no_controls() -> None:
    assert request_controls("r", None) is NO_CONTROLS
    assert request_controls("r", {}) is NO_CONTROLS
    assert request_controls("r", {"do_remote_prefill": True}) is NO_CONTROLS
    assert request_controls("r", {"conversation_continues": None,
                                  "session_id": None}) is NO_CONTROLS


@pytest.mark.parametrize(("params", "expected"), [
    ({"conversation_continues": True}, RequestControls(continues=True)),
    ({"conversation_continues": False}, RequestControls(continues=False)),
    ({"session_id": "chat-42"}, RequestControls(session_id="chat-42")),
    ({"conversation_continues": False, "session_id": "s", "max_offload_tokens": 64},
     RequestControls(max_store_tokens=64, continues=False, session_id="s")),
])
def test_good_hints_are_taken_as_sent(params: dict[str, object],
                                      expected: RequestControls) -> None:
    assert request_controls("r", params) == expected


@pytest.mark.parametrize(("key", "value"), [
    ("conversation_continues", "true"), ("conversation_continues", 1),
    ("conversation_continues", 0), ("conversation_continues", [True]),
    ("session_id", ""), ("session_id", 42), ("session_id", {"id": "s"}),
    ("session_id", True),
])
def test_a_bad_hint_is_no_hint_with_a_warning_naming_the_key(
        key: str, value: object, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        controls = request_controls("req-7", {key: value, "max_load_tokens": 16})
    assert controls == RequestControls(max_load_tokens=16)  # the other keys still count
    (record,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = record.getMessage()
    assert f"kv_transfer_params.{key}" in message and "req-7" in message
    assert repr(value) in message


def test_a_bad_hint_alone_sets_no_controls(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert request_controls("r", {"conversation_continues": "no"}) is NO_CONTROLS
    assert "conversation_continues" in caplog.text
