"""Agent-level value types every layer shares (RULES.md Appendix A.2/A.3): models, usage, receipts, calls.

All are frozen, keyword-only dataclasses with written-out tags, so they travel on the bus inside messages
and errors. Only the Router constructs a ``UsageReceipt`` (RT-09).
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable, Mapping
from dataclasses import field
from typing import Any, ClassVar, Literal, TypeVar

from actors.errors import KbusError
from transport.codec import JsonValue
from transport.errors import BusError, NotDelivered, Unavailable
from transport.records import direct_setters, frozen

CALL_KTOOL = "call_ktool"  # the one native tool every provider path declares (RT-04)

_T = TypeVar("_T")
_UNCHANGED: Any = object()
_EVOLVERS: dict[type[Any], Callable[..., Any]] = {}


def evolve(obj: _T, /, **changes: Any) -> _T:
    """``dataclasses.replace(obj, **changes)`` for the frozen states an actor replaces on every message:
    the same new object, made by a function written once per class. Where building the class is only
    setting each field (``transport.records.direct_setters``) it calls each slot's own setter, without the
    keyword call; for any other class it calls the class. About half of replace's cost."""
    cls = type(obj)
    make = _EVOLVERS.get(cls)
    if make is None:
        make = _EVOLVERS[cls] = _evolver(cls)
    return make(obj, **changes)  # type: ignore[no-any-return]


def _evolver(cls: type[Any]) -> Callable[..., Any]:
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    params = "".join(f", {name}=_unchanged_" for name in names)
    values = [f"_obj_.{name} if {name} is _unchanged_ else {name}" for name in names]
    scope: dict[str, Any] = {"_cls_": cls, "_unchanged_": _UNCHANGED, "_make_": object.__new__}
    slot_setters = direct_setters(cls)
    if slot_setters is None:
        body = ["    return _cls_(" + ", ".join(f"{n}={v}" for n, v in zip(names, values, strict=True)) + ")"]
    else:
        scope.update((f"_set{i}_", setter) for i, setter in enumerate(slot_setters))
        body = ["    _new_ = _make_(_cls_)", *(f"    _set{i}_(_new_, {v})" for i, v in enumerate(values))]
        body.append("    return _new_")
    exec("\n".join([f"def evolve(_obj_, /, *{params}):", *body]), scope)  # the class's field names only
    return scope["evolve"]  # type: ignore[no-any-return]


class AgentProvider(enum.StrEnum):
    OPENAI = "openai"
    ANTHROPIC = "anthropic"
    CODEX = "codex"
    LOCAL = "local"
    SCRIPTED = "scripted"
    OTHER = "other"


@frozen(kw_only=True)
class TokenUsage:
    """Cumulative usage of one provider turn (non-decreasing across updates)."""

    TAG: ClassVar[str] = "agent.usage"
    input_tokens: int = 0
    cached_input_tokens: int = 0
    output_tokens: int = 0
    reasoning_output_tokens: int = 0
    total_tokens: int = 0


@frozen(kw_only=True)
class ResolvedAgentModel:
    """The exact model a name resolved to, as the Router's catalog says (RT-03)."""

    TAG: ClassVar[str] = "agent.model"
    requested: str
    model: str
    provider: AgentProvider
    provider_model: str
    context_window_tokens: int
    max_input_tokens: int
    reasoning_efforts: tuple[str, ...] = ()


@frozen(kw_only=True)
class AgentContinuation:
    """Opaque native continuation: only the Router interprets ``token``."""

    TAG: ClassVar[str] = "agent.continuation"
    provider: AgentProvider
    model: str
    token: bytes


ReceiptStatus = Literal["completed", "interrupted", "failed", "cancelled", "timed_out", "unavailable"]


@frozen(kw_only=True)
class UsageReceipt:
    """The canonical accounting record of one provider turn; exactly one per turn, on every path."""

    TAG: ClassVar[str] = "agent.receipt"
    receipt_id: str
    operation_id: uuid.UUID
    parent_operation_id: uuid.UUID
    user_id: str
    provider: AgentProvider
    provider_model: str
    model: str
    round: int | None
    status: ReceiptStatus
    usage: TokenUsage | None
    issued_at_ms: int
    started_at_ms: int = 0
    duration_ms: int = 0
    cost_usd: float | None = None
    error: str | None = None


@frozen(kw_only=True)
class ContextItem:
    TAG: ClassVar[str] = "agent.context_item"
    role: Literal["system", "developer", "user", "assistant", "tool"]
    text: str
    call_id: str | None = None


@frozen(kw_only=True)
class ModelContext:
    """What was actually submitted to the provider for one request (normalized)."""

    TAG: ClassVar[str] = "agent.model_context"
    model: str
    reasoning_effort: str | None
    instructions: str | None
    items: tuple[ContextItem, ...]
    tools: tuple[str, ...] = (CALL_KTOOL,)
    continued: bool = False


@frozen(kw_only=True)
class ToolResult:
    TAG: ClassVar[str] = "agent.tool_result"
    success: bool
    output: str


class ToolCallErrorKind(enum.StrEnum):
    INVALID_JSON = "invalid_json"
    NOT_OBJECT = "not_object"
    MISSING_NAME = "missing_name"
    INVALID_NAME = "invalid_name"
    INVALID_ARGUMENTS = "invalid_arguments"
    UNEXPECTED_FIELD = "unexpected_field"
    UNKNOWN_FUNCTION = "unknown_function"


TOOL_CALL_ERROR_MAX = 256


@frozen(kw_only=True)
class ToolCallError:
    """A bounded classification of an invalid native tool call (RT-06): a value, not an exception."""

    TAG: ClassVar[str] = "agent.tool_call_error"
    kind: ToolCallErrorKind
    detail: str = ""

    def __post_init__(self) -> None:
        if len(self.detail) > 160:
            object.__setattr__(self, "detail", self.detail[:157] + "...")

    def __str__(self) -> str:
        return f"invalid tool call ({self.kind}): {self.detail}"[:TOOL_CALL_ERROR_MAX]


@frozen(kw_only=True)
class OfferedTool:
    """One application tool a turn offers the model through ``call_ktool``: its name, description and
    JSON-schema parameters, as structured data (``PreparedRound.tools``, ``StartTurn.tools``). A provider
    that can constrain output (the embedded model's grammar) limits a call to these tools and schemas."""

    TAG: ClassVar[str] = "agent.offered_tool"
    name: str
    description: str = ""
    parameters: dict[str, JsonValue] = field(default_factory=dict)


@frozen(kw_only=True)
class ToolCall:
    """A strictly parsed ``call_ktool`` call: the application tool's name and its JSON-object arguments."""

    TAG: ClassVar[str] = "agent.tool_call"
    name: str
    arguments: dict[str, JsonValue] = field(default_factory=dict)


class ReceiptError(KbusError):
    """A failure that may carry the canonical receipt of the turn it ended (a Router or handle error).

    Not on the wire itself: subclasses with their own ``WIRE`` names are. The receipt travels in the
    error's fields and comes back as the same ``UsageReceipt``.
    """

    def __init__(self, message: str = "", *, receipt: UsageReceipt | None = None, **details: Any) -> None:
        super().__init__(message, **details)
        self.receipt = receipt

    def wire_fields(self) -> dict[str, Any]:
        return {**self.details, "receipt": self.receipt}

    @classmethod
    def from_wire(cls, message: str, fields: Mapping[str, Any]) -> BusError:
        fields = dict(fields)
        receipt = fields.pop("receipt", None)
        if receipt is not None and not isinstance(receipt, UsageReceipt):
            raise ValueError("receipt is not a UsageReceipt")
        return cls(message, receipt=receipt, **fields)


AGENT_TYPES = (
    TokenUsage,
    ResolvedAgentModel,
    AgentContinuation,
    UsageReceipt,
    ContextItem,
    ModelContext,
    ToolResult,
    ToolCallError,
    ToolCall,
    OfferedTool,
)


def note_accounting_failure(error: BaseException, accounting: BaseException) -> BaseException:
    """RS-34 / SA-28: the original failure stays the outcome; the interrupted-call accounting that failed as
    well is attached to it, as a note and (notes do not cross the bus) as the wire field
    ``accounting_error`` that ``restore_accounting_note`` turns back into a note on the caller's side."""
    note = f"interrupted-call accounting failed as well: {accounting!r}"[:1000]
    error.add_note(note)
    if isinstance(error, BusError):
        error.details["accounting_error"] = note
    if error.__context__ is None:
        error.__context__ = accounting
    return error


def restore_accounting_note(error: BaseException) -> BaseException:
    if isinstance(error, BusError) and "accounting_error" in error.details:
        error.add_note(str(error.details["accounting_error"]))
    return error


def retry_class(error: BaseException, *, progressed: bool) -> BaseException:
    """The error a multi-step operation (a session run, a subagent run, a turn) ends with, so its caller can
    choose by class whether a retry is safe: ``NotDelivered`` from a later hop of an operation that had
    already done something (a provider turn started, a tool ran) means the operation's outcome is unknown,
    so it becomes ``Unavailable`` (the hop's error kept as its cause); ``NotDelivered`` before anything ran,
    ``Unavailable``, ``Expired`` and every other error stay as they are."""
    if progressed and isinstance(error, NotDelivered):
        unknown = Unavailable(
            f"the operation had started when a later step was not delivered: {error.message}"
        )
        unknown.__cause__ = error
        return unknown
    return error
