"""Hostile per-request values in ``kv_transfer_params`` (issue 40), at the connector's unit
level: whatever JSON a client sends, the connector reads it into ``RequestControls`` with
a warning naming the request and the safe reading, and never raises (vLLM would answer
the client with an HTTP 500). No engine is started here.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.integrations.vllm.request_params import MAX_SESSION_ID_CHARS, request_controls
from kvoffload.planner.contract import NO_CONTROLS, RequestControls

RID = "cmpl-hostile-1"
MIB = 1 << 20


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("params", [
    "max_offload_tokens=0",  # a string: its .get() does not exist
    "",
    ["max_offload_tokens", 0],  # a list
    [],
    [{"max_offload_tokens": 0}],
    5,  # numbers: "in" raises on them
    0,
    -1.5,
    True,
    b"\x00\x01",
    "x" * MIB,  # a 1 MiB string: named, not echoed
])
def test_params_that_are_not_an_object_are_read_as_empty_with_a_warning(
        params: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert request_controls(RID, params) is NO_CONTROLS
    (message,) = warnings_of(caplog)
    assert RID in message and "kv_transfer_params must be a JSON object" in message
    assert "read as empty" in message
    assert len(message) < 400  # the value is cut to 80 characters


@pytest.mark.parametrize(("session", "taken"), [
    ("s" * MAX_SESSION_ID_CHARS, True),
    ("s" * (MAX_SESSION_ID_CHARS + 1), False),
    ("s" * MIB, False),  # 300 such requests held 300 MiB in the session table
    ("\u00e9" * MAX_SESSION_ID_CHARS, True),  # characters, not bytes
])
def test_a_session_id_is_bounded_in_length(session: str, taken: bool,
                                           caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        controls = request_controls(RID, {"session_id": session, "max_load_tokens": 16})
    if taken:
        assert controls == RequestControls(max_load_tokens=16, session_id=session)
        assert warnings_of(caplog) == []
        return
    assert controls == RequestControls(max_load_tokens=16)  # no hint; the cap still counts
    (message,) = warnings_of(caplog)
    assert RID in message and "kv_transfer_params.session_id" in message
    assert f"at most {MAX_SESSION_ID_CHARS} characters" in message and "ignored" in message
    assert len(message) < 500


@pytest.mark.parametrize(("params", "expected"), [
    ({"max_offload_tokens": "9" * MIB}, RequestControls(max_store_tokens=0)),
    ({"max_load_tokens": ["x" * MIB]}, RequestControls(max_load_tokens=0)),
    ({"conversation_continues": "y" * MIB}, NO_CONTROLS),
])
def test_a_huge_bad_value_is_named_not_echoed(params: dict[str, Any], expected: RequestControls,
                                              caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert request_controls(RID, params) == expected
    (message,) = warnings_of(caplog)
    assert RID in message and len(message) < 500 and "characters)" in message


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=300),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
_KEYS = st.sampled_from(["max_offload_tokens", "max_load_tokens", "conversation_continues",
                         "session_id", "do_remote_prefill", ""])
_PARAMS = st.one_of(_JSON, st.dictionaries(_KEYS, _JSON, max_size=5))


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=_PARAMS)
def test_any_json_value_gives_controls_and_at_most_a_warning_per_key(
        params: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        controls = request_controls(RID, params)
    assert isinstance(controls, RequestControls)
    warned = warnings_of(caplog)
    assert all(RID in m and len(m) < 600 for m in warned)
    if not isinstance(params, dict):
        assert controls is NO_CONTROLS and len(warned) == (params is not None)
        return
    # The safe reading: a cap that is not a whole number >= 0 stores / loads nothing.
    for key, got in (("max_offload_tokens", controls.max_store_tokens),
                     ("max_load_tokens", controls.max_load_tokens)):
        sent = params.get(key)
        good = type(sent) is int and sent >= 0
        assert got == (sent if good else None if sent is None else 0)
    session = params.get("session_id")
    assert controls.session_id == (session if isinstance(session, str)
                                   and 0 < len(session) <= MAX_SESSION_ID_CHARS else None)
    assert len(warned) <= 4
