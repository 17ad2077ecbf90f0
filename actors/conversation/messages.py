"""Wire messages of the conversation actor, its tool host and its event-sink actor (RULES.md C.3).

Requests to the conversation actor come in three classes (MB-03): commands (applied one at a time in
arrival order), queries (answered at once, even mid-turn) and controls (applied at once).
"""

from __future__ import annotations

from typing import ClassVar

from actors.conversation.shadow import CheckpointInfo, RestoreReport, ShadowSpec, Skipped
from actors.conversation.tools import ToolExecution, ToolSpec
from actors.conversation.types import (
    ChatTokenUsage,
    CompletedJob,
    GoalState,
    Message,
    RuntimeOutcome,
    Wakeup,
)
from actors.errors import Broken, KbusError
from transport.codec import JsonValue
from transport.errors import BusError
from transport.records import frozen

# -------------------------------------------------------------------------------------- commands


@frozen(kw_only=True)
class RunTurn:
    TAG: ClassVar[str] = "conv.run"
    text: str


@frozen(kw_only=True)
class ContinueTurn:
    """A command: go on with the turn the journal shows interrupted (the process stopped during it, or a
    tool's outcome became unknown). Each call without a result is asked of the tool host again by its
    idempotency key (a finished call answers its stored outcome and does not run again; a call whose run
    was cut off answers "outcome unknown"), then the model continues the turn."""

    TAG: ClassVar[str] = "conv.continue"


@frozen(kw_only=True)
class EnqueueText:
    TAG: ClassVar[str] = "conv.enqueue"
    text: str
    ticket: str = ""  # the caller's id for it: ``WithdrawEnqueued(ticket)`` takes it back before it runs


@frozen(kw_only=True)
class EnqueueResult:
    TAG: ClassVar[str] = "conv.enqueue_result"
    outcome: RuntimeOutcome | None


@frozen(kw_only=True)
class MaybeCompact:
    TAG: ClassVar[str] = "conv.maybe_compact"
    usage: ChatTokenUsage


@frozen(kw_only=True)
class CompactNow:
    TAG: ClassVar[str] = "conv.compact_now"


@frozen(kw_only=True)
class CompactPartialBefore:
    TAG: ClassVar[str] = "conv.compact_before"
    pivot_index: int


@frozen(kw_only=True)
class CompactPartialAfter:
    TAG: ClassVar[str] = "conv.compact_after"
    pivot_index: int


@frozen(kw_only=True)
class SetTranscript:
    TAG: ClassVar[str] = "conv.set_transcript"
    messages: tuple[Message, ...]


@frozen(kw_only=True)
class TruncateTranscript:
    TAG: ClassVar[str] = "conv.truncate"
    length: int


@frozen(kw_only=True)
class CloseSession:
    TAG: ClassVar[str] = "conv.close"
    last_outcome: RuntimeOutcome | None = None


@frozen(kw_only=True)
class SetLlm:
    """Use the Router model ``model`` for later turns (deferred to the next command boundary, LLM-02)."""

    TAG: ClassVar[str] = "conv.set_llm"
    model: str


@frozen(kw_only=True)
class SetEventSink:
    """``rebind_tools`` True: also re-bind the host's sink-holding tools (ES-02); False: ES-03."""

    TAG: ClassVar[str] = "conv.set_sink"
    address: str | None
    rebind_tools: bool


@frozen(kw_only=True)
class SetSessionId:
    TAG: ClassVar[str] = "conv.set_session_id"
    session_id: str


@frozen(kw_only=True)
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


@frozen(kw_only=True)
class RestoreCheckpoint:
    """Restore the working tree to one of the session's checkpoints; the transcript gets a system message
    that says exactly what was restored, so the model knows from its next turn on."""

    TAG: ClassVar[str] = "conv.restore_checkpoint"
    checkpoint_id: str


@frozen(kw_only=True)
class RunGoalLoop:
    """``run_goal_loop`` (GL-05): turns until the judge says ``condition`` holds, ``max_turns`` (or the
    optional ``token_budget``) is spent, or the goal is cleared. A runtime resumed from a journal whose goal
    loop on the same condition did not end continues it, with its turn count."""

    TAG: ClassVar[str] = "conv.goal_loop"
    prompt: str
    condition: str
    max_turns: int
    token_budget: int | None = None


@frozen(kw_only=True)
class RunLoop:
    """``run_loop`` / ``run_event_loop`` (WK, BG): turns while the agent schedules wakeups in slot ``slot``
    (or, with ``jobs``, a job of that manager completes)."""

    TAG: ClassVar[str] = "conv.run_loop"
    initial_goal: str
    slot: str
    jobs: str | None = None  # the job runner actor's address (run_event_loop), None for run_loop


@frozen(kw_only=True)
class LoopResult:
    TAG: ClassVar[str] = "conv.loop_result"
    outcomes: tuple[RuntimeOutcome, ...]


# -------------------------------------------------------------------------------------- controls


@frozen(kw_only=True)
class SetGoal:
    TAG: ClassVar[str] = "conv.set_goal"
    condition: str
    max_turns: int
    token_budget: int | None = None


@frozen(kw_only=True)
class ClearGoal:
    TAG: ClassVar[str] = "conv.clear_goal"


@frozen(kw_only=True)
class RegisterWakeupTool:
    """Give the model ``schedule_wakeup(delay_seconds, prompt=None)``, writing into slot ``slot``; a delay
    outside ``[0, max_delay_s]`` is refused with an error result."""

    TAG: ClassVar[str] = "conv.register_wakeup_tool"
    slot: str
    max_delay_s: float


@frozen(kw_only=True)
class SlotSchedule:
    TAG: ClassVar[str] = "conv.slot_schedule"
    slot: str
    delay_s: float
    prompt: str | None = None
    reason: str = ""


@frozen(kw_only=True)
class SlotTake:
    """Read slot ``slot``; ``clear`` True empties it (``take``), False leaves it (``peek``)."""

    TAG: ClassVar[str] = "conv.slot_take"
    slot: str
    clear: bool


@frozen(kw_only=True)
class SlotReply:
    TAG: ClassVar[str] = "conv.slot"
    wakeup: Wakeup | None


@frozen(kw_only=True)
class SetInterruptToken:
    TAG: ClassVar[str] = "conv.set_token"
    token_id: str
    cancelled: bool = False


@frozen(kw_only=True)
class WithdrawEnqueued:
    """QU-04: the caller cancelled its enqueue future; a message still waiting resolves to None."""

    TAG: ClassVar[str] = "conv.withdraw"
    ticket: str


@frozen(kw_only=True)
class CancelToken:
    TAG: ClassVar[str] = "conv.cancel_token"
    token_id: str


# --------------------------------------------------------------------------------------- queries


@frozen(kw_only=True)
class GetGoal:
    TAG: ClassVar[str] = "conv.get_goal"


@frozen(kw_only=True)
class GoalReply:
    TAG: ClassVar[str] = "conv.goal"
    goal: GoalState | None


@frozen(kw_only=True)
class GetTranscript:
    TAG: ClassVar[str] = "conv.get_transcript"
    tail: int | None = None  # None: the whole transcript


@frozen(kw_only=True)
class TranscriptReply:
    TAG: ClassVar[str] = "conv.transcript"
    messages: tuple[Message, ...]


@frozen(kw_only=True)
class GetStatus:
    TAG: ClassVar[str] = "conv.get_status"


@frozen(kw_only=True)
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


# ------------------------------------------------------------------------- background jobs (jobs.py)


@frozen(kw_only=True)
class RegisterJobTools:
    """A control: give the model ``start_job``, ``job_status`` and ``stop_job`` on the job runner
    ``runner``; jobs run in ``workdir``, for at most ``timeout_s``; their output is kept to its last
    ``output_cap`` bytes."""

    TAG: ClassVar[str] = "conv.register_job_tools"
    runner: str
    workdir: str
    output_cap: int
    timeout_s: float


@frozen(kw_only=True)
class StartJob:
    """Start a job (idempotent by ``job_id``: a repeat answers the job as it is). ``command``: a shell command
    (``/bin/sh -c``); or ``callable``: the name of a Python callable registered on the runner."""

    TAG: ClassVar[str] = "jobs.start"
    job_id: str
    owner: str
    command: str = ""
    callable: str = ""
    workdir: str = ""
    timeout_s: float = 3600.0
    output_cap: int = 16384


@frozen(kw_only=True)
class GetJob:
    TAG: ClassVar[str] = "jobs.get"
    job_id: str


@frozen(kw_only=True)
class AdoptJob:
    """``GetJob`` that also makes ``owner`` the job's owner: a resumed conversation (perhaps at another
    address) claims a job still running, so its ``JobDone`` reaches the owner that is alive."""

    TAG: ClassVar[str] = "jobs.adopt"
    job_id: str
    owner: str


@frozen(kw_only=True)
class StopJob:
    TAG: ClassVar[str] = "jobs.stop"
    job_id: str


@frozen(kw_only=True)
class StopJobs:
    """End every job of ``owner`` (its whole process group); answered once they have all ended."""

    TAG: ClassVar[str] = "jobs.stop_all"
    owner: str


@frozen(kw_only=True)
class CountJobs:
    TAG: ClassVar[str] = "jobs.count"
    owner: str = ""


@frozen(kw_only=True)
class JobInfo:
    """A job as the runner knows it: ``state`` "running", "finished", "stopped" or "unknown"."""

    TAG: ClassVar[str] = "jobs.info"
    job_id: str
    command: str
    state: str
    exit_code: int | None = None
    output: str = ""
    output_size: int = 0
    pgid: int = 0


@frozen(kw_only=True)
class JobCount:
    TAG: ClassVar[str] = "jobs.count_reply"
    running: int


@frozen(kw_only=True)
class JobDone:
    """Told by the runner to the job's owner when the job ends."""

    TAG: ClassVar[str] = "jobs.done"
    job: CompletedJob


# --------------------------------------------------------------------------------- the tool host


@frozen(kw_only=True)
class ExecuteTool:
    """Run one tool call. ``idempotency_key`` (conversation id, turn, step, call id; never an attempt
    number) is stable across retries and resumes: a host with an effect store runs each key at most once and
    answers a repeat with the stored outcome. An empty key runs the call without that protection."""

    TAG: ClassVar[str] = "conv.host.execute"
    name: str
    arguments: dict[str, JsonValue]
    idempotency_key: str = ""


@frozen(kw_only=True)
class ListTools:
    TAG: ClassVar[str] = "conv.host.list"


@frozen(kw_only=True)
class ToolList:
    TAG: ClassVar[str] = "conv.host.tools"
    specs: tuple[ToolSpec, ...]
    mutating: tuple[str, ...] = ()  # the tools registered mutating (plan mode denies them)


@frozen(kw_only=True)
class BindSink:
    TAG: ClassVar[str] = "conv.host.bind_sink"
    address: str | None


@frozen(kw_only=True)
class BindCheckpoints:
    """The host registers the session's checkpoint tools (see ``EnableCheckpoints``), or fails having
    registered nothing (CK-05)."""

    TAG: ClassVar[str] = "conv.host.bind_checkpoints"
    shadow: ShadowSpec
    session_id: str
    log_path: str
    touched_slot: str = ""
    restore_tool: bool = False


@frozen(kw_only=True)
class CheckpointsBound:
    TAG: ClassVar[str] = "conv.host.checkpoints_bound"
    tools: tuple[str, ...]


@frozen(kw_only=True)
class HostRestoreCheckpoint:
    TAG: ClassVar[str] = "conv.host.restore_checkpoint"
    checkpoint_id: str


# ----------------------------------------------------------------------------------------- errors


class ConversationError(KbusError):
    """A command the conversation cannot carry out (bad argument, failed summary, failed turn)."""

    WIRE = "conv.error"


class TurnFailed(ConversationError, Broken):
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
    RunGoalLoop,
    RunLoop,
)
MESSAGES = (
    *CONVERSATION_COMMANDS,
    LoopResult,
    SetGoal,
    ClearGoal,
    RegisterWakeupTool,
    SlotSchedule,
    SlotTake,
    SlotReply,
    GetGoal,
    GoalReply,
    RegisterJobTools,
    StartJob,
    GetJob,
    AdoptJob,
    StopJob,
    StopJobs,
    CountJobs,
    JobInfo,
    JobCount,
    JobDone,
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
