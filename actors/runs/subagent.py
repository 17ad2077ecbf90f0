"""The single-turn subagent run (seed 000 "Single-turn subagent loop"; RULES.md SA-*, EV-01..EV-06, C.4).

``run`` resolves one exact model, renders the projection (``projection.py``) and starts exactly one fresh,
ephemeral provider turn. Inside that turn the tools run one at a time through the application's ``Host``;
before every provider request the whole projection is rendered again (history with its markers, the latest
state) and submitted to the Router (``SubmitInput``), which is what lets a displayed result be replaced in
place. One ``SubagentRunActor`` per call runs this as a state machine of continuations (it never blocks its
mailbox); a ``RunHostActor`` serves the application's ``Host`` object, in this process or another.

Sizes are counted by the Router (``CountTokens``): the model's own tokenizer where its provider has one, a
conservative estimate otherwise. Each distinct piece of the projection is counted once per run.
"""

from __future__ import annotations

import concurrent.futures
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import field, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol

from actors.base import Context
from actors.effects import RerunSafe, idempotency_key
from actors.errors import Broken, Cancelled, Invalid
from actors.inference.handle import (
    InferenceHandleActor,
    PreparedRound,
    RespondAndRead,
    SessionInferenceEvent,
    SessionInferenceRequest,
)
from actors.router.messages import CountTokens, ResolveModel, SubmitInput, TokenCount
from actors.runs.events import AnyAuditEvent, AuditEvent
from actors.runs.host import (
    HANDLE_TIMEOUT,
    HOST_TIMEOUT,
    HostCompleteCapture,
    HostExecuteTool,
    HostRecord,
    ToolHostActor,
)
from actors.runs.machine import (
    Abort,
    Answered,
    Ask,
    Ended,
    Failed,
    Finish,
    Idle,
    Reading,
    Refuse,
    RoundActor,
    Run,
    Step,
    Target,
    abort,
    fail,
    failed_with,
    read,
    spawn_run,
    starting,
)
from actors.runs.projection import (
    HISTORY_CLOSE,
    HISTORY_OPEN,
    INVALID_CALL,
    PROTOCOL_RESERVE_TOKENS,
    RUN_TOOL_DESCRIPTION,
    STATE_CLOSE,
    STATE_OPEN,
    ContextBudget,
    Projection,
    StateUpdate,
    ToolOutcome,
    manifest_hash,
    rejection_text,
    truncated,
)
from actors.types import (
    ResolvedAgentModel,
    ToolCall,
    ToolCallError,
    ToolResult,
    UsageReceipt,
    restore_accounting_note,
)
from transport.codec import JsonValue
from transport.errors import BusError, Expired, ProtocolError
from transport.node import Node
from transport.pending import chained, forbid_blocking
from transport.records import frozen

log = logging.getLogger(__name__)

COUNT_TIMEOUT: Final = 120.0  # the first count may load a tokenizer

__all__ = [
    "PROTOCOL_RESERVE_TOKENS",
    "RUN_TOOL_DESCRIPTION",
    "AuditEvent",
    "CaptureFailedError",
    "ContextBudget",
    "ContextCapacityError",
    "EmptyAnswerError",
    "EmptyCaptureError",
    "Host",
    "InvalidRunRequest",
    "RunHostActor",
    "RunRequest",
    "RunResult",
    "StateUpdate",
    "SubagentHostError",
    "SubagentRunActor",
    "ToolOutcome",
    "run",
    "run_future",
]

# ------------------------------------------------------------------------------------------------ types


@frozen(kw_only=True)
class RunRequest:
    TAG: ClassVar[str] = "sa.request"
    user_id: str
    parent_operation_id: uuid.UUID
    model: str
    reasoning_effort: str
    context: tuple[str, ...]
    task: str
    timeout: float | None = None
    start_metadata: JsonValue = None


@frozen(kw_only=True)
class RunResult:
    TAG: ClassVar[str] = "sa.result"
    answer: str
    model: ResolvedAgentModel


# ----------------------------------------------------------------------------------------------- errors


class ContextCapacityError(Invalid):
    """SA-06: the projection (estimate plus protocol reserve) does not fit the model's maximum input."""

    WIRE = "sa.context_capacity"

    def __init__(self, message: str = "", *, estimated: int, maximum: int, **details: Any) -> None:
        super().__init__(
            message or f"the provider input needs ~{estimated} tokens; the model takes at most {maximum}",
            **details,
        )
        self.estimated = estimated
        self.maximum = maximum

    def wire_fields(self) -> dict[str, Any]:
        return {**self.details, "estimated": self.estimated, "maximum": self.maximum}


class EmptyAnswerError(Broken):
    """SA-23/SA-24: the run's terminal result is empty."""

    WIRE = "sa.empty_answer"


class EmptyCaptureError(Broken):
    """SA-22: a capture was designated and the turn's terminal answer is empty."""

    WIRE = "sa.empty_capture"


class CaptureFailedError(Broken):
    """SA-24: ``complete_capture`` returned a failed outcome; the message is its text."""

    WIRE = "sa.capture_failed"


class InvalidRunRequest(Invalid, ValueError):
    """A run request that cannot start (a negative protocol reserve, a second run on one run actor)."""

    WIRE = "sa.invalid_request"


class RunCancelled(Cancelled):
    """The caller cancelled the run (or stopped waiting for it); an open provider turn was accounted for."""

    WIRE = "sa.cancelled"


class SubagentHostError(Broken):
    """A host method returned something other than what the ``Host`` protocol says."""

    WIRE = "sa.host_error"


# ------------------------------------------------------------------------------------------------- host


class Host(Protocol):
    """The application side of a run; ``execute_tool`` and ``complete_capture`` may also return a
    ``concurrent.futures.Future`` of their outcome (then ``record`` traffic keeps flowing meanwhile)."""

    def render_tool_call(self, call: ToolCall) -> str: ...
    def execute_tool(self, call: ToolCall, operation_id: uuid.UUID, budget: ContextBudget) -> Any: ...
    def complete_capture(self, capture: JsonValue, contents: str, budget: ContextBudget) -> Any: ...
    def record(self, event: AnyAuditEvent) -> Any: ...


@frozen(kw_only=True)
class HostRenderToolCall:
    TAG: ClassVar[str] = "sa.host.render_tool_call"
    call: ToolCall


@frozen(kw_only=True)
class RenderedCall:
    TAG: ClassVar[str] = "sa.host.rendered_call"
    text: str


class RunHostActor(ToolHostActor):
    """Serves one application ``Host`` on the bus: one request message per host method.

    ``execute_tool`` runs at most once per idempotency key, as in ``run_session``'s ``HostActor``
    (actors/runs/host.py): a repeat gets the stored outcome; a key whose run was cut off gets
    ``ToolOutcome(ok=False, unknown=True)`` and is not run again unless ``rerun_safe`` says so; a store that
    cannot be written answers ``EffectStoreError``. ``effects``: the SQLite file (else in memory).
    """

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        host: Host,
        effects: str | Path | None = None,
        rerun_safe: RerunSafe = (),
    ) -> None:
        super().__init__(node, address, unknown=_unknown_outcome, effects=effects, rerun_safe=rerun_safe)
        self.host = host

    def handle(self, message: Any, ctx: Context) -> Any:
        host = self.host
        match message:
            case HostRenderToolCall(call=call):
                text = host.render_tool_call(call)
                if not isinstance(text, str):
                    raise SubagentHostError(f"render_tool_call returned {type(text).__name__}, not str")
                return RenderedCall(text=text)
            case HostExecuteTool(
                call=ToolCall() as call,
                operation_id=op,
                budget=ContextBudget() as budget,
                idempotency_key=key,
            ):
                return self.execute(ctx, call, key, partial(host.execute_tool, call, op, budget))
            case HostCompleteCapture(capture=capture, contents=contents, budget=ContextBudget() as budget):
                return self.answer_when_done(host.complete_capture(capture, contents, budget), ctx)
            case HostRecord(
                event=AuditEvent.Started()
                | AuditEvent.InferenceSubmitted()
                | AuditEvent.ToolCall()
                | AuditEvent.ToolResult()
                | AuditEvent.ProviderReceipt()
                | AuditEvent.Completed() as event
            ):
                return self.answer_when_done(host.record(event), ctx)
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")


def _unknown_outcome(text: str) -> ToolOutcome:
    return ToolOutcome(text=text, ok=False, unknown=True)


# -------------------------------------------------------------------------------------------------- run


@frozen(kw_only=True)
class RunSubagent:
    TAG: ClassVar[str] = "sa.run"
    request: RunRequest
    host: str
    router: str
    protocol_reserve_tokens: int = PROTOCOL_RESERVE_TOKENS


@frozen
class CancelRun:
    """Ends a run at its next step boundary (before its next read of the provider or its next tool), the open
    turn accounted for as interrupted and its receipt recorded once; the run fails with ``RunCancelled``."""

    TAG: ClassVar[str] = "sa.cancel"


# The run's states (SA-*, EV-*): what it waits for. The shared ones (the handle's start and stream,
# accounting, cancellation, the end) are actors/runs/machine.py's.


@frozen
class SubagentFacts:
    """The run's request, its one model (SA-01), the projection and the sizes counted so far, the round
    last submitted (EV-02, EV-04) and the designated capture (SA-21). ``projection`` is never changed in
    place: a step that changes it works on a copy and carries the copy on."""

    request: RunRequest
    reserve: int
    model: ResolvedAgentModel | None = None
    projection: Projection | None = None
    counts: Mapping[str, int] = field(default_factory=dict)
    exact: bool = False
    round: int = 0
    hash: str = ""
    capture: JsonValue | None = None

    @property
    def op(self) -> uuid.UUID:
        return self.request.parent_operation_id

    @property
    def maximum(self) -> int:
        assert self.model is not None
        return self.model.max_input_tokens

    def tokens(self, projection: Projection) -> int:
        return sum(self.counts[p] for p in projection.pieces())

    def budget(self, pending: str | None = None) -> ContextBudget:
        assert self.projection is not None
        return self.projection.budget(
            self.counts.__getitem__,
            reserve=self.reserve,
            maximum=self.maximum,
            exact=self.exact,
            pending=pending,
        )


@frozen
class Placement:
    """A failure entry being placed (SA-16, SA-18, SA-25): exact when it fits, else truncated to fit."""

    call_id: str
    name: str
    rendered: str
    text: str
    ok: bool
    accepted: bool
    exact: str


# What comes after a count (the sizes of the pieces named are then known).
@frozen
class ToFirst:
    pass


@frozen
class ToExecute:
    call_id: str
    call: ToolCall
    rendered: str


@frozen
class ToDecide:
    call_id: str
    call: ToolCall
    rendered: str
    outcome: ToolOutcome
    candidate: Projection


@frozen
class ToCheckExact:
    placement: Placement
    candidate: Projection
    empty: Projection


@frozen
class ToTruncate:
    placement: Placement
    candidate: Projection
    empty: Projection


@frozen
class ToCheckTruncated:
    placement: Placement
    candidate: Projection
    shown: str


AfterCount = ToFirst | ToExecute | ToDecide | ToCheckExact | ToTruncate | ToCheckTruncated


@frozen
class Resolving:
    run: Run[SubagentFacts]


@frozen
class RecordingStarted:
    run: Run[SubagentFacts]


@frozen
class Counting:
    run: Run[SubagentFacts]
    missing: tuple[str, ...]
    then: AfterCount


@frozen
class SubmittingFirst:
    """The first ``InferenceSubmitted`` being recorded; then the turn starts (EV-02)."""

    run: Run[SubagentFacts]
    prepared: PreparedRound


@frozen
class Rendering:
    run: Run[SubagentFacts]
    call_id: str
    call: ToolCall


@frozen
class RecordingCall:
    run: Run[SubagentFacts]
    call_id: str
    call: ToolCall
    rendered: str


@frozen
class ExecutingTool:
    run: Run[SubagentFacts]
    call_id: str
    call: ToolCall
    rendered: str


@frozen
class RecordingResult:
    run: Run[SubagentFacts]
    call_id: str
    result: ToolResult


@frozen
class RecordingSubmitted:
    run: Run[SubagentFacts]
    call_id: str
    result: ToolResult
    rendered: str


@frozen
class SubmittingInput:
    run: Run[SubagentFacts]
    call_id: str
    result: ToolResult


@frozen
class Capturing:
    run: Run[SubagentFacts]


@frozen
class RecordingCompleted:
    run: Run[SubagentFacts]
    answer: str


def _host(message: Any, *, boundary: bool = False) -> Ask:
    return Ask(Target.HOST, message, boundary=boundary)


class SubagentFlavor:
    """The subagent ``run``'s rows and hooks for the round machine: model resolution, the projection and
    its budget checks, the capture."""

    def begin(self, run: Any, *, cancelled: bool) -> Step:
        if run.protocol_reserve_tokens < 0:
            return Step(Idle(), (Refuse(InvalidRunRequest("protocol_reserve_tokens must be at least 0")),))
        if cancelled:  # the cancel overtook the run: nothing has started
            return Step(Ended(), (Abort(RunCancelled("the run was cancelled before it started"), False),))
        request: RunRequest = run.request
        facts = SubagentFacts(
            request=request,
            reserve=run.protocol_reserve_tokens,
            projection=Projection(tuple(request.context), request.task),
        )
        ask = Ask(Target.ROUTER, ResolveModel(requested=request.model), boundary=False)  # SA-01
        return Step(Resolving(Run(facts)), (ask,))

    def refused(self) -> BaseException:
        return InvalidRunRequest("this run actor runs one run only")

    def cancelled(self, text: str) -> BaseException:
        return RunCancelled(text)

    def record(self, event: Any) -> Any:
        return HostRecord(event=event)

    def receipt(self, run: Run[Any], receipt: UsageReceipt, usage: Any, continuation: Any) -> Any:
        facts: SubagentFacts = run.facts
        return AuditEvent.ProviderReceipt(
            parent_operation_id=facts.op,
            round=facts.round,
            manifest_hash=facts.hash,
            usage=usage,
            receipt=receipt,
        )  # EV-04: the last submitted round

    def on_event(self, run: Run[Any], event: Any) -> Step:
        match event:
            case SessionInferenceEvent.ToolCall(call_id=call_id, call=ToolCallError() as error):
                text = str(error)  # SA-25: answered without the host; audited as a call_ktool result
                placement = Placement(
                    call_id, "call_ktool", INVALID_CALL, text, ok=False, accepted=True, exact=text
                )
                return self._place(run, placement)
            case SessionInferenceEvent.ToolCall(call_id=call_id, call=ToolCall() as call):
                # SA-05: once, before execute_tool; a cancelled run runs no further tool
                render = _host(HostRenderToolCall(call=call), boundary=True)
                return Step(Rendering(run, call_id, call), (render,))
        return read(self, run)  # ProviderInput, UsageUpdated: a subagent run records neither

    def completed(self, run: Run[Any], completed: SessionInferenceEvent.Completed) -> Step:
        facts: SubagentFacts = run.facts
        answer = completed.answer
        if facts.capture is None:
            if not answer.strip():
                return fail(run, EmptyAnswerError("the run's terminal answer is empty"))  # SA-23
            return self.succeed(run, answer)
        if not answer.strip():  # SA-22: complete_capture is never called
            return fail(run, EmptyCaptureError("a capture was designated, but the terminal answer is empty"))
        capture = HostCompleteCapture(capture=facts.capture, contents=answer, budget=facts.budget())
        return Step(Capturing(run), (_host(capture),))  # SA-21

    def succeed(self, run: Run[Any], answer: Any) -> Step:
        facts: SubagentFacts = run.facts
        assert facts.model is not None
        done = AuditEvent.Completed(parent_operation_id=facts.op, model=facts.model.model, response=answer)
        return Step(RecordingCompleted(run, answer), (_host(HostRecord(event=done)),))  # EV-05: last

    def then(self, run: Run[Any]) -> Step:
        raise AssertionError("a subagent run has one turn: nothing comes after its accounting but the end")

    # ------------------------------------------------------------------------------ counting
    def _count(self, run: Run[SubagentFacts], pieces: Sequence[str], then: AfterCount) -> Step:
        """Count every piece not counted yet (one Router request), then go on with ``then``."""
        facts = run.facts
        missing = tuple(dict.fromkeys(p for p in pieces if p not in facts.counts))
        if not missing:
            return self._counted(run, then)
        assert facts.model is not None
        count = Ask(Target.ROUTER, CountTokens(model=facts.model.model, texts=missing), False, COUNT_TIMEOUT)
        return Step(Counting(run, missing, then), (count,))

    def _counted(self, run: Run[SubagentFacts], then: AfterCount) -> Step:
        facts = run.facts
        match then:
            case ToFirst():
                return self._first(run)
            case ToExecute(call_id=call_id, call=call, rendered=rendered):
                assert run.op is not None
                execute = HostExecuteTool(
                    call=call,
                    operation_id=run.op,
                    budget=facts.budget(pending=rendered),  # SA-20: P before this result is applied
                    idempotency_key=idempotency_key(run.op, call_id),
                    call_id=call_id,
                )
                return Step(ExecutingTool(run, call_id, call, rendered), (_host(execute),))
            case ToDecide(
                call_id=call_id, call=call, rendered=rendered, outcome=outcome, candidate=candidate
            ):
                needed = facts.tokens(candidate) + facts.reserve
                if needed > facts.maximum:  # SA-16: a failure to the provider; projected state unchanged
                    text = rejection_text(needed, facts.maximum)
                    placement = Placement(
                        call_id, call.name, rendered, text, ok=True, accepted=False, exact=outcome.text
                    )
                    return self._place(run, placement)
                capture = (
                    facts.capture if outcome.capture is None else outcome.capture
                )  # SA-21: the last wins
                run = run.with_facts(replace(facts, projection=candidate, capture=capture))  # SA-17: exact
                result = ToolResult(success=True, output=outcome.text)
                return self._tool_done(run, call_id, call.name, result, True, True, outcome.text)
            case ToCheckExact(placement=p, candidate=candidate, empty=empty):
                if facts.tokens(candidate) + facts.reserve <= facts.maximum:
                    return self._placed(run, p, candidate, p.text, p.accepted)
                return self._count(run, empty.pieces(), ToTruncate(p, candidate, empty))
            case ToTruncate(placement=p, candidate=candidate, empty=empty):
                room = facts.maximum - facts.reserve - facts.tokens(empty)
                shown = truncated(p.text, room, facts.exact)
                candidate = candidate.copy()
                candidate.entries[-1] = replace(candidate.entries[-1], text=shown)
                return self._count(run, candidate.pieces(), ToCheckTruncated(p, candidate, shown))
            case ToCheckTruncated(placement=p, candidate=candidate, shown=shown):
                needed = facts.tokens(candidate) + facts.reserve
                if needed > facts.maximum:
                    return abort(self, run, ContextCapacityError(estimated=needed, maximum=facts.maximum))
                return self._placed(run, p, candidate, shown, False)

    # ------------------------------------------------------------------------------ the turn
    def _first(self, run: Run[SubagentFacts]) -> Step:
        facts = run.facts
        assert facts.projection is not None and facts.model is not None
        rendered = facts.projection.render()
        estimated = facts.tokens(facts.projection) + facts.reserve
        if estimated > facts.maximum:  # SA-06: before the provider turn starts
            return fail(run, ContextCapacityError(estimated=estimated, maximum=facts.maximum))
        run = run.with_facts(replace(facts, round=1, hash=manifest_hash(rendered)))
        submitted = AuditEvent.InferenceSubmitted(
            parent_operation_id=facts.op,
            round=1,
            manifest_hash=run.facts.hash,
            estimated_input_tokens=estimated,
        )
        prepared = PreparedRound(
            input=rendered,
            provider_input=rendered,
            continuation=None,  # SA-02: fresh
            model=facts.model.model,  # SA-01: the one resolution
            reasoning_effort=facts.request.reasoning_effort,  # SA-26
            tool_description=RUN_TOOL_DESCRIPTION,  # SA-27
            timeout=facts.request.timeout,
        )
        return Step(SubmittingFirst(run, prepared), (_host(HostRecord(event=submitted)),))  # EV-02

    def _place(self, run: Run[SubagentFacts], p: Placement) -> Step:
        """A failure entry: exact when it fits, else truncated to fit, else the run cannot go on
        (``ContextCapacityError`` after accounting)."""
        projection = run.facts.projection
        assert projection is not None
        candidate = projection.copy()
        candidate.add(p.rendered, p.text, False)
        empty = projection.copy()
        empty.add(p.rendered, "", False)
        return self._count(run, candidate.pieces(), ToCheckExact(p, candidate, empty))

    def _placed(
        self, run: Run[SubagentFacts], p: Placement, candidate: Projection, shown: str, accepted: bool
    ) -> Step:
        run = run.with_facts(replace(run.facts, projection=candidate))
        result = ToolResult(success=False, output=shown)
        return self._tool_done(run, p.call_id, p.name, result, p.ok, accepted, p.exact)

    def _tool_done(
        self,
        run: Run[SubagentFacts],
        call_id: str,
        name: str,
        result: ToolResult,
        ok: bool,
        accepted: bool,
        exact: str,
    ) -> Step:
        """Audit the classified result (SA-15: the exact text); then the next provider request."""
        audited = AuditEvent.ToolResult(
            parent_operation_id=run.facts.op, name=name, ok=ok, projection_accepted=accepted, result=exact
        )
        return Step(RecordingResult(run, call_id, result), (_host(HostRecord(event=audited)),))

    def _submit(self, run: Run[SubagentFacts], call_id: str, result: ToolResult) -> Step:
        """SA-19: the whole projection re-rendered and submitted, then the native response."""
        facts = run.facts
        assert facts.projection is not None
        rendered = facts.projection.render()
        estimated = facts.tokens(facts.projection) + facts.reserve
        if estimated > facts.maximum:  # SA-06 before every request (placement keeps it from happening)
            return abort(self, run, ContextCapacityError(estimated=estimated, maximum=facts.maximum))
        run = run.with_facts(replace(facts, round=facts.round + 1, hash=manifest_hash(rendered)))
        submitted = AuditEvent.InferenceSubmitted(
            parent_operation_id=facts.op,
            round=run.facts.round,
            manifest_hash=run.facts.hash,
            estimated_input_tokens=estimated,
        )
        return Step(RecordingSubmitted(run, call_id, result, rendered), (_host(HostRecord(event=submitted)),))

    # ------------------------------------------------------------------------------ the rows
    def step(self, state: Any, message: Any) -> Step:
        match state, message:
            case Resolving(run=run), Answered(value=ResolvedAgentModel() as model):
                facts = replace(run.facts, model=model)
                request = facts.request
                started = AuditEvent.Started(
                    parent_operation_id=facts.op,
                    model=model.model,
                    provider_model=model.provider_model,
                    provider=model.provider,
                    context_window_tokens=model.context_window_tokens,
                    max_input_tokens=model.max_input_tokens,
                    context=tuple(request.context),
                    task=request.task,
                    host=request.start_metadata,
                )  # EV-01
                return Step(RecordingStarted(run.with_facts(facts)), (_host(HostRecord(event=started)),))
            case Resolving(run=run), Answered(value=other):
                return fail(run, SubagentHostError(f"ResolveModel answered {type(other).__name__}"))
            case Resolving(run=run), Failed(error=error):
                return fail(run, error)
            case RecordingStarted(run=run), Answered():
                assert run.facts.projection is not None
                frames = (HISTORY_OPEN, HISTORY_CLOSE, STATE_OPEN, STATE_CLOSE)
                return self._count(run, (*run.facts.projection.pieces(), *frames), ToFirst())
            case Counting(run=run, missing=missing, then=then), Answered(value=TokenCount() as counted):
                if len(counted.counts) != len(missing):
                    error = BusError(f"CountTokens answered {len(counted.counts)} counts for {len(missing)}")
                    return abort(self, run, error)
                counts = {**run.facts.counts, **dict(zip(missing, counted.counts, strict=True))}
                return self._counted(
                    run.with_facts(replace(run.facts, counts=counts, exact=counted.exact)), then
                )
            case Counting(run=run), Answered(value=other):
                return abort(self, run, BusError(f"CountTokens answered {type(other).__name__}"))
            case SubmittingFirst(run=run, prepared=prepared), Answered():
                facts = run.facts
                inference = SessionInferenceRequest(
                    user_id=facts.request.user_id, operation_id=facts.op, round=1, prepared=prepared
                )
                return starting(run, inference)
            case Rendering(run=run, call_id=call_id, call=call), Answered(value=RenderedCall(text=text)):
                event = AuditEvent.ToolCall(
                    parent_operation_id=run.facts.op, name=call.name, arguments=call.arguments
                )
                return Step(
                    RecordingCall(run, call_id, call, text), (_host(HostRecord(event=event)),)
                )  # EV-03
            case Rendering(run=run), Answered(value=other):
                return abort(
                    self, run, SubagentHostError(f"render_tool_call returned {type(other).__name__}")
                )
            case RecordingCall(run=run, call_id=call_id, call=call, rendered=rendered), Answered():
                assert run.facts.projection is not None
                pending = run.facts.projection.copy()
                pending.add(rendered, "", True)
                return self._count(run, pending.pieces(), ToExecute(call_id, call, rendered))
            case ExecutingTool(run=run, call_id=call_id, call=call, rendered=rendered), Answered(
                value=ToolOutcome() as outcome
            ):
                if not outcome.ok:  # SA-18: updates, displayed keys and capture ignored
                    p = Placement(
                        call_id,
                        call.name,
                        rendered,
                        outcome.text,
                        ok=False,
                        accepted=True,
                        exact=outcome.text,
                    )
                    return self._place(run, p)
                assert run.facts.projection is not None
                candidate = run.facts.projection.copy()
                candidate.add(rendered, outcome.text, True, outcome.displayed_state_keys)
                candidate.apply(outcome.state_updates)
                return self._count(
                    run, candidate.pieces(), ToDecide(call_id, call, rendered, outcome, candidate)
                )
            case ExecutingTool(run=run), Answered(value=other):
                return abort(self, run, SubagentHostError(f"execute_tool returned {type(other).__name__}"))
            case RecordingResult(run=run, call_id=call_id, result=result), Answered():
                return self._submit(run, call_id, result)
            case RecordingSubmitted(run=run, call_id=call_id, result=result, rendered=rendered), Answered():
                assert run.op is not None
                submit = Ask(Target.ROUTER, SubmitInput(operation_id=run.op, input=rendered), boundary=False)
                return Step(SubmittingInput(run, call_id, result), (submit,))
            case SubmittingInput(run=run, call_id=call_id, result=result), Answered():
                # The response and the next read in one ask: the answer is the next event, or the
                # respond's error (failed_with, as for a read). A boundary, as the read after it was.
                respond = Ask(Target.HANDLE, RespondAndRead(call_id=call_id, result=result, batch=True))
                return Step(Reading(run), (respond,))
            case SubmittingInput(run=run), Failed(error=error):
                return failed_with(self, run, error)
            case Capturing(run=run), Answered(value=outcome):
                match outcome:  # SA-24
                    case ToolOutcome(ok=False, text=text):
                        return fail(run, CaptureFailedError(text[:2000]))
                    case ToolOutcome(text=text) if not text.strip():
                        return fail(run, EmptyAnswerError("complete_capture returned an empty result"))
                    case ToolOutcome(text=text):
                        return self.succeed(run, text)
                return fail(run, SubagentHostError(f"complete_capture returned {type(outcome).__name__}"))
            case RecordingCompleted(run=run, answer=answer), Answered():
                assert run.facts.model is not None
                return Step(Ended(), (Finish(RunResult(answer=answer, model=run.facts.model)),))
            case RecordingStarted(run=run) | Counting(run=run) | SubmittingFirst(run=run) | Rendering(
                run=run
            ) | RecordingCall(run=run) | ExecutingTool(run=run) | RecordingResult(
                run=run
            ) | RecordingSubmitted(run=run) | Capturing(run=run) | RecordingCompleted(run=run), Failed(
                error=error
            ):  # SA-28
                return abort(self, run, error)
        raise AssertionError(f"no row for {type(state).__name__} and {type(message).__name__}")


SUBAGENT: Final = SubagentFlavor()


class SubagentRunActor(RoundActor):
    """Runs one ``run`` (SA-01..SA-28, EV-01..EV-06) and stops: the round machine (actors/runs/machine.py)
    with ``SubagentFlavor``'s rows, on the bus."""

    FLAVOR = SUBAGENT
    RUN = RunSubagent
    CANCEL = CancelRun

    def __init__(self, node: Node, address: str, *, handle_timeout: float = HANDLE_TIMEOUT) -> None:
        super().__init__(node, address)
        self._handle_timeout = handle_timeout

    def accepted(self, message: Any) -> None:
        self._to = {Target.HOST: message.host, Target.ROUTER: message.router}
        self._timeout = {Target.HOST: HOST_TIMEOUT, Target.HANDLE: self._handle_timeout, Target.ROUTER: None}

    def open_handle(self, request: SessionInferenceRequest) -> tuple[str, Any]:
        name = f"{self.name}.inference"
        # Hosted on this run's thread, as a session loop's handle is: the run's requests to its handle, and
        # the answers, change no thread, and a run costs no thread of its own for its provider turn.
        ref = self.host_actor(
            InferenceHandleActor,
            name,
            router=self._to[Target.ROUTER],
            request=request,
            start_timeout=self._handle_timeout,
            ephemeral=True,
        )
        return f"{self.node.name}/{name}", ref


# ------------------------------------------------------------------------------------------------ facade


def run_future(
    node: Node,
    router_address: str,
    request: RunRequest,
    host_address: str,
    *,
    timeout: float | None = None,
    protocol_reserve_tokens: int = PROTOCOL_RESERVE_TOKENS,
    run_on: Node | None = None,
) -> concurrent.futures.Future[Any]:
    """Spawn a ``SubagentRunActor`` (on ``run_on``, default ``node``); resolves with the ``RunResult``.

    Cancelling the returned future, or its ``timeout`` running out, sends the run ``CancelRun``: it stops at
    its next step boundary instead of going on for nobody (its open turn accounted for, the receipt recorded
    once)."""
    where = run_on or node
    name = f"subagent.{uuid.uuid4().hex}"
    spawn_run(where, SubagentRunActor, name)
    address = f"{where.name}/{name}"

    def tell_cancel() -> None:
        # Through the node's I/O thread (never a blocking connect on whichever thread cancels). A cancel that
        # overtakes the run request still counts: the run then stops at its first step boundary.
        try:
            node.tell(address, CancelRun(), src=node.client_address(via_node=True))
        except BusError as exc:  # the run is gone or unreachable: nothing left to stop
            log.info("cancelling %s: %r", address, exc)

    def expired(fut: concurrent.futures.Future[Any]) -> None:
        if isinstance(fut.exception(), Expired):
            tell_cancel()

    inner = node.request_future(
        address,
        RunSubagent(
            request=request,
            host=host_address,
            router=router_address,
            protocol_reserve_tokens=protocol_reserve_tokens,
        ),
        timeout=timeout,
    )
    inner.add_done_callback(expired)
    outer = chained(inner, error=restore_accounting_note)
    outer.add_done_callback(lambda fut: tell_cancel() if fut.cancelled() else None)
    return outer


def run(
    node: Node,
    router_address: str,
    request: RunRequest,
    host_address: str,
    *,
    timeout: float | None = None,
    protocol_reserve_tokens: int = PROTOCOL_RESERVE_TOKENS,
) -> RunResult:
    forbid_blocking("run")
    future = run_future(
        node,
        router_address,
        request,
        host_address,
        timeout=timeout,
        protocol_reserve_tokens=protocol_reserve_tokens,
    )
    return future.result(None if timeout is None else timeout + 1.0)  # type: ignore[no-any-return]


SUBAGENT_MESSAGES = (
    RunRequest,
    RunResult,
    StateUpdate,
    ToolOutcome,
    ContextBudget,
    AuditEvent.Started,
    AuditEvent.InferenceSubmitted,
    AuditEvent.ToolCall,
    AuditEvent.ToolResult,
    AuditEvent.ProviderReceipt,
    AuditEvent.Completed,
    HostRenderToolCall,
    RenderedCall,
    RunSubagent,
    CancelRun,
)
SUBAGENT_ERRORS: tuple[type[BusError], ...] = (
    RunCancelled,
    ContextCapacityError,
    EmptyAnswerError,
    EmptyCaptureError,
    CaptureFailedError,
    InvalidRunRequest,
    SubagentHostError,
)
