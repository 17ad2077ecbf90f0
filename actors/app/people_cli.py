"""People in the loop at the terminal (issue 13): what ``kbus chat`` and ``kbus run`` add for plans,
permission asks and todos (agent.py and chat.py call these; they live apart so the two files merge easily).

- Every conversation gets ``todo_write``, ``exit_plan_mode`` and ``request_plan_mode``; a todo update prints
  as a checklist.
- ``--plan`` starts in plan mode (the workspace tools are denied until a plan is approved).
- ``--ask TOOL`` (repeatable): a permission hook answers ``ask`` for that tool, ``allow`` for the others.
- A proposed plan is printed and the terminal asks ``approve / reject``; an ``ask`` prompts ``allow / deny``.
  The questions are asked on the main thread while it waits for the turn. ``kbus chat`` always asks (it
  reads its input lines); ``kbus run`` asks only on a terminal, and otherwise denies an ``ask`` (rejects a
  plan) with a reason that says there was no terminal to ask.
"""

from __future__ import annotations

import argparse
import queue
import sys
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["AskTools", "People", "add_people_arguments", "configure_builder"]

NO_TERMINAL = "no one could be asked: kbus run has no terminal"


def add_people_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", action="store_true", help="start in plan mode: mutating tools need a plan first")
    p.add_argument(
        "--ask",
        action="append",
        metavar="TOOL",
        default=[],
        help="ask in the terminal before TOOL runs (repeatable)",
    )


def configure_builder(builder: Any, args: argparse.Namespace) -> Any:
    return builder.people_tools(True).plan_mode(bool(getattr(args, "plan", False)))


class AskTools:
    """The ``--ask`` permission hook: ``ask`` for the tools named, ``allow`` for the others."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def check(self, request: Any) -> Any:
        from actors.conversation.permissions import PermissionDecision

        if request.tool_name in self.names:
            return PermissionDecision.ask(f"--ask {request.tool_name}")
        return PermissionDecision.allow()


class People:
    """The terminal side: prints plans and todo lists, and asks the person (on the main thread)."""

    def __init__(
        self,
        runtime: Any,
        out: TextIO,
        *,
        interactive: bool,
        read: Callable[[str], str] = input,
    ) -> None:
        self.runtime = runtime
        self.out = out
        self.interactive = interactive
        self.read = read
        self.questions: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()

    # on the sink's thread: print, and queue a question for the main thread
    def emit(self, event: Any, write: Callable[[str], None]) -> None:
        from actors.conversation.people import render_todos
        from actors.conversation.permissions import PermissionAsked
        from actors.conversation.types import PlanProposed, TodoUpdated

        match event:
            case TodoUpdated(todos=todos, version=version):
                write(f"[todos v{version}]\n{render_todos(todos)}\n")
            case PlanProposed(plan=plan):
                write(f"[plan proposed]\n{plan}\n")
                self.questions.put(("plan", event))
            case PermissionAsked(request=request, reason=reason):
                write(f"[permission] {request.tool_name} {request.arguments} ({reason or 'asked'})\n")
                self.questions.put(("ask", event))

    # on the main thread, between polls of the running turn
    def poll(self) -> None:
        while True:
            try:
                kind, event = self.questions.get_nowait()
            except queue.Empty:
                return
            if kind == "plan":
                self._plan()
            else:
                self._ask(event)

    def _answer(self, prompt: str) -> tuple[bool, str | None]:
        if not self.interactive:
            return False, NO_TERMINAL
        try:
            line = self.read(prompt).strip()
        except EOFError:
            return False, "the terminal closed"
        verb, _, reason = line.partition(" ")
        if verb.lower() in ("a", "approve", "y", "yes", "allow"):
            return True, None
        return False, reason.strip() or "rejected in the terminal"

    def _plan(self) -> None:
        approved, reason = self._answer("approve / reject [reason]> ")
        gate = self.runtime.plan_approval_gate()
        for _ in range(100):  # the plan becomes pending as its result reaches the conversation
            if gate.pending_plan() is not None:
                break
            self.runtime.status()
        if approved:
            self.runtime.confirm_plan()
        else:
            self.runtime.reject_plan(reason or "rejected")
        self.out.write("[plan approved]\n" if approved else f"[plan rejected] {reason}\n")
        self.out.flush()

    def _ask(self, event: Any) -> None:
        allow, reason = self._answer(f"allow {event.request.tool_name}? allow / deny [reason]> ")
        self.runtime.answer_permission(event.request.key, allow, reason)
        self.out.write("[allowed]\n" if allow else f"[denied] {reason}\n")
        self.out.flush()


def install(agent: Any) -> None:
    """After the conversation is built: the ``--ask`` hook and the terminal side."""
    args = agent.args
    interactive = bool(getattr(args, "interactive", sys.stdin.isatty()))
    people = People(agent.runtime, agent.err, interactive=interactive)  # status and questions: stderr
    if getattr(args, "ask", None):
        agent.runtime.set_permission_hook(AskTools(set(args.ask)))
    agent.printer.other = lambda event: people.emit(event, agent.printer._write)
    agent.on_poll = people.poll
