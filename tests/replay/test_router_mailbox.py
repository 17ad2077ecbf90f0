"""The Router's own mailbox messages (provider events and ends, timeouts, token counts, ticks) survive their
record as mailbox effects unchanged, so a replay hands the Router what it took when recorded (issue 17)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.router.providers.base import (
    CLOSED,
    NativeToolCall,
    ProviderError,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    UsageUpdate,
)
from actors.router.turns import TICK, Counted, Emitted, Finished, TimedOut, decode_local, encode_local
from actors.types import ContextItem, ModelContext, TokenUsage

OP = uuid.UUID(int=5)
USAGE = TokenUsage(input_tokens=3, output_tokens=2, total_tokens=5)


class _Ctx:
    class header:  # noqa: N801 - stands for a Context's header
        id = b"request-1"


@pytest.mark.parametrize(
    "message",
    [
        Emitted(
            OP,
            Submitted(
                ModelContext(
                    model="m",
                    reasoning_effort=None,
                    instructions=None,
                    items=(ContextItem(role="user", text="hi"),),
                )
            ),
        ),
        Emitted(OP, TextDelta("Sunny")),
        Emitted(OP, UsageUpdate(USAGE)),
        Emitted(OP, ToolCallRequested(NativeToolCall("call-1", "call_ktool", '{"name": "x"}'))),
        Finished(OP, ProviderOutcome("done", USAGE, continuation=b"native"), None),
        Finished(OP, ProviderOutcome("done", None), None),
        TimedOut(OP),
        TICK,
    ],
)
def test_a_mailbox_message_round_trips(message: Any) -> None:
    reg = registry()
    payload = encode_local(reg, message)
    assert payload is not None
    assert decode_local(reg, payload, {}) == message


@pytest.mark.parametrize(
    ("error", "check"),
    [
        (ProviderError("unavailable", "refused", started=True), lambda e: (e.kind, e.message, e.started)),
        (ProviderError(CLOSED, "closed"), lambda e: (e.kind, e.message, e.started)),
        (KeyError("boom"), lambda e: (type(e).__name__, str(e))),
    ],
)
def test_a_failed_turn_round_trips_with_its_kind_and_text(error: BaseException, check: Any) -> None:
    reg = registry()
    payload = encode_local(reg, Finished(OP, None, error))
    assert payload is not None
    back = decode_local(reg, payload, {})
    assert back.outcome is None and back.error is not None
    assert check(back.error) == check(error)


def test_a_token_count_goes_back_to_the_request_that_asked() -> None:
    reg = registry()
    ctx = _Ctx()
    payload = encode_local(reg, Counted(ctx, (4, 2), None))  # type: ignore[arg-type]
    assert payload is not None
    back = decode_local(reg, payload, {b"request-1": ctx})
    assert back.ctx is ctx and back.counts == (4, 2) and back.error is None


def test_a_message_that_is_not_the_routers_own_is_not_recorded() -> None:
    assert encode_local(registry(), object()) is None
