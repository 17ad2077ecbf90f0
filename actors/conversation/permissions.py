"""The permission layer every tool call of a turn passes (RULES.md 9.11 PH-01..PH-03, 9.10 plan mode).

Between journaling a call (``tool_call``, with its idempotency key) and sending it to the tool host, the
conversation actor decides whether it may run, in this order:

1. a decision already journaled for the call's key (a continued turn after a crash): used as it is;
2. **plan mode**: while it is on, a tool registered ``mutating`` is denied, whatever the model asks;
3. the **permission hook** (``set_permission_hook``), served by a ``PermissionHookActor`` (any process):
   ``allow``, ``deny`` (its reason is shown to the model as ``Permission denied: <reason>``), ``ask`` (a
   person decides: ``answer_permission``) or ``allow`` with ``updated_input``, which is merged into the
   arguments (``merge_input``: the keys given replace those keys, nothing else changes).

Fail closed: a hook that raises, does not answer within its timeout, or cannot be reached denies the call,
with a reason that says which; ``fail_open=True`` is the explicit opposite. Every final decision is journaled
(``permission``) before the call is sent or its denial shown; an ``ask`` is journaled (``permission_asked``)
before anyone is asked, so it is still pending after a crash and a resume, and is decided exactly once:
the first ``answer_permission`` for its key is journaled and applied, any later one changes nothing.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, Protocol

from actors.base import BusActor, Context
from transport.codec import JsonValue
from transport.errors import ProtocolError
from transport.node import Node
from transport.records import frozen

log = logging.getLogger(__name__)

__all__ = [
    "AnswerPermission",
    "CheckPermission",
    "GetPendingPermissions",
    "PendingPermissions",
    "PermissionAnswered",
    "PermissionAsked",
    "PermissionDecision",
    "PermissionHook",
    "PermissionHookActor",
    "PermissionRequest",
    "SetPermissionHook",
    "denial_text",
    "merge_input",
]

Behavior = Literal["allow", "deny", "ask"]


@frozen(kw_only=True)
class PermissionRequest:
    """One tool call waiting for a decision. ``key`` is the call's idempotency key (stable across a
    crash): an ``ask`` is answered by it."""

    TAG: ClassVar[str] = "conv.perm.request"
    key: str
    call_id: str
    tool_name: str
    arguments: dict[str, JsonValue]
    session_id: str | None = None
    mutating: bool = False


@frozen(kw_only=True)
class PermissionDecision:
    """``allow`` (with ``updated_input`` merged into the arguments when given), ``deny`` (``reason`` is
    shown to the model) or ``ask`` (a person decides; ``reason`` is shown to them)."""

    TAG: ClassVar[str] = "conv.perm.decision"
    behavior: Behavior
    reason: str | None = None
    updated_input: dict[str, JsonValue] | None = None

    @staticmethod
    def allow(updated_input: Mapping[str, JsonValue] | None = None) -> PermissionDecision:
        return PermissionDecision(
            behavior="allow", updated_input=dict(updated_input) if updated_input is not None else None
        )

    @staticmethod
    def deny(reason: str) -> PermissionDecision:
        return PermissionDecision(behavior="deny", reason=reason)

    @staticmethod
    def ask(reason: str | None = None) -> PermissionDecision:
        return PermissionDecision(behavior="ask", reason=reason)

    def to_json(self) -> dict[str, Any]:
        return {"behavior": self.behavior, "reason": self.reason, "updated_input": self.updated_input}

    @staticmethod
    def from_json(row: Mapping[str, Any]) -> PermissionDecision:
        behavior = row["behavior"]
        if behavior not in ("allow", "deny", "ask"):
            raise ValueError(f"unknown permission behavior {behavior!r}")
        updated = row.get("updated_input")
        return PermissionDecision(
            behavior=behavior,
            reason=row.get("reason"),
            updated_input=dict(updated) if isinstance(updated, dict) else None,
        )


class PermissionHook(Protocol):
    def check(
        self, request: PermissionRequest
    ) -> PermissionDecision | concurrent.futures.Future[PermissionDecision]: ...


def merge_input(arguments: Mapping[str, Any], updated: Mapping[str, Any] | None) -> dict[str, Any]:
    """The arguments a call runs with after an ``allow`` with ``updated_input``: each key given replaces that
    key; every other key stays as the model gave it."""
    merged = dict(arguments)
    if updated:
        merged.update(updated)
    return merged


def denial_text(reason: str | None) -> str:
    """The tool result the model sees for a denied call (PH-02)."""
    return f"Permission denied: {reason or 'no reason given'}"


# ------------------------------------------------------------------------------------------ wire


@frozen(kw_only=True)
class CheckPermission:
    """To a ``PermissionHookActor``: answer with a ``PermissionDecision``."""

    TAG: ClassVar[str] = "conv.perm.check"
    request: PermissionRequest


@frozen(kw_only=True)
class SetPermissionHook:
    """A command (applied between commands, PH-03): later calls ask the hook actor at ``address`` (None:
    no hook), waiting ``timeout`` seconds for it; ``fail_open`` lets a failed hook allow the call."""

    TAG: ClassVar[str] = "conv.perm.set_hook"
    address: str | None
    timeout: float = 30.0
    fail_open: bool = False


@frozen(kw_only=True)
class AnswerPermission:
    """A control: a person's decision on the ``ask`` with this key. Answered ``PermissionAnswered``."""

    TAG: ClassVar[str] = "conv.perm.answer"
    key: str
    allow: bool
    reason: str | None = None
    updated_input: dict[str, JsonValue] | None = None


@frozen(kw_only=True)
class PermissionAnswered:
    """``decided`` False: nothing was waiting under that key (or it was decided already): nothing changed."""

    TAG: ClassVar[str] = "conv.perm.answered"
    decided: bool


@frozen(kw_only=True)
class GetPendingPermissions:
    TAG: ClassVar[str] = "conv.perm.get_pending"


@frozen(kw_only=True)
class PendingPermissions:
    TAG: ClassVar[str] = "conv.perm.pending"
    requests: tuple[PermissionRequest, ...]


@frozen(kw_only=True)
class PermissionAsked:
    """Event: a call waits for a person (``answer_permission(request.key, ...)``)."""

    TAG: ClassVar[str] = "conv.ev.permission_asked"
    request: PermissionRequest
    reason: str | None = None


class PermissionHookActor(BusActor):
    """Serves one local ``PermissionHook`` on the bus (the facade starts one for a local hook object). A
    hook that raises answers an error; a hook that returns a future answers when it resolves, and this
    actor serves other checks meanwhile."""

    def __init__(self, node: Node, address: str, *, hook: PermissionHook) -> None:
        super().__init__(node, address)
        self.hook = hook

    def handle(self, message: Any, ctx: Context) -> Any:
        if not isinstance(message, CheckPermission):
            raise ProtocolError(f"{self.address} does not handle {type(message).__name__}")
        result = self.hook.check(message.request)
        if isinstance(result, concurrent.futures.Future):
            return self.answer_when_done(result, ctx)
        if not isinstance(result, PermissionDecision):
            raise TypeError(f"the permission hook returned {type(result).__name__}, not a PermissionDecision")
        return result


PERMISSION_MESSAGES = (
    PermissionRequest,
    PermissionDecision,
    CheckPermission,
    SetPermissionHook,
    AnswerPermission,
    PermissionAnswered,
    GetPendingPermissions,
    PendingPermissions,
    PermissionAsked,
)
