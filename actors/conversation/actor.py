"""``ConversationActor``: the session-loop actor that hosts one ``ConversationRuntime`` (RULES.md 9, MB-03).

It owns the transcript and runs commands one at a time in arrival order (a FIFO of stashed requests),
while queries (``GetTranscript``, ``GetStatus``) and controls (``SetInterruptToken``, ``CancelToken``) are
answered at once, mid-turn included: the actor never blocks its mailbox.

Each turn, and each compaction's summary, is a kernel run (kernel.py): one ``run_session`` over the Router
with this actor as its ``SessionHost``.

The session file is a write-ahead journal (journal.py): a turn's user message is on disk before the turn's
first model request, each tool call before it is sent, the turn's end before its caller hears of it. Resumed
from a file whose last turn has no end, the conversation holds that turn as *interrupted*: ``ContinueTurn``
goes on with it (asking the tool host again by each call's idempotency key), any other transcript command
first closes it, its unknown outcomes kept in the transcript as such.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pykka

import actors.conversation.compaction as compaction
from actors.base import DEFER, Context, HostPool
from actors.conversation.gatekeeper import INTERRUPTED, NOT_MINE, PEOPLE_COMMANDS, Gatekeeper
from actors.conversation.jobs import JobsMixin
from actors.conversation.journal import InterruptedTurn, Journal, PendingCall, placeholders, read_journal
from actors.conversation.kernel import (
    CONVERSATION_HOSTS,
    HOST_TIMEOUT,
    SUMMARY_TOOL_DESCRIPTION,
    ConversationConfig,
    KernelHost,
    KernelRun,
    line_of,
    render_input,
)
from actors.conversation.loops import LoopsMixin
from actors.conversation.messages import (
    BindCheckpoints,
    BindSink,
    CancelToken,
    ClearGoal,
    CloseSession,
    CompactNow,
    CompactPartialAfter,
    CompactPartialBefore,
    ContinueTurn,
    ConversationError,
    EnableCheckpoints,
    EnqueueResult,
    EnqueueText,
    ExecuteTool,
    GetGoal,
    GetStatus,
    GetTranscript,
    HostRestoreCheckpoint,
    JobDone,
    ListTools,
    MaybeCompact,
    RegisterJobTools,
    RegisterWakeupTool,
    RestoreCheckpoint,
    RunGoalLoop,
    RunLoop,
    RunTurn,
    SetEventSink,
    SetGoal,
    SetInterruptToken,
    SetLlm,
    SetSessionId,
    SetTranscript,
    SlotSchedule,
    SlotTake,
    StatusReply,
    ToolList,
    TranscriptReply,
    TruncateTranscript,
    WithdrawEnqueued,
)
from actors.conversation.people import GateActor
from actors.conversation.permissions import denial_text, merge_input
from actors.conversation.shadow import RestoreReport
from actors.conversation.timers import conversation_mailbox
from actors.conversation.tools import ToolExecution, ToolSpec, describe_tools, offered_tools
from actors.conversation.types import (
    ChatTokenUsage,
    CompactionBoundary,
    CompactionTrigger,
    FinishReason,
    Message,
    MessageAppended,
    MessageToolCall,
    RuntimeOutcome,
    SessionEnd,
    TurnFinished,
    WakeupCancelled,
)
from actors.conversation.wakeups import WakeupsMixin
from actors.router.messages import ResolveModel, TurnTextDelta
from actors.runs.session import (
    HostCompleteCapture,
    HostCompleteRound,
    HostExecuteTool,
    HostPrepareResume,
    HostPrepareRound,
    HostRecord,
    HostRunTool,
)
from transport.errors import Expired, NotDelivered, ProtocolError, Unavailable
from transport.messages import Ok
from transport.node import Node
from transport.pending import Reply

log = logging.getLogger(__name__)

__all__ = ["ConversationActor", "ConversationConfig"]


# ------------------------------------------------------------------------------------------ states


@dataclass
class _Command:
    message: Any
    ctx: Context


@dataclass(frozen=True)
class _HooksDone:
    ctx: Context


# Commands that change the transcript: an interrupted turn is closed before any of them runs.
CONVERSATION_TRANSCRIPT_COMMANDS = (
    RunTurn,
    RunGoalLoop,
    RunLoop,
    EnqueueText,
    MaybeCompact,
    CompactNow,
    CompactPartialBefore,
    CompactPartialAfter,
    SetTranscript,
    TruncateTranscript,
    RestoreCheckpoint,
)


class ConversationActor(Gatekeeper, JobsMixin, WakeupsMixin, LoopsMixin, KernelHost):
    def __init__(self, node: Node, address: str, *, config: ConversationConfig) -> None:
        super().__init__(node, address, config=config)
        self._model = config.model
        self._sink = config.sink
        self._session_id = config.session_id
        self._compactor = config.compactor
        self._transcript: list[Message] = []
        self._turn_index = 0
        self._waiting: deque[_Command] = deque()
        self._current: _Command | None = None
        self._draining = False
        self._closed = False
        self._token: str | None = None
        self._cancelled: set[str] = set()
        self._interrupted: InterruptedTurn | None = None
        self._checkpoints_enabled = False  # CK-01: True once a BindCheckpoints succeeded
        self._people_init(None)
        path = config.session_file
        restored = None
        if path is not None:
            restored = read_journal(path) if config.resume and path.exists() else None
            journal = Journal(path, truncate=not config.resume, sync=config.journal_sync)
            if restored is not None:
                self._transcript = list(restored.transcript)
                self._turn_index = restored.turn_index
                self._interrupted = restored.interrupted
            self._people_init(restored.people if restored is not None else None)
            if restored is not None and restored.conversation_id is not None:
                self._conversation_id = restored.conversation_id
            else:
                journal.session(self._conversation_id)
            self._journal = journal
        self._init_loops(restored.loops if restored is not None else None)
        self._init_wakeups(restored.loops if restored is not None else None)
        self._init_jobs(restored.loops if restored is not None else None)
        self._start_gates()  # before build() returns: the gates answer from the start

    # ------------------------------------------------------------------------------- dispatch
    def handle(self, message: Any, ctx: Context) -> Any:
        answer = self._people_handle(message, ctx)  # permission asks, plan gates, todos, kernel (at once)
        if answer is not NOT_MINE:
            return answer
        if isinstance(message, PEOPLE_COMMANDS):
            self._waiting.append(_Command(message, ctx))
            self._drain()
            return DEFER
        match message:
            # queries and controls: at once (MB-03)
            case GetTranscript(tail=tail):
                if tail is None:
                    return TranscriptReply(messages=tuple(self._transcript))
                if tail < 0:
                    raise ConversationError("transcript_tail needs n >= 0")
                return TranscriptReply(messages=tuple(self._transcript[-tail:]) if tail else ())
            case GetStatus():
                return StatusReply(
                    queue_len=sum(isinstance(c.message, EnqueueText) for c in self._waiting),
                    turn_index=self._turn_index,
                    busy=self._current is not None,
                    model=self._model,
                    session_id=self._session_id,
                    event_sink=self._sink,
                    transcript_len=len(self._transcript),
                    closed=self._closed,
                    interrupted_turn=self._interrupted.turn_index if self._interrupted is not None else None,
                    checkpoints_enabled=self._checkpoints_enabled,
                )
            case SetInterruptToken(token_id=token_id, cancelled=cancelled):
                self._token = token_id
                if cancelled:
                    self._cancelled.add(token_id)
                    self._interrupt()
                    self._wake_interrupted()
                    self._end_people_waits(INTERRUPTED)
                return None
            case GetGoal() | SetGoal() | RegisterWakeupTool() | SlotSchedule() | SlotTake():
                return self._loop_control(message)
            case ClearGoal():
                self._clear_goal("cleared")
                return None
            case RegisterJobTools():
                if message.output_cap < 1 or message.timeout_s <= 0:
                    raise ConversationError("register_job_tools needs output_cap >= 1 and timeout_s > 0")
                self._job_tools = message
                return None
            case JobDone(job=job):
                self._job_done(job)
                return None
            case WithdrawEnqueued(ticket=ticket):
                for command in list(self._waiting):
                    m = command.message
                    if isinstance(m, EnqueueText) and m.ticket == ticket and ticket:
                        self._waiting.remove(command)
                        if not command.ctx.done:
                            command.ctx.reply(EnqueueResult(outcome=None))
                return None
            case CancelToken(token_id=token_id):
                self._cancelled.add(token_id)
                if token_id == self._token and self._run is not None:
                    self._log(logging.INFO, "interrupt requested; stopping the running turn")
                    self._interrupt()
                if token_id == self._token:
                    self._wake_interrupted()
                    self._end_people_waits(INTERRUPTED)  # a wait for a person ends too
                return None
            # the session loop's host calls and the handle's streamed text
            case TurnTextDelta():
                self._text_delta(message, ctx)
                return None
            case (
                HostPrepareRound()
                | HostRecord()
                | HostExecuteTool()
                | HostRunTool()
                | HostPrepareResume()
                | HostCompleteRound()
                | HostCompleteCapture()
            ):
                return self._host_call(message, ctx)
            # commands: one at a time, in arrival order
            case (
                RunTurn()
                | ContinueTurn()
                | EnqueueText()
                | MaybeCompact()
                | CompactNow()
                | CompactPartialBefore()
                | CompactPartialAfter()
                | SetTranscript()
                | TruncateTranscript()
                | CloseSession()
                | SetLlm()
                | SetEventSink()
                | SetSessionId()
                | EnableCheckpoints()
                | RestoreCheckpoint()
                | RunGoalLoop()
                | RunLoop()
            ):
                self._waiting.append(_Command(message, ctx))
                self._drain()
                if isinstance(message, CloseSession):
                    self._wake_closing()  # a sleeping wakeup loop ends now: the session is over
                return DEFER
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def on_start(self) -> None:
        super().on_start()
        self._people_started()
        if self._sink is not None:  # the builder's sink is the sink-holding tools' too (ES-02)

            def bound(reply: Reply) -> None:
                if reply.error is not None:
                    self._log(logging.WARNING, "binding the tools to the event sink failed: %r", reply.error)

            self.ask(self.config.host, BindSink(address=self._sink), bound, timeout=HOST_TIMEOUT)
        self._reconcile_jobs()

    def on_local(self, message: Any) -> Any:
        message = conversation_mailbox(self.node, self.address, message)  # recorded, or served on a replay
        if self._people_local(message):
            return None
        if isinstance(message, _HooksDone):
            self._done(message.ctx, None)
            return None
        if self._loop_local(message):
            return None
        return super().on_local(message)

    def on_stop(self) -> None:
        while self._waiting:  # QU-04: enqueued messages that never ran resolve to None
            command = self._waiting.popleft()
            if isinstance(command.message, EnqueueText) and not command.ctx.done:
                command.ctx.reply(EnqueueResult(outcome=None))
        self._stop_gates()
        if self._journal is not None:
            self._journal.close()
        self._close_wakeups()
        super().on_stop()

    # ---------------------------------------------------------------------------------- helpers
    def _log(self, level: int, msg: str, *args: Any, **fields: Any) -> None:
        """A log record of this session: ``session_id`` once set (SID-01/SID-02), plus ``fields``."""
        extra = {"session_id": self._session_id, **fields} if self._session_id is not None else fields
        log.log(level, "%s: " + msg, self.address, *args, extra=extra or None)

    def _emit(self, event: Any) -> None:
        """An event for the sink (the journal is written separately, ahead of what it records)."""
        if self._sink is not None:
            self.tell_to(self._sink, event)

    def _write(self, what: str, write: Callable[[Journal], None]) -> None:
        """A journal record that must be on disk before anyone acts on it: ``ConversationError`` if not."""
        if self._journal is None:
            return
        try:
            write(self._journal)
        except OSError as exc:
            log.exception("%s: cannot write the session file", self.address)
            raise ConversationError(f"the session file cannot be written ({what}): {exc}") from exc

    def ask(self, dst: str, message: Any, then: Callable[[Reply], None], **kwargs: Any) -> bytes:
        """``BusActor.ask`` whose continuation, should it raise (a bug), fails the running command instead
        of leaving its caller waiting until the deadline."""

        def guarded(reply: Reply) -> None:
            try:
                then(reply)
            except Exception as exc:
                log.exception("%s: continuation for %s raised", self.address, type(message).__name__)
                current = self._current
                if current is not None:
                    self._run = None
                    self._done(current.ctx, exc)

        return super().ask(dst, message, guarded, **kwargs)

    def _append(self, message: Message) -> None:
        """A message a command adds outside a turn (a restore's notice): journaled, then told to the sink."""
        index = len(self._transcript)
        self._write("a message", lambda j: j.appended(index, message, durable=True))
        self._transcript.append(message)
        self._emit(MessageAppended(message=message, index=index))

    def _cancel_requested(self) -> bool:
        return self._token is not None and self._token in self._cancelled

    # --------------------------------------------------------------------------------- commands
    def _drain(self) -> None:
        if self._draining:  # a command that finished synchronously: the outer loop goes on
            return
        self._draining = True
        try:
            while self._current is None and self._waiting:
                command = self._waiting.popleft()
                if command.ctx.done:
                    continue
                self._current = command
                try:
                    self._start(command)
                except Exception as exc:
                    if self._current is command:
                        self._done(command.ctx, exc)
                    else:
                        log.exception("%s: command failed after it finished", self.address)
        finally:
            self._draining = False

    def _done(self, ctx: Context, result: Any) -> None:
        """Answer the current command (an exception fails it) and start the next one."""
        if not ctx.done:
            if isinstance(result, BaseException):
                ctx.fail(result)
            else:
                ctx.reply(Ok() if result is None else result)
        if self._current is not None and self._current.ctx is ctx:
            self._current = None
        self._drain()

    def _start(self, command: _Command) -> None:
        ctx = command.ctx
        if isinstance(command.message, CONVERSATION_TRANSCRIPT_COMMANDS):
            self._close_interrupted()
        if self._people_command(command.message):
            self._done(ctx, None)
            return
        match command.message:
            case ContinueTurn():
                self._continue_turn(ctx)
            case RunTurn(text=text) | EnqueueText(text=text):
                wrap = isinstance(command.message, EnqueueText)

                def answer(result: Any) -> None:
                    if wrap and isinstance(result, RuntimeOutcome):
                        result = EnqueueResult(outcome=result)
                    self._done(ctx, result)

                self._start_turn(text, answer)
            case RunGoalLoop():
                self._goal_loop(command.message, ctx)
            case RunLoop():
                self._wake_loop(command.message, ctx)
            case MaybeCompact(usage=usage):
                self._maybe_compact(usage, lambda error: self._done(ctx, error))
            case CompactNow():
                self._compact_full("manual", None, lambda error: self._done(ctx, error))
            case CompactPartialBefore(pivot_index=p):
                self._compact_before(p, lambda error: self._done(ctx, error))
            case CompactPartialAfter(pivot_index=p):
                self._compact_after(p, lambda error: self._done(ctx, error))
            case SetTranscript(messages=messages):
                self._write("set_transcript", lambda j: j.replaced(messages))
                self._transcript = list(messages)
                self._done(ctx, None)
            case TruncateTranscript(length=length):
                if length < 0:
                    raise ConversationError(f"truncate_transcript needs a length >= 0, not {length}")
                if length < len(self._transcript):
                    self._write("truncate_transcript", lambda j: j.truncated(length))
                    del self._transcript[length:]
                self._done(ctx, None)
            case CloseSession(last_outcome=last):
                self._close(last, ctx)
            case SetLlm(model=model):
                self._set_llm(model, ctx)
            case SetEventSink(address=address, rebind_tools=rebind):
                self._sink = address
                if not rebind:
                    self._done(ctx, None)
                else:

                    def bound(reply: Reply) -> None:
                        if reply.error is None:  # TodoUpdated follows the tools' sink (ES-02/ES-03)
                            self._tool_sink = address
                        self._done(ctx, reply.error)

                    self.ask(self.config.host, BindSink(address=address), bound, timeout=HOST_TIMEOUT)
            case SetSessionId(session_id=session_id):
                self._session_id = session_id
                self._done(ctx, None)
            case EnableCheckpoints():
                self._enable_checkpoints(command.message, ctx)
            case RestoreCheckpoint(checkpoint_id=checkpoint_id):
                self._restore_checkpoint(checkpoint_id, ctx)

    def _set_llm(self, model: str, ctx: Context) -> None:
        def resolved(reply: Reply) -> None:
            if reply.error is None:
                self._model = model
            self._done(ctx, reply.error)

        self.ask(self.config.router, ResolveModel(requested=model), resolved)

    def _close(self, last: RuntimeOutcome | None, ctx: Context) -> None:
        if self._closed:  # CL-02
            self._done(ctx, None)
            return
        self._closed = True
        for slot in list(self._slots):  # closing cancels pending wakeups

            def cancelled(journal: Journal, slot: str = slot) -> None:
                journal.loop_record("wakeup_cancelled", slot=slot, reason="closed")

            self._write("a wakeup's cancel", cancelled)
            del self._slots[slot]
            self._emit(WakeupCancelled(slot=slot, reason="closed"))
        self._stop_jobs(lambda: self._close_hooks(last, ctx))  # closing ends the jobs' process groups

    def _close_hooks(self, last: RuntimeOutcome | None, ctx: Context) -> None:
        event = SessionEnd(session_id=self._session_id, last_outcome=last)
        self._forward("SessionEnd", {"hook_event_name": "SessionEnd", "session_id": self._session_id}, None)
        hooks = self.config.hooks
        self._log(logging.INFO, "session end (%d hook(s))", len(hooks))
        if not hooks:
            self._done(ctx, None)
            return
        ref = self.actor_ref

        def fire() -> None:  # off the actor thread: queries stay answered while hooks run (CL-04)
            for hook in hooks:
                try:
                    hook(event)
                except Exception:
                    log.exception("SessionEnd hook %r raised", hook)
            try:
                ref.tell(_HooksDone(ctx))
            except pykka.ActorDeadError:
                log.info("the conversation stopped while its SessionEnd hooks ran")

        threading.Thread(target=fire, name=f"{self.name}-session-end", daemon=True).start()

    # ------------------------------------------------------------------------------- checkpoints
    def _enable_checkpoints(self, m: EnableCheckpoints, ctx: Context) -> None:
        def bound(reply: Reply) -> None:
            if reply.error is None:
                self._checkpoints_enabled = True
            self._done(ctx, reply.error)

        bind = BindCheckpoints(
            shadow=m.shadow,
            session_id=m.session_id,
            log_path=m.log_path,
            touched_slot=m.touched_slot,
            restore_tool=m.restore_tool,
        )
        self.ask(self.config.host, bind, bound, timeout=HOST_TIMEOUT)

    def _restore_checkpoint(self, checkpoint_id: str, ctx: Context) -> None:
        def restored(reply: Reply) -> None:
            if reply.error is None and isinstance(reply.message, RestoreReport):
                self._append(Message.system(reply.message.text))  # the model is told, from its next turn on
                self._done(ctx, reply.message)
            else:
                self._done(ctx, reply.error or ConversationError("the tool host did not restore"))

        restore = HostRestoreCheckpoint(checkpoint_id=checkpoint_id)
        self.ask(self.config.host, restore, restored, timeout=HOST_TIMEOUT)

    # ------------------------------------------------------------------------------------ turns
    def _start_turn(self, text: str, answer: Callable[[Any], None], *, goal: str | None = None) -> None:
        """One turn; ``answer(outcome or error)`` when it ends (a command's reply, or a loop's next step).
        ``goal``: the id of the goal loop the turn belongs to (journaled with it, so a resume counts it)."""
        index = self._turn_index
        user = Message.user(text)
        user_at = len(self._transcript)
        # before any effect
        self._write("the user message", lambda j: j.turn_started(index, user_at, user, goal=goal))
        self._turn_index += 1  # CV-05: a turn counts once started
        self._transcript.append(user)  # CV-01 (its event follows the turn, CV-09)
        self._forward("UserPromptSubmit", {"hook_event_name": "UserPromptSubmit", "prompt": text}, None)
        self._log(
            logging.INFO,
            "turn %d started (model %s)",
            index,
            self._model,
            span="conversation.turn",
            turn_index=index,
        )

        if self._cancel_requested():  # IT-04: the first boundary comes before any model call
            run = KernelRun("turn", "", self._model, "", "", turn_index=index, finish=FinishReason.CANCELLED)
            self._finish_turn(run, user_at, answer)
            return

        def listed(reply: Reply) -> None:
            if reply.error is not None:
                self._fail_turn(user_at, reply.error, answer)
                return
            specs: tuple[ToolSpec, ...] = reply.message.specs if isinstance(reply.message, ToolList) else ()
            if isinstance(reply.message, ToolList):
                self._tools_listed(reply.message.mutating, {spec.name for spec in specs})
            run = KernelRun(
                "turn",
                "",
                self._model,
                render_input(self.config.system_prompt, self._transcript),
                describe_tools((*specs, *self._local_specs())),
                turn_index=index,
                base=len(self._transcript),
                tools=offered_tools((*specs, *self._local_specs())),
            )
            self._kernel(run, lambda error: self._turn_ran(run, user_at, error, answer))

        self.ask(self.config.host, ListTools(), listed, timeout=self.config.tool_timeout)

    # ------------------------------------------------------------------------ interrupted turns
    def _close_interrupted(self) -> None:
        """Move on from an interrupted turn without continuing it: its unknown-outcome placeholders (already
        in the transcript) are journaled, and the turn is closed."""
        it = self._interrupted
        if it is None:
            return
        messages = self._transcript[it.length : it.length + 2 * len(it.pending)]

        def write(journal: Journal) -> None:
            for offset, message in enumerate(messages):
                journal.appended(it.length + offset, message)
            journal.closed(it.turn_index, "interrupted")

        self._write("closing the interrupted turn", write)
        self._interrupted = None

    def _continue_turn(self, ctx: Context) -> None:
        it = self._interrupted
        if it is None:
            raise ConversationError("there is no interrupted turn to continue")
        self._interrupted = None
        del self._transcript[it.length :]  # the placeholders: each call is asked again below
        pending = list(it.pending)
        self._log(logging.INFO, "continuing turn %d (%d call(s) to settle)", it.turn_index, len(pending))

        def suspended(error: BaseException, call: PendingCall) -> None:
            """The host could not settle a call: the turn stays interrupted, as it was."""
            rest = (call, *pending)
            self._interrupted = InterruptedTurn(
                it.turn_index, it.user_at, it.steps, rest, len(self._transcript)
            )
            self._transcript.extend(placeholders(rest))
            self._done(ctx, error)

        def settle() -> None:
            if not pending:
                self._resume_kernel(it, ctx)
                return
            call = pending.pop(0)

            def executed(reply: Reply) -> None:
                error = reply.error
                if isinstance(error, NotDelivered | Unavailable | Expired):
                    suspended(error, call)
                    return
                if error is None and isinstance(reply.message, ToolExecution):
                    self._after_tool(call, reply.message, record)
                else:
                    record(ToolExecution(ok=False, text=f"the tool host failed: {error or reply.message}"))

            def record(result: ToolExecution) -> None:
                settled = [
                    Message.assistant(
                        call.text,
                        (MessageToolCall(id=call.call_id, name=call.name, arguments=call.arguments),),
                    ),
                    Message.tool(call.call_id, result.text, is_error=not result.ok),
                ]
                for message in settled:
                    self._transcript.append(message)
                    if self._journal is not None:
                        self._journal.appended(len(self._transcript) - 1, message)
                settle()

            def permitted(decision: Any) -> None:  # the same permission layer, by the same key
                if decision.behavior != "allow":
                    record(ToolExecution(ok=False, text=denial_text(decision.reason)))
                    return
                arguments = merge_input(json.loads(call.arguments), decision.updated_input)
                local = self._local_tool(call.name, dict(arguments), call.key)  # by the same key
                if isinstance(local, ToolExecution):
                    record(local)
                    return
                if local is not None:
                    local(record)
                    return
                self.ask(
                    self.config.host,
                    ExecuteTool(name=call.name, arguments=arguments, idempotency_key=call.key),
                    executed,
                    timeout=self.config.tool_timeout,
                )

            self._permit(call, json.loads(call.arguments), permitted)

        settle()

    def _resume_kernel(self, it: InterruptedTurn, ctx: Context) -> None:
        """The interrupted turn's calls are settled: the model goes on from the transcript as it is."""

        def answer(result: Any) -> None:
            self._done(ctx, result)

        def listed(reply: Reply) -> None:
            if reply.error is not None:  # nothing of the continuation ran: the turn stays interrupted
                self._interrupted = InterruptedTurn(
                    it.turn_index, it.user_at, it.steps, (), len(self._transcript)
                )
                answer(reply.error)
                return
            specs: tuple[ToolSpec, ...] = reply.message.specs if isinstance(reply.message, ToolList) else ()
            if isinstance(reply.message, ToolList):
                self._tools_listed(reply.message.mutating, {spec.name for spec in specs})
            run = KernelRun(
                "turn",
                "",
                self._model,
                render_input(self.config.system_prompt, self._transcript),
                describe_tools((*specs, *self._local_specs())),
                turn_index=it.turn_index,
                steps=it.steps,
                base=len(self._transcript),
                tools=offered_tools((*specs, *self._local_specs())),
            )
            self._kernel(run, lambda error: self._turn_ran(run, it.user_at, error, answer))

        self.ask(self.config.host, ListTools(), listed, timeout=self.config.tool_timeout)

    def _turn_ran(
        self, run: KernelRun, user_at: int, error: BaseException | None, answer: Callable[[Any], None]
    ) -> None:
        if run.suspended is not None and run.suspended_call is not None:
            self._suspend_turn(run, user_at, (run.suspended_call,), run.suspended, answer)
        elif isinstance(error, NotDelivered | Unavailable | Expired) and (
            run.steps or run.new or run.base > user_at + 1
        ):
            # The Router (or the loop) was lost once the turn had done something (or it continues one that
            # had): what the model was doing is unknown, what the tools did is known. Keep it, and let
            # continue_turn go on.
            self._suspend_turn(run, user_at, (), error, answer)
        elif error is not None:
            # The tool calls that completed stay with their results: they ran, and a caller retrying the
            # turn must not have the model run them again (CV-10 keeps "nothing of the kernel's" otherwise).
            self._transcript.extend(m for m in run.new if m.role == "tool" or m.tool_calls)
            self._fail_turn(user_at, error, answer, kept=len(self._transcript))
        else:
            self._finish_turn(run, user_at, answer)

    def _suspend_turn(
        self,
        run: KernelRun,
        user_at: int,
        pending: tuple[PendingCall, ...],
        error: BaseException,
        answer: Callable[[Any], None],
    ) -> None:
        """The turn's outcome became unknown part-way (a tool host or the Router was lost after a request
        left): its completed steps stay, a call in flight is shown with an unknown outcome, and the turn stays
        open for ``continue_turn``, exactly as a resume after a crash would find it; the caller gets the
        transport error (``Unavailable`` or ``Expired``) that says so."""
        self._transcript.extend(run.new)
        self._interrupted = InterruptedTurn(
            run.turn_index, user_at, run.steps, pending, len(self._transcript)
        )
        self._transcript.extend(placeholders(pending))
        self._log(logging.WARNING, "turn %d suspended: %r", run.turn_index, error)
        answer(error)

    def _fail_turn(
        self, user_at: int, error: BaseException, answer: Callable[[Any], None], *, kept: int | None = None
    ) -> None:
        """CV-10: the user message stays (and is persisted), and of the kernel's messages only the tool calls
        that completed, each with its result (``kept``: the transcript's length with them): they ran, and a
        rerun of the turn must see them, or its model would run them again. Partial text is dropped. The
        turn still counts (CV-05): the session file says so for a resume."""
        keep = max(user_at + 1, kept or 0)
        del self._transcript[keep:]
        for i in range(user_at, keep):
            self._emit(MessageAppended(message=self._transcript[i], index=i))
        if self._journal is not None:
            try:
                self._journal.failed(self._turn_index - 1, f"{type(error).__name__}: {error}"[:500], keep)
            except OSError:
                log.exception("%s: cannot write the session file", self.address)
        self._log(logging.WARNING, "turn failed: %r", error)
        answer(error)

    def _finish_turn(self, run: KernelRun, user_at: int, answer: Callable[[Any], None]) -> None:
        for (
            note
        ) in self._take_rejections():  # PG-04: after the turn's messages, never between a call and result
            self._add(run, Message.user(note))
        self._transcript.extend(run.new)  # CV-02, in kernel order
        usage = ChatTokenUsage.from_token_usage(run.usage)
        outcome = RuntimeOutcome(
            finish_reason=run.finish,
            final_text=run.final or "",
            new_messages=len(run.new),
            steps=run.steps,
            usage=usage,
            turn_index=run.turn_index,
        )
        if self._journal is not None:
            try:  # durable before the caller hears of the turn (and before a compaction rewrites it)
                self._journal.finished(run.turn_index, run.finish, usage)
            except OSError:
                log.exception("%s: cannot write the session file", self.address)
        for i in range(user_at, len(self._transcript)):  # CV-09
            self._emit(MessageAppended(message=self._transcript[i], index=i))

        def compacted(error: BaseException | None) -> None:
            if error is not None:  # CV-11: logged, never discards the outcome
                self._log(logging.WARNING, "cross-turn compaction failed: %r", error)
            self._emit(TurnFinished(turn_index=run.turn_index, finish_reason=run.finish, usage=usage))
            stop = {"hook_event_name": "Stop", "turn_index": run.turn_index, "finish_reason": str(run.finish)}
            self._forward("Stop", stop, None)
            self._log(
                logging.INFO,
                "turn %d finished: %s",
                run.turn_index,
                run.finish,
                span="conversation.turn",
                turn_index=run.turn_index,
                finish_reason=str(run.finish),
            )
            answer(outcome)

        self._maybe_compact(usage, compacted)  # CV-11

    # ------------------------------------------------------------------------------- compaction
    def _maybe_compact(self, usage: ChatTokenUsage, then: Callable[[BaseException | None], None]) -> None:
        compactor = self._compactor
        if compactor is None:  # CP-01
            then(None)
            return
        trigger = compaction.cross_turn_trigger(compactor, self._transcript, usage)
        if trigger is None:
            then(None)
            return
        self._compact_full(trigger, usage, then)

    def _compact_full(
        self,
        trigger: CompactionTrigger,
        usage: ChatTokenUsage | None,
        then: Callable[[BaseException | None], None],
    ) -> None:
        compactor = self._compactor
        if compactor is None or len(self._transcript) < compactor.keep_recent_n + 2:  # CP-01, CP-09
            then(None)
            return
        s = compaction.safe_split_point(self._transcript, compactor.keep_recent_n)  # CP-10
        if s == 0:
            then(None)
            return
        self._summarize(trigger, 0, s, usage, then)

    def _compact_before(self, pivot: int, then: Callable[[BaseException | None], None]) -> None:
        compactor = self._compactor
        if compactor is None:
            then(None)
            return
        s = compaction.partial_before_split(self._transcript, pivot, compactor.keep_recent_n)  # CP-13/14
        if s == 0:
            then(None)
            return
        self._summarize("partial_before", 0, s, None, then)

    def _compact_after(self, pivot: int, then: Callable[[BaseException | None], None]) -> None:
        if self._compactor is None:
            then(None)
            return
        b = compaction.partial_after_boundary(self._transcript, pivot)  # CP-15/16
        if b is None:
            then(None)
            return
        self._summarize("partial_after", b, len(self._transcript), None, then)

    def _summarize(
        self,
        trigger: CompactionTrigger,
        start: int,
        end: int,
        usage: ChatTokenUsage | None,
        then: Callable[[BaseException | None], None],
    ) -> None:
        """Summarize ``transcript[start:end]`` with the session's model; swap it in atomically (CP-17)."""
        compactor = self._compactor
        assert compactor is not None
        before = list(self._transcript)
        part = before[start:end]
        text = compactor.instructions + "\n\n" + "\n".join(line_of(m) for m in part)
        run = KernelRun("summary", "", self._model, text, SUMMARY_TOOL_DESCRIPTION)

        def summarized(error: BaseException | None) -> None:
            refused = (
                None
                if error is not None
                else compaction.summary_refusal(run.final or "", compactor.instructions)
            )
            if refused is not None:  # CP-17: nothing replaced, nothing emitted
                error = ConversationError(f"{refused}: refused, the {len(before)} messages are kept")
            if error is not None:
                then(error if isinstance(error, ConversationError) else _wrap(error))
                return
            if self._transcript != before:  # cannot happen: commands run one at a time
                then(ConversationError("the transcript changed during compaction"))
                return
            summary = Message.system(
                f"Summary of {len(part)} earlier message(s):\n{(run.final or '').strip()}"
            )
            todo = self._todo_message()  # the current todo list goes back into the model's context
            compacted = [*before[:start], summary, *([todo] if todo else []), *before[end:]]
            boundary = CompactionBoundary(
                trigger=trigger,
                summarized_count=len(part),
                kept_count=len(before) - len(part),
                prompt_tokens=usage.prompt_tokens if usage is not None else None,
                cache_hit_tokens=usage.cache_hit_tokens if usage is not None else None,
                cache_miss_tokens=usage.cache_miss_tokens if usage is not None else None,
            )
            try:  # one record: a crash keeps the old transcript or the new one, never half of each
                self._write("the compaction", lambda j: j.compacted(boundary, compacted))
            except ConversationError as exc:
                then(exc)
                return
            self._transcript = compacted
            self._emit(boundary)
            for i, m in enumerate(self._transcript):  # CP-06: summary and every kept message
                self._emit(MessageAppended(message=m, index=i))
            self._log(logging.INFO, "compacted %d message(s) (%s)", len(part), trigger)
            then(None)

        self._kernel(run, summarized)

    # ------------------------------------------------------------------------------- plan gates
    def _gate_names(self) -> tuple[str, str]:
        return f"{self.name}.plan_gate", f"{self.name}.plan_mode_gate"

    def _start_gates(self) -> None:
        """The plan gates' own addresses (PG-01): ``<conversation>.plan_gate`` and ``.plan_mode_gate``."""
        for name, kind in zip(self._gate_names(), ("plan", "mode_request"), strict=True):
            if self.node.lookup(name) is None:  # beside this conversation, on its host when it has one
                HostPool.of(self.node, CONVERSATION_HOSTS).spawn(
                    GateActor, name, conversation=self.address, kind=kind, timeout=HOST_TIMEOUT
                )

    def _stop_gates(self) -> None:
        for name in self._gate_names():
            ref = self.node.lookup(name)
            if ref is not None:
                ref.stop(block=False)


def _wrap(error: BaseException) -> ConversationError:
    wrapped = ConversationError(f"summarization failed: {error}")
    wrapped.__cause__ = error
    return wrapped
