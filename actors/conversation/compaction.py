"""Compaction arithmetic (RULES.md CP-*): where a transcript may be split without separating a tool call from
its result (invariant #8), and when cross-turn compaction is due. Pure functions, no actor."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence

from actors.conversation.types import ChatTokenUsage, CompactionTrigger, Compactor, Message

__all__ = [
    "char_count",
    "cross_turn_trigger",
    "is_safe_split",
    "partial_after_boundary",
    "partial_before_split",
    "safe_split_point",
    "summary_refusal",
]


def char_count(messages: Sequence[Message]) -> int:
    """CP-03: the sum of ``len(content)`` and, for messages that carry them, ``len(json(tool_calls))``."""
    total = 0
    for m in messages:
        total += len(m.content)
        if m.tool_calls:
            total += len(
                json.dumps([{"id": c.id, "name": c.name, "arguments": c.arguments} for c in m.tool_calls])
            )
    return total


def is_safe_split(messages: Sequence[Message], s: int) -> bool:
    """Whether cutting before index ``s`` keeps every assistant tool call in the same part as its results."""
    if s <= 0 or s >= len(messages):
        return True
    if messages[s].role == "tool":
        return False
    before = {c.id for m in messages[:s] if m.role == "assistant" for c in m.tool_calls}
    after_results = {m.tool_call_id for m in messages[s:] if m.role == "tool"}
    after_calls = {c.id for m in messages[s:] if m.role == "assistant" for c in m.tool_calls}
    before_results = {m.tool_call_id for m in messages[:s] if m.role == "tool"}
    return not (before & after_results) and not (after_calls & before_results)


def _largest_safe(messages: Sequence[Message], limit: int) -> int:
    for s in range(min(limit, len(messages)), 0, -1):
        if is_safe_split(messages, s):
            return s
    return 0


def safe_split_point(messages: Sequence[Message], keep_recent_n: int) -> int:
    """CP-12: the largest ``s <= len - keep_recent_n`` where no tool pair straddles ``s``; 0 if none > 0."""
    return _largest_safe(messages, len(messages) - max(0, keep_recent_n))


def partial_before_split(messages: Sequence[Message], pivot: int, keep_recent_n: int) -> int:
    """CP-14: the split for ``compact_partial_before(pivot)``: ``min(pivot, safe split of [..=pivot])``,
    checked against the whole transcript. 0 (nothing to do) for an out-of-range pivot."""
    if pivot < 0 or pivot >= len(messages):
        return 0
    return _largest_safe(messages, min(pivot, pivot + 1 - max(0, keep_recent_n)))


def partial_after_boundary(messages: Sequence[Message], pivot: int) -> int | None:
    """CP-16: the boundary ``b <= pivot`` for ``compact_partial_after``, moved back until no tool pair
    straddles it; None for an out-of-range pivot."""
    if pivot < 0 or pivot >= len(messages):
        return None
    b = pivot
    while b > 0 and not is_safe_split(messages, b):
        b -= 1
    return b


def cross_turn_trigger(
    compactor: Compactor, messages: Sequence[Message], usage: ChatTokenUsage
) -> CompactionTrigger | None:
    """CP-02/CP-03/CP-04: "tokens" or "chars" when cross-turn compaction is due, else None."""
    if len(messages) < compactor.keep_recent_n + 2:
        return None
    if compactor.threshold_prompt_tokens is not None and usage.prompt_tokens > 0:
        return "tokens" if usage.prompt_tokens > compactor.threshold_prompt_tokens else None
    return "chars" if math.ceil(char_count(messages) / 4) > compactor.threshold_tokens else None


ECHO_SHARE = 0.5  # a summary whose word triples are at least this share the instruction's is an echo


def summary_refusal(summary: str, instructions: str) -> str | None:
    """CP-17: why a model's summary may not replace the messages it summarises, or None when it may.

    Refused: an empty summary, and one that echoes the summariser's own instruction (a small model answered
    "Summarize the conversation below ..." and the facts it replaced were gone): half or more of its runs
    of three words found in the instruction. A summary of one or two words is let through. The caller
    raises instead of compacting, so the transcript stays as it was."""
    words = re.findall(r"[a-z0-9]+", summary.lower())
    if not words:
        return "the model returned an empty summary"
    if len(words) < 3:
        return None
    said = re.findall(r"[a-z0-9]+", instructions.lower())
    theirs = {tuple(said[i : i + 3]) for i in range(len(said) - 2)}
    ours = [tuple(words[i : i + 3]) for i in range(len(words) - 2)]
    echoed = sum(t in theirs for t in ours) >= ECHO_SHARE * len(ours)
    return "the model's summary repeats the summariser's instruction" if echoed else None
