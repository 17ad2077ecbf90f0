"""The inference handle: one native provider turn, single use (seed 000; RULES.md SI-*, RT-*, MB-02, MB-10).

- ``handle.py``: its values (``PreparedRound``, ``SessionInferenceRequest``, ``SessionInferenceEvent``), its
  messages and errors, and ``InferenceHandleActor``, whose states *are* the single use.
- ``facade.py``: ``SessionInference``, the blocking and future face of one handle, from any thread or process.

``InferenceRuntime``, which starts handles and fronts the runs built on them, is in ``actors.runs``.
"""

from actors.inference.facade import SessionInference
from actors.inference.handle import (
    DEFAULT_ROUND_LIMIT,
    INFERENCE_ERRORS,
    INFERENCE_MESSAGES,
    HandleTerminated,
    InferenceError,
    InferenceHandleActor,
    InferenceTimeout,
    InvalidCallId,
    PreparedRound,
    ProviderEndedError,
    SessionInferenceEvent,
    SessionInferenceRequest,
    parse_call_ktool,
)

__all__ = [
    "DEFAULT_ROUND_LIMIT",
    "INFERENCE_ERRORS",
    "INFERENCE_MESSAGES",
    "HandleTerminated",
    "InferenceError",
    "InferenceHandleActor",
    "InferenceTimeout",
    "InvalidCallId",
    "PreparedRound",
    "ProviderEndedError",
    "SessionInference",
    "SessionInferenceEvent",
    "SessionInferenceRequest",
    "parse_call_ktool",
]
