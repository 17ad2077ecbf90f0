"""Compaction (RULES.md CP-*): the split arithmetic as plain functions (with a Hypothesis property for
invariant #8), and the runtime's compaction commands over the real Router (scripted summary turns)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peers.conversation_kit import WAIT, CaptureSink

from actors.app.wiring import registry
from actors.conversation import (
    ChatTokenUsage,
    CompactionBoundary,
    Compactor,
    ConversationError,
    ConversationRuntime,
    Message,
    MessageAppended,
    MessageToolCall,
    TurnFinished,
    read_journal,
)
from actors.conversation.compaction import (
    char_count,
    cross_turn_trigger,
    is_safe_split,
    partial_after_boundary,
    partial_before_split,
    safe_split_point,
)
from actors.router.actor import RouterActor
from actors.router.providers.scripted import ScriptedProvider
from transport.node import Node


def u(i: int) -> Message:
    return Message.user(f"u{i}")


def a_calls(*ids: str) -> Message:
    return Message.assistant("", tuple(MessageToolCall(id=i, name="t", arguments="{}") for i in ids))


def r(call_id: str) -> Message:
    return Message.tool(call_id, f"result {call_id}")


# ------------------------------------------------------------------------------- pure: split points


def test_cp12_a_split_on_a_tool_result_moves_before_its_assistant() -> None:
    """CP-12: the split that would land on a tool result moves back before the assistant that called it;
    chained results move it back further; none > 0 → 0."""
    msgs = [u(0), u(1), a_calls("c1"), r("c1"), u(4)]
    assert safe_split_point(msgs, 2) == 2  # len-k = 3 is r(c1): back to the assistant at 2
    chained = [u(0), a_calls("c1", "c2"), r("c1"), r("c2"), u(4)]
    assert safe_split_point(chained, 1) == 4
    assert safe_split_point(chained, 2) == 1
    assert safe_split_point([a_calls("c1"), r("c1")], 1) == 0
    assert safe_split_point([u(0), u(1)], 0) == 2
    assert safe_split_point([u(0)], 5) == 0


def test_cp10_the_pair_at_the_end_stays_in_the_kept_part() -> None:
    """CP-10: the last message is a tool result whose pair starts at len-4 (two results, then a reply),
    k=2 → the whole pair is kept."""
    msgs = [u(0), u(1), u(2), a_calls("c1", "c2"), r("c1"), r("c2")]
    s = safe_split_point(msgs, 2)
    assert s == 3 and all(m in msgs[s:] for m in msgs[3:])


def test_cp14_partial_before_indices() -> None:
    """CP-14: len=12, p=8, k=2 → split 7; k=0 → split 8 (message 8 is kept)."""
    msgs = [u(i) for i in range(12)]
    assert partial_before_split(msgs, 8, 2) == 7
    assert partial_before_split(msgs, 8, 0) == 8
    assert partial_before_split(msgs, 12, 0) == 0  # CP-13: out of range
    assert partial_before_split(msgs, 1, 2) == 0  # CP-13: the split is 0


def test_cp16_partial_after_boundary_moves_back_over_a_pair() -> None:
    """CP-16: transcript[p] is the result of the assistant at p-1 → b = p-1; no pairs → b = p."""
    msgs = [u(0), u(1), a_calls("c1"), r("c1"), u(4)]
    assert partial_after_boundary(msgs, 3) == 2
    assert partial_after_boundary(msgs, 4) == 4
    assert partial_after_boundary(msgs, 5) is None  # CP-15


def test_cp02_the_token_check_takes_priority() -> None:
    """CP-02: threshold_prompt_tokens=1000: 1500 compacts a tiny transcript; 500 with a big character
    estimate does not; 1000 does not."""
    c = Compactor(threshold_tokens=10, threshold_prompt_tokens=1000, keep_recent_n=1)
    tiny = [u(0), u(1), u(2)]
    big = [Message.user("x" * 400)] * 3
    assert cross_turn_trigger(c, tiny, ChatTokenUsage(prompt_tokens=1500)) == "tokens"
    assert cross_turn_trigger(c, big, ChatTokenUsage(prompt_tokens=500)) is None
    assert cross_turn_trigger(c, big, ChatTokenUsage(prompt_tokens=1000)) is None


def test_cp03_the_character_estimate_otherwise() -> None:
    """CP-03: prompt_tokens=0 (or no token threshold): 4T+4 characters compact, 4T do not."""
    t = 25
    c = Compactor(threshold_tokens=t, threshold_prompt_tokens=1000, keep_recent_n=0)
    over = [Message.user("x" * (2 * t)), Message.user("y" * (2 * t + 4))]
    exact = [Message.user("x" * (2 * t)), Message.user("y" * (2 * t))]
    assert char_count(over) == 4 * t + 4
    assert cross_turn_trigger(c, over, ChatTokenUsage()) == "chars"
    assert cross_turn_trigger(c, exact, ChatTokenUsage()) is None
    calls = a_calls("c1")
    assert char_count([calls]) == len(json.dumps([{"id": "c1", "name": "t", "arguments": "{}"}]))


def test_cp04_never_below_keep_recent_n_plus_two() -> None:
    """CP-04: the threshold is exceeded but len = keep_recent_n + 1 → no compaction."""
    c = Compactor(threshold_tokens=0, keep_recent_n=2)
    assert cross_turn_trigger(c, [Message.user("x" * 100)] * 3, ChatTokenUsage()) is None
    assert cross_turn_trigger(c, [Message.user("x" * 100)] * 4, ChatTokenUsage()) == "chars"


# ------------------------------------------------------------------------ property: invariant #8


@st.composite
def transcripts(draw: st.DrawFn) -> list[Message]:
    """Random transcripts: user/assistant/system text, and assistant tool-call groups each followed by all
    their results (in a random order, sometimes with other messages in between)."""
    msgs: list[Message] = []
    n = 0
    for kind in draw(st.lists(st.sampled_from(["user", "assistant", "system", "calls"]), max_size=18)):
        body = draw(st.text(max_size=5))
        if kind == "user":
            msgs.append(Message.user(body))
            continue
        if kind in ("assistant", "system"):
            msgs.append(Message.assistant(body) if kind == "assistant" else Message.system(body))
            continue
        ids = [f"c{n + i}" for i in range(draw(st.integers(1, 3)))]
        n += len(ids)
        msgs.append(a_calls(*ids))
        for i in draw(st.permutations(ids)):
            if draw(st.booleans()):  # a message between a call and its result (set_transcript allows it)
                msgs.append(Message.system("note"))
            msgs.append(r(i))
    return msgs


def pairs_intact(part_a: list[Message], part_b: list[Message]) -> bool:
    def calls(ms: list[Message]) -> set[str]:
        return {c.id for m in ms for c in m.tool_calls}

    def results(ms: list[Message]) -> set[str]:
        return {m.tool_call_id for m in ms if m.role == "tool" and m.tool_call_id is not None}

    return calls(part_a) == results(part_a) and calls(part_b) == results(part_b)


@settings(max_examples=400, deadline=None)
@given(transcripts(), st.integers(0, 25), st.integers(0, 6))
def test_cp11_no_compaction_separates_a_tool_call_from_its_result(
    msgs: list[Message], pivot: int, keep: int
) -> None:
    """CP-11 (invariant #8): full, partial-before and partial-after splits never separate an assistant's
    tool calls from their results; CP-12's bound holds for the full split."""
    s = safe_split_point(msgs, keep)
    assert 0 <= s <= max(0, len(msgs) - keep)
    assert pairs_intact(msgs[:s], msgs[s:])
    assert s == 0 or is_safe_split(msgs, s)
    b = partial_before_split(msgs, pivot, keep)
    assert b <= pivot or b == 0
    assert pairs_intact(msgs[:b], msgs[b:])
    after = partial_after_boundary(msgs, pivot)
    if pivot >= len(msgs):
        assert after is None
    else:
        assert after is not None and after <= pivot
        assert pairs_intact(msgs[:after], msgs[after:])


# ----------------------------------------------------------------------- through the runtime


class Env:
    def __init__(self, node: Node, tmp: Path) -> None:
        self.node = node
        self.tmp = tmp
        self.provider = ScriptedProvider()
        node.spawn(RouterActor, "router", data_dir=tmp, providers={"scripted": self.provider})
        self.sink = CaptureSink()
        self.built: list[ConversationRuntime] = []

    def build(self, compactor: Compactor | None, **options: Any) -> ConversationRuntime:
        b = ConversationRuntime.builder().node(self.node).llm("scripted").event_sink(self.sink).timeout(WAIT)
        b.compactor(compactor)
        for key, value in options.items():
            getattr(b, key)(value)
        rt = b.build()
        self.built.append(rt)
        return rt

    def summary(self, body: str = "SUMMARY") -> None:
        self.provider.add([{"text": body}])

    def events_after(self, rt: ConversationRuntime) -> list[Any]:
        """Every runtime event so far (a status query first: events were told before its reply)."""
        rt.run("marker")  # a later TurnFinished proves the earlier events have all arrived
        self.sink.wait_for(lambda e: isinstance(e, TurnFinished))
        events = self.sink.of(MessageAppended, CompactionBoundary)
        marker = next(
            i
            for i, e in enumerate(events)
            if isinstance(e, MessageAppended) and e.message.content == "marker"
        )
        return events[:marker]


@pytest.fixture
def env(make_node: Callable[..., Node], tmp_path: Path) -> Iterator[Env]:
    e = Env(make_node("n1", registry=registry()), tmp_path)
    yield e
    for rt in e.built:
        rt.stop()


def numbered(n: int) -> list[Message]:
    return [Message.user(f"m{i}") if i % 2 == 0 else Message.assistant(f"m{i}") for i in range(n)]


def test_cp01_without_a_compactor_every_call_is_a_no_op(env: Env) -> None:
    """CP-01: the four calls leave the transcript unchanged and emit nothing."""
    rt = env.build(None)
    old = numbered(10)
    rt.set_transcript(old)
    rt.maybe_compact_cross_turn(ChatTokenUsage(prompt_tokens=10**9))
    rt.compact_now()
    rt.compact_partial_before(5)
    rt.compact_partial_after(5)
    assert rt.transcript() == tuple(old)
    assert env.events_after(rt) == []
    assert env.provider.turns[0].messages[-1].content.endswith("marker")  # no summary turn ran


def test_cp05_cp06_compact_now_replaces_the_range_with_one_summary(env: Env) -> None:
    """CP-05: len=10, k=3 → [S] + old[7:], S from the session's model over old[:7]. CP-06: boundary,
    MA(summary), MA(each kept), so replaying after the boundary gives transcript()."""
    rt = env.build(Compactor(threshold_tokens=10**9, threshold_prompt_tokens=10**9, keep_recent_n=3))
    old = numbered(10)
    rt.set_transcript(old)
    env.summary("the gist")
    rt.compact_now()
    after = rt.transcript()
    assert after[1:] == tuple(old[7:]) and after[0].role == "system" and "the gist" in after[0].content
    events = env.events_after(rt)
    assert isinstance(events[0], CompactionBoundary)
    assert (events[0].trigger, events[0].summarized_count, events[0].kept_count) == ("manual", 7, 3)
    assert events[0].cache_hit_tokens is None  # CP-07: manual boundaries carry None
    assert [e.message for e in events[1:]] == list(after)
    summary_request = env.provider.turns[0].messages[-1].content
    assert "m0" in summary_request and "m6" in summary_request and "m7" not in summary_request


def test_cp08_compact_now_ignores_the_thresholds(env: Env) -> None:
    """CP-08: thresholds at 10**9 and len = keep_recent_n + 2 → compact_now still compacts."""
    rt = env.build(Compactor(threshold_tokens=10**9, threshold_prompt_tokens=10**9, keep_recent_n=3))
    rt.set_transcript(numbered(5))
    env.summary()
    rt.compact_now()
    assert len(rt.transcript()) == 4
    assert isinstance(env.events_after(rt)[0], CompactionBoundary)


def test_cp06_the_session_file_replays_to_the_compacted_transcript(env: Env, tmp_path: Path) -> None:
    """CP-06: rebuilding from the JSONL (skipping what the boundary compacted) equals transcript()."""
    path = tmp_path / "s.jsonl"
    rt = env.build(Compactor(threshold_tokens=10**9, keep_recent_n=2), session_file=path)
    rt.set_transcript(numbered(6))
    rt.run("one more")
    env.summary()
    rt.compact_now()
    restored = read_journal(path)
    assert restored.boundaries == 1
    assert restored.transcript == rt.transcript()


def test_cp07_cross_turn_boundary_forwards_the_cache_tokens(env: Env) -> None:
    """CP-02, CP-07: maybe_compact_cross_turn(usage(cache_hit=11, cache_miss=22, prompt=1500)) with a
    1000 threshold compacts, and the boundary carries 1500, 11 and 22."""
    rt = env.build(Compactor(threshold_tokens=10**9, threshold_prompt_tokens=1000, keep_recent_n=1))
    rt.set_transcript(numbered(3))
    env.summary()
    rt.maybe_compact_cross_turn(ChatTokenUsage(prompt_tokens=1500, cache_hit_tokens=11, cache_miss_tokens=22))
    boundary = env.events_after(rt)[0]
    assert boundary == CompactionBoundary(
        trigger="tokens",
        summarized_count=2,
        kept_count=1,
        prompt_tokens=1500,
        cache_hit_tokens=11,
        cache_miss_tokens=22,
    )


def test_cp09_too_short_to_compact(env: Env) -> None:
    """CP-09: compact_now with len = k+1 changes nothing and emits nothing (CP-04 likewise cross-turn)."""
    rt = env.build(Compactor(threshold_tokens=0, threshold_prompt_tokens=1, keep_recent_n=3))
    old = numbered(4)
    rt.set_transcript(old)
    rt.compact_now()
    rt.maybe_compact_cross_turn(ChatTokenUsage(prompt_tokens=99))
    assert rt.transcript() == tuple(old)
    assert env.events_after(rt)[:1] == []


def test_cp13_partial_before_out_of_range_or_zero_split_is_a_no_op(env: Env) -> None:
    """CP-13: p = len, p < 0 and a p so small that the split is 0 change nothing and emit nothing."""
    rt = env.build(Compactor(threshold_tokens=10**9, keep_recent_n=2))
    old = numbered(12)
    rt.set_transcript(old)
    rt.compact_partial_before(12)
    rt.compact_partial_before(-1)
    rt.compact_partial_before(1)
    assert rt.transcript() == tuple(old)
    assert env.events_after(rt) == []


def test_cp14_partial_before_keeps_the_pivot_onward(env: Env) -> None:
    """CP-14: len=12, p=8, k=2 → [S] + old[7:]."""
    rt = env.build(Compactor(threshold_tokens=10**9, keep_recent_n=2))
    old = numbered(12)
    rt.set_transcript(old)
    env.summary()
    rt.compact_partial_before(8)
    assert rt.transcript()[1:] == tuple(old[7:]) and rt.transcript()[0].role == "system"


def test_cp15_partial_after_out_of_range_is_a_no_op(env: Env) -> None:
    """CP-15: p = len (and p < 0) change nothing and emit nothing; so does no compactor at all (CP-01)."""
    rt = env.build(Compactor(threshold_tokens=10**9, keep_recent_n=2))
    old = numbered(6)
    rt.set_transcript(old)
    rt.compact_partial_after(len(old))
    rt.compact_partial_after(-1)
    assert rt.transcript() == tuple(old)
    assert env.events_after(rt) == []


def test_cp16_compact_partial_after_summarizes_from_the_pair_on(env: Env) -> None:
    """CP-16: the pivot is a tool result → the boundary moves back to its assistant; the result is
    old[:b] + [S], the summary at the end."""
    rt = env.build(Compactor(threshold_tokens=10**9, keep_recent_n=2))
    old = [u(0), Message.assistant("a1"), u(2), a_calls("c1"), r("c1"), Message.assistant("done")]
    rt.set_transcript(old)
    env.summary("later part")
    rt.compact_partial_after(4)
    after = rt.transcript()
    assert after[:3] == tuple(old[:3]) and len(after) == 4 and "later part" in after[3].content
    events = env.events_after(rt)
    assert events[0].trigger == "partial_after"
    assert [e.message for e in events[1:]] == list(after)


def test_cp17_a_failed_summary_changes_nothing(env: Env) -> None:
    """CP-17: the summary turn fails → compact_now raises, the transcript is unchanged, no events."""
    rt = env.build(Compactor(threshold_tokens=10**9, keep_recent_n=2))
    old = numbered(8)
    rt.set_transcript(old)
    env.provider.add([{"fail": "failed", "message": "no summary today"}])
    with pytest.raises(ConversationError, match="summar"):
        rt.compact_now()
    env.provider.add([{"text": "   "}])
    with pytest.raises(ConversationError, match="empty summary"):
        rt.compact_now()
    assert rt.transcript() == tuple(old)
    assert env.events_after(rt) == []


def test_cp17_a_summary_echoing_the_instruction_is_refused_and_changes_nothing(env: Env) -> None:
    """CP-17 (issue 16): the embedded model answered the summariser's instruction back as the summary and
    the conversation was gone. An echo, whole or in part, is refused like a failed summary: compact_now
    raises naming why and that the messages are kept, the transcript is unchanged, no events; a real
    summary that quotes a few of the instruction's words still compacts."""
    compactor = Compactor(threshold_tokens=10**9, keep_recent_n=2)
    rt = env.build(compactor)
    old = numbered(8)
    rt.set_transcript(old)
    for echo in (
        compactor.instructions,
        "Summarize the conversation below for your own later use:",
        "keep facts, decisions, names",
    ):
        env.provider.add([{"text": echo}])
        with pytest.raises(ConversationError, match=r"summariser's instruction.*8 messages are kept"):
            rt.compact_now()
        assert rt.transcript() == tuple(old)
    assert env.events_after(rt) == []
    old = list(rt.transcript())
    env.summary("The user asked for 17% of 2350; the answer was 399.5. Open tasks: none.")
    rt.compact_now()
    assert len(rt.transcript()) < len(old) and "399.5" in rt.transcript()[0].content


def test_summary_refusal_names_empty_and_echoed_summaries_only() -> None:
    """The pure check behind CP-17's refusal: empty and echoed summaries get a reason, others None."""
    from actors.conversation.compaction import summary_refusal

    said = Compactor(threshold_tokens=1).instructions
    assert (
        summary_refusal("", said) == summary_refusal("  \n ", said) == "the model returned an empty summary"
    )
    assert summary_refusal(said.upper(), said) is not None
    assert summary_refusal("keep facts, decisions", said) is not None
    assert summary_refusal("the summary", said) is None  # one or two words: let through
    assert summary_refusal("Alice's cat is called Tom; she lives in Oslo.", said) is None
    assert summary_refusal("ok", said) is None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(transcripts(), st.sampled_from(["now", "before", "after", "cross"]), st.integers(0, 25))
def test_cp11_through_the_runtime_no_call_loses_its_result(
    env: Env, msgs: list[Message], how: str, pivot: int
) -> None:
    """CP-11 end to end: whatever the compaction, every tool call left in transcript() has its result
    there and every result its call (the summary turns come from the scripted model's default reply)."""
    if not env.built:
        env.build(Compactor(threshold_tokens=0, keep_recent_n=2))
    rt = env.built[0]
    rt.set_transcript(msgs)
    match how:
        case "now":
            rt.compact_now()
        case "before":
            rt.compact_partial_before(pivot)
        case "after":
            rt.compact_partial_after(pivot)
        case _:
            rt.maybe_compact_cross_turn(ChatTokenUsage())
    after = rt.transcript()
    assert pairs_intact(list(after), [])
    summaries = [m for m in after if m.role == "system" and m.content.startswith("Summary of")]
    assert len(summaries) <= 1
