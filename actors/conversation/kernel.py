"""One kernel run of a conversation: a ``run_session`` (actors/runs/session.py) whose ``SessionHost`` is the
conversation actor itself (``KernelHost``).

``prepare_round`` renders the transcript into the round's input and lists the tool host's tools in
``tool_description`` (the model calls them through the one ``call_ktool``); ``execute_tool`` journals each
call with its idempotency key (conversation id, turn, step, call id), then forwards it to the
``ToolHostActor``, and journals the call and its result together when the result arrives, so no call is
left without its result; ``prepare_provider_resume`` is the step boundary where an interrupt (IT-01/IT-02)
or the step budget ends the turn. An interrupt also sends the loop ``CancelSession``, so a model that is
still generating is stopped at once; the loop's ``SessionCancelled`` then ends the turn as CANCELLED with its
completed steps. The summary of a compaction is a kernel run of the same kind, without tools.

A tool host that cannot be reached before the call left (``NotDelivered``) gives the model an error result:
nothing ran. A host that fails after the call left (``Unavailable``, ``Expired``: the outcome is unknown)
suspends the turn: the run ends with that error, the turn stays open in the journal, and
``continue_turn`` later asks the host again by the same key (a finished call is not rerun).
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal

from actors.base import DEFER, BusActor, Context
from actors.conversation.journal import Journal, PendingCall, Sync
from actors.conversation.messages import ConversationError, ExecuteTool
from actors.conversation.permissions import denial_text, merge_input
from actors.conversation.tools import ToolExecution
from actors.conversation.types import (
    Compactor,
    FinishReason,
    Message,
    MessageToolCall,
    SessionEnd,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
)
from actors.inference.handle import PreparedRound
from actors.router.messages import TurnTextDelta
from actors.runs.machine import RUN_HOSTS
from actors.runs.session import (
    CALL_TIMEOUT,
    CancelSession,
    HostCompleteCapture,
    HostCompleteRound,
    HostExecuteTool,
    HostPrepareResume,
    HostPrepareRound,
    HostRecord,
    HostRunTool,
    ProviderResume,
    ResumeAfter,
    RoundPreparation,
    RunSession,
    SessionCancelled,
    SessionControl,
    SessionEvent,
    SessionLoopActor,
    SessionRunRequest,
    SessionToolOutcome,
)
from actors.types import OfferedTool, TokenUsage, ToolCall, ToolCallError
from transport.errors import BusError, Expired, NotDelivered, Unavailable
from transport.node import Node
from transport.pending import Reply
from transport.replay import recorded_uuid

log = logging.getLogger(__name__)

__all__ = ["ConversationConfig", "KernelHost", "KernelRun", "line_of", "render_input"]

LocalResult = ToolExecution | Callable[[Callable[[ToolExecution], None]], None] | None
RUN_TIMEOUT = 24 * 3600.0  # one run_session; the callers' own deadlines bound their waits
HOST_TIMEOUT = 3600.0

# The node's host pools (actors.base.HostPool) a conversation is placed on: the conversation actor and its
# plan gates on one, its tool host on the other (a tool may block its thread; a conversation never does).
CONVERSATION_HOSTS = RUN_HOSTS  # one pool: bare session and subagent runs are placed on it too
TOOL_HOSTS = "tool"
SUMMARY_TOOL_DESCRIPTION = "No tools are available while summarizing: answer with the summary text only."


@dataclass(frozen=True)
class ConversationConfig:
    router: str
    model: str
    host: str
    system_prompt: str = ""
    session_file: Path | None = None
    resume: bool = True
    journal_sync: Sync = Sync.EFFECTS
    compactor: Compactor | None = None
    sink: str | None = None
    session_id: str | None = None
    hooks: tuple[Callable[[SessionEnd], None], ...] = ()
    max_steps: int = 16
    user_id: str = "conversation"
    round_timeout: float | None = None
    tool_timeout: float = HOST_TIMEOUT  # one tool call, then its outcome is unknown (the turn suspends)
    call_timeout: float = CALL_TIMEOUT  # each step of a kernel run (a model read, a host callback)
    reasoning_effort: str = ""
    # None: a recorded UUID4 (transport/replay.py recorded_uuid), so a capture replays with no factory passed
    operation_ids: Callable[[], uuid.UUID] | None = None
    # the loops (loops.py): a GoalEvaluator (None: the judge run), the judge's model (None: the session's),
    # its timeout, the transcript tail it sees, and the clock/timer source (None: wall clock, threads)
    goal_evaluator: Any = None
    judge_model: str | None = None
    judge_timeout: float = 120.0
    goal_judge_tail: int = 20
    timers: Any = None
    # people in the loop (gatekeeper.py): the permission hook actor, how long it may take, how long a person
    permission_hook: str | None = None
    permission_timeout: float = 30.0
    ask_timeout: float = 3600.0  # an ``ask`` or a proposed plan nobody decides is denied (rejected) after it
    plan_mode: bool = False  # start in plan mode (a resumed session keeps its journaled mode)


def line_of(m: Message) -> str:
    """One transcript message as a line of the rendered conversation."""
    match m.role:
        case "user":
            return f"User: {m.content}"
        case "system":
            return f"System: {m.content}"
        case "tool":
            status = "error" if m.is_error else "ok"
            return f"Tool result ({m.tool_call_id}, {status}): {m.content}"
    calls = "".join(f"\nAssistant called tool {c.name} with {c.arguments} ({c.id})" for c in m.tool_calls)
    text = f"Assistant: {m.content}" if m.content or not calls else ""
    return (text + calls).lstrip("\n")


def render_input(system_prompt: str, transcript: list[Message] | tuple[Message, ...]) -> str:
    """The text one round sends to the model: instructions, the conversation so far, the latest message."""
    parts = [system_prompt] if system_prompt else []
    history, latest = list(transcript), None
    if history and history[-1].role == "user":
        latest = history.pop()
    if history:
        parts.append("Conversation so far:\n" + "\n".join(line_of(m) for m in history))
    if latest is not None:
        parts.append(latest.content if not history else f"User: {latest.content}")
    return "\n\n".join(parts)


@dataclass
class KernelRun:
    """One run_session in flight (a turn or a summary)."""

    mode: Literal["turn", "summary", "judge"]
    loop: str  # the session loop's address: the only sender the host handlers accept
    model: str
    provider_input: str
    tool_description: str
    turn_index: int = -1
    new: list[Message] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # streamed text since the last tool call
    steps: int = 0
    usage: TokenUsage | None = None
    finish: FinishReason = FinishReason.STOP
    final: str | None = None
    interrupted: bool = False  # CancelSession was sent to the loop: its SessionCancelled is a cancel
    base: int = 0  # the transcript index run.new[0] will have (the journal's message_appended index)
    suspended: BaseException | None = None  # a tool call's outcome became unknown: the turn stays open
    suspended_call: PendingCall | None = None
    verdict: dict[str, Any] | None = None  # a judge run: the arguments of its goal_verdict call
    timed_out: bool = False  # a judge run cancelled at its timeout
    response_schema: dict[str, Any] | None = None  # the answer's JSON schema (a judge run's verdict)
    tools: tuple[OfferedTool, ...] = ()  # the tools tool_description lists, as data (PreparedRound.tools)


class KernelHost(BusActor):
    """The kernel half of the conversation actor: starts kernel runs and serves their host calls."""

    def __init__(self, node: Node, address: str, *, config: ConversationConfig) -> None:
        super().__init__(node, address)
        self.config = config
        self._run: KernelRun | None = None
        self._journal: Journal | None = None  # the session file, opened by the conversation actor
        self._conversation_id = str(recorded_uuid(node, address))  # replaced by the journal's own on resume
        self._loops = itertools.count()
        self._interrupt_tells: set[bytes] = set()  # CancelSession tells whose run may end first

    def _emit(self, event: Any) -> None:
        raise NotImplementedError

    def _cancel_requested(self) -> bool:
        raise NotImplementedError

    def _new_operation_id(self) -> uuid.UUID:
        """A new operation id: the builder's factory if one was given, else a uuid4 that a capture records
        and a replay serves from the log (transport.replay.recorded_uuid)."""
        factory = self.config.operation_ids
        return factory() if factory is not None else recorded_uuid(self.node, self.address)

    def _local_tool(self, name: str, arguments: dict[str, Any], key: str) -> LocalResult:
        """A tool the conversation actor runs itself (``schedule_wakeup``, the job tools): its result, or a
        function that starts it and later calls ``finished(result)``; None: a tool of the tool host."""
        return None

    def _permit(self, pending: PendingCall, arguments: dict[str, Any], then: Callable[[Any], None]) -> None:
        """The permission layer (gatekeeper.py): ``then(decision)`` once the call may run or is denied."""
        raise NotImplementedError

    def _after_tool(
        self, pending: PendingCall, result: ToolExecution, then: Callable[[ToolExecution], None]
    ) -> None:
        then(result)

    def _people_wait(self) -> float:
        return 0.0

    def _add(self, run: KernelRun, message: Message) -> None:
        """A message of the running turn: kept for the transcript and journaled at once."""
        run.new.append(message)
        if self._journal is not None:
            try:
                self._journal.appended(run.base + len(run.new) - 1, message)
            except OSError:  # the effect store and the turn's end record still hold the facts
                log.exception("%s: cannot write the session file", self.address)

    def _text_delta(self, delta: TurnTextDelta, ctx: Context) -> None:
        """A piece of the model's text, told by the run's inference handle (RunSession.observer)."""
        run = self._run
        if run is None or run.mode != "turn" or not ctx.header.src.startswith(f"{run.loop}.inference."):
            return  # a late delta of an earlier run, or a stranger's
        run.text.append(delta.text)
        self._emit(TextDelta(turn_index=run.turn_index, text=delta.text))

    def _kernel(self, run: KernelRun, then: Callable[[BaseException | None], None]) -> None:
        """Run one run_session with this actor as its host; ``then(error)`` when it ends."""
        name = f"{self.name}.loop.{next(self._loops)}"
        self.host_actor(SessionLoopActor, name)  # on this thread: its host calls cost no hand-off
        run.loop = f"{self.node.name}/{name}"
        self._run = run
        request = SessionRunRequest(
            user_id=self.config.user_id,
            operation_id=self._new_operation_id(),
            rounds_used=0,
            round_limit=1,
            call_timeout=max(self.config.call_timeout, self.config.tool_timeout + self._people_wait()),
        )

        def ended(reply: Reply) -> None:
            self._run = None
            if len(self._interrupt_tells) > 64:  # only a late one is of interest: keep the set small
                self._interrupt_tells.clear()
            error = reply.error
            if run.interrupted and isinstance(error, SessionCancelled):  # IT-01: the completed steps stay
                run.finish, error = FinishReason.CANCELLED, None
            then(error)

        self.ask(
            run.loop,
            RunSession(request=request, host=self.address, router=self.config.router, observer=self.address),
            ended,
            timeout=RUN_TIMEOUT,
        )

    def _interrupt(self) -> None:
        """The turn's token was cancelled: stop the running turn's session loop now. A provider stream being
        read is interrupted at once (its turn accounted for as interrupted); a tool that is running finishes
        and keeps its result (IT-02); the loop ends with ``SessionCancelled`` at its next step boundary."""
        run = self._run
        if run is None or run.mode != "turn" or run.interrupted:
            return
        run.interrupted = True
        self._interrupt_tells.add(self.tell_to(run.loop, CancelSession()))

    def on_tell_error(self, error: BusError, tell_id: bytes | None) -> None:
        if tell_id is not None and tell_id in self._interrupt_tells and isinstance(error, NotDelivered):
            self._interrupt_tells.discard(tell_id)  # the run ended (its loop stopped) as the cancel left
            log.debug("%s: the interrupted run had already ended", self.address)
            return
        super().on_tell_error(error, tell_id)

    # ------------------------------------------------------------------------- the host protocol
    def _host_call(self, message: Any, ctx: Context) -> Any:
        run = self._run
        if run is None or ctx.header.src != run.loop:
            raise ConversationError(f"{type(message).__name__} from {ctx.header.src}: no such session loop")
        match message:
            case HostPrepareRound():
                if run.mode == "turn" and self._cancel_requested():
                    run.finish = FinishReason.CANCELLED
                    return RoundPreparation.Complete(answer=None)
                return RoundPreparation.Run(
                    prepared=PreparedRound(
                        input=run.provider_input,
                        provider_input=run.provider_input,
                        continuation=None,
                        model=run.model,
                        reasoning_effort=self.config.reasoning_effort,
                        tool_description=run.tool_description,
                        timeout=self.config.round_timeout,
                        response_schema=run.response_schema,
                        tools=run.tools,
                    )
                )
            case HostRecord(event=event):
                self._record(run, event)
                return None
            case HostExecuteTool(call_id=call_id, call=call):
                return self._execute(run, call_id, call, ctx)
            case HostRunTool(call_id=call_id, call=call, records=records):  # records, the tool, its resume
                for event in records:  # RS-10: the events that came with the call, first
                    self._record(run, event)
                return self._execute(run, call_id, call, ResumeAfter(ctx, self, partial(self._resume, run)))
            case HostPrepareResume(outcome=outcome):
                return self._resume(run, outcome)
            case HostCompleteRound(completion=completion):
                if completion.finish_reason == "length" and run.finish is FinishReason.STOP:
                    run.finish = FinishReason.LENGTH  # the answer was cut at the output-token limit
                return self._completed(run, completion.answer)
            case HostCompleteCapture(contents=contents):
                return self._completed(run, contents)
        raise TypeError(type(message).__name__)

    @staticmethod
    def _record(run: KernelRun, event: Any) -> None:
        if isinstance(event, SessionEvent.UsageUpdated) or (
            isinstance(event, SessionEvent.ProviderReceipt) and event.usage is not None
        ):
            run.usage = event.usage

    def _resume(self, run: KernelRun, outcome: SessionToolOutcome) -> Any:
        if run.mode == "turn" and self._cancel_requested():  # IT-01/IT-02: after the result
            run.finish = FinishReason.CANCELLED
            return ProviderResume.Complete(answer=None)
        if run.mode == "judge":  # one verdict call, then the judge's turn ends
            return ProviderResume.Complete(answer=None)
        if run.steps >= (self.config.max_steps if run.mode == "turn" else 2):
            run.finish = FinishReason.MAX_STEPS
            return ProviderResume.Complete(answer=None)
        return ProviderResume.Continue(outcome=outcome)

    def _completed(self, run: KernelRun, answer: str) -> Any:
        run.final = answer
        if run.mode == "turn":
            if self._cancel_requested():
                run.finish = FinishReason.CANCELLED
            self._add(run, Message.assistant(answer))
        return SessionControl.Complete(answer=answer)

    def _execute(self, run: KernelRun, call_id: str, call: ToolCall | ToolCallError, ctx: Context) -> Any:
        run.steps += 1
        content, run.text = "".join(run.text), []
        if isinstance(call, ToolCall):
            name, arguments = call.name, json.dumps(call.arguments, ensure_ascii=False)
        else:
            name, arguments = "call_ktool", json.dumps({"error": str(call)}, ensure_ascii=False)
        pending = PendingCall(
            key=f"{self._conversation_id}:{run.turn_index}:{run.steps}:{call_id}",
            call_id=call_id,
            name=name,
            arguments=arguments,
            text=content,
        )
        if run.mode == "turn":
            self._emit(
                ToolCallStarted(turn_index=run.turn_index, call_id=call_id, name=name, arguments=arguments)
            )

        def finished(result: ToolExecution) -> None:
            if run.mode == "turn":
                self._resolved(run, pending, result)
            outcome = SessionToolOutcome(text=result.text, ok=result.ok)
            if not ctx.done:
                ctx.reply(outcome)

        if run.mode == "summary":
            finished(ToolExecution(ok=False, text=SUMMARY_TOOL_DESCRIPTION))
            return DEFER
        if run.mode == "judge":
            if isinstance(call, ToolCall) and run.verdict is None:
                run.verdict = dict(call.arguments)
            finished(ToolExecution(ok=True, text="verdict recorded"))
            return DEFER
        if isinstance(call, ToolCallError):
            finished(ToolExecution(ok=False, text=f"invalid tool call: {call}"))
            return DEFER
        if self._journal is not None:
            try:  # write-ahead: the call is on disk before the host can run it
                self._journal.tool_call(run.turn_index, run.steps, pending)
            except OSError as exc:
                finished(
                    ToolExecution(ok=False, text=f"not run: the session journal cannot be written ({exc})")
                )
                return DEFER

        def executed(reply: Reply) -> None:
            error = reply.error
            if error is None and isinstance(reply.message, ToolExecution):
                self._after_tool(pending, reply.message, finished)
            elif error is None:
                finished(
                    ToolExecution(ok=False, text=f"the tool host answered {type(reply.message).__name__}")
                )
            elif isinstance(error, NotDelivered):  # nothing ran: the model may try again
                finished(
                    ToolExecution(
                        ok=False, text=f"not run: the tool host cannot be reached ({error.message})"
                    )
                )
            elif isinstance(error, Unavailable | Expired):  # the call left: its outcome is unknown
                run.suspended, run.suspended_call = error, pending
                self._log_suspended(run, pending, error)
                if not ctx.done:
                    ctx.fail(error)
            else:
                finished(ToolExecution(ok=False, text=f"the tool host failed: {error}"))

        def permitted(decision: Any) -> None:
            if decision.behavior != "allow":  # PH-02: a denied call never reaches the host (nor runs here)
                finished(ToolExecution(ok=False, text=denial_text(decision.reason)))
                return
            arguments = merge_input(call.arguments, decision.updated_input)
            local = self._local_tool(name, dict(arguments), pending.key)  # the loops' own tools
            if isinstance(local, ToolExecution):
                finished(local)
                return
            if local is not None:
                local(finished)
                return
            self.ask(
                self.config.host,
                ExecuteTool(name=name, arguments=arguments, idempotency_key=pending.key),
                executed,
                timeout=self.config.tool_timeout,
            )

        self._permit(pending, dict(call.arguments), permitted)  # PH-01: before the tool runs
        return DEFER

    def _resolved(self, run: KernelRun, call: PendingCall, result: ToolExecution) -> None:
        """A call of the running turn has its result: the call and its result enter the turn together, so
        the transcript never holds a call without its result."""
        self._add(
            run,
            Message.assistant(
                call.text, (MessageToolCall(id=call.call_id, name=call.name, arguments=call.arguments),)
            ),
        )
        self._add(run, Message.tool(call.call_id, result.text, is_error=not result.ok))
        self._emit(
            ToolCallFinished(
                turn_index=run.turn_index,
                call_id=call.call_id,
                name=call.name,
                ok=result.ok,
                text=result.text,
            )
        )

    def _log_suspended(self, run: KernelRun, call: PendingCall, error: BaseException) -> None:
        log.warning(
            "%s: turn %d suspended: the outcome of %s (%s) is unknown: %r",
            self.address,
            run.turn_index,
            call.name,
            call.key,
            error,
        )
