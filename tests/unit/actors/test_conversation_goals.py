"""The goal loop (RULES.md 9.6, GL-01..GL-15) and its judge on the Router (actors/conversation/loops.py).

Scripted provider behind a real Router; a ``FakeEvaluator`` where a rule is about the loop, the real judge
run where it is about the judge. A crash between turns is simulated by copying the session file while the
evaluator holds the loop (what a SIGKILL at that moment leaves on disk).
"""

from __future__ import annotations

import dataclasses
import json
import queue
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, Env, call, env_fixture, text
from peers.loop_kit import FakeEvaluator, ManualClock, kinds, no, yes

from actors.conversation import CancellationToken, FinishReason, Message, read_journal
from actors.conversation.loops import AUTO_PROMPT, VERDICT_SCHEMA, parse_verdict
from actors.conversation.types import (
    GoalAchieved,
    GoalCleared,
    GoalContinuing,
    GoalSet,
    GoalState,
    GoalVerdict,
)
from actors.router.client import RouterClient
from transport.node import Node

GOAL_EVENTS = (GoalSet, GoalContinuing, GoalAchieved, GoalCleared)


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    yield from env_fixture(make_node, tmp_path)


def turns(env: Env, n: int) -> None:
    env.script(*[text(f"t{i}") for i in range(n)])
    for i in range(n):
        env.p1.add([text(f"answer {i}")])


def answers(env: Env, n: int) -> None:
    for i in range(n):
        env.p1.add([text(f"answer {i}")])


def goal_events(env: Env) -> list[Any]:
    return env.sink.of(*GOAL_EVENTS)


def wait_goal_end(env: Env) -> None:
    env.sink.wait_for(lambda e: isinstance(e, GoalAchieved | GoalCleared))


def users(rt: Any) -> list[str]:
    return [m.content for m in rt.transcript() if m.role == "user"]


# --------------------------------------------------------------------------------------- controls


def test_gl01_current_goal_is_a_copy(env: Env) -> None:
    """GL-01: current_goal() returns a frozen copy; changing what was returned never changes the runtime."""
    rt = env.build()
    assert rt.current_goal() is None
    rt.set_goal("c", 3)
    goal = rt.current_goal()
    assert goal is not None
    with pytest.raises(dataclasses.FrozenInstanceError):
        goal.turns = 9  # type: ignore[misc]
    changed = dataclasses.replace(goal, turns=9)
    assert changed.turns == 9 and rt.current_goal() == GoalState(condition="c", max_turns=3, turns=0)


def test_gl02_set_goal_installs_the_goal_and_emits_goal_set(env: Env) -> None:
    """GL-02: set_goal("c", 3) → GoalState("c", 3, 0) and GoalSet{c, 3}."""
    rt = env.build()
    rt.set_goal("c", 3)
    assert rt.current_goal() == GoalState(condition="c", max_turns=3, turns=0)
    assert env.sink.wait_for(lambda e: isinstance(e, GoalSet)) == GoalSet(condition="c", max_turns=3)


def test_gl03_clear_goal_emits_goal_cleared_even_without_a_goal(env: Env) -> None:
    """GL-03: clear_goal() → None and GoalCleared{cleared}, also when no goal was set."""
    rt = env.build()
    rt.clear_goal()
    assert env.sink.wait_for(lambda e: isinstance(e, GoalCleared)) == GoalCleared(reason="cleared")
    rt.set_goal("c", 3)
    rt.clear_goal()
    assert rt.current_goal() is None
    # events reach the sink by tell, after the control's answer may have: wait for the second GoalCleared
    env.sink.wait_for(lambda e: isinstance(e, GoalCleared) and len(env.sink.of(GoalCleared)) == 2)
    assert kinds(goal_events(env)) == ["GoalCleared", "GoalSet", "GoalCleared"]


def test_gl04_set_and_clear_goal_are_controls_answered_mid_turn(env: Env) -> None:
    """GL-04: during a turn blocked in a tool, set_goal/clear_goal/current_goal are answered at once (the
    turn is still blocked when they return)."""
    rt = env.build()
    env.script(call("gate", "g1", key="G"), text("done"))
    future = rt.run_future("block")
    env.gates.wait_entered("G")
    rt.set_goal("c", 2, timeout=WAIT)
    assert rt.current_goal(timeout=WAIT) == GoalState(condition="c", max_turns=2)
    rt.clear_goal(timeout=WAIT)
    assert rt.current_goal(timeout=WAIT) is None
    assert not future.done()
    env.gates.open("G")
    assert future.result(WAIT).final_text == "done"


# -------------------------------------------------------------------------------------- the loop


def test_gl05_loop_order_and_events(env: Env) -> None:
    """GL-05: evaluator [no, yes], max_turns=5 → 2 outcomes; GoalSet, GoalContinuing, GoalAchieved."""
    evaluator = FakeEvaluator(no("tests failing"), yes("all green"))
    rt = env.build(goal_evaluator=evaluator)
    answers(env, 2)
    outcomes = rt.run_goal_loop("fix it", "tests pass", 5)
    assert len(outcomes) == 2
    wait_goal_end(env)
    assert kinds(goal_events(env)) == ["GoalSet", "GoalContinuing", "GoalAchieved"]
    assert goal_events(env)[-1] == GoalAchieved(condition="tests pass", turns=2, reason="all green")
    assert [c for c, _ in evaluator.calls] == ["tests pass", "tests pass"]


def test_gl06_the_last_turn_is_never_evaluated(env: Env) -> None:
    """GL-06: max_turns=1 and an evaluator that would say yes → 1 turn, 0 evaluator calls, budget_exceeded."""
    evaluator = FakeEvaluator(yes())
    rt = env.build(goal_evaluator=evaluator)
    answers(env, 1)
    assert len(rt.run_goal_loop("go", "c", 1)) == 1
    assert evaluator.calls == []
    wait_goal_end(env)
    assert goal_events(env)[-1] == GoalCleared(reason="budget_exceeded")


def test_gl07_outcomes_of_every_turn_in_order(env: Env) -> None:
    """GL-07: 3 turns → a list of 3 with increasing turn_index."""
    rt = env.build(goal_evaluator=FakeEvaluator(no(), no()))
    answers(env, 3)
    outcomes = rt.run_goal_loop("go", "c", 3)
    assert [o.turn_index for o in outcomes] == [0, 1, 2]
    assert [o.final_text for o in outcomes] == ["answer 0", "answer 1", "answer 2"]


def test_gl08_clear_goal_during_a_turn_stops_the_loop_after_it(env: Env) -> None:
    """GL-08: clear_goal() during turn 2 → 2 outcomes, no evaluator call for turn 2, no further turn."""
    evaluator = FakeEvaluator(no())
    rt = env.build(goal_evaluator=evaluator)
    env.script(text("one"))
    env.script(call("gate", "g2", key="T2"), text("two"))
    env.script(text("never"))
    future = rt.run_goal_loop_future("go", "c", 5)
    env.gates.wait_entered("T2")
    rt.clear_goal()
    env.gates.open("T2")
    outcomes = future.result(WAIT)
    assert [o.final_text for o in outcomes] == ["one", "two"]
    assert len(evaluator.calls) == 1
    assert rt.current_goal() is None


def test_gl09_the_evaluator_gets_the_transcript_tail(env: Env) -> None:
    """GL-09: a 100-message transcript → the evaluator gets the last 20 messages (GOAL_JUDGE_TAIL)."""
    evaluator = FakeEvaluator(yes())
    rt = env.build(goal_evaluator=evaluator)
    rt.set_transcript(
        [Message.user(f"m{i}") if i % 2 == 0 else Message.assistant(f"a{i}") for i in range(98)]
    )
    answers(env, 2)
    rt.run_goal_loop("go", "c", 5)
    _, tail = evaluator.calls[0]
    assert len(rt.transcript()) >= 100 and len(tail) == 20
    assert tail == rt.transcript()[:100][-20:]


def test_gl09_tail_length_is_configurable(env: Env) -> None:
    evaluator = FakeEvaluator(yes())
    rt = env.build(goal_evaluator=evaluator, goal_judge_tail=3)
    answers(env, 1)
    rt.run_goal_loop("go", "c", 5)
    assert len(evaluator.calls[0][1]) == 2  # the whole transcript is shorter than the tail


def test_gl10_goal_continuing_carries_the_reason_and_the_next_prompt_is_the_auto_prompt(env: Env) -> None:
    """GL-10: reason "tests failing" → GoalContinuing has it; the next user message is AUTO_PROMPT."""
    rt = env.build(goal_evaluator=FakeEvaluator(no("tests failing"), yes()))
    answers(env, 2)
    rt.run_goal_loop("fix it", "tests pass", 5)
    env.sink.wait_for(lambda e: isinstance(e, GoalAchieved))
    assert [e for e in goal_events(env) if isinstance(e, GoalContinuing)] == [
        GoalContinuing(reason="tests failing", turns=1)
    ]
    assert users(rt) == ["fix it", AUTO_PROMPT.format(condition="tests pass", reason="tests failing")]
    assert env.p1.turns[1].messages[-1].content.endswith(users(rt)[1])


def test_gl11_turns_is_readable_between_turns(env: Env) -> None:
    """GL-11: a query while the evaluator holds the loop reads turns 1, then 2."""
    release = threading.Semaphore(0)
    entered: queue.SimpleQueue[int] = queue.SimpleQueue()

    class Held:
        def evaluate(self, condition: str, tail: Any) -> GoalVerdict:
            entered.put(len(tail))
            assert release.acquire(timeout=WAIT)
            return no()

    rt = env.build(goal_evaluator=Held())
    answers(env, 3)
    future = rt.run_goal_loop_future("go", "c", 3)
    seen = []
    for _ in range(2):
        entered.get(timeout=WAIT)
        goal = rt.current_goal()
        assert goal is not None
        seen.append(goal.turns)
        release.release()
    assert len(future.result(WAIT)) == 3
    assert seen == [1, 2]


@pytest.mark.parametrize("ending", ["achieved", "budget", "cleared", "cancelled", "impossible"])
def test_gl12_no_goal_after_the_loop_ends(env: Env, ending: str) -> None:
    """GL-12: after every kind of ending, current_goal() is None."""
    verdicts = {"achieved": [yes()], "impossible": [dataclasses.replace(no(), impossible=True)]}.get(
        ending, []
    )
    rt = env.build(goal_evaluator=FakeEvaluator(*verdicts))
    if ending == "cleared":
        env.script(call("gate", "g", key="C"), text("x"))
        future = rt.run_goal_loop_future("go", "c", 5)
        env.gates.wait_entered("C")
        rt.clear_goal()
        env.gates.open("C")
        future.result(WAIT)
    elif ending == "cancelled":
        token = CancellationToken()
        token.cancel()
        rt.set_interrupt_token(token)
        rt.run_goal_loop("go", "c", 5)
    else:
        answers(env, 2)
        rt.run_goal_loop("go", "c", 1 if ending == "budget" else 5)
    assert rt.current_goal() is None


def test_gl13_max_turns_zero_runs_one_turn(env: Env) -> None:
    """GL-13: max_turns=0 behaves like 1."""
    evaluator = FakeEvaluator(yes())
    rt = env.build(goal_evaluator=evaluator)
    answers(env, 2)
    assert len(rt.run_goal_loop("go", "c", 0)) == 1
    assert evaluator.calls == []
    wait_goal_end(env)
    assert goal_events(env)[-1] == GoalCleared(reason="budget_exceeded")


def test_gl14_an_evaluator_error_propagates_and_keeps_the_goal(env: Env) -> None:
    """GL-14: the evaluator raises → the loop raises and current_goal().turns == turns run."""
    rt = env.build(goal_evaluator=FakeEvaluator(no(), RuntimeError("judge broke")))
    answers(env, 3)
    with pytest.raises(Exception, match="judge broke"):
        rt.run_goal_loop("go", "c", 5)
    goal = rt.current_goal()
    assert goal is not None and goal.turns == 2 and goal.condition == "c"


def test_gl14_a_turn_error_propagates_and_keeps_the_goal(env: Env) -> None:
    rt = env.build(goal_evaluator=FakeEvaluator(no()))
    env.script(text("one"))
    env.script({"fail": "failed", "message": "provider down"})
    with pytest.raises(Exception, match="provider down"):
        rt.run_goal_loop("go", "c", 5)
    goal = rt.current_goal()
    assert goal is not None and goal.turns == 1


def test_gl15_a_cancelled_turn_ends_the_loop(env: Env) -> None:
    """GL-15: cancel during turn 1 → 1 outcome and GoalCleared{cancelled}."""
    evaluator = FakeEvaluator(yes())
    rt = env.build(goal_evaluator=evaluator)
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("gate", "g", key="K"), text("x"))
    future = rt.run_goal_loop_future("go", "c", 5)
    env.gates.wait_entered("K")
    token.cancel()
    env.gates.open("K")
    outcomes = future.result(WAIT)
    assert len(outcomes) == 1 and outcomes[0].finish_reason is FinishReason.CANCELLED
    assert evaluator.calls == []
    wait_goal_end(env)
    assert goal_events(env)[-1] == GoalCleared(reason="cancelled")


def test_a_token_budget_ends_the_loop(env: Env) -> None:
    """Beyond the seed: token_budget next to max_turns; the loop stops once the turns' tokens reach it."""
    rt = env.build(goal_evaluator=FakeEvaluator(no(), no(), no()))
    for i in range(4):
        env.script({"usage": {"input_tokens": 40, "output_tokens": 10}}, text(f"t{i}"))
    outcomes = rt.run_goal_loop("go", "c", 10, token_budget=100)
    assert len(outcomes) == 2
    wait_goal_end(env)
    assert goal_events(env)[-1] == GoalCleared(reason="token_budget_exceeded")


# ------------------------------------------------------------------------------------ the judge


def verdict_call(achieved: bool, reason: str, impossible: bool = False) -> dict[str, Any]:
    return call(
        "goal_verdict", f"v{uuid.uuid4().hex[:6]}", achieved=achieved, reason=reason, impossible=impossible
    )


def test_the_judge_sees_the_condition_and_the_tail_and_each_call_has_one_receipt(env: Env) -> None:
    """The default evaluator is a judge run on the Router: it is given the condition and the transcript's
    tail; every provider turn of the loop (the turns and the judge calls) has exactly one receipt."""
    operation = uuid.uuid4()
    rt = env.build(operation_ids=lambda: operation)
    env.script(text("I wrote hello.txt"))
    env.script(verdict_call(False, "the file is empty"))
    env.script(text("now it has text"))
    env.script(verdict_call(True, "the file has text"))
    outcomes = rt.run_goal_loop("write hello.txt", "hello.txt has text", 5)
    assert len(outcomes) == 2
    wait_goal_end(env)
    assert goal_events(env)[-1] == GoalAchieved(
        condition="hello.txt has text", turns=2, reason="the file has text"
    )
    assert env.p1.turns[1].response_schema == VERDICT_SCHEMA  # the judge's turn carries the schema
    assert env.p1.turns[0].response_schema is None and env.p1.turns[2].response_schema is None
    judge_input = env.p1.turns[1].messages[-1].content
    assert "<condition>\nhello.txt has text\n</condition>" in judge_input
    assert "I wrote hello.txt" in judge_input
    receipts = RouterClient(env.node, f"{env.node.name}/router").receipts_for(operation, timeout=WAIT)
    assert len(env.p1.turns) == 4 and len(receipts) == 4
    assert len({r.receipt_id for r in receipts}) == 4


def test_a_verdict_that_does_not_parse_is_not_achieved_and_the_loop_stays_bounded(env: Env) -> None:
    """A judge answer that is not the strict JSON verdict → not achieved, the reason says so; max_turns
    still ends the loop."""
    rt = env.build()
    env.script(text("t1"))
    env.script(text("I think it is probably fine"))
    env.script(text("t2"))
    outcomes = rt.run_goal_loop("go", "c", 2)
    assert len(outcomes) == 2
    wait_goal_end(env)
    events = goal_events(env)
    assert kinds(events) == ["GoalSet", "GoalContinuing", "GoalCleared"]
    assert "did not parse" in events[1].reason and events[2] == GoalCleared(reason="budget_exceeded")


def test_a_json_text_verdict_is_accepted(env: Env) -> None:
    rt = env.build()
    env.script(text("t1"))
    env.script(text('{"achieved": true, "reason": "yes it is", "impossible": false}'))
    assert len(rt.run_goal_loop("go", "c", 3)) == 1
    wait_goal_end(env)
    assert goal_events(env)[-1] == GoalAchieved(condition="c", turns=1, reason="yes it is")


def test_an_impossible_verdict_clears_the_goal(env: Env) -> None:
    rt = env.build()
    env.script(text("t1"))
    env.script(verdict_call(False, "there is no such file system", impossible=True))
    assert len(rt.run_goal_loop("go", "c", 5)) == 1
    wait_goal_end(env)
    assert goal_events(env)[-1] == GoalCleared(reason="impossible")
    assert rt.current_goal() is None


def test_a_judge_past_its_timeout_is_not_achieved(env: Env) -> None:
    """A judge that does not answer within judge_timeout (the injected clock) is cancelled: not achieved,
    with a reason that says so, and its provider turn still has its one receipt."""
    clock = ManualClock()
    operation = uuid.uuid4()
    rt = env.build(timers=clock, judge_timeout=30.0, operation_ids=lambda: operation)
    judging = threading.Event()
    env.p1._sleep = lambda seconds: judging.set()  # the script's "delay" step: the judge's turn has begun
    env.script(text("t1"))
    env.script({"delay": 0}, {"hang": True})
    env.script(text("t2"))
    future = rt.run_goal_loop_future("go", "c", 2)
    assert judging.wait(WAIT)
    clock.wait_timer()
    clock.advance(30.0)
    assert len(future.result(WAIT)) == 2
    wait_goal_end(env)
    continuing = [e for e in goal_events(env) if isinstance(e, GoalContinuing)]
    assert len(continuing) == 1 and "did not answer within 30s" in continuing[0].reason
    receipts = RouterClient(env.node, f"{env.node.name}/router").receipts_for(operation, timeout=WAIT)
    assert len(receipts) == 3


def test_parse_verdict_is_strict() -> None:
    assert parse_verdict({"achieved": True, "reason": "r"}, None).achieved
    assert not parse_verdict({"achieved": "yes", "reason": "r"}, None).achieved
    assert "did not parse" in parse_verdict({"achieved": True}, None).reason
    assert "did not parse" in parse_verdict(None, "no json here").reason
    assert parse_verdict(None, 'x {"achieved": false, "reason": "r", "impossible": true} y').impossible


# ------------------------------------------------------------------------------------ durability


def records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_resumed_runtime_knows_its_goal_and_continues_the_loop_with_its_turn_count(
    env: Env, tmp_path: Path
) -> None:
    """Crash between turns (the evaluator holds the loop after turn 1; the session file is copied as a
    SIGKILL would leave it): the resumed runtime has the goal with turns=1, and run_goal_loop on it asks the
    judge about turn 1 and goes on from there, never starting from turn 0 again."""
    path = tmp_path / "s.jsonl"
    hold = threading.Event()
    evaluator = FakeEvaluator(no("keep going"), hold=hold)
    rt = env.build(session_file=path, goal_evaluator=evaluator)
    env.script(text("turn one"))
    future = rt.run_goal_loop_future("go", "c", 3)
    assert evaluator.entered.wait(WAIT)
    crashed = tmp_path / "crashed.jsonl"
    shutil.copy(path, crashed)
    hold.set()
    future.result(WAIT)

    restored = read_journal(crashed)
    assert restored.loops.goal == GoalState(condition="c", max_turns=3, turns=1, tokens_used=0)
    assert restored.loops.goal_loop and restored.loops.goal_phase == "evaluate"
    evaluator2 = FakeEvaluator(no("still failing"), no("again"))
    rt2 = env.build(session_file=crashed, goal_evaluator=evaluator2)
    assert rt2.current_goal() == GoalState(condition="c", max_turns=3, turns=1)
    env.script(text("turn two"))
    env.script(text("turn three"))
    outcomes = rt2.run_goal_loop("go", "c", 3)
    assert [o.final_text for o in outcomes] == ["turn two", "turn three"]
    assert [o.turn_index for o in outcomes] == [1, 2]
    assert users(rt2) == [
        "go",
        AUTO_PROMPT.format(condition="c", reason="still failing"),
        AUTO_PROMPT.format(condition="c", reason="again"),
    ]
    assert len(evaluator2.calls) == 2  # turn 1 (asked again after the crash) and turn 2
    assert rt2.current_goal() is None
    kinds_on_disk = [r["type"] for r in records(crashed) if r["type"].startswith("goal")]
    assert kinds_on_disk.count("goal_set") == 1  # the resumed loop did not set the goal again
    assert kinds_on_disk[-1] == "goal_cleared"  # turn 3 reached max_turns=3


def test_goal_records_are_durable_before_the_judge_is_asked(env: Env, tmp_path: Path) -> None:
    """goal_set before the first turn, goal_turn (with the count) before the evaluator runs."""
    path = tmp_path / "s.jsonl"
    hold = threading.Event()
    evaluator = FakeEvaluator(yes(), hold=hold)
    rt = env.build(session_file=path, goal_evaluator=evaluator)
    answers(env, 1)
    future = rt.run_goal_loop_future("go", "c", 3)
    assert evaluator.entered.wait(WAIT)
    kinds_now = [r["type"] for r in records(path)]
    assert kinds_now.index("goal_set") < kinds_now.index("turn_started")
    assert kinds_now[-1] == "goal_turn" and records(path)[-1]["turns"] == 1
    hold.set()
    future.result(WAIT)
    assert [r["type"] for r in records(path)][-2:] == ["goal_verdict", "goal_achieved"]


def cut_after(path: Path, out: Path, kind: str, nth: int = 1) -> list[str]:
    """The session file as a SIGKILL leaves it right after the ``nth`` record of ``kind`` was written."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    seen = 0
    for n, line in enumerate(lines):
        if json.loads(line)["type"] == kind:
            seen += 1
            if seen == nth:
                out.write_text("\n".join(lines[: n + 1]) + "\n")
                return [json.loads(x)["type"] for x in lines[: n + 1]]
    raise AssertionError(f"no {kind} #{nth} in {path}")


def test_gl06_a_crash_between_turn_finished_and_goal_turn_never_runs_past_max_turns(
    env: Env, tmp_path: Path
) -> None:
    """GL-06/GL-11 across a crash: the session file ends right after turn 2's ``turn_finished`` (its
    ``goal_turn`` never written). The resumed runtime counts turn 2 from its tagged ``turn_started``, so with
    max_turns=2 run_goal_loop ends at once with GoalCleared(budget_exceeded): no third turn, no judge."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path, goal_evaluator=FakeEvaluator(no("red")))
    env.script(text("one"))
    env.script(text("two"))
    rt.run_goal_loop("go", "c", 2)
    crashed = tmp_path / "crashed.jsonl"
    kinds_left = cut_after(path, crashed, "turn_finished", 2)
    assert kinds_left.count("goal_turn") == 1  # turn 2's count was not yet on disk
    restored = read_journal(crashed).loops
    assert restored.goal is not None and restored.goal.turns == 2 and restored.goal_phase == "evaluate"

    evaluator2 = FakeEvaluator(no("would run a third turn"))
    rt2 = env.build(session_file=crashed, goal_evaluator=evaluator2)
    assert rt2.current_goal() == GoalState(condition="c", max_turns=2, turns=2)
    env.script(text("three: past max_turns"))
    assert rt2.run_goal_loop("go", "c", 2) == []
    assert evaluator2.calls == []
    assert rt2.current_goal() is None
    assert [r["type"] for r in records(crashed)].count("turn_started") == 2
    assert records(crashed)[-1] == {"type": "goal_cleared", "reason": "budget_exceeded"}


def test_gl06_a_crash_between_goal_turn_and_goal_cleared_is_not_judged_on_resume(
    env: Env, tmp_path: Path
) -> None:
    """GL-06 across a crash: the last turn's ``goal_turn`` is on disk, its ``goal_cleared(budget_exceeded)``
    is not; the resumed loop checks the budget again before asking the judge, and ends."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path, goal_evaluator=FakeEvaluator())
    env.script(text("only"))
    rt.run_goal_loop("go", "c", 1)
    crashed = tmp_path / "crashed.jsonl"
    cut_after(path, crashed, "goal_turn")
    evaluator2 = FakeEvaluator(yes("would be achieved"))
    rt2 = env.build(session_file=crashed, goal_evaluator=evaluator2)
    assert rt2.run_goal_loop("go", "c", 1) == []
    assert evaluator2.calls == []
    assert records(crashed)[-1] == {"type": "goal_cleared", "reason": "budget_exceeded"}


def test_a_turn_the_process_died_in_counts_toward_max_turns(env: Env, tmp_path: Path) -> None:
    """A goal-loop turn with no end record (the process died in it) counts once started: resumed with
    max_turns=2 after dying in turn 2, the loop runs no further turn."""
    path = tmp_path / "s.jsonl"
    rt = env.build(session_file=path, goal_evaluator=FakeEvaluator(no("red")))
    env.script(text("one"))
    env.script(text("two"))
    rt.run_goal_loop("go", "c", 2)
    crashed = tmp_path / "crashed.jsonl"
    cut_after(path, crashed, "turn_started", 2)
    restored = read_journal(crashed)
    assert restored.interrupted is not None and restored.loops.goal is not None
    assert restored.loops.goal.turns == 2
    rt2 = env.build(session_file=crashed, goal_evaluator=FakeEvaluator())
    env.script(text("three: past max_turns"))
    assert rt2.run_goal_loop("go", "c", 2) == []
    assert [r["type"] for r in records(crashed)].count("turn_started") == 2


def test_only_the_goal_loops_own_turns_are_counted(env: Env, tmp_path: Path) -> None:
    """A plain turn after a goal loop crashed (no run_goal_loop yet) is not one of the loop's turns."""
    path = tmp_path / "s.jsonl"
    hold = threading.Event()
    evaluator = FakeEvaluator(no("red"), hold=hold)
    rt = env.build(session_file=path, goal_evaluator=evaluator)
    env.script(text("one"))
    future = rt.run_goal_loop_future("go", "c", 3)
    assert evaluator.entered.wait(WAIT)
    crashed = tmp_path / "crashed.jsonl"
    shutil.copy(path, crashed)
    hold.set()
    future.result(WAIT)
    rt2 = env.build(session_file=crashed, goal_evaluator=FakeEvaluator())
    env.script(text("a plain turn"))
    rt2.run("hello")
    assert read_journal(crashed).loops.goal == GoalState(condition="c", max_turns=3, turns=1)
