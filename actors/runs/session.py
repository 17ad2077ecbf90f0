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
import itertools
import logging
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol

from actors.base import DEFER, BusActor, Context
from actors.effects import RerunSafe, idempotency_key
from actors.errors import Broken, Cancelled, Exhausted, Invalid
from actors.inference.handle import (
    DEFAULT_ROUND_LIMIT,
    InferenceError,
    InferenceHandleActor,
    PreparedRound,
    Respond,
    RespondAndRead,
    SessionInferenceEvent,
    SessionInferenceRequest,
)
from actors.runs.events import AnySessionEvent, SessionEvent
from actors.runs.host import HANDLE_TIMEOUT, HostCompleteCapture, HostExecuteTool, HostRecord, ToolHostActor
from actors.runs.machine import (
    Abort,
    Answered,
    Ask,
    Close,
    Ended,
    Failed,
    Finish,
    Idle,
    Reading,
    Refuse,
    RoundActor,
    Run,
    Step,
    Succeed,
    Target,
    Then,
    abort,
    account,
    fail,
    failed_with,
    read,
    spawn_run,
    starting,
)
from actors.runs.projection import manifest_hash  # RS-07: the same identity as a subagent's EV-02
from actors.types import (
    ToolCall,
    ToolCallError,
    ToolResult,
    UsageReceipt,
    evolve,
    restore_accounting_note,
)
from transport.codec import JsonValue
from transport.errors import BusError, Expired, ProtocolError
from transport.messages import Ok
from transport.node import Node
from transport.pending import Reply, forbid_blocking
from transport.records import frozen
from transport.replay import recorded_uuid

log = logging.getLogger(__name__)

# The default bound on each host or handle call the loop makes (SessionRunRequest.call_timeout).
CALL_TIMEOUT: Final = 3600.0

__all__ = [
    "CALL_TIMEOUT",
    "CancelSession",
    "HostActor",
    "HostCompleteCapture",
    "HostExecuteTool",
    "HostRecord",
    "HostRunTool",
    "InvalidSessionRequest",
    "ProviderResume",
    "ResumeAfter",
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


@frozen(kw_only=True)
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
    @frozen(kw_only=True)
    class Run:
        TAG: ClassVar[str] = "rs.prep.run"
        prepared: PreparedRound

    @frozen(kw_only=True)
    class Complete:
        TAG: ClassVar[str] = "rs.prep.complete"
        answer: str | None


@frozen(kw_only=True)
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
    @frozen(kw_only=True)
    class Continue:
        TAG: ClassVar[str] = "rs.resume.continue"
        outcome: SessionToolOutcome

    @frozen(kw_only=True)
    class Complete:
        TAG: ClassVar[str] = "rs.resume.complete"
        answer: str | None

    @frozen(kw_only=True)
    class RestartFresh:
        TAG: ClassVar[str] = "rs.resume.restart_fresh"


@frozen(kw_only=True)
class RoundCompletion:
    TAG: ClassVar[str] = "rs.round_completion"
    answer: str
    used_tool: bool
    finish_requested: bool
    emitted_response: bool
    finish_reason: str = "stop"  # the provider's: "length" when the answer was cut at the token limit


class SessionControl:
    @frozen(kw_only=True)
    class Continue:
        TAG: ClassVar[str] = "rs.control.continue"

    @frozen(kw_only=True)
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


@frozen(kw_only=True)
class HostPrepareRound:
    TAG: ClassVar[str] = "rs.host.prepare_round"
    round: int


@frozen(kw_only=True)
class HostRunTool:
    """``execute_tool``, then ``prepare_provider_resume`` on its outcome, in one request (RS-11, RS-13: the
    rules order the two host calls, they do not need two bus round trips): answered with the
    ``ProviderResume`` decision. The tool runs at most once per ``idempotency_key``; a repeat gets the stored
    outcome, and the decision is made on it again."""

    TAG: ClassVar[str] = "rs.host.run_tool"
    call_id: str
    call: ToolCall | ToolCallError
    operation_id: uuid.UUID
    idempotency_key: str
    # RS-10: the events that came in one batch with this call (ProviderInput, UsageUpdated), recorded in
    # order before the tool runs, as a ``HostRecord`` each would be; a record that fails answers the request
    # with its error, and the tool does not run.
    records: tuple[SessionEvent.ProviderInput | SessionEvent.UsageUpdated, ...] = ()


@frozen(kw_only=True)
class HostPrepareResume:
    TAG: ClassVar[str] = "rs.host.prepare_resume"
    outcome: SessionToolOutcome


@frozen(kw_only=True)
class HostCompleteRound:
    TAG: ClassVar[str] = "rs.host.complete_round"
    completion: RoundCompletion


class ResumeAfter(Context):
    """The reply context of a ``HostRunTool`` for whoever executes the tool: the outcome it is answered with
    goes through ``decide`` (the host's ``prepare_provider_resume``: a decision, or a future of one) and the
    request is answered with that decision; a failure is answered as it is."""

    __slots__ = ("_decide", "_inner")

    def __init__(self, ctx: Context, actor: BusActor, decide: Callable[[SessionToolOutcome], Any]) -> None:
        self._inner = ctx
        self._actor = actor
        self._decide = decide

    # The request's own state is the inner context's: this one only changes what it is answered with.
    done = property(lambda self: self._inner.done, lambda self, value: setattr(self._inner, "done", value))
    expired = property(
        lambda self: self._inner.expired, lambda self, value: setattr(self._inner, "expired", value)
    )
    header = property(
        lambda self: self._inner.header, lambda self, value: setattr(self._inner, "header", value)
    )
    route = property(lambda self: self._inner.route, lambda self, value: setattr(self._inner, "route", value))

    def reply(self, message: Any, *, moved: bool = False) -> None:
        # What is sent is the host's decision on ``message``, made by application code: never moved.
        answer = self.decided(message)
        if answer is not DEFER and not self._inner.done:
            self._inner.reply(Ok() if answer is None else answer)

    def fail(self, error: BaseException) -> None:
        self._inner.fail(error)

    def decided(self, outcome: Any) -> Any:
        """The decision on ``outcome`` for a handler to return: a value, or ``DEFER`` (answered later)."""
        try:
            decision = self._decide(outcome)
        except Exception as exc:  # noqa: BLE001 - RS-32: the host's own failure is the answer
            if not self._inner.done:
                self._inner.fail(exc)
            return DEFER
        return self._actor.answer_when_done(decision, self._inner)


class HostActor(ToolHostActor):
    """Serves one application ``SessionHost`` on the bus (one request message per host method).

    ``execute_tool`` runs at most once per idempotency key (actors/runs/host.py, actors/effects.py): a repeat
    gets the stored outcome (or the stored error); a duplicate arriving while the key runs waits for that
    run; a key whose run was cut off gets ``SessionToolOutcome(ok=False, unknown=True)``. ``HostRunTool``
    runs the tool the same way and answers with ``prepare_provider_resume``'s decision on its outcome.
    """

    # Direct on a node with endpoints: a run's loop in another process reaches it on its own socket (a
    # lane, transport/inbox.py), with no I/O-thread hand-off on either side. It has a thread of its own
    # anyway: the application's callbacks may block.
    DIRECT = True

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        host: SessionHost,
        effects: str | Path | None = None,
        rerun_safe: RerunSafe = (),
    ) -> None:
        super().__init__(node, address, unknown=_unknown_outcome, effects=effects, rerun_safe=rerun_safe)
        self.host = host

    def handle(self, message: Any, ctx: Context) -> Any:
        host = self.host
        match message:
            case HostPrepareRound(round=r):
                return self.answer_when_done(host.prepare_round(r), ctx)
            case HostRecord(
                event=SessionEvent.InferenceSubmitted()
                | SessionEvent.ProviderInput()
                | SessionEvent.UsageUpdated()
                | SessionEvent.ProviderReceipt() as event
            ):
                return self.answer_when_done(host.record(event), ctx)
            case HostExecuteTool(call=call, operation_id=op, idempotency_key=key):
                return self.execute(ctx, call, key, partial(host.execute_tool, call, op))
            case HostRunTool(call=call, operation_id=op, idempotency_key=key, records=records):
                return self._records_then(records, ctx, partial(self._run_tool, ctx, call, op, key))
            case HostPrepareResume(outcome=outcome):
                return self.answer_when_done(host.prepare_provider_resume(outcome), ctx)
            case HostCompleteCapture(capture=capture, contents=contents):
                return self.answer_when_done(host.complete_capture(capture, contents), ctx)
            case HostCompleteRound(completion=completion):
                return self.answer_when_done(host.complete_round(completion), ctx)
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _run_tool(self, ctx: Context, call: ToolCall | ToolCallError, op: uuid.UUID, key: str) -> Any:
        then = ResumeAfter(ctx, self, self.host.prepare_provider_resume)
        answer = self.execute(then, call, key, partial(self.host.execute_tool, call, op))
        return answer if answer is DEFER else then.decided(answer)

    def _records_then(self, records: tuple[Any, ...], ctx: Context, go: Callable[[], Any]) -> Any:
        """RS-10: ``host.record`` each of ``records`` in order, then ``go()``; the handler's answer. A record
        that returns a future holds the rest until it resolves (``_RecordsDone``); a record that fails is the
        request's answer, and nothing after it runs."""
        for i, event in enumerate(records):
            result = self.host.record(event)
            if isinstance(result, concurrent.futures.Future):
                result.add_done_callback(partial(_records_done, self.actor_ref, records[i + 1 :], ctx, go))
                return DEFER
        return go()

    def on_local(self, message: Any) -> Any:
        if not isinstance(message, _RecordsDone):
            return super().on_local(message)
        ctx = message.ctx
        try:
            if message.future.cancelled():
                raise concurrent.futures.CancelledError()
            error = message.future.exception()
            if error is not None:
                raise error
            answer = self._records_then(message.rest, ctx, message.then)
        except Exception as exc:  # noqa: BLE001 - the record's (or the tool's) failure is the answer
            if not ctx.done:
                ctx.fail(exc)
            return None
        if answer is not DEFER and not ctx.done:
            ctx.reply(Ok() if answer is None else answer)
        return None


@frozen
class _RecordsDone:
    """A record of a ``HostRunTool``'s ``records`` resolved (HostActor's mailbox): go on with the rest."""

    future: concurrent.futures.Future[Any]
    rest: tuple[Any, ...]
    ctx: Context
    then: Callable[[], Any]


def _records_done(
    ref: Any,
    rest: tuple[Any, ...],
    ctx: Context,
    go: Callable[[], Any],
    future: concurrent.futures.Future[Any],
) -> None:
    ref.tell(_RecordsDone(future, rest, ctx, go))  # on the future's thread: only a hand-off to the mailbox


def _unknown_outcome(text: str) -> SessionToolOutcome:
    return SessionToolOutcome(text=text, ok=False, unknown=True)


# ------------------------------------------------------------------------------------------------- loop


@frozen(kw_only=True)
class RunSession:
    TAG: ClassVar[str] = "rs.run"
    request: SessionRunRequest
    host: str
    router: str
    observer: str | None = None  # told each streamed TurnTextDelta (a UI's live text); None: dropped
    # The loop actor's name, for a ``SessionLoopService`` to spawn it under (so the caller can cancel it).
    loop: str = ""


@frozen(kw_only=True)
class SessionResult:
    TAG: ClassVar[str] = "rs.result"
    answer: str | None


@frozen(kw_only=True)
class CancelSession:
    """A control (answered at once, even mid-step): end the run at its next step boundary. An open
    provider turn is accounted for as interrupted and its receipt recorded once; the run then fails with
    ``SessionCancelled``. A provider stream being read is interrupted at once. Sent to a
    ``SessionLoopService`` with ``loop`` set, it is passed on to that loop."""

    TAG: ClassVar[str] = "rs.cancel"
    loop: str = ""


# The loop's states (RS-*): what the run waits for. The shared ones (the handle's start and stream,
# accounting, cancellation, the end) are actors/runs/machine.py's.


@frozen
class SessionFacts:
    """The run's request and the current round's number and accumulated facts (RS-21, RS-22); everything
    but the number is reset when a round is selected (RS-37)."""

    request: SessionRunRequest
    round: int = 0
    capture: JsonValue | None = None  # RS-21: the last non-None capture of the round's Continue outcomes
    used_tool: bool = False
    finish_requested: bool = False
    emitted_response: bool = False
    # RS-10: records of events in hand that precede a tool call in hand too: sent with its HostRunTool
    records: tuple[SessionEvent.ProviderInput | SessionEvent.UsageUpdated, ...] = ()


@frozen
class Preparing:
    """``prepare_round`` asked (RS-06)."""

    run: Run[SessionFacts]


@frozen
class Submitting:
    """``InferenceSubmitted`` being recorded; then the handle starts (RS-07)."""

    run: Run[SessionFacts]
    prepared: PreparedRound


@frozen
class RecordingEvent:
    """A ``ProviderInput`` or ``UsageUpdated`` being recorded before the next read (RS-10, EV-10)."""

    run: Run[SessionFacts]


@frozen
class Resuming:
    """``execute_tool`` and then ``prepare_provider_resume`` asked, in one ``HostRunTool`` (RS-11, RS-13)."""

    run: Run[SessionFacts]
    call_id: str


@frozen
class Responding:
    """The native response of an outcome with ``stop`` sent (RS-14, RS-24); the turn is accounted next.
    (Without ``stop`` the response and the next read are one ask, made in ``Reading``.)"""

    run: Run[SessionFacts]


@frozen
class Completing:
    """``complete_round`` or ``complete_capture`` asked (RS-21, RS-22, RS-27)."""

    run: Run[SessionFacts]


class SessionFlavor:
    """``run_session``'s rows and hooks for the round machine."""

    def begin(self, run: Any, *, cancelled: bool) -> Step:
        request: SessionRunRequest = run.request
        if request.round_limit <= 0:  # RS-02
            return Step(Idle(), (Refuse(InvalidSessionRequest("round_limit must be at least 1")),))
        if request.rounds_used < 0 or request.rounds_used > request.round_limit:  # RS-03
            error = InvalidSessionRequest(
                f"rounds_used {request.rounds_used} is outside 0..round_limit {request.round_limit}"
            )
            return Step(Idle(), (Refuse(error),))
        if not request.call_timeout > 0:  # also rejects NaN
            error = InvalidSessionRequest(f"call_timeout must be positive, not {request.call_timeout!r}")
            return Step(Idle(), (Refuse(error),))
        facts = Run(SessionFacts(request=request))
        if cancelled:  # cancelled before the run reached this loop
            return Step(Ended(), (Abort(SessionCancelled("the run was cancelled before it started"), False),))
        return self._select(facts, request.rounds_used + 1)  # RS-04

    def refused(self) -> BaseException:
        return InvalidSessionRequest("this session loop runs one run_session only")

    def cancelled(self, text: str) -> BaseException:
        return SessionCancelled(text)

    def record(self, event: Any) -> Any:
        return HostRecord(event=event)

    def receipt(self, run: Run[Any], receipt: UsageReceipt, usage: Any, continuation: Any) -> Any:
        return SessionEvent.ProviderReceipt(
            round=run.facts.round, usage=usage, receipt=receipt, continuation=continuation
        )

    def on_event(self, run: Run[Any], event: Any) -> Step:
        facts: SessionFacts = run.facts
        match event:
            case SessionInferenceEvent.ProviderInput(context=context):  # RS-10
                return self._record(run, SessionEvent.ProviderInput(round=facts.round, context=context))
            case SessionInferenceEvent.UsageUpdated(usage=usage):
                return self._record(run, SessionEvent.UsageUpdated(round=facts.round, usage=usage))
            case SessionInferenceEvent.ToolCall(call_id=call_id, call=call):  # RS-11
                op = run.op
                assert op is not None
                run = evolve(run.with_facts(evolve(facts, used_tool=True, records=())), progressed=True)
                execute = HostRunTool(
                    call_id=call_id,
                    call=call,
                    operation_id=op,
                    idempotency_key=idempotency_key(facts.request.operation_id, facts.round, call_id),
                    records=facts.records,
                )  # RS-13: the host decides the resume on the outcome in the same request
                # Moved: the call came moved from the handle (its arguments are this run's alone), the run's
                # state keeps only its id, and the request that comes back with the answer is not read: the
                # host, and its tool, take the call as it is, with nothing to copy.
                return Step(Resuming(run, call_id), (Ask(Target.HOST, execute, moved=True),))
        return abort(self, run, InferenceError(f"unexpected handle event {type(event).__name__}"))

    def _record(self, run: Run[SessionFacts], recorded: Any) -> Step:
        """RS-10: record ``recorded`` before any later event acts. When the events in hand end with a tool
        call (and hold nothing else), the record goes with that call's ``HostRunTool``, which the host
        carries out in order, records first: one host exchange for the batch instead of one per event."""
        queued = run.queued
        if (
            queued
            and isinstance(queued[-1], SessionInferenceEvent.ToolCall)
            and all(
                isinstance(e, SessionInferenceEvent.ProviderInput | SessionInferenceEvent.UsageUpdated)
                for e in queued[:-1]
            )
        ):
            facts = run.facts
            return read(self, run.with_facts(evolve(facts, records=(*facts.records, recorded))))
        return Step(RecordingEvent(run), (Ask(Target.HOST, HostRecord(event=recorded)),))

    def completed(self, run: Run[Any], completed: SessionInferenceEvent.Completed) -> Step:
        facts: SessionFacts = run.facts
        if facts.capture is not None:  # RS-21
            message: Any = HostCompleteCapture(capture=facts.capture, contents=completed.answer)
        else:  # RS-22
            message = HostCompleteRound(
                completion=RoundCompletion(
                    answer=completed.answer,
                    used_tool=facts.used_tool,
                    finish_requested=facts.finish_requested,
                    emitted_response=facts.emitted_response,
                    finish_reason=completed.finish_reason,
                )
            )
        return Step(Completing(run), (Ask(Target.HOST, message),))

    def succeed(self, run: Run[Any], answer: Any) -> Step:
        effects: tuple[Any, ...] = (Close(),) if run.handle else ()
        return Step(Ended(), (*effects, Finish(SessionResult(answer=answer))))

    def then(self, run: Run[Any]) -> Step:
        return self._select(run, run.facts.round + 1)

    def _select(self, run: Run[SessionFacts], r: int) -> Step:
        request = run.facts.request
        closing: tuple[Any, ...] = (Close(),) if run.handle else ()
        run = run.closed()
        if r > request.round_limit:  # RS-05: before prepare_round
            return Step(
                Ended(), (*closing, Abort(SessionRoundLimitError(limit=request.round_limit), run.progressed))
            )
        run = run.with_facts(SessionFacts(request=request, round=r))  # RS-37: only the number is kept
        return Step(Preparing(run), (*closing, Ask(Target.HOST, HostPrepareRound(round=r))))

    def step(self, state: Any, message: Any) -> Step:
        match state, message:
            case Preparing(run=run), Answered(value=RoundPreparation.Complete(answer=answer)):
                return self.succeed(run, answer)  # RS-06
            case Preparing(run=run), Answered(value=RoundPreparation.Run(prepared=prepared)):
                submitted = SessionEvent.InferenceSubmitted(
                    round=run.facts.round, manifest_hash=manifest_hash(prepared.input), model=prepared.model
                )
                return Step(
                    Submitting(run, prepared), (Ask(Target.HOST, HostRecord(event=submitted)),)
                )  # RS-07
            case Preparing(run=run), Answered(value=other):
                return fail(run, SessionHostError(f"prepare_round returned {type(other).__name__}"))
            case Submitting(run=run, prepared=prepared), Answered():
                facts = run.facts
                inference = SessionInferenceRequest(
                    user_id=facts.request.user_id,
                    operation_id=facts.request.operation_id,
                    round=facts.round,
                    prepared=prepared,
                )  # RS-08: prepared passed through unchanged
                return starting(run, inference)
            case RecordingEvent(run=run), Answered():
                return read(self, run)
            case Resuming(run=run, call_id=call_id), Answered(
                value=ProviderResume.Continue(outcome=o)
            ):  # RS-14
                facts = run.facts
                if o.capture is not None or o.finish_after_round or o.emitted_response:
                    run = run.with_facts(
                        evolve(
                            facts,
                            capture=facts.capture if o.capture is None else o.capture,  # RS-21: the last wins
                            finish_requested=facts.finish_requested or o.finish_after_round,  # RS-22
                            emitted_response=facts.emitted_response or o.emitted_response,
                        )
                    )
                result = ToolResult(success=o.ok, output=o.text)
                if o.stop:  # RS-24: respond, then account; no read
                    return Step(
                        Responding(run), (Ask(Target.HANDLE, Respond(call_id=call_id, result=result)),)
                    )
                # RS-36: the next event is read only once this call's response is carried out; the handle
                # answers with it (a respond error comes back as the answer: RS-33 as for a read, RS-30).
                respond = RespondAndRead(call_id=call_id, result=result, batch=True)
                return Step(Reading(run), (Ask(Target.HANDLE, respond),))
            case Resuming(run=run), Answered(value=ProviderResume.Complete(answer=answer)):  # RS-15, 18, 25
                return account(self, run, Succeed(answer))
            case Resuming(run=run), Answered(value=ProviderResume.RestartFresh()):  # RS-16, 17, 20, 26
                return account(self, run, Then())
            case Resuming(run=run), Answered(value=other):
                return abort(
                    self, run, SessionHostError(f"prepare_provider_resume returned {type(other).__name__}")
                )
            case Responding(run=run), Failed(error=error):  # RS-33
                return failed_with(self, run, error)
            case Responding(run=run), Answered():  # RS-24
                return account(self, run, Succeed(None))
            case Completing(run=run), Answered(value=SessionControl.Continue()):  # RS-27
                return self.then(run)
            case Completing(run=run), Answered(value=SessionControl.Complete(answer=answer)):
                return self.succeed(run, answer)
            case Completing(run=run), Answered(value=other):
                return fail(run, SessionHostError(f"the completion callback returned {type(other).__name__}"))
            case Preparing(run=run) | Submitting(run=run) | RecordingEvent(run=run) | Resuming(
                run=run
            ) | Completing(run=run), Failed(error=error):  # RS-35
                return abort(self, run, error)
        raise AssertionError(f"no row for {type(state).__name__} and {type(message).__name__}")


SESSION: Final = SessionFlavor()


class SessionLoopActor(RoundActor):
    """Runs one ``run_session`` (RS-01..RS-37) and stops: the round machine (actors/runs/machine.py) with
    ``SessionFlavor``'s rows, on the bus.

    ``CancelSession`` is answered at once; the run then ends at its next step boundary (before the next host
    or handle call it would make), accounting for an open provider turn first. A provider stream being read
    is interrupted at once: the loop asks the handle for ``finish_unavailable`` and, once both that answer
    and the read's own answer are in, records whichever receipt exists, once.
    """

    FLAVOR = SESSION
    RUN = RunSession
    CANCEL = CancelSession

    def __init__(self, node: Node, address: str, *, handle_timeout: float = HANDLE_TIMEOUT) -> None:
        super().__init__(node, address)
        self._handle_timeout = handle_timeout
        self._observer: str | None = None
        self._handles = itertools.count()

    def accepted(self, message: Any) -> None:
        request: SessionRunRequest = message.request
        self._to = {Target.HOST: message.host, Target.ROUTER: message.router}
        self._observer = message.observer
        self._timeout = {
            Target.HOST: request.call_timeout,
            Target.HANDLE: min(self._handle_timeout, request.call_timeout),
        }

    def open_handle(self, request: SessionInferenceRequest) -> tuple[str, Any]:
        name = f"{self.name}.inference.{next(self._handles)}"
        # Hosted on this loop's thread: the loop's requests to its handle, and the answers, change no thread.
        ref = self.host_actor(
            InferenceHandleActor,
            name,
            router=self._to[Target.ROUTER],
            request=request,
            start_timeout=self._timeout[Target.HANDLE],
            observer=self._observer,
        )
        return f"{self.node.name}/{name}", ref


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
        spawn_run(self.node, SessionLoopActor, name)
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
        spawn_run(where, SessionLoopActor, name)
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
    HostRunTool,
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
