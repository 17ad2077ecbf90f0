"""The people-in-the-loop test kit (issue 13): ``People`` (the conversation kit's Env with the people tools,
a recording tool and the real workspace tools, registered mutating), a recording permission ``Hook``, and
helpers to start a turn that proposes a plan and to retry a decision until something is pending."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from peers.conversation_kit import WAIT, Env, call, text

from actors.app.builtin_tools import register_workspace_tools
from actors.conversation import ConversationRuntime, Message
from actors.conversation.permissions import PermissionRequest
from actors.conversation.types import PlanProposed
from transport.node import Node

TWO = [
    {"content": "read", "status": "completed", "active_form": "reading"},
    {"content": "write", "status": "in_progress", "active_form": "writing"},
]


class People(Env):
    """The kit's Env plus the people tools, a recording tool and the real workspace tools (mutating)."""

    def __init__(self, node: Node, tmp: Path) -> None:
        super().__init__(node, tmp)
        self.order: list[tuple[str, str]] = []
        self.ran: list[dict[str, Any]] = []

        def record(a: int, b: int = 0) -> str:
            """Record that it ran."""
            self.order.append(("run", f"{a}"))
            self.ran.append({"a": a, "b": b})
            return f"recorded {a} {b}"

        self.tools.register(record)
        self.workdir = tmp / "ws"
        self.workdir.mkdir()
        register_workspace_tools(self.tools, self.workdir)

    def build(self, **options: Any) -> ConversationRuntime:
        options.setdefault("people_tools", True)
        return super().build(**options)


def people_env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[People]:
    """The body of an ``env`` fixture: a People on node ``n1`` and the runtimes' cleanup."""
    from actors.app.wiring import registry

    e = People(make_node("n1", registry=registry()), tmp_path)
    yield e
    for rt in e.built:
        rt.stop()


class Hook:
    """A permission hook that records each request and answers from ``decide``."""

    def __init__(self, env: People, decide: Callable[[PermissionRequest], Any]) -> None:
        self.env = env
        self.decide = decide
        self.requests: list[PermissionRequest] = []

    def check(self, request: PermissionRequest) -> Any:
        self.requests.append(request)
        self.env.order.append(("hook", str(request.arguments.get("a"))))
        return self.decide(request)


def results(rt: ConversationRuntime) -> list[Message]:
    return [m for m in rt.transcript() if m.role == "tool"]


def plan_turn(env: People, rt: ConversationRuntime, plan: str = "1. read\n2. write") -> Any:
    env.script(call("exit_plan_mode", "p1", plan=plan), text("after the plan"))
    future = rt.run_future("plan it")
    env.sink.wait_for(lambda e: isinstance(e, PlanProposed))
    # The tool emits PlanProposed as it returns; the conversation holds the plan once the result reaches it.
    assert wait_until(lambda: rt.plan_approval_gate().pending_plan() is not None)
    return future


def wait_until(decide: Callable[[], bool]) -> bool:
    """Retry a decision until something is pending (bounded by WAIT); no sleeping on a condition."""
    done = threading.Event()
    for _ in range(int(WAIT / 0.05)):
        if decide():
            return True
        done.wait(0.05)
    return False
