"""The Router actor: the sole owner of providers, credentials, the model catalog, cancellation lineage and
canonical receipts (seed 000: ``kcode_intelligence_router``; RULES.md RT-*, A.2).

Each provider turn runs on a worker thread of its own and reports back through this actor's mailbox, so
the Router keeps answering while tokens stream. Per turn it keeps a queue of events; a ``NextTurnEvent``
with nothing queued is answered later (the request is deferred, never waited on). Every turn gets exactly
one ``UsageReceipt`` on every path (completed, failed, unavailable, cancelled/interrupted, timed out),
written to the SQLite ledger before anyone hears of it; asking again returns the same receipt.
"""

from __future__ import annotations

import collections
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.base import DEFER, BusActor, Context
from actors.router.catalog import DEFAULT_CATALOG, ModelCatalog
from actors.router.ledger import ReceiptLedger
from actors.router.messages import (
    TERMINAL_EVENTS,
    CancelOperation,
    CountTokens,
    FinishUnavailable,
    GetReceipt,
    GetReceiptsFor,
    InvalidCallId,
    NextTurnEvent,
    OperationsCancelled,
    ProviderFailed,
    ProviderUnavailable,
    ReceiptList,
    ResolveModel,
    RespondCall,
    RouterError,
    StartTurn,
    StreamTurnEvents,
    SubmitInput,
    TokenCount,
    TurnCancelled,
    TurnClosed,
    TurnCompleted,
    TurnEventBatch,
    TurnInput,
    TurnNotFound,
    TurnStarted,
    TurnTerminated,
    TurnTextDelta,
    TurnTimedOut,
    TurnToolCall,
    TurnUsage,
)
from actors.router.providers.base import (
    ChatMessage,
    NativeToolCall,
    Provider,
    ProviderError,
    ProviderEvent,
    ProviderOutcome,
    Submitted,
    TextDelta,
    ToolCallRequested,
    ToolSpec,
    TurnRequest,
    UsageUpdate,
    estimate_tokens,
)
from actors.router.providers.base import (
    TurnCancelled as ProviderTurnCancelled,
)
from actors.types import (
    CALL_KTOOL,
    AgentContinuation,
    ReceiptStatus,
    ResolvedAgentModel,
    TokenUsage,
    ToolCallError,
    ToolCallErrorKind,
    ToolResult,
    UsageReceipt,
)
from transport.errors import ProtocolError

log = logging.getLogger(__name__)

# The one native tool (RT-04): the application tool's name and its JSON-object arguments.
CALL_KTOOL_PARAMETERS: Mapping[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "the application tool to run"},
        "arguments": {"type": "object", "description": "that tool's arguments"},
    },
    "required": ["name", "arguments"],
}


_BATCH = 256  # events per stream part at most (bounded frame size; text deltas are small)


# Messages from worker threads to the Router's own mailbox (local only, never on the wire).
@dataclass(frozen=True, slots=True)
class _Emitted:
    operation_id: uuid.UUID
    event: ProviderEvent


@dataclass(frozen=True, slots=True)
class _Finished:
    operation_id: uuid.UUID
    outcome: ProviderOutcome | None
    error: BaseException | None


@dataclass(frozen=True, slots=True)
class _TimedOut:
    operation_id: uuid.UUID


@dataclass(frozen=True, slots=True)
class _Counted:
    ctx: Context
    counts: tuple[int, ...] | None
    error: BaseException | None


class _WorkerIO:
    """The provider's view of its turn (TurnIO): runs on the worker thread, talks by telling the Router."""

    def __init__(self, router: Any, operation_id: uuid.UUID) -> None:
        self._router = router
        self._op = operation_id
        self.cancelled = threading.Event()
        self._results: queue.SimpleQueue[tuple[str, ToolResult] | None] = queue.SimpleQueue()
        self._early: dict[str, ToolResult] = {}
        # Set by SubmitInput on the Router's thread before the RespondCall that resumes the worker; the
        # result queue orders the two, so the worker sees it once its wait_result returns.
        self._next_input: str | None = None

    def submit_input(self, text: str) -> None:
        self._next_input = text

    def take_input(self) -> str | None:
        text, self._next_input = self._next_input, None
        return text

    def emit(self, event: ProviderEvent) -> None:
        self._router.tell(_Emitted(self._op, event))

    def deliver(self, call_id: str, result: ToolResult) -> None:
        self._results.put((call_id, result))

    def cancel(self) -> None:
        self.cancelled.set()
        self._results.put(None)

    def wait_result(self, call_id: str) -> ToolResult:
        if call_id in self._early:
            return self._early.pop(call_id)
        while True:
            item = self._results.get()
            if item is None or self.cancelled.is_set():
                raise ProviderTurnCancelled(call_id)
            got_id, result = item
            if got_id == call_id:
                return result
            self._early[got_id] = result  # answered out of order: keep for its own wait


@dataclass(eq=False)
class _Turn:
    operation_id: uuid.UUID
    parent_operation_id: uuid.UUID
    spec: StartTurn
    model: ResolvedAgentModel
    io: _WorkerIO
    started_ms: int
    events: collections.deque[Any] = field(default_factory=collections.deque)
    waiting: list[Context] = field(default_factory=list)  # deferred NextTurnEvent requests
    stream: Context | None = None  # a StreamTurnEvents request being fed partials
    surfaced: set[str] = field(default_factory=set)  # call ids surfaced and not yet answered
    answered: set[str] = field(default_factory=set)
    usage: TokenUsage | None = None
    produced: bool = False
    receipt: UsageReceipt | None = None
    failure: RouterError | None = None  # terminal error waiting to be reported
    timer: threading.Timer | None = None
    prices: Any = None
    takes_input: bool = True  # the provider applies SubmitInput (a provider says otherwise: takes_input)

    @property
    def done(self) -> bool:
        return self.receipt is not None


class RouterActor(BusActor):
    """See the module docstring. One per node that serves models; reach it with ``RouterClient``."""

    DIRECT = True

    def __init__(
        self,
        node: Any,
        address: str,
        *,
        catalog: ModelCatalog | None = None,
        data_dir: str | Path | None = None,
        providers: Mapping[str, Provider] | None = None,
        env: Mapping[str, str] | None = None,
        new_operation_id: Callable[[], uuid.UUID] = uuid.uuid4,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        super().__init__(node, address)
        self.catalog = catalog or DEFAULT_CATALOG
        self._data_dir = Path(data_dir) if data_dir is not None else None
        self._ledger: ReceiptLedger | None = None
        self._provider_overrides = dict(providers or {})
        self._providers: dict[str, Provider] = {}
        self._env = env
        self._new_op = new_operation_id
        self._clock_ms = clock_ms or (lambda: int(time.time() * 1000))
        self._turns: dict[uuid.UUID, _Turn] = {}
        self._children: dict[uuid.UUID, set[uuid.UUID]] = collections.defaultdict(set)
        self._threads: set[threading.Thread] = set()

    # ------------------------------------------------------------------------------------- lifecycle
    def on_start(self) -> None:
        super().on_start()
        if self._data_dir is not None:
            # Opened on this thread: sqlite connections are thread-bound, and only the Router writes.
            self._ledger = ReceiptLedger(self._data_dir / "receipts.sqlite3")

    def on_stop(self) -> None:
        for turn in list(self._turns.values()):
            if not turn.done:
                turn.io.cancel()
                self._settle(turn, "interrupted", "the Router stopped")
        for provider in self._providers.values():
            try:
                provider.close()
            except Exception:
                log.exception("closing provider %s failed", provider.name)
        if self._ledger is not None:
            self._ledger.close()
        super().on_stop()

    # --------------------------------------------------------------------------------------- dispatch
    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case ResolveModel(requested=requested):
                return self.catalog.resolve(requested)[0]
            case StartTurn():
                return self._start(message)
            case NextTurnEvent(operation_id=op):
                return self._next(self._turn(op), ctx)
            case StreamTurnEvents(operation_id=op):
                return self._stream(self._turn(op), ctx)
            case RespondCall(operation_id=op, call_id=call_id, result=result):
                return self._respond(self._turn(op), call_id, result)
            case FinishUnavailable(operation_id=op):
                return self._finish_unavailable(op)
            case CancelOperation(operation_id=op):
                return OperationsCancelled(operation_ids=tuple(self._cancel(op)))
            case SubmitInput(operation_id=op, input=text):
                turn = self._turn(op)
                if turn.done:
                    raise TurnTerminated(f"operation {op} has ended", receipt=turn.receipt)
                if not turn.takes_input:  # stored, never read: the caller's edits would not reach the model
                    raise ProtocolError(
                        f"model {turn.spec.model!r} runs on a provider that cannot take a re-rendered input: "
                        f"SubmitInput is not supported (operation {op})"
                    )
                turn.io.submit_input(text)
                return None
            case CountTokens(model=model, texts=texts):
                return self._count(model, texts, ctx)
            case GetReceipt(operation_id=op):
                receipt = self._receipt_of(op)
                if receipt is None:
                    raise TurnNotFound(f"no receipt for operation {op}")
                return receipt
            case GetReceiptsFor(parent_operation_id=parent):
                return ReceiptList(receipts=self._receipts_for(parent))
        raise TypeError(f"the Router does not handle {type(message).__name__}")

    def on_local(self, message: Any) -> Any:
        try:
            return self._on_local(message)
        except Exception:
            # A bug in turn bookkeeping must not stop the Router (pykka stops an actor whose tell raises):
            # the other turns and the receipts they owe are worth more than this message.
            log.exception("%s: handling %s failed", self.address, type(message).__name__)
            return None

    def _on_local(self, message: Any) -> Any:
        match message:
            case _Emitted(operation_id=op, event=event):
                turn = self._turns.get(op)
                if turn is not None and not turn.done:
                    self._on_event(turn, event)
            case _Finished(operation_id=op, outcome=outcome, error=error):
                turn = self._turns.get(op)
                if turn is not None and not turn.done:
                    self._on_finished(turn, outcome, error)
            case _Counted(ctx=ctx, counts=counts, error=error):
                if error is not None:
                    ctx.fail(error)
                else:
                    ctx.reply(TokenCount(counts=counts or (), exact=True))
            case _TimedOut(operation_id=op):
                turn = self._turns.get(op)
                if turn is not None and not turn.done:
                    turn.io.cancel()
                    self._fail(
                        turn, "timed_out", TurnTimedOut, f"no completion within {turn.spec.timeout_s}s"
                    )
            case _:
                return super().on_local(message)
        return None

    # ---------------------------------------------------------------------------------------- starting
    def _start(self, spec: StartTurn) -> TurnStarted:
        resolved, entry, provider_entry = self.catalog.resolve(spec.model)
        provider = self._provider(provider_entry)
        op = self._new_op()
        io = _WorkerIO(self.actor_ref, op)
        turn = _Turn(
            op,
            spec.parent_operation_id,
            spec,
            resolved,
            io,
            self._clock_ms(),
            prices=getattr(entry, "prices", None),
            takes_input=getattr(provider, "takes_input", True) is not False,
        )
        self._turns[op] = turn
        self._children[spec.parent_operation_id].add(op)
        request = TurnRequest(
            model=resolved,
            messages=self._messages(spec),
            tool=ToolSpec(CALL_KTOOL, spec.tool_description, CALL_KTOOL_PARAMETERS),
            reasoning_effort=spec.reasoning_effort,
            max_output_tokens=spec.max_output_tokens,
            # The provider entry's options configured its client already; per-turn overrides go here.
        )
        ref = self.actor_ref

        def work() -> None:
            try:
                outcome = provider.run_turn(request, io)
            except BaseException as exc:  # noqa: BLE001 - reported to the Router, which decides the receipt
                _tell_quietly(ref, _Finished(op, None, exc))  # the Router may have stopped meanwhile
            else:
                _tell_quietly(ref, _Finished(op, outcome, None))

        thread = threading.Thread(target=work, name=f"kbus-turn-{op}", daemon=True)
        thread.start()
        if spec.timeout_s is not None:
            turn.timer = threading.Timer(spec.timeout_s, lambda: _tell_quietly(ref, _TimedOut(op)))
            turn.timer.daemon = True
            turn.timer.start()
        return TurnStarted(operation_id=op, model=resolved)

    def _count(self, model: str, texts: tuple[str, ...], ctx: Context) -> Any:
        """The provider's tokenizer counts on a thread of their own (it may load a model file first), and
        the answer comes back through this mailbox; without a tokenizer, the conservative estimate."""
        _, _, provider_entry = self.catalog.resolve(model)
        counter = getattr(self._provider(provider_entry), "count_tokens", None)
        if counter is None:
            return TokenCount(counts=tuple(estimate_tokens(t) for t in texts), exact=False)
        ref = self.actor_ref

        def work() -> None:
            try:
                counts = tuple(int(n) for n in counter(texts))
            except Exception as exc:  # noqa: BLE001 - reported to the caller as a typed error
                error = ProviderFailed(f"counting tokens failed: {exc}"[:500], kind="failed")
                error.__cause__ = exc
                _tell_quietly(ref, _Counted(ctx, None, error))
            else:
                _tell_quietly(ref, _Counted(ctx, counts, None))

        threading.Thread(target=work, name="kbus-count-tokens", daemon=True).start()
        return DEFER

    def _messages(self, spec: StartTurn) -> tuple[ChatMessage, ...]:
        messages: list[ChatMessage] = []
        if spec.instructions:
            messages.append(ChatMessage("system", spec.instructions))
        if spec.continuation is not None:
            messages.extend(self._continued(spec.continuation))
        messages.append(ChatMessage("user", spec.input))
        return tuple(messages)

    def _continued(self, continuation: AgentContinuation) -> list[ChatMessage]:
        """The conversation a continuation token stands for (kept by the Router, opaque to everyone else)."""
        try:
            rows = json.loads(continuation.token.decode("utf-8"))
            return [
                ChatMessage(
                    r["role"],
                    r["content"],
                    tuple(NativeToolCall(*c) for c in r.get("calls", ())),
                    r.get("call_id"),
                )
                for r in rows
            ]
        except (ValueError, KeyError, TypeError) as exc:
            raise RouterError(f"unreadable continuation: {exc}", kind="bad_continuation") from None

    def _provider(self, entry: Any) -> Provider:
        name = entry.name
        if name in self._provider_overrides:
            return self._provider_overrides[name]
        provider = self._providers.get(name)
        if provider is None:
            from actors.router.providers import build_provider

            provider = build_provider(entry, env=self._env)
            self._providers[name] = provider
        return provider

    # ------------------------------------------------------------------------------------------ events
    def _on_event(self, turn: _Turn, event: ProviderEvent) -> None:
        match event:
            case Submitted(context=context):
                self._queue(turn, TurnInput(context=context))
            case TextDelta(text=text):
                turn.produced = True
                self._queue(turn, TurnTextDelta(text=text))
            case UsageUpdate(usage=usage):
                turn.usage = usage
                self._queue(turn, TurnUsage(usage=usage))
            case ToolCallRequested(call=call):
                turn.produced = True
                turn.surfaced.add(call.call_id)
                self._queue(turn, parse_tool_call(call))

    def _on_finished(self, turn: _Turn, outcome: ProviderOutcome | None, error: BaseException | None) -> None:
        if turn.timer is not None:
            turn.timer.cancel()
        if outcome is not None:
            usage = outcome.usage or turn.usage
            turn.usage = usage
            receipt = self._settle(turn, "completed", None)
            self._queue(
                turn,
                TurnCompleted(
                    answer=outcome.answer,
                    usage=usage,
                    receipt=receipt,
                    continuation=self._continuation(turn, outcome),
                ),
            )
            return
        from actors.router.providers.scripted import StreamClosed

        if isinstance(error, StreamClosed):
            self._queue(turn, TurnClosed())  # no receipt yet: finish_unavailable accounts for it (SI-09)
            return
        if isinstance(error, ProviderError):
            status: ReceiptStatus = {
                "unavailable": "unavailable",
                "cancelled": "interrupted",
                "timed_out": "timed_out",
            }.get(error.kind, "failed")  # type: ignore[assignment]
            cls = {
                "unavailable": ProviderUnavailable,
                "cancelled": TurnCancelled,
                "timed_out": TurnTimedOut,
            }.get(error.kind, ProviderFailed)
            self._fail(turn, status, cls, error.message, cause=error.__cause__ or error)
        else:
            log.error("provider for %s raised %r", turn.operation_id, error, exc_info=error)
            self._fail(turn, "failed", ProviderFailed, f"{type(error).__name__}: {error}", cause=error)

    def _continuation(self, turn: _Turn, outcome: ProviderOutcome) -> AgentContinuation | None:
        if turn.spec.ephemeral:
            return None
        rows = [
            {"role": m.role, "content": m.content} for m in self._messages(turn.spec) if m.role != "system"
        ]
        rows.append({"role": "assistant", "content": outcome.answer})
        return AgentContinuation(
            provider=turn.model.provider, model=turn.model.model, token=json.dumps(rows).encode("utf-8")
        )

    def _fail(
        self,
        turn: _Turn,
        status: ReceiptStatus,
        cls: type[RouterError],
        message: str,
        cause: BaseException | None = None,
    ) -> None:
        receipt = self._settle(turn, status, message)
        error = cls(message, receipt=receipt, kind=status)
        if cause is not None:
            error.__cause__ = cause
        turn.failure = error
        self._flush(turn)

    def _queue(self, turn: _Turn, event: Any) -> None:
        turn.events.append(event)
        self._flush(turn)

    def _flush(self, turn: _Turn) -> None:
        """Hand queued events to whoever waits: the stream first, else deferred next_event requests."""
        while turn.events and turn.stream is not None:
            batch: list[Any] = []
            while turn.events and not isinstance(turn.events[0], TERMINAL_EVENTS) and len(batch) < _BATCH:
                batch.append(turn.events.popleft())
            if len(batch) == 1:
                turn.stream.partial(batch[0])
            elif batch:
                turn.stream.partial(TurnEventBatch(events=tuple(batch)))
            if turn.events and isinstance(turn.events[0], TERMINAL_EVENTS):
                turn.stream.reply(turn.events.popleft())
                turn.stream = None
        while turn.events and turn.waiting:
            turn.waiting.pop(0).reply(turn.events.popleft())
        if turn.failure is not None and not turn.events:
            for ctx in ([turn.stream] if turn.stream is not None else []) + turn.waiting:
                ctx.fail(turn.failure)
            turn.stream, turn.waiting = None, []

    def _next(self, turn: _Turn, ctx: Context) -> Any:
        if turn.events:
            return turn.events.popleft()
        if turn.failure is not None:
            raise turn.failure
        if turn.done:
            raise TurnTerminated(f"operation {turn.operation_id} has ended", receipt=turn.receipt)
        turn.waiting.append(ctx)
        return DEFER

    def _stream(self, turn: _Turn, ctx: Context) -> Any:
        if turn.stream is not None or turn.waiting:
            raise RouterError(f"operation {turn.operation_id} already has a reader", kind="busy")
        if turn.done and not turn.events and turn.failure is None:
            raise TurnTerminated(f"operation {turn.operation_id} has ended", receipt=turn.receipt)
        turn.stream = ctx
        self._flush(turn)
        return DEFER

    def _respond(self, turn: _Turn, call_id: str, result: ToolResult) -> None:
        if call_id not in turn.surfaced:
            why = "was answered already" if call_id in turn.answered else "was never surfaced"
            raise InvalidCallId(f"call {call_id!r} of operation {turn.operation_id} {why}")
        if turn.done:
            raise TurnTerminated(f"operation {turn.operation_id} has ended", receipt=turn.receipt)
        turn.surfaced.discard(call_id)
        turn.answered.add(call_id)
        turn.io.deliver(call_id, result)

    # -------------------------------------------------------------------------------------- accounting
    def _settle(self, turn: _Turn, status: ReceiptStatus, error: str | None) -> UsageReceipt:
        """Issue the turn's one receipt: written to the ledger before it is reported."""
        if turn.receipt is not None:
            return turn.receipt
        if turn.timer is not None:
            turn.timer.cancel()
        now = self._clock_ms()
        usage = turn.usage
        prices = turn.prices
        receipt = UsageReceipt(
            receipt_id=f"rcpt-{uuid.uuid4()}",
            operation_id=turn.operation_id,
            parent_operation_id=turn.parent_operation_id,
            user_id=turn.spec.user_id,
            provider=turn.model.provider,
            provider_model=turn.model.provider_model,
            model=turn.model.model,
            round=turn.spec.round,
            status=status,
            usage=usage,
            issued_at_ms=now,
            started_at_ms=turn.started_ms,
            duration_ms=max(0, now - turn.started_ms),
            cost_usd=prices.cost_usd(usage) if prices is not None and usage is not None else None,
            error=error,
        )
        if self._ledger is not None:
            receipt = self._ledger.record(receipt)  # the stored one wins if it exists (exactly once)
        turn.receipt = receipt
        return receipt

    def _finish_unavailable(self, op: uuid.UUID) -> UsageReceipt:
        turn = self._turns.get(op)
        if turn is None:
            stored = self._receipt_of(op)
            if stored is None:
                raise TurnNotFound(f"no operation {op}")
            return stored
        if turn.done:
            assert turn.receipt is not None
            return turn.receipt
        turn.io.cancel()
        receipt = self._settle(turn, "interrupted", "accounted as unavailable by the caller")
        turn.failure = TurnTerminated(f"operation {op} was accounted as unavailable", receipt=receipt)
        self._flush(turn)
        return receipt

    def _cancel(self, op: uuid.UUID) -> list[uuid.UUID]:
        """Cancel ``op``'s turn (if it is one) and every descendant operation's turn."""
        cancelled: list[uuid.UUID] = []
        stack = [op]
        seen: set[uuid.UUID] = set()
        while stack:
            current = stack.pop()
            if current in seen:
                continue
            seen.add(current)
            stack.extend(self._children.get(current, ()))
            turn = self._turns.get(current)
            if turn is not None and not turn.done:
                turn.io.cancel()
                status: ReceiptStatus = "interrupted" if turn.produced else "cancelled"
                self._fail(turn, status, TurnCancelled, f"operation {current} was cancelled")
                cancelled.append(current)
        return cancelled

    def _receipt_of(self, op: uuid.UUID) -> UsageReceipt | None:
        turn = self._turns.get(op)
        if turn is not None and turn.receipt is not None:
            return turn.receipt
        return self._ledger.get(op) if self._ledger is not None else None

    def _receipts_for(self, parent: uuid.UUID) -> tuple[UsageReceipt, ...]:
        """The ledger's receipts under ``parent`` plus those of its live turns (no ledger: only those)."""
        found = {r.operation_id: r for r in (self._ledger.for_parent(parent) if self._ledger else ())}
        for op in self._children.get(parent, ()):
            receipt = self._receipt_of(op)
            if receipt is not None:
                found.setdefault(op, receipt)
        return tuple(sorted(found.values(), key=lambda r: r.issued_at_ms))

    def _turn(self, op: uuid.UUID) -> _Turn:
        turn = self._turns.get(op)
        if turn is None:
            receipt = self._receipt_of(op)
            if receipt is not None:
                raise TurnTerminated(f"operation {op} has ended", receipt=receipt)
            raise TurnNotFound(f"no operation {op}")
        return turn


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


def _tell_quietly(ref: Any, message: Any) -> None:
    try:
        ref.tell(message)
    except Exception:  # noqa: BLE001 - the Router stopped: nothing left to time out
        log.debug("router gone before %r", message)
