"""ConversationRuntime over the real Router (scripted provider), a real ToolHostActor and a CaptureSink:
one test per CV/TR/QU/CL/ES/IT/SID/LLM rule, and the actor's side of CP (RULES.md section 9, MB-03)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from peers.conversation_kit import WAIT, CaptureSink, Env, call, env_fixture, text, usage

from actors.conversation import (
    CancellationToken,
    ChatTokenUsage,
    CompactionBoundary,
    Compactor,
    ConversationError,
    ConversationRuntime,
    FinishReason,
    Message,
    MessageAppended,
    MessageToolCall,
    NullSink,
    SessionEnd,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
    ToolNotice,
    TurnFinished,
    read_journal,
)
from actors.inference.handle import InferenceError
from actors.router.catalog import UnknownModel
from actors.router.client import RouterClient
from transport.errors import Unavailable
from transport.node import Node

RUNTIME_EVENTS = (MessageAppended, TurnFinished, CompactionBoundary)


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    yield from env_fixture(make_node, tmp_path)


def runtime_events(sink: CaptureSink) -> list[Any]:
    return sink.of(*RUNTIME_EVENTS)


def wait_turn_finished(sink: CaptureSink, turn_index: int) -> None:
    sink.wait_for(lambda e: isinstance(e, TurnFinished) and e.turn_index == turn_index)


def no_orphans(messages: tuple[Message, ...] | list[Message]) -> bool:
    calls = {c.id for m in messages for c in m.tool_calls}
    results = {m.tool_call_id for m in messages if m.role == "tool"}
    return calls == results


# ------------------------------------------------------------------------------------------ CV: run


def test_cv01_the_user_message_is_appended_before_the_kernel_runs(env: Env) -> None:
    """CV-01: the model's request ends with the new user text; the transcript starts with user(text)."""
    rt = env.build(system_prompt="Be terse.")
    rt.run("what is the answer?")
    request = env.p1.turns[0]
    assert request.messages[-1].content.endswith("what is the answer?")
    assert request.messages[-1].content.startswith("Be terse.")
    assert rt.transcript()[0] == Message.user("what is the answer?")


def test_cv02_one_kernel_turn_appends_its_messages_in_order(env: Env) -> None:
    """CV-02: [assistant(tool_calls=[c1]), tool(c1), assistant("hi")] after the prior messages and the user
    message; the provider ran once."""
    rt = env.build()
    prior = [Message.user("earlier"), Message.assistant("ok")]
    rt.set_transcript(prior)
    env.script(text("adding"), call("add", "c1", a=2, b=3), text("hi"))
    rt.run("add 2 and 3")
    assert rt.transcript() == (
        *prior,
        Message.user("add 2 and 3"),
        Message.assistant("adding", (MessageToolCall(id="c1", name="add", arguments='{"a": 2, "b": 3}'),)),
        Message.tool("c1", "5"),
        Message.assistant("hi"),
    )
    assert len(env.p1.turns) == 1
    assert "earlier" in env.p1.turns[0].messages[-1].content  # the model saw the conversation so far


def test_cv03_run_returns_the_turns_outcome(env: Env) -> None:
    """CV-03: finish_reason and usage are the turn's (A.4 mapping of the provider's usage)."""
    rt = env.build()
    env.script(text("fine"), usage(40, 7, cached=10))
    outcome = rt.run("how are you")
    assert outcome.finish_reason is FinishReason.STOP
    assert outcome.final_text == "fine"
    assert outcome.usage == ChatTokenUsage(
        prompt_tokens=40, completion_tokens=7, total_tokens=47, cache_hit_tokens=10, cache_miss_tokens=30
    )
    assert outcome.new_messages == 1 and outcome.steps == 0


def test_cv04_run_never_makes_a_checkpoint(env: Env) -> None:
    """CV-04: outcome.checkpoint_id is always None (checkpoints come with a later issue)."""
    rt = env.build()
    assert rt.run("x").checkpoint_id is None


def test_cv05_turn_index_counts_every_turn(env: Env) -> None:
    """CV-05: 0 → 1 (run) → 2 (enqueue); a failed turn counts too (INTERPRETATION)."""
    rt = env.build()
    assert rt.turn_index() == 0
    first = rt.run("a")
    assert rt.turn_index() == 1 and first.turn_index == 0
    second = rt.enqueue("b")
    assert second is not None and second.turn_index == 1 and rt.turn_index() == 2
    env.script({"fail": "failed", "message": "boom"})
    with pytest.raises(InferenceError):
        rt.run("c")
    assert rt.turn_index() == 3


def test_cv06_the_outcome_carries_the_turn_index_from_before_the_turn(env: Env) -> None:
    """CV-06: the first run's outcome has turn_index 0, the second's 1; set_transcript does not reset it."""
    rt = env.build()
    assert rt.run("a").turn_index == 0
    rt.set_transcript([])
    assert rt.run("b").turn_index == 1


def test_cv07_builder_requires_a_node_and_a_model_and_starts_empty(env: Env) -> None:
    """CV-07: build() without llm or node raises; a fresh runtime is empty."""
    with pytest.raises(ValueError, match="llm"):
        ConversationRuntime.builder().node(env.node).build()
    with pytest.raises(ValueError, match="node"):
        ConversationRuntime.builder().llm("m1").build()
    rt = env.build()
    assert rt.transcript() == () and rt.turn_index() == 0 and rt.queue_len() == 0
    assert rt.model() == "m1"


def test_cv08_connect_reaches_the_same_actor(env: Env) -> None:
    """CV-08 (across facades): a second facade on the same address sees the same conversation."""
    rt = env.build()
    rt.run("hello")
    other = ConversationRuntime.connect(env.node, rt.address, timeout=WAIT)
    assert other.transcript() == rt.transcript()
    assert other.address == rt.address


def test_cv09_events_after_the_turn_in_transcript_order(env: Env) -> None:
    """CV-09: [MA(user), MA(m1), MA(m2), MA(m3), TurnFinished]; the streaming events come first."""
    rt = env.build()
    env.script(text("look", chunks=2), call("add", "c1", a=1, b=1), text("two"))
    rt.run("1+1")
    wait_turn_finished(env.sink, 0)
    events = runtime_events(env.sink)
    assert [type(e) for e in events] == [MessageAppended] * 4 + [TurnFinished]
    assert [e.index for e in events[:4]] == [0, 1, 2, 3]
    assert [e.message for e in events[:4]] == list(rt.transcript())
    live = env.sink.of(TextDelta, ToolCallStarted, ToolCallFinished)
    assert [type(e) for e in live] == [TextDelta, TextDelta, ToolCallStarted, ToolCallFinished, TextDelta]
    assert "".join(e.text for e in live if isinstance(e, TextDelta)) == "looktwo"
    assert env.sink.events.index(live[-1]) < env.sink.events.index(events[0])


def test_cv10_a_failed_turn_keeps_the_user_message_only(env: Env) -> None:
    """CV-10: the kernel raises before any tool ran → run raises, the transcript ends with user(text), and
    nothing else."""
    rt = env.build()
    env.script({"text": "half an answer"}, {"fail": "failed", "message": "model broke"})
    with pytest.raises(InferenceError):
        rt.run("please fail")
    assert rt.transcript() == (Message.user("please fail"),)
    appended = env.sink.wait_for(lambda e: isinstance(e, MessageAppended))
    assert appended.message == Message.user("please fail")  # persisted like any kept message


def test_cv10_a_failed_turn_keeps_the_tool_calls_that_ran(env: Env) -> None:
    """CV-10 as kbus resolves it with durable work (issue 11): a completed tool call stays with its result
    when the turn then fails (it ran: a retry of the turn must not run it again), no partial text does."""
    rt = env.build()
    env.script(call("add", "c1", a=1, b=2), {"text": "so the sum"}, {"fail": "failed", "message": "broke"})
    with pytest.raises(InferenceError):
        rt.run("add, then fail")
    assert [(m.role, m.content) for m in rt.transcript()] == [
        ("user", "add, then fail"),
        ("assistant", ""),
        ("tool", "3"),
    ]
    env.script(text("it is 3"))  # the retry's model sees the result: nothing runs twice
    rt.run("try again")
    assert env.p1.inputs[-1].count("Tool result (c1, ok): 3") == 1


def test_cv10_a_cancelled_turn_keeps_its_completed_steps(env: Env) -> None:
    """CV-10: a cancelled turn appends the messages completed up to the step boundary."""
    rt = env.build()
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("gate", "c1", key="g"), text("never"))
    future = rt.run_future("go")
    env.gates.wait_entered("g")
    token.cancel()
    env.gates.open("g")
    outcome = future.result(WAIT)
    assert outcome.finish_reason is FinishReason.CANCELLED
    assert outcome.new_messages == 2
    assert [m.role for m in rt.transcript()] == ["user", "assistant", "tool"]


def test_cv11_run_compacts_after_appending_and_before_turn_finished(env: Env) -> None:
    """CV-11: with the threshold exceeded, CompactionBoundary comes before TurnFinished."""
    rt = env.build(compactor=Compactor(threshold_tokens=1, keep_recent_n=1))
    rt.set_transcript([Message.user("old question"), Message.assistant("old answer")])
    env.script(text("new answer"))
    env.script(text("SUMMARY"))  # the summary turn
    outcome = rt.run("new question")
    assert outcome.final_text == "new answer"
    wait_turn_finished(env.sink, 0)
    kinds = [type(e) for e in runtime_events(env.sink)]
    assert kinds.index(CompactionBoundary) < kinds.index(TurnFinished)
    transcript = rt.transcript()
    assert transcript[0].role == "system" and "SUMMARY" in transcript[0].content
    assert transcript[-1] == Message.assistant("new answer")


def test_cv11_a_failing_compaction_never_discards_the_outcome(env: Env) -> None:
    """CV-11: the summary turn fails → run still returns the outcome; the transcript is not compacted."""
    rt = env.build(compactor=Compactor(threshold_tokens=1, keep_recent_n=1))
    env.script(text("answer"))
    env.script({"fail": "failed", "message": "summary broke"})
    outcome = rt.run("question")
    assert outcome.final_text == "answer"
    assert rt.transcript() == (Message.user("question"), Message.assistant("answer"))


def test_cv12_repr_is_immediate_and_holds_no_content(env: Env) -> None:
    """CV-12: repr(runtime) needs no round trip and shows no message text."""
    rt = env.build()
    rt.run("secret words")
    assert "secret" not in repr(rt) and rt.address in repr(rt)


# ----------------------------------------------------------------------------------- TR: transcript


def test_tr01_transcript_is_a_snapshot(env: Env) -> None:
    """TR-01: changing the returned sequence does not change the runtime."""
    rt = env.build()
    rt.run("a")
    snapshot = list(rt.transcript())
    snapshot.append(Message.user("injected"))
    assert len(rt.transcript()) == 2


def test_tr02_transcript_tail(env: Env) -> None:
    """TR-02: n = 0, 2, 5, 9 on a transcript of 5 → lengths 0, 2, 5, 5, equal to transcript()[-n:]."""
    rt = env.build()
    msgs = [Message.user(str(i)) for i in range(5)]
    rt.set_transcript(msgs)
    assert rt.transcript_tail(0) == ()
    assert rt.transcript_tail(2) == tuple(msgs[-2:])
    assert rt.transcript_tail(5) == tuple(msgs)
    assert rt.transcript_tail(9) == tuple(msgs)
    with pytest.raises(ValueError):
        rt.transcript_tail(-1)


def test_tr03_set_transcript_then_run_appends_after_it(env: Env) -> None:
    """TR-03: set_transcript([a, b]) then run("x") → [a, b, user(x), ...]."""
    rt = env.build()
    a, b = Message.user("a"), Message.assistant("b")
    rt.set_transcript([a, b])
    rt.run("x")
    assert rt.transcript()[:3] == (a, b, Message.user("x"))


def test_tr04_truncate_keeps_the_first_n(env: Env) -> None:
    """TR-04: truncate(3) of 5 keeps the same first 3; truncate(9) changes nothing; a negative length is
    a typed error and changes nothing."""
    rt = env.build()
    msgs = [Message.user(str(i)) for i in range(5)]
    rt.set_transcript(msgs)
    rt.truncate_transcript(9)
    assert rt.transcript() == tuple(msgs)
    rt.truncate_transcript(3)
    assert rt.transcript() == tuple(msgs[:3])
    with pytest.raises(ConversationError):
        rt.truncate_transcript(-1)
    assert rt.transcript() == tuple(msgs[:3])


def test_tr05_truncating_to_the_pre_turn_length_restores_it(env: Env) -> None:
    """TR-05: record L0, run a cancelled turn, truncate(L0) → the pre-turn transcript exactly."""
    rt = env.build()
    rt.run("first")
    before = rt.transcript()
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("gate", "c1", key="t5"), text("never"))
    future = rt.run_future("second")
    env.gates.wait_entered("t5")
    token.cancel()
    env.gates.open("t5")
    assert future.result(WAIT).finish_reason is FinishReason.CANCELLED
    rt.truncate_transcript(len(before))
    assert rt.transcript() == before


def test_tr06_set_and_truncate_emit_nothing_and_keep_turn_index(env: Env) -> None:
    """TR-06: no MessageAppended from set_transcript / truncate_transcript; turn_index unchanged."""
    rt = env.build()
    rt.run("a")
    wait_turn_finished(env.sink, 0)
    count = len(runtime_events(env.sink))
    rt.set_transcript([Message.user("x"), Message.user("y")])
    rt.truncate_transcript(1)
    rt.run("b")  # a later event proves the earlier commands' (absent) events would have arrived
    wait_turn_finished(env.sink, 1)
    later = runtime_events(env.sink)[count:]
    assert [e.index for e in later if isinstance(e, MessageAppended)] == [1, 2]
    assert rt.turn_index() == 2


# ------------------------------------------------------------------------------------- QU: enqueue


def test_qu01_enqueued_messages_run_in_arrival_order(env: Env) -> None:
    """QU-01: 3 threads enqueue at once; the turns run one at a time in the order the actor received
    them: each caller's outcome index is its message's position among the user messages."""
    rt = env.build()
    barrier = threading.Barrier(3)
    outcomes: dict[str, Any] = {}

    def send(name: str) -> None:
        barrier.wait(WAIT)
        outcomes[name] = rt.enqueue(name)

    threads = [threading.Thread(target=send, args=(n,)) for n in "ABC"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
    users = [m.content for m in rt.transcript() if m.role == "user"]
    assert sorted(users) == ["A", "B", "C"]
    assert {name: o.turn_index for name, o in outcomes.items()} == {u: i for i, u in enumerate(users)}
    assert [r.messages[-1].content.rpartition("\n")[2].removeprefix("User: ") for r in env.p1.turns] == users


def test_qu03_queue_len_counts_the_waiting_and_answers_mid_turn(env: Env) -> None:
    """QU-03 (MB-03): A blocks in a tool; B and C wait (queue_len 2, answered mid-turn); after B
    starts, 1; at the end, 0."""
    rt = env.build()
    env.script(call("gate", "a1", key="A"), text("A done"))
    env.script(call("gate", "b1", key="B"), text("B done"))
    env.script(text("C done"))
    fa = rt.enqueue_future("A")
    env.gates.wait_entered("A")
    fb = rt.enqueue_future("B")
    fc = rt.enqueue_future("C")
    assert rt.queue_len() == 2  # answered while A is blocked in its tool
    assert rt.transcript()[-1] == Message.user("A")  # the query path works mid-turn too
    assert len(env.p1.turns) == 1
    env.gates.open("A")
    env.gates.wait_entered("B")
    assert rt.queue_len() == 1
    assert fa.result(WAIT).final_text == "A done" and not fb.done()
    env.gates.open("B")
    assert [f.result(WAIT).final_text for f in (fa, fb, fc)] == ["A done", "B done", "C done"]
    assert rt.queue_len() == 0
    finished = [e.turn_index for e in env.sink.of(TurnFinished)]
    assert finished == sorted(finished)


def test_qu02_enqueue_during_a_turn_never_starts_a_concurrent_turn(env: Env) -> None:
    """QU-02: A blocks in a tool, enqueue(B) → B's provider turn starts only after A's TurnFinished; the
    provider never has two turns at once."""
    rt = env.build()
    env.script(call("gate", "a1", key="Q2"), text("A done"))
    env.script(text("B done"))
    fa = rt.enqueue_future("A")
    env.gates.wait_entered("Q2")
    fb = rt.enqueue_future("B")
    assert rt.queue_len() == 1 and len(env.p1.turns) == 1  # B waits; no second provider turn
    env.gates.open("Q2")
    assert fa.result(WAIT).final_text == "A done" and fb.result(WAIT).final_text == "B done"
    wait_turn_finished(env.sink, 1)
    order = [(type(e).__name__, getattr(e, "turn_index", None)) for e in env.sink.of(TurnFinished, TextDelta)]
    assert order.index(("TurnFinished", 0)) < order.index(("TextDelta", 1))


def test_qu04_each_enqueue_resolves_to_its_own_outcome(env: Env) -> None:
    """QU-04: the futures of A and B resolve to outcomes with turn_index 0 and 1."""
    rt = env.build()
    env.script(text("for A"))
    env.script(text("for B"))
    fa, fb = rt.enqueue_future("A"), rt.enqueue_future("B")
    a, b = fa.result(WAIT), fb.result(WAIT)
    assert (a.turn_index, a.final_text) == (0, "for A")
    assert (b.turn_index, b.final_text) == (1, "for B")


def test_qu04_a_withdrawn_or_unrun_message_never_runs(env: Env) -> None:
    """QU-04: cancelling B's future before B starts withdraws it (it never runs); messages still waiting
    when the runtime stops resolve to None."""
    rt = env.build()
    env.script(call("gate", "a1", key="W"), text("A done"))
    fa = rt.enqueue_future("A")
    env.gates.wait_entered("W")
    fb = rt.enqueue_future("B")
    fc = rt.enqueue_future("C")
    assert rt.queue_len() == 2
    assert fb.cancel()
    assert rt.queue_len() == 1  # the withdrawal is a control: applied while A still runs
    env.gates.open("W")
    assert fa.result(WAIT).final_text == "A done" and fc.result(WAIT).turn_index == 1
    assert [m.content for m in rt.transcript() if m.role == "user"] == ["A", "C"]
    env.script(call("gate", "d1", key="S"), text("D done"))
    fd = rt.enqueue_future("D")
    env.gates.wait_entered("S")
    fe = rt.enqueue_future("E")
    assert rt.queue_len() == 1
    ref = env.node.lookup(rt.address.partition("/")[2])  # stop the conversation actor alone, D mid-tool
    assert ref is not None
    ref.stop(block=True, timeout=WAIT)
    assert fe.result(WAIT) is None
    with pytest.raises(Unavailable):
        fd.result(WAIT)
    env.gates.open("S")


def test_qu05_a_failed_queued_turn_fails_only_its_caller(env: Env) -> None:
    """QU-05: A's turn fails → A's future raises; B still runs and resolves."""
    rt = env.build()
    env.script({"fail": "failed", "message": "A broke"})
    env.script(text("B fine"))
    fa, fb = rt.enqueue_future("A"), rt.enqueue_future("B")
    with pytest.raises(InferenceError):
        fa.result(WAIT)
    assert fb.result(WAIT).final_text == "B fine"


def test_qu06_messages_sent_while_the_actor_starts_are_kept_in_order(env: Env, tmp_path: Path) -> None:
    """QU-06: three enqueues sent right after build (the actor restores a session file first) all run,
    in order."""
    path = tmp_path / "big.jsonl"
    seed = ConversationRuntime.builder().node(env.node).llm("m1").session_file(path).timeout(WAIT).build()
    seed.set_transcript([Message.user(f"m{i}") for i in range(200)])
    seed.stop()
    rt = env.build(session_file=path)
    futures = [rt.enqueue_future(t) for t in ("one", "two", "three")]
    assert [f.result(WAIT).turn_index for f in futures] == [0, 1, 2]
    assert [m.content for m in rt.transcript() if m.role == "user"][-3:] == ["one", "two", "three"]


def test_qu07_run_and_enqueue_share_one_fifo(env: Env) -> None:
    """QU-07: run(X) and enqueue(Y) interleaved behind a blocked turn run in arrival order; queue_len
    counts only the enqueued ones."""
    rt = env.build()
    env.script(call("gate", "a1", key="Q7"), text("first"))
    f0 = rt.enqueue_future("first")
    env.gates.wait_entered("Q7")
    fx = rt.run_future("X")
    fy = rt.enqueue_future("Y")
    fz = rt.run_future("Z")
    assert rt.queue_len() == 1
    env.gates.open("Q7")
    results = [f0.result(WAIT), fx.result(WAIT), fy.result(WAIT), fz.result(WAIT)]
    assert [r.turn_index for r in results] == [0, 1, 2, 3]
    assert [m.content for m in rt.transcript() if m.role == "user"] == ["first", "X", "Y", "Z"]


# ------------------------------------------------------------------------------------------- CL: close


class Hooks:
    def __init__(self) -> None:
        self.calls: list[SessionEnd] = []
        self.turns_seen: list[int] = []

    def __call__(self, event: SessionEnd) -> None:
        self.calls.append(event)


def test_cl01_close_fires_session_end_with_the_last_outcome(env: Env) -> None:
    """CL-01: one SessionEnd{session_id, last_outcome} per hook."""
    hooks, other = Hooks(), Hooks()
    rt = env.build(session_id="s-1", on_session_end=hooks)
    outcome = rt.run("a")
    assert hooks.calls == []
    rt.close(outcome)
    assert hooks.calls == [SessionEnd(session_id="s-1", last_outcome=outcome)]
    assert rt.status().closed
    b = ConversationRuntime.builder().node(env.node).llm("m1").on_session_end(other).timeout(WAIT)
    env.built.append(plain := b.build())
    plain.close()
    assert other.calls == [SessionEnd(session_id=None, last_outcome=None)]


def test_cl02_a_second_close_does_nothing(env: Env) -> None:
    """CL-02: close twice → 1 hook invocation; the second call returns normally."""
    hooks = Hooks()
    rt = env.build(on_session_end=hooks)
    rt.close()
    rt.close()
    assert len(hooks.calls) == 1


def test_a_built_runtime_as_a_context_manager_closes_and_stops(env: Env) -> None:
    """Leaving the with-block closes the session (SessionEnd once) and stops the actors build() started;
    a connect()-ed facade closes nothing."""
    hooks = Hooks()
    b = ConversationRuntime.builder().node(env.node).llm("m1").on_session_end(hooks).timeout(WAIT)
    with b.build() as rt:
        with ConversationRuntime.connect(env.node, rt.address, timeout=WAIT) as other:
            other.run("hello")
        assert hooks.calls == [] and rt.turn_index() == 1
    assert len(hooks.calls) == 1
    assert env.node.lookup(rt.address.partition("/")[2]) is None


def test_stop_with_a_tool_still_running_stops_the_rest_and_does_not_raise(env: Env) -> None:
    """A tool host busy in a tool that does not return in time is logged and left running; ``stop`` still
    stops the conversation and the sink actors, and does not raise (``kbus chat`` quitting mid-tool)."""
    rt = env.build()
    env.script(call("gate", "s1", key="ST"), text("never"))
    try:
        rt.run_future("block")
        env.gates.wait_entered("ST")
        names = [name for _, name in rt._owned]
        rt.stop(timeout=0.2)  # the tool host is busy: it cannot stop within the timeout
        host = next(name for name in names if name.endswith(".host"))
        assert [name for name in names if env.node.lookup(name) is not None] == [host]
    finally:
        env.gates.open("ST")


def test_cl03_run_after_close_works_and_never_fires_again(env: Env) -> None:
    """CL-03: close, then run → an outcome; the hook count stays 1."""
    hooks = Hooks()
    rt = env.build(on_session_end=hooks)
    rt.close()
    assert rt.run("after").final_text == "ok"
    rt.close()
    assert len(hooks.calls) == 1


def test_cl04_close_waits_for_hooks_and_survives_a_failing_one(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """CL-04: close returns only after a blocked hook finishes (queries still answer meanwhile); a hook
    that raises is logged and close still returns."""
    release = threading.Event()
    entered = threading.Event()

    def slow(event: SessionEnd) -> None:
        entered.set()
        assert release.wait(WAIT)

    def broken(event: SessionEnd) -> None:
        raise RuntimeError("hook broke")

    rt = env.build(on_session_end=slow)
    b = ConversationRuntime.builder().node(env.node).llm("m1").on_session_end(broken).on_session_end(Hooks())
    other = b.timeout(WAIT).build()
    env.built.append(other)
    future = rt.close_future()
    assert entered.wait(WAIT)
    assert rt.queue_len() == 0 and not future.done()
    release.set()
    future.result(WAIT)
    with caplog.at_level(logging.ERROR):
        other.close()
    assert any("hook" in r.getMessage() and r.exc_info for r in caplog.records)


def test_cl05_close_runs_after_every_command_before_it(env: Env) -> None:
    """CL-05: enqueue A (blocked) and B, then close → the hook fires after B's turn."""
    seen: list[int] = []
    rt_box: list[ConversationRuntime] = []
    env.script(call("gate", "a1", key="C5"), text("A"))
    env.script(text("B"))

    def hook(event: SessionEnd) -> None:
        seen.append(len(env.p1.turns))

    rt = env.build(on_session_end=hook)
    rt_box.append(rt)
    fa = rt.enqueue_future("A")
    env.gates.wait_entered("C5")
    fb = rt.enqueue_future("B")
    fclose = rt.close_future()
    env.gates.open("C5")
    fclose.result(WAIT)
    assert fa.result(WAIT).final_text == "A" and fb.result(WAIT).final_text == "B"
    assert seen == [2]


# ----------------------------------------------------------------------------------- ES: event sinks


def test_es01_event_sink_returns_the_installed_sink(env: Env) -> None:
    """ES-01: after set_event_sink(s2), event_sink() is s2; without one, a NullSink."""
    rt = env.build()
    assert rt.event_sink() is env.sink
    s2 = CaptureSink()
    rt.set_event_sink(s2)
    assert rt.event_sink() is s2
    rt.set_event_sink(None)
    assert isinstance(rt.event_sink(), NullSink)


def test_es02_set_event_sink_rebinds_sink_holding_tools(env: Env) -> None:
    """ES-02: after set_event_sink(s2), a sink-holding tool's notice reaches s2, not s1."""
    rt = env.build()
    s2 = CaptureSink()
    rt.set_event_sink(s2)
    env.script(call("note", "n1", message="hello"), text("done"))
    rt.run("note it")
    notice = s2.wait_for(lambda e: isinstance(e, ToolNotice))
    assert notice.data == {"message": "hello"}
    s2.wait_for(lambda e: isinstance(e, TurnFinished))
    assert env.sink.of(ToolNotice) == []


def test_es02_the_builders_sink_is_the_tools_sink_too(env: Env) -> None:
    """ES-02: without any set_event_sink, a sink-holding tool emits to the sink given to the builder."""
    rt = env.build()
    env.script(call("note", "n1", message="first"), text("done"))
    rt.run("note")
    assert env.sink.wait_for(lambda e: isinstance(e, ToolNotice)).data == {"message": "first"}


def test_es03_replace_event_sink_leaves_tools_on_their_sink(env: Env) -> None:
    """ES-03: after set_event_sink(s1) then replace_event_sink(s2), the notice goes to s1 and the
    runtime's MessageAppended to s2."""
    rt = env.build()  # the builder's sink (s1) is the tools' sink too
    s2 = CaptureSink()
    rt.replace_event_sink(s2)
    env.script(call("note", "n1", message="where"), text("done"))
    rt.run("note")
    env.sink.wait_for(lambda e: isinstance(e, ToolNotice))
    s2.wait_for(lambda e: isinstance(e, TurnFinished))
    assert s2.of(MessageAppended) and not s2.of(ToolNotice)
    assert not env.sink.of(MessageAppended)


def test_es04_rebinding_replaces_tools_without_duplicating(env: Env) -> None:
    """ES-04: the registry has the same tools after set_event_sink (re-registration replaces)."""
    rt = env.build()
    names = env.tools.names()
    rt.set_event_sink(CaptureSink())
    rt.set_event_sink(CaptureSink())
    assert env.tools.names() == names
    env.tools.register(lambda message: message, name="note")
    assert env.tools.names() == names


def test_es05_a_sink_change_during_a_turn_applies_after_it(env: Env) -> None:
    """ES-05: set_event_sink(s2) during turn 1 → all of turn 1's events go to s1, turn 2's to s2."""
    rt = env.build()
    env.script(call("gate", "e1", key="E5"), text("one"))
    f1 = rt.run_future("one")
    env.gates.wait_entered("E5")
    s2 = CaptureSink()
    fset = rt.set_event_sink_future(s2)
    assert rt.status().busy  # a query sent after the command: the command has arrived by now
    assert not fset.done()
    env.gates.open("E5")
    f1.result(WAIT)
    fset.result(WAIT)
    rt.run("two")
    wait_turn_finished(env.sink, 0)
    s2.wait_for(lambda e: isinstance(e, TurnFinished) and e.turn_index == 1)
    assert {e.turn_index for e in env.sink.of(TurnFinished)} == {0}
    assert all(e.index <= 3 for e in env.sink.of(MessageAppended))
    assert [e.index for e in s2.of(MessageAppended)] == [4, 5]


def test_a_sink_that_raises_still_gets_the_later_events(env: Env) -> None:
    """A broken sink is logged and skipped; the turn and the later events are unaffected."""
    seen: list[Any] = []

    class Flaky:
        def emit(self, event: Any) -> None:
            seen.append(event)
            if len(seen) == 1:
                raise RuntimeError("sink broke")

    done = CaptureSink()
    rt = env.build(sink=Flaky())
    rt.run("one")
    rt.set_event_sink(done)
    rt.run("two")
    done.wait_for(lambda e: isinstance(e, TurnFinished))
    assert [type(e) for e in seen] == [TextDelta, MessageAppended, MessageAppended, TurnFinished]


# ---------------------------------------------------------------------------------- IT: interrupts


def test_it01_cancel_ends_the_turn_at_the_next_step_boundary(env: Env) -> None:
    """IT-01: 5 tool steps, cancelled during step 2 → CANCELLED after step 2."""
    rt = env.build()
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(
        call("add", "s1", a=1, b=1),
        call("gate", "s2", key="IT"),
        call("add", "s3", a=3, b=3),
        call("add", "s4", a=4, b=4),
        call("add", "s5", a=5, b=5),
        text("all done"),
    )
    future = rt.run_future("five steps")
    env.gates.wait_entered("IT")
    token.cancel()
    env.gates.open("IT")
    outcome = future.result(WAIT)
    assert outcome.finish_reason is FinishReason.CANCELLED and outcome.steps == 2
    transcript = rt.transcript()
    assert [m.tool_call_id for m in transcript if m.role == "tool"] == ["s1", "s2"]
    assert no_orphans(transcript)
    started = [e.call_id for e in env.sink.of(ToolCallStarted)]
    assert started == ["s1", "s2"]


def test_it02_the_step_in_progress_completes_and_the_next_never_starts(env: Env) -> None:
    """IT-02: cancelled while step 1's tool runs → that tool's result is kept with its call, the tool of
    step 2 never runs, and the model's text after step 1 is never asked for."""
    rt = env.build()
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("gate", "s1", key="I2"), call("gate", "s2", key="never"), text("unreached"))
    future = rt.run_future("two steps")
    env.gates.wait_entered("I2")
    token.cancel()
    env.gates.open("I2")
    outcome = future.result(WAIT)
    assert outcome.finish_reason is FinishReason.CANCELLED and outcome.final_text == ""
    assert env.gates.runs == ["I2"]
    assert rt.transcript()[-1] == Message.tool("s1", "gate I2 opened")
    assert no_orphans(rt.transcript())


def test_it06_cancel_interrupts_a_model_that_is_still_generating(env: Env) -> None:
    """IT-06, IT-02: cancelled while the model is still generating (after one completed tool step) → the
    open provider stream is interrupted at once, the turn ends CANCELLED keeping the completed step (no
    orphan call), and the provider turn gets exactly one ``interrupted`` receipt."""
    operation = uuid.uuid4()
    rt = env.build(operation_ids=lambda: operation)
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("add", "h1", a=1, b=2), text("still thinking"), {"hang": True})
    future = rt.run_future("slow")
    env.sink.wait_for(lambda e: isinstance(e, TextDelta) and e.text == "still thinking")
    token.cancel()
    outcome = future.result(WAIT)  # without the interrupt the provider hangs until the round timeout
    assert outcome.finish_reason is FinishReason.CANCELLED and outcome.final_text == ""
    assert outcome.steps == 1 and outcome.new_messages == 2
    transcript = rt.transcript()
    assert [m.role for m in transcript] == ["user", "assistant", "tool"]
    assert transcript[-1] == Message.tool("h1", "3")
    assert no_orphans(transcript)
    receipts = RouterClient(env.node, f"{env.node.name}/router").receipts_for(operation, timeout=WAIT)
    assert [r.status for r in receipts] == ["interrupted"]
    wait_turn_finished(env.sink, outcome.turn_index)
    rt.set_interrupt_token(CancellationToken())  # IT-05: the cancelled token would cancel the next turn
    env.script(text("after"))  # the conversation goes on
    assert rt.run("next").final_text == "after"


def test_it03_a_replaced_token_has_no_effect(env: Env) -> None:
    """IT-03: set(t1), set(t2), cancel t1, run → completes normally."""
    rt = env.build()
    t1, t2 = CancellationToken(), CancellationToken()
    rt.set_interrupt_token(t1)
    rt.set_interrupt_token(t2)
    t1.cancel()
    assert rt.run("x").finish_reason is FinishReason.STOP


def test_it04_a_cancelled_token_stops_the_turn_before_any_model_call(env: Env) -> None:
    """IT-04: a token cancelled before run → CANCELLED with 0 provider calls."""
    rt = env.build()
    token = CancellationToken()
    token.cancel()
    rt.set_interrupt_token(token)
    outcome = rt.run("x")
    assert outcome.finish_reason is FinishReason.CANCELLED
    assert env.p1.turns == []
    assert rt.transcript() == (Message.user("x"),)


def test_it05_a_cancelled_token_keeps_cancelling_until_replaced(env: Env) -> None:
    """IT-05: cancel, then two runs → both CANCELLED; a fresh token → normal."""
    rt = env.build()
    token = CancellationToken()
    rt.set_interrupt_token(token)
    token.cancel()
    assert rt.run("a").finish_reason is FinishReason.CANCELLED
    assert rt.run("b").finish_reason is FinishReason.CANCELLED
    rt.set_interrupt_token(CancellationToken())
    assert rt.run("c").finish_reason is FinishReason.STOP


def test_it06_cancel_by_id_from_another_facade_is_not_queued(
    env: Env, make_node: Callable[..., Node]
) -> None:
    """IT-06 (in-process half; tests/integration/test_conversation_processes.py has the cross-process one):
    a cancel sent while the turn is blocked is applied at once, by token id, from another node's client."""
    rt = env.build()
    token = CancellationToken()
    rt.set_interrupt_token(token)
    env.script(call("gate", "g1", key="I6"), text("never"))
    future = rt.run_future("block")
    env.gates.wait_entered("I6")
    CancellationToken.bound(env.node, rt.address, token.token_id).cancel()  # returns while blocked
    assert not future.done()
    env.gates.open("I6")
    assert future.result(WAIT).finish_reason is FinishReason.CANCELLED


# ------------------------------------------------------------------------------------ SID, LLM


def _session_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "actors.conversation.actor" and r.levelno == logging.INFO]


def test_sid02_a_later_id_replaces_the_earlier_and_none_before_any(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """SID-02: no session_id before set; set a, run, set b, run → the records read a, then b."""
    rt = env.build()
    with caplog.at_level(logging.INFO, logger="actors.conversation.actor"):
        rt.run("zero")
        before = _session_records(caplog)
        caplog.clear()
        rt.set_session_id("a")
        rt.run("one")
        first = _session_records(caplog)
        caplog.clear()
        rt.set_session_id("b")
        rt.run("two")
        second = _session_records(caplog)
    assert before and all(not hasattr(r, "session_id") for r in before)
    assert first and {getattr(r, "session_id", None) for r in first} == {"a"}
    assert second and {getattr(r, "session_id", None) for r in second} == {"b"}
    spans = [r for r in first if getattr(r, "span", None) == "conversation.turn"]  # the turn's span records
    assert [getattr(r, "turn_index", None) for r in spans] == [1, 1]


def test_sid01_every_run_logs_its_session_id(env: Env, caplog: pytest.LogCaptureFixture) -> None:
    """SID-01: after set_session_id(id), each run adds INFO records (the turn's span records among them)
    with record.session_id == id."""
    rt = env.build()
    rt.set_session_id("sess-9")
    for n in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="actors.conversation.actor"):
            rt.run(f"turn {n}")
        records = _session_records(caplog)
        assert records and all(getattr(r, "session_id", None) == "sess-9" for r in records)
        spans = [r for r in records if getattr(r, "span", None) == "conversation.turn"]
        assert {getattr(r, "turn_index", None) for r in spans} == {n}


def test_llm01_set_llm_switches_later_turns(env: Env) -> None:
    """LLM-01: run on m1, set_llm(m2), run → the second turn reaches only p2."""
    rt = env.build()
    rt.run("one")
    rt.set_llm("m2")
    env.p2.add([text("from p2")])
    assert rt.run("two").final_text == "from p2"
    assert len(env.p1.turns) == 1 and len(env.p2.turns) == 1


def test_llm03_set_llm_keeps_the_transcript_and_turn_index(env: Env) -> None:
    """LLM-03: snapshots before and after set_llm are equal."""
    rt = env.build()
    rt.run("one")
    before = (rt.transcript(), rt.turn_index(), rt.status().queue_len)
    rt.set_llm("m2")
    assert (rt.transcript(), rt.turn_index(), rt.status().queue_len) == before


def test_llm02_set_llm_mid_turn_is_deferred_and_an_unknown_model_is_refused(env: Env) -> None:
    """LLM-02: set_llm(m2) during a turn applies after it (that turn stays on m1); an unknown model is a
    typed error and changes nothing."""
    rt = env.build()
    env.script(call("gate", "l1", key="L2"), text("still p1"))
    future = rt.run_future("block")
    env.gates.wait_entered("L2")
    pending = rt.set_llm_future("m2")
    assert rt.model() == "m1" and not pending.done()
    env.gates.open("L2")
    assert future.result(WAIT).final_text == "still p1"
    pending.result(WAIT)
    assert rt.model() == "m2" and len(env.p2.turns) == 0
    with pytest.raises(UnknownModel):
        rt.set_llm("no-such-model")
    assert rt.model() == "m2"


# -------------------------------------------------------------------------------- persistence


def test_every_runtime_event_lands_in_the_session_file_and_resumes(env: Env, tmp_path: Path) -> None:
    """Persistence: MessageAppended/TurnFinished records are in the JSONL when the turn returns; a new
    runtime on the file resumes the same transcript and turn index (set_transcript is recorded too)."""
    path = tmp_path / "session.jsonl"
    rt = env.build(session_file=path)
    rt.set_transcript([Message.user("from before")])
    env.script(call("add", "c1", a=2, b=2), text("four"))
    rt.run("2+2")
    env.script({"fail": "failed", "message": "broken turn"})
    with pytest.raises(InferenceError):
        rt.run("this one fails")
    restored = read_journal(path)
    assert restored.transcript == rt.transcript()
    assert restored.transcript[-1] == Message.user("this one fails")
    assert restored.turn_index == 2 == rt.turn_index()
    rt.stop()
    again = env.build(session_file=path)
    assert again.transcript() == restored.transcript and again.turn_index() == 2


def test_rs10_usage_reported_with_a_tool_call_counts_when_the_turn_stops_at_its_step_limit(env: Env) -> None:
    """RS-10: the usage update that came in one batch with a tool call reaches the conversation (recorded by
    that call's request) before the tool runs: a turn that then stops at max_steps, whose interrupted
    receipt carries no usage of its own, reports it."""
    rt = env.build(max_steps=1)
    env.script(usage(40, 7), call("add", "c1", a=1, b=2), text("never"))
    outcome = rt.run("add them")
    assert outcome.finish_reason is FinishReason.MAX_STEPS
    assert outcome.usage is not None and outcome.usage.prompt_tokens == 40
    assert outcome.usage.completion_tokens == 7
