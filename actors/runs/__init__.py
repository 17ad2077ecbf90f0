"""The runs built on the inference handle (seed 000): the primary-session loop and the subagent run.

- ``runtime.py``: ``InferenceRuntime``, the seed's router-backed ``AgentRuntime`` (resolve a model, start a
  handle, ``run_session``, ``run``).
- ``session.py``: ``run_session`` — rounds driven through a host's callbacks (``SessionHost``, served by
  ``HostActor`` with its idempotent outcome store), by ``SessionLoopActor`` (RULES.md RS-*).
- ``subagent.py``: ``run`` — one fresh-context provider turn with replaceable projected state and a context
  budget (``Host``, ``RunHostActor``, ``SubagentRunActor``; RULES.md SA-*).
- ``machine.py``: the round machine both loops are built on: frozen states, one ``match`` row per (state,
  message), effects the hosting ``RoundActor`` carries out; testable without an actor.
- ``host.py``: the host messages both loops send, and ``ToolHostActor``, the idempotent outcome store
  under ``HostActor`` and ``RunHostActor``; ``events.py``: the events both report.
- ``projection.py``: the subagent's provider input as plain values, no actor.
"""

from actors.runs.projection import ContextBudget, StateUpdate, ToolOutcome
from actors.runs.runtime import InferenceRuntime
from actors.runs.session import (
    HostActor,
    ProviderResume,
    RoundCompletion,
    RoundPreparation,
    SessionCancelled,
    SessionControl,
    SessionEvent,
    SessionHost,
    SessionHostError,
    SessionLoopService,
    SessionRoundLimitError,
    SessionRunRequest,
    SessionToolOutcome,
    run_session,
    run_session_future,
)
from actors.runs.subagent import (
    AuditEvent,
    CaptureFailedError,
    ContextCapacityError,
    EmptyAnswerError,
    EmptyCaptureError,
    Host,
    RunHostActor,
    RunRequest,
    RunResult,
    SubagentHostError,
    run,
    run_future,
)

__all__ = [
    "AuditEvent",
    "CaptureFailedError",
    "ContextBudget",
    "ContextCapacityError",
    "EmptyAnswerError",
    "EmptyCaptureError",
    "Host",
    "HostActor",
    "InferenceRuntime",
    "ProviderResume",
    "RoundCompletion",
    "RoundPreparation",
    "RunHostActor",
    "RunRequest",
    "RunResult",
    "SessionCancelled",
    "SessionControl",
    "SessionEvent",
    "SessionHost",
    "SessionHostError",
    "SessionLoopService",
    "SessionRoundLimitError",
    "SessionRunRequest",
    "SessionToolOutcome",
    "StateUpdate",
    "SubagentHostError",
    "ToolOutcome",
    "run",
    "run_future",
    "run_session",
    "run_session_future",
]
