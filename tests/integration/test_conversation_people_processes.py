"""People in the loop across processes over ipc (issue 13): a plan approved or rejected from another process
while the turn waits (PG-02), a conversation process SIGKILLed with a plan pending and decided once after
resume, and a permission hook in a process that was SIGKILLed (fail closed: the call is denied and does not
run)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import PEERS, PeerProcess
from peers.conversation_kit import Env, call, text

from actors.app.wiring import registry
from actors.conversation import ConversationRuntime, FinishReason
from transport import Node, Peer

pytestmark = pytest.mark.integration

WAIT = 60.0


def session_peer(spawn_peer: Callable[..., PeerProcess], ipc_dir: Path, *args: str) -> PeerProcess:
    """The conversation peer (tests/peers/conversation_peer.py) as ``brain`` (as in
    test_conversation_processes.py)."""
    data = ipc_dir / "brain-data"
    data.mkdir(exist_ok=True)
    return spawn_peer(
        "--name", "brain", "--bind", f"ipc://{ipc_dir}/brain.sock", "--data-dir", str(data), *args,
        script=PEERS / "conversation_peer.py", timeout=30,
    )  # fmt: skip


def client_node(make_node: Callable[..., Node], ipc_dir: Path) -> Node:
    node = make_node("tester", registry=registry(), peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock")])
    node.connect(node.peers()["brain"], wait=20)
    return node


PLAN = [{"call": {"name": "exit_plan_mode", "arguments": {"plan": "1. look\n2. change"}}, "id": "p1"}]


def wait_pending(rt: ConversationRuntime) -> str:
    """The plan the conversation holds, once it holds one (bounded by WAIT; each query is itself bounded).
    Bounded by time, not by a count of queries: faster queries must not shorten the wait."""
    gate = rt.plan_approval_gate()
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        plan = gate.pending_plan()
        if plan is not None:
            return plan
        rt.status()  # a round trip to the conversation, instead of a sleep
    raise AssertionError("no plan became pending")


@pytest.mark.parametrize("approve", [True, False], ids=["approve", "reject"])
def test_a_plan_is_decided_from_another_process_while_the_turn_waits(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node], approve: bool
) -> None:
    """PG-02/PG-03/PG-04 across processes: the turn waits in exit_plan_mode in the conversation's process;
    this process sees the plan through the gate's address and approves it (the turn goes on, plan mode
    ends) or rejects it (the tool gets the reason, the transcript a user message with it, plan mode stays
    on)."""
    scripts = [[*PLAN, {"text": "going on"}]]
    session = session_peer(spawn_peer, ipc_dir, "--scripts", json.dumps(scripts), "--people", "--plan-mode")
    node = client_node(make_node, ipc_dir)
    rt = ConversationRuntime.connect(node, session.info["address"], timeout=WAIT)
    future = rt.run_future("make a plan")
    assert wait_pending(rt) == "1. look\n2. change"
    assert not future.done()
    gate = rt.plan_approval_gate()
    assert (gate.approve() if approve else gate.reject("smaller steps")) is True
    assert future.result(WAIT).final_text == "going on"
    result = json.loads(next(m for m in rt.transcript() if m.role == "tool").content)
    if approve:
        assert result == {"approved": True} and rt.plan_mode() is False
    else:
        assert result == {"approved": False, "reason": "smaller steps"} and rt.plan_mode() is True
        last = rt.transcript()[-1]
        assert last.role == "user" and "smaller steps" in last.content


def test_sigkill_with_a_plan_pending_then_resume_and_decide_once(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node]
) -> None:
    """The conversation process is SIGKILLed while its plan waits; a new process on the same session file
    has the plan pending again (plan mode still on); this process rejects it once; the continued turn's
    tool result is exactly that rejection, and a second decision changes nothing."""
    journal = ipc_dir / "chat.jsonl"
    first = session_peer(
        spawn_peer, ipc_dir, "--scripts", json.dumps([[*PLAN, {"text": "never"}]]),
        "--session-file", str(journal), "--people", "--plan-mode",
    )  # fmt: skip
    node = client_node(make_node, ipc_dir)
    rt = ConversationRuntime.connect(node, first.info["address"], timeout=WAIT)
    rt.run_future("make a plan")
    wait_pending(rt)
    first.kill()

    second = session_peer(
        spawn_peer, ipc_dir, "--scripts", json.dumps([[{"text": "revised"}]]),
        "--session-file", str(journal), "--people",
    )  # fmt: skip
    node.connect(node.peers()["brain"], wait=20)
    rt2 = ConversationRuntime.connect(node, second.info["address"], timeout=WAIT)
    assert rt2.plan_approval_gate().pending_plan() == "1. look\n2. change"
    assert rt2.plan_mode() is True and rt2.interrupted_turn() == 0
    assert rt2.reject_plan("smaller steps") is True
    assert rt2.reject_plan("again") is False
    assert rt2.continue_turn().final_text == "revised"
    results = [m for m in rt2.transcript() if m.role == "tool" and m.tool_call_id == "p1"]
    assert [json.loads(m.content) for m in results] == [{"approved": False, "reason": "smaller steps"}]
    assert rt2.plan_mode() is True
    assert all("again" not in m.content for m in rt2.transcript())


def test_a_hook_in_a_killed_process_denies_the_call(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """Fail closed: the permission hook lives in another process; while it runs the call is checked
    there and runs; once that process is SIGKILLed the next call is denied with a reason and never runs."""
    hooks = spawn_peer(
        "--name", "hooks", "--bind", f"ipc://{ipc_dir}/hooks.sock", script=PEERS / "permission_hook_peer.py"
    )
    node = make_node("n1", registry=registry(), peers=[Peer("hooks", f"ipc://{ipc_dir}/hooks.sock")])
    node.connect(node.peers()["hooks"], wait=20)
    env = Env(node, tmp_path)
    rt = env.build()
    try:
        rt.set_permission_hook(hooks.info["address"], hook_timeout=2.0)
        env.script(call("add", "c1", a=1, b=2), text("three"))
        assert rt.run("add").final_text == "three"
        assert hooks.expect_line("CHECKED", timeout=WAIT) == "CHECKED add"
        hooks.kill()
        env.script(call("add", "c2", a=2, b=2), text("denied"))
        outcome = rt.run("add again")
        assert outcome.finish_reason is FinishReason.STOP
        result = [m for m in rt.transcript() if m.tool_call_id == "c2"][-1]
        assert result.is_error and result.content.startswith("Permission denied: the permission hook")
        assert "fail closed" in result.content
    finally:
        rt.stop()
