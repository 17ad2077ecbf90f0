"""ConversationRuntime across processes over ipc: many clients enqueueing into one conversation (QU-01..05),
an interrupt from another process during a tool call (IT-06), and resuming a killed session from its JSONL
(CP-06)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import PEERS, PeerProcess

from actors.app.wiring import registry
from actors.conversation import (
    CancellationToken,
    ConversationRuntime,
    FinishReason,
    Message,
    read_journal,
)
from transport import Node, Peer

pytestmark = pytest.mark.integration

WAIT = 60.0


def session_peer(
    spawn_peer: Callable[..., PeerProcess], ipc_dir: Path, *args: str, name: str = "brain"
) -> PeerProcess:
    data = ipc_dir / f"{name}-data"
    data.mkdir(exist_ok=True)
    return spawn_peer(
        "--name", name, "--bind", f"ipc://{ipc_dir}/{name}.sock", "--data-dir", str(data), *args,
        script=PEERS / "conversation_peer.py", timeout=30,
    )  # fmt: skip


def client_node(make_node: Callable[..., Node], ipc_dir: Path, server: str = "brain") -> Node:
    node = make_node("tester", registry=registry(), peers=[Peer(server, f"ipc://{ipc_dir}/{server}.sock")])
    node.connect(node.peers()[server], wait=20)
    return node


def no_orphans(messages: tuple[Message, ...]) -> bool:
    calls = {c.id for m in messages for c in m.tool_calls}
    results = {m.tool_call_id for m in messages if m.role == "tool"}
    return calls == results


def journal_messages(path: Path) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["message"] for r in rows if r["type"] == "message_appended"]


def test_three_client_processes_enqueue_100_messages_each(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node]
) -> None:
    """QU-01/QU-04/QU-05 over ipc: 3 processes x 100 enqueues at once → all 300 answered, each process's
    messages in its own order, every outcome the turn of its own message, none lost."""
    session = session_peer(spawn_peer, ipc_dir)
    address = session.info["address"]
    clients = [
        spawn_peer(
            "--name",
            f"client{i}",
            "--server",
            f"brain=ipc://{ipc_dir}/brain.sock",
            "--address",
            address,
            "--count",
            "100",
            "--tag",
            f"P{i}",
            script=PEERS / "conversation_client.py",
        )
        for i in range(3)
    ]
    results = [json.loads(c.expect_line("RESULT", timeout=110)[7:]) for c in clients]
    for result in results:
        assert "outcomes" in result, result
    node = client_node(make_node, ipc_dir)
    transcript = ConversationRuntime.connect(node, address, timeout=WAIT).transcript()
    assert len(transcript) == 600  # user + answer per turn
    seen: set[int] = set()
    for i, result in enumerate(results):
        outcomes = result["outcomes"]
        assert [text for text, _, _ in outcomes] == [f"P{i}-{n}" for n in range(100)]
        indices = [turn for _, turn, _ in outcomes]
        assert indices == sorted(indices)  # this process's messages ran in its own order
        for text, turn, final in outcomes:
            assert transcript[2 * turn] == Message.user(text)  # the outcome of this caller's own message
            assert transcript[2 * turn + 1] == Message.assistant(final)
        seen.update(indices)
    assert seen == set(range(300))


def test_interrupt_from_another_process_during_a_tool_call(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node]
) -> None:
    """IT-06, IT-02: the turn is inside a tool in the session process; this process cancels the token →
    CANCELLED after that tool's result; neither the transcript nor the JSONL keeps an orphan call."""
    scripts = [
        [{"call": {"name": "add", "arguments": {"a": 1, "b": 2}}, "id": "c1"}, {"text": "3"}],
        [
            {"call": {"name": "hold", "arguments": {"key": "k1"}}, "id": "c2"},
            {"call": {"name": "add", "arguments": {"a": 5, "b": 5}}, "id": "c3"},
            {"text": "never said"},
        ],
    ]
    journal = ipc_dir / "chat.jsonl"
    session = session_peer(
        spawn_peer, ipc_dir, "--scripts", json.dumps(scripts), "--session-file", str(journal)
    )
    node = client_node(make_node, ipc_dir)
    rt = ConversationRuntime.connect(node, session.info["address"], timeout=WAIT)
    assert rt.run("1+2").final_text == "3"
    token = CancellationToken()
    rt.set_interrupt_token(token)
    future = rt.run_future("hold on")
    session.expect_line("TOOL_ENTERED k1", timeout=WAIT)
    token.cancel()  # a control: applied while the session's turn is blocked in the tool
    assert rt.status().busy and not future.done()
    assert session.proc.stdin is not None
    session.proc.stdin.write("RELEASE k1\n")
    session.proc.stdin.flush()
    outcome = future.result(WAIT)
    assert outcome.finish_reason is FinishReason.CANCELLED and outcome.steps == 1
    transcript = rt.transcript()
    assert [m.tool_call_id for m in transcript if m.role == "tool"] == ["c1", "c2"]
    assert transcript[-1] == Message.tool("c2", "k1 released")
    assert no_orphans(transcript)
    restored = read_journal(journal)
    assert restored.transcript == transcript and no_orphans(restored.transcript)
    rows = journal_messages(journal)
    assert {c["id"] for r in rows for c in r.get("tool_calls", ())} == {"c1", "c2"}


def test_a_killed_session_resumes_from_its_jsonl(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node]
) -> None:
    """Persistence: turns, a compaction and more turns; SIGKILL the session process; a new process on the
    same file has the same transcript and turn index, and the compacted messages stay skipped."""
    scripts = [
        [{"call": {"name": "add", "arguments": {"a": 2, "b": 2}}, "id": "c1"}, {"text": "four"}],
        [{"text": "second answer"}],
        [{"text": "third answer"}],
        [{"text": "SUMMARY: arithmetic was done"}],
        [{"text": "after compaction"}],
    ]
    journal = ipc_dir / "chat.jsonl"
    args = ("--scripts", json.dumps(scripts), "--session-file", str(journal), "--keep-recent", "2")
    first = session_peer(spawn_peer, ipc_dir, *args)
    node = client_node(make_node, ipc_dir)
    rt = ConversationRuntime.connect(node, first.info["address"], timeout=WAIT)
    for text in ("2+2", "second", "third"):
        rt.run(text)
    rt.compact_now()
    rt.run("fourth")
    before, turns = rt.transcript(), rt.turn_index()
    assert before[0].role == "system" and "SUMMARY" in before[0].content
    assert Message.user("2+2") not in before
    first.kill()

    second = session_peer(spawn_peer, ipc_dir, *args)
    node.connect(node.peers()["brain"], wait=20)  # the same endpoint, a new process
    rt2 = ConversationRuntime.connect(node, second.info["address"], timeout=WAIT)
    assert rt2.transcript() == before
    assert rt2.turn_index() == turns == 4
    boundary_rows = [r for r in journal.read_text().splitlines() if '"compaction_boundary"' in r]
    assert len(boundary_rows) == 1
    assert read_journal(journal).boundaries == 1
