"""The inference handle (seed 000; RULES.md RT-*, SI-*, MB-02, MB-10): one native provider turn, single use.

Its values and messages, and ``InferenceHandleActor``. Each ``SessionInference`` (``facade.py``) fronts one
handle actor: the actor's state *is* the handle's
single use (Starting → Active → Terminal), and its mailbox serialises every operation on it, so concurrent
callers need no lock (MB-02). The actor never blocks: every Router call is a request with a continuation,
and a caller's request that must wait for the Router is answered later through its stored ``Context``.

The handle holds no host reference and runs no application code: it talks to the Router only when asked
through ``next_event``, ``respond``, ``finish_unavailable`` or ``close`` (SI-04).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from actors.base import DEFER, BusActor, Context
from actors.errors import Closed, TimedOut
from actors.router.messages import (
    CancelOperation,
    InvalidCallId,
    NextTurnEvent,
    RespondCall,
    RouterError,
    StartTurn,
    TurnCancelled,
    TurnClosed,
    TurnCompleted,
    TurnEventBatch,
    TurnInput,
    TurnStarted,
    TurnTerminated,
    TurnTextDelta,
    TurnTimedOut,
    TurnToolCall,
    TurnUsage,
)
from actors.router.messages import FinishUnavailable as RouterFinishUnavailable
from actors.types import (
    AgentContinuation,
    ModelContext,
    OfferedTool,
    ReceiptError,
    ResolvedAgentModel,
    TokenUsage,
    ToolCall,
    ToolCallError,
    ToolCallErrorKind,
    ToolResult,
    UsageReceipt,
    evolve,
)
from transport.codec import JsonValue
from transport.errors import BusError, Expired, NotDelivered, ProtocolError, Unavailable
from transport.messages import Ok
from transport.node import Node
from transport.pending import Reply
from transport.records import frozen

log = logging.getLogger(__name__)

DEFAULT_ROUND_LIMIT: Final = 250  # RT-01

# How long the handle's one outstanding Router read may take. Deliberately longer than any caller's wait:
# an event that arrives after its reader gave up is kept for the next ``next_event`` instead of being lost.
READ_TIMEOUT: Final = 3600.0
_LIVE_MARGIN = 0.05  # a reader whose deadline is this close is treated as gone (its reply could be dropped)

_AgentToolCall = ToolCall  # the seed's ToolCall, named apart from SessionInferenceEvent.ToolCall

__all__ = [
    "DEFAULT_ROUND_LIMIT",
    "HandleTerminated",
    "InferenceError",
    "InferenceEvents",
    "InferenceHandleActor",
    "InferenceTimeout",
    "InvalidCallId",
    "PreparedRound",
    "ProviderEndedError",
    "SessionInferenceEvent",
    "SessionInferenceRequest",
    "parse_call_ktool",
]

# -------------------------------------------------------------------------------------------- requests


@frozen(kw_only=True)
class PreparedRound:
    TAG: ClassVar[str] = "si.prepared_round"
    input: str
    provider_input: str
    continuation: AgentContinuation | None
    model: str
    reasoning_effort: str
    tool_description: str
    timeout: float | None
    # a JSON schema the answer must follow, where the provider can constrain it (the goal judge's verdict)
    response_schema: dict[str, JsonValue] | None = None
    # the application tools offered this round, as data (``tool_description`` lists them as text)
    tools: tuple[OfferedTool, ...] = ()


@frozen(kw_only=True)
class SessionInferenceRequest:
    TAG: ClassVar[str] = "si.request"
    user_id: str
    operation_id: uuid.UUID
    round: int
    prepared: PreparedRound


# ---------------------------------------------------------------------------------------------- events


class SessionInferenceEvent:
    """The normalized events ``next_event`` returns (SI-05); callers ``match`` on the nested classes."""

    @frozen(kw_only=True)
    class ProviderInput:
        TAG: ClassVar[str] = "si.ev.provider_input"
        context: ModelContext

    @frozen(kw_only=True)
    class UsageUpdated:
        TAG: ClassVar[str] = "si.ev.usage"
        usage: TokenUsage

    @frozen(kw_only=True)
    class ToolCall:
        TAG: ClassVar[str] = "si.ev.tool_call"
        call_id: str
        call: _AgentToolCall | ToolCallError

    @frozen(kw_only=True)
    class Completed:
        TAG: ClassVar[str] = "si.ev.completed"
        answer: str
        usage: TokenUsage | None
        receipt: UsageReceipt
        continuation: AgentContinuation | None = None
        finish_reason: str = "stop"  # the Router's TurnCompleted.finish_reason ("length": cut at the limit)


Event = (
    SessionInferenceEvent.ProviderInput
    | SessionInferenceEvent.UsageUpdated
    | SessionInferenceEvent.ToolCall
    | SessionInferenceEvent.Completed
)
DECISIONS = (SessionInferenceEvent.ToolCall, SessionInferenceEvent.Completed)  # what a reader acts on


@frozen(kw_only=True)
class InferenceEvents:
    """The answer to a ``batch`` read that found several events in hand: in order, each a ``ProviderInput``
    or ``UsageUpdated`` but the last, which may be the decision they precede (a tool call, the completion).
    Only events the provider had produced already: a batch never waits for more."""

    TAG: ClassVar[str] = "si.events"
    events: tuple[Event, ...]


# ------------------------------------------------------------------------------- the handle's messages


@frozen(kw_only=True)
class AwaitStarted:
    """Answered with ``InferenceStarted`` once the Router started the turn (or its start error)."""

    TAG: ClassVar[str] = "si.await_started"


@frozen(kw_only=True)
class InferenceStarted:
    TAG: ClassVar[str] = "si.started"
    operation_id: uuid.UUID
    model: ResolvedAgentModel


@frozen(kw_only=True)
class NextEvent:
    """Answered with one normalized event, or ``Ok`` when the stream closed without completion (SI-09).

    ``batch``: when several events are in hand (read together from the Router), the answer is
    ``InferenceEvents`` with them, up to and including the next decision; a closed stream or an error still
    comes alone, on the read after the events before it."""

    TAG: ClassVar[str] = "si.next_event"
    batch: bool = False


@frozen(kw_only=True)
class Respond:
    """Answer a surfaced tool call. ``read_on``: the caller asks ``NextEvent`` as soon as this succeeds,
    so the handle may read the Router's next event in the same exchange (``RespondCall.read_on``) and hold
    it for that ``NextEvent``. Leave it off when the run may end after the respond (a ``stop``)."""

    TAG: ClassVar[str] = "si.respond"
    call_id: str
    result: ToolResult
    read_on: bool = False


@frozen(kw_only=True)
class RespondAndRead:
    """Answer a surfaced tool call, then read: answered with what a ``NextEvent`` asked right after a
    successful respond would get (an event, ``Ok`` for a stream closed without completion, or the read's
    error), or with the respond's own error (SI-11: the call is then answerable again). One exchange with
    the loop where ``Respond`` then ``NextEvent`` are two; the Router reads on (``RespondCall.read_on``)
    when no other read is in flight or held."""

    TAG: ClassVar[str] = "si.respond_and_read"
    call_id: str
    result: ToolResult
    batch: bool = False  # the read is a batch read (``NextEvent.batch``)


@frozen(kw_only=True)
class FinishUnavailable:
    TAG: ClassVar[str] = "si.finish_unavailable"


@frozen(kw_only=True)
class Close:
    TAG: ClassVar[str] = "si.close"


# ---------------------------------------------------------------------------------------------- errors


class InferenceError(ReceiptError):
    """A provider start or stream error; ``__cause__`` is the Router's error, ``receipt`` its receipt."""

    WIRE = "si.inference"


class InferenceTimeout(InferenceError, TimedOut):
    """The Router ended the turn because ``prepared.timeout`` ran out (SI-20)."""

    WIRE = "si.timeout"


class ProviderEndedError(InferenceError, Closed):
    """The Router ended the turn (cancelled through its lineage, or accounted already)."""

    WIRE = "si.provider_ended"


class HandleTerminated(Closed):
    """The handle was used up (completed, accounted, failed with a receipt, or closed): nothing was sent."""

    WIRE = "si.handle_terminated"


INFERENCE_MESSAGES = (
    PreparedRound,
    SessionInferenceRequest,
    SessionInferenceEvent.ProviderInput,
    SessionInferenceEvent.UsageUpdated,
    SessionInferenceEvent.ToolCall,
    SessionInferenceEvent.Completed,
    AwaitStarted,
    InferenceStarted,
    InferenceEvents,
    NextEvent,
    Respond,
    RespondAndRead,
    FinishUnavailable,
    Close,
)
INFERENCE_ERRORS: tuple[type[BusError], ...] = (
    InferenceError,
    InferenceTimeout,
    ProviderEndedError,
    HandleTerminated,
)

# ------------------------------------------------------------------------------------ strict parsing


def _error(kind: ToolCallErrorKind, detail: str) -> ToolCallError:
    return ToolCallError(kind=kind, detail=detail)


def parse_call_ktool(arguments: Mapping[str, JsonValue] | None) -> ToolCall | ToolCallError:
    """RT-05: exactly ``{"name": non-empty str, "arguments": JSON object}``; anything else is a bounded
    ``ToolCallError`` (the Router classified bad JSON, non-objects and foreign function names already)."""
    if arguments is None:
        return _error(ToolCallErrorKind.NOT_OBJECT, "no argument object")
    if "name" not in arguments:
        return _error(ToolCallErrorKind.MISSING_NAME, "the call has no 'name'")
    name = arguments["name"]
    if not isinstance(name, str) or not name:
        return _error(ToolCallErrorKind.INVALID_NAME, f"'name' is {_describe(name)}, not a non-empty string")
    if "arguments" not in arguments:
        return _error(ToolCallErrorKind.INVALID_ARGUMENTS, "the call has no 'arguments'")
    args = arguments["arguments"]
    if not isinstance(args, dict):
        return _error(ToolCallErrorKind.INVALID_ARGUMENTS, f"'arguments' is {_describe(args)}, not an object")
    extra = sorted(key for key in arguments if key not in ("name", "arguments"))
    if extra:
        return _error(ToolCallErrorKind.UNEXPECTED_FIELD, f"unexpected field {extra[0][:60]!r}")
    return ToolCall(name=name, arguments=args)


def _describe(value: object) -> str:
    if isinstance(value, str):
        return "an empty string" if not value else f"a string of {len(value)} characters"
    return f"a {type(value).__name__}"


def inference_error(error: BaseException) -> BusError:
    """The handle's error for a Router failure: receipt kept, the original as ``__cause__``. A transport
    outcome of the hop to the Router (``NotDelivered``: nothing ran; ``Unavailable``: outcome unknown;
    ``Expired``) stays itself, so every caller can tell by class whether a retry is safe."""
    if isinstance(error, NotDelivered | Unavailable | Expired):
        return error
    receipt = error.receipt if isinstance(error, RouterError) else None
    cls: type[InferenceError] = InferenceError
    if isinstance(error, TurnTimedOut):
        cls = InferenceTimeout
    elif isinstance(error, TurnCancelled | TurnTerminated):
        cls = ProviderEndedError
    message = error.message if isinstance(error, BusError) else str(error)
    wrapped = cls(f"provider turn failed: {message}"[:500], receipt=receipt)
    wrapped.__cause__ = error
    return wrapped


# ----------------------------------------------------------------------------------- the handle actor

Outcome = Event | BusError | None  # what one Router read gives a reader (None: closed, SI-09)


@frozen
class _Together:
    """Events that one Router reply brought (a ``TurnEventBatch``), held as one: a batch reader takes them
    together (``NextEvent.batch``), a plain reader one at a time. Only what one reply carried: how many
    events a read finds never depends on when the reader came."""

    events: tuple[Event, ...]


def _is_event(outcome: Outcome | _Together) -> bool:
    return outcome is not None and not isinstance(outcome, BusError | _Together)


@frozen
class Starting:
    waiters: tuple[Context, ...] = ()  # AwaitStarted requests
    queued: tuple[tuple[Any, Context], ...] = ()  # other requests, replayed once started


@frozen
class Active:
    operation_id: uuid.UUID
    model: ResolvedAgentModel
    surfaced: frozenset[str] = frozenset()  # call ids surfaced and not answered (nor being answered)
    readers: tuple[tuple[Context, bool], ...] = ()  # NextEvent requests (and whether batch), FIFO
    reading: bool = False  # one Router read in flight
    buffered: tuple[Outcome | _Together, ...] = ()  # outcomes no reader has taken yet, in order
    accountants: tuple[Context, ...] = ()  # FinishUnavailable requests; the first one is in flight


@frozen
class Terminal:
    why: str
    operation_id: uuid.UUID | None = None
    model: ResolvedAgentModel | None = None
    start_error: BusError | None = None


State = Starting | Active | Terminal


def start_turn_of(request: SessionInferenceRequest, *, ephemeral: bool = False) -> StartTurn:
    """SI-02/SI-03: everything the caller prepared, and ``provider_input`` verbatim (never ``input``).
    ``ephemeral``: a fresh turn the Router keeps no continuation for (a subagent run's, SA-02)."""
    prepared = request.prepared
    return StartTurn(
        user_id=request.user_id,
        parent_operation_id=request.operation_id,
        round=request.round,
        model=prepared.model,
        input=prepared.provider_input,
        tool_description=prepared.tool_description,
        reasoning_effort=prepared.reasoning_effort,
        continuation=prepared.continuation,
        timeout_s=prepared.timeout,
        ephemeral=ephemeral,
        response_schema=prepared.response_schema,
        tools=prepared.tools,
    )


def _init_record(node: Node, *options: Any) -> bytes:
    from transport.capture import pack_payload

    router, request, *rest = options
    return pack_payload([router, node.registry.encode(request), *rest])


class ReadOn:
    """The continuation of a ``RespondCall(read_on=True)``: its partial ``Ok`` is the respond's success,
    and its final reply is the read that follows (``_on_read``). An event before any ``Ok`` (partial or
    final: the Router's ack of a respond whose turn steps at once) is that success and the read's first
    event together. On that success a ``Respond``'s caller is answered ``Ok``, and a ``RespondAndRead``'s
    caller (``and_read``) becomes the first reader in line for that read. A final error or ``Ok`` with no
    success before it is the respond's own answer: its error, or ``Ok`` from a Router that does not read
    on, and the next read is then made as usual."""

    __slots__ = ("_actor", "_and_read", "_batch", "_call_id", "_ctx", "_taken")

    def __init__(
        self, actor: InferenceHandleActor, ctx: Context, call_id: str, *, and_read: bool, batch: bool = False
    ) -> None:
        self._actor = actor
        self._ctx = ctx
        self._call_id = call_id
        self._and_read = and_read
        self._batch = batch
        self._taken = False

    def __call__(self, reply: Reply) -> None:
        actor = self._actor
        if not self._taken:
            acked_by_event = reply.error is None and type(reply.message) is not Ok
            if acked_by_event or not reply.final:
                self._taken = True
                actor._responded(self._ctx, and_read=self._and_read, batch=self._batch)
                if not acked_by_event:
                    return
        if self._taken:
            # an event of the read: one before the turn's next decision (a partial) goes on
            actor._on_read(reply, more=not reply.final)
            return
        state = actor._state
        if isinstance(state, Active):
            actor._state = evolve(state, reading=False)
        actor._on_responded(self._ctx, self._call_id, reply, and_read=self._and_read, batch=self._batch)
        actor._pump()


class InferenceHandleActor(BusActor):
    """One provider turn; spawned by ``InferenceRuntime``. See the module docstring."""

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        router: str,
        request: SessionInferenceRequest,
        start_timeout: float | None = None,
        read_timeout: float = READ_TIMEOUT,
        observer: str | None = None,
        ephemeral: bool = False,
    ) -> None:
        super().__init__(node, address)
        # The handle's options are its spawner's: recorded first, so a replay can start it alike (replayed()).
        node.effect(address, b"init", lambda: _init_record(node, router, request, start_timeout, read_timeout,
                                                          observer, ephemeral))  # fmt: skip
        self._router = router
        self._observer = observer  # told every TurnTextDelta as it streams (not an event of its own)
        self._start = start_turn_of(request, ephemeral=ephemeral)
        self._start_timeout = start_timeout
        self._read_timeout = read_timeout
        self._state: State = Starting()

    @classmethod
    def replayed(cls) -> Any:
        """What ``Replay.run`` replays a handle as: started with the options its log's first record holds."""

        class FromLog:
            @staticmethod
            def start(node: Any, address: str) -> Any:
                from transport.capture import unpack_payload

                key, value = node.effects[0]
                if key != b"init":
                    raise ValueError(f"{address}: the log does not start with the handle's options")
                router, request, start_timeout, read_timeout, observer, ephemeral = unpack_payload(value)
                decoded = node.registry.decode(SessionInferenceRequest.TAG, request)
                options = {"start_timeout": start_timeout, "read_timeout": read_timeout}
                options |= {"observer": observer, "ephemeral": ephemeral}
                return cls.start(node, address, router=router, request=decoded, **options)

        return FromLog

    def on_start(self) -> None:
        super().on_start()
        self.ask(self._router, self._start, self._on_started, timeout=self._start_timeout)

    # ------------------------------------------------------------------------------------ dispatch
    def handle(self, message: Any, ctx: Context) -> Any:
        state = self._state
        match state, message:
            case Starting(), AwaitStarted():
                self._state = evolve(state, waiters=(*state.waiters, ctx))
                return DEFER
            case Starting(), NextEvent() | Respond() | RespondAndRead() | FinishUnavailable() | Close():
                self._state = evolve(state, queued=(*state.queued, (message, ctx)))
                return DEFER
            case Active(), AwaitStarted():
                return InferenceStarted(operation_id=state.operation_id, model=state.model)
            case Active(), NextEvent(batch=batch):
                self._state = evolve(state, readers=(*state.readers, (ctx, batch)))
                self._pump()
                return DEFER
            case Active(), Respond(call_id=call_id, result=result, read_on=read_on):
                self._respond(state, ctx, call_id, result, read_on=read_on, and_read=False)
                return DEFER
            case Active(), RespondAndRead(call_id=call_id, result=result, batch=batch):
                self._respond(state, ctx, call_id, result, read_on=True, and_read=True, batch=batch)
                return DEFER
            case Active(), FinishUnavailable():
                self._state = evolve(state, accountants=(*state.accountants, ctx))
                if not state.accountants:
                    self._account(state.operation_id)
                return DEFER
            case Active(), Close():
                # SI-17: cancel the child operation; the caller gets no receipt and no event.
                self._terminate("the handle was closed")
                self.ask(
                    self._router,
                    CancelOperation(operation_id=state.operation_id),
                    lambda reply: self._closed(ctx, reply),
                )
                return DEFER
            case Terminal(start_error=error), AwaitStarted():
                if error is not None:
                    raise error
                assert state.operation_id is not None and state.model is not None
                return InferenceStarted(operation_id=state.operation_id, model=state.model)
            case Terminal(), Close():
                self.stop()
                return None
            case Terminal(why=why), NextEvent() | Respond() | RespondAndRead() | FinishUnavailable():
                raise HandleTerminated(why)  # SI-13: the Router is not contacted
        raise ProtocolError(f"the inference handle does not handle {type(message).__name__}")

    # --------------------------------------------------------------------------------- starting
    def _on_started(self, reply: Reply) -> None:
        state = self._state
        assert isinstance(state, Starting)
        if reply.error is None and isinstance(reply.message, TurnStarted):
            self._state = Active(reply.message.operation_id, reply.message.model)
            started = InferenceStarted(operation_id=reply.message.operation_id, model=reply.message.model)
            for ctx in state.waiters:
                ctx.reply(started)
        else:
            error = inference_error(reply.error or RouterError(f"unexpected start reply {reply.message!r}"))
            self._state = Terminal("the provider turn did not start", start_error=error)
            for ctx in state.waiters:
                ctx.fail(error)
        for message, ctx in state.queued:
            self._replay(message, ctx)

    def _replay(self, message: Any, ctx: Context) -> None:
        try:
            result = self.handle(message, ctx)
        except BusError as exc:
            ctx.fail(exc)
            return
        if result is not DEFER and not ctx.done:
            ctx.reply(Ok() if result is None else result)

    # ---------------------------------------------------------------------------------- reading
    def _pump(self) -> None:
        """Give buffered outcomes to live readers; start one Router read when a reader still waits."""
        while isinstance(self._state, Active):
            state = self._state
            readers = tuple(reader for reader in state.readers if self._alive(reader[0]))
            if len(readers) != len(state.readers):
                self._state = state = evolve(state, readers=readers)
            if not readers:
                return
            if state.buffered:
                head, rest = state.buffered[0], state.buffered[1:]
                if not isinstance(head, _Together):
                    self._state = evolve(state, buffered=rest)
                    self._give(head)
                    continue
                events, n = head.events, 1
                if readers[0][1]:  # a batch reader: up to and including the first decision
                    n = next((i + 1 for i, e in enumerate(events) if isinstance(e, DECISIONS)), len(events))
                left = events[n:]
                if left:
                    rest = (_Together(left) if len(left) > 1 else left[0], *rest)
                self._state = evolve(state, buffered=rest)
                self._give(InferenceEvents(events=events[:n]) if n > 1 else events[0])
                continue
            if not state.reading:
                self._state = evolve(state, reading=True)
                self.ask(
                    self._router,
                    NextTurnEvent(operation_id=state.operation_id),
                    self._on_read,
                    timeout=self._read_timeout,
                )
            return

    def _alive(self, ctx: Context) -> bool:
        deadline = ctx.header.deadline
        return not ctx.done and (deadline is None or deadline - self.node.clock() > _LIVE_MARGIN)

    def _on_read(self, reply: Reply, *, more: bool = False, hold: bool = False) -> None:
        """One Router event (or the read's error). ``more``: a partial of a read that goes on, which stays
        the read in flight. ``hold``: buffer the outcome for ``_pump`` (one of a batch: a batch reader gets
        it together with the rest)."""
        state = self._state
        if not isinstance(state, Active):
            return  # terminated meanwhile: every reader was answered then
        if not more:
            self._state = state = evolve(state, reading=False)
        outcome: Outcome
        if reply.error is not None:
            outcome = inference_error(reply.error)
        else:
            match reply.message:
                case TurnEventBatch(events=events):  # several events queued at once, in order
                    held = len(state.buffered)
                    for event in events:
                        self._on_read(Reply(event, None, False, reply.header), more=True, hold=True)
                    self._together(held)
                    self._pump()
                    return
                case TurnTextDelta():
                    if self._observer is not None:
                        self.tell_to(self._observer, reply.message)
                    if not hold:
                        self._pump()  # not a normalized event (SI-05): read on
                    return
                case TurnInput(context=context):
                    outcome = SessionInferenceEvent.ProviderInput(context=context)
                case TurnUsage(usage=usage):
                    outcome = SessionInferenceEvent.UsageUpdated(usage=usage)
                case TurnToolCall(call_id=call_id, arguments=arguments, error=error):
                    call = error if error is not None else parse_call_ktool(arguments)
                    self._state = evolve(state, surfaced=state.surfaced | {call_id})
                    outcome = SessionInferenceEvent.ToolCall(call_id=call_id, call=call)
                case TurnCompleted(
                    answer=answer, usage=usage, receipt=receipt, continuation=continuation, finish_reason=why
                ):
                    outcome = SessionInferenceEvent.Completed(
                        answer=answer,
                        usage=usage,
                        receipt=receipt,
                        continuation=continuation,
                        finish_reason=why,
                    )
                case TurnClosed():
                    outcome = None
                case other:
                    outcome = InferenceError(f"unexpected Router event {type(other).__name__}")
        if (
            not hold
            and isinstance(self._state, Active)
            and any(self._alive(c) for c, _ in self._state.readers)
        ):
            self._give(outcome)
        else:
            active = self._state
            assert isinstance(active, Active)
            self._state = evolve(active, buffered=(*active.buffered, outcome))
        if not hold:
            self._pump()

    def _together(self, held: int) -> None:
        """The outcomes buffered from ``held`` on came in one reply: runs of two or more events are held
        together (``_Together``); a closed stream or an error stays on its own."""
        state = self._state
        if not isinstance(state, Active) or len(state.buffered) - held < 2:
            return
        grouped: list[Outcome | _Together] = list(state.buffered[:held])
        for events, run in itertools.groupby(state.buffered[held:], key=_is_event):
            outcomes = tuple(run)
            if events and len(outcomes) > 1:
                grouped.append(_Together(outcomes))  # type: ignore[arg-type]  # events only (the key)
            else:
                grouped.extend(outcomes)
        self._state = evolve(state, buffered=tuple(grouped))

    def _give(self, outcome: Outcome | InferenceEvents) -> None:
        """Answer the first live reader with ``outcome`` and apply what it means for the handle.

        Events go to the reader ``moved``: the handle built them from the Router's reply, which reached it
        copied or decoded (its JSON values, a tool call's arguments, are the handle's own), and none of them
        stays in its state (``_pump`` and ``_on_read`` give an outcome instead of buffering it, or take it
        out of the buffer first). The reader in this process, its loop, becomes their only user: no second
        copy of the arguments on their way to the host."""
        state = self._state
        assert isinstance(state, Active) and state.readers
        (ctx, _), rest = state.readers[0], state.readers[1:]
        self._state = evolve(state, readers=rest)
        if isinstance(outcome, InferenceEvents):  # a batch reader's (_pump)
            ctx.reply(outcome, moved=True)
            if isinstance(outcome.events[-1], SessionInferenceEvent.Completed):
                self._terminate("the provider turn completed")  # SI-08
        elif isinstance(outcome, BusError):
            ctx.fail(outcome)
            if getattr(outcome, "receipt", None) is not None:
                self._terminate("the provider turn failed; its receipt was reported")  # SI-16
        elif outcome is None:
            ctx.reply(Ok())  # SI-09: closed without completion; the handle stays active
        else:
            ctx.reply(outcome, moved=True)
            if isinstance(outcome, SessionInferenceEvent.Completed):
                self._terminate("the provider turn completed")  # SI-08

    # ------------------------------------------------------------------------ respond / account
    def _respond(
        self,
        state: Active,
        ctx: Context,
        call_id: str,
        result: ToolResult,
        *,
        read_on: bool,
        and_read: bool,
        batch: bool = False,
    ) -> None:
        if call_id not in state.surfaced:
            raise InvalidCallId(f"call {call_id[:80]!r} was not surfaced, or was answered already")
        # Read on only when that read would be the next one anyway: none in flight, none held.
        read_on = read_on and not state.reading and not state.buffered
        self._state = evolve(state, surfaced=state.surfaced - {call_id}, reading=read_on)
        respond = RespondCall(
            operation_id=state.operation_id, call_id=call_id, result=result, read_on=read_on
        )
        if read_on:
            then: Any = ReadOn(self, ctx, call_id, and_read=and_read, batch=batch)
            self.ask(self._router, respond, then, timeout=self._read_timeout, stream=True)
        else:
            self.ask(
                self._router,
                respond,
                lambda reply: self._on_responded(ctx, call_id, reply, and_read=and_read, batch=batch),
            )

    def _responded(self, ctx: Context, *, and_read: bool, batch: bool = False) -> None:
        """The respond succeeded: a ``Respond`` is answered; a ``RespondAndRead`` waits for the next read."""
        if not and_read:
            if not ctx.done:
                ctx.reply(Ok())
            return
        state = self._state
        if isinstance(state, Active):
            self._state = evolve(state, readers=(*state.readers, (ctx, batch)))
        elif isinstance(state, Terminal) and not ctx.done:
            ctx.fail(HandleTerminated(state.why))  # ended (accounted, closed) as the respond went out

    def _on_responded(
        self, ctx: Context, call_id: str, reply: Reply, *, and_read: bool = False, batch: bool = False
    ) -> None:
        if reply.error is None:
            self._responded(ctx, and_read=and_read, batch=batch)
            self._pump()
            return
        error = inference_error(reply.error)
        state = self._state
        if getattr(error, "receipt", None) is not None:
            self._terminate("the provider turn ended; its receipt was reported")
        elif isinstance(state, Active) and not isinstance(reply.error, InvalidCallId):
            self._state = evolve(state, surfaced=state.surfaced | {call_id})  # SI-11: still answerable
        ctx.fail(error)

    def _account(self, operation_id: uuid.UUID) -> None:
        self.ask(self._router, RouterFinishUnavailable(operation_id=operation_id), self._on_accounted)

    def _on_accounted(self, reply: Reply) -> None:
        state = self._state
        if not isinstance(state, Active) or not state.accountants:
            return  # closed meanwhile: the requests were answered then
        ctx, rest = state.accountants[0], state.accountants[1:]
        if reply.error is None:
            self._state = evolve(state, accountants=rest)
            ctx.reply(reply.message)
            self._terminate("the provider turn was accounted as unavailable")  # SI-12, MB-02
            return
        error = inference_error(reply.error)
        self._state = evolve(state, accountants=rest)
        ctx.fail(error)
        if getattr(error, "receipt", None) is not None:
            self._terminate("the provider turn ended; its receipt was reported")
        elif rest:
            self._account(state.operation_id)  # SI-14: not terminal; the next caller tries again

    def _terminate(self, why: str) -> None:
        state = self._state
        if not isinstance(state, Active):
            return
        self._state = Terminal(why, state.operation_id, state.model)
        for ctx in (*(reader for reader, _ in state.readers), *state.accountants):
            if not ctx.done:
                ctx.fail(HandleTerminated(why))

    def _closed(self, ctx: Context, reply: Reply) -> None:
        if reply.error is not None:
            log.info("%s: cancelling the turn on close failed: %r", self.address, reply.error)
        ctx.reply(Ok())
        self.stop()
