"""The conversation layer's value types (RULES.md Appendix A.4): transcript messages, outcomes and events.

Every type here is a frozen dataclass with a ``TAG``: it crosses the bus as it is (commands, replies, events
told to an event sink) and lands in the session's JSONL file through ``to_json`` / ``from_json``.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar, Literal

from actors.types import TokenUsage
from transport.codec import JsonValue
from transport.records import frozen

Role = Literal["system", "user", "assistant", "tool"]


@frozen(kw_only=True)
class MessageToolCall:
    """One tool call an assistant message carries: ``arguments`` is the JSON text of the arguments."""

    TAG: ClassVar[str] = "conv.tool_call"
    id: str
    name: str
    arguments: str


@frozen(kw_only=True)
class Message:
    """One transcript message. ``tool_calls`` only on assistant messages; ``tool_call_id``/``is_error`` only
    on tool messages."""

    TAG: ClassVar[str] = "conv.message"
    role: Role
    content: str
    tool_calls: tuple[MessageToolCall, ...] = ()
    tool_call_id: str | None = None
    is_error: bool = False

    @staticmethod
    def system(text: str) -> Message:
        return Message(role="system", content=text)

    @staticmethod
    def user(text: str) -> Message:
        return Message(role="user", content=text)

    @staticmethod
    def assistant(text: str, tool_calls: tuple[MessageToolCall, ...] = ()) -> Message:
        return Message(role="assistant", content=text, tool_calls=tool_calls)

    @staticmethod
    def tool(call_id: str, text: str, *, is_error: bool = False) -> Message:
        return Message(role="tool", content=text, tool_call_id=call_id, is_error=is_error)

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            row["tool_calls"] = [
                {"id": c.id, "name": c.name, "arguments": c.arguments} for c in self.tool_calls
            ]
        if self.tool_call_id is not None:
            row["tool_call_id"] = self.tool_call_id
        if self.is_error:
            row["is_error"] = True
        return row

    @staticmethod
    def from_json(row: dict[str, Any]) -> Message:
        return Message(
            role=row["role"],
            content=str(row["content"]),
            tool_calls=tuple(
                MessageToolCall(id=str(c["id"]), name=str(c["name"]), arguments=str(c["arguments"]))
                for c in row.get("tool_calls", ())
            ),
            tool_call_id=row.get("tool_call_id"),
            is_error=bool(row.get("is_error", False)),
        )


@frozen(kw_only=True)
class ChatTokenUsage:
    """[S2] ``TokenUsage`` of one conversation turn (A.4)."""

    TAG: ClassVar[str] = "conv.usage"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cache_hit_tokens: int = 0
    cache_miss_tokens: int = 0

    @staticmethod
    def from_token_usage(u: TokenUsage | None) -> ChatTokenUsage:
        if u is None:
            return ChatTokenUsage()
        return ChatTokenUsage(
            prompt_tokens=u.input_tokens,
            completion_tokens=u.output_tokens,
            total_tokens=u.total_tokens or u.input_tokens + u.output_tokens,
            cache_hit_tokens=u.cached_input_tokens,
            cache_miss_tokens=max(0, u.input_tokens - u.cached_input_tokens),
        )

    def to_json(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.total_tokens,
            "cache_hit_tokens": self.cache_hit_tokens,
            "cache_miss_tokens": self.cache_miss_tokens,
        }


class FinishReason(enum.StrEnum):
    STOP = "stop"
    CANCELLED = "cancelled"
    MAX_STEPS = "max_steps"
    LENGTH = "length"


@frozen(kw_only=True)
class RuntimeOutcome:
    """What one turn produced. ``new_messages`` counts the messages appended after the user message;
    ``steps`` the tool calls run in the turn; ``checkpoint_id`` is always None from ``run`` (CV-04)."""

    TAG: ClassVar[str] = "conv.outcome"
    finish_reason: FinishReason
    final_text: str
    new_messages: int
    steps: int
    usage: ChatTokenUsage
    turn_index: int
    checkpoint_id: str | None = None


# ------------------------------------------------------------------------------------------ events
# The runtime's own events (persisted in the session's JSONL): MessageAppended, TurnFinished,
# CompactionBoundary. Streaming events (for a live UI, never persisted): TextDelta, ToolCallStarted,
# ToolCallFinished. ToolNotice is what a sink-holding tool emits (ES-02/ES-03).


@frozen(kw_only=True)
class MessageAppended:
    TAG: ClassVar[str] = "conv.ev.message_appended"
    message: Message
    index: int


@frozen(kw_only=True)
class TurnFinished:
    TAG: ClassVar[str] = "conv.ev.turn_finished"
    turn_index: int
    finish_reason: FinishReason
    usage: ChatTokenUsage


CompactionTrigger = Literal["tokens", "chars", "manual", "partial_before", "partial_after"]


@frozen(kw_only=True)
class CompactionBoundary:
    """Everything persisted before this record was compacted: a reader starts over from here (CP-06)."""

    TAG: ClassVar[str] = "conv.ev.compaction_boundary"
    trigger: CompactionTrigger
    summarized_count: int
    kept_count: int
    prompt_tokens: int | None = None
    cache_hit_tokens: int | None = None
    cache_miss_tokens: int | None = None


@frozen(kw_only=True)
class TextDelta:
    """A piece of the assistant's text as the model generates it (turn ``turn_index``)."""

    TAG: ClassVar[str] = "conv.ev.text_delta"
    turn_index: int
    text: str


@frozen(kw_only=True)
class ToolCallStarted:
    TAG: ClassVar[str] = "conv.ev.tool_call_started"
    turn_index: int
    call_id: str
    name: str
    arguments: str  # JSON text


@frozen(kw_only=True)
class ToolCallFinished:
    TAG: ClassVar[str] = "conv.ev.tool_call_finished"
    turn_index: int
    call_id: str
    name: str
    ok: bool
    text: str


@frozen(kw_only=True)
class ToolNotice:
    """An event a sink-holding tool emits through the sink it was registered with (ES-02)."""

    TAG: ClassVar[str] = "conv.ev.tool_notice"
    tool: str
    data: JsonValue


# ------------------------------------------------------------------------ goals, wakeups and jobs
# (RULES.md 9.6-9.8; loops.py). Each goal event is also a journal record (journal.py).

GoalClearReason = Literal["cleared", "budget_exceeded", "token_budget_exceeded", "cancelled", "impossible"]


@frozen(kw_only=True)
class GoalState:
    """The active goal (GL-01): ``turns`` counts the goal loop's turns so far; ``tokens_used`` their total
    tokens (checked against ``token_budget`` when one is set)."""

    TAG: ClassVar[str] = "conv.goal_state"
    condition: str
    max_turns: int
    turns: int = 0
    token_budget: int | None = None
    tokens_used: int = 0


@frozen(kw_only=True)
class GoalVerdict:
    """An evaluator's answer: ``impossible`` True ends the loop with ``GoalCleared(reason="impossible")``."""

    TAG: ClassVar[str] = "conv.goal_verdict"
    achieved: bool
    reason: str
    impossible: bool = False


@frozen(kw_only=True)
class GoalSet:
    TAG: ClassVar[str] = "conv.ev.goal_set"
    condition: str
    max_turns: int


@frozen(kw_only=True)
class GoalContinuing:
    TAG: ClassVar[str] = "conv.ev.goal_continuing"
    reason: str
    turns: int


@frozen(kw_only=True)
class GoalAchieved:
    TAG: ClassVar[str] = "conv.ev.goal_achieved"
    condition: str
    turns: int
    reason: str


@frozen(kw_only=True)
class GoalCleared:
    TAG: ClassVar[str] = "conv.ev.goal_cleared"
    reason: GoalClearReason


@frozen(kw_only=True)
class Wakeup:
    """A wakeup in a ``WakeupSlot``: ``due`` is the absolute time (the injected clock's seconds) it fires."""

    TAG: ClassVar[str] = "conv.wakeup"
    delay_s: float
    prompt: str | None = None
    reason: str = ""
    due: float = 0.0


@frozen(kw_only=True)
class WakeupScheduled:
    """A wakeup was put in slot ``slot`` (by the ``schedule_wakeup`` tool or ``WakeupSlot.schedule``)."""

    TAG: ClassVar[str] = "conv.ev.wakeup_scheduled"
    slot: str
    due: float
    delay_s: float
    prompt: str | None = None


@frozen(kw_only=True)
class WakeupWaiting:
    """A loop sleeps until ``due`` (the injected clock's seconds)."""

    TAG: ClassVar[str] = "conv.ev.wakeup_waiting"
    slot: str
    due: float


@frozen(kw_only=True)
class WakeupFired:
    TAG: ClassVar[str] = "conv.ev.wakeup_fired"
    slot: str
    due: float


@frozen(kw_only=True)
class WakeupCancelled:
    TAG: ClassVar[str] = "conv.ev.wakeup_cancelled"
    slot: str
    reason: str


@frozen(kw_only=True)
class CompletedJob:
    """A background job's end (A.4): ``exit_code`` None when its outcome is unknown (its runner died)."""

    TAG: ClassVar[str] = "conv.completed_job"
    job_id: str
    command: str
    exit_code: int | None
    output: str
    completed_at_ms: int
    output_size: int = 0  # the full output's size in bytes (``output`` may be its capped tail)
    lost: bool = False


@frozen(kw_only=True)
class JobStarted:
    TAG: ClassVar[str] = "conv.ev.job_started"
    job_id: str
    command: str


@frozen(kw_only=True)
class JobFinished:
    TAG: ClassVar[str] = "conv.ev.job_finished"
    job_id: str
    exit_code: int | None
    lost: bool = False


AgentEvent = (
    MessageAppended
    | TurnFinished
    | CompactionBoundary
    | TextDelta
    | ToolCallStarted
    | ToolCallFinished
    | ToolNotice
    | GoalSet
    | GoalContinuing
    | GoalAchieved
    | GoalCleared
    | WakeupScheduled
    | WakeupWaiting
    | WakeupFired
    | WakeupCancelled
    | JobStarted
    | JobFinished
)


@frozen(kw_only=True)
class SessionEnd:
    """The hook event ``close`` fires exactly once (CL-01)."""

    TAG: ClassVar[str] = "conv.session_end"
    session_id: str | None
    last_outcome: RuntimeOutcome | None


@frozen(kw_only=True)
class Compactor:
    """Cross-turn compaction settings; the summary comes from the session's model (a Router turn).

    ``threshold_tokens`` is compared with the character estimate (chars / 4, CP-03);
    ``threshold_prompt_tokens`` with the provider's ``prompt_tokens`` when it is set and non-zero (CP-02).
    """

    TAG: ClassVar[str] = "conv.compactor"
    threshold_tokens: int
    threshold_prompt_tokens: int | None = None
    keep_recent_n: int = 4
    instructions: str = (
        "Summarize the conversation below for your own later use: keep facts, decisions, names, numbers "
        "and open tasks. Answer with the summary only."
    )


TYPES = (
    MessageToolCall,
    Message,
    ChatTokenUsage,
    RuntimeOutcome,
    MessageAppended,
    TurnFinished,
    CompactionBoundary,
    TextDelta,
    ToolCallStarted,
    ToolCallFinished,
    ToolNotice,
    SessionEnd,
    Compactor,
    GoalState,
    GoalVerdict,
    GoalSet,
    GoalContinuing,
    GoalAchieved,
    GoalCleared,
    Wakeup,
    WakeupScheduled,
    WakeupWaiting,
    WakeupFired,
    WakeupCancelled,
    CompletedJob,
    JobStarted,
    JobFinished,
)

LOOP_EVENTS = (
    GoalSet,
    GoalContinuing,
    GoalAchieved,
    GoalCleared,
    WakeupScheduled,
    WakeupWaiting,
    WakeupFired,
    WakeupCancelled,
    JobStarted,
    JobFinished,
)


# ------------------------------------------------------------------------ people in the loop (issue 13)


@frozen(kw_only=True)
class TodoItem:
    """One entry of the agent's task list (TD-01..TD-04): ``active_form`` is the text shown while it runs."""

    TAG: ClassVar[str] = "conv.todo"
    content: str
    status: Literal["pending", "in_progress", "completed"]
    active_form: str = ""

    def to_json(self) -> dict[str, str]:
        return {"content": self.content, "status": self.status, "active_form": self.active_form}


@frozen(kw_only=True)
class TodoUpdated:
    """``todo_write`` replaced the list (TD-02); ``version`` counts the lists written by that tool."""

    TAG: ClassVar[str] = "conv.ev.todo_updated"
    todos: tuple[TodoItem, ...]
    version: int


@frozen(kw_only=True)
class PlanProposed:
    """``exit_plan_mode`` proposed ``plan`` (PG-07); ``plan_id`` is the call's idempotency key."""

    TAG: ClassVar[str] = "conv.ev.plan_proposed"
    plan: str
    plan_id: str = ""


PEOPLE_TYPES = (TodoItem, TodoUpdated, PlanProposed)
