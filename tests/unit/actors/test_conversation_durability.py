"""The conversation's write-ahead journal (actors/conversation/journal.py), continuing an interrupted turn,
and retry classes kept end to end (issue: durable agent work; DESIGN.md 4a).

A crash is simulated by copying the session file while the turn is still in flight (what a SIGKILL at that
moment leaves on disk) and resuming a new runtime on the copy; the multi-process SIGKILL tests are in
tests/integration/test_conversation_crash.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, Env, call, env_fixture, text

from actors.conversation import (
    ConversationError,
    FinishReason,
    Message,
    ToolHostActor,
    ToolRegistry,
    read_journal,
)
from actors.conversation.journal import Journal, unknown_outcome
from actors.conversation.messages import ExecuteTool
from actors.router.actor import RouterActor
from transport.errors import Expired, NotDelivered, Unavailable
from transport.node import Node


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    yield from env_fixture(make_node, tmp_path)


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_the_user_message_and_the_tool_call_are_on_disk_before_the_tool_runs(
    env: Env, tmp_path: Path
) -> None:
    """Write-ahead: while the tool runs, the journal already holds the user message and the call with its
    idempotency key (conversation id, turn, step, call id), and no result for it."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path)
    env.script(call("gate", "c1", key="G"), text("done"))
    future = rt.run_future("open the gate")
    env.gates.wait_entered("G")
    kinds = [r["type"] for r in records(path)]
    assert kinds == ["session", "turn_started", "tool_call"]
    session, started, tool_call = records(path)
    assert started["message"] == {"role": "user", "content": "open the gate"}
    assert tool_call["key"] == f"{session['conversation_id']}:0:1:c1"
    restored = read_journal(path)
    assert restored.interrupted is not None and restored.interrupted.turn_index == 0
    assert [c.call_id for c in restored.interrupted.pending] == ["c1"]
    env.gates.open("G")
    assert future.result(WAIT).finish_reason is FinishReason.STOP
    done = read_journal(path)
    assert done.interrupted is None
    assert done.transcript == rt.transcript()
    assert [m.role for m in done.transcript] == ["user", "assistant", "tool", "assistant"]


def test_a_crash_mid_tool_resumes_with_the_call_marked_unknown(env: Env, tmp_path: Path) -> None:
    """The transcript rule after a crash: the call journaled without a result comes back with a result
    that says its outcome is unknown; the turn counts (CV-05) and is offered for continue_turn."""
    path, crashed = tmp_path / "s.jsonl", tmp_path / "crashed.jsonl"
    rt = env.build(session_file=path)
    env.script(call("add", "c1", a=1, b=2), call("gate", "c2", key="K"), text("never"))
    future = rt.run_future("add, then wait")
    env.gates.wait_entered("K")
    shutil.copy(path, crashed)  # what a SIGKILL now would leave
    env.gates.open("K")
    future.result(WAIT)
    resumed = env.build(session_file=crashed)
    transcript = resumed.transcript()
    assert [m.role for m in transcript] == ["user", "assistant", "tool", "assistant", "tool"]
    assert transcript[2] == Message.tool("c1", "3")  # the finished call keeps its result
    assert transcript[3].tool_calls[0].id == "c2"
    assert transcript[4] == Message.tool("c2", unknown_outcome("gate"), is_error=True)
    assert resumed.interrupted_turn() == 0 and resumed.turn_index() == 1


def test_continue_turn_asks_the_host_again_by_the_same_key_and_the_model_goes_on(
    env: Env, tmp_path: Path
) -> None:
    """Continuing: the pending call is sent again with the key journaled before the crash, its real
    result replaces the placeholder, and the model continues the same turn (same turn index)."""
    path, crashed = tmp_path / "s.jsonl", tmp_path / "crashed.jsonl"
    rt = env.build(session_file=path)
    env.script(call("gate", "c1", key="C"), text("first run"))
    future = rt.run_future("wait")
    env.gates.wait_entered("C")
    shutil.copy(path, crashed)
    key = records(crashed)[-1]["key"]
    env.gates.open("C")
    future.result(WAIT)
    keys: list[str] = []
    env.node.spawn(KeySpyHost, "spy-host", registry=env.tools, keys=keys)
    resumed = env.build(session_file=crashed, host="n1/spy-host")
    env.script(text("continued"))
    outcome = resumed.continue_turn()
    assert keys == [key]
    assert outcome.turn_index == 0 and outcome.final_text == "continued"
    assert [m.content for m in resumed.transcript()][-2:] == ["gate C opened", "continued"]
    assert resumed.interrupted_turn() is None and resumed.turn_index() == 1
    again = read_journal(crashed)
    assert again.interrupted is None and again.transcript == resumed.transcript()
    with pytest.raises(ConversationError, match="no interrupted turn"):
        resumed.continue_turn()


class KeySpyHost(ToolHostActor):
    """A real ToolHostActor that also records the idempotency key of every ExecuteTool it gets."""

    def __init__(self, node: Node, address: str, *, registry: ToolRegistry, keys: list[str]) -> None:
        super().__init__(node, address, registry=registry)
        self.keys = keys

    def handle(self, message: Any, ctx: Any) -> Any:
        if isinstance(message, ExecuteTool):
            self.keys.append(message.idempotency_key)
        return super().handle(message, ctx)


def test_a_new_message_after_a_crash_closes_the_interrupted_turn_for_good(env: Env, tmp_path: Path) -> None:
    """Moving on instead of continuing: the placeholders are journaled and the turn is closed, so a later
    resume no longer offers it, and the transcript keeps its unknown outcome."""
    path, crashed = tmp_path / "s.jsonl", tmp_path / "crashed.jsonl"
    rt = env.build(session_file=path)
    env.script(call("gate", "c1", key="N"), text("x"))
    future = rt.run_future("wait")
    env.gates.wait_entered("N")
    shutil.copy(path, crashed)
    env.gates.open("N")
    future.result(WAIT)
    resumed = env.build(session_file=crashed)
    env.script(text("fresh"))
    assert resumed.run("something else").turn_index == 1
    restored = read_journal(crashed)
    assert restored.interrupted is None and restored.turn_index == 2
    assert restored.transcript == resumed.transcript()
    assert restored.transcript[2].content == unknown_outcome("gate")


def test_a_crash_between_the_turns_end_and_compaction_loses_nothing(tmp_path: Path) -> None:
    """A compaction is one record (the whole new transcript): a torn compaction line leaves the old
    transcript, never half of each."""
    path = tmp_path / "s.jsonl"
    journal = Journal(path)
    journal.session("conv")
    journal.turn_started(0, 0, Message.user("a"))
    journal.appended(1, Message.assistant("b"))
    journal.finished(0, FinishReason.STOP, _usage())
    journal.close()
    with path.open("a") as f:
        f.write('{"type":"compaction_boundary","trigger":"manual","transcript":[{"role":"sys')
    assert read_journal(path).transcript == (Message.user("a"), Message.assistant("b"))


def _usage() -> Any:
    from actors.conversation import ChatTokenUsage

    return ChatTokenUsage()


def test_a_failed_turn_keeps_its_completed_calls_on_resume(env: Env, tmp_path: Path) -> None:
    """CV-10 through the journal: the call that finished before the turn failed was journaled as it
    happened; after turn_failed, a resume has the user message and that call with its result, as the live
    transcript does, and nothing else of the turn."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path)
    env.script(call("add", "c1", a=1, b=1), {"fail": "failed", "message": "broken"})
    with pytest.raises(Exception, match="broken"):
        rt.run("add and break")
    assert read_journal(path).transcript == rt.transcript()
    assert [m.role for m in rt.transcript()] == ["user", "assistant", "tool"]


def test_not_delivered_before_anything_ran_reaches_the_caller_as_itself(env: Env, tmp_path: Path) -> None:
    """Retry classes: a Router that is not there → NotDelivered (nothing ran: retry is safe), not a
    provider InferenceError."""
    rt = env.build(router="n1/no-such-router")
    with pytest.raises(NotDelivered):
        rt.run("hello")


def test_not_delivered_after_the_turn_started_is_unavailable(env: Env, tmp_path: Path) -> None:
    """Retry classes: the Router gone while a tool runs (a provider turn had started and a tool ran): the
    caller gets Unavailable (outcome unknown), with the hop's NotDelivered as its cause, and the turn keeps
    what its tools did."""
    env.node.spawn(RouterActor, "router2", catalog=env_catalog(env), providers={"p1": env.p1, "p2": env.p2})
    rt = env.build(router="n1/router2")
    env.script(call("gate", "c1", key="R"), text("never"))
    future = rt.run_future("wait")
    env.gates.wait_entered("R")
    ref = env.node.lookup("router2")
    assert ref is not None
    ref.stop(block=True, timeout=WAIT)
    env.gates.open("R")
    with pytest.raises(Unavailable) as err:
        future.result(WAIT)
    assert isinstance(err.value.__cause__, NotDelivered)
    # The turn is suspended, not failed: the tool's result is kept and continue_turn can go on with it.
    assert rt.interrupted_turn() == 0
    assert [m.content for m in rt.transcript()][-1] == "gate R opened"


def env_catalog(env: Env) -> Any:
    from peers.conversation_kit import CATALOG

    return CATALOG


def test_a_tool_past_its_timeout_suspends_the_turn_with_the_call_pending(env: Env, tmp_path: Path) -> None:
    """A tool call past ``tool_timeout``: its outcome is unknown, so the caller gets Expired (not a
    failed result the model could retry blindly), the call shows an unknown outcome, and continue_turn
    sends it again under the same key."""
    path = tmp_path / "s.jsonl"
    keys: list[str] = []
    env.node.spawn(KeySpyHost, "spy-host", registry=env.tools, keys=keys)
    rt = env.build(session_file=path, host="n1/spy-host", tool_timeout=0.5)
    env.script(call("gate", "c1", key="T"), text("never"))
    with pytest.raises(Expired):
        rt.run("wait too long")
    assert rt.interrupted_turn() == 0
    assert rt.transcript()[-1] == Message.tool("c1", unknown_outcome("gate"), is_error=True)
    env.gates.open("T")  # the slow run finishes on the host; the host answers the repeat
    env.script(text("went on"))
    assert rt.continue_turn().final_text == "went on"
    assert len(keys) == 2 and keys[0] == keys[1]
