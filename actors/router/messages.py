"""The Router's wire protocol: requests, turn events and typed errors (RULES.md A.2, C.3)."""

from __future__ import annotations

import uuid
from typing import ClassVar

from actors.errors import Broken, Busy, Cancelled, Closed, Invalid, TimedOut
from actors.types import (
    AgentContinuation,
    ModelContext,
    OfferedTool,
    ReceiptError,
    ResolvedAgentModel,
    TokenUsage,
    ToolCallError,
    ToolResult,
    UsageReceipt,
)
from transport.codec import JsonValue
from transport.errors import BusError, NotDelivered
from transport.records import frozen

# ----------------------------------------------------------------------------------------------- requests


@frozen(kw_only=True)
class ResolveModel:
    TAG: ClassVar[str] = "router.resolve_model"
    requested: str


@frozen(kw_only=True)
class StartTurn:
    """Start one provider turn under a new child operation of ``parent_operation_id`` (RT-12)."""

    TAG: ClassVar[str] = "router.start_turn"
    user_id: str
    parent_operation_id: uuid.UUID
    model: str
    input: str
    tool_description: str
    round: int | None = None
    reasoning_effort: str | None = None
    instructions: str | None = None
    continuation: AgentContinuation | None = None
    timeout_s: float | None = None
    ephemeral: bool = False
    max_output_tokens: int | None = None
    # a JSON schema the final answer must follow; a provider that cannot constrain output ignores it
    response_schema: dict[str, JsonValue] | None = None
    # the application tools ``tool_description`` offers, as data (the embedded model's grammar uses them)
    tools: tuple[OfferedTool, ...] = ()


@frozen(kw_only=True)
class TurnStarted:
    TAG: ClassVar[str] = "router.turn_started"
    operation_id: uuid.UUID
    model: ResolvedAgentModel


@frozen(kw_only=True)
class NextTurnEvent:
    """The next event of a turn; answered when one is there (the Router never blocks on it)."""

    TAG: ClassVar[str] = "router.next_event"
    operation_id: uuid.UUID


@frozen(kw_only=True)
class StreamTurnEvents:
    """Every remaining event of a turn as partial replies, the terminal one as the final reply."""

    TAG: ClassVar[str] = "router.stream_events"
    operation_id: uuid.UUID


@frozen(kw_only=True)
class RespondCall:
    """Answer a surfaced tool call. With ``read_on``, sent as a stream request by a reader that reads the
    turn's events right after: a partial ``Ok`` says the result was taken; then each event up to the
    turn's next decision (``DECISION_EVENTS``: a tool call, the completion, the close) comes as a partial
    (several queued at once as one ``TurnEventBatch``), and the final reply is that decision (or the read's
    error), as ``NextTurnEvent`` would answer it; one exchange instead of one per event. Events queued
    together with the decision come with it in the final reply, a ``TurnEventBatch`` ending with the
    decision, rather than as a partial before it. When the turn's next step is already due on the Router's
    own thread, the ``Ok`` is left out if that step hands the reader an event: the first event (partial or
    final) then says the result was taken; a step that hands none, and any error, is preceded by the
    ``Ok``. Beside another reader of the turn the read is of one event only. An error before any ``Ok`` or
    event is the respond's own. Otherwise the reply is ``Ok``."""

    TAG: ClassVar[str] = "router.respond"
    operation_id: uuid.UUID
    call_id: str
    result: ToolResult
    read_on: bool = False


@frozen(kw_only=True)
class FinishUnavailable:
    """Account for an interrupted turn: its one receipt (the stored one if it has one already)."""

    TAG: ClassVar[str] = "router.finish_unavailable"
    operation_id: uuid.UUID


@frozen(kw_only=True)
class CancelOperation:
    """Cancel an operation and, transitively, every child operation under it."""

    TAG: ClassVar[str] = "router.cancel"
    operation_id: uuid.UUID


@frozen(kw_only=True)
class OperationsCancelled:
    TAG: ClassVar[str] = "router.cancelled"
    operation_ids: tuple[uuid.UUID, ...]


@frozen(kw_only=True)
class SubmitInput:
    """The complete input of a turn's next provider request, replacing the conversation so far (a fresh-
    context subagent re-renders its whole projection before each request: RULES.md SA model, D-11).
    Send it before the ``RespondCall`` that resumes the provider; it applies to that resumption."""

    TAG: ClassVar[str] = "router.submit_input"
    operation_id: uuid.UUID
    input: str


@frozen(kw_only=True)
class CountTokens:
    """How many tokens each text is for ``model``: the provider's own tokenizer where it has one, else a
    conservative estimate (``exact=False``; see ``providers.base.estimate_tokens``)."""

    TAG: ClassVar[str] = "router.count_tokens"
    model: str
    texts: tuple[str, ...]


@frozen(kw_only=True)
class TokenCount:
    TAG: ClassVar[str] = "router.token_count"
    counts: tuple[int, ...]
    exact: bool


@frozen(kw_only=True)
class GetReceipt:
    TAG: ClassVar[str] = "router.get_receipt"
    operation_id: uuid.UUID


@frozen(kw_only=True)
class GetReceiptsFor:
    """The receipts of every provider turn started under ``parent_operation_id`` so far, oldest first."""

    TAG: ClassVar[str] = "router.get_receipts_for"
    parent_operation_id: uuid.UUID


@frozen(kw_only=True)
class ReceiptList:
    TAG: ClassVar[str] = "router.receipts"
    receipts: tuple[UsageReceipt, ...]


@frozen(kw_only=True)
class GetRouterStats:
    """How much per-turn state the Router holds right now (for operators, benchmarks and tests)."""

    TAG: ClassVar[str] = "router.get_stats"


@frozen(kw_only=True)
class RouterStats:
    """``turns``: turns in memory (running, or ended and not yet delivered); ``links``: parent operations
    with children in memory; ``recent``: receipts kept in memory (only without a data dir); ``incarnation``:
    this Router's incarnation in its ledger (None without a data dir); ``recovered``: receipts it wrote at
    start for turns an earlier, dead incarnation left open; ``commits``: write transactions its ledger has
    committed, each one fsync (a group commit counts once; None without a data dir)."""

    TAG: ClassVar[str] = "router.stats"
    turns: int
    links: int
    recent: int
    incarnation: str | None
    recovered: int
    commits: int | None = None


# ------------------------------------------------------------------------------------------------- events


@frozen(kw_only=True)
class TurnInput:
    """The normalized context the provider was actually sent (one per provider request)."""

    TAG: ClassVar[str] = "router.ev.input"
    context: ModelContext


@frozen(kw_only=True)
class TurnTextDelta:
    TAG: ClassVar[str] = "router.ev.text"
    text: str


@frozen(kw_only=True)
class TurnUsage:
    TAG: ClassVar[str] = "router.ev.usage"
    usage: TokenUsage


@frozen(kw_only=True)
class TurnToolCall:
    """A native tool call with its exact provider call id; ``error`` set when it was invalid."""

    TAG: ClassVar[str] = "router.ev.tool_call"
    call_id: str
    name: str
    arguments: dict[str, JsonValue] | None = None
    error: ToolCallError | None = None


@frozen(kw_only=True)
class TurnCompleted:
    TAG: ClassVar[str] = "router.ev.completed"
    answer: str
    usage: TokenUsage | None
    receipt: UsageReceipt
    continuation: AgentContinuation | None = None
    # "stop", or "length" when the provider cut the answer at its output-token limit. A default, so an
    # older capture without the field still decodes.
    finish_reason: str = "stop"


@frozen(kw_only=True)
class TurnClosed:
    """The provider stream ended without a terminal completion (the turn still needs accounting)."""

    TAG: ClassVar[str] = "router.ev.closed"


TurnEvent = TurnInput | TurnTextDelta | TurnUsage | TurnToolCall | TurnCompleted | TurnClosed
TERMINAL_EVENTS = (TurnCompleted, TurnClosed)
DECISION_EVENTS = (TurnToolCall, *TERMINAL_EVENTS)  # what ends a reading-on RespondCall (its final reply)


@frozen(kw_only=True)
class TurnEventBatch:
    """Several events of a turn, in order, in one reply.

    A provider can produce events far faster than one message each can travel (a burst of a thousand
    tokens queued while the reader was away); sending what is queued as one part keeps the stream within
    the socket's high-water mark, where a part that does not fit would be lost (delivery is at-most-once).
    As a partial reply it holds events before the read's last; as the final reply of a reading-on
    ``RespondCall`` it ends with the decision that ends the read, and holds what one provider step produced
    with it (the Router hands on a step's events when the step ends).
    """

    TAG: ClassVar[str] = "router.ev.batch"
    events: tuple[TurnInput | TurnTextDelta | TurnUsage | TurnToolCall | TurnCompleted | TurnClosed, ...]


# ------------------------------------------------------------------------------------------------- errors


class RouterError(ReceiptError):
    """A Router failure. ``receipt`` is the canonical receipt the Router attached, if it issued one."""

    WIRE = "router"


class TurnNotFound(RouterError, Invalid):
    WIRE = "router.turn_not_found"


class TurnTerminated(RouterError, Closed):
    """The turn already ended (its receipt is attached): nothing more can happen on it."""

    WIRE = "router.turn_terminated"


class TurnInterrupted(TurnTerminated):
    """The turn ended without completing and its receipt (status ``interrupted``) is attached: the Router
    ended it on its own (its owner stopped answering, it waited on its owner past the bound, or the Router
    that ran it died and a later one accounted it), or it was cut short some other way. Nothing more
    happens on it; what the provider would have produced after the last delivered event is lost."""

    WIRE = "router.turn_interrupted"


class TurnBusy(RouterError, Busy):
    """A read the turn cannot serve beside its current reader: a stream while another read waits, or any
    read while a stream holds the turn (the stream takes every event)."""

    WIRE = "router.turn_busy"


class TurnNotStarted(RouterError, NotDelivered):
    """``StartTurn`` was refused before any provider was called: no operation, no receipt, nothing ran.

    A ``NotDelivered`` (known: nothing ran), so it is safe to retry as it is; the cause says why (the
    intent could not be written to the ledger, the provider could not be built)."""

    WIRE = "router.turn_not_started"


class InvalidCallId(RouterError, Invalid):
    """``respond`` for a call id that was not surfaced, or was answered already: nothing was sent."""

    WIRE = "router.invalid_call_id"


class ProviderFailed(RouterError, Broken):
    WIRE = "router.provider_failed"


class ProviderUnavailable(RouterError, Broken):
    WIRE = "router.provider_unavailable"


class LedgerUnavailable(RouterError, Broken):
    """The receipt ledger could not commit what this answer would have reported (a disk's error, and
    again when the receipt was written once more): it is not known to be on disk. The receipt, when one is
    attached, is the Router's in memory; a later Router accounts the turn from its open row."""

    WIRE = "router.ledger_unavailable"


class TurnCancelled(RouterError, Cancelled):
    WIRE = "router.cancelled"


class TurnTimedOut(RouterError, TimedOut):
    WIRE = "router.timed_out"


ROUTER_MESSAGES = (
    ResolveModel,
    StartTurn,
    TurnStarted,
    NextTurnEvent,
    StreamTurnEvents,
    RespondCall,
    FinishUnavailable,
    CancelOperation,
    OperationsCancelled,
    GetReceipt,
    SubmitInput,
    CountTokens,
    TokenCount,
    TurnInput,
    TurnTextDelta,
    TurnUsage,
    TurnToolCall,
    TurnCompleted,
    TurnClosed,
    TurnEventBatch,
    GetReceiptsFor,
    ReceiptList,
    GetRouterStats,
    RouterStats,
)
ROUTER_ERRORS: tuple[type[BusError], ...] = (
    RouterError,
    TurnNotFound,
    TurnBusy,
    TurnTerminated,
    TurnInterrupted,
    TurnNotStarted,
    InvalidCallId,
    ProviderFailed,
    ProviderUnavailable,
    LedgerUnavailable,
    TurnCancelled,
    TurnTimedOut,
)
