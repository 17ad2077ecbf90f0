"""The inference handle over the real Router (scripted provider): RT-*, SI-01..SI-20, MB-02, MB-10.

``FakeRouter`` (a tiny actor speaking the Router protocol) stands in only where the real Router cannot be
made to misbehave: a failing respond or accounting, an error without a receipt, a start error with one,
and counting every Router call.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from actors.app.wiring import registry
from actors.base import DEFER, BusActor, Context
from actors.inference.facade import SessionInference
from actors.inference.handle import (
    DEFAULT_ROUND_LIMIT,
    HandleTerminated,
    InferenceError,
    InferenceEvents,
    InferenceHandleActor,
    InferenceTimeout,
    InvalidCallId,
    NextEvent,
    PreparedRound,
    ProviderEndedError,
    SessionInferenceEvent,
    SessionInferenceRequest,
    parse_call_ktool,
)
from actors.router.actor import RouterActor
from actors.router.catalog import UnknownModel
from actors.router.client import RouterClient
from actors.router.messages import (
    CancelOperation,
    FinishUnavailable,
    NextTurnEvent,
    OperationsCancelled,
    ProviderFailed,
    ProviderUnavailable,
    ResolveModel,
    RespondCall,
    RouterError,
    StartTurn,
    TurnClosed,
    TurnCompleted,
    TurnEventBatch,
    TurnInput,
    TurnStarted,
    TurnTextDelta,
    TurnToolCall,
    TurnUsage,
)
from actors.router.providers.base import (
    AwaitResult,
    NativeToolCall,
    ProviderError,
    ProviderOutcome,
    Sleep,
    Submitted,
    ToolCallRequested,
    model_context,
)
from actors.router.providers.base import TextDelta as ProviderTextDelta
from actors.router.providers.scripted import ScriptedProvider
from actors.router.receipts import ReceiptLedger
from actors.runs.runtime import InferenceRuntime
from actors.types import (
    CALL_KTOOL,
    TOOL_CALL_ERROR_MAX,
    AgentContinuation,
    AgentProvider,
    ModelContext,
    ResolvedAgentModel,
    TokenUsage,
    ToolCall,
    ToolCallError,
    ToolCallErrorKind,
    ToolResult,
    UsageReceipt,
)
from transport.errors import ActorUnavailable, BusTimeout
from transport.messages import Ok
from transport.node import Node

PARENT = uuid.UUID("00000000-0000-4000-8000-000000000001")
OK = ToolResult(success=True, output="done")
CONTEXT = ModelContext(model="fake", reasoning_effort=None, instructions=None, items=())
BAD = ToolResult(success=False, output="bad")
WAIT = 10.0  # every blocking wait in this file is bounded by this


def prepared(**fields: Any) -> PreparedRound:
    values: dict[str, Any] = {
        "input": "FULL",
        "provider_input": "DELTA",
        "continuation": None,
        "model": "scripted",
        "reasoning_effort": "low",
        "tool_description": "run an application tool",
        "timeout": None,
    }
    values.update(fields)
    return PreparedRound(**values)


def request(**fields: Any) -> SessionInferenceRequest:
    return SessionInferenceRequest(user_id="u1", operation_id=PARENT, round=3, prepared=prepared(**fields))


# --------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1", registry=registry())


@pytest.fixture
def provider() -> ScriptedProvider:
    return ScriptedProvider()


@pytest.fixture
def router(node: Node, provider: ScriptedProvider, tmp_path: Path) -> RouterClient:
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    return RouterClient(node, "n1/router", timeout=WAIT)


@pytest.fixture
def runtime(node: Node, router: RouterClient) -> InferenceRuntime:
    return InferenceRuntime(node, router.address, timeout=WAIT)


@pytest.fixture
def handles() -> Iterator[list[SessionInference]]:
    """Handles a test opens are closed at its end (explicit release, never __del__)."""
    opened: list[SessionInference] = []
    yield opened
    for si in opened:
        si.close(timeout=WAIT)


def open_(runtime: InferenceRuntime, handles: list[SessionInference], **fields: Any) -> SessionInference:
    si = runtime.start_session_inference(request(**fields))
    handles.append(si)
    return si


def next_of(si: SessionInference, kind: type[Any]) -> Any:
    """Events until the first ``kind`` (bounded: a script has a handful of events)."""
    for _ in range(50):
        event = si.next_event(timeout=WAIT)
        if isinstance(event, kind):
            return event
    raise AssertionError(f"no {kind.__name__}")


def drain(si: SessionInference) -> list[Any]:
    events: list[Any] = []
    for _ in range(50):
        event = si.next_event(timeout=WAIT)
        events.append(event)
        if event is None or isinstance(
            event, SessionInferenceEvent.Completed | SessionInferenceEvent.ToolCall
        ):
            return events
    raise AssertionError("no terminal event")


# ------------------------------------------------------------------------------------------- FakeRouter

MODEL = ResolvedAgentModel(
    requested="fake",
    model="fake",
    provider=AgentProvider.OTHER,
    provider_model="fake-v1",
    context_window_tokens=1000,
    max_input_tokens=900,
)


class FakeRouter:
    """The plan a ``FakeRouterActor`` follows, and its record: every call, every receipt it issued."""

    def __init__(
        self,
        *,
        start_error: RouterError | None = None,
        events: list[Any] | None = None,
        respond_errors: list[RouterError | None] | None = None,
        finish_errors: list[RouterError | None] | None = None,
        reads_on: bool | str = False,
        hold_respond: bool = False,
    ) -> None:
        self.start_error = start_error
        # answers RespondCall(read_on=True) as the real Router does: True, a partial Ok, then the read;
        # "event", as for a turn that steps at once: the read's first event says the respond was taken (an
        # error is still preceded by the Ok)
        self.reads_on = reads_on
        # a fake's order no real Router shows on cue: a respond's success answered only after the next
        # FinishUnavailable's receipt (the turn accounted as the respond went out)
        self.hold_respond = hold_respond
        self.held: Context | None = None
        self.events = list(events or [])
        self.respond_errors = list(respond_errors or [])
        self.finish_errors = list(finish_errors or [])
        self.calls: list[Any] = []
        self.issued: list[UsageReceipt] = []
        self.op = uuid.uuid4()

    def receipt(self, status: Any = "interrupted") -> UsageReceipt:
        receipt = UsageReceipt(
            receipt_id=f"fake-{len(self.issued)}",
            operation_id=self.op,
            parent_operation_id=PARENT,
            user_id="u1",
            provider=AgentProvider.OTHER,
            provider_model="fake-v1",
            model="fake",
            round=3,
            status=status,
            usage=None,
            issued_at_ms=1,
        )
        self.issued.append(receipt)
        return receipt


class FakeRouterActor(BusActor):
    """Speaks the Router protocol from a ``FakeRouter`` plan, on its own thread like the real one."""

    def __init__(self, node: Node, address: str, *, plan: FakeRouter) -> None:
        super().__init__(node, address)
        self.plan = plan

    def handle(self, message: Any, ctx: Context) -> Any:
        plan = self.plan
        plan.calls.append(message)
        match message:
            case ResolveModel():
                return MODEL
            case StartTurn():
                if plan.start_error is not None:
                    raise plan.start_error
                return TurnStarted(operation_id=plan.op, model=MODEL)
            case NextTurnEvent():
                return self._read()
            case RespondCall(read_on=read_on):
                error = plan.respond_errors.pop(0) if plan.respond_errors else None
                if error is not None:
                    raise error
                if plan.hold_respond:
                    plan.held = ctx
                    return DEFER
                if plan.reads_on and read_on and ctx.header.flow == "stream":
                    if (
                        plan.reads_on != "event"
                        or not plan.events
                        or isinstance(plan.events[0], BaseException)
                    ):
                        ctx.partial(Ok())
                    return self._read()
                return None
            case FinishUnavailable():
                error = plan.finish_errors.pop(0) if plan.finish_errors else None
                if error is not None:
                    raise error
                if plan.held is not None:
                    ctx.reply(plan.receipt())
                    plan.held.partial(Ok())  # then the read, which never comes: the turn is over
                    return DEFER
                return plan.receipt()
            case CancelOperation(operation_id=op):
                return OperationsCancelled(operation_ids=(op,))
        raise TypeError(type(message).__name__)

    def _read(self) -> Any:
        plan = self.plan
        if not plan.events:
            return DEFER  # hangs until the test ends
        event = plan.events.pop(0)
        if callable(event):
            event = event(plan)
        if isinstance(event, BaseException):
            raise event
        return event


@pytest.fixture
def fake(node: Node) -> Callable[..., tuple[FakeRouter, InferenceRuntime]]:
    def make(**plan: Any) -> tuple[FakeRouter, InferenceRuntime]:
        router = FakeRouter(**plan)
        node.spawn(FakeRouterActor, "fake", plan=router)
        return router, InferenceRuntime(node, "n1/fake", timeout=WAIT)

    return make


def completed(router: FakeRouter) -> TurnCompleted:
    return TurnCompleted(answer="hi", usage=None, receipt=router.receipt("completed"))


def kinds(calls: list[Any]) -> list[str]:
    return [type(c).__name__ for c in calls]


def ktool(call_id: str, name: str = "t") -> TurnToolCall:
    return TurnToolCall(call_id=call_id, name="call_ktool", arguments={"name": name, "arguments": {}})


# ------------------------------------------------------------------------------------------------ RT


def test_rt01_default_round_limit() -> None:
    """RT-01: DEFAULT_ROUND_LIMIT == 250."""
    assert DEFAULT_ROUND_LIMIT == 250


def test_rt02_clones_share_one_router(fake: Callable[..., tuple[FakeRouter, InferenceRuntime]]) -> None:
    """RT-02: a clone reaches the same Router (its call count is 2)."""
    router, runtime = fake()
    clone = runtime.clone()
    assert clone.router_address == runtime.router_address
    assert runtime.resolve_model("fake") == clone.resolve_model("fake") == MODEL
    assert kinds(router.calls) == ["ResolveModel", "ResolveModel"]


def test_rt03_resolve_model_is_the_routers_and_errors_keep_their_cause(runtime: InferenceRuntime) -> None:
    """RT-03: the catalog's model unchanged; an unknown one raises with the Router's error as cause."""
    assert runtime.resolve_model("scripted").model == "scripted"
    with pytest.raises(InferenceError) as err:
        runtime.resolve_model("gpt-9")
    assert isinstance(err.value.__cause__, UnknownModel)


def test_rt04_exactly_one_native_tool_named_call_ktool(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """RT-04: the provider path declares exactly one native tool, call_ktool."""
    si = open_(runtime, handles)
    first = si.next_event(timeout=WAIT)
    assert isinstance(first, SessionInferenceEvent.ProviderInput)
    assert first.context.tools == ("call_ktool",)
    assert provider.turns[-1].tool.name == "call_ktool"


RT05_CASES = [
    ("{not json", ToolCallErrorKind.INVALID_JSON),
    ("[1, 2]", ToolCallErrorKind.NOT_OBJECT),
    ('{"arguments": {}}', ToolCallErrorKind.MISSING_NAME),
    ('{"name": 1, "arguments": {}}', ToolCallErrorKind.INVALID_NAME),
    ('{"name": "t", "arguments": "x"}', ToolCallErrorKind.INVALID_ARGUMENTS),
    ('{"name": "t", "arguments": {}, "extra": 1}', ToolCallErrorKind.UNEXPECTED_FIELD),
]


def test_rt05_strict_call_ktool_parsing_gives_a_distinct_kind_per_defect(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """RT-05: each malformed call_ktool argument object gives its own ToolCallError kind; a valid one a
    ToolCall(name, arguments)."""
    script: list[dict[str, Any]] = [
        {"raw_call": {"name": "call_ktool", "arguments": text}, "id": f"c{i}"}
        for i, (text, _) in enumerate(RT05_CASES)
    ]
    script += [{"call": {"name": "calc", "arguments": {"x": [1, {"y": None}]}}, "id": "ok"}, {"text": "fine"}]
    provider.add(script)
    si = open_(runtime, handles)
    seen = []
    for i, (_, kind) in enumerate(RT05_CASES):
        event = next_of(si, SessionInferenceEvent.ToolCall)
        assert event.call_id == f"c{i}"
        assert isinstance(event.call, ToolCallError)
        seen.append(event.call.kind)
        assert event.call.kind == kind
        si.respond(event.call_id, BAD)
    assert len(set(seen)) == len(RT05_CASES)
    good = next_of(si, SessionInferenceEvent.ToolCall)
    assert good.call == ToolCall(name="calc", arguments={"x": [1, {"y": None}]})
    assert parse_call_ktool({"name": "", "arguments": {}}) == ToolCallError(
        kind=ToolCallErrorKind.INVALID_NAME, detail="'name' is an empty string, not a non-empty string"
    )


def test_rt06_one_mib_of_garbage_gives_a_bounded_error(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """RT-06: 1 MiB of garbage arguments → a ToolCallError whose str() is at most 256 characters."""
    garbage = "\x00{]" * (1 << 18) + "x" * 256
    provider.add([{"raw_call": {"name": "call_ktool", "arguments": garbage}, "id": "g"}, {"text": "ok"}])
    si = open_(runtime, handles)
    event = next_of(si, SessionInferenceEvent.ToolCall)
    assert isinstance(event.call, ToolCallError)
    assert event.call.kind in ToolCallErrorKind
    assert len(str(event.call)) <= TOOL_CALL_ERROR_MAX
    big = "g" * (1 << 20)
    for arguments in (
        {"name": "t", "arguments": big},
        {"name": "t", "arguments": {}, big: 1},
        {"name": [big]},
    ):
        error = parse_call_ktool(arguments)
        assert isinstance(error, ToolCallError)
        assert len(str(error)) <= TOOL_CALL_ERROR_MAX
        assert big[:300] not in str(error)


def test_rt09_every_surfaced_receipt_is_one_the_router_issued(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
    tmp_path: Path,
) -> None:
    """RT-09: receipts in Completed, in errors and from finish_unavailable are the Router's own."""
    provider.add(
        [{"text": "done"}], [{"fail": "failed", "message": "boom"}], [{"hang": True}], [{"hang": True}]
    )
    surfaced: list[UsageReceipt] = []
    done = next_of(open_(runtime, handles), SessionInferenceEvent.Completed)
    surfaced.append(done.receipt)
    with pytest.raises(InferenceError) as err:
        drain(open_(runtime, handles))
    assert err.value.receipt is not None
    surfaced.append(err.value.receipt)
    si = open_(runtime, handles)
    si.next_event(timeout=WAIT)
    surfaced.append(si.finish_unavailable(timeout=WAIT))
    with pytest.raises(InferenceTimeout) as timed_out:
        drain(open_(runtime, handles, timeout=0.05))
    assert timed_out.value.receipt is not None
    surfaced.append(timed_out.value.receipt)
    for receipt in surfaced:
        assert router.receipt(receipt.operation_id) == receipt
    with ReceiptLedger(tmp_path / "receipts.sqlite3") as ledger:
        issued = {r.receipt_id for r in ledger.for_parent(PARENT)}
    assert {r.receipt_id for r in surfaced} == issued
    assert len(issued) == 4


# ------------------------------------------------------------------------------------------------ SI


def test_si01_each_start_starts_exactly_one_provider_turn(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """SI-01: one start_session_inference → one native provider turn."""
    before = len(provider.turns)
    si = open_(runtime, handles)
    next_of(si, SessionInferenceEvent.Completed)
    assert len(provider.turns) == before + 1
    open_(runtime, handles).next_event(timeout=WAIT)
    assert len(provider.turns) == before + 2


def test_si02_the_start_applies_every_prepared_field(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """SI-02: user attribution, parent operation, round, continuation, model, reasoning effort, the single
    call_ktool description and the timeout reach the Router."""
    rows = [{"role": "user", "content": "earlier"}, {"role": "assistant", "content": "reply"}]
    continuation = AgentContinuation(
        provider=AgentProvider.SCRIPTED, model="scripted", token=json.dumps(rows).encode()
    )
    provider.add([{"text": "ok"}], [{"hang": True}])
    si = open_(
        runtime, handles, continuation=continuation, reasoning_effort="high", tool_description="tools: calc"
    )
    done = next_of(si, SessionInferenceEvent.Completed)
    turn = provider.turns[-1]
    assert turn.model.model == "scripted"
    assert turn.reasoning_effort == "high"
    assert (turn.tool.name, turn.tool.description) == ("call_ktool", "tools: calc")
    assert [(m.role, m.content) for m in turn.messages] == [
        ("user", "earlier"),
        ("assistant", "reply"),
        ("user", "DELTA"),
    ]
    receipt = done.receipt
    assert (receipt.user_id, receipt.parent_operation_id, receipt.round) == ("u1", PARENT, 3)
    assert receipt.operation_id == si.operation_id != PARENT
    timed = open_(runtime, handles, timeout=0.05)
    with pytest.raises(InferenceTimeout):
        drain(timed)


def test_si03_the_provider_gets_provider_input_verbatim(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """SI-03: input="FULL", provider_input="DELTA" → the provider receives exactly "DELTA"."""
    si = open_(runtime, handles, input="FULL", provider_input="  DELTA\n")
    next_of(si, SessionInferenceEvent.Completed)
    contents = [m.content for m in provider.turns[-1].messages]
    assert contents == ["  DELTA\n"]


def test_si04_the_handle_reads_nothing_until_asked_and_takes_no_host(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-04: after a start with no next_event the Router had 0 stream reads; no host parameter."""
    router, runtime = fake(events=[ktool("c1")])
    si = runtime.start_session_inference(request())
    handles.append(si)
    runtime.resolve_model("fake")  # a round trip through the same Router mailbox: it saw everything sent
    assert kinds(router.calls) == ["StartTurn", "ResolveModel"]
    for fn in (SessionInference.__init__, InferenceHandleActor.__init__, InferenceRuntime.__init__):
        assert not any("host" in name for name in inspect.signature(fn).parameters)


def test_si05_only_normalized_events_are_returned(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """SI-05: text deltas (raw transport records) are hidden; ProviderInput carries a ModelContext."""
    provider.add([{"text": "Hello there", "chunks": 5}, {"usage": {"output_tokens": 2, "total_tokens": 2}}])
    events = drain(open_(runtime, handles))
    assert [type(e).__name__ for e in events] == ["ProviderInput", "UsageUpdated", "Completed"]
    assert isinstance(events[0].context, ModelContext)
    assert events[-1].answer == "Hello there"


def test_si06_tool_calls_keep_the_exact_native_call_id(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """SI-06: a native call "c-9" with malformed arguments → ToolCall(call_id="c-9", call=ToolCallError)."""
    provider.add(
        [{"raw_call": {"name": "call_ktool", "arguments": '{"name": "x"'}, "id": "c-9"}, {"text": "ok"}]
    )
    event = next_of(open_(runtime, handles), SessionInferenceEvent.ToolCall)
    assert event.call_id == "c-9"
    assert isinstance(event.call, ToolCallError)


def test_si07_an_invalid_call_does_not_abort_the_handle(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """SI-07: a failure response to an invalid call succeeds, and the handle later yields Completed."""
    provider.add([{"raw_call": {"name": "nope", "arguments": "{}"}, "id": "c1"}, {"text": "recovered"}])
    si = open_(runtime, handles)
    event = next_of(si, SessionInferenceEvent.ToolCall)
    assert isinstance(event.call, ToolCallError) and event.call.kind == ToolCallErrorKind.UNKNOWN_FUNCTION
    si.respond("c1", BAD)
    assert next_of(si, SessionInferenceEvent.Completed).answer == "recovered"


def test_si08_completed_is_returned_exactly_once_with_the_routers_receipt(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """SI-08: Completed once, as the terminal event; then next_event raises HandleTerminated."""
    provider.add([{"text": "answer"}, {"usage": {"output_tokens": 1, "total_tokens": 1}}])
    si = open_(runtime, handles)
    done = next_of(si, SessionInferenceEvent.Completed)
    assert (done.answer, done.usage) == ("answer", TokenUsage(output_tokens=1, total_tokens=1))
    assert done.receipt == router.receipt(si.operation_id)
    assert done.continuation is not None
    with pytest.raises(HandleTerminated):
        si.next_event(timeout=WAIT)


def test_si09_a_closed_stream_gives_none_and_stays_accountable(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """SI-09: the stream closed without completion → None; finish_unavailable then returns a receipt."""
    provider.add([{"text": "partial"}, {"close": True}])
    si = open_(runtime, handles)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.ProviderInput)
    assert si.next_event(timeout=WAIT) is None
    receipt = si.finish_unavailable(timeout=WAIT)
    assert receipt == router.receipt(si.operation_id)
    assert receipt.status == "interrupted"


def test_si10_respond_only_to_surfaced_unanswered_ids(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-10: one result per surfaced call; another id or a second answer raises InvalidCallId, unsent."""
    router, runtime = fake(events=[ktool("c1")])
    si = runtime.start_session_inference(request())
    handles.append(si)
    with pytest.raises(InvalidCallId):
        si.respond("c1", OK)  # not surfaced yet
    event = si.next_event(timeout=WAIT)
    assert isinstance(event, SessionInferenceEvent.ToolCall) and event.call == ToolCall(
        name="t", arguments={}
    )
    si.respond("c1", OK)
    with pytest.raises(InvalidCallId):
        si.respond("c1", OK)
    with pytest.raises(InvalidCallId):
        si.respond("other", OK)
    assert kinds(router.calls).count("RespondCall") == 1
    assert si.finish_unavailable(timeout=WAIT) in router.issued  # InvalidCallId did not terminalize


def test_si11_a_failed_respond_leaves_the_handle_accountable(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-11: the Router fails the respond → respond raises; finish_unavailable then returns a receipt."""
    cause = ProviderFailed("the provider connection dropped")
    router, runtime = fake(events=[ktool("c1")], respond_errors=[cause])
    si = runtime.start_session_inference(request())
    handles.append(si)
    si.next_event(timeout=WAIT)
    with pytest.raises(InferenceError) as err:
        si.respond("c1", OK)
    assert err.value.__cause__ == cause and err.value.receipt is None
    receipt = si.finish_unavailable(timeout=WAIT)
    assert receipt in router.issued


# ------------------------------------------------------------------------------------- reading on
# Respond(read_on=True): the loop reads right after a respond, so the handle takes the respond's answer and
# the next event in one exchange with the Router (RespondCall(read_on=True): a partial Ok, then the event;
# or the event alone, which says the respond was taken: the ``acks`` fixture runs each test both ways).


@pytest.fixture(params=[True, "event"], ids=["ok-then-event", "event-alone"])
def acks(request: pytest.FixtureRequest) -> bool | str:
    """How the fake Router answers a reading-on respond (``FakeRouter.reads_on``)."""
    return request.param  # type: ignore[no-any-return]


def reading_handle(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference], **plan: Any
) -> tuple[FakeRouter, SessionInference]:
    """A handle over a fake Router with ``plan``, its first event (a tool call) already read."""
    router, runtime = fake(**plan)
    si = runtime.start_session_inference(request())
    handles.append(si)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.ToolCall)
    return router, si


def test_a_respond_that_reads_on_gets_the_next_event_without_a_second_read(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    handles: list[SessionInference],
    acks: bool | str,
) -> None:
    router, si = reading_handle(fake, handles, events=[ktool("c1"), completed], reads_on=acks)
    si.respond("c1", OK, read_on=True)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.Completed)
    assert kinds(router.calls) == ["StartTurn", "NextTurnEvent", "RespondCall"]
    (respond,) = (c for c in router.calls if isinstance(c, RespondCall))
    assert respond.read_on


def test_a_router_that_does_not_read_on_is_read_as_before(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """A Router answering ``Ok`` alone (not reading on): the next event is read with its own request."""
    router, si = reading_handle(fake, handles, events=[ktool("c1"), completed])
    si.respond("c1", OK, read_on=True)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.Completed)
    assert kinds(router.calls) == ["StartTurn", "NextTurnEvent", "RespondCall", "NextTurnEvent"]


def test_si11_a_failed_respond_that_reads_on_raises_as_respond_and_stays_accountable(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-11 with read_on: the error before any partial is the respond's; the call is answerable again."""
    cause = ProviderFailed("the provider connection dropped")
    router, si = reading_handle(fake, handles, events=[ktool("c1")], respond_errors=[cause], reads_on=True)
    with pytest.raises(InferenceError) as err:
        si.respond("c1", OK, read_on=True)
    assert err.value.__cause__ == cause and err.value.receipt is None
    assert si.finish_unavailable(timeout=WAIT) in router.issued


def test_a_read_that_fails_after_a_taken_respond_fails_the_next_event_not_the_respond(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    handles: list[SessionInference],
    acks: bool | str,
) -> None:
    cause = ProviderFailed("the stream broke")
    router, si = reading_handle(fake, handles, events=[ktool("c1"), cause], reads_on=acks)
    si.respond("c1", OK, read_on=True)  # taken: no error here
    with pytest.raises(InferenceError) as err:
        si.next_event(timeout=WAIT)
    assert err.value.__cause__ == cause
    assert kinds(router.calls) == ["StartTurn", "NextTurnEvent", "RespondCall"]


# RespondAndRead: the respond and the read after it in one exchange with the handle (the round loops' way).


def test_respond_and_read_answers_with_the_next_event_in_one_router_exchange(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    handles: list[SessionInference],
    acks: bool | str,
) -> None:
    router, si = reading_handle(fake, handles, events=[ktool("c1"), completed], reads_on=acks)
    assert isinstance(si.respond_and_read("c1", OK, timeout=WAIT), SessionInferenceEvent.Completed)
    assert kinds(router.calls) == ["StartTurn", "NextTurnEvent", "RespondCall"]
    (respond,) = (c for c in router.calls if isinstance(c, RespondCall))
    assert respond.read_on and respond.call_id == "c1"


def test_respond_and_read_reads_with_its_own_request_from_a_router_that_does_not_read_on(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    router, si = reading_handle(fake, handles, events=[ktool("c1"), ktool("c2"), TurnClosed()])
    event = si.respond_and_read("c1", OK, timeout=WAIT)
    assert isinstance(event, SessionInferenceEvent.ToolCall) and event.call_id == "c2"
    assert si.respond_and_read("c2", OK, timeout=WAIT) is None  # SI-09: closed without completion
    assert kinds(router.calls)[2:] == ["RespondCall", "NextTurnEvent"] * 2


def test_si11_a_failed_respond_and_read_raises_the_respond_error_and_the_call_stays_answerable(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-11: the respond's error is the answer (no read was made), the handle stays available, and the
    call can be answered again."""
    cause = ProviderFailed("the provider connection dropped")
    plan: dict[str, Any] = {"events": [ktool("c1"), completed], "respond_errors": [cause], "reads_on": True}
    router, si = reading_handle(fake, handles, **plan)
    with pytest.raises(InferenceError) as err:
        si.respond_and_read("c1", OK, timeout=WAIT)
    assert err.value.__cause__ == cause and err.value.receipt is None
    assert kinds(router.calls) == ["StartTurn", "NextTurnEvent", "RespondCall"]
    assert isinstance(si.respond_and_read("c1", OK, timeout=WAIT), SessionInferenceEvent.Completed)


def test_a_read_that_fails_after_a_taken_respond_and_read_raises_the_read_error(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    handles: list[SessionInference],
    acks: bool | str,
) -> None:
    cause = ProviderFailed("the stream broke")
    router, si = reading_handle(fake, handles, events=[ktool("c1"), cause], reads_on=acks)
    with pytest.raises(InferenceError) as err:
        si.respond_and_read("c1", OK, timeout=WAIT)
    assert err.value.__cause__ == cause
    with pytest.raises(InvalidCallId):
        si.respond("c1", OK, timeout=WAIT)  # the respond was taken: c1 is answered
    assert kinds(router.calls) == ["StartTurn", "NextTurnEvent", "RespondCall"]


def test_si12_respond_and_read_on_a_turn_accounted_as_it_responded_ends_terminated(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-12: the turn is accounted while the respond is out (the fake answers the respond only after the
    receipt): the read that would follow can never come, so the caller learns the handle is used up."""
    router, si = reading_handle(fake, handles, events=[ktool("c1")], reads_on=True, hold_respond=True)
    pending = si.respond_and_read_future("c1", OK, timeout=WAIT)
    assert si.finish_unavailable(timeout=WAIT) in router.issued
    with pytest.raises(HandleTerminated):
        pending.result(timeout=WAIT)


def test_si13_respond_and_read_after_termination_does_not_reach_the_router(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    handles: list[SessionInference],
    acks: bool | str,
) -> None:
    router, si = reading_handle(fake, handles, events=[ktool("c1")], reads_on=acks)
    si.finish_unavailable(timeout=WAIT)
    calls = len(router.calls)
    with pytest.raises(HandleTerminated):
        si.respond_and_read("c1", OK, timeout=WAIT)
    assert len(router.calls) == calls


def flat(parts: list[Any]) -> list[Any]:
    """A stream's parts with each ``TurnEventBatch`` opened into its events."""
    return [e for p in parts for e in (p.events if isinstance(p, TurnEventBatch) else (p,))]


def two_calls_read_to_the_first(router: RouterClient, provider: ScriptedProvider) -> uuid.UUID:
    """A turn scripted with calls c1, c2 and an answer, read (one event a read) up to c1; its operation."""
    call = {"name": "t", "arguments": {}}
    provider.add([{"call": call, "id": "c1"}, {"call": call, "id": "c2"}, {"text": "after"}])
    start = StartTurn(
        user_id="u1", parent_operation_id=PARENT, model="scripted", input="go", tool_description="t()"
    )
    op = router.start_turn(start).operation_id
    while not isinstance(router.next_event(op), TurnToolCall):
        pass
    return op


def test_the_router_answers_a_respond_that_reads_on_with_the_events_up_to_the_next_decision(
    node: Node, router: RouterClient, provider: ScriptedProvider
) -> None:
    """The real Router: the events that follow the result up to the turn's next decision (the model's next
    input, then its next call as the final reply); an unknown call fails before any reply; a plain request
    with read_on is answered Ok and reads nothing. The turn steps inline at once, so its first event says
    the result was taken: no partial Ok before it (issue 15, item 6: one message fewer a tool round)."""
    op = two_calls_read_to_the_first(router, provider)
    bad = RespondCall(operation_id=op, call_id="nope", result=OK, read_on=True)
    with pytest.raises(InvalidCallId):
        next(node.stream(router.address, bad, timeout=WAIT))
    good = RespondCall(operation_id=op, call_id="c1", result=OK, read_on=True)
    events = flat(list(node.stream(router.address, good, timeout=WAIT)))
    assert [type(e) for e in events] == [TurnInput, TurnToolCall] and events[-1].call_id == "c2"
    plain = RespondCall(operation_id=op, call_id="c2", result=OK, read_on=True)
    assert node.request(router.address, plain, timeout=WAIT) == Ok()  # not a stream: nothing read
    assert isinstance(router.next_event(op), TurnInput)
    assert isinstance(router.next_event(op), TurnTextDelta)  # the turn's events are all still there
    assert isinstance(router.next_event(op), TurnCompleted)


class _AfterResult(ScriptedProvider):
    """An inline test provider (named so): one tool call, then, once its result is in, what ``then``
    says: ``"sleep"`` steps once emitting nothing (a timer resumes it, then it answers), ``"fail"`` raises
    at once."""

    def __init__(self, then: str) -> None:
        super().__init__()
        self.then = then

    def steps(self, request: Any, io: Any) -> Any:
        io.emit(Submitted(model_context(request)))
        io.emit(
            ToolCallRequested(NativeToolCall("c1", CALL_KTOOL, json.dumps({"name": "t", "arguments": {}})))
        )
        yield AwaitResult("c1")
        if self.then == "fail":
            raise ProviderError("failed", "the model broke right after the result")
        yield Sleep(0.0)
        io.emit(ProviderTextDelta("after"))
        return ProviderOutcome("after", None)


class _Pooled(ScriptedProvider):
    """The scripted model placed on the Router's worker pool (a test double, named so)."""

    placement = "pool"


def _read_to_the_call(node: Node, address: str) -> uuid.UUID:
    start = StartTurn(
        user_id="u1", parent_operation_id=PARENT, model="scripted", input="go", tool_description="t()"
    )
    op = node.request(address, start, timeout=WAIT).operation_id
    while not isinstance(node.request(address, NextTurnEvent(operation_id=op), timeout=WAIT), TurnToolCall):
        pass
    return op


def test_a_reading_on_respond_whose_turn_does_not_step_at_once_is_answered_ok_first(node: Node) -> None:
    """The Router's ack of a reading-on respond: an ``Ok`` partial first whenever the result is not answered
    by the turn's own next events: a turn on the worker pool, an inline turn whose next step emits nothing
    (the Ok goes when that step ends), and an inline turn that fails at once (the Ok, then the error: the
    respond was taken, the read failed; SI-11 tells the two apart by it)."""
    pooled = _Pooled()
    pooled.add([{"call": {"name": "t", "arguments": {}}, "id": "c1"}, {"text": "after"}])
    for name, provider in (("pooled", pooled), ("quiet", _AfterResult("sleep"))):
        node.spawn(RouterActor, name, providers={"scripted": provider})
        address = f"n1/{name}"
        op = _read_to_the_call(node, address)
        good = RespondCall(operation_id=op, call_id="c1", result=OK, read_on=True)
        parts = list(node.stream(address, good, timeout=WAIT))
        assert parts[0] == Ok(), name
        assert isinstance(flat(parts)[-1], TurnCompleted), name
    node.spawn(RouterActor, "failing", providers={"scripted": _AfterResult("fail")})
    op = _read_to_the_call(node, "n1/failing")
    stream = node.stream("n1/failing", RespondCall(operation_id=op, call_id="c1", result=OK, read_on=True),
                         timeout=WAIT)  # fmt: skip
    assert next(stream) == Ok()
    with pytest.raises(RouterError):
        list(stream)


def test_a_respond_that_reads_on_ends_at_the_completion_and_the_handle_keeps_what_it_read(
    node: Node,
    router: RouterClient,
    provider: ScriptedProvider,
    runtime: InferenceRuntime,
    handles: list[SessionInference],
) -> None:
    """The Router reads on past text to the completion; the handle answers the first event and holds the
    rest, in order, for the reads that follow: no second Router read."""
    call = {"name": "t", "arguments": {}}
    provider.add([{"call": call, "id": "c1"}, {"text": "the answer", "chunks": 3}])
    si = open_(runtime, handles)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.ProviderInput)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.ToolCall)
    first = si.respond_and_read("c1", OK, timeout=WAIT)
    assert isinstance(first, SessionInferenceEvent.ProviderInput)
    router_took = node.actor_counts("router").handled
    done = si.next_event(timeout=WAIT)
    assert node.actor_counts("router").handled == router_took  # answered from what the handle holds
    assert isinstance(done, SessionInferenceEvent.Completed) and done.answer == "the answer"


def test_si12_finish_unavailable_accounts_and_terminalizes(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """SI-12: the Router marks the turn interrupted; the receipt is its; later operations are terminated."""
    provider.add([{"text": "partial"}, {"hang": True}])
    si = open_(runtime, handles)
    si.next_event(timeout=WAIT)
    receipt = si.finish_unavailable(timeout=WAIT)
    assert receipt.status == "interrupted"
    assert receipt == router.receipt(si.operation_id)
    for op in (
        lambda: si.next_event(timeout=WAIT),
        lambda: si.respond("c1", OK),
        lambda: si.finish_unavailable(timeout=WAIT),
    ):
        with pytest.raises(HandleTerminated):
            op()


def test_si13_after_termination_nothing_reaches_the_router(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-13: after Completed every operation raises HandleTerminated and the Router's call count holds."""
    router, runtime = fake(events=[ktool("c1"), completed])
    si = runtime.start_session_inference(request())
    handles.append(si)
    si.next_event(timeout=WAIT)
    si.respond("c1", OK)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.Completed)
    calls = len(router.calls)
    for op in (
        lambda: si.next_event(timeout=WAIT),
        lambda: si.respond("c1", OK),
        lambda: si.finish_unavailable(timeout=WAIT),
    ):
        with pytest.raises(HandleTerminated):
            op()
    runtime.resolve_model("fake")  # a round trip through the Router: everything sent before it has arrived
    assert len(router.calls) == calls + 1


def test_si14_a_failed_finish_unavailable_can_be_retried(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]], handles: list[SessionInference]
) -> None:
    """SI-14: the first accounting fails → the handle is not terminal; a second one returns a receipt."""
    router, runtime = fake(finish_errors=[RouterError("the ledger is busy")])
    si = runtime.start_session_inference(request())
    handles.append(si)
    with pytest.raises(InferenceError) as err:
        si.finish_unavailable(timeout=WAIT)
    assert err.value.receipt is None
    receipt = si.finish_unavailable(timeout=WAIT)
    assert receipt == router.issued[-1]


def test_si15_start_and_stream_errors_keep_the_router_error_and_its_receipt(
    node: Node,
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """SI-15: start error with a receipt, stream error with one, stream error without one."""
    fake_router, fake_runtime = fake(events=[RouterError("a glitch")])
    attached = fake_router.receipt("failed")
    fake_router.start_error = ProviderUnavailable("the provider is down", receipt=attached)
    with pytest.raises(InferenceError) as at_start:
        fake_runtime.start_session_inference(request())
    assert isinstance(at_start.value.__cause__, ProviderUnavailable)
    assert at_start.value.__cause__.receipt == attached == at_start.value.receipt

    provider.add([{"text": "partial"}, {"fail": "failed", "message": "boom"}])
    si = open_(runtime, handles)
    with pytest.raises(InferenceError) as mid:
        drain(si)
    assert isinstance(mid.value.__cause__, ProviderFailed)
    assert mid.value.receipt is not None and mid.value.receipt == mid.value.__cause__.receipt
    assert mid.value.receipt == router.receipt(si.operation_id)

    fake_router.start_error = None
    no_receipt = fake_runtime.start_session_inference(request())
    handles.append(no_receipt)
    with pytest.raises(InferenceError) as bare:
        no_receipt.next_event(timeout=WAIT)
    assert bare.value.receipt is None and isinstance(bare.value.__cause__, RouterError)


def test_si16_a_receipt_bearing_error_terminalizes_one_without_does_not(
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    runtime: InferenceRuntime,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """SI-16: with a receipt → finish_unavailable raises HandleTerminated; without → it returns one."""
    provider.add([{"fail": "unavailable", "message": "gone"}])
    si = open_(runtime, handles)
    with pytest.raises(InferenceError):
        drain(si)
    with pytest.raises(HandleTerminated):
        si.finish_unavailable(timeout=WAIT)

    fake_router, fake_runtime = fake(events=[RouterError("a glitch")])
    other = fake_runtime.start_session_inference(request())
    handles.append(other)
    with pytest.raises(InferenceError):
        other.next_event(timeout=WAIT)
    assert other.finish_unavailable(timeout=WAIT) in fake_router.issued


def test_si17_close_cancels_at_the_router_with_no_receipt_or_event(
    runtime: InferenceRuntime, router: RouterClient, provider: ScriptedProvider
) -> None:
    """SI-17: close() on an active handle → the Router cancels the child operation; the caller gets
    nothing back (no receipt, no event)."""
    provider.add([{"hang": True}])
    si = runtime.start_session_inference(request())
    si.next_event(timeout=WAIT)
    pending = si.next_event_future(timeout=WAIT)  # a reader parked on the hanging provider
    si.close(timeout=WAIT)  # returns nothing: no receipt
    with pytest.raises(HandleTerminated):  # the parked reader gets no event either
        pending.result(WAIT)
    receipt = router.receipt(si.operation_id)  # the Router's own accounting of the cancelled turn
    assert receipt.status in ("cancelled", "interrupted")


def test_si18_usage_arrives_in_order(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """SI-18: usages u1 then u2 → UsageUpdated(u1) then UsageUpdated(u2)."""
    u1, u2 = (
        {"input_tokens": 5, "total_tokens": 5},
        {"input_tokens": 5, "output_tokens": 4, "total_tokens": 9},
    )
    provider.add([{"usage": u1}, {"text": "x"}, {"usage": u2}])
    events = drain(open_(runtime, handles))
    usages = [e.usage for e in events if isinstance(e, SessionInferenceEvent.UsageUpdated)]
    assert usages == [TokenUsage(**u1), TokenUsage(**u2)]


def test_si19_provider_input_precedes_its_calls_and_completion(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """SI-19: each provider request's ProviderInput comes before its tool calls and the completion."""
    provider.add([{"call": {"name": "calc", "arguments": {}}, "id": "c1"}, {"text": "after"}])
    si = open_(runtime, handles)
    first = drain(si)
    assert [type(e).__name__ for e in first] == ["ProviderInput", "ToolCall"]
    si.respond("c1", OK)
    second = drain(si)
    assert [type(e).__name__ for e in second] == ["ProviderInput", "Completed"]
    assert second[0].context.continued


def test_si20_the_routers_timeout_ends_the_turn_with_a_receipt(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """SI-20: timeout=0.05s and a stalled provider → InferenceTimeout carrying the Router's receipt."""
    provider.add([{"hang": True}])
    si = open_(runtime, handles, timeout=0.05)
    with pytest.raises(InferenceTimeout) as err:
        drain(si)
    assert err.value.receipt is not None and err.value.receipt.status == "timed_out"
    assert err.value.receipt == router.receipt(si.operation_id)


# ------------------------------------------------------------------------------------------------ MB


def concurrently(n: int, fn: Callable[[], Any]) -> list[Any]:
    """Run ``fn`` on ``n`` threads released together; each result or raised exception, in a list."""
    barrier = threading.Barrier(n, timeout=WAIT)

    def call() -> Any:
        barrier.wait()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - collected for the assertion
            return exc

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return [f.result(WAIT * 2) for f in [pool.submit(call) for _ in range(n)]]


def test_mb02_ten_concurrent_finish_unavailable_give_one_receipt(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """MB-02: 10 concurrent finish_unavailable → exactly 1 receipt and 9 HandleTerminated."""
    provider.add([{"hang": True}])
    si = open_(runtime, handles)
    results = concurrently(10, lambda: si.finish_unavailable(timeout=WAIT))
    receipts = [r for r in results if isinstance(r, UsageReceipt)]
    assert len(receipts) == 1 and receipts[0] == router.receipt(si.operation_id)
    assert sum(isinstance(r, HandleTerminated) for r in results) == 9


def test_mb02_ten_concurrent_next_event_after_completed_are_all_terminated(
    runtime: InferenceRuntime, handles: list[SessionInference]
) -> None:
    """MB-02: 10 concurrent next_event after Completed → 10 HandleTerminated."""
    si = open_(runtime, handles)
    next_of(si, SessionInferenceEvent.Completed)
    results = concurrently(10, lambda: si.next_event(timeout=WAIT))
    assert all(isinstance(r, HandleTerminated) for r in results), results


def test_mb10_a_dead_handle_is_unavailable_and_the_router_still_accounts(
    node: Node, runtime: InferenceRuntime, router: RouterClient, provider: ScriptedProvider
) -> None:
    """MB-10: the handle actor stops mid-turn → the caller gets ActorUnavailable (no hang), and
    RouterClient.finish_unavailable(operation_id) still returns the turn's receipt."""
    provider.add([{"hang": True}])
    si = runtime.start_session_inference(request())
    si.next_event(timeout=WAIT)
    waiting = si.next_event_future(timeout=WAIT)
    ref = node.lookup(si.address.partition("/")[2])
    assert ref is not None
    ref.stop(block=True, timeout=WAIT)
    with pytest.raises(ActorUnavailable):
        waiting.result(WAIT)
    with pytest.raises(ActorUnavailable):
        si.next_event(timeout=WAIT)
    receipt = router.finish_unavailable(si.operation_id)
    assert receipt.status == "interrupted" and receipt.operation_id == si.operation_id
    si.close(timeout=WAIT)  # releasing a dead handle is quiet


def test_an_event_that_outlives_its_reader_is_kept_for_the_next_one(
    runtime: InferenceRuntime, provider: ScriptedProvider, handles: list[SessionInference]
) -> None:
    """MB-04 at the handle: a next_event whose deadline passed loses nothing; the late event is kept."""
    provider.add([{"delay": 0.5}, {"usage": {"total_tokens": 1}}, {"text": "ok"}])
    si = open_(runtime, handles)
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.ProviderInput)
    with pytest.raises(BusTimeout):
        si.next_event(timeout=0.1)
    assert si.next_event(timeout=WAIT) == SessionInferenceEvent.UsageUpdated(usage=TokenUsage(total_tokens=1))
    assert isinstance(si.next_event(timeout=WAIT), SessionInferenceEvent.Completed)


def test_cancelling_the_parent_ends_the_turn_with_the_routers_receipt(
    runtime: InferenceRuntime,
    router: RouterClient,
    provider: ScriptedProvider,
    handles: list[SessionInference],
) -> None:
    """RT-12: cancelling the parent at the Router ends the child turn: ProviderEndedError with its receipt."""
    provider.add([{"hang": True}])
    si = open_(runtime, handles)
    si.next_event(timeout=WAIT)
    waiting = si.next_event_future(timeout=WAIT)
    assert router.cancel(PARENT) == (si.operation_id,)
    with pytest.raises(ProviderEndedError) as err:
        waiting.result(WAIT)
    assert err.value.receipt == router.receipt(si.operation_id)
    with pytest.raises(HandleTerminated):
        si.finish_unavailable(timeout=WAIT)


def test_a_reading_on_respond_whose_next_call_is_ready_gets_it_with_the_input_in_one_final_reply(
    node: Node, router: RouterClient, provider: ScriptedProvider
) -> None:
    """The real Router: the events one provider step produces go to the reader together. When the input
    and the next call are both queued, the reading-on respond is answered with one final
    ``TurnEventBatch`` ending with the call, which also says the result was taken: one reply, not one per
    event, and no partial Ok before it."""
    op = two_calls_read_to_the_first(router, provider)
    parts = list(
        node.stream(
            router.address, RespondCall(operation_id=op, call_id="c1", result=OK, read_on=True), timeout=WAIT
        )
    )
    assert len(parts) == 1 and isinstance(parts[0], TurnEventBatch)
    assert [type(e) for e in parts[0].events] == [TurnInput, TurnToolCall] and parts[0].events[
        -1
    ].call_id == "c2"


def test_a_batch_read_gets_the_events_in_hand_up_to_the_decision_and_a_plain_read_one_at_a_time(
    node: Node,
    fake: Callable[..., tuple[FakeRouter, InferenceRuntime]],
    handles: list[SessionInference],
) -> None:
    """``NextEvent(batch=True)``: what one Router reply brought (input, usage, completion) in one
    ``InferenceEvents``, after which the handle is terminated by the completion it gave (SI-08); a plain
    read of the same events gets them one at a time, from the one Router read."""
    usage = TokenUsage(input_tokens=1, output_tokens=1)
    events = lambda plan: TurnEventBatch(  # noqa: E731
        events=(TurnInput(context=CONTEXT), TurnUsage(usage=usage), completed(plan))
    )
    router, runtime = fake(events=[events, events])
    batched = runtime.start_session_inference(request())
    handles.append(batched)
    got = node.request(batched.address, NextEvent(batch=True), timeout=WAIT)
    assert isinstance(got, InferenceEvents)
    assert [type(e) for e in got.events] == [
        SessionInferenceEvent.ProviderInput,
        SessionInferenceEvent.UsageUpdated,
        SessionInferenceEvent.Completed,
    ]
    with pytest.raises(HandleTerminated):
        batched.next_event(timeout=WAIT)
    plain = runtime.start_session_inference(request())
    handles.append(plain)
    assert isinstance(plain.next_event(timeout=WAIT), SessionInferenceEvent.ProviderInput)
    assert isinstance(plain.next_event(timeout=WAIT), SessionInferenceEvent.UsageUpdated)
    assert isinstance(plain.next_event(timeout=WAIT), SessionInferenceEvent.Completed)
    assert kinds(router.calls).count("NextTurnEvent") == 2  # one Router read each
