"""``ConversationRuntime``: the facade of one conversation actor, and its builder (RULES.md 9, C.2).

Every method sends a request to the conversation actor and blocks the calling thread until the reply
(``timeout=`` bounds the wait); ``*_future`` twins return a ``concurrent.futures.Future`` instead. The facade
holds no state of the conversation: any number of facades, in any processes, may drive the same actor
(``ConversationRuntime.connect``).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pykka

from actors.base import HostPool
from actors.conversation.gatekeeper import GetKernel, GetTodos, KernelInfo, SetPlanMode
from actors.conversation.hooks import (
    GetHookStats,
    HookForwarderActor,
    HookStats,
    SdkHookForwarder,
    SetSdkHookForwarder,
)
from actors.conversation.journal import Sync
from actors.conversation.kernel import CONVERSATION_HOSTS, TOOL_HOSTS
from actors.conversation.messages import (
    ClearGoal,
    CloseSession,
    CompactNow,
    CompactPartialAfter,
    CompactPartialBefore,
    ContinueTurn,
    EnableCheckpoints,
    EnqueueText,
    GetGoal,
    GetStatus,
    GetTranscript,
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
    TranscriptReply,
    TruncateTranscript,
    WithdrawEnqueued,
)
from actors.conversation.people import PlanApprovalGate, PlanModeRequestGate, register_people_tools
from actors.conversation.permissions import (
    AnswerPermission,
    GetPendingPermissions,
    PermissionHook,
    PermissionHookActor,
    PermissionRequest,
    SetPermissionHook,
)
from actors.conversation.shadow import RestoreReport, ShadowRepo
from actors.conversation.sinks import EventSink, NullSink, RemoteSink, SinkActor
from actors.conversation.token import CancellationToken

if TYPE_CHECKING:
    from actors.conversation.checkpoints import TouchedFiles
from actors.conversation.tools import ToolRegistry
from actors.conversation.types import (
    ChatTokenUsage,
    Compactor,
    GoalState,
    Message,
    RuntimeOutcome,
    SessionEnd,
    TodoItem,
    Wakeup,
)
from transport.errors import BusError
from transport.node import Node
from transport.pending import chained, forbid_blocking

log = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # seconds ``stop`` waits for each actor it started

__all__ = ["DEFAULT_TIMEOUT", "ConversationRuntime", "ConversationRuntimeBuilder", "WakeupSlot"]

DEFAULT_TIMEOUT = 600.0  # a turn may run tools and a slow model; every call may pass its own


def _none(value: Any) -> None:
    return None


def _outcomes(reply: Any) -> list[RuntimeOutcome]:
    return list(reply.outcomes)


class WakeupSlot:
    """A conversation's wakeup slot (A.4 ``WakeupSlot``), named by ``slot_id`` (stable across restarts: pass
    the same id to a resumed runtime). The slot's value lives in the conversation actor, journaled with its
    absolute due time; this object is a handle on it, bound to a runtime by ``register_wakeup_tool`` or
    ``run_loop``. ``schedule`` replaces the value (last write wins), ``take`` reads and clears it (WK-03),
    ``peek`` reads it."""

    def __init__(self, slot_id: str | None = None) -> None:
        self.slot_id = slot_id or uuid.uuid4().hex
        self._rt: ConversationRuntime | None = None

    def bind(self, rt: ConversationRuntime) -> None:
        self._rt = rt

    def _runtime(self) -> ConversationRuntime:
        if self._rt is None:
            raise ValueError(
                "this WakeupSlot is not bound to a conversation (register_wakeup_tool or run_loop)"
            )
        return self._rt

    def schedule(self, wakeup: Wakeup, *, timeout: float | None = None) -> None:
        message = SlotSchedule(
            slot=self.slot_id, delay_s=wakeup.delay_s, prompt=wakeup.prompt, reason=wakeup.reason
        )
        self._runtime()._call(message, timeout, _none)

    def take(self, *, timeout: float | None = None) -> Wakeup | None:
        return self._runtime()._call(SlotTake(slot=self.slot_id, clear=True), timeout, lambda r: r.wakeup)  # type: ignore[no-any-return]

    def peek(self, *, timeout: float | None = None) -> Wakeup | None:
        return self._runtime()._call(SlotTake(slot=self.slot_id, clear=False), timeout, lambda r: r.wakeup)  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        return f"WakeupSlot({self.slot_id!r})"


class ConversationRuntime:
    """The stateful conversation (seed 002 ``AgentRuntime``). Build with ``ConversationRuntime.builder()``;
    reach an existing one with ``ConversationRuntime.connect(node, address)``."""

    def __init__(
        self,
        node: Node,
        address: str,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        owned: Sequence[tuple[Node, str]] = (),
    ) -> None:
        self.node = node
        self.address = address
        self.timeout = timeout
        self._owned = list(owned)  # (node, actor name) this facade started (``stop`` stops them)
        self._sinks: dict[str, EventSink] = {}  # sink actor address -> the local sink it serves
        self._gates: dict[str, PlanApprovalGate] = {}
        self._kernel: KernelInfo | None = None

    @staticmethod
    def builder() -> ConversationRuntimeBuilder:
        return ConversationRuntimeBuilder()

    @classmethod
    def connect(
        cls, node: Node, address: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> ConversationRuntime:
        """A facade on the conversation actor at ``address`` (possibly in another process)."""
        return cls(node, address, timeout=timeout)

    # ---------------------------------------------------------------------------------- plumbing
    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def _future(
        self, message: Any, timeout: float | None, convert: Callable[[Any], Any] = lambda v: v
    ) -> concurrent.futures.Future[Any]:
        inner = self.node.request_future(self.address, message, timeout=self._t(timeout))
        return chained(inner, convert)

    def _call(self, message: Any, timeout: float | None, convert: Callable[[Any], Any] = lambda v: v) -> Any:
        forbid_blocking(type(message).__name__)
        t = self._t(timeout)
        return self._future(message, timeout, convert).result(None if t is None else t + 1.0)

    # ---------------------------------------------------------------------------------- commands
    def run(self, user_text: str, *, timeout: float | None = None) -> RuntimeOutcome:
        """One turn: append ``user(user_text)``, run the model with the tools, append its messages."""
        return self._call(RunTurn(text=user_text), timeout)  # type: ignore[no-any-return]

    def run_future(self, user_text: str, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(RunTurn(text=user_text), timeout)

    def continue_turn(self, *, timeout: float | None = None) -> RuntimeOutcome:
        """Go on with the turn a resumed session shows interrupted (``interrupted_turn()``): every tool call
        it journaled without a result is asked of the tool host again by the same idempotency key (a
        finished call is not rerun; a call cut off mid-run is reported to the model as of unknown outcome),
        then the model continues. ``ConversationError`` when no turn is interrupted; ``Unavailable`` or
        ``Expired`` (the turn stays interrupted) when the tool host cannot settle a call."""
        return self._call(ContinueTurn(), timeout)  # type: ignore[no-any-return]

    def continue_turn_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(ContinueTurn(), timeout)

    def interrupted_turn(self, *, timeout: float | None = None) -> int | None:
        """The index of the turn ``continue_turn`` would go on with, or None."""
        return self.status(timeout=timeout).interrupted_turn

    def enqueue(self, text: str, *, timeout: float | None = None) -> RuntimeOutcome | None:
        """Queue ``text``; returns the outcome of the turn that ran it (FIFO with every other caller)."""
        return self._call(EnqueueText(text=text), timeout, lambda r: r.outcome)  # type: ignore[no-any-return]

    def enqueue_future(self, text: str, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        """``cancel()`` on the returned future withdraws the message if it has not started (QU-04)."""
        ticket = uuid.uuid4().hex
        future = self._future(EnqueueText(text=text, ticket=ticket), timeout, lambda r: r.outcome)
        node, address = self.node, self.address

        def withdrawn(fut: concurrent.futures.Future[Any]) -> None:
            if fut.cancelled():
                node.tell(address, WithdrawEnqueued(ticket=ticket))

        future.add_done_callback(withdrawn)
        return future

    def maybe_compact_cross_turn(self, last_usage: ChatTokenUsage, *, timeout: float | None = None) -> None:
        self._call(MaybeCompact(usage=last_usage), timeout, _none)

    def compact_now(self, *, timeout: float | None = None) -> None:
        self._call(CompactNow(), timeout, _none)

    def compact_partial_before(self, pivot_index: int, *, timeout: float | None = None) -> None:
        self._call(CompactPartialBefore(pivot_index=pivot_index), timeout, _none)

    def compact_partial_after(self, pivot_index: int, *, timeout: float | None = None) -> None:
        self._call(CompactPartialAfter(pivot_index=pivot_index), timeout, _none)

    def set_transcript(self, transcript: Sequence[Message], *, timeout: float | None = None) -> None:
        self._call(SetTranscript(messages=tuple(transcript)), timeout, _none)

    def truncate_transcript(self, length: int, *, timeout: float | None = None) -> None:
        self._call(TruncateTranscript(length=length), timeout, _none)

    def close(self, last_outcome: RuntimeOutcome | None = None, *, timeout: float | None = None) -> None:
        """Fire ``SessionEnd`` once, after every command submitted before it (CL-01..CL-05)."""
        self._call(CloseSession(last_outcome=last_outcome), timeout, _none)

    def close_future(
        self, last_outcome: RuntimeOutcome | None = None, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        return self._future(CloseSession(last_outcome=last_outcome), timeout, _none)

    # --------------------------------------------------------------------- goals and loops (loops.py)
    def run_goal_loop(
        self,
        initial_prompt: str,
        condition: str,
        max_turns: int,
        *,
        token_budget: int | None = None,
        timeout: float | None = None,
    ) -> list[RuntimeOutcome]:
        """GL-05: turns until the judge finds ``condition`` met, ``max_turns`` (or ``token_budget`` total
        tokens) is spent, or the goal is cleared; the outcomes of every turn run. On a runtime resumed from a
        session file whose goal loop on ``condition`` did not end, it continues that loop (its turn count
        kept)."""
        return self._call(  # type: ignore[no-any-return]
            RunGoalLoop(
                prompt=initial_prompt, condition=condition, max_turns=max_turns, token_budget=token_budget
            ),
            timeout,
            _outcomes,
        )

    def run_goal_loop_future(
        self,
        initial_prompt: str,
        condition: str,
        max_turns: int,
        *,
        token_budget: int | None = None,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Any]:
        message = RunGoalLoop(
            prompt=initial_prompt, condition=condition, max_turns=max_turns, token_budget=token_budget
        )
        return self._future(message, timeout, _outcomes)

    def current_goal(self, *, timeout: float | None = None) -> GoalState | None:
        """GL-01: the goal (a frozen copy) or None; answered at once, mid-turn too."""
        return self._call(GetGoal(), timeout, lambda r: r.goal)  # type: ignore[no-any-return]

    def set_goal(
        self, condition: str, max_turns: int, *, token_budget: int | None = None, timeout: float | None = None
    ) -> None:
        """GL-02/GL-04: a control, applied at once."""
        self._call(
            SetGoal(condition=condition, max_turns=max_turns, token_budget=token_budget), timeout, _none
        )

    def clear_goal(self, *, timeout: float | None = None) -> None:
        """GL-03/GL-04: a control, applied at once; a running goal loop stops after its current turn."""
        self._call(ClearGoal(), timeout, _none)

    def register_wakeup_tool(
        self, slot: WakeupSlot, *, max_delay_s: float = 7 * 24 * 3600.0, timeout: float | None = None
    ) -> None:
        """Give the model ``schedule_wakeup(delay_seconds, prompt=None)`` writing into ``slot`` (run by the
        conversation actor itself, so the wakeup is journaled before the model is told). Outside a running
        loop it answers the model an error; a delay outside [0, ``max_delay_s``] is refused."""
        slot.bind(self)
        self._call(RegisterWakeupTool(slot=slot.slot_id, max_delay_s=max_delay_s), timeout, _none)

    def register_job_tools(self, manager: Any, *, timeout: float | None = None) -> None:
        """Give the model ``start_job(command)``, ``job_status(job_id)`` and ``stop_job(job_id)`` on the
        ``BackgroundJobManager``'s runner (jobs.py): commands run in its ``workdir``; their completions wake
        ``run_event_loop``."""
        message = RegisterJobTools(
            runner=manager.address,
            workdir=manager.workdir,
            output_cap=manager.output_cap,
            timeout_s=manager.timeout_s,
        )
        self._call(message, timeout, _none)

    def run_loop(
        self, initial_goal: str, wakeup_slot: WakeupSlot, *, timeout: float | None = None
    ) -> list[RuntimeOutcome]:
        """WK-01..07: ``initial_goal`` first; then, while a turn scheduled a wakeup in ``wakeup_slot``, sleep
        until it is due (the injected clock; cut short by the interrupt token) and run its prompt."""
        wakeup_slot.bind(self)
        return self._call(  # type: ignore[no-any-return]
            RunLoop(initial_goal=initial_goal, slot=wakeup_slot.slot_id), timeout, _outcomes
        )

    def run_loop_future(
        self, initial_goal: str, wakeup_slot: WakeupSlot, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        wakeup_slot.bind(self)
        return self._future(RunLoop(initial_goal=initial_goal, slot=wakeup_slot.slot_id), timeout, _outcomes)

    def run_event_loop(
        self,
        initial_goal: str,
        wakeup_slot: WakeupSlot,
        bg_manager: Any = None,
        *,
        timeout: float | None = None,
    ) -> list[RuntimeOutcome]:
        """BG-01..07: ``run_loop`` that also wakes for each completed job of ``bg_manager`` (a
        ``BackgroundJobManager``), one job per turn, in completion order; None behaves as ``run_loop``."""
        wakeup_slot.bind(self)
        jobs = None if bg_manager is None else bg_manager.address
        message = RunLoop(initial_goal=initial_goal, slot=wakeup_slot.slot_id, jobs=jobs)
        return self._call(message, timeout, _outcomes)  # type: ignore[no-any-return]

    def run_event_loop_future(
        self,
        initial_goal: str,
        wakeup_slot: WakeupSlot,
        bg_manager: Any = None,
        *,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Any]:
        wakeup_slot.bind(self)
        jobs = None if bg_manager is None else bg_manager.address
        message = RunLoop(initial_goal=initial_goal, slot=wakeup_slot.slot_id, jobs=jobs)
        return self._future(message, timeout, _outcomes)

    # ----------------------------------------------------- configuration (applied between commands)
    def set_llm(self, model: str, *, timeout: float | None = None) -> None:
        """Use the Router model ``model`` from the next command on (never mid-turn, LLM-02)."""
        self._call(SetLlm(model=model), timeout, _none)

    def set_llm_future(self, model: str, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(SetLlm(model=model), timeout, _none)

    def _sink_address(self, sink: EventSink | None) -> str | None:
        if sink is None or isinstance(sink, NullSink):
            return None
        if isinstance(sink, RemoteSink):
            return sink.address
        for address, known in self._sinks.items():
            if known is sink:
                return address
        name = f"conversation-sink.{uuid.uuid4().hex[:12]}"
        self.node.spawn(SinkActor, name, sink=sink)
        self._owned.append((self.node, name))
        address = f"{self.node.name}/{name}"
        self._sinks[address] = sink
        return address

    def set_event_sink(self, sink: EventSink | None, *, timeout: float | None = None) -> None:
        """Send later events to ``sink`` and re-bind the sink-holding tools to it (ES-02)."""
        self._call(SetEventSink(address=self._sink_address(sink), rebind_tools=True), timeout, _none)

    def set_event_sink_future(
        self, sink: EventSink | None, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        return self._future(SetEventSink(address=self._sink_address(sink), rebind_tools=True), timeout, _none)

    def replace_event_sink(self, sink: EventSink | None, *, timeout: float | None = None) -> None:
        """Send the runtime's own events to ``sink``; sink-holding tools keep their sink (ES-03)."""
        self._call(SetEventSink(address=self._sink_address(sink), rebind_tools=False), timeout, _none)

    def set_session_id(self, session_id: str, *, timeout: float | None = None) -> None:
        self._call(SetSessionId(session_id=session_id), timeout, _none)

    def set_interrupt_token(self, token: CancellationToken, *, timeout: float | None = None) -> None:
        """Install ``token`` at once (it interrupts the current or next turn); replaces the previous one."""
        token.bind(self.node, self.address)
        self._call(SetInterruptToken(token_id=token.token_id, cancelled=token.is_cancelled()), timeout, _none)

    # ---------------------------------------------------------------------------- checkpoints
    def enable_checkpoints(
        self,
        shadow: ShadowRepo,
        session_id: str,
        log_path: str | Path,
        touched: TouchedFiles | None = None,
        *,
        restore_tool: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Bind this conversation to the checkpoint chain ``session_id`` of ``shadow`` (applied between
        commands): its tool host gets ``checkpoint_list``, ``checkpoint_diff`` and ``checkpoint_save``
        (CK-02), plus ``checkpoint_restore`` with ``restore_tool``. Nothing saves on its own (CK-03).
        ``touched``: a ``TouchedFiles`` the workspace tools record into, in the tool host's process; a save
        then covers those files (CK-07). Raises ``ConversationError`` having changed nothing (CK-05)."""
        message = EnableCheckpoints(
            shadow=shadow.spec,
            session_id=session_id,
            log_path=str(Path(log_path).absolute()),
            touched_slot=touched.slot_id if touched is not None else "",
            restore_tool=restore_tool,
        )
        self._call(message, timeout, _none)

    def checkpoints_enabled(self, *, timeout: float | None = None) -> bool:
        """Whether ``enable_checkpoints`` has succeeded (CK-01; answered at once, mid-turn too)."""
        return self.status(timeout=timeout).checkpoints_enabled

    def restore_checkpoint(self, checkpoint_id: str, *, timeout: float | None = None) -> RestoreReport:
        """Make the working tree the checkpoint's snapshot again (a command, between turns); the transcript
        gets a system message saying exactly what was restored."""
        return self._call(RestoreCheckpoint(checkpoint_id=checkpoint_id), timeout)  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ queries (answered mid-turn)
    def transcript(self, *, timeout: float | None = None) -> tuple[Message, ...]:
        return self._call(GetTranscript(), timeout, lambda r: r.messages)  # type: ignore[no-any-return]

    def transcript_tail(self, n: int, *, timeout: float | None = None) -> tuple[Message, ...]:
        if n < 0:
            raise ValueError("n must be >= 0")
        reply: TranscriptReply = self._call(GetTranscript(tail=n), timeout)
        return reply.messages

    def status(self, *, timeout: float | None = None) -> StatusReply:
        return self._call(GetStatus(), timeout)  # type: ignore[no-any-return]

    def queue_len(self, *, timeout: float | None = None) -> int:
        return self.status(timeout=timeout).queue_len

    def turn_index(self, *, timeout: float | None = None) -> int:
        return self.status(timeout=timeout).turn_index

    def model(self, *, timeout: float | None = None) -> str:
        return self.status(timeout=timeout).model

    def event_sink(self, *, timeout: float | None = None) -> EventSink:
        """The sink in use: the local object this facade installed, else a ``RemoteSink`` on its address."""
        address = self.status(timeout=timeout).event_sink
        if address is None:
            return NullSink()
        return self._sinks.get(address) or RemoteSink(self.node, address)

    # ------------------------------------------------------------- people in the loop (issue 13)
    def set_permission_hook(
        self,
        hook: PermissionHook | str | None,
        *,
        hook_timeout: float = 30.0,
        fail_open: bool = False,
        timeout: float | None = None,
    ) -> None:
        """Every later tool call awaits ``hook`` before it runs (PH-01; applied between commands, replacing
        the earlier hook, PH-03). ``hook``: an object with ``check(request)`` (served by a
        ``PermissionHookActor`` this facade starts) or the address of one in any process; None removes it.
        A hook that raises, takes longer than ``hook_timeout`` seconds or cannot be reached denies the call
        (fail closed) unless ``fail_open``."""
        self._call(self._permission_hook(hook, hook_timeout, fail_open), timeout, _none)

    def set_permission_hook_future(
        self,
        hook: PermissionHook | str | None,
        *,
        hook_timeout: float = 30.0,
        fail_open: bool = False,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Any]:
        return self._future(self._permission_hook(hook, hook_timeout, fail_open), timeout, _none)

    def _permission_hook(
        self, hook: PermissionHook | str | None, hook_timeout: float, fail_open: bool
    ) -> SetPermissionHook:
        address = self._served(hook, "permission-hook", PermissionHookActor, "hook")
        return SetPermissionHook(address=address, timeout=hook_timeout, fail_open=fail_open)

    def _served(self, target: Any, prefix: str, actor: type[Any], field: str) -> str | None:
        """The address of ``target``: itself when it is an address (or None); else of an ``actor`` this facade
        starts to serve the object (stopped with the facade)."""
        if target is None or isinstance(target, str):
            return target
        name = f"{prefix}.{uuid.uuid4().hex[:12]}"
        self.node.spawn(actor, name, **{field: target})
        self._owned.append((self.node, name))
        return f"{self.node.name}/{name}"

    def set_sdk_hook_forwarder(
        self,
        forwarder: SdkHookForwarder | str | None,
        *,
        callback_timeout: float = 30.0,
        timeout: float | None = None,
    ) -> None:
        """Send later hook events (PreToolUse, PostToolUse, UserPromptSubmit, Stop, SessionEnd) to
        ``forwarder`` as ``hook_callback`` requests (hooks.py; PH-04), each bounded by ``callback_timeout``:
        an object with ``forward(hook_event, payload)`` (served by a ``HookForwarderActor`` this facade
        starts) or the address of one in any process. ``None`` removes it."""
        self._call(self._hook_forwarder(forwarder, callback_timeout), timeout, _none)

    def set_sdk_hook_forwarder_future(
        self,
        forwarder: SdkHookForwarder | str | None,
        *,
        callback_timeout: float = 30.0,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Any]:
        return self._future(self._hook_forwarder(forwarder, callback_timeout), timeout, _none)

    def _hook_forwarder(
        self, forwarder: SdkHookForwarder | str | None, callback_timeout: float
    ) -> SetSdkHookForwarder:
        address = self._served(forwarder, "hook-forwarder", HookForwarderActor, "forwarder")
        return SetSdkHookForwarder(address=address, timeout=callback_timeout)

    def hook_stats(self, *, timeout: float | None = None) -> HookStats:
        """How many hook callbacks were sent, and how many failed (timed out, raised, unreachable)."""
        return self._call(GetHookStats(), timeout)  # type: ignore[no-any-return]

    def hook_stats_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(GetHookStats(), timeout)

    def pending_permissions(self, *, timeout: float | None = None) -> tuple[PermissionRequest, ...]:
        """The calls waiting for a person (``ask``), each with its key (answered at once, mid-turn too)."""
        return self._call(GetPendingPermissions(), timeout, lambda r: r.requests)  # type: ignore[no-any-return]

    def pending_permissions_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(GetPendingPermissions(), timeout, lambda r: r.requests)

    def answer_permission(
        self,
        key: str,
        allow: bool,
        reason: str | None = None,
        *,
        updated_input: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Decide the ``ask`` with this key; False (and nothing changes) if none waits under it."""
        message = AnswerPermission(key=key, allow=allow, reason=reason, updated_input=updated_input)
        return self._call(message, timeout, lambda r: r.decided)  # type: ignore[no-any-return]

    def answer_permission_future(
        self,
        key: str,
        allow: bool,
        reason: str | None = None,
        *,
        updated_input: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> concurrent.futures.Future[Any]:
        message = AnswerPermission(key=key, allow=allow, reason=reason, updated_input=updated_input)
        return self._future(message, timeout, lambda r: r.decided)

    def set_plan_mode(self, on: bool, *, timeout: float | None = None) -> None:
        """Turn plan mode on or off (a command, journaled): while on, tools registered mutating are denied."""
        self._call(SetPlanMode(on=on), timeout, _none)

    def set_plan_mode_future(
        self, on: bool, *, timeout: float | None = None
    ) -> concurrent.futures.Future[Any]:
        return self._future(SetPlanMode(on=on), timeout, _none)

    def plan_mode(self, *, timeout: float | None = None) -> bool:
        return self._call(GetTodos(), timeout, lambda r: r.plan_mode)  # type: ignore[no-any-return]

    def plan_mode_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        return self._future(GetTodos(), timeout, lambda r: r.plan_mode)

    def _gate(self, cls: type[PlanApprovalGate], suffix: str) -> PlanApprovalGate:
        gate = self._gates.get(suffix)
        if gate is None:
            gate = self._gates[suffix] = cls(self.node, f"{self.address}.{suffix}")
        return gate

    def plan_approval_gate(self) -> PlanApprovalGate:
        """The conversation's plan-approval gate (PG-01: the same object on every call, the same actor
        address from every process); its operations work while a turn runs (PG-02)."""
        return self._gate(PlanApprovalGate, "plan_gate")

    def plan_mode_request_gate(self) -> PlanModeRequestGate:
        return self._gate(PlanModeRequestGate, "plan_mode_gate")  # type: ignore[return-value]

    def confirm_plan(self) -> bool:
        """Approve the pending plan (PG-03): ``exit_plan_mode`` returns approved, plan mode ends. False when
        nothing is pending (PG-08)."""
        return self.plan_approval_gate().approve()

    def confirm_plan_future(self) -> concurrent.futures.Future[Any]:
        return self.plan_approval_gate().approve_future()

    def reject_plan(self, reason: str) -> bool:
        """Reject the pending plan with ``reason`` (PG-04): the tool returns the reason, the transcript gets a
        user message with it, plan mode stays on."""
        return self.plan_approval_gate().reject(reason)

    def reject_plan_future(self, reason: str) -> concurrent.futures.Future[Any]:
        return self.plan_approval_gate().reject_future(reason)

    def approve_plan_mode_request(self) -> bool:
        return self.plan_mode_request_gate().approve()  # PG-05

    def approve_plan_mode_request_future(self) -> concurrent.futures.Future[Any]:
        return self.plan_mode_request_gate().approve_future()

    def reject_plan_mode_request(self, reason: str) -> bool:
        return self.plan_mode_request_gate().reject(reason)  # PG-06

    def reject_plan_mode_request_future(self, reason: str) -> concurrent.futures.Future[Any]:
        return self.plan_mode_request_gate().reject_future(reason)

    def current_todos(self, *, timeout: float | None = None) -> list[TodoItem]:
        """A copy of the current todo list (TD-01), answered mid-turn (TD-04); ``[]`` if the conversation
        cannot be asked (TD-03)."""
        try:
            return list(self._call(GetTodos(), timeout if timeout is not None else 5.0, lambda r: r.todos))
        except (BusError, concurrent.futures.TimeoutError):
            return []

    def current_todos_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        """``current_todos`` as a future: it resolves to ``[]`` (never fails) when the conversation cannot be
        asked (TD-03)."""
        inner = self.node.request_future(
            self.address, GetTodos(), timeout=timeout if timeout is not None else 5.0
        )
        outer: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def done(fut: concurrent.futures.Future[Any]) -> None:
            if not outer.set_running_or_notify_cancel():
                return
            error = fut.exception()
            outer.set_result([] if error is not None else list(fut.result().todos))

        inner.add_done_callback(done)
        return outer

    def kernel(self, *, timeout: float | None = None) -> KernelInfo:
        """The kernel that runs this conversation's turns (CV-08): the conversation actor's ``KernelHost``
        (each turn is one ``run_session`` with it as the session host), described by its address, tool host
        and model. The same object on every call of this facade; the same address from every process."""
        if self._kernel is None:
            self._kernel = self._call(GetKernel(), timeout)
        return self._kernel

    def kernel_future(self, *, timeout: float | None = None) -> concurrent.futures.Future[Any]:
        """``kernel`` as a future: the same object as ``kernel()`` once this facade has asked (CV-08)."""
        if self._kernel is not None:
            known: concurrent.futures.Future[Any] = concurrent.futures.Future()
            known.set_result(self._kernel)
            return known

        def keep(info: KernelInfo) -> KernelInfo:
            if self._kernel is None:
                self._kernel = info
            return self._kernel

        return self._future(GetKernel(), timeout, keep)

    # ------------------------------------------------------------------------------------ lifetime
    def stop(self, *, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the actors this facade started (the conversation, its tool host, its sink actors), waiting up
        to ``timeout`` for each. One still busy (a tool that does not return) is logged and left to its
        node's shutdown; the others are stopped all the same."""
        owned, self._owned = list(reversed(self._owned)), []
        for node, name in owned:
            ref = node.lookup(name)
            if ref is None:
                continue
            try:
                ref.stop(block=True, timeout=timeout)
            except pykka.Timeout:
                log.warning("%s did not stop within %ss (still busy); stopping the others", name, timeout)

    def __enter__(self) -> ConversationRuntime:
        return self

    def __exit__(self, *exc: object) -> None:
        """Close the session (SessionEnd, once) and stop the actors, when this facade built them."""
        if self._owned:
            try:
                self.close(timeout=10.0)
            except BusError as error:
                log.warning("closing %s on exit failed: %r", self.address, error)
        self.stop()

    def __repr__(self) -> str:
        return f"ConversationRuntime({self.address!r})"


class ConversationRuntimeBuilder:
    """Options of a new conversation; ``build()`` starts its actors and returns the facade."""

    def __init__(self) -> None:
        self._node: Node | None = None
        self._router: str | None = None
        self._model: str | None = None
        self._tools: ToolRegistry | None = None
        self._host: str | None = None
        self._host_node: Node | None = None
        self._system_prompt = ""
        self._session_file: Path | None = None
        self._resume = True
        self._journal_sync = Sync.EFFECTS
        self._effects: Path | None = None
        self._compactor: Compactor | None = None
        self._sink: EventSink | None = None
        self._session_id: str | None = None
        self._hooks: list[Callable[[SessionEnd], None]] = []
        self._max_steps = 16
        self._user_id = "conversation"
        self._name: str | None = None
        self._conversation_node: Node | None = None
        self._round_timeout: float | None = None
        self._tool_timeout: float | None = None
        self._call_timeout: float | None = None
        self._timeout: float | None = DEFAULT_TIMEOUT
        self._reasoning_effort = ""
        self._operation_ids: Callable[[], uuid.UUID] | None = None
        self._loop_options: dict[str, Any] = {}
        self._plan_mode = False
        self._people_tools = False
        self._ask_timeout: float | None = None

    def node(self, node: Node) -> ConversationRuntimeBuilder:
        """The caller's bus node (required): the facade talks through it; actors start on it by default."""
        self._node = node
        return self

    def router(self, address: str) -> ConversationRuntimeBuilder:
        """The Router's address (default ``<node>/router``)."""
        self._router = address
        return self

    def llm(self, model: str) -> ConversationRuntimeBuilder:
        """The Router catalog model the turns use (required; e.g. ``"scripted"``, ``"local"``)."""
        self._model = model
        return self

    model = llm

    def tools(self, registry: ToolRegistry) -> ConversationRuntimeBuilder:
        """The tools; a tool-host actor serving them starts on ``host_node`` (default: the node)."""
        self._tools = registry
        return self

    def host(self, address: str) -> ConversationRuntimeBuilder:
        """Use an already running ``ToolHostActor`` (possibly in another process) instead of ``tools``."""
        self._host = address
        return self

    def host_node(self, node: Node) -> ConversationRuntimeBuilder:
        self._host_node = node
        return self

    def conversation_node(self, node: Node) -> ConversationRuntimeBuilder:
        """Where the conversation actor (and its session loops) run (default: the node)."""
        self._conversation_node = node
        return self

    def system_prompt(self, text: str) -> ConversationRuntimeBuilder:
        """Instructions put before the conversation in every model request (not a transcript message)."""
        self._system_prompt = text
        return self

    def session_file(self, path: str | Path, *, resume: bool = True) -> ConversationRuntimeBuilder:
        """The session's JSONL file; with ``resume`` an existing file restores the transcript first."""
        self._session_file = Path(path)
        self._resume = resume
        return self

    def effects(self, path: str | Path) -> ConversationRuntimeBuilder:
        """The effect store of the tool host ``build()`` starts (SQLite: an intent row before each tool runs,
        its outcome after; a repeated idempotency key answers the stored outcome and never runs the tool
        twice). Default: next to the session file (``<session file>.effects.sqlite3``); without a session
        file, an in-memory store that lives as long as the host."""
        self._effects = Path(path)
        return self

    def journal_sync(self, sync: Sync | str) -> ConversationRuntimeBuilder:
        """When the session file is fsync'd: ``"effects"`` (default: every record that precedes a model
        request, a tool call or an answer), ``"always"`` (every record) or ``"never"`` (flushed to the OS
        only: a process crash loses nothing, a power loss may)."""
        self._journal_sync = Sync(sync)
        return self

    def compactor(self, compactor: Compactor | None) -> ConversationRuntimeBuilder:
        self._compactor = compactor
        return self

    def event_sink(self, sink: EventSink | None) -> ConversationRuntimeBuilder:
        self._sink = sink
        return self

    def session_id(self, session_id: str) -> ConversationRuntimeBuilder:
        self._session_id = session_id
        return self

    def on_session_end(self, hook: Callable[[SessionEnd], None]) -> ConversationRuntimeBuilder:
        """A ``SessionEnd`` hook (runs once, on ``close``, in the conversation actor's process)."""
        self._hooks.append(hook)
        return self

    def max_steps(self, n: int) -> ConversationRuntimeBuilder:
        """Tool calls allowed in one turn; the turn ends ``MAX_STEPS`` at the next boundary past it."""
        if n < 1:
            raise ValueError("max_steps must be at least 1")
        self._max_steps = n
        return self

    def user_id(self, user_id: str) -> ConversationRuntimeBuilder:
        self._user_id = user_id
        return self

    def name(self, name: str) -> ConversationRuntimeBuilder:
        """The conversation actor's name on its node (default ``conversation.<random>``)."""
        self._name = name
        return self

    def round_timeout(self, seconds: float | None) -> ConversationRuntimeBuilder:
        """The provider timeout of one model request (PreparedRound.timeout)."""
        self._round_timeout = seconds
        return self

    def tool_timeout(self, seconds: float) -> ConversationRuntimeBuilder:
        """How long one tool call may run (default an hour); past it the call's outcome is unknown and the
        turn is suspended (``continue_turn`` asks the host again by the call's idempotency key)."""
        self._tool_timeout = seconds
        return self

    def call_timeout(self, seconds: float) -> ConversationRuntimeBuilder:
        """How long each step of a turn may wait (a model read, a callback; default an hour, and never less
        than ``tool_timeout``); past it the turn ends with ``Expired`` (suspended once it had progressed)."""
        self._call_timeout = seconds
        return self

    def reasoning_effort(self, effort: str) -> ConversationRuntimeBuilder:
        self._reasoning_effort = effort
        return self

    def timeout(self, seconds: float | None) -> ConversationRuntimeBuilder:
        """The facade's default wait for a reply."""
        self._timeout = seconds
        return self

    def operation_ids(self, factory: Callable[[], uuid.UUID]) -> ConversationRuntimeBuilder:
        self._operation_ids = factory
        return self

    def goal_evaluator(self, evaluator: Any) -> ConversationRuntimeBuilder:
        """A ``GoalEvaluator`` (loops.py) instead of the judge run; called off the actor thread."""
        self._loop_options["goal_evaluator"] = evaluator
        return self

    def judge_model(self, model: str) -> ConversationRuntimeBuilder:
        """The Router catalog model of the goal judge (default: the session's model)."""
        self._loop_options["judge_model"] = model
        return self

    def judge_timeout(self, seconds: float) -> ConversationRuntimeBuilder:
        """Past it a judge call is cancelled and counts as "not achieved" (default 120 s)."""
        self._loop_options["judge_timeout"] = seconds
        return self

    def goal_judge_tail(self, n: int) -> ConversationRuntimeBuilder:
        """How many transcript messages the judge sees (GL-09; default 20)."""
        if n < 0:
            raise ValueError("goal_judge_tail must be >= 0")
        self._loop_options["goal_judge_tail"] = n
        return self

    def timers(self, timers: Any) -> ConversationRuntimeBuilder:
        """The loops' clock and timer source (``loops.Timers``; default wall clock and threads)."""
        self._loop_options["timers"] = timers
        return self

    clock = timers

    def plan_mode(self, on: bool = True) -> ConversationRuntimeBuilder:
        """Start in plan mode (a resumed session keeps its journaled mode): mutating tools are denied."""
        self._plan_mode = on
        return self

    def people_tools(self, on: bool = True) -> ConversationRuntimeBuilder:
        """Register ``todo_write``, ``exit_plan_mode`` and ``request_plan_mode`` in the tools (people.py)."""
        self._people_tools = on
        return self

    def ask_timeout(self, seconds: float) -> ConversationRuntimeBuilder:
        """How long an ``ask`` or a proposed plan waits for a person (default an hour); then it is denied."""
        self._ask_timeout = seconds
        return self

    def build(self) -> ConversationRuntime:
        from actors.conversation.actor import ConversationActor, ConversationConfig
        from actors.conversation.host import ToolHostActor

        node = self._node
        if node is None:
            raise ValueError("ConversationRuntime.builder() needs .node(node)")
        if not self._model:
            raise ValueError("ConversationRuntime.builder() needs .llm(model)")
        where = self._conversation_node or node
        name = self._name or f"conversation.{uuid.uuid4().hex[:12]}"
        facade = ConversationRuntime(node, f"{where.name}/{name}", timeout=self._timeout)
        host = self._host
        if host is None:
            host_node = self._host_node or where
            host_name = f"{name}.host"
            effects = self._effects
            if effects is None and self._session_file is not None:
                effects = self._session_file.with_name(self._session_file.name + ".effects.sqlite3")
            registry = self._tools or ToolRegistry()
            if self._people_tools:
                register_people_tools(registry)
            # Tools may block: their hosts are a pool of their own, never a conversation's host.
            HostPool.of(host_node, TOOL_HOSTS).spawn(
                ToolHostActor, host_name, registry=registry, effects=effects
            )
            facade._owned.append((host_node, host_name))
            host = f"{host_node.name}/{host_name}"
        sink_address = facade._sink_address(self._sink)
        config = ConversationConfig(
            router=self._router or f"{node.name}/router",
            model=self._model,
            host=host,
            system_prompt=self._system_prompt,
            session_file=self._session_file,
            resume=self._resume,
            journal_sync=self._journal_sync,
            compactor=self._compactor,
            sink=sink_address,
            session_id=self._session_id,
            hooks=tuple(self._hooks),
            max_steps=self._max_steps,
            user_id=self._user_id,
            round_timeout=self._round_timeout,
            reasoning_effort=self._reasoning_effort,
            operation_ids=self._operation_ids,
            plan_mode=self._plan_mode,
        )
        extra: dict[str, Any] = dict(self._loop_options)
        if self._tool_timeout is not None:
            extra["tool_timeout"] = self._tool_timeout
        if self._call_timeout is not None:
            extra["call_timeout"] = self._call_timeout
        config = dataclasses.replace(config, **extra)
        if self._ask_timeout is not None:
            config = dataclasses.replace(config, ask_timeout=self._ask_timeout)
        HostPool.of(where, CONVERSATION_HOSTS).spawn(ConversationActor, name, config=config)
        facade._owned.append((where, name))
        return facade
