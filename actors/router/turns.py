"""A Router turn's state and the provider's view of it: the pieces of ``RouterActor`` that hold no actor.

``Turn`` is one provider turn as the Router keeps it (events, readers, receipt, owner liveness);
``WorkerIO`` is what the provider's turn talks through, wherever it is hosted (stepping.py); the messages
below travel only from turn workers, timers and the Router itself into the Router's own mailbox, never on
the wire. ``parse_tool_call`` is the
Router's half of strict tool-call parsing (RT-05).
"""

from __future__ import annotations

import collections
import json
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from actors.base import Context
from actors.router.messages import ProviderFailed, RouterError, StartTurn, TurnCancelled, TurnToolCall
from actors.router.providers.base import (
    CLOSED,
    NativeToolCall,
    ProviderError,
    ProviderEvent,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    UsageUpdate,
)
from actors.types import (
    CALL_KTOOL,
    ResolvedAgentModel,
    TokenUsage,
    ToolCallError,
    ToolCallErrorKind,
    ToolResult,
    UsageReceipt,
)
from transport.capture import pack_payload, unpack_payload
from transport.errors import Expired, NotDelivered, Unavailable
from transport.records import frozen

# Defaults of the Router's liveness and memory options (RouterActor and actor.py's docstring explain them).
TICK_S: Final = 1.0
OWNER_PING_INTERVAL_S: Final = 10.0
OWNER_LOST_AFTER_S: Final = 30.0
OWNER_IDLE_BOUND_S: Final = 3600.0
FINISHED_GRACE_S: Final = 60.0
RECENT_RECEIPTS: Final = 4096

# A heartbeat that failed this way means the owner is gone (or wedged): anything else is a sign of life.
OWNER_GONE: Final = (NotDelivered, Unavailable, Expired)

Ticker = Callable[[float, Callable[[], None]], Callable[[], None]]
"""``ticker(interval_s, fn)`` calls ``fn`` every ``interval_s`` from some other thread until the function it
returns is called. The Router's housekeeping runs on it; tests pass a manual one."""


def thread_ticker(interval_s: float, fn: Callable[[], None]) -> Callable[[], None]:
    """The default ``Ticker``: one daemon thread per Router."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(interval_s):
            fn()

    threading.Thread(target=run, name="kbus-router-tick", daemon=True).start()
    return stop.set


# Messages from worker threads to the Router's own mailbox (local only, never on the wire).
@frozen
class Emitted:
    operation_id: uuid.UUID
    event: ProviderEvent


@frozen
class Finished:
    operation_id: uuid.UUID
    outcome: ProviderOutcome | None
    error: BaseException | None


@frozen
class TimedOut:
    operation_id: uuid.UUID


@frozen
class Counted:
    ctx: Context
    counts: tuple[int, ...] | None
    error: BaseException | None


@frozen
class Tick:
    """Housekeeping: flush staged usage, watch turns idle on their owners, drop ended turns."""


TICK = Tick()


@frozen
class StepMark:
    """The start (``end=False``) or the end of one step of the inline turns: the events queued between the
    two reach their readers together, at the end. Recorded, so a replay, which runs no step, groups the
    recorded events as the recording did."""

    end: bool


STEP_STARTED, STEP_ENDED = StepMark(end=False), StepMark(end=True)


class WorkerIO:
    """The provider's view of its turn (TurnIO), on whichever thread hosts the turn.

    ``emit`` tells the Router (or, for a turn the Router hosts itself, calls ``emit_to``). A stepped turn's
    tool results and cancel go to its host (``resume``, ``on_cancel``); a blocking ``run_turn`` waits in
    ``wait_result``, bounded by ``wait_bound_s`` of real time: the Router normally ends a turn that waits
    too long first (on its own clock), but the worker must not outlive the bound even if the Router is gone.
    """

    def __init__(
        self,
        router: Any,
        operation_id: uuid.UUID,
        wait_bound_s: float = math.inf,
        *,
        emit_to: Callable[[Emitted], None] | None = None,
        resume: Callable[[str, ToolResult], None] | None = None,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self._router = router
        self._op = operation_id
        self._wait_bound_s = wait_bound_s
        self._emit_to = emit_to
        self._resume = resume
        self._on_cancel = on_cancel
        self.cancelled = threading.Event()
        self._results: queue.SimpleQueue[tuple[str, ToolResult] | None] = queue.SimpleQueue()
        self._early: dict[str, ToolResult] = {}
        # Set by SubmitInput on the Router's thread before the RespondCall that resumes the worker; the
        # result queue orders the two, so the worker sees it once its wait_result returns.
        self._next_input: str | None = None

    @property
    def operation_id(self) -> uuid.UUID:
        return self._op

    def submit_input(self, text: str) -> None:
        self._next_input = text

    def take_input(self) -> str | None:
        text, self._next_input = self._next_input, None
        return text

    def emit(self, event: ProviderEvent) -> None:
        if self._emit_to is not None:
            self._emit_to(Emitted(self._op, event))
        else:
            self._router.tell(Emitted(self._op, event))

    def deliver(self, call_id: str, result: ToolResult) -> None:
        if self._resume is not None:
            self._resume(call_id, result)
        else:
            self._results.put((call_id, result))

    def cancel(self) -> None:
        if self.cancelled.is_set():
            return
        self.cancelled.set()
        self._results.put(None)
        if self._on_cancel is not None:
            self._on_cancel()

    def wait_result(self, call_id: str) -> ToolResult:
        if call_id in self._early:
            return self._early.pop(call_id)
        deadline = time.monotonic() + self._wait_bound_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise queue.Empty
                item = self._results.get(timeout=min(remaining, threading.TIMEOUT_MAX))
            except queue.Empty:
                self.cancelled.set()
                raise TurnCancelled(f"no result for {call_id} within {self._wait_bound_s}s") from None
            if item is None:  # the cancel's mark: a result put before it is still read first (FIFO)
                raise TurnCancelled(call_id)
            got_id, result = item
            if got_id == call_id:
                return result
            self._early[got_id] = result  # answered out of order: keep for its own wait


@dataclass(eq=False)
class Turn:
    operation_id: uuid.UUID
    parent_operation_id: uuid.UUID
    spec: StartTurn
    model: ResolvedAgentModel
    io: WorkerIO
    started_ms: int
    receipt_id: str
    owner: str  # the StartTurn's sender
    heartbeat: tuple[str, Any] | None  # where and what to send to hear from the owner (None: no way)
    owner_seen: float  # monotonic: the owner's last sign of life (its request on this turn, a heartbeat)
    events: collections.deque[Any] = field(default_factory=collections.deque)
    waiting: list[Context] = field(default_factory=list)  # deferred NextTurnEvent requests
    stream: Context | None = None  # a StreamTurnEvents request (or a reading-on RespondCall) fed partials
    stream_until: tuple[type, ...] = ()  # the events that end ``stream``: its final reply
    surfaced: set[str] = field(default_factory=set)  # call ids surfaced and not yet answered
    answered: set[str] = field(default_factory=set)
    usage: TokenUsage | None = None
    produced: bool = False
    closed: bool = False  # the provider's stream ended without completion; FinishUnavailable accounts it
    receipt: UsageReceipt | None = None
    failure: RouterError | None = None  # terminal error waiting to be reported
    delivered: bool = False  # the terminal event or error was handed to a reader (or the receipt returned)
    settled_at: float = 0.0  # monotonic, when the receipt was written
    idle_since: float | None = None  # monotonic, since when the turn has been idle on its owner (per tick)
    pinging: bool = False
    pinged_at: float = -math.inf
    ping_failed: bool = False
    timer: int | None = None  # the node timer (Node.call_at) of the turn's timeout
    prices: Any = None
    takes_input: bool = True  # the provider applies SubmitInput (a provider says otherwise: takes_input)

    @property
    def done(self) -> bool:
        return self.receipt is not None


def parse_tool_call(call: NativeToolCall) -> TurnToolCall:
    """The Router's half of strict parsing: the native tool must be call_ktool with a JSON-object
    argument; anything else is a bounded ToolCallError carrying the exact native call id."""
    if call.name != CALL_KTOOL:
        return TurnToolCall(
            call_id=call.call_id,
            name=call.name,
            error=ToolCallError(
                kind=ToolCallErrorKind.UNKNOWN_FUNCTION, detail=f"unknown function {call.name[:60]!r}"
            ),
        )
    try:
        arguments = json.loads(call.arguments)
    except ValueError as exc:
        return TurnToolCall(
            call_id=call.call_id,
            name=call.name,
            error=ToolCallError(kind=ToolCallErrorKind.INVALID_JSON, detail=str(exc)[:120]),
        )
    if not isinstance(arguments, dict):
        return TurnToolCall(
            call_id=call.call_id,
            name=call.name,
            error=ToolCallError(
                kind=ToolCallErrorKind.NOT_OBJECT, detail=f"arguments are a {type(arguments).__name__}"
            ),
        )
    if not _fits_the_wire(arguments, 0):
        return TurnToolCall(
            call_id=call.call_id,
            name=call.name,
            error=ToolCallError(
                kind=ToolCallErrorKind.INVALID_ARGUMENTS,
                detail="arguments nest too deep or hold an integer beyond 64 bits",
            ),
        )
    return TurnToolCall(call_id=call.call_id, name=call.name, arguments=arguments)


def _fits_the_wire(value: Any, depth: int) -> bool:
    """JSON msgpack can carry: integers within 64 bits, nesting within the codec's bound."""
    if depth > 30:
        return False
    if isinstance(value, bool) or value is None or isinstance(value, str | float):
        return True
    if isinstance(value, int):
        return -(1 << 63) <= value < (1 << 64)
    if isinstance(value, list):
        return all(_fits_the_wire(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_fits_the_wire(v, depth + 1) for v in value.values())
    return False


# ------------------------------------------------------------------------------- replay (mailbox records)
def encode_local(registry: Any, message: Any) -> bytes | None:
    """The Router's own mailbox messages as ``record_mailbox`` payloads (transport/replay.py), so a replay
    needs no provider, worker thread, timer or ticker; None for a message that is not one of them."""

    row: list[Any] = []  # stays empty for a message that is not one of the Router's own
    match message:
        case Emitted(operation_id=op, event=event):
            match event:
                case Submitted(context=context):
                    row = ["emitted", op.bytes, "submitted", registry.encode(context)]
                case TextDelta(text=text):
                    row = ["emitted", op.bytes, "text", text]
                case UsageUpdate(usage=usage):
                    row = ["emitted", op.bytes, "usage", registry.encode(usage)]
                case ToolCallRequested(call=call):
                    row = ["emitted", op.bytes, "tool_call", [call.call_id, call.name, call.arguments]]
        case Finished(operation_id=op, outcome=outcome, error=error):
            if outcome is not None:
                packed_usage = None if outcome.usage is None else registry.encode(outcome.usage)
                row = ["finished", op.bytes, [outcome.answer, packed_usage, outcome.continuation], None]
            elif isinstance(error, ProviderError):
                row = ["finished", op.bytes, None, ["provider", error.kind, error.message, error.started]]
            else:
                row = ["finished", op.bytes, None, ["other", type(error).__name__, str(error)]]
        case TimedOut(operation_id=op):
            row = ["timed_out", op.bytes]
        case Counted(ctx=ctx, counts=counts, error=error):
            row = ["counted", ctx.header.id, None if counts is None else list(counts), None if error is None
                   else str(error)]  # fmt: skip
        case Tick():
            row = ["tick"]
        case StepMark(end=end):
            row = ["step_end" if end else "step"]
    return pack_payload(row) if row else None


def decode_local(registry: Any, payload: bytes, open_requests: Any) -> Any:
    """The mailbox message ``encode_local`` recorded; ``open_requests`` maps a request id to its deferred
    ``Context`` (a token count's answer goes to the request that asked)."""

    row = unpack_payload(payload)
    kind = row[0]
    if kind == "emitted":
        op, what, value = uuid.UUID(bytes=row[1]), row[2], row[3]
        event: Any
        if what == "submitted":
            event = Submitted(context=registry.decode("agent.model_context", value))
        elif what == "text":
            event = TextDelta(text=value)
        elif what == "usage":
            event = UsageUpdate(usage=registry.decode(TokenUsage.TAG, value))
        else:
            event = ToolCallRequested(call=NativeToolCall(*value))
        return Emitted(op, event)
    if kind == "finished":
        op = uuid.UUID(bytes=row[1])
        if row[2] is not None:
            answer, usage, continuation = row[2]
            decoded = None if usage is None else registry.decode(TokenUsage.TAG, usage)
            return Finished(op, ProviderOutcome(answer, decoded, continuation=continuation), None)
        error = row[3]
        failure: BaseException
        if error[0] == "provider":
            failure = ProviderError(error[1], error[2], started=error[3])
        elif error[0] == "closed":  # how captures made before "closed" was a ProviderError kind hold it
            failure = ProviderError(CLOSED, error[1])
        else:
            failure = type(error[1], (Exception,), {})(error[2])  # same name and text as the recorded error
        return Finished(op, None, failure)
    if kind == "timed_out":
        return TimedOut(uuid.UUID(bytes=row[1]))
    if kind == "counted":
        ctx = open_requests[row[1]]
        counts = None if row[2] is None else tuple(row[2])
        return Counted(ctx, counts, None if row[3] is None else ProviderFailed(row[3], kind="failed"))
    if kind == "tick":
        return TICK
    if kind in ("step", "step_end"):
        return STEP_ENDED if kind == "step_end" else STEP_STARTED
    raise ValueError(f"not a Router mailbox record: {kind!r}")
