"""Wire messages of the conversation actor, its tool host and its event-sink actor (RULES.md C.3).

Requests to the conversation actor come in three classes (MB-03): commands (applied one at a time in
arrival order), queries (answered at once, even mid-turn) and controls (applied at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from actors.conversation.shadow import CheckpointInfo, RestoreReport, ShadowSpec, Skipped
from actors.conversation.tools import ToolExecution, ToolSpec
from actors.conversation.types import ChatTokenUsage, Message, RuntimeOutcome
from transport.codec import JsonValue
from transport.errors import BusError

# -------------------------------------------------------------------------------------- commands


@dataclass(frozen=True, slots=True, kw_only=True)
class RunTurn:
    TAG: ClassVar[str] = "conv.run"
    text: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ContinueTurn:
    """A command: go on with the turn the journal shows interrupted (the process stopped during it, or a
    tool's outcome became unknown). Each call without a result is asked of the tool host again by its
    idempotency key (a finished call answers its stored outcome and does not run again; a call whose run
    was cut off answers "outcome unknown"), then the model continues the turn."""

    TAG: ClassVar[str] = "conv.continue"


@dataclass(frozen=True, slots=True, kw_only=True)
class EnqueueText:
    TAG: ClassVar[str] = "conv.enqueue"
    text: str
    ticket: str = ""  # the caller's id for it: ``WithdrawEnqueued(ticket)`` takes it back before it runs


@dataclass(frozen=True, slots=True, kw_only=True)
class EnqueueResult:
    TAG: ClassVar[str] = "conv.enqueue_result"
    outcome: RuntimeOutcome | None


@dataclass(frozen=True, slots=True, kw_only=True)
class MaybeCompact:
    TAG: ClassVar[str] = "conv.maybe_compact"
    usage: ChatTokenUsage


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactNow:
    TAG: ClassVar[str] = "conv.compact_now"


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactPartialBefore:
    TAG: ClassVar[str] = "conv.compact_before"
    pivot_index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CompactPartialAfter:
    TAG: ClassVar[str] = "conv.compact_after"
    pivot_index: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SetTranscript:
    TAG: ClassVar[str] = "conv.set_transcript"
    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class TruncateTranscript:
    TAG: ClassVar[str] = "conv.truncate"
    length: int


@dataclass(frozen=True, slots=True, kw_only=True)
class CloseSession:
    TAG: ClassVar[str] = "conv.close"
    last_outcome: RuntimeOutcome | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class SetLlm:
    """Use the Router model ``model`` for later turns (deferred to the next command boundary, LLM-02)."""

    TAG: ClassVar[str] = "conv.set_llm"
    model: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SetEventSink:
    """``rebind_tools`` True: also re-bind the host's sink-holding tools (ES-02); False: ES-03."""

    TAG: ClassVar[str] = "conv.set_sink"
    address: str | None
    rebind_tools: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SetSessionId:
    TAG: ClassVar[str] = "conv.set_session_id"
    session_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class EnableCheckpoints:
    """``enable_checkpoints`` (applied between commands): bind the tool host's checkpoint tools to
    ``session_id`` on the shadow repository ``shadow``. ``touched_slot``: the ``TouchedFiles.slot_id`` of a
    set in the tool host's process ("" for none: every save covers the whole tree)."""

    TAG: ClassVar[str] = "conv.enable_checkpoints"
    shadow: ShadowSpec
    session_id: str
    log_path: str
    touched_slot: str = ""
    restore_tool: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreCheckpoint:
    """Restore the working tree to one of the session's checkpoints; the transcript gets a system message
    that says exactly what was restored, so the model knows from its next turn on."""

    TAG: ClassVar[str] = "conv.restore_checkpoint"
    checkpoint_id: str


# -------------------------------------------------------------------------------------- controls


@dataclass(frozen=True, slots=True, kw_only=True)
class SetInterruptToken:
    TAG: ClassVar[str] = "conv.set_token"
    token_id: str
    cancelled: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WithdrawEnqueued:
    """QU-04: the caller cancelled its enqueue future; a message still waiting resolves to None."""

    TAG: ClassVar[str] = "conv.withdraw"
    ticket: str


@dataclass(frozen=True, slots=True, kw_only=True)
class CancelToken:
    TAG: ClassVar[str] = "conv.cancel_token"
    token_id: str


# --------------------------------------------------------------------------------------- queries


@dataclass(frozen=True, slots=True, kw_only=True)
class GetTranscript:
    TAG: ClassVar[str] = "conv.get_transcript"
    tail: int | None = None  # None: the whole transcript


@dataclass(frozen=True, slots=True, kw_only=True)
class TranscriptReply:
    TAG: ClassVar[str] = "conv.transcript"
    messages: tuple[Message, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class GetStatus:
    TAG: ClassVar[str] = "conv.get_status"


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusReply:
    TAG: ClassVar[str] = "conv.status"
    queue_len: int
    turn_index: int
    busy: bool
    model: str
    session_id: str | None
    event_sink: str | None
    transcript_len: int
    closed: bool
    interrupted_turn: int | None = None  # the turn index ``continue_turn`` would go on with
    checkpoints_enabled: bool = False


# --------------------------------------------------------------------------------- the tool host


@dataclass(frozen=True, slots=True, kw_only=True)
class ExecuteTool:
    """Run one tool call. ``idempotency_key`` (conversation id, turn, step, call id; never an attempt
    number) is stable across retries and resumes: a host with an effect store runs each key at most once and
    answers a repeat with the stored outcome. An empty key runs the call without that protection."""

    TAG: ClassVar[str] = "conv.host.execute"
    name: str
    arguments: dict[str, JsonValue]
    idempotency_key: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ListTools:
    TAG: ClassVar[str] = "conv.host.list"


@dataclass(frozen=True, slots=True, kw_only=True)
class ToolList:
    TAG: ClassVar[str] = "conv.host.tools"
    specs: tuple[ToolSpec, ...]
    mutating: tuple[str, ...] = ()  # the tools registered mutating (plan mode denies them)


@dataclass(frozen=True, slots=True, kw_only=True)
class BindSink:
    TAG: ClassVar[str] = "conv.host.bind_sink"
    address: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class BindCheckpoints:
    """The host registers the session's checkpoint tools (see ``EnableCheckpoints``), or fails having
    registered nothing (CK-05)."""

    TAG: ClassVar[str] = "conv.host.bind_checkpoints"
    shadow: ShadowSpec
    session_id: str
    log_path: str
    touched_slot: str = ""
    restore_tool: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointsBound:
    TAG: ClassVar[str] = "conv.host.checkpoints_bound"
    tools: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class HostRestoreCheckpoint:
    TAG: ClassVar[str] = "conv.host.restore_checkpoint"
    checkpoint_id: str


# ----------------------------------------------------------------------------------------- errors


class ConversationError(BusError):
    """A command the conversation cannot carry out (bad argument, failed summary, failed turn)."""

    WIRE = "conv.error"


class TurnFailed(ConversationError):
    """The turn's kernel run raised (CV-10): the user message stays, nothing else was appended."""

    WIRE = "conv.turn_failed"


CONVERSATION_COMMANDS = (
    RunTurn,
    ContinueTurn,
    EnqueueText,
    MaybeCompact,
    CompactNow,
    CompactPartialBefore,
    CompactPartialAfter,
    SetTranscript,
    TruncateTranscript,
    CloseSession,
    SetLlm,
    SetEventSink,
    SetSessionId,
    EnableCheckpoints,
    RestoreCheckpoint,
)
MESSAGES = (
    *CONVERSATION_COMMANDS,
    EnqueueResult,
    SetInterruptToken,
    CancelToken,
    WithdrawEnqueued,
    GetTranscript,
    TranscriptReply,
    GetStatus,
    StatusReply,
    ExecuteTool,
    ListTools,
    ToolList,
    BindSink,
    ToolExecution,
    ToolSpec,
    BindCheckpoints,
    CheckpointsBound,
    HostRestoreCheckpoint,
    ShadowSpec,
    Skipped,
    CheckpointInfo,
    RestoreReport,
)
ERRORS: tuple[type[BusError], ...] = (ConversationError, TurnFailed)
