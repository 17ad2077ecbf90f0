"""The primary-session compatibility loop (seed 000; RULES.md RS-*, EV-07..EV-10).

``run_session`` is the application-host adapter over ``SessionInference``: one ``SessionLoopActor`` per call
runs the loop as an explicit state machine driven by continuations (it never blocks its mailbox), talking to
an inference-handle actor per provider round (RS-01) and to a ``HostActor`` that wraps the application's
``SessionHost`` object (possibly on another node or process).

``HostActor`` runs host methods on its own thread; a method that returns a ``concurrent.futures.Future`` is
answered when the future resolves, so ``record`` traffic keeps flowing while a long tool runs. Tool effects
are idempotent per key (operation id, round, call id): a repeated ``HostExecuteTool`` gets the stored outcome
without running the tool again.

A run can live in another process than its caller: a ``SessionLoopService`` there spawns the loop
(``run_session_future(..., loop_at=...)``). Every host and handle call is bounded by the run's
``SessionRunRequest.call_timeout``. Cancelling the caller's future (or the run's own deadline running out)
sends the loop ``CancelSession``: it stops at its next step boundary, accounting for an open provider turn
as interrupted and recording its receipt once.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol

from actors.base import DEFER, BusActor, Context
from actors.effects import EffectRunner, EffectStore, RerunSafe, idempotency_key, rerun_rule
from actors.errors import Broken, Cancelled, Exhausted, Invalid
from actors.inference.handle import (
    DEFAULT_ROUND_LIMIT,
    AwaitStarted,
    FinishUnavailable,
    InferenceError,
    InferenceHandleActor,
    InferenceStarted,
    NextEvent,
    PreparedRound,
    ProviderEndedError,
    Respond,
    SessionInferenceEvent,
    SessionInferenceRequest,
)
from actors.types import (
    AgentContinuation,
    ModelContext,
    TokenUsage,
    ToolCall,
    ToolCallError,
    ToolResult,
    UsageReceipt,
    note_accounting_failure,
    restore_accounting_note,
    retry_class,
)
from transport.codec import JsonValue
from transport.errors import BusError, Expired, ProtocolError
from transport.messages import Ok
from transport.node import Node
from transport.pending import Reply, forbid_blocking
from transport.replay import recorded_uuid

log = logging.getLogger(__name__)

HOST_TIMEOUT: Final = 3600.0  # a host call (a tool) may take long; the run's own deadline bounds the caller
HANDLE_TIMEOUT: Final = 3600.0
# The default bound on each host or handle call the loop makes (SessionRunRequest.call_timeout).
CALL_TIMEOUT: Final = 3600.0

__all__ = [
    "CALL_TIMEOUT",
    "CancelSession",
    "HostActor",
    "InvalidSessionRequest",
    "ProviderResume",
    "RoundCompletion",
    "RoundPreparation",
    "SessionCancelled",
    "SessionControl",
    "SessionEvent",
    "SessionHost",
    "SessionHostError",
    "SessionLoopActor",
    "SessionLoopService",
    "SessionRoundLimitError",
    "SessionRunRequest",
    "SessionToolOutcome",
    "idempotency_key",
    "is_session_round_limit",
    "manifest_hash",
    "run_session",
    "run_session_future",
]

# ------------------------------------------------------------------------------------------------ types


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionRunRequest:
    TAG: ClassVar[str] = "rs.request"
    user_id: str
    operation_id: uuid.UUID
    rounds_used: int
    round_limit: int = DEFAULT_ROUND_LIMIT
    # Not in the seed: how long the loop waits for any one host or inference-handle call (seconds). An
    # expired call ends the run with ``Expired`` after the open provider turn is accounted for.
    call_timeout: float = CALL_TIMEOUT


class RoundPreparation:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Run:
        TAG: ClassVar[str] = "rs.prep.run"
        prepared: PreparedRound

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Complete:
        TAG: ClassVar[str] = "rs.prep.complete"
        answer: str | None


class SessionEvent:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class InferenceSubmitted:
        TAG: ClassVar[str] = "rs.ev.submitted"
        round: int
        manifest_hash: str
        model: str

    @dataclass(frozen=True, slots=True, kw_only=True)
    class ProviderInput:
        TAG: ClassVar[str] = "rs.ev.provider_input"
        round: int
        context: ModelContext

    @dataclass(frozen=True, slots=True, kw_only=True)
    class UsageUpdated:
        TAG: ClassVar[str] = "rs.ev.usage"
        round: int
        usage: TokenUsage

    @dataclass(frozen=True, slots=True, kw_only=True)
    class ProviderReceipt:
        TAG: ClassVar[str] = "rs.ev.receipt"
        round: int
        usage: TokenUsage | None
        receipt: UsageReceipt
        continuation: AgentContinuation | None


AnySessionEvent = (
    SessionEvent.InferenceSubmitted
    | SessionEvent.ProviderInput
    | SessionEvent.UsageUpdated
    | SessionEvent.ProviderReceipt
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionToolOutcome:
    """``unknown``: the call may or may not have run (its host died while it ran); ``ok`` is then False
    and ``text`` says so, and the host does not run it again under the same idempotency key."""

    TAG: ClassVar[str] = "rs.tool_outcome"
    text: str
    ok: bool
    capture: JsonValue | None = None
    stop: bool = False
    finish_after_round: bool = False
    emitted_response: bool = False
    unknown: bool = False

    @classmethod
    def success(cls, text: str) -> SessionToolOutcome:
        return cls(text=text, ok=True)

    @classmethod
    def failure(cls, text: str) -> SessionToolOutcome:
        return cls(text=text, ok=False)


class ProviderResume:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Continue:
        TAG: ClassVar[str] = "rs.resume.continue"
        outcome: SessionToolOutcome

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Complete:
        TAG: ClassVar[str] = "rs.resume.complete"
        answer: str | None

    @dataclass(frozen=True, slots=True, kw_only=True)
    class RestartFresh:
        TAG: ClassVar[str] = "rs.resume.restart_fresh"


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundCompletion:
    TAG: ClassVar[str] = "rs.round_completion"
    answer: str
    used_tool: bool
    finish_requested: bool
    emitted_response: bool
    finish_reason: str = "stop"  # the provider's: "length" when the answer was cut at the token limit


class SessionControl:
    @dataclass(frozen=True, slots=True, kw_only=True)
    class Continue:
        TAG: ClassVar[str] = "rs.control.continue"

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Complete:
        TAG: ClassVar[str] = "rs.control.complete"
        answer: str | None


AnyRoundPreparation = RoundPreparation.Run | RoundPreparation.Complete
AnyProviderResume = ProviderResume.Continue | ProviderResume.Complete | ProviderResume.RestartFresh
AnySessionControl = SessionControl.Continue | SessionControl.Complete

# ----------------------------------------------------------------------------------------------- errors


class InvalidSessionRequest(Invalid, ValueError):
    """RS-02/RS-03: a zero limit, or a restored round count above the limit. Not a round-limit error."""

    WIRE = "rs.invalid_request"


class SessionRoundLimitError(Exhausted):
    """RS-05: the cumulative round limit is exhausted; test with ``is_session_round_limit``."""

    WIRE = "rs.round_limit"

    def __init__(self, message: str = "", *, limit: int, **details: Any) -> None:
        super().__init__(message or f"the session round limit of {limit} is exhausted", **details)
        self.limit = limit

    def wire_fields(self) -> dict[str, Any]:
        return {**self.details, "limit": self.limit}


class SessionCancelled(Cancelled):
    """The caller cancelled the run (``CancelSession``); the open provider turn was accounted for."""

    WIRE = "rs.cancelled"


class SessionHostError(Broken):
    """A failure an application host may raise to abort a run with a typed, wire-stable error."""

    WIRE = "rs.host_error"


def is_session_round_limit(error: BaseException | None) -> bool:
    """RT-13: whether ``error`` or anything in its cause/context chain is a ``SessionRoundLimitError``."""
    seen: set[int] = set()
    stack = [error]
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, SessionRoundLimitError):
            return True
        stack.extend((current.__cause__, current.__context__))
    return False


def manifest_hash(text: str) -> str:
    """RS-07: lowercase hex SHA-256 over the UTF-8 bytes of ``PreparedRound.input``."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------------------------- host


class SessionHost(Protocol):
    """The application host; every method may also return a ``concurrent.futures.Future`` of its value."""

    def prepare_round(self, round: int) -> Any: ...  # RoundPreparation.* | Future
    def record(self, event: AnySessionEvent) -> Any: ...  # None | Future
    def execute_tool(
        self, call: ToolCall | ToolCallError, provider_operation_id: uuid.UUID
    ) -> Any: ...  # SessionToolOutcome | Future
    def prepare_provider_resume(self, outcome: SessionToolOutcome) -> Any: ...  # ProviderResume.* | Future
    def complete_capture(self, capture: JsonValue, contents: str) -> Any: ...  # SessionControl.* | Future
    def complete_round(self, completion: RoundCompletion) -> Any: ...  # SessionControl.* | Future


@dataclass(frozen=True, slots=True, kw_only=True)
class HostPrepareRound:
    TAG: ClassVar[str] = "rs.host.prepare_round"
    round: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRecord:
    TAG: ClassVar[str] = "rs.host.record"
    event: AnySessionEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class HostExecuteTool:
    TAG: ClassVar[str] = "rs.host.execute_tool"
    call_id: str
    call: ToolCall | ToolCallError
    provider_operation_id: uuid.UUID
    idempotency_key: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HostPrepareResume:
    TAG: ClassVar[str] = "rs.host.prepare_resume"
    outcome: SessionToolOutcome


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCompleteCapture:
    TAG: ClassVar[str] = "rs.host.complete_capture"
    capture: JsonValue
    contents: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCompleteRound:
    TAG: ClassVar[str] = "rs.host.complete_round"
    completion: RoundCompletion


class HostActor(BusActor):
    """Serves one application ``SessionHost`` on the bus (one request message per host method).

    ``execute_tool`` runs at most once per idempotency key (actors/effects.py): a repeat gets the stored
    outcome (or the stored error); a duplicate arriving while the key runs waits for that run; a key whose
    run was cut off (the host died while it ran) gets ``SessionToolOutcome(ok=False, unknown=True)``, and the
    tool is not run again unless ``rerun_safe`` (tool names, or a predicate on the ``ToolCall``) says so; a
    store that cannot be written answers ``EffectStoreError`` and runs nothing. ``effects`` names the SQLite
    file that keeps this across restarts; without it the keys are remembered in memory.
    """

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        host: SessionHost,
        effects: str | Path | None = None,
        rerun_safe: RerunSafe = (),
    ) -> None:
        super().__init__(node, address)
        self.host = host
        self._effects = EffectRunner(self, EffectStore(effects), _unknown_outcome)
        self._rerun_safe = rerun_rule(rerun_safe)

    def handle(self, message: Any, ctx: Context) -> Any:
        host = self.host
        match message:
            case HostPrepareRound(round=r):
                return self._result(host.prepare_round(r), ctx)
            case HostRecord(event=event):
                return self._result(host.record(event), ctx)
            case HostExecuteTool(call=call, provider_operation_id=op, idempotency_key=key):
                summary = f"tool {call.name[:80]!r}" if isinstance(call, ToolCall) else "an invalid tool call"
                return self._effects.execute(
                    ctx, key, summary, lambda: host.execute_tool(call, op), rerun_safe=self._rerun_safe(call)
                )
            case HostPrepareResume(outcome=outcome):
                return self._result(host.prepare_provider_resume(outcome), ctx)
            case HostCompleteCapture(capture=capture, contents=contents):
                return self._result(host.complete_capture(capture, contents), ctx)
            case HostCompleteRound(completion=completion):
                return self._result(host.complete_round(completion), ctx)
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _result(self, result: Any, ctx: Context) -> Any:
        return self.answer_when_done(result, ctx)

    def on_stop(self) -> None:
        self._effects.close()
        super().on_stop()


def _unknown_outcome(text: str) -> SessionToolOutcome:
    return SessionToolOutcome(text=text, ok=False, unknown=True)


# ------------------------------------------------------------------------------------------------- loop


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSession:
    TAG: ClassVar[str] = "rs.run"
    request: SessionRunRequest
    host: str
    router: str
    observer: str | None = None  # told each streamed TurnTextDelta (a UI's live text); None: dropped
    # The loop actor's name, for a ``SessionLoopService`` to spawn it under (so the caller can cancel it).
    loop: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionResult:
    TAG: ClassVar[str] = "rs.result"
    answer: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelSession:
    """A control (answered at once, even mid-step): end the run at its next step boundary. An open
    provider turn is accounted for as interrupted and its receipt recorded once; the run then fails with
    ``SessionCancelled``. A provider stream being read is interrupted at once. Sent to a
    ``SessionLoopService`` with ``loop`` set, it is passed on to that loop."""

    TAG: ClassVar[str] = "rs.cancel"
    loop: str = ""


class SessionLoopActor(BusActor):
    """Runs one ``run_session`` (RS-01..RS-37) and stops. Every wait is a continuation (MB-03).

    ``CancelSession`` is answered at once; the run then ends at its next step boundary (before the next host
    or handle call it would make), accounting for an open provider turn first. A provider stream being read
    is interrupted at once: the loop asks the handle for ``finish_unavailable`` and, once both that answer
    and the read's own answer are in, records whichever receipt exists, once.
    """

    def __init__(self, node: Node, address: str, *, handle_timeout: float = HANDLE_TIMEOUT) -> None:
        super().__init__(node, address)
        self._handle_timeout = handle_timeout
        self._host_timeout = HOST_TIMEOUT
        self._ctx: Context | None = None
        self._request: SessionRunRequest | None = None
        self._host = ""
        self._router = ""
        self._observer: str | None = None
        self._round = 0
        self._handle: str | None = None
        self._handle_ref: Any = None
        self._handle_op: uuid.UUID | None = None
        self._handles = itertools.count()
        self._cancelled = False
        self._reading = False  # a NextEvent is in flight
        self._interrupt: dict[str, Reply] | None = None  # a cancelled read: its answers, by kind
        self._progressed = False  # a provider turn started or a tool ran: a later NotDelivered is Unavailable
        self._reset_round()

    def _reset_round(self) -> None:
        self._capture: JsonValue | None = None
        self._used_tool = False
        self._finish_requested = False
        self._emitted_response = False

    # ------------------------------------------------------------------------------------ entry
    def handle(self, message: Any, ctx: Context) -> Any:
        if isinstance(message, CancelSession):
            self._cancel()
            return None
        if not isinstance(message, RunSession):
            raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")
        if self._ctx is not None:
            raise InvalidSessionRequest("this session loop runs one run_session only")
        request = message.request
        if request.round_limit <= 0:  # RS-02
            raise InvalidSessionRequest("round_limit must be at least 1")
        if request.rounds_used < 0 or request.rounds_used > request.round_limit:  # RS-03
            raise InvalidSessionRequest(
                f"rounds_used {request.rounds_used} is outside 0..round_limit {request.round_limit}"
            )
        if not request.call_timeout > 0:  # also rejects NaN
            raise InvalidSessionRequest(f"call_timeout must be positive, not {request.call_timeout!r}")
        self._ctx, self._request = ctx, request
        self._host, self._router = message.host, message.router
        self._observer = message.observer
        self._host_timeout = request.call_timeout
        self._handle_timeout = min(self._handle_timeout, request.call_timeout)
        if self._cancelled:  # cancelled before the run reached this loop
            self._fail(SessionCancelled("the run was cancelled before it started"))
            return DEFER
        self._select_round(request.rounds_used + 1)  # RS-04
        return DEFER

    # ----------------------------------------------------------------------------------- cancel
    def _cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        if self._reading and self._handle is not None and self._interrupt is None:
            self._interrupt = {}
            self.ask(
                self._handle,
                FinishUnavailable(),
                lambda reply: self._interrupted("account", reply),
                timeout=self._handle_timeout,
            )

    def _stopping(self) -> bool:
        """At a step boundary: a cancelled run ends here (after accounting for an open turn)."""
        if not self._cancelled:
            return False
        self._abort(SessionCancelled("the run was cancelled"))
        return True

    def _interrupted(self, kind: str, reply: Reply) -> None:
        """A cancelled read: once the read's answer and the accounting's answer are both in, record the one
        receipt the turn has (from the final event, an error that carries it, or the accounting)."""
        interrupt = self._interrupt
        assert interrupt is not None
        interrupt[kind] = reply
        if len(interrupt) < 2:
            return
        events: list[SessionEvent.ProviderReceipt] = []
        seen: set[str] = set()
        for part in (interrupt["event"], interrupt["account"]):
            message = part.message if part.error is None else None
            usage, continuation = None, None
            if isinstance(message, SessionInferenceEvent.Completed):
                receipt: Any = message.receipt
                usage, continuation = message.usage, message.continuation
            else:
                receipt = message if part.error is None else getattr(part.error, "receipt", None)
            if isinstance(receipt, UsageReceipt) and receipt.receipt_id not in seen:
                seen.add(receipt.receipt_id)
                events.append(
                    SessionEvent.ProviderReceipt(
                        round=self._round, usage=usage, receipt=receipt, continuation=continuation
                    )
                )
        self._release_handle()
        cancelled = SessionCancelled("the run was cancelled while the provider was streaming")
        if not events:
            failure = interrupt["account"].error or interrupt["event"].error
            self._fail(cancelled if failure is None else note_accounting_failure(cancelled, failure))
            return
        self._record_receipts(events, cancelled)

    def _record_receipts(self, events: list[SessionEvent.ProviderReceipt], error: BaseException) -> None:
        first, rest = events[0], events[1:]

        def recorded(reply: Reply) -> None:
            if reply.error is not None:
                self._fail(note_accounting_failure(error, reply.error))
            elif rest:
                self._record_receipts(rest, error)
            else:
                self._fail(error)

        self.ask(self._host, HostRecord(event=first), recorded, timeout=self._host_timeout)

    # ------------------------------------------------------------------------------ host / handle
    def _call_host(self, message: Any, then: Callable[[Any], None]) -> None:
        """Ask the host; any host error aborts the run (after accounting when a handle is active)."""
        receipt = isinstance(message, HostRecord) and isinstance(message.event, SessionEvent.ProviderReceipt)
        if not receipt and self._stopping():  # a receipt in hand is recorded even when cancelled
            return

        def on_reply(reply: Reply) -> None:
            if reply.error is not None:
                self._abort(reply.error)
            else:
                then(reply.message)

        self.ask(self._host, message, on_reply, timeout=self._host_timeout)

    def _record(self, event: AnySessionEvent, then: Callable[[], None]) -> None:
        self._call_host(HostRecord(event=event), lambda _: then())  # EV-10: awaited

    def _call_handle(self, message: Any, then: Callable[[Reply], None]) -> None:
        assert self._handle is not None
        if not isinstance(message, FinishUnavailable) and self._stopping():
            return
        if isinstance(message, NextEvent):
            self._reading = True

            def read(reply: Reply) -> None:
                self._reading = False
                if self._interrupt is not None:
                    self._interrupted("event", reply)
                else:
                    then(reply)

            self.ask(self._handle, message, read, timeout=self._handle_timeout)
            return
        self.ask(self._handle, message, then, timeout=self._handle_timeout)

    # ---------------------------------------------------------------------------------- rounds
    def _select_round(self, r: int) -> None:
        request = self._request
        assert request is not None
        self._release_handle()
        if r > request.round_limit:  # RS-05: before prepare_round
            self._fail(SessionRoundLimitError(limit=request.round_limit))
            return
        self._round = r
        self._reset_round()
        self._call_host(HostPrepareRound(round=r), self._on_prepared)

    def _on_prepared(self, preparation: Any) -> None:
        match preparation:
            case RoundPreparation.Complete(answer=answer):
                self._succeed(answer)  # RS-06
            case RoundPreparation.Run(prepared=prepared):
                submitted = SessionEvent.InferenceSubmitted(
                    round=self._round, manifest_hash=manifest_hash(prepared.input), model=prepared.model
                )
                self._record(submitted, lambda: self._start(prepared))  # RS-07
            case other:
                self._fail(SessionHostError(f"prepare_round returned {type(other).__name__}"))

    def _start(self, prepared: PreparedRound) -> None:
        request = self._request
        assert request is not None
        if self._stopping():
            return
        inference = SessionInferenceRequest(
            user_id=request.user_id, operation_id=request.operation_id, round=self._round, prepared=prepared
        )  # RS-08: prepared passed through unchanged
        name = f"{self.name}.inference.{next(self._handles)}"
        # Hosted on this loop's thread: the loop's requests to its handle, and the answers, change no thread.
        self._handle_ref = self.host_actor(
            InferenceHandleActor,
            name,
            router=self._router,
            request=inference,
            start_timeout=self._handle_timeout,
            observer=self._observer,
        )
        self._handle = f"{self.node.name}/{name}"
        self._call_handle(AwaitStarted(), self._on_started)

    def _on_started(self, reply: Reply) -> None:
        if reply.error is not None:
            error = reply.error
            self._release_handle()
            receipt = error.receipt if isinstance(error, InferenceError) else None
            if receipt is not None:  # RS-29
                self._record_and_fail(error, receipt)
            else:
                self._fail(error)
            return
        started: InferenceStarted = reply.message
        self._handle_op = started.operation_id
        self._progressed = True
        self._next()

    def _next(self) -> None:
        self._call_handle(NextEvent(), self._on_event)

    def _on_event(self, reply: Reply) -> None:
        if reply.error is not None:
            error = reply.error
            receipt = error.receipt if isinstance(error, InferenceError) else None
            if receipt is not None:  # RS-30: the attached receipt
                self._record_and_fail(error, receipt)
            else:
                self._abort(error)
            return
        match reply.message:
            case Ok():  # RS-31: the stream closed without completion
                self._abort(ProviderEndedError("the provider stream ended without a final answer"))
            case SessionInferenceEvent.ProviderInput(context=context):  # RS-10
                self._record(SessionEvent.ProviderInput(round=self._round, context=context), self._next)
            case SessionInferenceEvent.UsageUpdated(usage=usage):
                self._record(SessionEvent.UsageUpdated(round=self._round, usage=usage), self._next)
            case SessionInferenceEvent.ToolCall(call_id=call_id, call=call):  # RS-11
                self._tool(call_id, call)
            case SessionInferenceEvent.Completed(
                answer=answer, usage=usage, receipt=receipt, continuation=continuation, finish_reason=why
            ):
                self._release_handle()
                event = SessionEvent.ProviderReceipt(
                    round=self._round, usage=usage, receipt=receipt, continuation=continuation
                )
                self._record(event, lambda: self._complete_round(answer, why))  # RS-23
            case other:
                self._abort(InferenceError(f"unexpected handle event {type(other).__name__}"))

    # ------------------------------------------------------------------------------------ tools
    def _tool(self, call_id: str, call: ToolCall | ToolCallError) -> None:
        request = self._request
        assert request is not None and self._handle_op is not None
        self._used_tool = True
        self._progressed = True
        execute = HostExecuteTool(
            call_id=call_id,
            call=call,
            provider_operation_id=self._handle_op,
            idempotency_key=idempotency_key(request.operation_id, self._round, call_id),
        )
        self._call_host(
            execute,
            lambda outcome: self._call_host(
                HostPrepareResume(outcome=outcome), lambda resume: self._resume(call_id, resume)
            ),  # RS-13
        )

    def _resume(self, call_id: str, resume: Any) -> None:
        match resume:
            case ProviderResume.Continue(outcome=outcome):  # RS-14
                if outcome.capture is not None:
                    self._capture = outcome.capture  # RS-21: the last non-None capture wins
                self._finish_requested |= outcome.finish_after_round  # RS-22
                self._emitted_response |= outcome.emitted_response
                result = ToolResult(success=outcome.ok, output=outcome.text)

                def responded(reply: Reply) -> None:
                    receipt = getattr(reply.error, "receipt", None)
                    if isinstance(receipt, UsageReceipt):  # RS-33: the turn ended at the Router
                        assert reply.error is not None
                        self._record_and_fail(reply.error, receipt)
                    elif reply.error is not None:
                        self._abort(reply.error)  # RS-33
                    elif outcome.stop:
                        self._account(lambda: self._succeed(None), self._fail)  # RS-24
                    else:
                        self._next()  # RS-36: the next call only after this one's response

                self._call_handle(Respond(call_id=call_id, result=result), responded)
            case ProviderResume.Complete(answer=answer):  # RS-15, RS-18, RS-25
                self._account(lambda: self._succeed(answer), self._fail)
            case ProviderResume.RestartFresh():  # RS-16, RS-17, RS-20, RS-26
                self._account(lambda: self._select_round(self._round + 1), self._fail)
            case other:
                self._abort(SessionHostError(f"prepare_provider_resume returned {type(other).__name__}"))

    # ------------------------------------------------------------------------------- completion
    def _complete_round(self, answer: str, finish_reason: str = "stop") -> None:
        if self._capture is not None:  # RS-21
            message: Any = HostCompleteCapture(capture=self._capture, contents=answer)
        else:  # RS-22
            message = HostCompleteRound(
                completion=RoundCompletion(
                    answer=answer,
                    used_tool=self._used_tool,
                    finish_requested=self._finish_requested,
                    emitted_response=self._emitted_response,
                    finish_reason=finish_reason,
                )
            )
        self._call_host(message, self._on_control)

    def _on_control(self, control: Any) -> None:
        match control:  # RS-27
            case SessionControl.Continue():
                self._select_round(self._round + 1)
            case SessionControl.Complete(answer=answer):
                self._succeed(answer)
            case other:
                self._fail(SessionHostError(f"the completion callback returned {type(other).__name__}"))

    # ------------------------------------------------------------------------------- accounting
    def _account(self, then: Callable[[], None], failed: Callable[[BaseException], None]) -> None:
        """finish_unavailable on the active handle, then record its receipt exactly once (EV-09)."""
        if self._handle is None or self._handle_op is None:
            then()
            return

        def accounted(reply: Reply) -> None:
            error = reply.error
            receipt = reply.message if error is None else getattr(error, "receipt", None)
            self._release_handle()
            if isinstance(receipt, UsageReceipt):
                event = SessionEvent.ProviderReceipt(
                    round=self._round, usage=None, receipt=receipt, continuation=None
                )

                def recorded(reply: Reply) -> None:
                    # A host that cannot take the receipt (it died mid-tool) must not hide why the run
                    # is ending: the accounting error, or the caller's own, is what ``failed`` reports.
                    if error is not None:
                        failed(error if reply.error is None else note_accounting_failure(error, reply.error))
                    elif reply.error is not None:
                        failed(reply.error)
                    else:
                        then()

                self.ask(self._host, HostRecord(event=event), recorded, timeout=self._host_timeout)
            elif error is not None:
                failed(error)
            else:
                failed(InferenceError(f"finish_unavailable returned {type(receipt).__name__}"))

        self._call_handle(FinishUnavailable(), accounted)

    def _record_and_fail(self, error: BaseException, receipt: UsageReceipt) -> None:
        """RS-29/30/33: an error's attached receipt is recorded once, then that error is raised, with a
        failing record attached to it (RS-34), never in its place."""
        self._release_handle()  # the handle is terminal: its receipt is the one attached
        event = SessionEvent.ProviderReceipt(
            round=self._round, usage=None, receipt=receipt, continuation=None
        )

        def recorded(reply: Reply) -> None:
            self._fail(error if reply.error is None else note_accounting_failure(error, reply.error))

        self.ask(self._host, HostRecord(event=event), recorded, timeout=self._host_timeout)

    def _abort(self, error: BaseException) -> None:
        """RS-12/RS-30..35: a failure with a live handle accounts for it first, then raises ``error``."""
        if self._handle is None or self._handle_op is None:
            self._fail(error)
            return
        self._account(
            lambda: self._fail(error),
            lambda accounting: self._fail(note_accounting_failure(error, accounting)),
        )

    # ------------------------------------------------------------------------------------ ending
    def _release_handle(self) -> None:
        ref, self._handle_ref = self._handle_ref, None
        self._handle = None
        self._handle_op = None
        if ref is not None:
            ref.stop(block=False)

    def _succeed(self, answer: str | None) -> None:
        self._release_handle()
        ctx = self._ctx
        if ctx is not None and not ctx.done:
            ctx.reply(SessionResult(answer=answer))
        self.stop()

    def _fail(self, error: BaseException) -> None:
        self._release_handle()
        ctx = self._ctx
        if ctx is not None and not ctx.done:
            ctx.fail(retry_class(error, progressed=self._progressed))
        self.stop()


# ------------------------------------------------------------------------------------------------ facade


class SessionLoopService(BusActor):
    """Runs each ``RunSession`` it receives in a new ``SessionLoopActor`` on its own node, and relays the
    result: a session loop in another process than its caller (``run_session_future(..., loop_at=...)``).
    The loop is spawned under ``RunSession.loop`` when given, so the caller can send it ``CancelSession``."""

    def handle(self, message: Any, ctx: Context) -> Any:
        if isinstance(message, CancelSession):
            # After the RunSession it cancels (one ordered stream from the caller): the loop exists.
            if message.loop.startswith("session.") and "/" not in message.loop:
                self.tell_to(f"{self.node.name}/{message.loop}", CancelSession())
            return None
        if not isinstance(message, RunSession):
            raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")
        name = message.loop or f"session.{recorded_uuid(self.node, self.address).hex}"
        if not name.startswith("session.") or "/" in name:
            raise InvalidSessionRequest(f"a session loop's name starts with 'session.', not {name[:80]!r}")
        self.node.spawn(SessionLoopActor, name)
        deadline = ctx.header.deadline
        timeout = None if deadline is None else max(0.001, deadline - self.node.clock())

        def relay(reply: Reply) -> None:
            if ctx.done:
                return
            if reply.error is not None:
                ctx.fail(reply.error)
            else:
                ctx.reply(reply.message)

        self.ask(f"{self.node.name}/{name}", message, relay, timeout=timeout)
        return DEFER


def run_session_future(
    node: Node,
    router_address: str,
    request: SessionRunRequest,
    host_address: str,
    *,
    timeout: float | None = None,
    loop_on: Node | None = None,
    loop_at: str | None = None,
) -> concurrent.futures.Future[Any]:
    """Spawn a ``SessionLoopActor`` and resolve with the final answer. The loop runs on ``loop_on`` (a local
    node, default ``node``), or, given ``loop_at``, in the process of that ``SessionLoopService``.

    Cancelling the returned future sends the loop ``CancelSession``: the run ends at its next step
    boundary, with an open provider turn accounted for as interrupted (its receipt recorded once). So does
    the run's own ``timeout`` running out (the caller then gets ``Expired``)."""
    name = f"session.{uuid.uuid4().hex}"
    if loop_at is not None:
        loop_address = f"{loop_at.partition('/')[0]}/{name}"
        target, message = (
            loop_at,
            RunSession(request=request, host=host_address, router=router_address, loop=name),
        )
    else:
        where = loop_on or node
        where.spawn(SessionLoopActor, name)
        loop_address = f"{where.name}/{name}"
        target, message = loop_address, RunSession(request=request, host=host_address, router=router_address)
    inner = node.request_future(target, message, timeout=timeout)
    outer: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def done(fut: concurrent.futures.Future[Any]) -> None:
        if not outer.set_running_or_notify_cancel():
            return  # cancelled by the caller: the loop was told (below); its late answer is dropped
        error = fut.exception()
        if isinstance(error, Expired):
            tell_cancel()  # nobody waits for the run any more: end it at its next step boundary
        if error is not None:
            outer.set_exception(restore_accounting_note(error))  # RS-34, rebuilt from the wire
        else:
            outer.set_result(fut.result().answer)

    def tell_cancel() -> None:
        try:
            if loop_at is not None:
                # Through the service, on the node's own ordered stream (the one the RunSession took), so
                # the cancel can never overtake the run and reach a loop not spawned yet.
                src = node.client_address(via_node=True)
                node.tell(loop_at, CancelSession(loop=name), src=src)
            else:
                node.tell(loop_address, CancelSession())
        except BusError as exc:  # the loop is gone or unreachable: nothing left to stop
            log.info("cancelling %s: %r", loop_address, exc)

    def cancelled(fut: concurrent.futures.Future[Any]) -> None:
        if fut.cancelled():
            tell_cancel()

    outer.add_done_callback(cancelled)
    inner.add_done_callback(done)
    return outer


def run_session(
    node: Node,
    router_address: str,
    request: SessionRunRequest,
    host_address: str,
    *,
    timeout: float | None = None,
    loop_at: str | None = None,
) -> str | None:
    forbid_blocking("run_session")
    future = run_session_future(node, router_address, request, host_address, timeout=timeout, loop_at=loop_at)
    return future.result(None if timeout is None else timeout + 1.0)  # type: ignore[no-any-return]


SESSION_MESSAGES = (
    SessionRunRequest,
    RoundPreparation.Run,
    RoundPreparation.Complete,
    SessionEvent.InferenceSubmitted,
    SessionEvent.ProviderInput,
    SessionEvent.UsageUpdated,
    SessionEvent.ProviderReceipt,
    SessionToolOutcome,
    ProviderResume.Continue,
    ProviderResume.Complete,
    ProviderResume.RestartFresh,
    RoundCompletion,
    SessionControl.Continue,
    SessionControl.Complete,
    HostPrepareRound,
    HostRecord,
    HostExecuteTool,
    HostPrepareResume,
    HostCompleteCapture,
    HostCompleteRound,
    RunSession,
    SessionResult,
    CancelSession,
)
SESSION_ERRORS: tuple[type[BusError], ...] = (
    InvalidSessionRequest,
    SessionRoundLimitError,
    SessionHostError,
    SessionCancelled,
)
