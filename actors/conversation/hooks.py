"""The SDK hook forwarder (RULES.md PH-04): hook events as callback requests shaped after the Claude Agent
SDK's control protocol (``control_request{request_id, request:{subtype: "hook_callback", callback_id, input,
tool_use_id}}``, answered with the hook's output; ``control_cancel_request`` cancels one in flight).

``set_sdk_hook_forwarder(forwarder)`` installs an object with ``forward(hook_event, payload)`` (served by a
``HookForwarderActor``, so it may live in another process); ``None`` removes it. The conversation sends it:

- ``PreToolUse`` {hook_event_name, tool_name, tool_input, tool_use_id, session_id} before the permission
  hook; the answer may block (``{"decision": "block", "reason"}`` or ``{"continue": false, "stopReason"}``),
  decide (``hookSpecificOutput.permissionDecision`` allow | deny | ask, with ``permissionDecisionReason``),
  change the input (``hookSpecificOutput.updatedInput``: merged, the keys given replace those keys; the
  permission hook then sees the merged input) or say nothing (``{}``: go on). A forwarder that fails, times
  out or cannot be reached **denies** the call (fail closed).
- ``PostToolUse`` {tool_name, tool_input, tool_response}: ``hookSpecificOutput.additionalContext`` is added
  to the result the model sees.
- ``UserPromptSubmit`` {prompt}, ``Stop`` {turn_index, finish_reason} and ``SessionEnd`` {session_id}:
  notifications; their answers are logged, not applied.

Every callback has a timeout (``timeout``, seconds); a callback that times out is cancelled at the forwarder
(``CancelHookCallback``: a future it returned is cancelled). Failures other than ``PreToolUse`` are logged
and counted (``hook_stats()``) and never end the turn.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

from actors.base import BusActor, Context
from actors.conversation.permissions import PermissionDecision
from transport.codec import JsonValue
from transport.errors import ProtocolError
from transport.node import Node
from transport.records import frozen

log = logging.getLogger(__name__)

__all__ = [
    "CancelHookCallback",
    "GetHookStats",
    "HookCallback",
    "HookForwarderActor",
    "HookOutput",
    "HookStats",
    "SdkHookForwarder",
    "SetSdkHookForwarder",
    "pre_tool_decision",
]

HOOK_EVENTS = ("PreToolUse", "PostToolUse", "UserPromptSubmit", "Stop", "SessionEnd")


class SdkHookForwarder(Protocol):
    def forward(
        self, hook_event: str, payload: dict[str, Any]
    ) -> Mapping[str, Any] | concurrent.futures.Future[Mapping[str, Any]]: ...


@frozen(kw_only=True)
class HookCallback:
    """One ``hook_callback`` request: ``payload`` given to ``forward`` is ``{request_id, callback_id, input,
    tool_use_id}``."""

    TAG: ClassVar[str] = "conv.hook.callback"
    request_id: str
    callback_id: str
    hook_event: str
    input: dict[str, JsonValue]
    tool_use_id: str | None = None


@frozen(kw_only=True)
class HookOutput:
    TAG: ClassVar[str] = "conv.hook.output"
    response: dict[str, JsonValue]


@frozen(kw_only=True)
class CancelHookCallback:
    """``control_cancel_request``: the callback ``request_id`` is no longer awaited."""

    TAG: ClassVar[str] = "conv.hook.cancel"
    request_id: str


@frozen(kw_only=True)
class SetSdkHookForwarder:
    """A command: later hook events go to the forwarder actor at ``address`` (None: nowhere)."""

    TAG: ClassVar[str] = "conv.hook.set_forwarder"
    address: str | None
    timeout: float = 30.0


@frozen(kw_only=True)
class GetHookStats:
    TAG: ClassVar[str] = "conv.hook.get_stats"


@frozen(kw_only=True)
class HookStats:
    TAG: ClassVar[str] = "conv.hook.stats"
    forwarded: int
    failures: int


def pre_tool_decision(response: Mapping[str, Any]) -> PermissionDecision | None:
    """What a ``PreToolUse`` answer decides: a decision, or None (no opinion: go on)."""
    specific = response.get("hookSpecificOutput")
    specific = specific if isinstance(specific, Mapping) else {}
    if response.get("continue") is False:
        return PermissionDecision.deny(str(response.get("stopReason") or "a PreToolUse hook stopped it"))
    if response.get("decision") == "block":
        return PermissionDecision.deny(str(response.get("reason") or "a PreToolUse hook blocked it"))
    behavior = specific.get("permissionDecision")
    reason = specific.get("permissionDecisionReason")
    updated = specific.get("updatedInput")
    updated = dict(updated) if isinstance(updated, Mapping) else None
    if behavior == "deny":
        return PermissionDecision.deny(str(reason or "a PreToolUse hook denied it"))
    if behavior == "ask":
        return PermissionDecision.ask(str(reason) if reason else None)
    if behavior == "allow" or updated is not None:
        return PermissionDecision.allow(updated)
    return None


def additional_context(response: Mapping[str, Any]) -> str | None:
    specific = response.get("hookSpecificOutput")
    if isinstance(specific, Mapping) and isinstance(specific.get("additionalContext"), str):
        return str(specific["additionalContext"])
    return None


class HookForwarderActor(BusActor):
    """Serves one local ``SdkHookForwarder`` on the bus. A forwarder that raises answers an error; one that
    returns a future answers when it resolves (and ``CancelHookCallback`` cancels that future)."""

    def __init__(self, node: Node, address: str, *, forwarder: SdkHookForwarder) -> None:
        super().__init__(node, address)
        self.forwarder = forwarder
        self._running: dict[str, concurrent.futures.Future[Any]] = {}

    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case HookCallback():
                payload = {
                    "request_id": message.request_id,
                    "callback_id": message.callback_id,
                    "input": dict(message.input),
                    "tool_use_id": message.tool_use_id,
                }
                result = self.forwarder.forward(message.hook_event, payload)
                if isinstance(result, concurrent.futures.Future):
                    self._running[message.request_id] = result
                    return self.answer_when_done(_as_output(result), ctx, lambda v, e: self._done(message))
                return HookOutput(response=dict(result or {}))
            case CancelHookCallback(request_id=request_id):
                future = self._running.pop(request_id, None)
                if future is not None:
                    future.cancel()
                return None
        raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")

    def _done(self, message: HookCallback) -> None:
        self._running.pop(message.request_id, None)


def _as_output(result: concurrent.futures.Future[Any]) -> concurrent.futures.Future[HookOutput]:
    """The forwarder's future of a hook output, as a future of ``HookOutput`` (cancelled with it)."""
    out: concurrent.futures.Future[HookOutput] = concurrent.futures.Future()

    def done(f: concurrent.futures.Future[Any]) -> None:
        if f.cancelled():
            out.set_exception(concurrent.futures.CancelledError("the hook callback was cancelled"))
        elif f.exception() is not None:
            out.set_exception(f.exception())
        else:
            out.set_result(HookOutput(response=dict(f.result() or {})))

    result.add_done_callback(done)
    return out


HOOK_MESSAGES = (HookCallback, HookOutput, CancelHookCallback, SetSdkHookForwarder, GetHookStats, HookStats)
