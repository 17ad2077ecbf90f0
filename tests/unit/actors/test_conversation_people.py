"""People in the loop (issue 13): the permission hook (PH), plan mode and plan gates (PG), todos (TD), the
sink-holding people tools (ES-02, ES-04) and ``kernel()`` (CV-08), against the real conversation actor, its
real tool host and the scripted provider behind the real Router.

A crash is simulated as in test_conversation_durability.py: the session file is copied while a call waits
for a person (what a SIGKILL at that moment leaves on disk), and a new runtime resumes on the copy. The
multi-process tests (a decision from another process, a SIGKILLed conversation process, a hook in a killed
process) are in tests/integration/test_conversation_people_processes.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, CaptureSink, call, text
from peers.people_kit import TWO, Hook, People, people_env, plan_turn, results, wait_until

from actors.conversation import ConversationRuntime, FinishReason, Message, read_journal
from actors.conversation.permissions import (
    PermissionAsked,
    PermissionDecision,
    PermissionRequest,
    merge_input,
)
from actors.conversation.types import PlanProposed, TodoItem, TodoUpdated
from transport.logs import LogLimiter
from transport.node import Node


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[People]:
    yield from people_env(make_node, tmp_path)


# ------------------------------------------------------------------------------------- PH: hooks


def test_ph01_every_call_awaits_the_hook_before_it_runs(env: People) -> None:
    """PH-01: as many hook calls as tool calls, each before its tool's execution."""
    rt = env.build()
    hook = Hook(env, lambda r: PermissionDecision.allow())
    rt.set_permission_hook(hook)
    env.script(call("record", "c1", a=1), call("record", "c2", a=2), text("done"))
    assert rt.run("twice").finish_reason is FinishReason.STOP
    assert env.order == [("hook", "1"), ("run", "1"), ("hook", "2"), ("run", "2")]
    assert [r.key.rsplit(":", 1)[1] for r in hook.requests] == ["c1", "c2"]


def test_ph02_a_denied_call_never_runs_and_the_model_sees_the_reason(env: People, tmp_path: Path) -> None:
    """PH-02: a denied call does not execute; the model gets an error result with the hook's reason; the
    decision is journaled before the denial is shown."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path)
    rt.set_permission_hook(Hook(env, lambda r: PermissionDecision.deny("not on Fridays")))
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("try")
    assert env.ran == []
    assert results(rt) == [Message.tool("c1", "Permission denied: not on Fridays", is_error=True)]
    decided = [json.loads(line) for line in path.read_text().splitlines() if '"permission"' in line]
    assert [d["decision"]["behavior"] for d in decided] == ["deny"]


def test_ph03_a_later_hook_replaces_the_earlier_one(env: People) -> None:
    """PH-03: h1 then h2 → only h2 is called."""
    rt = env.build()
    h1 = Hook(env, lambda r: PermissionDecision.allow())
    h2 = Hook(env, lambda r: PermissionDecision.allow())
    rt.set_permission_hook(h1)
    rt.set_permission_hook(h2)
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("go")
    assert h1.requests == [] and len(h2.requests) == 1


def test_allow_with_updated_input_merges_the_keys_given(env: People) -> None:
    """An allow with ``updated_input`` replaces the keys given and keeps the others (the documented merge)."""
    assert merge_input({"a": 1, "b": 2}, {"b": 5}) == {"a": 1, "b": 5}
    rt = env.build()
    rt.set_permission_hook(Hook(env, lambda r: PermissionDecision.allow({"b": 7})))
    env.script(call("record", "c1", a=1, b=2), text("ok"))
    rt.run("go")
    assert env.ran == [{"a": 1, "b": 7}]


def test_a_hook_that_raises_denies_the_call(env: People) -> None:
    """Fail closed: a hook that raises denies the call, with a reason that says so; nothing runs."""

    def boom(r: PermissionRequest) -> Any:
        raise RuntimeError("hook bug")

    rt = env.build()
    rt.set_permission_hook(Hook(env, boom))
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("go")
    assert env.ran == []
    (result,) = results(rt)
    assert result.is_error and "the permission hook failed" in result.content and "hook bug" in result.content


def test_a_hook_that_times_out_denies_the_call(env: People) -> None:
    """Fail closed: a hook whose future never resolves within its timeout denies the call."""
    never: concurrent.futures.Future[PermissionDecision] = concurrent.futures.Future()
    rt = env.build()
    rt.set_permission_hook(Hook(env, lambda r: never), hook_timeout=0.3)
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("go")
    assert env.ran == []
    (result,) = results(rt)
    assert result.is_error and "did not answer within 0.3s" in result.content
    never.set_result(PermissionDecision.allow())  # a late answer changes nothing


def test_a_hook_that_cannot_be_reached_denies_the_call_and_fail_open_is_explicit(env: People) -> None:
    """Fail closed for a hook address nobody serves; ``fail_open=True`` is the explicit opposite."""
    rt = env.build()
    rt.set_permission_hook("n1/no-such-hook", hook_timeout=2.0)
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("go")
    assert env.ran == [] and "denied (fail closed)" in results(rt)[0].content
    rt.set_permission_hook("n1/no-such-hook", hook_timeout=2.0, fail_open=True)
    env.script(call("record", "c2", a=2), text("ok"))
    rt.run("go again")
    assert env.ran == [{"a": 2, "b": 0}]


def test_an_ask_waits_for_a_person_and_is_decided_once(env: People) -> None:
    """``ask``: the call waits (PermissionAsked on the sink, pending_permissions lists it) until a person
    decides; the first answer counts, a second changes nothing."""
    rt = env.build()
    rt.set_permission_hook(Hook(env, lambda r: PermissionDecision.ask("check it")))
    env.script(call("record", "c1", a=1), text("ok"))
    future = rt.run_future("go")
    asked = env.sink.wait_for(lambda e: isinstance(e, PermissionAsked))
    assert asked.reason == "check it"
    (pending,) = rt.pending_permissions()
    assert pending.key == asked.request.key and env.ran == []
    assert rt.answer_permission(pending.key, True) is True
    assert future.result(WAIT).finish_reason is FinishReason.STOP
    assert rt.answer_permission(pending.key, False, "too late") is False
    assert env.ran == [{"a": 1, "b": 0}] and rt.pending_permissions() == ()


def test_an_ask_nobody_answers_is_denied_after_its_bound(env: People) -> None:
    """Every wait is bounded: an ask nobody answers within ask_timeout is denied with a reason."""
    rt = env.build(ask_timeout=0.3)
    rt.set_permission_hook(Hook(env, lambda r: PermissionDecision.ask()))
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("go")
    assert env.ran == [] and "no one decided within 0.3s" in results(rt)[0].content


def test_an_ask_pending_at_a_crash_is_pending_after_resume_and_decided_once(
    env: People, tmp_path: Path
) -> None:
    """An ask still pending at a crash is pending after resume; the continued turn asks again by the same
    call key (the hook is not asked again); the person's one decision runs the call exactly once."""
    path, crashed = tmp_path / "s.jsonl", tmp_path / "crashed.jsonl"
    rt = env.build(session_file=path)
    hook = Hook(env, lambda r: PermissionDecision.ask())
    rt.set_permission_hook(hook)
    env.script(call("record", "c1", a=1), text("never"))
    future = rt.run_future("go")
    asked = env.sink.wait_for(lambda e: isinstance(e, PermissionAsked))
    shutil.copy(path, crashed)  # what a SIGKILL now leaves
    rt.answer_permission(asked.request.key, False, "first runtime")
    future.result(WAIT)
    assert read_journal(crashed).people.asks.keys() == {asked.request.key}
    resumed = env.build(session_file=crashed)
    resumed.set_permission_hook(hook)
    (pending,) = resumed.pending_permissions()
    assert pending.key == asked.request.key
    env.script(text("continued"))
    continued = resumed.continue_turn_future()
    sink_events = env.sink.of(PermissionAsked)
    assert resumed.answer_permission(pending.key, True) is True
    assert continued.result(WAIT).final_text == "continued"
    assert resumed.answer_permission(pending.key, False) is False
    assert env.ran == [{"a": 1, "b": 0}]  # once, by the resumed runtime's decision
    assert len(hook.requests) == 1 and len(sink_events) >= 1


# ------------------------------------------------------------------------- plan mode and gates


def test_plan_mode_denies_a_mutating_tool_the_model_calls_anyway(env: People) -> None:
    """Plan mode is enforced by the permission layer: write_file (registered mutating) is denied and the
    file is never written; a non-mutating tool still runs."""
    rt = env.build(plan_mode=True)
    env.script(call("write_file", "w1", path="x.txt", content="hi"), call("record", "r1", a=3), text("ok"))
    rt.run("write it")
    denied, _ran = results(rt)
    assert denied.is_error and "plan mode is on: write_file" in denied.content
    assert not (env.workdir / "x.txt").exists()
    assert env.ran == [{"a": 3, "b": 0}] and rt.plan_mode() is True


def test_pg01_the_gates_are_the_same_on_every_call(env: People, make_node: Callable[..., Node]) -> None:
    """PG-01: the same gate object from one facade; the same actor address from another facade."""
    rt = env.build()
    assert rt.plan_approval_gate() is rt.plan_approval_gate()
    assert rt.plan_mode_request_gate() is rt.plan_mode_request_gate()
    other = ConversationRuntime.connect(env.node, rt.address)
    assert other.plan_approval_gate().address == rt.plan_approval_gate().address
    assert rt.plan_approval_gate().address != rt.plan_mode_request_gate().address


def test_pg02_pg07_pending_plan_is_visible_mid_turn_until_decided(env: People) -> None:
    """PG-07: PlanProposed on the tool's sink, pending_plan is the plan until confirm_plan, then None;
    PG-02: the gate answers while the turn waits."""
    rt = env.build(plan_mode=True)
    future = plan_turn(env, rt, "the plan")
    gate = rt.plan_approval_gate()
    assert gate.pending_plan() == "the plan"
    assert env.sink.of(PlanProposed)[0].plan == "the plan"
    assert not future.done()
    assert rt.confirm_plan() is True
    future.result(WAIT)
    assert gate.pending_plan() is None


def test_pg03_confirm_plan_wakes_the_tool_with_an_approval_and_ends_plan_mode(env: People) -> None:
    """PG-03: the tool result shows the approval, the turn continues, plan mode is off."""
    rt = env.build(plan_mode=True)
    future = plan_turn(env, rt)
    rt.confirm_plan()
    assert future.result(WAIT).final_text == "after the plan"
    assert results(rt)[0].content == json.dumps({"approved": True})
    assert rt.plan_mode() is False


def test_pg04_reject_plan_carries_the_reason_and_plan_mode_stays_on(env: People) -> None:
    """PG-04: the tool result has the reason; the transcript gains user(...reason...) after the turn's
    messages, never between a call and its result; a rejected plan leaves plan mode on."""
    rt = env.build(plan_mode=True)
    future = plan_turn(env, rt)
    rt.reject_plan("too risky")
    future.result(WAIT)
    transcript = rt.transcript()
    assert json.loads(results(rt)[0].content) == {"approved": False, "reason": "too risky"}
    assert transcript[-1].role == "user" and "too risky" in transcript[-1].content
    assert transcript[-2].content == "after the plan"
    assert rt.plan_mode() is True


def test_pg05_pg06_plan_mode_requests(env: People) -> None:
    """PG-05: approve → {"approved": true} and plan mode on; PG-06: reject → exactly
    {"approved": false, "reason": reason}."""
    rt = env.build()
    env.script(call("request_plan_mode", "q1", reason="big change"), text("ok"))
    future = rt.run_future("ask")
    assert wait_until(lambda: rt.approve_plan_mode_request())
    future.result(WAIT)
    assert json.loads(results(rt)[0].content) == {"approved": True}
    assert rt.plan_mode() is True
    env.script(call("request_plan_mode", "q2"), text("ok"))
    future = rt.run_future("ask again")
    assert wait_until(lambda: rt.reject_plan_mode_request("no need"))
    future.result(WAIT)
    assert json.loads(results(rt)[-1].content) == {"approved": False, "reason": "no need"}


def test_pg08_a_decision_with_nothing_pending_changes_nothing(env: People) -> None:
    """PG-08: confirm with nothing pending → False and a later exit_plan_mode still waits; reject after
    confirm → False, and the tool saw only the approval."""
    rt = env.build(plan_mode=True)
    assert rt.confirm_plan() is False
    future = plan_turn(env, rt)
    assert not future.done() and rt.plan_approval_gate().pending_plan() is not None
    assert rt.confirm_plan() is True
    assert rt.reject_plan("late") is False
    plan_id = env.sink.of(PlanProposed)[0].plan_id  # the proposing call's idempotency key
    assert plan_id.endswith(":p1")
    assert rt.plan_approval_gate().reject("late", plan_id=plan_id) is False  # by its id: decided already
    future.result(WAIT)
    assert results(rt)[0].content == json.dumps({"approved": True})
    assert all("late" not in m.content for m in rt.transcript())


def test_a_plan_pending_at_a_crash_is_decided_exactly_once_after_resume(env: People, tmp_path: Path) -> None:
    """The pending plan survives a crash: after resume it is pending again (same plan id); continue_turn
    waits for it; one decision; the tool result holds exactly that decision."""
    path, crashed = tmp_path / "s.jsonl", tmp_path / "crashed.jsonl"
    rt = env.build(session_file=path, plan_mode=True)
    future = plan_turn(env, rt, "crash plan")
    assert rt.plan_approval_gate().pending_plan() == "crash plan"
    shutil.copy(path, crashed)
    rt.reject_plan("first runtime")
    future.result(WAIT)
    resumed = env.build(session_file=crashed)
    assert resumed.plan_approval_gate().pending_plan() == "crash plan"
    assert resumed.plan_mode() is True
    env.script(text("continued"))
    continued = resumed.continue_turn_future()
    assert resumed.confirm_plan() is True
    assert resumed.confirm_plan() is False
    assert continued.result(WAIT).final_text == "continued"
    plan_results = [m for m in results(resumed) if m.tool_call_id == "p1"]
    assert [m.content for m in plan_results] == [json.dumps({"approved": True})]
    assert resumed.plan_mode() is False


# ----------------------------------------------------------------------------------- TD: todos


def test_td01_td02_todo_write_replaces_the_list_and_snapshots_are_copies(env: People) -> None:
    """TD-02: todo_write of 2 items → current_todos has them and TodoUpdated{todos, version} reaches the
    sink; TD-01: a snapshot taken before a later todo_write is unchanged by it."""
    rt = env.build()
    assert rt.current_todos() == []
    env.script(call("todo_write", "t1", todos=TWO), text("ok"))
    rt.run("plan")
    first = rt.current_todos()
    assert [t.content for t in first] == ["read", "write"]
    update = env.sink.wait_for(lambda e: isinstance(e, TodoUpdated))
    assert list(update.todos) == first and update.version == 1
    env.script(call("todo_write", "t2", todos=[{"content": "only", "status": "pending"}]), text("ok"))
    rt.run("replace")
    assert [t.content for t in rt.current_todos()] == ["only"]
    assert [t.content for t in first] == ["read", "write"]


def test_an_invalid_todo_list_is_an_error_that_includes_the_current_list(env: People) -> None:
    """Two items in_progress: an error result that shows the current list; the list is unchanged."""
    rt = env.build()
    env.script(call("todo_write", "t1", todos=TWO), text("ok"))
    rt.run("plan")
    bad = [{"content": "a", "status": "in_progress"}, {"content": "b", "status": "in_progress"}]
    env.script(call("todo_write", "t2", todos=bad), text("ok"))
    rt.run("bad")
    result = results(rt)[-1]
    assert result.is_error and "at most one item may be in_progress" in result.content
    assert '"content": "read"' in result.content
    assert [t.content for t in rt.current_todos()] == ["read", "write"]


def test_td03_current_todos_is_empty_when_the_store_cannot_be_read(env: People) -> None:
    """TD-03: the conversation actor (the todo store) is stopped → current_todos() is [], no raise."""
    rt = env.build()
    env.script(call("todo_write", "t1", todos=TWO), text("ok"))
    rt.run("plan")
    other = ConversationRuntime.connect(env.node, rt.address, timeout=1.0)
    rt.stop()
    assert other.current_todos() == []


def test_td04_current_todos_answers_while_a_turn_runs(env: People) -> None:
    """TD-04: during a turn blocked in a tool, current_todos answers (bounded by its own short timeout)."""
    rt = env.build()
    env.script(call("todo_write", "t1", todos=TWO), call("gate", "g1", key="TD4"), text("ok"))
    future = rt.run_future("work")
    env.gates.wait_entered("TD4")
    assert [t.content for t in rt.current_todos(timeout=2.0)] == ["read", "write"]
    env.gates.open("TD4")
    future.result(WAIT)


def test_todos_survive_a_compaction_and_a_resume(env: People, tmp_path: Path) -> None:
    """After a compaction the model's next request contains the current list; a resumed session has it."""
    from actors.conversation import Compactor

    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path, compactor=Compactor(threshold_tokens=10**9, keep_recent_n=1))
    env.script(call("todo_write", "t1", todos=TWO), text("listed"))
    rt.run("plan")
    rt.run("more")
    env.script(text("the summary"))
    rt.compact_now()
    env.script(text("next"))
    rt.run("go on")
    assert "[~] writing" in env.p1.inputs[-1] and "[x] read" in env.p1.inputs[-1]
    resumed = env.build(session_file=path)
    assert [t.content for t in resumed.current_todos()] == ["read", "write"]


# -------------------------------------------------------------------------------- ES and CV


def test_es02_set_event_sink_routes_todo_and_plan_events_of_the_real_tools(env: People) -> None:
    """ES-02 with the real TodoWriteTool and ExitPlanModeTool: after set_event_sink(s2) their events reach
    s2 and not s1."""
    rt = env.build()
    s2 = CaptureSink()
    rt.set_event_sink(s2)
    env.script(call("todo_write", "t1", todos=TWO), call("exit_plan_mode", "p1", plan="P"), text("ok"))
    future = rt.run_future("go")
    s2.wait_for(lambda e: isinstance(e, PlanProposed))
    assert wait_until(lambda: rt.confirm_plan())
    future.result(WAIT)
    assert s2.wait_for(lambda e: isinstance(e, TodoUpdated)).version == 1
    assert env.sink.of(TodoUpdated, PlanProposed) == []


def test_es04_rebinding_keeps_the_people_tools_and_the_todo_list(env: People) -> None:
    """ES-04: set_event_sink replaces (does not duplicate) the sink-holding tools and keeps current_todos."""
    rt = env.build()
    env.script(call("todo_write", "t1", todos=TWO), text("ok"))
    rt.run("plan")
    names, todos = env.tools.names(), rt.current_todos()
    assert names.count("todo_write") == 1 and "exit_plan_mode" in names
    rt.set_event_sink(CaptureSink())
    assert env.tools.names() == names and len(env.tools) == len(names)
    assert rt.current_todos() == todos


def test_cv08_kernel_is_the_same_on_every_call(env: People) -> None:
    """CV-08: kernel() is the same object on every call, and the same address from another facade."""
    rt = env.build()
    kernel = rt.kernel()
    assert rt.kernel() is kernel
    assert kernel.address == rt.address
    assert ConversationRuntime.connect(env.node, rt.address).kernel() == kernel


def test_todo_items_are_values() -> None:
    item = TodoItem(content="x", status="pending")
    assert item.to_json() == {"content": "x", "status": "pending", "active_form": ""}


# ------------------------------------------------------------------------- PH-04: hook forwarder


class Forwarder:
    """An SDK hook forwarder that records (event, payload) and answers from ``answer``."""

    def __init__(self, answer: Callable[[str, dict[str, Any]], Any] = lambda e, p: {}) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.answer = answer
        self.arrived = threading.Condition()

    def forward(self, hook_event: str, payload: dict[str, Any]) -> Any:
        with self.arrived:
            self.calls.append((hook_event, payload))
            self.arrived.notify_all()
        return self.answer(hook_event, payload)

    def wait_for(self, n: int) -> None:
        """Until ``n`` calls arrived (bounded): the turn does not await notifications (Stop, SessionEnd)."""
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.calls) >= n, WAIT), self.calls


def test_ph04_hook_events_reach_the_forwarder_and_none_removes_it(env: People) -> None:
    """PH-04: with f installed, the turn's hook events and SessionEnd reach f as hook_callback requests
    (callback id, input, tool-use id); after set_sdk_hook_forwarder(None) no more calls."""
    rt = env.build()
    f = Forwarder()
    rt.set_sdk_hook_forwarder(f)
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("go")
    rt.close()
    f.wait_for(5)
    events = [e for e, _ in f.calls]
    assert events == ["UserPromptSubmit", "PreToolUse", "PostToolUse", "Stop", "SessionEnd"]
    pre = f.calls[1][1]
    assert pre["callback_id"] == "hook_0" and pre["tool_use_id"] == "c1"
    assert pre["input"]["tool_name"] == "record" and pre["input"]["tool_input"] == {"a": 1}
    assert f.calls[2][1]["input"]["tool_response"] == "recorded 1 0"
    rt2 = env.build()
    g = Forwarder()
    rt2.set_sdk_hook_forwarder(g)
    rt2.set_sdk_hook_forwarder(None)
    env.script(call("record", "c2", a=2), text("ok"))
    rt2.run("go")
    rt2.close()
    assert g.calls == []


def test_a_pre_tool_use_forwarder_blocks_or_changes_the_input(env: People) -> None:
    """PreToolUse may block (the call never runs, the model sees the reason) or change the input (merged;
    the permission hook sees the merged input); PostToolUse's additionalContext reaches the model."""

    def answer(event: str, payload: dict[str, Any]) -> Any:
        if event == "PreToolUse" and payload["input"]["tool_input"]["a"] == 1:
            return {"decision": "block", "reason": "one is blocked"}
        if event == "PreToolUse":
            return {"hookSpecificOutput": {"permissionDecision": "allow", "updatedInput": {"b": 9}}}
        if event == "PostToolUse":
            return {"hookSpecificOutput": {"additionalContext": "checked by the hook"}}
        return {}

    rt = env.build()
    rt.set_sdk_hook_forwarder(Forwarder(answer))
    hook = Hook(env, lambda r: PermissionDecision.allow())
    rt.set_permission_hook(hook)
    env.script(call("record", "c1", a=1), call("record", "c2", a=2, b=0), text("ok"))
    rt.run("go")
    blocked, changed = results(rt)
    assert blocked == Message.tool("c1", "Permission denied: one is blocked", is_error=True)
    assert env.ran == [{"a": 2, "b": 9}]
    assert hook.requests[-1].arguments == {"a": 2, "b": 9}
    assert changed.content == "recorded 2 9\n\n[hook context] checked by the hook"


def test_a_failing_forwarder_denies_pre_tool_use_and_never_ends_the_turn(env: People) -> None:
    """A PreToolUse forwarder that raises denies the call (fail closed); failures of the other events are
    logged and counted, and the turn finishes."""

    def answer(event: str, payload: dict[str, Any]) -> Any:
        raise RuntimeError(f"{event} broke")

    rt = env.build()
    rt.set_sdk_hook_forwarder(Forwarder(answer))
    env.script(call("record", "c1", a=1), text("still finished"))
    outcome = rt.run("go")
    assert outcome.final_text == "still finished" and env.ran == []
    (denied,) = results(rt)
    assert denied.is_error and "PreToolUse broke" in denied.content and "fail closed" in denied.content
    # UserPromptSubmit, PreToolUse, Stop: Stop is a notification the turn does not await, so its failure
    # may be counted just after run() returned
    assert wait_until(lambda: rt.hook_stats().failures == 3)
    stats = rt.hook_stats()
    assert stats.failures == stats.forwarded == 3


def test_a_forwarder_that_keeps_failing_is_logged_once_per_window_and_counted_every_time(
    env: People, caplog: pytest.LogCaptureFixture
) -> None:
    """Hostile input (issue 18): a peer may point the hook forwarder at a dead or failing address; each
    failure is counted, the log gets one line per window (the node's LogLimiter), not one per event."""

    def answer(event: str, payload: dict[str, Any]) -> Any:
        raise RuntimeError(f"{event} broke")

    env.node.log_limit = LogLimiter(monotonic=lambda: 0.0)  # one window for the whole test
    rt = env.build()
    rt.set_sdk_hook_forwarder(Forwarder(answer))
    env.script(call("record", "c1", a=1), text("one"), text("two"))
    with caplog.at_level(logging.WARNING, logger="actors.conversation.gatekeeper"):
        rt.run("go")
        rt.run("again")
        assert wait_until(lambda: rt.hook_stats().failures == 5)
    lines = [r for r in caplog.records if "hook forwarder failed" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]


def test_a_forwarder_callback_that_times_out_is_denied_and_cancelled(env: People) -> None:
    """Each callback has a timeout: a PreToolUse that does not answer in time denies the call, and the
    forwarder's pending future is cancelled (control_cancel_request)."""
    pending: list[concurrent.futures.Future[Any]] = []
    cancelled = threading.Event()

    def answer(event: str, payload: dict[str, Any]) -> Any:
        if event != "PreToolUse":
            return {}
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        future.add_done_callback(lambda f: cancelled.set() if f.cancelled() else None)
        pending.append(future)
        return future

    rt = env.build()
    rt.set_sdk_hook_forwarder(Forwarder(answer), callback_timeout=0.3)
    env.script(call("record", "c1", a=1), text("ok"))
    rt.run("go")
    assert env.ran == [] and "did not answer PreToolUse within 0.3s" in results(rt)[0].content
    assert cancelled.wait(WAIT) and pending[0].cancelled()
