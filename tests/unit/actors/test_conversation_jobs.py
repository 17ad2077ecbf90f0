"""Background jobs and run_event_loop (RULES.md 9.8, BG-01..BG-07; actors/conversation/jobs.py).

Real shell jobs (``/bin/sh``) on a ``JobRunnerActor`` in this process (the other-process runner and its
SIGKILL are in tests/integration/test_conversation_loops_processes.py); a scripted model; a ManualClock
for wakeups. Jobs finish "during a turn" while the turn is held in a gate tool: the test waits (bounded) for
each ``JobFinished`` event, then opens the gate.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, Env, call, env_fixture, text
from peers.loop_kit import ManualClock, gone, read_pid
from peers.people_kit import wait_until

from actors.conversation import CancellationToken, ToolCallFinished, read_journal
from actors.conversation.jobs import BackgroundJobManager, JobRunnerActor, injected_text
from actors.conversation.messages import GetJob, JobDone, JobInfo, StartJob
from actors.conversation.runtime import WakeupSlot
from actors.conversation.types import CompletedJob, JobFinished, JobStarted, MessageAppended, TurnFinished
from transport.node import Node


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    yield from env_fixture(make_node, tmp_path)


def setup(
    env: Env, tmp_path: Path, *, cap: int = 16384, **options: Any
) -> tuple[Any, WakeupSlot, Any, ManualClock]:
    clock = ManualClock()
    rt = env.build(timers=clock, **options)
    manager = BackgroundJobManager.spawn(
        env.node, f"jobs-{len(env.built)}", workdir=str(tmp_path), output_cap=cap
    )
    rt.register_job_tools(manager)
    slot = WakeupSlot("s1")
    rt.register_wakeup_tool(slot, max_delay_s=3600)
    return rt, slot, manager, clock


def start(command: str, call_id: str) -> dict[str, Any]:
    return call("start_job", call_id, command=command)


def finished(env: Env, n: int) -> list[JobFinished]:
    env.sink.wait_for(lambda e: isinstance(e, JobFinished) and len(env.sink.of(JobFinished)) >= n)
    return env.sink.of(JobFinished)


def started_ids(env: Env, *commands: str) -> dict[str, str]:
    """The job ids of the ``JobStarted`` events, once one has arrived for each of ``commands``: the sink is
    an actor, so an event may reach it after the answer of the run that emitted it."""
    for command in commands:
        env.sink.wait_for(lambda e, c=command: isinstance(e, JobStarted) and e.command == c)
    return {e.command: e.job_id for e in env.sink.of(JobStarted)}


def users(rt: Any) -> list[str]:
    return [m.content for m in rt.transcript() if m.role == "user"]


def test_bg02_a_completed_jobs_output_is_the_next_turns_goal(env: Env, tmp_path: Path) -> None:
    """BG-02: job completes with output "42" → turn 2's user text is the injected completion with it."""
    rt, slot, manager, _ = setup(env, tmp_path)
    env.script(start("echo 42", "j1"), call("gate", "g", key="G"), text("started"))
    env.script(text("the job said 42"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    finished(env, 1)
    env.gates.open("G")
    outcomes = future.result(WAIT)
    assert len(outcomes) == 2
    job_id = started_ids(env, "echo 42")["echo 42"]
    assert users(rt)[1] == f"[Background job {job_id} completed (exit 0)]\n42\n"


def test_bg06_two_completions_during_one_turn_make_two_turns_in_completion_order(
    env: Env, tmp_path: Path
) -> None:
    """BG-06: two jobs finish during turn 1 (the one started second finishes first) → turns 2 and 3 each
    get one completion, in completion order, each exactly once."""
    rt, slot, manager, _ = setup(env, tmp_path)
    slow = "while [ ! -f go ]; do sleep 0.01; done; echo slow"
    env.script(start(slow, "j1"), start("echo fast", "j2"), call("gate", "g", key="G"), text("both started"))
    env.script(text("saw one"))
    env.script(text("saw the other"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    first = finished(env, 1)[0]
    (tmp_path / "go").write_text("")
    second = finished(env, 2)[1]
    env.gates.open("G")
    outcomes = future.result(WAIT)
    assert len(outcomes) == 3
    ids = started_ids(env, "echo fast", slow)
    assert [first.job_id, second.job_id] == [ids["echo fast"], ids[slow]]
    assert users(rt)[1].startswith(f"[Background job {ids['echo fast']} completed (exit 0)]\nfast")
    assert users(rt)[2].startswith(f"[Background job {ids[slow]} completed (exit 0)]\nslow")
    assert sum("[Background job" in u for u in users(rt)) == 2


def test_bg01_both_sources_are_checked_after_every_turn(env: Env, tmp_path: Path) -> None:
    """BG-01: after turn 1 a completion is found, after turn 2 the wakeup that turn scheduled."""
    rt, slot, manager, clock = setup(env, tmp_path)
    env.script(start("echo a", "j1"), call("gate", "g", key="G"), text("t1"))
    env.script(call("schedule_wakeup", "w", delay_seconds=5), text("t2"))
    env.script(text("t3"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    finished(env, 1)
    env.gates.open("G")
    clock.wait_timer()
    clock.advance(5)
    assert [o.final_text for o in future.result(WAIT)] == ["t1", "t2", "t3"]
    assert users(rt)[2] == "go"


def test_bg03_a_wakeup_and_no_job_sleeps_then_continues(env: Env, tmp_path: Path) -> None:
    """BG-03: as WK-02, through run_event_loop."""
    rt, slot, manager, clock = setup(env, tmp_path)
    env.script(call("schedule_wakeup", "w", delay_seconds=30), text("t1"))
    env.script(text("t2"))
    future = rt.run_event_loop_future("go", slot, manager)
    clock.wait_timer()
    assert clock.set_delays == [30.0] and len(env.p1.turns) == 1
    clock.advance(30)
    assert len(future.result(WAIT)) == 2


def test_bg04_neither_a_completion_nor_a_wakeup_ends_the_loop_with_jobs_running(
    env: Env, tmp_path: Path
) -> None:
    """BG-04: one running job, nothing completed, no wakeup → the loop returns after the turn."""
    rt, slot, manager, _ = setup(env, tmp_path)
    env.script(start("sleep 30", "j1"), text("started"))
    outcomes = rt.run_event_loop("go", slot, manager)
    assert len(outcomes) == 1
    assert manager.running_count() == 1
    rt.close()
    assert manager.running_count() == 0


def test_bg05_a_completion_runs_before_a_wakeup_which_stays(env: Env, tmp_path: Path) -> None:
    """BG-05: both present → the job turn runs at once (no timer set, the clock not advanced), then the
    wakeup turn after its delay."""
    rt, slot, manager, clock = setup(env, tmp_path)
    env.script(
        start("echo j", "j1"),
        call("schedule_wakeup", "w", delay_seconds=10, prompt="wake"),
        call("gate", "g", key="G"),
        text("t1"),
    )
    env.script(text("t2"))
    env.script(text("t3"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    finished(env, 1)
    env.gates.open("G")
    env.sink.wait_for(lambda e: isinstance(e, TurnFinished) and e.turn_index == 1)
    clock.wait_timer()
    assert clock.set_delays == [10.0 - 0.0]  # set only after the job turn, with the clock not advanced
    assert users(rt)[1].startswith("[Background job")
    clock.advance(10)
    assert len(future.result(WAIT)) == 3
    assert users(rt)[2] == "wake"


def test_bg07_no_manager_behaves_like_run_loop(env: Env, tmp_path: Path) -> None:
    """BG-07: the same script through run_loop and run_event_loop(None) → the same outcomes and events."""
    traces = []
    for loop in ("run_loop", "run_event_loop"):
        env.sink.events.clear()
        clock = ManualClock()
        rt = env.build(timers=clock)
        slot = WakeupSlot(f"s-{loop}")
        rt.register_wakeup_tool(slot)
        env.script(call("schedule_wakeup", "w", delay_seconds=3), text("t1"))
        env.script(text("t2"))
        future = (
            rt.run_loop_future("go", slot)
            if loop == "run_loop"
            else rt.run_event_loop_future("go", slot, None)
        )
        clock.wait_timer()
        clock.advance(3)
        outcomes = future.result(WAIT)
        env.sink.wait_for(lambda e: isinstance(e, TurnFinished) and e.turn_index == 1)
        shape = [type(e).__name__ for e in env.sink.of(object) if not isinstance(e, MessageAppended)]
        traces.append(([(o.final_text, o.finish_reason, o.turn_index) for o in outcomes], shape))
    assert traces[0] == traces[1]


def test_the_injected_output_is_capped_to_its_tail_with_the_full_size(env: Env, tmp_path: Path) -> None:
    rt, slot, manager, _ = setup(env, tmp_path, cap=100)
    command = "i=0; while [ $i -lt 300 ]; do echo line$i; i=$((i+1)); done"
    env.script(start(command, "j1"), call("gate", "g", key="G"), text("t1"))
    env.script(text("t2"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    finished(env, 1)
    env.gates.open("G")
    future.result(WAIT)
    injected = users(rt)[1]
    assert injected.rstrip().endswith("[output: the last 100 of 2290 bytes]")
    assert "line299" in injected and "line0\n" not in injected


def test_job_status_and_stop_job_tools(env: Env, tmp_path: Path) -> None:
    rt, _, _, _ = setup(env, tmp_path)
    env.script(start("echo hi; sleep 30", "j1"), text("t"))
    rt.run("start it")
    job_id = started_ids(env, "echo hi; sleep 30")["echo hi; sleep 30"]
    env.script(
        call("job_status", "s1", job_id=job_id),
        call("stop_job", "s2", job_id=job_id),
        call("job_status", "s3", job_id="nope"),
        text("t"),
    )
    rt.run("check it")
    env.sink.wait_for(lambda e: isinstance(e, TurnFinished) and e.turn_index == 1)  # its tools' events first
    results = [e for e in env.sink.of(ToolCallFinished) if e.name in ("job_status", "stop_job")]
    assert results[0].ok and results[0].text.startswith(f"job {job_id}: running")
    assert results[1].ok
    assert not results[2].ok and "no job 'nope'" in results[2].text
    assert finished(env, 1)[0].exit_code is None  # stopped: its group killed


def test_close_ends_the_jobs_whole_process_group(env: Env, tmp_path: Path) -> None:
    """Closing the conversation ends its jobs' process groups: a grandchild of the job is gone after it."""
    rt, _, manager, _ = setup(env, tmp_path)
    os.mkfifo(tmp_path / "child.fifo")
    fifo = tmp_path / "child.fifo"
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the job's write-open never blocks
    command = "sleep 300 & echo $! > child.fifo; wait"
    env.script(start(command, "j1"), text("t"))
    rt.run("start it")
    job_id = started_ids(env, command)[command]
    pgid = manager.status(job_id).pgid
    assert pgid > 0
    child = read_pid(reader)
    rt.close()
    assert gone(child) and gone(pgid)


def test_a_finished_but_undelivered_job_is_delivered_once_after_a_resume(env: Env, tmp_path: Path) -> None:
    """Crash after the completion was journaled and before its turn: the resumed runtime delivers it once."""
    path = tmp_path / "s.jsonl"
    rt, slot, manager, _ = setup(env, tmp_path, session_file=path)
    env.script(start("echo done", "j1"), call("gate", "g", key="G"), text("t1"))
    env.script(text("t2"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    finished(env, 1)
    crashed = tmp_path / "crashed.jsonl"
    shutil.copy(path, crashed)
    env.gates.open("G")
    future.result(WAIT)
    assert len(read_journal(crashed).loops.undelivered) == 1
    rt2, slot2, manager2, _ = setup(env, tmp_path, session_file=crashed)
    env.script(text("resumed turn"))
    env.script(text("delivered"))
    env.script(text("never"))
    outcomes = rt2.run_event_loop("go on", slot2, manager2)
    assert [o.final_text for o in outcomes] == ["resumed turn", "delivered"]
    assert sum(u.startswith("[Background job") for u in users(rt2)) == 1
    assert read_journal(crashed).loops.undelivered == ()


def test_a_job_whose_runner_died_is_reported_once_as_lost(env: Env, tmp_path: Path) -> None:
    """The runner stops while the job runs (the job dies with it); a conversation resumed from its journal
    asks the (new, empty) runner, finds the job unknown, and delivers it once as lost, outcome unknown."""
    path = tmp_path / "s.jsonl"
    clock = ManualClock()
    rt = env.build(timers=clock, session_file=path)
    runner = env.node.spawn(JobRunnerActor, "runner")
    manager = BackgroundJobManager(env.node, f"{env.node.name}/runner", workdir=str(tmp_path))
    rt.register_job_tools(manager)
    env.script(start("sleep 300", "j1"), text("started"))
    rt.run("start")
    crashed = tmp_path / "crashed.jsonl"
    shutil.copy(path, crashed)
    runner.stop()
    env.node.spawn(JobRunnerActor, "runner")  # the runner's restart: it knows no job
    rt2 = env.build(timers=clock, session_file=crashed)
    rt2.register_job_tools(manager)
    lost = env.sink.wait_for(lambda e: isinstance(e, JobFinished) and e.lost)
    slot = WakeupSlot("s9")
    rt2.register_wakeup_tool(slot)
    env.script(text("t1"))
    env.script(text("noted the loss"))
    outcomes = rt2.run_event_loop("go", slot, manager)
    assert len(outcomes) == 2
    assert users(rt2)[-1].startswith(f"[Background job {lost.job_id} lost")
    assert len([e for e in env.sink.of(JobFinished) if e.lost]) == 1


def test_cancelling_the_loop_stops_its_jobs(env: Env, tmp_path: Path) -> None:
    rt, slot, manager, clock = setup(env, tmp_path)
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(start("sleep 300", "j1"), call("schedule_wakeup", "w", delay_seconds=60), text("t1"))
    future = rt.run_event_loop_future("go", slot, manager)
    clock.wait_timer()
    token.cancel()
    assert len(future.result(WAIT)) == 1
    env.sink.wait_for(lambda e: isinstance(e, JobFinished))
    assert manager.running_count() == 0


def test_injected_text_format() -> None:
    from actors.conversation.types import CompletedJob

    job = CompletedJob(job_id="j", command="c", exit_code=2, output="out", completed_at_ms=0, output_size=3)
    assert injected_text(job) == "[Background job j completed (exit 2)]\nout"
    assert json.dumps(injected_text(job))


def test_a_completion_told_twice_is_delivered_once(env: Env, tmp_path: Path) -> None:
    """BG-06 "exactly once": a repeated JobDone for a job (a runner retrying, a resume that asked again) is
    ignored: one JobFinished, one delivering turn."""
    from actors.conversation.messages import JobDone
    from actors.conversation.types import CompletedJob

    rt, slot, manager, _ = setup(env, tmp_path)
    env.script(start("echo once", "j1"), call("gate", "g", key="G"), text("t1"))
    env.script(text("t2"))
    env.script(text("t3 must not run"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    done = finished(env, 1)[0]
    repeat = CompletedJob(
        job_id=done.job_id, command="echo once", exit_code=0, output="once\n", completed_at_ms=1
    )
    env.node.request(rt.address, JobDone(job=repeat), timeout=WAIT)
    env.gates.open("G")
    assert [o.final_text for o in future.result(WAIT)] == ["t1", "t2"]
    assert len(env.sink.of(JobFinished)) == 1
    assert sum(u.startswith("[Background job") for u in users(rt)) == 1


def test_a_registered_python_callable_runs_as_a_job(env: Env, tmp_path: Path) -> None:
    """start_job(callable=NAME) runs a function registered on the runner; its return value is the output; an
    unknown name is an error result naming the callables there."""
    clock = ManualClock()
    rt = env.build(timers=clock)
    manager = BackgroundJobManager.spawn(
        env.node, "pyjobs", callables={"answer": lambda: 42}, workdir=str(tmp_path)
    )
    rt.register_job_tools(manager)
    slot = WakeupSlot("s1")
    rt.register_wakeup_tool(slot)
    env.script(
        call("start_job", "j1", callable="answer"),
        call("start_job", "j2", callable="nope"),
        call("gate", "g", key="G"),
        text("t1"),
    )
    env.script(text("t2"))
    future = rt.run_event_loop_future("go", slot, manager)
    env.gates.wait_entered("G")
    finished(env, 1)
    env.gates.open("G")
    assert len(future.result(WAIT)) == 2
    job_id = started_ids(env, "callable:answer")["callable:answer"]
    assert users(rt)[1] == f"[Background job {job_id} completed (exit 0)]\n42"
    refused = next(e for e in env.sink.of(ToolCallFinished) if e.call_id == "j2")
    assert not refused.ok and "no job callable 'nope'" in refused.text and "answer" in refused.text


def test_a_job_still_running_at_resume_reports_to_the_resumed_conversation(env: Env, tmp_path: Path) -> None:
    """BG-06 across a resume: the job is still running when the resumed conversation (at another address)
    reconciles it, and ends only afterwards. Its completion must reach the resumed conversation, once: the
    resume adopts the job (``AdoptJob``), so the runner's ``JobDone`` no longer goes to the dead owner."""
    path = tmp_path / "s.jsonl"
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    rt, _, manager, _ = setup(env, tmp_path, session_file=path)
    env.script(start(f"read x < {fifo}; echo finished-7", "j1"), text("started"))
    rt.run("start")
    crashed = tmp_path / "crashed.jsonl"
    shutil.copy(path, crashed)
    rt.stop()
    job_id = next(iter(read_journal(crashed).loops.jobs_running))
    rt2 = env.build(session_file=crashed)
    rt2.register_job_tools(manager)
    assert rt2.status() is not None  # the resume (and its reconcile request to the runner) is behind us
    assert manager.status(job_id).state == "running"
    with fifo.open("w") as release:  # only now does the job end
        release.write("go\n")
    done = env.sink.wait_for(lambda e: isinstance(e, JobFinished) and e.job_id == job_id and not e.lost)
    assert done.exit_code == 0
    slot2 = WakeupSlot("s2")
    rt2.register_wakeup_tool(slot2)
    env.script(text("t1"))
    env.script(text("delivered"))
    outcomes = rt2.run_event_loop("go", slot2, manager)
    assert [o.final_text for o in outcomes] == ["t1", "delivered"]
    delivered = [u for u in users(rt2) if u.startswith("[Background job")]
    assert len(delivered) == 1 and "(exit 0)" in delivered[0] and "finished-7" in delivered[0]


def test_a_job_that_finished_while_the_conversation_was_down_is_delivered_once_as_finished(
    env: Env, tmp_path: Path
) -> None:
    """The conversation crashes while its job runs (the session file copied as a SIGKILL leaves it: a
    ``job_started`` and no ``job_finished``); the job then finishes on its runner. The resumed conversation
    asks that runner (the address journaled with the job) and delivers the completion once, with its exit
    status and output: it was not lost."""
    path = tmp_path / "s.jsonl"
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    rt, _, manager, _ = setup(env, tmp_path, session_file=path)
    env.script(start(f"read x < {fifo}; echo finished-42", "j1"), text("started"))
    rt.run("start")
    crashed = tmp_path / "crashed.jsonl"
    shutil.copy(path, crashed)
    assert len(read_journal(crashed).loops.jobs_running) == 1
    rt.stop()
    with fifo.open("w") as release:  # the job ends now, with no conversation to tell
        release.write("go\n")
    job_id = next(iter(read_journal(crashed).loops.jobs_running))
    # The runner has recorded the end before the resume asks (a hosted conversation resumes fast enough to
    # ask while the job's process is still exiting: then it is running, a different case).
    assert wait_until(
        lambda: env.node.request(manager.address, GetJob(job_id=job_id), timeout=WAIT).state == "finished"
    )
    rt2 = env.build(session_file=crashed)
    rt2.register_job_tools(manager)
    done = env.sink.wait_for(lambda e: isinstance(e, JobFinished) and e.job_id == job_id and not e.lost)
    assert done.exit_code == 0
    slot2 = WakeupSlot("s2")
    rt2.register_wakeup_tool(slot2)
    env.script(text("t1"))
    env.script(text("delivered"))
    outcomes = rt2.run_event_loop("go", slot2, manager)
    assert [o.final_text for o in outcomes] == ["t1", "delivered"]
    delivered = [u for u in users(rt2) if u.startswith("[Background job")]
    assert len(delivered) == 1 and "(exit 0)" in delivered[0] and "finished-42" in delivered[0]


def cut_after(path: Path, kind: str) -> None:
    """Cut the session file right after its last record of ``kind``: what a SIGKILL leaves at that point."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    last = max(n for n, line in enumerate(lines) if json.loads(line)["type"] == kind)
    path.write_text("\n".join(lines[: last + 1]) + "\n")


def test_a_start_job_repeated_by_its_key_answers_the_stored_result_and_starts_nothing(
    env: Env, tmp_path: Path
) -> None:
    """The loops' tools go through the conversation's effect store: the process dies after start_job ran
    (its result stored) and before the result was journaled; continue_turn asks the call again by the same
    key, and gets the stored result: the job is not started a second time, even on a runner that no longer
    knows it (a restarted one)."""
    path = tmp_path / "s.jsonl"
    marks = tmp_path / "marks"
    rt, _, manager, _ = setup(env, tmp_path, session_file=path)
    env.script(start(f"echo run >> {marks}", "j1"), text("ok"))
    rt.run("start")
    finished(env, 1)
    rt.stop()
    cut_after(path, "job_started")
    assert read_journal(path).interrupted is not None
    runner = env.node.lookup(manager.address.split("/", 1)[1])
    assert runner is not None
    runner.stop()
    env.node.spawn(JobRunnerActor, manager.address.split("/", 1)[1])  # a new runner: it knows no job
    rt2 = env.build(session_file=path)
    rt2.register_job_tools(manager)
    env.script(text("continued"))
    outcome = rt2.continue_turn()
    assert outcome.final_text == "continued"
    results = [m for m in rt2.transcript() if m.role == "tool"]
    assert len(results) == 1 and results[0].content.startswith("started background job job-")
    assert marks.read_text().splitlines() == ["run"]
    assert [r["type"] for r in records(path)].count("job_started") == 1


def test_plan_mode_denies_start_job_and_stop_job_and_allows_job_status_and_schedule_wakeup(
    env: Env, tmp_path: Path
) -> None:
    """PH/plan mode: the loops' own tools are registered with a mutating flag: start_job and stop_job are
    denied while plan mode is on; job_status (reads) and schedule_wakeup (the conversation's own slot) run."""
    marks = tmp_path / "marks"
    rt, slot, _, clock = setup(env, tmp_path, plan_mode=True)
    env.script(
        start(f"echo run >> {marks}", "j1"),
        call("stop_job", "s1", job_id="job-x"),
        call("job_status", "q1", job_id="job-x"),
        call("schedule_wakeup", "w1", delay_seconds=5),
        text("planned"),
    )
    env.script(text("woken"))
    future = rt.run_loop_future("plan", slot)
    clock.wait_timer()
    clock.advance(5)
    future.result(WAIT)
    results = {m.tool_call_id: m for m in rt.transcript() if m.role == "tool"}
    assert results["j1"].is_error and results["j1"].content.startswith("Permission denied: plan mode is on")
    assert results["s1"].is_error and results["s1"].content.startswith("Permission denied: plan mode is on")
    assert results["q1"].content == "job_status: no job 'job-x'"  # it ran (and found nothing)
    assert not results["w1"].is_error and results["w1"].content.startswith("wakeup scheduled")
    assert not marks.exists()
    assert env.sink.of(JobStarted) == []


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def forget_outcomes(effects: Path) -> None:
    """The loops' effect store as a crash between a call's run and its stored outcome leaves it: the
    intent rows stay, their outcomes are gone (the row is claimed, never settled)."""
    import sqlite3

    db = sqlite3.connect(effects)
    try:
        db.execute("UPDATE effects SET tag = NULL, outcome = NULL, finished_at = NULL")
        db.commit()
    finally:
        db.close()


@pytest.mark.parametrize("runner_restarted", [False, True])
def test_a_start_job_cut_off_before_its_outcome_is_never_started_again(
    env: Env, tmp_path: Path, runner_restarted: bool
) -> None:
    """start_job ran (the job started) and the process died before its outcome was stored: continue_turn
    by the same key asks the runner. A runner that knows the job: "started"; one that does not (it was
    restarted): "outcome unknown", naming the job id. Either way the job is not started a second time."""
    path = tmp_path / "s.jsonl"
    marks = tmp_path / "marks"
    rt, _, manager, _ = setup(env, tmp_path, session_file=path)
    env.script(start(f"echo run >> {marks}", "j1"), text("ok"))
    rt.run("start")
    finished(env, 1)
    rt.stop()
    cut_after(path, "job_started")
    forget_outcomes(path.with_name(path.name + ".loops.sqlite3"))
    if runner_restarted:
        name = manager.address.split("/", 1)[1]
        runner = env.node.lookup(name)
        assert runner is not None
        runner.stop()
        env.node.spawn(JobRunnerActor, name)
    rt2 = env.build(session_file=path)
    rt2.register_job_tools(manager)
    env.script(text("continued"))
    rt2.continue_turn()
    result = next(m for m in rt2.transcript() if m.role == "tool")
    if runner_restarted:
        assert result.is_error and result.content.startswith("outcome unknown: tool 'start_job'")
        assert "its job id would be job-" in result.content
    else:
        assert not result.is_error and result.content.startswith("started background job job-")
    assert marks.read_text().splitlines() == ["run"]


class OvertakingRunner(JobRunnerActor):
    """A fake runner (named so): it tells the job's end before it answers the start, as a real runner in
    another process can when its tell and its reply travel on different sockets."""

    def handle(self, message: Any, ctx: Any) -> Any:
        if isinstance(message, StartJob):
            done = CompletedJob(
                job_id=message.job_id,
                command=message.command,
                exit_code=0,
                output="fast\n",
                completed_at_ms=1,
            )
            self.tell_to(message.owner, JobDone(job=done))
            return JobInfo(job_id=message.job_id, command=message.command, state="running")
        return super().handle(message, ctx)


def test_bg06_a_completion_that_overtakes_its_start_is_delivered_once_after_job_started(
    env: Env, tmp_path: Path
) -> None:
    """BG-06 (every completion delivered exactly once): a JobDone that arrives before the runner's answer to
    StartJob is neither dropped nor reported before JobStarted; the next turn gets it."""
    clock = ManualClock()
    rt = env.build(timers=clock)
    env.node.spawn(OvertakingRunner, "overtaking")
    manager = BackgroundJobManager(env.node, f"{env.node.name}/overtaking", workdir=str(tmp_path))
    rt.register_job_tools(manager)
    slot = WakeupSlot("s1")
    rt.register_wakeup_tool(slot, max_delay_s=3600)
    env.script(start("echo fast", "j1"), text("started"))
    env.script(text("the job said fast"))
    outcomes = rt.run_event_loop_future("go", slot, manager).result(WAIT)
    assert [o.final_text for o in outcomes] == ["started", "the job said fast"]
    finished(env, 1)  # the sink's events may land after the answers
    kinds = [type(e).__name__ for e in env.sink.of(JobStarted, JobFinished)]
    assert kinds == ["JobStarted", "JobFinished"]
    job_id = started_ids(env, "echo fast")["echo fast"]
    assert users(rt)[1] == f"[Background job {job_id} completed (exit 0)]\nfast\n"
