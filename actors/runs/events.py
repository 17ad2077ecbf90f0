"""The events a run records through its host (RULES.md EV-*): ``SessionEvent`` for ``run_session``,
``AuditEvent`` for the subagent ``run``; defined here, below both loops and the one ``HostRecord`` that
carries them."""

from __future__ import annotations

import uuid
from typing import ClassVar

from actors.types import AgentContinuation, AgentProvider, ModelContext, TokenUsage, UsageReceipt
from transport.codec import JsonValue
from transport.records import frozen

__all__ = ["AnyAuditEvent", "AnyRunEvent", "AnySessionEvent", "AuditEvent", "SessionEvent"]


class SessionEvent:
    @frozen(kw_only=True)
    class InferenceSubmitted:
        TAG: ClassVar[str] = "rs.ev.submitted"
        round: int
        manifest_hash: str
        model: str

    @frozen(kw_only=True)
    class ProviderInput:
        TAG: ClassVar[str] = "rs.ev.provider_input"
        round: int
        context: ModelContext

    @frozen(kw_only=True)
    class UsageUpdated:
        TAG: ClassVar[str] = "rs.ev.usage"
        round: int
        usage: TokenUsage

    @frozen(kw_only=True)
    class ProviderReceipt:
        TAG: ClassVar[str] = "rs.ev.receipt"
        round: int
        usage: TokenUsage | None
        receipt: UsageReceipt
        continuation: AgentContinuation | None


AnySessionEvent = (
    SessionEvent.InferenceSubmitted
    | SessionEvent.ProviderInput
    | SessionEvent.UsageUpdated
    | SessionEvent.ProviderReceipt
)


class AuditEvent:
    """What a run records through ``Host.record``, in order (EV-01..EV-06); callers ``match`` on these."""

    @frozen(kw_only=True)
    class Started:
        TAG: ClassVar[str] = "sa.ev.started"
        parent_operation_id: uuid.UUID
        model: str
        provider_model: str
        provider: AgentProvider
        context_window_tokens: int
        max_input_tokens: int
        context: tuple[str, ...]
        task: str
        host: JsonValue

    @frozen(kw_only=True)
    class InferenceSubmitted:
        TAG: ClassVar[str] = "sa.ev.submitted"
        parent_operation_id: uuid.UUID
        round: int
        manifest_hash: str
        estimated_input_tokens: int

    @frozen(kw_only=True)
    class ToolCall:
        TAG: ClassVar[str] = "sa.ev.tool_call"
        parent_operation_id: uuid.UUID
        name: str
        arguments: JsonValue

    @frozen(kw_only=True)
    class ToolResult:
        TAG: ClassVar[str] = "sa.ev.tool_result"
        parent_operation_id: uuid.UUID
        name: str
        ok: bool
        projection_accepted: bool
        result: str

    @frozen(kw_only=True)
    class ProviderReceipt:
        TAG: ClassVar[str] = "sa.ev.receipt"
        parent_operation_id: uuid.UUID
        round: int
        manifest_hash: str
        usage: TokenUsage | None
        receipt: UsageReceipt

    @frozen(kw_only=True)
    class Completed:
        TAG: ClassVar[str] = "sa.ev.completed"
        parent_operation_id: uuid.UUID
        model: str
        response: str


AnyAuditEvent = (
    AuditEvent.Started
    | AuditEvent.InferenceSubmitted
    | AuditEvent.ToolCall
    | AuditEvent.ToolResult
    | AuditEvent.ProviderReceipt
    | AuditEvent.Completed
)

AnyRunEvent = AnySessionEvent | AnyAuditEvent
