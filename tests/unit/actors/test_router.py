"""The Router actor with the scripted provider: catalog, turns, tool calls, receipts, cancellation (RT-*)."""

from __future__ import annotations

import concurrent.futures
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.errors import Busy
from actors.router.actor import MAX_TURN_TIMEOUT_S, RouterActor
from actors.router.catalog import UnknownModel
from actors.router.client import RouterClient
from actors.router.messages import (
    InvalidCallId,
    ProviderUnavailable,
    RouterError,
    StartTurn,
    TurnBusy,
    TurnCancelled,
    TurnClosed,
    TurnCompleted,
    TurnInput,
    TurnTerminated,
    TurnTextDelta,
    TurnTimedOut,
    TurnToolCall,
    TurnUsage,
)
from actors.router.providers.scripted import ScriptedProvider
from actors.router.receipts import ReceiptLedger
from actors.types import AgentProvider, ToolCallErrorKind, ToolResult
from transport.errors import HandlerError, ProtocolError
from transport.node import Node

PARENT = uuid.UUID("00000000-0000-4000-8000-000000000001")


@pytest.fixture
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
def router(
    make_node: Callable[..., Node], provider: ScriptedProvider, tmp_path: Path
) -> Iterator[RouterClient]:
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    yield RouterClient(node, "n1/router", timeout=10)


def start(router: RouterClient, **fields: Any) -> uuid.UUID:
    spec = StartTurn(
        user_id="u1",
        parent_operation_id=fields.pop("parent", PARENT),
        model="scripted",
        input="hello",
        tool_description="run a tool",
        **fields,
    )
    return router.start_turn(spec).operation_id


def drain(router: RouterClient, op: uuid.UUID) -> list[Any]:
    events = []
    while True:
        event = router.next_event(op)
        events.append(event)
        if isinstance(event, TurnCompleted | TurnClosed | TurnToolCall):
            return events


def ledger_count(tmp_path: Path) -> int:
    ledger = ReceiptLedger(tmp_path / "receipts.sqlite3")
    try:
        return ledger.count()
    finally:
        ledger.close()


def test_resolve_model_by_id_and_alias_and_unknown_lists_known(router: RouterClient) -> None:
    """RT-03: the catalog's ResolvedAgentModel, unchanged; an unknown name is a typed error."""
    m = router.resolve_model("scripted")
    assert (m.requested, m.model, m.provider) == ("scripted", "scripted", AgentProvider.SCRIPTED)
    assert router.resolve_model("default").model == "smollm2"
    with pytest.raises(UnknownModel) as err:
        router.resolve_model("gpt-9")
    assert "scripted" in err.value.known and "smollm2" in err.value.known


def test_a_turn_streams_events_and_ends_with_one_receipt(
    router: RouterClient, provider: ScriptedProvider, tmp_path: Path
) -> None:
    provider.add(
        [
            {"text": "Hello there", "chunks": 3},
            {"usage": {"input_tokens": 7, "output_tokens": 3, "total_tokens": 10}},
        ]
    )
    op = start(router, round=1)
    events = drain(router, op)
    assert isinstance(events[0], TurnInput)
    assert events[0].context.tools == ("call_ktool",)
    assert "".join(e.text for e in events if isinstance(e, TurnTextDelta)) == "Hello there"
    assert sum(isinstance(e, TurnTextDelta) for e in events) == 3
    assert any(isinstance(e, TurnUsage) and e.usage.output_tokens == 3 for e in events)
    done = events[-1]
    assert isinstance(done, TurnCompleted)
    assert done.answer == "Hello there"
    receipt = done.receipt
    assert (receipt.status, receipt.operation_id, receipt.parent_operation_id) == ("completed", op, PARENT)
    assert (receipt.user_id, receipt.round, receipt.usage) == ("u1", 1, done.usage)
    assert router.receipt(op) == receipt
    assert router.finish_unavailable(op) == receipt  # a second accounting request: the same receipt
    assert ledger_count(tmp_path) == 1
    with pytest.raises(TurnTerminated) as err:
        router.next_event(op)
    assert err.value.receipt == receipt


def test_the_provider_sees_one_call_ktool_tool_and_the_input_verbatim(
    router: RouterClient, provider: ScriptedProvider
) -> None:
    """RT-04 / SI-03: exactly one native tool; the input is sent as given."""
    provider.add([{"text": "ok"}])
    op = start(router, instructions="be brief")
    drain(router, op)
    request = provider.turns[-1]
    assert request.tool.name == "call_ktool"
    assert request.tool.description == "run a tool"
    assert [(m.role, m.content) for m in request.messages] == [("system", "be brief"), ("user", "hello")]


def test_tool_call_with_exact_id_then_result_then_answer(
    router: RouterClient, provider: ScriptedProvider
) -> None:
    provider.add([{"call": {"name": "calc", "arguments": {"x": 1}}, "id": "c-9"}, {"text": "it is 1"}])
    op = start(router)
    events = drain(router, op)
    call = events[-1]
    assert isinstance(call, TurnToolCall)
    assert (call.call_id, call.name, call.error) == ("c-9", "call_ktool", None)
    assert call.arguments == {"name": "calc", "arguments": {"x": 1}}
    with pytest.raises(InvalidCallId):
        router.respond(op, "c-other", ToolResult(success=True, output="1"))
    router.respond(op, "c-9", ToolResult(success=True, output="1"))
    with pytest.raises(InvalidCallId, match="answered already"):
        router.respond(op, "c-9", ToolResult(success=True, output="1"))
    done = drain(router, op)[-1]
    assert isinstance(done, TurnCompleted)
    assert done.answer == "it is 1"


@pytest.mark.parametrize(
    ("raw", "kind"),
    [
        ({"name": "call_ktool", "arguments": "{not json"}, ToolCallErrorKind.INVALID_JSON),
        ({"name": "call_ktool", "arguments": "[1, 2]"}, ToolCallErrorKind.NOT_OBJECT),
        ({"name": "rm_rf", "arguments": "{}"}, ToolCallErrorKind.UNKNOWN_FUNCTION),
        ({"name": "call_ktool", "arguments": '{"n": ' + "9" * 30 + "}"}, ToolCallErrorKind.INVALID_ARGUMENTS),
    ],
    ids=["bad-json", "not-object", "unknown-function", "int-beyond-64-bits"],
)
def test_invalid_tool_calls_are_bounded_errors_with_the_exact_id_and_the_turn_goes_on(
    router: RouterClient, provider: ScriptedProvider, raw: dict[str, str], kind: ToolCallErrorKind
) -> None:
    provider.add([{"raw_call": raw, "id": "native-77"}, {"text": "recovered"}])
    op = start(router)
    call = drain(router, op)[-1]
    assert isinstance(call, TurnToolCall)
    assert call.call_id == "native-77"
    assert call.error is not None and call.error.kind == kind
    assert len(str(call.error)) <= 256
    router.respond(op, "native-77", ToolResult(success=False, output=str(call.error)))
    assert drain(router, op)[-1].answer == "recovered"


def test_cancelling_the_parent_cancels_the_child_turn_with_one_interrupted_receipt(
    router: RouterClient, provider: ScriptedProvider, tmp_path: Path
) -> None:
    """RT-12: cancelling the parent operation ends the child turn; the error carries the receipt."""
    provider.add([{"text": "partial"}, {"hang": True}])
    op = start(router)
    assert isinstance(router.next_event(op), TurnInput)
    assert isinstance(router.next_event(op), TurnTextDelta)
    waiting = router.next_event_future(op)  # parked in the Router while the provider hangs
    assert router.resolve_model("scripted").model == "scripted"  # the Router still answers
    assert router.cancel(PARENT) == (op,)
    with pytest.raises(TurnCancelled) as err:
        waiting.result(10)
    assert err.value.receipt is not None
    assert err.value.receipt.status == "interrupted"
    assert router.receipt(op) == err.value.receipt
    assert router.finish_unavailable(op) == err.value.receipt
    assert ledger_count(tmp_path) == 1


def test_a_provider_that_goes_away_gives_unavailable_with_the_cause_and_one_receipt(
    router: RouterClient, provider: ScriptedProvider, tmp_path: Path
) -> None:
    provider.add([{"text": "part"}, {"fail": "unavailable", "message": "connection reset by peer"}])
    op = start(router)
    with pytest.raises(ProviderUnavailable) as err:
        while True:
            router.next_event(op)
    assert err.value.receipt is not None and err.value.receipt.status == "unavailable"
    cause = err.value.__cause__
    assert isinstance(cause, HandlerError) and cause.details["exc_type"] == "ConnectionResetError"
    assert ledger_count(tmp_path) == 1


def test_a_stream_closed_without_completion_is_accounted_once_by_finish_unavailable(
    router: RouterClient, provider: ScriptedProvider, tmp_path: Path
) -> None:
    """SI-09/SI-12 at the Router, and MB-02's counting: 10 concurrent accountings, one receipt."""
    provider.add([{"text": "half an answer"}, {"close": True}])
    op = start(router)
    assert isinstance(drain(router, op)[-1], TurnClosed)
    futures = [router.finish_unavailable_future(op) for _ in range(10)]
    receipts = {f.result(10) for f in concurrent.futures.as_completed(futures)}
    assert len(receipts) == 1
    (receipt,) = receipts
    assert receipt.status == "interrupted"
    assert ledger_count(tmp_path) == 1


def test_a_timeout_ends_the_turn_with_a_timed_out_receipt(
    router: RouterClient, provider: ScriptedProvider
) -> None:
    """SI-20 at the Router: the Router enforces the turn's timeout."""
    provider.add([{"hang": True}])
    op = start(router, timeout_s=0.05)
    with pytest.raises(TurnTimedOut) as err:
        while True:
            router.next_event(op)
    assert err.value.receipt is not None and err.value.receipt.status == "timed_out"


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf"), 1e308])
def test_a_turn_timeout_out_of_bounds_is_refused_before_anything_starts(
    router: RouterClient, provider: ScriptedProvider, tmp_path: Path, timeout_s: float
) -> None:
    """Hostile input (issue 18): a timeout that sizes a timer has a limit and a typed error past it; no
    intent is opened, and the Router goes on serving turns."""
    with pytest.raises(ProtocolError, match="timeout_s must be in"):
        start(router, timeout_s=timeout_s)
    assert ledger_count(tmp_path) == 0
    provider.add([{"text": "done"}])
    assert isinstance(drain(router, start(router, timeout_s=MAX_TURN_TIMEOUT_S))[-1], TurnCompleted)


def test_events_stream_in_one_request(router: RouterClient, provider: ScriptedProvider) -> None:
    provider.add([{"text": "abcdef", "chunks": 6}])
    op = start(router)
    events = list(router.events(op))
    assert [type(e) for e in events] == [TurnInput, *[TurnTextDelta] * 6, TurnCompleted]


def test_a_second_reader_of_one_turn_is_refused_as_busy(
    router: RouterClient, provider: ScriptedProvider
) -> None:
    """One reader per turn: while a stream holds the turn, another read is ``TurnBusy`` (a ``Busy`` and a
    ``RouterError``), and the first reader's stream goes on to the end."""
    provider.add([{"call": {"name": "t", "arguments": {}}, "id": "c1"}, {"text": "done"}])
    op = start(router)
    first = router.events(op)
    assert isinstance(next(first), TurnInput)
    assert isinstance(next(first), TurnToolCall)  # the stream stays open: the provider waits for the result
    with pytest.raises(TurnBusy) as refused:
        router.next_event(op)  # it once waited for an event the stream would take
    assert isinstance(refused.value, Busy) and isinstance(refused.value, RouterError)
    with pytest.raises(TurnBusy):
        next(router.events(op))
    router.respond(op, "c1", ToolResult(success=True, output="ok"))
    assert [type(e) for e in first][-1] is TurnCompleted


def test_a_restarted_router_still_has_the_receipt(
    make_node: Callable[..., Node], provider: ScriptedProvider, tmp_path: Path
) -> None:
    node = make_node("n1", registry=registry())
    ref = node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    client = RouterClient(node, "n1/router", timeout=10)
    provider.add([{"text": "done"}])
    op = start(client)
    receipt = drain(client, op)[-1].receipt
    ref.stop()
    node.spawn(RouterActor, "router2", data_dir=tmp_path, providers={"scripted": provider})
    again = RouterClient(node, "n1/router2", timeout=10)
    assert again.receipt(op) == receipt
    assert again.finish_unavailable(op) == receipt
    assert ledger_count(tmp_path) == 1


def test_a_burst_of_events_streams_without_loss(router: RouterClient, provider: ScriptedProvider) -> None:
    """A provider far faster than the reader: the queued events travel in batches, none is lost."""
    provider.add([{"text": "y"}] * 5000)
    op = start(router)
    events = list(router.events(op))
    assert sum(isinstance(e, TurnTextDelta) for e in events) == 5000
    assert isinstance(events[-1], TurnCompleted)
    assert events[-1].answer == "y" * 5000


def test_a_priced_model_has_its_cost_on_the_receipt(make_node: Callable[..., Node], tmp_path: Path) -> None:
    from actors.router.catalog import ModelCatalog

    catalog = ModelCatalog.from_mapping(
        {
            "providers": {"scripted": {"kind": "scripted"}},
            "models": {
                "paid": {
                    "provider": "scripted",
                    "provider_model": "paid-v1",
                    "context_window": 1000,
                    "max_input_tokens": 900,
                    "input_usd_per_mtok": 2.0,
                    "output_usd_per_mtok": 8.0,
                    "cached_input_usd_per_mtok": 0.5,
                }
            },
        }
    )
    provider = ScriptedProvider(
        [
            [
                {"text": "ok"},
                {
                    "usage": {
                        "input_tokens": 1_000_000,
                        "cached_input_tokens": 400_000,
                        "output_tokens": 100_000,
                        "total_tokens": 1_100_000,
                    }
                },
            ]
        ]
    )
    node = make_node("n1", registry=registry())
    node.spawn(RouterActor, "router", catalog=catalog, data_dir=tmp_path, providers={"scripted": provider})
    client = RouterClient(node, "n1/router", timeout=10)
    op = client.start_turn(
        StartTurn(user_id="u", parent_operation_id=PARENT, model="paid", input="x", tool_description="t")
    ).operation_id
    receipt = drain(client, op)[-1].receipt
    # 600k uncached input at $2/M + 400k cached at $0.5/M + 100k output at $8/M
    assert receipt.cost_usd == pytest.approx(1.2 + 0.2 + 0.8)
    assert receipt.provider_model == "paid-v1"
