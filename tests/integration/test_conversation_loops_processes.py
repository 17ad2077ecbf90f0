"""Goals, wakeups and background jobs across real processes over ipc (issue 12): SIGKILL of the
conversation's process during a wakeup sleep and during a goal loop between turns, then a resume from its
journal in a new process; a job runner in another process, its SIGKILL, and a job's children gone after
close. Every process is ended by its PID (the spawn_peer finaliser)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import PEERS, PeerProcess
from peers.conversation_kit import Gates
from peers.loop_kit import gone, read_pid

from actors.app.wiring import registry
from actors.conversation import ConversationRuntime, ToolRegistry, read_journal
from actors.conversation.jobs import BackgroundJobManager
from actors.conversation.loops import AUTO_PROMPT
from actors.conversation.runtime import WakeupSlot
from actors.conversation.types import JobFinished, JobStarted
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from transport import Node, Peer

pytestmark = pytest.mark.integration

WAIT = 60.0


def loop_peer(
    spawn_peer: Callable[..., PeerProcess], ipc_dir: Path, session: Path, scripts: list[Any], *args: str
) -> PeerProcess:
    data = ipc_dir / "brain-data"
    data.mkdir(exist_ok=True)
    return spawn_peer(
        "--name", "brain", "--bind", f"ipc://{ipc_dir}/brain.sock", "--data-dir", str(data),
        "--session-file", str(session), "--scripts", json.dumps(scripts), *args,
        script=PEERS / "loop_peer.py", timeout=30,
    )  # fmt: skip


def client(make_node: Callable[..., Node], ipc_dir: Path, name: str) -> Node:
    node = make_node(name, registry=registry(), peers=[Peer("brain", f"ipc://{ipc_dir}/brain.sock")])
    node.connect(node.peers()["brain"], wait=20)
    return node


def text(body: str) -> list[dict[str, Any]]:
    return [{"text": body}]


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def users(rt: ConversationRuntime) -> list[str]:
    return [m.content for m in rt.transcript() if m.role == "user"]


def test_sigkill_during_a_wakeup_sleep_then_the_resumed_loop_fires_it_once(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """The conversation process is SIGKILLed while its loop sleeps on a 1 s wakeup; a new process resumes
    the session file; run_loop on the same slot fires the wakeup exactly once (one turn with its prompt)."""
    session = tmp_path / "s.jsonl"
    wake = [
        {
            "call": {"name": "schedule_wakeup", "arguments": {"delay_seconds": 1, "prompt": "woken"}},
            "id": "w1",
        }
    ]
    first = loop_peer(spawn_peer, ipc_dir, session, [[*wake, {"text": "sleeping"}]])
    node = client(make_node, ipc_dir, "tester1")
    rt = ConversationRuntime.connect(node, first.info["address"], timeout=WAIT)
    rt.run_loop_future("watch", WakeupSlot("s1"))
    first.expect_line("EVENT WakeupWaiting", timeout=WAIT)
    first.kill()
    restored = read_journal(session).loops
    assert restored.loop is not None and "s1" in restored.slots

    second = loop_peer(spawn_peer, ipc_dir, session, [text("awake"), text("never")])
    node2 = client(make_node, ipc_dir, "tester2")
    rt2 = ConversationRuntime.connect(node2, second.info["address"], timeout=WAIT)
    outcomes = rt2.run_loop("watch", WakeupSlot("s1"))
    assert [o.final_text for o in outcomes] == ["awake"]
    assert users(rt2) == ["watch", "woken"]
    assert [r["type"] for r in records(session)].count("wakeup_fired") == 1
    assert read_journal(session).loops.loop is None


def test_sigkill_during_a_goal_loop_between_turns_then_it_continues_with_its_turn_count(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """SIGKILL while the evaluator judges turn 1; the resumed process knows the goal with turns=1, and
    run_goal_loop continues: it judges turn 1, then runs turns 2 and 3 (max_turns=3), never turn 1 again."""
    session = tmp_path / "s.jsonl"
    first = loop_peer(spawn_peer, ipc_dir, session, [text("turn one")], "--hold-judge")
    node = client(make_node, ipc_dir, "tester1")
    rt = ConversationRuntime.connect(node, first.info["address"], timeout=WAIT)
    rt.run_goal_loop_future("go", "the tests pass", 3)
    first.expect_line("JUDGING 1", timeout=WAIT)
    first.kill()

    verdicts = json.dumps([{"achieved": False, "reason": "still red"}, {"achieved": False, "reason": "red"}])
    second = loop_peer(
        spawn_peer, ipc_dir, session, [text("turn two"), text("turn three")], "--verdicts", verdicts
    )
    node2 = client(make_node, ipc_dir, "tester2")
    rt2 = ConversationRuntime.connect(node2, second.info["address"], timeout=WAIT)
    goal = rt2.current_goal()
    assert goal is not None and goal.turns == 1 and goal.condition == "the tests pass"
    outcomes = rt2.run_goal_loop("go", "the tests pass", 3)
    assert [o.final_text for o in outcomes] == ["turn two", "turn three"]
    assert [o.turn_index for o in outcomes] == [1, 2]
    assert users(rt2) == [
        "go",
        AUTO_PROMPT.format(condition="the tests pass", reason="still red"),
        AUTO_PROMPT.format(condition="the tests pass", reason="red"),
    ]
    assert rt2.current_goal() is None
    second.expect_line('EVENT GoalCleared {"reason": "budget_exceeded"}', timeout=WAIT)


def test_gl06_sigkill_between_turn_finished_and_goal_turn_then_the_resume_stays_within_max_turns(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """GL-06 across a SIGKILL at the exact point (the peer's fault hook, a fake, holds the conversation
    right after turn 2's ``turn_finished`` is on disk, before its ``goal_turn``): max_turns=2, and the
    resumed process counts turn 2 from its tagged ``turn_started``, so run_goal_loop ends with
    GoalCleared(budget_exceeded) and never starts a third turn or asks the judge again."""
    session = tmp_path / "s.jsonl"
    verdicts = json.dumps([{"achieved": False, "reason": "red"}])
    first = loop_peer(
        spawn_peer, ipc_dir, session, [text("one"), text("two")], "--verdicts", verdicts,
        "--fake-crash-after-turn-finished", "2",
    )  # fmt: skip
    node = client(make_node, ipc_dir, "tester1")
    rt = ConversationRuntime.connect(node, first.info["address"], timeout=WAIT)
    rt.run_goal_loop_future("go", "the tests pass", 2)
    first.expect_line("CRASH_POINT turn_finished 2", timeout=WAIT)
    first.kill()
    kinds_on_disk = [r["type"] for r in records(session)]
    assert kinds_on_disk[-1] == "turn_finished" and kinds_on_disk.count("goal_turn") == 1

    second = loop_peer(spawn_peer, ipc_dir, session, [text("three: past max_turns")], "--verdicts", verdicts)
    node2 = client(make_node, ipc_dir, "tester2")
    rt2 = ConversationRuntime.connect(node2, second.info["address"], timeout=WAIT)
    goal = rt2.current_goal()
    assert goal is not None and goal.turns == 2
    assert rt2.run_goal_loop("go", "the tests pass", 2) == []
    assert [r["type"] for r in records(session)].count("turn_started") == 2
    assert rt2.current_goal() is None
    second.expect_line('EVENT GoalCleared {"reason": "budget_exceeded"}', timeout=WAIT)


def runner_peer(spawn_peer: Callable[..., PeerProcess], ipc_dir: Path, name: str) -> PeerProcess:
    return spawn_peer(
        "--name", name, "--bind", f"ipc://{ipc_dir}/{name}.sock", "--peer", f"owner=ipc://{ipc_dir}/owner.sock",
        script=PEERS / "job_runner_peer.py", timeout=30,
    )  # fmt: skip


class Sink:
    def __init__(self) -> None:
        import queue

        self.events: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def emit(self, event: Any) -> None:
        self.events.put(event)

    def next(self, kind: type[Any]) -> Any:
        while True:
            event = self.events.get(timeout=WAIT)
            if isinstance(event, kind):
                return event


def owner_and_runner(
    make_node: Callable[..., Node], spawn_peer: Callable[..., PeerProcess], ipc_dir: Path
) -> tuple[Node, PeerProcess]:
    """The conversation's node (bound first: the runner connects to it to tell completions) and a runner."""
    node = make_node(
        "owner",
        registry=registry(),
        bind=[f"ipc://{ipc_dir}/owner.sock"],
        peers=[Peer("runner", f"ipc://{ipc_dir}/runner.sock")],
    )
    runner = runner_peer(spawn_peer, ipc_dir, "runner")
    node.connect(node.peers()["runner"], wait=20)
    return node, runner


def test_jobs_on_a_runner_in_another_process_two_completions_two_turns_and_no_child_left(
    ipc_dir: Path, spawn_peer: Callable[..., PeerProcess], make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """The job runner is another process: two jobs finishing during one turn (the one started second
    finishes first) make two turns, in completion order; then close ends a running job's whole process
    group (its grandchild is gone)."""
    node, _ = owner_and_runner(make_node, spawn_peer, ipc_dir)
    provider = ScriptedProvider()
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    sink = Sink()
    gates = Gates()
    tools = gates.register(ToolRegistry())
    rt = ConversationRuntime.builder().node(node).llm("scripted").tools(tools).event_sink(sink).build()
    manager = BackgroundJobManager(node, "runner/jobs", workdir=str(tmp_path))
    rt.register_job_tools(manager)
    slot = WakeupSlot("s1")
    rt.register_wakeup_tool(slot)
    try:
        (tmp_path / "go").mkdir()
        slow = "while [ ! -f go/now ]; do sleep 0.01; done; echo slow"  # ends once the test creates go/now
        provider.add(
            [
                {"call": {"name": "start_job", "arguments": {"command": slow}}, "id": "j1"},
                {"call": {"name": "start_job", "arguments": {"command": "echo fast"}}, "id": "j2"},
                {"call": {"name": "gate", "arguments": {"key": "G"}}, "id": "g"},
                {"text": "both started"},
            ]
        )
        provider.add(text("one"), text("two"))
        future = rt.run_event_loop_future("go", slot, manager)
        first, second = sink.next(JobStarted), sink.next(JobStarted)
        assert sink.next(JobFinished).job_id == second.job_id
        (tmp_path / "go" / "now").write_text("")
        assert sink.next(JobFinished).job_id == first.job_id
        gates.open("G")
        outcomes = future.result(WAIT)
        assert [o.final_text for o in outcomes] == ["both started", "one", "two"]
        injected = [u for u in users(rt) if u.startswith("[Background job")]
        assert [u.split()[2] for u in injected] == [second.job_id, first.job_id]

        os.mkfifo(tmp_path / "pid")
        reader = os.open(tmp_path / "pid", os.O_RDONLY | os.O_NONBLOCK)
        command = "sleep 300 & echo $! > pid; wait"
        provider.add(
            [{"call": {"name": "start_job", "arguments": {"command": command}}, "id": "j3"}, {"text": "ok"}]
        )
        rt.run("one more")
        job = sink.next(JobStarted)
        info = manager.status(job.job_id)
        assert info.state == "running" and info.pgid > 0
        grandchild = read_pid(reader)
        rt.close()
        assert manager.running_count() == 0
        assert gone(info.pgid) and gone(grandchild)
    finally:
        rt.stop()


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def test_a_job_whose_runner_process_is_killed_is_reported_once_as_lost(
    ipc_dir: Path,
    spawn_peer: Callable[..., PeerProcess],
    make_node: Callable[..., Node],
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    """SIGKILL of the runner process while a job runs; a conversation resumed from its journal, with a new
    runner started in its place, delivers the job once as lost (outcome unknown)."""
    node, runner = owner_and_runner(make_node, spawn_peer, ipc_dir)
    provider = ScriptedProvider()
    node.spawn(RouterActor, "router", data_dir=tmp_path, providers={"scripted": provider})
    session = tmp_path / "s.jsonl"
    sink = Sink()
    build = ConversationRuntime.builder().node(node).llm("scripted").tools(ToolRegistry()).event_sink(sink)
    rt = build.session_file(session).name("chat").build()
    manager = BackgroundJobManager(node, "runner/jobs", workdir=str(tmp_path))
    rt.register_job_tools(manager)
    provider.add(
        [{"call": {"name": "start_job", "arguments": {"command": "sleep 300"}}, "id": "j1"}, {"text": "ok"}]
    )
    rt.run("start")
    job = sink.next(JobStarted)
    pgid = manager.status(job.job_id).pgid
    assert pgid > 0
    # The SIGKILLed runner cannot end its job's process group: this test does, by that group's id.
    request.addfinalizer(lambda: kill_group(pgid))
    runner.kill()
    rt.stop()
    runner_peer(spawn_peer, ipc_dir, "runner")  # a new runner process: it knows no job
    node.connect(node.peers()["runner"], wait=20)
    build2 = ConversationRuntime.builder().node(node).llm("scripted").tools(ToolRegistry()).event_sink(sink)
    rt2 = build2.session_file(session).name("chat2").build()
    try:
        lost = sink.next(JobFinished)
        assert lost.job_id == job.job_id and lost.lost
        slot = WakeupSlot("s1")
        rt2.register_wakeup_tool(slot)
        provider.add(text("t1"), text("noted"))
        outcomes = rt2.run_event_loop("go", slot, manager)
        assert len(outcomes) == 2
        assert users(rt2)[-1].startswith(f"[Background job {job.job_id} lost")
        assert [r["type"] for r in records(session)].count("job_delivered") == 1
    finally:
        rt2.stop()
