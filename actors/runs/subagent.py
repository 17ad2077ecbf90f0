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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Final, Protocol

from actors.base import DEFER, BusActor, Context
from actors.effects import EffectRunner, EffectStore, RerunSafe, idempotency_key, rerun_rule
from actors.errors import Broken, Cancelled, Invalid
from actors.inference.handle import (
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
from actors.router.messages import CountTokens, ResolveModel, SubmitInput, TokenCount
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
    AgentProvider,
    ResolvedAgentModel,
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
from transport.pending import Reply, chained, forbid_blocking

log = logging.getLogger(__name__)

HOST_TIMEOUT: Final = 3600.0  # a tool may take long; the caller's own deadline bounds the run
HANDLE_TIMEOUT: Final = 3600.0
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


@dataclass(frozen=True, slots=True, kw_only=True)
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


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    TAG: ClassVar[str] = "sa.result"
    answer: str
    model: ResolvedAgentModel


class AuditEvent:
    """What a run records through ``Host.record``, in order (EV-01..EV-06); callers ``match`` on these."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Started:
        TAG: ClassVar[str] = "sa.ev.started"
        parent_operation_id: uuid.UUID
        model: str
        provider_model: str
        provider: AgentProvider
        context_window_tokens: int
        max_input_tokens: int
        context: tuple[str, ...]
        task: str
        host: JsonValue

    @dataclass(frozen=True, slots=True, kw_only=True)
    class InferenceSubmitted:
        TAG: ClassVar[str] = "sa.ev.submitted"
        parent_operation_id: uuid.UUID
        round: int
        manifest_hash: str
        estimated_input_tokens: int

    @dataclass(frozen=True, slots=True, kw_only=True)
    class ToolCall:
        TAG: ClassVar[str] = "sa.ev.tool_call"
        parent_operation_id: uuid.UUID
        name: str
        arguments: JsonValue

    @dataclass(frozen=True, slots=True, kw_only=True)
    class ToolResult:
        TAG: ClassVar[str] = "sa.ev.tool_result"
        parent_operation_id: uuid.UUID
        name: str
        ok: bool
        projection_accepted: bool
        result: str

    @dataclass(frozen=True, slots=True, kw_only=True)
    class ProviderReceipt:
        TAG: ClassVar[str] = "sa.ev.receipt"
        parent_operation_id: uuid.UUID
        round: int
        manifest_hash: str
        usage: TokenUsage | None
        receipt: UsageReceipt

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Completed:
        TAG: ClassVar[str] = "sa.ev.completed"
        parent_operation_id: uuid.UUID
        model: str
        response: str


AnyAuditEvent = (
    AuditEvent.Started
    | AuditEvent.InferenceSubmitted
    | AuditEvent.ToolCall
    | AuditEvent.ToolResult
    | AuditEvent.ProviderReceipt
    | AuditEvent.Completed
)

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


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRenderToolCall:
    TAG: ClassVar[str] = "sa.host.render_tool_call"
    call: ToolCall


@dataclass(frozen=True, slots=True, kw_only=True)
class RenderedCall:
    TAG: ClassVar[str] = "sa.host.rendered_call"
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class HostExecuteTool:
    """``idempotency_key``: the run's operation id and the call id (``idempotency_key(op, call_id)``), so
    a repeat never runs the tool twice; empty: unprotected."""

    TAG: ClassVar[str] = "sa.host.execute_tool"
    call: ToolCall
    operation_id: uuid.UUID
    budget: ContextBudget
    idempotency_key: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class HostCompleteCapture:
    TAG: ClassVar[str] = "sa.host.complete_capture"
    capture: JsonValue
    contents: str
    budget: ContextBudget


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRecord:
    TAG: ClassVar[str] = "sa.host.record"
    event: AnyAuditEvent


class RunHostActor(BusActor):
    """Serves one application ``Host`` on the bus: one request message per host method.

    ``execute_tool`` runs at most once per idempotency key, as in ``run_session``'s ``HostActor``
    (actors/effects.py): a repeat gets the stored outcome; a key whose run was cut off gets
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
        super().__init__(node, address)
        self.host = host
        self._effects = EffectRunner(self, EffectStore(effects), _unknown_outcome)
        self._rerun_safe = rerun_rule(rerun_safe)

    def handle(self, message: Any, ctx: Context) -> Any:
        host = self.host
        match message:
            case HostRenderToolCall(call=call):
                text = host.render_tool_call(call)
                if not isinstance(text, str):
                    raise SubagentHostError(f"render_tool_call returned {type(text).__name__}, not str")
                return RenderedCall(text=text)
            case HostExecuteTool(call=call, operation_id=op, budget=budget, idempotency_key=key):
                return self._effects.execute(
                    ctx,
                    key,
                    f"tool {call.name[:80]!r}",
                    lambda: host.execute_tool(call, op, budget),
                    rerun_safe=self._rerun_safe(call),
                )
            case HostCompleteCapture(capture=capture, contents=contents, budget=budget):
                return self._result(host.complete_capture(capture, contents, budget), ctx)
            case HostRecord(event=event):
                return self._result(host.record(event), ctx)
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _result(self, result: Any, ctx: Context) -> Any:
        return self.answer_when_done(result, ctx)

    def on_stop(self) -> None:
        self._effects.close()
        super().on_stop()


def _unknown_outcome(text: str) -> ToolOutcome:
    return ToolOutcome(text=text, ok=False, unknown=True)


# -------------------------------------------------------------------------------------------------- run


@dataclass(frozen=True, slots=True, kw_only=True)
class RunSubagent:
    TAG: ClassVar[str] = "sa.run"
    request: RunRequest
    host: str
    router: str
    protocol_reserve_tokens: int = PROTOCOL_RESERVE_TOKENS


@dataclass(frozen=True, slots=True)
class CancelRun:
    """Ends a run at its next step boundary (before its next read of the provider or its next tool), the open
    turn accounted for as interrupted and its receipt recorded once; the run fails with ``RunCancelled``."""

    TAG: ClassVar[str] = "sa.cancel"


class SubagentRunActor(BusActor):
    """Runs one ``run`` (SA-01..SA-28, EV-01..EV-06) and stops. Every wait is a continuation."""

    def __init__(self, node: Node, address: str, *, handle_timeout: float = HANDLE_TIMEOUT) -> None:
        super().__init__(node, address)
        self._handle_timeout = handle_timeout
        self._progressed = False  # the provider turn started: a later NotDelivered is Unavailable
        self._ctx: Context | None = None
        self._request: RunRequest | None = None
        self._host = ""
        self._router = ""
        self._reserve = PROTOCOL_RESERVE_TOKENS
        self._model: ResolvedAgentModel | None = None
        self._projection: Projection | None = None
        self._counts: dict[str, int] = {}
        self._exact = False
        self._round = 0
        self._hash = ""
        self._handle: str | None = None
        self._handle_ref: Any = None
        self._handle_op: uuid.UUID | None = None
        self._capture: JsonValue | None = None
        self._cancelled = False

    # ------------------------------------------------------------------------------------ entry
    def handle(self, message: Any, ctx: Context) -> Any:
        if isinstance(message, CancelRun):
            self._cancelled = True
            return None
        if not isinstance(message, RunSubagent):
            raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")
        if self._ctx is not None:
            raise InvalidRunRequest("this run actor runs one run only")
        if message.protocol_reserve_tokens < 0:
            raise InvalidRunRequest("protocol_reserve_tokens must be at least 0")
        self._ctx, self._request = ctx, message.request
        if self._cancelled:  # the cancel overtook the run: nothing has started
            self._fail(RunCancelled("the run was cancelled before it started"))
            return DEFER
        self._host, self._router = message.host, message.router
        self._reserve = message.protocol_reserve_tokens
        self._projection = Projection(tuple(message.request.context), message.request.task)
        self.ask(self._router, ResolveModel(requested=message.request.model), self._on_resolved)  # SA-01
        return DEFER

    @property
    def _op(self) -> uuid.UUID:
        assert self._request is not None
        return self._request.parent_operation_id

    @property
    def _max(self) -> int:
        assert self._model is not None
        return self._model.max_input_tokens

    # ---------------------------------------------------------------------------- host / router
    def _call_host(self, message: Any, then: Callable[[Any], None]) -> None:
        """Ask the host; any host error aborts the run, after accounting for an active turn (SA-28)."""

        def on_reply(reply: Reply) -> None:
            if reply.error is not None:
                self._abort(reply.error)
            else:
                then(reply.message)

        self.ask(self._host, message, on_reply, timeout=HOST_TIMEOUT)

    def _record(self, event: AnyAuditEvent, then: Callable[[], None]) -> None:
        self._call_host(HostRecord(event=event), lambda _: then())  # EV-10: awaited

    def _counted(self, pieces: Sequence[str], then: Callable[[], None]) -> None:
        """Count every piece not counted yet (one Router request), then continue."""
        missing = list(dict.fromkeys(p for p in pieces if p not in self._counts))
        if not missing:
            then()
            return
        assert self._model is not None

        def on_reply(reply: Reply) -> None:
            if reply.error is not None:
                self._abort(reply.error)
                return
            counted: TokenCount = reply.message
            if len(counted.counts) != len(missing):
                self._abort(BusError(f"CountTokens answered {len(counted.counts)} counts for {len(missing)}"))
                return
            self._exact = counted.exact
            self._counts.update(zip(missing, counted.counts, strict=True))
            then()

        self.ask(
            self._router,
            CountTokens(model=self._model.model, texts=tuple(missing)),
            on_reply,
            timeout=COUNT_TIMEOUT,
        )

    def _tokens(self, projection: Projection) -> int:
        return sum(self._counts[p] for p in projection.pieces())

    def _budget(self, pending: str | None = None) -> ContextBudget:
        assert self._projection is not None
        return self._projection.budget(
            self._counts.__getitem__,
            reserve=self._reserve,
            maximum=self._max,
            exact=self._exact,
            pending=pending,
        )

    # ---------------------------------------------------------------------------------- start
    def _on_resolved(self, reply: Reply) -> None:
        if reply.error is not None:
            self._fail(reply.error)
            return
        model: ResolvedAgentModel = reply.message
        request = self._request
        assert request is not None and self._projection is not None
        self._model = model
        started = AuditEvent.Started(
            parent_operation_id=self._op,
            model=model.model,
            provider_model=model.provider_model,
            provider=model.provider,
            context_window_tokens=model.context_window_tokens,
            max_input_tokens=model.max_input_tokens,
            context=tuple(request.context),
            task=request.task,
            host=request.start_metadata,
        )  # EV-01
        frames = (HISTORY_OPEN, HISTORY_CLOSE, STATE_OPEN, STATE_CLOSE)
        self._record(started, lambda: self._counted((*self._projection_pieces(), *frames), self._first))

    def _projection_pieces(self) -> list[str]:
        assert self._projection is not None
        return self._projection.pieces()

    def _first(self) -> None:
        assert self._projection is not None and self._request is not None and self._model is not None
        rendered = self._projection.render()
        estimated = self._tokens(self._projection) + self._reserve
        if estimated > self._max:  # SA-06: before the provider turn starts
            self._fail(ContextCapacityError(estimated=estimated, maximum=self._max))
            return
        self._round = 1
        self._hash = manifest_hash(rendered)
        submitted = AuditEvent.InferenceSubmitted(
            parent_operation_id=self._op, round=1, manifest_hash=self._hash, estimated_input_tokens=estimated
        )
        prepared = PreparedRound(
            input=rendered,
            provider_input=rendered,
            continuation=None,  # SA-02: fresh
            model=self._model.model,  # SA-01: the one resolution
            reasoning_effort=self._request.reasoning_effort,  # SA-26
            tool_description=RUN_TOOL_DESCRIPTION,  # SA-27
            timeout=self._request.timeout,
        )
        self._record(submitted, lambda: self._start(prepared))  # EV-02

    def _start(self, prepared: PreparedRound) -> None:
        request = self._request
        assert request is not None
        inference = SessionInferenceRequest(
            user_id=request.user_id, operation_id=request.parent_operation_id, round=1, prepared=prepared
        )
        name = f"{self.name}.inference"
        self._handle_ref = self.node.spawn(
            InferenceHandleActor,
            name,
            router=self._router,
            request=inference,
            start_timeout=self._handle_timeout,
            ephemeral=True,
        )
        self._handle = f"{self.node.name}/{name}"
        self._call_handle(AwaitStarted(), self._on_started)

    def _call_handle(self, message: Any, then: Callable[[Reply], None]) -> None:
        assert self._handle is not None
        self.ask(self._handle, message, then, timeout=self._handle_timeout)

    def _on_started(self, reply: Reply) -> None:
        if reply.error is not None:
            error = reply.error
            self._release_handle()
            receipt = error.receipt if isinstance(error, InferenceError) else None
            if receipt is not None:
                self._record_and_fail(error, receipt)
            else:
                self._fail(error)
            return
        started: InferenceStarted = reply.message
        self._handle_op = started.operation_id  # SA-20: the run's child operation, stable for the run
        self._progressed = True
        self._next()

    # --------------------------------------------------------------------------------- events
    def _next(self) -> None:
        if self._cancelled:
            self._abort(RunCancelled("the run was cancelled"))
            return
        self._call_handle(NextEvent(), self._on_event)

    def _on_event(self, reply: Reply) -> None:
        if reply.error is not None:
            self._failed_with(reply.error)
            return
        match reply.message:
            case Ok():
                self._abort(ProviderEndedError("the provider stream ended without a final answer"))
            case SessionInferenceEvent.ProviderInput() | SessionInferenceEvent.UsageUpdated():
                self._next()
            case SessionInferenceEvent.ToolCall() if self._cancelled:  # no new tool after a cancel
                self._abort(RunCancelled("the run was cancelled"))
            case SessionInferenceEvent.ToolCall(call_id=call_id, call=call):
                if isinstance(call, ToolCallError):
                    self._invalid(call_id, call)
                else:
                    self._call_host(
                        HostRenderToolCall(call=call),
                        lambda rendered: self._rendered(call_id, call, rendered),
                    )  # SA-05: once, before execute_tool
            case SessionInferenceEvent.Completed(answer=answer, usage=usage, receipt=receipt):
                self._release_handle()
                event = AuditEvent.ProviderReceipt(
                    parent_operation_id=self._op,
                    round=self._round,
                    manifest_hash=self._hash,
                    usage=usage,
                    receipt=receipt,
                )  # EV-04: the last submitted round
                self._record(event, lambda: self._complete(answer))
            case other:
                self._abort(InferenceError(f"unexpected handle event {type(other).__name__}"))

    def _failed_with(self, error: BusError) -> None:
        receipt = getattr(error, "receipt", None)
        if isinstance(receipt, UsageReceipt):  # the turn ended at the Router: its receipt, once
            self._record_and_fail(error, receipt)
        else:
            self._abort(error)

    # ---------------------------------------------------------------------------------- tools
    def _invalid(self, call_id: str, error: ToolCallError) -> None:
        """SA-25: answered with a failure without the host; audited as a ``call_ktool`` result."""
        text = str(error)
        self._place_failure(call_id, "call_ktool", INVALID_CALL, text, ok=False, accepted=True, exact=text)

    def _rendered(self, call_id: str, call: ToolCall, rendered: Any) -> None:
        if not isinstance(rendered, RenderedCall):
            self._abort(SubagentHostError(f"render_tool_call returned {type(rendered).__name__}"))
            return
        text = rendered.text
        assert self._projection is not None
        pending = self._projection.copy()
        pending.add(text, "", True)

        def execute() -> None:
            assert self._handle_op is not None
            budget = self._budget(pending=text)  # SA-20: P before this result is applied
            self._call_host(
                HostExecuteTool(
                    call=call,
                    operation_id=self._handle_op,
                    budget=budget,
                    idempotency_key=idempotency_key(self._handle_op, call_id),
                ),
                lambda outcome: self._classify(call_id, call, text, outcome),
            )

        event = AuditEvent.ToolCall(parent_operation_id=self._op, name=call.name, arguments=call.arguments)
        self._record(event, lambda: self._counted(pending.pieces(), execute))  # EV-03

    def _classify(self, call_id: str, call: ToolCall, rendered: str, outcome: Any) -> None:
        if not isinstance(outcome, ToolOutcome):
            self._abort(SubagentHostError(f"execute_tool returned {type(outcome).__name__}"))
            return
        if not outcome.ok:  # SA-18: updates, displayed keys and capture ignored
            self._place_failure(
                call_id, call.name, rendered, outcome.text, ok=False, accepted=True, exact=outcome.text
            )
            return
        assert self._projection is not None
        candidate = self._projection.copy()
        candidate.add(rendered, outcome.text, True, outcome.displayed_state_keys)
        candidate.apply(outcome.state_updates)

        def decide() -> None:
            needed = self._tokens(candidate) + self._reserve
            if needed > self._max:  # SA-16: a failure to the provider; projected state unchanged
                self._place_failure(
                    call_id,
                    call.name,
                    rendered,
                    rejection_text(needed, self._max),
                    ok=True,
                    accepted=False,
                    exact=outcome.text,
                )
                return
            self._projection = candidate  # SA-17: exact
            if outcome.capture is not None:
                self._capture = outcome.capture  # SA-21: ok and accepted only; the last one wins
            self._tool_done(
                call_id, call.name, ToolResult(success=True, output=outcome.text), True, True, outcome.text
            )

        self._counted(candidate.pieces(), decide)

    def _place_failure(
        self, call_id: str, name: str, rendered: str, text: str, *, ok: bool, accepted: bool, exact: str
    ) -> None:
        """A failure entry (SA-16, SA-18, SA-25): exact when it fits, else truncated to fit, else the run
        cannot go on (``ContextCapacityError`` after accounting)."""
        assert self._projection is not None
        candidate = self._projection.copy()
        candidate.add(rendered, text, False)
        empty = self._projection.copy()
        empty.add(rendered, "", False)

        def placed(shown: str, accepted: bool) -> None:
            self._projection = candidate
            self._tool_done(call_id, name, ToolResult(success=False, output=shown), ok, accepted, exact)

        def try_truncated() -> None:
            room = self._max - self._reserve - self._tokens(empty)
            shown = truncated(text, room, self._exact)
            candidate.entries[-1] = replace(candidate.entries[-1], text=shown)

            def check() -> None:
                needed = self._tokens(candidate) + self._reserve
                if needed > self._max:
                    self._abort(ContextCapacityError(estimated=needed, maximum=self._max))
                else:
                    placed(shown, False)

            self._counted(candidate.pieces(), check)

        def check_exact() -> None:
            if self._tokens(candidate) + self._reserve <= self._max:
                placed(text, accepted)
            else:
                self._counted(empty.pieces(), try_truncated)

        self._counted(candidate.pieces(), check_exact)

    def _tool_done(
        self, call_id: str, name: str, result: ToolResult, ok: bool, accepted: bool, exact: str
    ) -> None:
        """Audit the classified result (SA-15: the exact text), then the next provider request: the whole
        projection re-rendered and submitted, then the native response (SA-19)."""
        audited = AuditEvent.ToolResult(
            parent_operation_id=self._op, name=name, ok=ok, projection_accepted=accepted, result=exact
        )
        self._record(audited, lambda: self._submit(call_id, result))

    def _submit(self, call_id: str, result: ToolResult) -> None:
        assert self._projection is not None and self._handle_op is not None
        rendered = self._projection.render()
        estimated = self._tokens(self._projection) + self._reserve
        if estimated > self._max:  # SA-06 before every request (placement keeps it from happening)
            self._abort(ContextCapacityError(estimated=estimated, maximum=self._max))
            return
        self._round += 1
        self._hash = manifest_hash(rendered)
        submitted = AuditEvent.InferenceSubmitted(
            parent_operation_id=self._op,
            round=self._round,
            manifest_hash=self._hash,
            estimated_input_tokens=estimated,
        )
        op = self._handle_op

        def submitted_input(reply: Reply) -> None:
            if reply.error is not None:
                self._failed_with(reply.error)
                return
            self._call_handle(Respond(call_id=call_id, result=result), responded)

        def responded(reply: Reply) -> None:
            if reply.error is not None:
                self._failed_with(reply.error)
            else:
                self._next()

        def submit() -> None:
            self.ask(self._router, SubmitInput(operation_id=op, input=rendered), submitted_input)

        self._record(submitted, submit)

    # ------------------------------------------------------------------------------ completion
    def _complete(self, answer: str) -> None:
        if self._capture is None:
            if not answer.strip():
                self._fail(EmptyAnswerError("the run's terminal answer is empty"))  # SA-23
            else:
                self._succeed(answer)
            return
        if not answer.strip():  # SA-22: complete_capture is never called
            self._fail(EmptyCaptureError("a capture was designated, but the terminal answer is empty"))
            return
        capture = HostCompleteCapture(capture=self._capture, contents=answer, budget=self._budget())
        self._call_host(capture, self._on_captured)  # SA-21

    def _on_captured(self, outcome: Any) -> None:
        match outcome:  # SA-24
            case ToolOutcome(ok=False, text=text):
                self._fail(CaptureFailedError(text[:2000]))
            case ToolOutcome(text=text) if not text.strip():
                self._fail(EmptyAnswerError("complete_capture returned an empty result"))
            case ToolOutcome(text=text):
                self._succeed(text)
            case other:
                self._fail(SubagentHostError(f"complete_capture returned {type(other).__name__}"))

    def _succeed(self, answer: str) -> None:
        model = self._model
        assert model is not None
        done = AuditEvent.Completed(parent_operation_id=self._op, model=model.model, response=answer)

        def reply() -> None:
            ctx = self._ctx
            if ctx is not None and not ctx.done:
                ctx.reply(RunResult(answer=answer, model=model))
            self.stop()

        self._record(done, reply)  # EV-05: last, on success only

    # ------------------------------------------------------------------------------ accounting
    def _abort(self, error: BaseException) -> None:
        """SA-28: with an active turn, account for it as interrupted and record its receipt, then fail."""
        if self._handle is None or self._handle_op is None:
            self._fail(error)
            return

        def accounted(reply: Reply) -> None:
            failure = reply.error
            receipt = reply.message if failure is None else getattr(failure, "receipt", None)
            self._release_handle()
            if isinstance(receipt, UsageReceipt):
                self._record_and_fail(error, receipt)
            else:
                self._fail(error if failure is None else note_accounting_failure(error, failure))

        self._call_handle(FinishUnavailable(), accounted)

    def _record_and_fail(self, error: BaseException, receipt: UsageReceipt) -> None:
        """The turn's receipt is recorded once (EV-04, EV-09), then ``error`` is raised; a failing record
        is attached to it, never raised in its place (nor retried)."""
        self._release_handle()
        event = AuditEvent.ProviderReceipt(
            parent_operation_id=self._op,
            round=self._round,
            manifest_hash=self._hash,
            usage=None,
            receipt=receipt,
        )

        def recorded(reply: Reply) -> None:
            self._fail(error if reply.error is None else note_accounting_failure(error, reply.error))

        self.ask(self._host, HostRecord(event=event), recorded, timeout=HOST_TIMEOUT)

    # ------------------------------------------------------------------------------------ ending
    def _release_handle(self) -> None:
        ref, self._handle_ref = self._handle_ref, None
        self._handle = None
        self._handle_op = None
        if ref is not None:
            ref.stop(block=False)

    def _fail(self, error: BaseException) -> None:
        self._release_handle()
        ctx = self._ctx
        if ctx is not None and not ctx.done:
            ctx.fail(retry_class(error, progressed=self._progressed))
        self.stop()


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
    where.spawn(SubagentRunActor, name)
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
    HostExecuteTool,
    HostCompleteCapture,
    HostRecord,
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
