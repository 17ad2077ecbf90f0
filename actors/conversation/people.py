"""People in the loop: the todo list, plan mode and plan gates (RULES.md 9.10 PG, 9.16 TD, 9.12 ES-02).

The tools (registered in the conversation's ``ToolRegistry``, so they run on its tool host; their events go
to the sink the tools were bound to, ES-02):

- ``TodoWriteTool`` (``todo_write``): replaces the whole list; validates it (statuses pending |
  in_progress | completed, at most one in_progress); the conversation then journals it and emits
  ``TodoUpdated{todos, version}`` on the sink the tools are bound to, ``version`` counting the
  conversation's lists (journaled: it keeps rising across a resume).
- ``ExitPlanModeTool`` (``exit_plan_mode``): proposes a plan; emits ``PlanProposed`` on its sink.
- ``RequestPlanModeTool`` (``request_plan_mode``): asks a person to turn plan mode on.

The conversation actor owns the state they change, in its journal (``PeopleState``): it waits for the
decision on a proposed plan (the tool call's result reaches the model only once a person decided, through
the ``PlanApprovalGate`` / ``PlanModeRequestGate`` actors or the runtime's ``confirm_plan``...), journals the
todo list a ``todo_write`` wrote, and puts it back into the model's context after every compaction.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from actors.base import DEFER, BusActor, Context
from actors.conversation.permissions import PermissionDecision, PermissionRequest
from actors.conversation.tools import EventSinkLike
from actors.conversation.types import PlanProposed, TodoItem
from transport.errors import ProtocolError
from transport.node import Node
from transport.pending import Reply, chained
from transport.records import frozen

__all__ = [
    "EXIT_PLAN_MODE",
    "REQUEST_PLAN_MODE",
    "TODO_WRITE",
    "ExitPlanModeTool",
    "GateActor",
    "GateDecide",
    "GatePending",
    "PendingPlan",
    "PeopleState",
    "RequestPlanModeTool",
    "TodoError",
    "TodoWriteTool",
    "render_todos",
    "validate_todos",
]

TODO_WRITE = "todo_write"
EXIT_PLAN_MODE = "exit_plan_mode"
REQUEST_PLAN_MODE = "request_plan_mode"
STATUSES = ("pending", "in_progress", "completed")


class TodoError(ValueError):
    """A todo list ``todo_write`` refuses."""


def validate_todos(todos: Any) -> tuple[TodoItem, ...]:
    """The list a ``todo_write`` call gives, checked: ``TodoError`` says what is wrong."""
    if not isinstance(todos, list | tuple):
        raise TodoError("todos must be a list of {content, status, active_form}")
    items: list[TodoItem] = []
    for n, row in enumerate(todos, 1):
        if not isinstance(row, Mapping):
            raise TodoError(f"item {n} is not an object")
        content, status = row.get("content"), row.get("status")
        active = row.get("active_form", row.get("activeForm", ""))
        if not isinstance(content, str) or not content.strip():
            raise TodoError(f"item {n} needs a non-empty content")
        if status not in STATUSES:
            raise TodoError(f"item {n}: status must be one of {', '.join(STATUSES)}, not {status!r}")
        if not isinstance(active, str):
            raise TodoError(f"item {n}: active_form must be text")
        items.append(TodoItem(content=content, status=status, active_form=active))
    running = sum(i.status == "in_progress" for i in items)
    if running > 1:
        raise TodoError(f"at most one item may be in_progress ({running} are)")
    return tuple(items)


def render_todos(todos: tuple[TodoItem, ...] | list[TodoItem]) -> str:
    """The list as a checklist (what the model is shown after a compaction, what the CLI prints)."""
    if not todos:
        return "(the todo list is empty)"
    marks = {"pending": "[ ]", "in_progress": "[~]", "completed": "[x]"}
    return "\n".join(
        f"{marks[t.status]} {t.active_form if t.status == 'in_progress' and t.active_form else t.content}"
        for t in todos
    )


def todos_json(todos: tuple[TodoItem, ...] | list[TodoItem]) -> list[dict[str, str]]:
    return [t.to_json() for t in todos]


def todos_from_json(rows: Any) -> tuple[TodoItem, ...]:
    return validate_todos(list(rows or ()))


class TodoWriteTool:
    """``todo_write(todos)``: replace the whole task list. Registered as its bound ``__call__``
    (``register_people_tools``). It only checks the list: the conversation actor journals it, numbers it
    (``TodoUpdated.version`` counts the lists of the conversation, journaled, so it keeps rising across a
    resume and a new tool host) and emits ``TodoUpdated`` on the sink the host's tools are bound to
    (ES-02)."""

    __name__ = TODO_WRITE

    def __call__(self, todos: list[dict[str, Any]]) -> str:
        """Replace the whole todo list. Each item: content, status (pending, in_progress or completed; at
        most one in_progress) and active_form (shown while it is in progress).

        Args:
            todos: the complete new list, in order
        """
        return json.dumps({"todos": todos_json(validate_todos(todos))})


class ExitPlanModeTool:
    """``exit_plan_mode(plan)``: propose the plan; the model gets a person's decision as the result."""

    __name__ = EXIT_PLAN_MODE

    def __call__(self, plan: str, sink: EventSinkLike | None = None, call_key: str = "") -> str:
        """Propose your plan and wait for a person to approve or reject it. Until a plan is approved,
        tools that change files or the world are denied.

        Args:
            plan: the plan, step by step
        """
        if not plan.strip():
            raise ValueError("the plan is empty")
        if sink is not None:
            sink.emit(PlanProposed(plan=plan, plan_id=call_key))
        return json.dumps({"proposed": True, "plan": plan})


class RequestPlanModeTool:
    """``request_plan_mode(reason)``: ask a person to turn plan mode on."""

    __name__ = REQUEST_PLAN_MODE

    def __call__(self, reason: str = "") -> str:
        """Ask a person to switch this session to plan mode (tools that change things are then denied
        until you propose a plan with exit_plan_mode and it is approved).

        Args:
            reason: why plan mode would help
        """
        return json.dumps({"requested": True, "reason": reason})


def register_people_tools(registry: Any) -> None:
    """Register ``todo_write``, ``exit_plan_mode`` and ``request_plan_mode`` (replacing same-named tools,
    ES-04). Each finishes at once and is safe to run again under its key; the waiting happens in the
    conversation."""
    registry.register(TodoWriteTool().__call__, name=TODO_WRITE, rerun_safe=True)
    registry.register(ExitPlanModeTool().__call__, name=EXIT_PLAN_MODE, rerun_safe=True)
    registry.register(RequestPlanModeTool().__call__, name=REQUEST_PLAN_MODE, rerun_safe=True)


# ------------------------------------------------------------------------------ journaled state


@dataclass
class PendingPlan:
    plan_id: str  # the proposing call's idempotency key
    kind: str  # "plan" (exit_plan_mode) or "mode_request" (request_plan_mode)
    plan: str
    decision: dict[str, Any] | None = None  # {"approved": bool, "reason": str | None} once decided


@dataclass
class PeopleState:
    """What the journal says about permissions, plans and todos (``apply`` one record at a time)."""

    decisions: dict[str, PermissionDecision] = field(default_factory=dict)  # key -> final allow / deny
    asks: dict[str, tuple[PermissionRequest, str | None]] = field(default_factory=dict)  # undecided
    plan_mode: bool = False
    plans: dict[str, PendingPlan] = field(default_factory=dict)
    todos: tuple[TodoItem, ...] = ()
    todo_version: int = 0

    RECORDS: ClassVar[tuple[str, ...]] = (
        "permission",
        "permission_asked",
        "plan_mode",
        "plan_proposed",
        "plan_decided",
        "todos",
    )

    def apply(self, record: Mapping[str, Any]) -> None:
        kind = record["type"]
        if kind == "permission":
            key = str(record["key"])
            self.decisions[key] = PermissionDecision.from_json(record["decision"])
            self.asks.pop(key, None)
        elif kind == "permission_asked":
            r = record["request"]
            request = PermissionRequest(
                key=str(r["key"]),
                call_id=str(r["call_id"]),
                tool_name=str(r["tool_name"]),
                arguments=dict(r["arguments"]),
                session_id=r.get("session_id"),
                mutating=bool(r.get("mutating", False)),
            )
            if request.key not in self.decisions:
                self.asks[request.key] = (request, record.get("reason"))
        elif kind == "plan_mode":
            self.plan_mode = bool(record["on"])
        elif kind == "plan_proposed":
            plan_id = str(record["plan_id"])
            if plan_id not in self.plans:
                self.plans[plan_id] = PendingPlan(plan_id, str(record["kind"]), str(record["plan"]))
        elif kind == "plan_decided":
            plan = self.plans.get(str(record["plan_id"]))
            if plan is not None and plan.decision is None:
                plan.decision = {"approved": bool(record["approved"]), "reason": record.get("reason")}
        elif kind == "todos":
            self.todos = todos_from_json(record["todos"])
            self.todo_version = int(record.get("version", 0))

    def pending(self, kind: str) -> PendingPlan | None:
        """The oldest undecided plan (or plan-mode request) of ``kind``."""
        for plan in self.plans.values():
            if plan.kind == kind and plan.decision is None:
                return plan
        return None


def plan_result(kind: str, decision: Mapping[str, Any]) -> str:
    """What the model gets back from ``exit_plan_mode`` / ``request_plan_mode`` once a person decided
    (PG-03..PG-06)."""
    if decision["approved"]:
        return json.dumps({"approved": True})
    return json.dumps({"approved": False, "reason": decision.get("reason") or ""})


# ----------------------------------------------------------------------------------- gate actors


@frozen(kw_only=True)
class GatePending:
    """Query a gate (or the conversation): the pending plan's text, or None. ``kind`` is set by the gate."""

    TAG: ClassVar[str] = "conv.gate.pending"
    kind: str = "plan"


@frozen(kw_only=True)
class GateDecide:
    """Decide the pending plan (or plan-mode request): ``plan_id`` "" means the one pending now. A decision
    with nothing pending, or on a plan decided already, changes nothing (PG-08): ``GateDecided(False)``."""

    TAG: ClassVar[str] = "conv.gate.decide"
    kind: str = "plan"
    approved: bool
    reason: str | None = None
    plan_id: str = ""


@frozen(kw_only=True)
class GatePlan:
    TAG: ClassVar[str] = "conv.gate.plan"
    plan: str | None
    plan_id: str | None = None


@frozen(kw_only=True)
class GateDecided:
    TAG: ClassVar[str] = "conv.gate.decided"
    decided: bool


class GateActor(BusActor):
    """A plan gate's own address (PG-01/PG-02): it relays ``GatePending`` / ``GateDecide`` of its ``kind``
    to the conversation actor, which keeps (and journals) the gate's state and answers them at once, even
    while a turn runs."""

    def __init__(self, node: Node, address: str, *, conversation: str, kind: str, timeout: float) -> None:
        super().__init__(node, address)
        self.conversation = conversation
        self.kind = kind
        self.timeout = timeout

    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case GatePending():
                forward: Any = GatePending(kind=self.kind)
            case GateDecide():
                forward = GateDecide(
                    kind=self.kind, approved=message.approved, reason=message.reason, plan_id=message.plan_id
                )
            case _:
                raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

        def relayed(reply: Reply) -> None:
            if ctx.done:
                return
            if reply.error is not None:
                ctx.fail(reply.error)
            else:
                ctx.reply(reply.message)

        self.ask(self.conversation, forward, relayed, timeout=self.timeout)
        return DEFER


class PlanApprovalGate:
    """A client of the plan-approval gate actor (``rt.plan_approval_gate()``); usable from any process."""

    kind: ClassVar[str] = "plan"

    def __init__(self, node: Node, address: str, *, timeout: float = 10.0) -> None:
        self.node = node
        self.address = address
        self.timeout = timeout

    def pending_plan(self) -> str | None:
        reply: GatePlan = self.node.request(self.address, GatePending(), timeout=self.timeout)
        return reply.plan

    def pending_plan_future(self) -> concurrent.futures.Future[Any]:
        future = self.node.request_future(self.address, GatePending(), timeout=self.timeout)
        return chained(future, lambda reply: reply.plan)

    def _decide(self, approved: bool, reason: str | None, plan_id: str) -> bool:
        message = GateDecide(approved=approved, reason=reason, plan_id=plan_id)
        reply: GateDecided = self.node.request(self.address, message, timeout=self.timeout)
        return reply.decided

    def _decide_future(
        self, approved: bool, reason: str | None, plan_id: str
    ) -> concurrent.futures.Future[Any]:
        message = GateDecide(approved=approved, reason=reason, plan_id=plan_id)
        future = self.node.request_future(self.address, message, timeout=self.timeout)
        return chained(future, lambda reply: reply.decided)

    def approve(self, plan_id: str = "") -> bool:
        """Approve the pending plan (or the one ``plan_id`` names); False if nothing was waiting."""
        return self._decide(True, None, plan_id)

    def approve_future(self, plan_id: str = "") -> concurrent.futures.Future[Any]:
        return self._decide_future(True, None, plan_id)

    def reject(self, reason: str, plan_id: str = "") -> bool:
        return self._decide(False, reason, plan_id)

    def reject_future(self, reason: str, plan_id: str = "") -> concurrent.futures.Future[Any]:
        return self._decide_future(False, reason, plan_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.address!r})"


class PlanModeRequestGate(PlanApprovalGate):
    """A client of the plan-mode-request gate actor (``rt.plan_mode_request_gate()``)."""

    kind: ClassVar[str] = "mode_request"


PEOPLE_MESSAGES = (GatePending, GateDecide, GatePlan, GateDecided)
