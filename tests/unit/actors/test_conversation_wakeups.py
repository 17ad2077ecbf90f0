"""The wakeup loop (RULES.md 9.7, WK-01..WK-07): ``WakeupSlot``, the ``schedule_wakeup`` tool, ``run_loop``.

Scripted provider behind a real Router; a ``ManualClock`` is the loop's clock and timer source, so no test
sleeps: a test waits (bounded) until the loop's timer is set, then advances the clock. A crash during the
sleep is simulated by copying the session file (what a SIGKILL then leaves on disk); the real SIGKILL is in
tests/integration/test_conversation_loops_processes.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, Env, call, env_fixture, text
from peers.loop_kit import ManualClock

from actors.conversation import CancellationToken, FinishReason, ToolCallFinished, read_journal
from actors.conversation.runtime import WakeupSlot
from actors.conversation.types import Wakeup, WakeupCancelled, WakeupFired, WakeupScheduled
from transport.node import Node


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    yield from env_fixture(make_node, tmp_path)


def wake(delay: float, call_id: str = "w1", prompt: str | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"delay_seconds": delay}
    if prompt is not None:
        args["prompt"] = prompt
    return call("schedule_wakeup", call_id, **args)


def users(rt: Any) -> list[str]:
    return [m.content for m in rt.transcript() if m.role == "user"]


def build(env: Env, clock: ManualClock, **options: Any) -> tuple[Any, WakeupSlot]:
    rt = env.build(timers=clock, **options)
    slot = WakeupSlot("s1")
    rt.register_wakeup_tool(slot, max_delay_s=3600.0)
    return rt, slot


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_wk01_the_first_turn_is_the_initial_goal(env: Env) -> None:
    """WK-01: the first user message is initial_goal."""
    rt, slot = build(env, ManualClock())
    env.script(text("nothing to schedule"))
    outcomes = rt.run_loop("watch the build", slot)
    assert len(outcomes) == 1 and users(rt) == ["watch the build"]


def test_wk02_a_scheduled_wakeup_sleeps_then_runs_another_turn(env: Env) -> None:
    """WK-02: turn 1 schedules 30 s on a ManualClock, turn 2 does not → 2 outcomes; the loop slept exactly
    30 s of the injected clock (and no turn ran before the clock moved)."""
    clock = ManualClock()
    rt, slot = build(env, clock)
    env.script(wake(30), text("see you in 30s"))
    env.script(text("done"))
    future = rt.run_loop_future("watch", slot)
    clock.wait_timer()
    assert clock.set_delays == [30.0] and len(env.p1.turns) == 1
    clock.advance(29.0)
    assert len(env.p1.turns) == 1 and not future.done()
    clock.advance(1.0)
    outcomes = future.result(WAIT)
    assert [o.final_text for o in outcomes] == ["see you in 30s", "done"]


def test_wk03_a_wakeup_already_in_the_slot_is_discarded(env: Env) -> None:
    """WK-03: pre-fill the slot; turn 1 schedules nothing → 1 outcome; taking empties the slot."""
    clock = ManualClock()
    rt, slot = build(env, clock)
    slot.schedule(Wakeup(delay_s=5))
    assert slot.peek() is not None and slot.peek() is not None  # peek leaves it
    env.script(text("nothing"))
    assert len(rt.run_loop("go", slot)) == 1
    assert slot.peek() is None and clock.set_delays == []
    slot.schedule(Wakeup(delay_s=1, prompt="p"))
    taken = slot.take()
    assert taken is not None and taken.prompt == "p" and slot.take() is None


def test_wk04_the_next_turn_runs_the_wakeups_prompt_or_the_goal(env: Env) -> None:
    """WK-04: schedule_wakeup(1, prompt="check CI") → turn 2's text is "check CI"; without a prompt, the
    initial goal."""
    clock = ManualClock()
    rt, slot = build(env, clock)
    env.script(wake(1, "w1", prompt="check CI"), text("later"))
    env.script(wake(1, "w2"), text("again"))
    env.script(text("done"))
    future = rt.run_loop_future("watch", slot)
    clock.wait_timer()
    clock.advance(1)
    clock.wait_timer()
    clock.advance(1)
    assert len(future.result(WAIT)) == 3
    assert users(rt) == ["watch", "check CI", "watch"]


def test_wk05_only_the_slot_registered_with_the_tool_counts(env: Env) -> None:
    """WK-05: the tool writes into the registered slot; a loop on a different slot object ends after the
    turn even though the model scheduled a wakeup."""
    clock = ManualClock()
    rt, registered = build(env, clock)
    env.script(wake(10), text("scheduled"))
    other = WakeupSlot("other")
    outcomes = rt.run_loop("go", other)
    assert len(outcomes) == 1 and clock.set_delays == []
    finished = env.sink.wait_for(lambda e: isinstance(e, ToolCallFinished))
    assert finished.ok  # the tool did schedule, into the registered slot
    assert registered.peek() is not None
    env.script(wake(10), text("scheduled"))
    env.script(text("woke"))
    future = rt.run_loop_future("go", registered)
    clock.wait_timer()
    clock.advance(10)
    assert len(future.result(WAIT)) == 2


def test_wk06_cancel_during_the_sleep_ends_the_loop_and_cancels_the_wakeup(env: Env, tmp_path: Path) -> None:
    """WK-06: ManualClock, delay 60 s, the token is cancelled during the sleep → no more turns; the pending
    wakeup is cancelled (event and journal), so nothing fires later."""
    clock = ManualClock()
    path = tmp_path / "s.jsonl"
    rt, slot = build(env, clock, session_file=path)
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(wake(60), text("sleeping"))
    env.script(text("must not run"))
    future = rt.run_loop_future("go", slot)
    clock.wait_timer()
    token.cancel()
    outcomes = future.result(WAIT)
    assert len(outcomes) == 1
    clock.advance(120)
    assert len(env.p1.turns) == 1 and clock.pending() == 0
    assert env.sink.wait_for(lambda e: isinstance(e, WakeupCancelled)).slot == "s1"
    assert slot.peek() is None
    assert [r["type"] for r in records(path)][-2:] == ["wakeup_cancelled", "loop_ended"]
    assert read_journal(path).loops.slots == {}


def test_wk07_a_cancelled_turn_ends_the_loop(env: Env) -> None:
    """WK-07: a cancelled turn 1 that scheduled a wakeup → 1 outcome, and the wakeup is cancelled."""
    clock = ManualClock()
    rt, slot = build(env, clock)
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(wake(5), call("gate", "g", key="K"), text("x"))
    future = rt.run_loop_future("go", slot)
    env.gates.wait_entered("K")
    token.cancel()
    env.gates.open("K")
    outcomes = future.result(WAIT)
    assert len(outcomes) == 1 and outcomes[0].finish_reason is FinishReason.CANCELLED
    assert clock.set_delays == [] and slot.peek() is None


def test_wk07_turn_errors_propagate(env: Env) -> None:
    rt, slot = build(env, ManualClock())
    env.script({"fail": "failed", "message": "provider down"})
    with pytest.raises(Exception, match="provider down"):
        rt.run_loop("go", slot)


def test_schedule_wakeup_outside_a_loop_is_an_error_result(env: Env) -> None:
    """The complaint to beat: schedule_wakeup outside a loop must not report success."""
    rt, slot = build(env, ManualClock())
    env.script(wake(10), text("ok"))
    rt.run("schedule yourself")
    finished = env.sink.wait_for(lambda e: isinstance(e, ToolCallFinished))
    assert not finished.ok and "no wakeup loop is running" in finished.text
    assert slot.peek() is None


@pytest.mark.parametrize("delay", [-1, 3601, "soon", True])
def test_a_delay_out_of_bounds_is_refused(env: Env, delay: Any) -> None:
    clock = ManualClock()
    rt, slot = build(env, clock)
    env.script(call("schedule_wakeup", "w", delay_seconds=delay), text("hm"))
    assert len(rt.run_loop("go", slot)) == 1
    finished = env.sink.wait_for(lambda e: isinstance(e, ToolCallFinished))
    assert not finished.ok and "delay_seconds must be a number from 0 to 3600" in finished.text
    assert clock.set_delays == []


def test_the_wakeup_is_on_disk_with_its_due_time_before_the_model_hears_of_it(
    env: Env, tmp_path: Path
) -> None:
    clock = ManualClock(start=500.0)
    path = tmp_path / "s.jsonl"
    rt, slot = build(env, clock, session_file=path)
    env.script(wake(30), text("ok"))
    env.script(text("done"))
    future = rt.run_loop_future("go", slot)
    clock.wait_timer()
    scheduled = [r for r in records(path) if r["type"] == "wakeup_scheduled"]
    assert scheduled[0].pop("key").endswith(":w1")  # the schedule_wakeup call's idempotency key
    assert scheduled == [
        {
            "type": "wakeup_scheduled",
            "slot": "s1",
            "due": 530.0,
            "delay_s": 30.0,
            "prompt": None,
            "reason": "",
        }
    ]
    kinds = [r["type"] for r in records(path)]
    assert kinds.index("wakeup_scheduled") < kinds.index("message_appended")
    assert env.sink.wait_for(lambda e: isinstance(e, WakeupScheduled)).due == 530.0
    clock.advance(30)
    future.result(WAIT)


def crash_during_sleep(env: Env, tmp_path: Path, clock: ManualClock) -> Path:
    """Run a loop until it sleeps on a 60 s wakeup, copy its session file (the crash), end the original."""
    path = tmp_path / "s.jsonl"
    rt, slot = build(env, clock, session_file=path)
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(wake(60, prompt="woken"), text("sleeping"))
    future = rt.run_loop_future("go", slot)
    clock.wait_timer()
    crashed = tmp_path / "crashed.jsonl"
    shutil.copy(path, crashed)
    token.cancel()
    future.result(WAIT)
    return crashed


def test_a_resumed_loop_fires_a_past_due_wakeup_exactly_once(env: Env, tmp_path: Path) -> None:
    """Crash during the sleep; resumed after the due time: run_loop on the same slot fires the wakeup at
    once, exactly once (one turn with its prompt), and the loop goes on as before."""
    clock = ManualClock(start=1000.0)
    crashed = crash_during_sleep(env, tmp_path, clock)
    restored = read_journal(crashed).loops
    assert restored.loop == ("s1", "go", None) and restored.slots["s1"].due == 1060.0
    later = ManualClock(start=2000.0)
    rt2, slot2 = build(env, later, session_file=crashed)
    env.script(text("awake"))
    outcomes = rt2.run_loop("go", slot2)
    assert [o.final_text for o in outcomes] == ["awake"]
    assert [m.content for m in rt2.transcript() if m.role == "user"] == ["go", "woken"]
    assert later.set_delays == [0.0]
    fired = [r for r in records(crashed) if r["type"] == "wakeup_fired"]
    assert len(fired) == 1
    assert read_journal(crashed).loops.slots == {} and read_journal(crashed).loops.loop is None


def test_a_resumed_loop_waits_for_a_wakeup_still_ahead(env: Env, tmp_path: Path) -> None:
    clock = ManualClock(start=1000.0)
    crashed = crash_during_sleep(env, tmp_path, clock)
    later = ManualClock(start=1040.0)
    rt2, slot2 = build(env, later, session_file=crashed)
    env.script(text("awake"))
    future = rt2.run_loop_future("go", slot2)
    later.wait_timer()
    assert later.set_delays == [20.0] and len(env.p1.turns) == 1
    later.advance(20)
    assert [o.final_text for o in future.result(WAIT)] == ["awake"]
    assert env.sink.wait_for(lambda e: isinstance(e, WakeupFired)).due == 1060.0


def test_a_wakeup_fired_but_not_yet_turned_fires_again_once(tmp_path: Path) -> None:
    """wakeup_fired without a following turn_started (a crash between the two) leaves it pending."""
    path = tmp_path / "s.jsonl"
    lines = [
        {"type": "session", "format": 2, "conversation_id": "c"},
        {"type": "loop_started", "slot": "s1", "initial_goal": "go", "jobs": None},
        {"type": "wakeup_scheduled", "slot": "s1", "due": 5.0, "delay_s": 5.0, "prompt": None, "reason": ""},
        {"type": "wakeup_fired", "slot": "s1", "due": 5.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert "s1" in read_journal(path).loops.slots
    with path.open("a") as f:
        f.write(
            json.dumps(
                {
                    "type": "turn_started",
                    "turn_index": 0,
                    "index": 0,
                    "message": {"role": "user", "content": "go"},
                }
            )
            + "\n"
        )
    assert read_journal(path).loops.slots == {}


def test_close_during_the_sleep_ends_the_loop_and_cancels_its_wakeup(env: Env, tmp_path: Path) -> None:
    """Closing the conversation while its loop sleeps on a 1 h wakeup: the loop returns its outcomes at
    once, the wakeup is cancelled (event, journal, no timer left), then close runs; nothing fires later."""
    clock = ManualClock()
    path = tmp_path / "s.jsonl"
    rt, slot = build(env, clock, session_file=path)
    env.script(wake(3600), text("sleeping"))
    env.script(text("must not run"))
    future = rt.run_loop_future("go", slot)
    clock.wait_timer()
    rt.close(timeout=WAIT)
    assert len(future.result(WAIT)) == 1
    assert clock.pending() == 0
    clock.advance(7200)
    assert len(env.p1.turns) == 1
    cancelled = env.sink.wait_for(lambda e: isinstance(e, WakeupCancelled))
    assert (cancelled.slot, cancelled.reason) == ("s1", "closed")
    assert read_journal(path).loops.slots == {} and read_journal(path).loops.loop is None


def test_a_schedule_wakeup_cut_off_before_its_outcome_answers_from_the_journal(
    env: Env, tmp_path: Path
) -> None:
    """schedule_wakeup journaled its wakeup and the process died before the call's outcome was stored:
    continue_turn by the same key finds that wakeup (journaled with the key, still in its slot) and answers
    "scheduled" without scheduling it again."""
    import sqlite3

    clock = ManualClock()
    path = tmp_path / "s.jsonl"
    rt, slot = build(env, clock, session_file=path)
    env.script(wake(60), text("sleeping"))
    future = rt.run_loop_future("go", slot)
    clock.wait_timer()
    rt.stop()
    future.exception(WAIT)
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    last = max(n for n, line in enumerate(lines) if json.loads(line)["type"] == "wakeup_scheduled")
    path.write_text("\n".join(lines[: last + 1]) + "\n")
    db = sqlite3.connect(path.with_name(path.name + ".loops.sqlite3"))
    db.execute("UPDATE effects SET tag = NULL, outcome = NULL, finished_at = NULL")
    db.commit()
    db.close()
    rt2, _ = build(env, clock, session_file=path)
    env.script(text("continued"))
    rt2.continue_turn()
    result = next(m for m in rt2.transcript() if m.role == "tool")
    assert not result.is_error and result.content == "wakeup scheduled in 60s (due at 1000060.000)"
    assert [r["type"] for r in records(path)].count("wakeup_scheduled") == 1
