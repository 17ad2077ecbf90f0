"""The conversation actor's people-in-the-loop half (``Gatekeeper``, a mixin of ``ConversationActor``).

It decides every tool call of a turn before it reaches the tool host (permissions.py: journaled decision,
plan mode, the permission hook, ``ask``), waits for a person on ``exit_plan_mode`` / ``request_plan_mode``
(people.py), and keeps the todo list a ``todo_write`` wrote. All of its state is in the session journal and
comes back on resume (``Restored.people``): an ``ask`` or a plan still pending at a crash is pending again,
and the first decision for its key is the only one that counts.

Waiting is bounded: an ``ask`` or a plan nobody decides within ``ask_timeout`` seconds (on the
conversation's injected clock, ``ConversationConfig.timers``) is denied (rejected) with a reason that says so.
The session loop's wait for the host call is lengthened by that bound. An interrupt (the turn's token
cancelled) ends every such wait at once: the call is denied, the plan or plan-mode request rejected, with a
reason that says so, journaled like a person's decision (a resume does not ask again), and the turn then
ends as an interrupted turn does.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pykka

from actors.base import Context
from actors.conversation.hooks import (
    HOOK_EVENTS,
    CancelHookCallback,
    GetHookStats,
    HookCallback,
    HookOutput,
    HookStats,
    SetSdkHookForwarder,
    additional_context,
    pre_tool_decision,
)
from actors.conversation.journal import Journal, PendingCall
from actors.conversation.messages import ConversationError
from actors.conversation.people import (
    EXIT_PLAN_MODE,
    REQUEST_PLAN_MODE,
    TODO_WRITE,
    GateDecide,
    GateDecided,
    GatePending,
    GatePlan,
    PendingPlan,
    PeopleState,
    plan_result,
    render_todos,
    todos_from_json,
    todos_json,
)
from actors.conversation.permissions import (
    AnswerPermission,
    CheckPermission,
    GetPendingPermissions,
    PendingPermissions,
    PermissionAnswered,
    PermissionAsked,
    PermissionDecision,
    PermissionRequest,
    SetPermissionHook,
    merge_input,
)
from actors.conversation.timers import RecordedTimers, Timers, WaitExpired
from actors.conversation.tools import ToolExecution, ToolSpec
from actors.conversation.types import Message, TodoItem, TodoUpdated
from transport.errors import Expired, NotDelivered
from transport.node import Node
from transport.pending import Reply
from transport.records import frozen

log = logging.getLogger(__name__)

__all__ = ["Gatekeeper", "GetKernel", "GetTodos", "KernelInfo", "SetPlanMode", "TodoList"]

NOT_MINE = object()
INTERRUPTED = "the turn was interrupted"  # the reason a wait for a person ended by an interrupt gives


@frozen(kw_only=True)
class SetPlanMode:
    """A command: turn plan mode on or off (journaled)."""

    TAG = "conv.plan_mode"
    on: bool


@frozen(kw_only=True)
class GetTodos:
    TAG = "conv.get_todos"


@frozen(kw_only=True)
class TodoList:
    TAG = "conv.todos"
    todos: tuple[TodoItem, ...]
    version: int
    plan_mode: bool = False


@frozen(kw_only=True)
class GetKernel:
    TAG = "conv.get_kernel"


@frozen(kw_only=True)
class KernelInfo:
    """CV-08: the kernel that runs this conversation's turns is the conversation actor's ``KernelHost``
    (each turn one ``run_session`` with it as host): its address, its tool host, its model."""

    TAG = "conv.kernel"
    address: str
    host: str
    model: str


_Expired = WaitExpired  # a wait for a person that ran past ask_timeout (timers.py: recorded on capture)


class Gatekeeper:
    """Mixin state and handlers; the host class provides ``_write``, ``ask``, ``_emit``, ``address``..."""

    # provided by ConversationActor / KernelHost / BusActor (declared for the type checker only: a stub
    # here would come first in the MRO and hide the real method)
    if TYPE_CHECKING:
        config: Any
        address: str
        node: Node
        actor_ref: Any
        _journal: Journal | None
        _session_id: str | None
        _run: Any
        _transcript: list[Message]
        _interrupted: Any

        def _write(self, what: str, write: Callable[[Journal], None]) -> None: ...
        def ask(self, dst: str, message: Any, then: Callable[[Reply], None], **kwargs: Any) -> bytes: ...
        def tell_to(self, dst: str, message: Any, **fields: Any) -> bytes: ...
        def _emit(self, event: Any) -> None: ...
        def _append(self, message: Message) -> None: ...
        def _local_specs(self) -> tuple[ToolSpec, ...]: ...

    def _people_init(self, people: PeopleState | None) -> None:
        self._people = people or PeopleState()
        if self.config.plan_mode and people is None:
            self._people.plan_mode = True
        self._hook: str | None = self.config.permission_hook
        self._hook_timeout: float = self.config.permission_timeout
        self._hook_fail_open = False
        self._mutating: frozenset[str] | None = None
        self._plan_tools = False  # the host has exit_plan_mode / request_plan_mode (a call may wait)
        self._ask_waiters: dict[str, Callable[[PermissionDecision], None]] = {}
        self._plan_waiters: dict[str, Callable[[ToolExecution], None]] = {}
        self._people_timers: Timers = self.config.timers or RecordedTimers(self.node, self.address)
        self._wait_timers: dict[tuple[str, str], Callable[[], None]] = {}  # (kind, key) -> cancel
        self._tool_sink: str | None = self.config.sink  # the sink the host's tools are bound to (ES-02)
        self._rejections: list[str] = []
        self._forwarder: str | None = None  # the SDK hook forwarder actor (hooks.py)
        self._forward_timeout = 30.0
        self._hook_seq = 0
        self._hooks_forwarded = 0
        self._hook_failures = 0

    def _people_started(self) -> None:
        if self.config.plan_mode and self._journal is not None and self._people.plan_mode:
            self._write("plan mode", lambda j: j.people("plan_mode", on=True))

    def _people_wait(self) -> float:
        """How much longer a host call of a turn may take because a person may be asked (or a hook or a
        forwarder consulted): nothing when none of them is in play, so the session loop's own bound on a
        host call stays as it was."""
        wait = 0.0
        if self._hook is not None:
            wait += self._hook_timeout
        if self._forwarder is not None:
            wait += 2 * self._forward_timeout  # PreToolUse and PostToolUse
        asks = self._hook is not None or self._forwarder is not None or bool(self._people.asks)
        if asks or self._plan_tools:
            wait += float(self.config.ask_timeout)
        return wait

    def _tools_listed(self, mutating: tuple[str, ...], names: set[str]) -> None:
        """The tool host's list (at the start of a turn or a continuation)."""
        self._mutating = frozenset(mutating)
        self._plan_tools = bool(names & {EXIT_PLAN_MODE, REQUEST_PLAN_MODE})

    # ------------------------------------------------------------------------- the permission layer
    def _permit(
        self,
        pending: PendingCall,
        arguments: dict[str, Any],
        then: Callable[[PermissionDecision], None],
        pre: dict[str, Any] | None = None,
    ) -> None:
        """Decide ``pending`` (journaled), then ``then(decision)``: allow or deny, never ask. ``pre``: the
        input changes a ``PreToolUse`` forwarder made (None: it has not been asked yet)."""
        key = pending.key
        people = self._people
        known = people.decisions.get(key)
        if known is not None:  # a continued turn: the decision made before the crash stands
            then(known)
            return
        if key in people.asks:  # asked before a crash and still undecided: wait for the person again
            request, reason = people.asks[key]
            self._wait_ask(request, reason, then)
            return
        if self._mutating is None and people.plan_mode:
            from actors.conversation.messages import ListTools, ToolList

            def listed(reply: Reply) -> None:
                names = reply.message.mutating if isinstance(reply.message, ToolList) else None
                if names is None:  # fail closed: unknown tools are treated as mutating in plan mode
                    self._final(
                        key, PermissionDecision.deny("plan mode is on and the tool list is unknown"), then
                    )
                    return
                self._mutating = frozenset(names)
                self._permit(pending, arguments, then)

            self.ask(self.config.host, ListTools(), listed, timeout=self.config.tool_timeout)
            return
        mutating = self._is_mutating(pending.name)
        if people.plan_mode and mutating:
            reason = (
                f"plan mode is on: {pending.name} changes files or the world, so it cannot run until a plan "
                "is approved (propose one with exit_plan_mode)"
            )
            self._final(key, PermissionDecision.deny(reason), then)
            return
        if pre is None and self._forwarder is not None:  # PreToolUse: before the permission hook
            tool_input = {
                "hook_event_name": "PreToolUse",
                "tool_name": pending.name,
                "tool_input": arguments,
                "session_id": self._session_id,
            }

            def pre_answered(response: dict[str, Any] | None, error: str | None) -> None:
                if error is not None:  # fail closed
                    self._final(key, PermissionDecision.deny(error + "; denied (fail closed)"), then)
                    return
                decision = pre_tool_decision(response or {})
                if decision is not None and decision.behavior == "deny":
                    self._final(key, decision, then)
                    return
                updates = dict(decision.updated_input or {}) if decision is not None else {}
                merged = merge_input(arguments, updates)
                if decision is not None and decision.behavior == "ask":
                    self._asked(self._request(pending, merged, mutating), decision.reason, then)
                    return
                self._permit(pending, merged, then, updates)

            self._forward("PreToolUse", tool_input, pending.call_id, pre_answered)
            return
        request = self._request(pending, arguments, mutating)
        pre = pre or {}
        if self._hook is None:
            # no hook, no plan-mode denial: nothing to journal unless a forwarder changed the input
            if pre:
                self._final(key, PermissionDecision.allow(pre), then)
            else:
                then(PermissionDecision.allow())
            return
        hook, timeout, fail_open = self._hook, self._hook_timeout, self._hook_fail_open

        def checked(reply: Reply) -> None:
            error, decision = reply.error, reply.message
            if error is None and isinstance(decision, PermissionDecision):
                if decision.behavior == "ask":
                    self._asked(request, decision.reason, then)
                    return
                if decision.behavior == "allow" and pre:
                    decision = PermissionDecision.allow({**pre, **(decision.updated_input or {})})
                self._final(key, decision, then)
                return
            if error is None:
                why = f"the permission hook answered {type(decision).__name__}"
            elif isinstance(error, Expired):
                why = f"the permission hook did not answer within {timeout:g}s"
            elif isinstance(error, NotDelivered):
                why = f"the permission hook cannot be reached ({error.message})"
            else:
                why = f"the permission hook failed: {error}"
            # rate-limited: a peer that points the hook at a dead address must not flood the log
            self.node.log_limit.log(
                log,
                logging.WARNING,
                (self.address, "permission hook"),
                "%s: %s (call %s)",
                self.address,
                why,
                key,
            )
            if fail_open:
                self._final(key, PermissionDecision.allow(pre or None), then)
            else:
                self._final(key, PermissionDecision.deny(why + "; denied (fail closed)"), then)

        self.ask(hook, CheckPermission(request=request), checked, timeout=timeout)

    def _is_mutating(self, name: str) -> bool:
        """Whether ``name`` was registered mutating: on the tool host (its ``ToolList``), or as one of the
        conversation's own tools (the loops' ``schedule_wakeup`` and job tools: their ``ToolSpec.mutating``,
        read at each call, since they may be registered mid-conversation). No fixed list of names."""
        if self._mutating is not None and name in self._mutating:
            return True
        return any(spec.mutating for spec in self._local_specs() if spec.name == name)

    def _request(self, pending: PendingCall, arguments: dict[str, Any], mutating: bool) -> PermissionRequest:
        return PermissionRequest(
            key=pending.key,
            call_id=pending.call_id,
            tool_name=pending.name,
            arguments=arguments,
            session_id=self._session_id,
            mutating=mutating,
        )

    def _forward(
        self,
        event: str,
        hook_input: dict[str, Any],
        tool_use_id: str | None,
        then: Callable[[dict[str, Any] | None, str | None], None] | None = None,
    ) -> None:
        """One hook callback to the SDK hook forwarder (hooks.py); ``then(response, error)``: a failure is
        logged and counted, and its text given to ``then``."""
        address = self._forwarder
        if address is None:
            if then is not None:
                then(None, None)
            return
        self._hook_seq += 1
        request_id = f"{self.address}:hook:{self._hook_seq}"
        timeout = self._forward_timeout
        self._hooks_forwarded += 1
        callback = HookCallback(
            request_id=request_id,
            callback_id=f"hook_{HOOK_EVENTS.index(event)}",
            hook_event=event,
            input=hook_input,
            tool_use_id=tool_use_id,
        )

        def answered(reply: Reply) -> None:
            error, message = reply.error, reply.message
            if error is None and isinstance(message, HookOutput):
                if then is not None:
                    then(dict(message.response), None)
                return
            if isinstance(error, Expired):
                why = f"the hook forwarder did not answer {event} within {timeout:g}s"
                self.tell_to(address, CancelHookCallback(request_id=request_id))
            elif isinstance(error, NotDelivered):
                why = f"the hook forwarder cannot be reached ({error.message})"
            elif error is None:
                why = f"the hook forwarder answered {type(message).__name__} to {event}"
            else:
                why = f"the hook forwarder failed on {event}: {error}"
            self._hook_failures += 1
            self.node.log_limit.log(
                log, logging.WARNING, (self.address, "hook forwarder"), "%s: %s", self.address, why
            )
            if then is not None:
                then(None, why)

        self.ask(address, callback, answered, timeout=timeout)

    def _final(
        self, key: str, decision: PermissionDecision, then: Callable[[PermissionDecision], None]
    ) -> None:
        try:
            self._write(
                "a permission decision",
                lambda j: j.people("permission", key=key, decision=decision.to_json()),
            )
        except ConversationError as exc:  # fail closed: not journaled, not run
            decision = PermissionDecision.deny(f"the decision cannot be journaled: {exc}")
        self._people.decisions[key] = decision
        self._people.asks.pop(key, None)
        then(decision)

    def _asked(
        self, request: PermissionRequest, reason: str | None, then: Callable[[PermissionDecision], None]
    ) -> None:
        row = {
            "key": request.key,
            "call_id": request.call_id,
            "tool_name": request.tool_name,
            "arguments": request.arguments,
            "session_id": request.session_id,
            "mutating": request.mutating,
        }
        try:
            self._write(
                "a permission ask",
                lambda j: j.people("permission_asked", key=request.key, request=row, reason=reason),
            )
        except ConversationError as exc:
            self._final(request.key, PermissionDecision.deny(str(exc)), then)
            return
        self._people.asks[request.key] = (request, reason)
        self._wait_ask(request, reason, then)

    def _wait_ask(
        self, request: PermissionRequest, reason: str | None, then: Callable[[PermissionDecision], None]
    ) -> None:
        self._ask_waiters[request.key] = then
        self._emit(PermissionAsked(request=request, reason=reason))
        self._timer("ask", request.key)

    def _timer(self, kind: str, key: str) -> None:
        """Bound a wait for a person by ``ask_timeout`` on the conversation's clock (``_expired``)."""
        ref = self.actor_ref

        def expire() -> None:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(_Expired(kind, key))

        self._stop_timer(kind, key)
        self._wait_timers[(kind, key)] = self._people_timers.call_later(self.config.ask_timeout, expire)

    def _stop_timer(self, kind: str, key: str) -> None:
        cancel = self._wait_timers.pop((kind, key), None)
        if cancel is not None:
            cancel()

    def _answer_ask(self, m: AnswerPermission) -> bool:
        if m.key not in self._people.asks:
            return False  # nothing waits under that key, or it was decided already
        if m.allow:  # the arguments the person saw (merged by a PreToolUse forwarder), then their changes
            request, _ = self._people.asks[m.key]
            decision = PermissionDecision.allow(merge_input(request.arguments, m.updated_input))
        else:
            decision = PermissionDecision.deny(m.reason or "a person denied it")
        waiter = self._ask_waiters.pop(m.key, None)
        self._stop_timer("ask", m.key)
        self._final(m.key, decision, waiter or (lambda d: None))
        return True

    def _expired(self, e: _Expired) -> None:
        self._wait_timers.pop((e.kind, e.key), None)
        wait = f"no one decided within {self.config.ask_timeout:g}s"
        if e.kind == "ask" and e.key in self._ask_waiters:
            self._answer_ask(AnswerPermission(key=e.key, allow=False, reason=wait))
        elif e.kind == "plan" and e.key in self._plan_waiters:
            plan = self._people.plans.get(e.key)
            if plan is not None:
                self._decide(plan, False, wait)

    def _end_people_waits(self, reason: str) -> None:
        """The interrupt token was cancelled: every call of this conversation waiting for a person is
        decided now, ``ask`` denied and plan (or plan-mode request) rejected with ``reason``, journaled as a
        person's decision would be (a resume does not ask again). The waiting tool calls then return, and
        the turn ends at its next step boundary as CANCELLED (IT-01/IT-02)."""
        for key in list(self._ask_waiters):
            self._answer_ask(AnswerPermission(key=key, allow=False, reason=reason))
        for plan_id in list(self._plan_waiters):
            plan = self._people.plans.get(plan_id)
            if plan is not None and plan.decision is None:
                self._decide(plan, False, reason, person=False)

    # ------------------------------------------------------------------------ plans and todos
    def _after_tool(
        self, pending: PendingCall, result: ToolExecution, then: Callable[[ToolExecution], None]
    ) -> None:
        """PostToolUse (its additionalContext joins the result), then the people tools' own handling."""
        if self._forwarder is None:
            self._people_after(pending, result, then)
            return
        hook_input = {
            "hook_event_name": "PostToolUse",
            "tool_name": pending.name,
            "tool_input": json.loads(pending.arguments),
            "tool_response": result.text,
            "session_id": self._session_id,
        }

        def post(response: dict[str, Any] | None, error: str | None) -> None:
            context = additional_context(response) if response else None
            if context:
                result2 = ToolExecution(
                    ok=result.ok, text=f"{result.text}\n\n[hook context] {context}", unknown=result.unknown
                )
                self._people_after(pending, result2, then)
            else:
                self._people_after(pending, result, then)

        self._forward("PostToolUse", hook_input, pending.call_id, post)

    def _people_after(
        self, pending: PendingCall, result: ToolExecution, then: Callable[[ToolExecution], None]
    ) -> None:
        """A people tool's result: wait for a person (plans), or journal the list (todos)."""
        name = pending.name
        if name == TODO_WRITE:
            self._todo_written(result, then)
        elif name in (EXIT_PLAN_MODE, REQUEST_PLAN_MODE) and result.ok and not result.unknown:
            kind = "plan" if name == EXIT_PLAN_MODE else "mode_request"
            self._propose(pending.key, kind, result, then)
        else:
            then(result)

    def _todo_written(self, result: ToolExecution, then: Callable[[ToolExecution], None]) -> None:
        current = json.dumps({"current_todos": todos_json(self._people.todos)})
        if not result.ok:
            then(
                ToolExecution(
                    ok=False, text=f"{result.text}\nThe list is unchanged: {current}", unknown=result.unknown
                )
            )
            return
        version = self._people.todo_version + 1  # the conversation's count, journaled (not the host's)
        try:
            todos = todos_from_json(json.loads(result.text)["todos"])
            self._write(
                "the todo list", lambda j: j.people("todos", todos=todos_json(todos), version=version)
            )
        except (ValueError, KeyError, TypeError, ConversationError) as exc:
            then(ToolExecution(ok=False, text=f"todo_write: {exc}\nThe list is unchanged: {current}"))
            return
        self._people.todos, self._people.todo_version = todos, version
        if self._tool_sink is not None:  # TD-02: after the list is durable
            self.tell_to(self._tool_sink, TodoUpdated(todos=todos, version=version))
        then(ToolExecution(ok=True, text=json.dumps({"todos": todos_json(todos), "version": version})))

    def _propose(
        self, plan_id: str, kind: str, result: ToolExecution, then: Callable[[ToolExecution], None]
    ) -> None:
        try:
            row = json.loads(result.text)
            text = str(row.get("plan", row.get("reason", "")))
        except ValueError:
            text = result.text
        plan = self._people.plans.get(plan_id)
        if plan is None:
            plan = PendingPlan(plan_id, kind, text)
            try:
                self._write(
                    "a proposed plan",
                    lambda j: j.people("plan_proposed", plan_id=plan_id, kind=kind, plan=text),
                )
            except ConversationError as exc:
                then(ToolExecution(ok=False, text=f"the plan cannot be journaled: {exc}"))
                return
            self._people.plans[plan_id] = plan
        if plan.decision is not None:  # decided already (after a resume): that decision, once
            then(ToolExecution(ok=True, text=plan_result(kind, plan.decision)))
            return
        self._plan_waiters[plan_id] = then
        self._timer("plan", plan_id)

    def _decide(self, plan: PendingPlan, approved: bool, reason: str | None, *, person: bool = True) -> None:
        """Journal and apply a decision on ``plan``; ``person`` False (an interrupt): no user message."""
        self._stop_timer("plan", plan.plan_id)
        decision = {"approved": approved, "reason": reason}
        self._write(
            "a plan decision",
            lambda j: j.people("plan_decided", plan_id=plan.plan_id, approved=approved, reason=reason),
        )
        plan.decision = decision
        mode = self._people.plan_mode
        if approved:
            mode = (
                plan.kind == "mode_request"
            )  # an approved plan ends plan mode; an approved request starts it
        if mode != self._people.plan_mode:
            self._write("plan mode", lambda j: j.people("plan_mode", on=mode))
            self._people.plan_mode = mode
        if not approved and plan.kind == "plan" and person:
            note = f"The plan was rejected: {reason or 'no reason given'}. Plan mode stays on."
            if self._run is None and self._interrupted is None:
                self._append(Message.user(note))
            else:
                self._rejections.append(note)  # after the turn's messages (PG-04)
        waiter = self._plan_waiters.pop(plan.plan_id, None)
        if waiter is not None:
            waiter(ToolExecution(ok=True, text=plan_result(plan.kind, decision)))

    def _take_rejections(self) -> list[str]:
        notes, self._rejections = self._rejections, []
        return notes

    def _todo_message(self) -> Message | None:
        """The list put back into the model's context after a compaction."""
        todos = self._people.todos
        if not todos:
            return None
        return Message.system(
            "Current todo list (kept across the compaction; todo_write replaces it):\n"
            + render_todos(todos)
            + "\n"
            + json.dumps(todos_json(todos))
        )

    # ---------------------------------------------------------------------------- dispatch
    def _people_handle(self, message: Any, ctx: Context) -> Any:
        """Queries and controls answered at once (MB-03); ``NOT_MINE`` for anything else."""
        match message:
            case AnswerPermission():
                return PermissionAnswered(decided=self._answer_ask(message))
            case GetPendingPermissions():
                return PendingPermissions(requests=tuple(r for r, _ in self._people.asks.values()))
            case GatePending(kind=kind):
                plan = self._people.pending(kind)
                return GatePlan(plan=plan.plan if plan else None, plan_id=plan.plan_id if plan else None)
            case GateDecide(kind=kind, approved=approved, reason=reason, plan_id=plan_id):
                target = self._people.plans.get(plan_id) if plan_id else self._people.pending(kind)
                if target is None or target.decision is not None or target.kind != kind:
                    return GateDecided(decided=False)  # PG-08
                self._decide(target, approved, reason)
                return GateDecided(decided=True)
            case GetTodos():
                p = self._people
                return TodoList(todos=p.todos, version=p.todo_version, plan_mode=p.plan_mode)
            case GetHookStats():
                return HookStats(forwarded=self._hooks_forwarded, failures=self._hook_failures)
            case GetKernel():
                return KernelInfo(
                    address=self.address, host=self.config.host, model=getattr(self, "_model", "")
                )
        return NOT_MINE

    def _people_command(self, message: Any) -> bool:
        """Commands applied between commands; True when handled."""
        match message:
            case SetPermissionHook(address=address, timeout=timeout, fail_open=fail_open):
                self._hook, self._hook_timeout, self._hook_fail_open = address, timeout, fail_open
                return True
            case SetSdkHookForwarder(address=address, timeout=timeout):
                self._forwarder, self._forward_timeout = address, timeout
                return True
            case SetPlanMode(on=on):
                self._write("plan mode", lambda j: j.people("plan_mode", on=on))
                self._people.plan_mode = on
                return True
        return False

    def _people_local(self, message: Any) -> bool:
        if isinstance(message, _Expired):
            self._expired(message)
            return True
        return False


PEOPLE_COMMANDS = (SetPermissionHook, SetPlanMode, SetSdkHookForwarder)
GATEKEEPER_MESSAGES = (SetPlanMode, GetTodos, TodoList, GetKernel, KernelInfo)
