"""EV-11 (MB-06 for the session loop's types): every SessionEvent variant, and every other message and
error run_session puts on the bus, survives a msgpack round trip unchanged."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from unit.transport.test_codec import strategy_for

from actors.app.wiring import registry
from actors.runs.session import (
    SESSION_ERRORS,
    SESSION_MESSAGES,
    SessionEvent,
    SessionRoundLimitError,
)
from transport.messages import ErrorReply

REG = registry()
EVENTS = (
    SessionEvent.InferenceSubmitted,
    SessionEvent.ProviderInput,
    SessionEvent.UsageUpdated,
    SessionEvent.ProviderReceipt,
)


@pytest.mark.parametrize("cls", EVENTS, ids=lambda c: c.TAG)
def test_ev11_every_session_event_survives_a_msgpack_round_trip(cls: type[Any]) -> None:
    """EV-11: a strategy per SessionEvent variant (UsageReceipt, TokenUsage, ModelContext and
    AgentContinuation included) → decode(encode(x)) == x."""

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(cls))
    def round_trip(event: Any) -> None:
        assert REG.decode(cls.TAG, REG.encode(event)) == event

    round_trip()


@pytest.mark.parametrize("cls", [c for c in SESSION_MESSAGES if c not in EVENTS], ids=lambda c: c.TAG)
def test_every_session_message_survives_a_msgpack_round_trip(cls: type[Any]) -> None:
    """MB-06 for run_session's own messages (host calls, controls, the run request and its result)."""

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(cls))
    def round_trip(message: Any) -> None:
        assert REG.decode(cls.TAG, REG.encode(message)) == message

    round_trip()


@pytest.mark.parametrize("cls", SESSION_ERRORS, ids=lambda c: c.WIRE)
def test_session_errors_come_back_as_the_same_class(cls: type[Any]) -> None:
    """Session errors cross the bus as error replies and are rebuilt as the same class, fields kept."""
    error = cls("boom", limit=7) if cls is SessionRoundLimitError else cls("boom")
    rebuilt = REG.rebuild_error(REG.decode(ErrorReply.TAG, REG.encode(REG.error_reply(error))))
    assert type(rebuilt) is cls and str(rebuilt) == str(error)
    if cls is SessionRoundLimitError:
        assert rebuilt.limit == 7
