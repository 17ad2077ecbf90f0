"""People in the loop, the second round (issue 13): a wait for a person bounded on the injected clock, ended
by an interrupt, the todo version kept by the conversation, plan mode reading the mutating flag of the
conversation's own tools, and the ``*_future`` twins of the people facade methods.

Same set-up as test_conversation_people.py: the real conversation actor, its real tool host and the scripted
provider behind the real Router. ``ManualClock`` (tests/peers/loop_kit.py) is the conversation's clock.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, CaptureSink, call, text
from peers.loop_kit import ManualClock
from peers.people_kit import TWO, Hook, People, people_env, plan_turn, results, wait_until

from actors.conversation import (
    CancellationToken,
    ConversationRuntime,
    FinishReason,
    Message,
    WakeupSlot,
    read_journal,
)
from actors.conversation.actor import ConversationActor
from actors.conversation.permissions import PermissionAsked, PermissionDecision
from actors.conversation.tools import ToolSpec
from actors.conversation.types import PlanProposed, TodoUpdated
from transport.node import Node


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[People]:
    yield from people_env(make_node, tmp_path)


def asking(env: People) -> Hook:
    return Hook(env, lambda r: PermissionDecision.ask("a person decides"))


# ---------------------------------------------------------------- the bound on the injected clock


def test_an_ask_is_denied_when_the_conversation_clock_passes_ask_timeout(env: People) -> None:
    """PH-01 (ask): the wait for a person is bounded by ask_timeout on the conversation's clock, not a
    thread timer: nothing happens until the manual clock moves past it, then the call is denied with a
    reason that says so and never runs."""
    clock = ManualClock()
    rt = env.build(timers=clock, ask_timeout=30.0)
    rt.set_permission_hook(asking(env))
    env.script(call("record", "c1", a=1), text("ok"))
    future = rt.run_future("go")
    env.sink.wait_for(lambda e: isinstance(e, PermissionAsked))
    clock.wait_timer()
    assert clock.set_delays == [30.0]
    clock.advance(29.0)
    assert rt.pending_permissions() != () and not future.done()
    clock.advance(1.0)
    assert future.result(WAIT).finish_reason is FinishReason.STOP
    assert env.ran == [] and "no one decided within 30s" in results(rt)[0].content


def test_a_plan_nobody_decides_is_rejected_on_the_clock_and_a_decision_stops_the_timer(env: People) -> None:
    """PG-07: the plan is pending until a decision; ask_timeout on the conversation's clock is one (a
    rejection that says why). A person's decision before it cancels that timer."""
    clock = ManualClock()
    rt = env.build(timers=clock, ask_timeout=60.0, plan_mode=True)
    future = plan_turn(env, rt)
    clock.wait_timer()
    clock.advance(60.0)
    future.result(WAIT)
    assert json.loads(results(rt)[0].content) == {
        "approved": False,
        "reason": "no one decided within 60s",
    }
    assert rt.plan_approval_gate().pending_plan() is None and rt.plan_mode() is True
    env.script(call("exit_plan_mode", "p2", plan="again"), text("ok"))
    future = rt.run_future("again")
    env.sink.wait_for(lambda e: isinstance(e, PlanProposed) and e.plan == "again")
    assert wait_until(lambda: rt.confirm_plan())
    future.result(WAIT)
    assert clock.pending() == 0  # the decided plan's timer is gone


# ----------------------------------------------------------------------- an interrupt ends the wait


def test_an_interrupt_ends_an_ask_the_call_denied_and_journaled(env: People, tmp_path: Path) -> None:
    """IT-01/PH-02: cancelling the token while a call waits for a person ends the wait at once: the call is
    denied with a reason (it never runs), the turn ends CANCELLED, and the denial is journaled, so a
    resume from the file finds nothing to ask."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path)
    rt.set_permission_hook(asking(env))
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("record", "c1", a=1), text("never"))
    future = rt.run_future("go")
    asked = env.sink.wait_for(lambda e: isinstance(e, PermissionAsked))
    token.cancel()
    outcome = future.result(WAIT)
    assert outcome.finish_reason is FinishReason.CANCELLED
    assert results(rt) == [Message.tool("c1", "Permission denied: the turn was interrupted", is_error=True)]
    assert env.ran == [] and rt.pending_permissions() == ()
    people = read_journal(path).people
    assert people.asks == {}
    assert people.decisions[asked.request.key] == PermissionDecision.deny("the turn was interrupted")
    assert rt.answer_permission(asked.request.key, True) is False  # decided once, by the interrupt
    resumed = env.build(session_file=path)
    assert resumed.pending_permissions() == () and resumed.interrupted_turn() is None


def test_an_interrupt_ends_a_pending_plan_rejected_and_journaled(env: People, tmp_path: Path) -> None:
    """IT-01/PG-08: an interrupt while exit_plan_mode waits rejects the plan with the interrupt as the
    reason (journaled; no person's rejection message), plan mode stays on, the turn ends CANCELLED; a later
    decision on that plan changes nothing, and a resume holds no pending plan."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path, plan_mode=True)
    token = CancellationToken()
    rt.set_interrupt_token(token)
    future = plan_turn(env, rt)
    token.cancel()
    assert future.result(WAIT).finish_reason is FinishReason.CANCELLED
    assert json.loads(results(rt)[0].content) == {"approved": False, "reason": "the turn was interrupted"}
    assert rt.plan_approval_gate().pending_plan() is None and rt.plan_mode() is True
    assert rt.confirm_plan() is False
    assert not any(m.role == "user" and "rejected" in m.content for m in rt.transcript())
    (plan,) = read_journal(path).people.plans.values()
    assert plan.decision == {"approved": False, "reason": "the turn was interrupted"}
    assert env.build(session_file=path).plan_approval_gate().pending_plan() is None


def test_an_interrupt_ends_a_plan_mode_request(env: People) -> None:
    """IT-01/PG-06: an interrupt while request_plan_mode waits answers the tool
    {"approved": false, "reason": <the interrupt>} and leaves plan mode off."""
    rt = env.build()
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("request_plan_mode", "q1", reason="big"), text("never"))
    future = rt.run_future("ask")
    assert wait_until(lambda: rt.plan_mode_request_gate().pending_plan() is not None)
    token.cancel()
    assert future.result(WAIT).finish_reason is FinishReason.CANCELLED
    assert json.loads(results(rt)[0].content) == {"approved": False, "reason": "the turn was interrupted"}
    assert rt.plan_mode() is False


def test_an_interrupt_ends_an_ask_of_a_continued_turn(env: People, tmp_path: Path) -> None:
    """IT-01: an ask still pending at a crash waits again in continue_turn; an interrupt there denies it
    (journaled), and the continued turn ends CANCELLED before any model call."""
    path, crashed = tmp_path / "s.jsonl", tmp_path / "crashed.jsonl"
    rt = env.build(session_file=path)
    rt.set_permission_hook(asking(env))
    env.script(call("record", "c1", a=1), text("never"))
    future = rt.run_future("go")
    asked = env.sink.wait_for(lambda e: isinstance(e, PermissionAsked))
    shutil.copy(path, crashed)  # what a SIGKILL now leaves
    rt.answer_permission(asked.request.key, False, "first runtime")
    future.result(WAIT)
    resumed = env.build(session_file=crashed)
    token = CancellationToken()
    resumed.set_interrupt_token(token)
    calls_before = len(env.p1.inputs)
    continued = resumed.continue_turn_future()
    assert wait_until(lambda: len(env.sink.of(PermissionAsked)) >= 2)
    token.cancel()
    assert continued.result(WAIT).finish_reason is FinishReason.CANCELLED
    assert env.ran == [] and len(env.p1.inputs) == calls_before
    assert read_journal(crashed).people.decisions[asked.request.key].reason == "the turn was interrupted"


# ------------------------------------------------------------------------------ the todo version


def test_td02_the_todo_version_keeps_rising_across_a_resume(env: People, tmp_path: Path) -> None:
    """TD-02: TodoUpdated{todos, version}; the version counts the conversation's lists (journaled), so a
    resumed conversation with a new tool host goes on from it instead of starting at 1 again; an invalid
    list does not count."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path)
    env.script(call("todo_write", "t1", todos=TWO), text("ok"))
    rt.run("one")
    env.script(call("todo_write", "t2", todos=TWO[:1]), text("ok"))
    rt.run("two")
    bad = [{"content": "a", "status": "in_progress"}, {"content": "b", "status": "in_progress"}]
    env.script(call("todo_write", "t3", todos=bad), text("ok"))
    rt.run("bad")
    rt.stop()
    resumed = env.build(session_file=path)  # a new conversation actor and a new tool host
    env.script(call("todo_write", "t4", todos=TWO), text("ok"))
    resumed.run("three")
    assert wait_until(lambda: len(env.sink.of(TodoUpdated)) >= 3)
    assert [u.version for u in env.sink.of(TodoUpdated)] == [1, 2, 3]
    assert json.loads(results(resumed)[-1].content)["version"] == 3
    assert read_journal(path).people.todo_version == 3


def test_es03_todo_updated_stays_with_the_tools_sink_after_replace_event_sink(env: People) -> None:
    """ES-03 with the real TodoWriteTool: after replace_event_sink(s2) TodoUpdated still goes to the sink
    the tools were bound to (s1), while the runtime's own events go to s2."""
    rt = env.build()
    s2 = CaptureSink()
    rt.replace_event_sink(s2)
    env.script(call("todo_write", "t1", todos=TWO), text("ok"))
    rt.run("go")
    assert env.sink.wait_for(lambda e: isinstance(e, TodoUpdated)).version == 1
    s2.wait_for(lambda e: type(e).__name__ == "TurnFinished")
    assert s2.of(TodoUpdated) == []


# ---------------------------------------------------------- plan mode and the loops' own tools


def _flag_schedule_wakeup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Register schedule_wakeup mutating, as the loops do once they mark it (wakeups.py): the real spec,
    with only its flag set."""
    original = ConversationActor._local_specs

    def flagged(self: ConversationActor) -> tuple[ToolSpec, ...]:
        return tuple(
            ToolSpec(name=s.name, description=s.description, parameters=s.parameters, mutating=True)
            if s.name == "schedule_wakeup"
            else s
            for s in original(self)
        )

    monkeypatch.setattr(ConversationActor, "_local_specs", flagged)


@pytest.mark.parametrize("flagged", [True, False])
def test_plan_mode_reads_the_mutating_flag_of_the_conversations_own_tools(
    env: People, monkeypatch: pytest.MonkeyPatch, flagged: bool
) -> None:
    """Plan mode is enforced by the permission layer for the conversation's own tools too: a loop tool
    whose registration says mutating (schedule_wakeup here) is denied while plan mode is on, and one whose
    registration does not is run; the flag decides, not a list of names."""
    if flagged:
        _flag_schedule_wakeup(monkeypatch)
    rt = env.build(plan_mode=True)
    rt.register_wakeup_tool(WakeupSlot("s1"))
    env.script(call("schedule_wakeup", "w1", delay_seconds=5), text("ok"))
    rt.run("wake me")
    (result,) = results(rt)
    if flagged:
        assert result.content.startswith("Permission denied: plan mode is on: schedule_wakeup")
    else:
        assert "no wakeup loop is running" in result.content


def test_the_host_tools_specs_carry_their_mutating_flag(env: People) -> None:
    """The tool host's specs carry the flag each tool was registered with (write_file mutating, record
    not), so any reader of a registration sees it."""
    specs = {s.name: s for s in env.tools.specs()}
    assert specs["write_file"].mutating is True and specs["record"].mutating is False


# ------------------------------------------------------------------------ the *_future twins


def test_the_people_facade_methods_have_future_twins(env: People) -> None:
    """Every people method has a ``*_future`` twin with the same answer: set_permission_hook (PH-01),
    pending_permissions / answer_permission, set_plan_mode / plan_mode, confirm_plan (PG-03),
    current_todos (TD-01), kernel (CV-08), hook_stats, set_sdk_hook_forwarder (PH-04)."""
    rt = env.build()
    hook = asking(env)
    rt.set_permission_hook_future(hook).result(WAIT)
    env.script(call("record", "c1", a=1), text("ok"))
    future = rt.run_future("go")
    env.sink.wait_for(lambda e: isinstance(e, PermissionAsked))
    (pending,) = rt.pending_permissions_future().result(WAIT)
    assert rt.answer_permission_future(pending.key, True).result(WAIT) is True
    future.result(WAIT)
    assert env.ran == [{"a": 1, "b": 0}] and len(hook.requests) == 1
    rt.set_permission_hook_future(None).result(WAIT)

    rt.set_plan_mode_future(True).result(WAIT)
    assert rt.plan_mode_future().result(WAIT) is True
    future = plan_turn(env, rt)
    assert rt.plan_approval_gate().pending_plan_future().result(WAIT) == "1. read\n2. write"
    assert rt.confirm_plan_future().result(WAIT) is True
    assert rt.reject_plan_future("late").result(WAIT) is False
    future.result(WAIT)
    assert rt.plan_mode_future().result(WAIT) is False

    env.script(call("todo_write", "t1", todos=TWO), text("ok"))
    rt.run("todos")
    assert rt.current_todos_future().result(WAIT) == rt.current_todos()
    assert rt.kernel_future().result(WAIT) is rt.kernel()
    fresh = ConversationRuntime.connect(env.node, rt.address)
    assert fresh.kernel_future().result(WAIT) is fresh.kernel()

    class Quiet:
        def forward(self, hook_event: str, payload: dict[str, Any]) -> Any:
            return {}

    rt.set_sdk_hook_forwarder_future(Quiet()).result(WAIT)
    env.script(text("hello"))
    rt.run("hi")
    assert rt.hook_stats_future().result(WAIT).forwarded >= 2  # UserPromptSubmit, Stop
    rt.set_sdk_hook_forwarder_future(None).result(WAIT)


def test_plan_mode_request_futures(env: People) -> None:
    """PG-05/PG-06 through the twins: approve_plan_mode_request_future → {"approved": true};
    reject_plan_mode_request_future(reason) → {"approved": false, "reason": reason}."""
    rt = env.build()
    env.script(call("request_plan_mode", "q1"), text("ok"))
    future = rt.run_future("ask")
    assert wait_until(lambda: rt.approve_plan_mode_request_future().result(WAIT))
    future.result(WAIT)
    env.script(call("request_plan_mode", "q2"), text("ok"))
    future = rt.run_future("ask again")
    assert wait_until(lambda: rt.reject_plan_mode_request_future("no").result(WAIT))
    future.result(WAIT)
    assert [json.loads(m.content) for m in results(rt)] == [
        {"approved": True},
        {"approved": False, "reason": "no"},
    ]


def test_td03_current_todos_future_is_empty_when_the_store_cannot_be_read(env: People) -> None:
    """TD-03 through the twin: the conversation actor is stopped → the future resolves to [], no error."""
    rt = env.build()
    other = ConversationRuntime.connect(env.node, rt.address, timeout=1.0)
    rt.stop()
    assert other.current_todos_future(timeout=1.0).result(WAIT) == []
