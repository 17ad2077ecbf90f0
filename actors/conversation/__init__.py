"""The stateful conversation layer (seed 002 ``AgentRuntime``; RULES.md section 9): ``ConversationRuntime``.

A conversation is one ``ConversationActor`` (the session-loop actor that owns the transcript), a
``ToolHostActor`` that runs its tools, and optionally a ``SinkActor`` that hands its events to a local
``EventSink``. Each turn runs the kernel: one ``run_session`` over the Router (``runs/session.py``), in which
the model sees the tools through the single ``call_ktool`` bridge.

Build one (all options but ``node`` and ``llm`` are optional)::

    from actors.conversation import ConversationRuntime, ToolRegistry

    tools = ToolRegistry()
    tools.register(add)                       # a plain function; schema from its hints and docstring
    rt = (
        ConversationRuntime.builder()
        .node(node)                           # the caller's running bus node (required)
        .router("n1/router")                  # the Router's address (default "<node name>/router")
        .llm("local")                         # the Router catalog model (required): "scripted", "local", ...
        .tools(tools)                         # served by a ToolHostActor started on .host_node(n) or node
        # .host("n2/tools")                   # ...or an already running ToolHostActor, any process
        .system_prompt("You are terse.")      # put before the conversation in every model request
        .session_file("sess.jsonl")           # JSONL of MessageAppended/TurnFinished/CompactionBoundary;
                                              # an existing file is resumed (resume=False starts afresh)
        .event_sink(my_sink)                  # any object with emit(event); see the events below
        .session_id("s1")                     # labels the session's log records (extra session_id)
        .compactor(Compactor(threshold_tokens=6000, keep_recent_n=4))
        .on_session_end(hook)                 # hook(SessionEnd) on close(), once
        .max_steps(16)                        # tool calls per turn before MAX_STEPS
        .round_timeout(120.0)                 # provider timeout of one model request
        .name("chat")                         # the actor's name: address "<node>/chat"
        .build()
    )
    outcome = rt.run("What is 2+2?")          # RuntimeOutcome(finish_reason, final_text, ...)
    rt.close(outcome)
    rt.stop()                                 # stops the actors build() started

From another process: ``ConversationRuntime.connect(node, "n1/chat")`` gives the same facade.

``ConversationRuntime.builder()`` options not shown: ``.host_node(node)`` (where the tool host starts),
``.conversation_node(node)`` (where the conversation actor starts), ``.user_id(...)``,
``.reasoning_effort(...)``, ``.timeout(s)`` (the facade's default wait), ``.operation_ids(factory)`` (the
parent operation id of each kernel run: the Router files receipts under it).

Commands (``run``, ``enqueue``, ``compact_*``, ``set_transcript``, ``truncate_transcript``, ``close``, and the
deferred ``set_llm``, ``set_event_sink``, ``replace_event_sink``, ``set_session_id``) run one at a time in
arrival order; queries (``transcript``, ``transcript_tail``, ``queue_len``, ``turn_index``, ``event_sink``,
``status``) and ``set_interrupt_token`` / ``CancellationToken.cancel`` are answered at once, mid-turn too.
Every method takes ``timeout=``; ``run_future``, ``enqueue_future``, ``set_llm_future``,
``set_event_sink_future`` and ``close_future`` return a ``concurrent.futures.Future`` (cancelling an
``enqueue_future`` before its turn starts withdraws the message).

Checkpoints (RULES.md 9.9; checkpoints.py, shadow.py): ``rt.enable_checkpoints(shadow, session_id, log_path,
touched=None, restore_tool=False)`` gives the tool host ``checkpoint_save``/``checkpoint_list``/
``checkpoint_diff`` (and ``checkpoint_restore``) on a ``ShadowRepo``; ``checkpoints_enabled()`` is a query;
``restore_checkpoint(id)`` is a command that also tells the model, through a system message, what it restored.

Events an ``EventSink`` receives, in order: ``TextDelta`` (streamed answer text), ``ToolCallStarted`` and
``ToolCallFinished`` (each tool call and its result, as they happen), then after the turn
``MessageAppended`` for the user message and each new message, ``CompactionBoundary`` (if the turn
compacted) and ``TurnFinished``. A tool with a ``sink`` parameter emits ``ToolNotice`` events through the sink
it was bound to. Interrupt: ``token = CancellationToken(); rt.set_interrupt_token(token)``, then
``token.cancel()`` from any thread; the turn ends ``FinishReason.CANCELLED`` after the current step.

Goals, wakeups and background jobs (RULES.md 9.6-9.8; loops.py, wakeups.py, jobs.py), each journaled in the
session file before it is acted on, so a resumed runtime knows its goal, turn count, pending wakeup and
undelivered job completions:

- ``rt.run_goal_loop(prompt, condition, max_turns, token_budget=None)``: turns until the judge finds
  ``condition`` met (``GoalAchieved``), ``max_turns`` or the token budget is spent, the judge says impossible,
  the goal is cleared, or a turn is cancelled (``GoalCleared{reason}``); ``GoalContinuing{reason}`` after each
  "not yet". ``current_goal()``, ``set_goal(condition, max_turns)`` and ``clear_goal()`` are answered at once.
  The judge is one tool-less Router turn of ``.judge_model(name)`` (default: the session's model) answering
  ``{achieved, reason, impossible}``; a verdict that does not parse, or past ``.judge_timeout(s)``, is "not
  achieved" with a reason that says so. ``.goal_evaluator(obj)`` replaces it; ``.goal_judge_tail(n)`` (20).
- ``slot = WakeupSlot("id")``; ``rt.register_wakeup_tool(slot, max_delay_s=...)`` gives the model
  ``schedule_wakeup(delay_seconds, prompt=None)``; ``rt.run_loop(goal, slot)`` sleeps on the injected clock
  (``.timers(t)``, default wall clock) until each wakeup is due, then runs its prompt; the interrupt token
  cuts the sleep short. Events ``WakeupScheduled``, ``WakeupWaiting``, ``WakeupFired``, ``WakeupCancelled``.
- ``manager = BackgroundJobManager.spawn(node, "jobs", workdir=...)`` (or a ``JobRunnerActor`` in another
  process); ``rt.register_job_tools(manager)`` gives the model ``start_job``, ``job_status``, ``stop_job``;
  ``rt.run_event_loop(goal, slot, manager)`` also runs one turn per completed job, in completion order,
  the output's last ``output_cap`` bytes injected. Events ``JobStarted``, ``JobFinished``. ``close()`` ends
  the jobs' process groups.

People in the loop (issue 13; permissions.py, people.py, gatekeeper.py, hooks.py): ``.people_tools()``
registers ``todo_write``, ``exit_plan_mode`` and ``request_plan_mode``; ``.plan_mode()`` starts in plan mode
(mutating tools denied by the permission layer, for the tool host's tools and the conversation's own, by
the flag each was registered with); ``.ask_timeout(s)`` bounds a person's decision on the ``.timers``
clock, and an interrupt ends it (denied or rejected, journaled).
``set_permission_hook(hook | address)`` (fail closed), ``pending_permissions()``, ``answer_permission(key,
allow)``, ``set_plan_mode(on)``, ``plan_mode()``, ``plan_approval_gate()`` / ``plan_mode_request_gate()``
(gate actors at ``<conversation>.plan_gate`` / ``.plan_mode_gate``), ``confirm_plan()``, ``reject_plan(r)``,
``approve_plan_mode_request()``, ``reject_plan_mode_request(r)``, ``current_todos()``,
``set_sdk_hook_forwarder(f | address | None)``, ``hook_stats()`` and ``kernel()`` (CV-08: a ``KernelInfo``
naming the conversation actor whose ``KernelHost`` runs the turns). Events: ``TodoUpdated``,
``PlanProposed`` (on the sink the tools are bound to, ES-02) and ``PermissionAsked``.

Models that call tools over and over (the 135M ``local`` model): give the Router catalog entry
``tool_choice_after_call = "none"`` (actors/router/catalog.py) and keep ``max_steps`` small.
"""

from actors.conversation.host import ToolHostActor
from actors.conversation.jobs import BackgroundJobManager, JobRunnerActor
from actors.conversation.journal import Restored, read_journal
from actors.conversation.loops import AUTO_PROMPT, GOAL_JUDGE_TAIL, GoalEvaluator
from actors.conversation.messages import ConversationError, StatusReply, TurnFailed
from actors.conversation.runtime import (
    DEFAULT_TIMEOUT,
    ConversationRuntime,
    ConversationRuntimeBuilder,
    WakeupSlot,
)
from actors.conversation.sinks import CallbackSink, EventSink, NullSink, RemoteSink, SinkActor
from actors.conversation.timers import RealTimers, Timers
from actors.conversation.token import CancellationToken
from actors.conversation.tools import ToolExecution, ToolRegistry, ToolRegistryError, ToolSpec
from actors.conversation.types import (
    AgentEvent,
    ChatTokenUsage,
    CompactionBoundary,
    Compactor,
    CompletedJob,
    FinishReason,
    GoalAchieved,
    GoalCleared,
    GoalContinuing,
    GoalSet,
    GoalState,
    GoalVerdict,
    JobFinished,
    JobStarted,
    Message,
    MessageAppended,
    MessageToolCall,
    RuntimeOutcome,
    SessionEnd,
    TextDelta,
    ToolCallFinished,
    ToolCallStarted,
    ToolNotice,
    TurnFinished,
    Wakeup,
    WakeupCancelled,
    WakeupFired,
    WakeupScheduled,
    WakeupWaiting,
)

__all__ = [
    "AUTO_PROMPT",
    "CONVERSATION_ERRORS",
    "CONVERSATION_MESSAGES",
    "DEFAULT_TIMEOUT",
    "GOAL_JUDGE_TAIL",
    "AgentEvent",
    "BackgroundJobManager",
    "CallbackSink",
    "CancellationToken",
    "ChatTokenUsage",
    "CompactionBoundary",
    "Compactor",
    "CompletedJob",
    "ConversationError",
    "ConversationRuntime",
    "ConversationRuntimeBuilder",
    "EventSink",
    "FinishReason",
    "GoalAchieved",
    "GoalCleared",
    "GoalContinuing",
    "GoalEvaluator",
    "GoalSet",
    "GoalState",
    "GoalVerdict",
    "JobFinished",
    "JobRunnerActor",
    "JobStarted",
    "Message",
    "MessageAppended",
    "MessageToolCall",
    "NullSink",
    "RealTimers",
    "RemoteSink",
    "Restored",
    "RuntimeOutcome",
    "SessionEnd",
    "SinkActor",
    "StatusReply",
    "TextDelta",
    "Timers",
    "ToolCallFinished",
    "ToolCallStarted",
    "ToolExecution",
    "ToolHostActor",
    "ToolNotice",
    "ToolRegistry",
    "ToolRegistryError",
    "ToolSpec",
    "TurnFailed",
    "TurnFinished",
    "Wakeup",
    "WakeupCancelled",
    "WakeupFired",
    "WakeupScheduled",
    "WakeupSlot",
    "WakeupWaiting",
    "read_journal",
]

# The wire table actors/app/wiring.py adds to the registry.
from typing import Any as _Any

from actors.conversation.gatekeeper import GATEKEEPER_MESSAGES as _GATEKEEPER
from actors.conversation.hooks import HOOK_MESSAGES as _HOOKS
from actors.conversation.messages import ERRORS as _ERRORS
from actors.conversation.messages import MESSAGES as _MESSAGES
from actors.conversation.people import PEOPLE_MESSAGES as _PEOPLE
from actors.conversation.permissions import PERMISSION_MESSAGES as _PERMISSIONS
from actors.conversation.types import PEOPLE_TYPES as _PEOPLE_TYPES
from actors.conversation.types import TYPES as _TYPES

CONVERSATION_MESSAGES: tuple[type[_Any], ...] = (*_TYPES, *_MESSAGES)
CONVERSATION_MESSAGES = (
    *CONVERSATION_MESSAGES,
    *_PEOPLE_TYPES,
    *_PERMISSIONS,
    *_PEOPLE,
    *_GATEKEEPER,
    *_HOOKS,
)
CONVERSATION_ERRORS = _ERRORS
