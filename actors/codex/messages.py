"""The Codex-adapter actor's wire messages (RULES.md C.3: Retain, Release, StartTurn, NextEvent, Respond,
Abandon, Diagnostics) and the child's output as the actor receives it.

The child's stdout lines and stderr chunks reach the actor as ``ChildOutput`` tells from its reader
threads (senders ``<node>/<actor>.stdout`` and ``.stderr``), so a capture records them as deliveries and a
replay feeds them back without a child. What the actor writes to the child is recorded as ``effect``
records keyed by the written bytes, so a replay compares those too.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from actors.codex.types import CODEX_TYPE_ERRORS, CODEX_TYPES
from actors.types import AGENT_TYPES, TokenUsage, ToolResult
from transport.codec import Registry
from transport.errors import ErrorRegistry
from transport.messages import SYSTEM_MESSAGES
from transport.records import frozen


@frozen(kw_only=True)
class AwaitOpen:
    """Answered with ``Ok`` once the child finished the handshake, or with the ``AdapterError``."""

    TAG: ClassVar[str] = "codex.await_open"


@frozen(kw_only=True)
class Retain:
    TAG: ClassVar[str] = "codex.retain"


@frozen(kw_only=True)
class Retained:
    """The answer to ``Retain``: the new handle's token, which only its holder can ``Release``."""

    TAG: ClassVar[str] = "codex.retained"
    handle: str


@frozen(kw_only=True)
class Release:
    """Give back the handle ``handle`` (a token ``Retain`` or ``Adapter.open`` gave out); any other token is
    refused, so a peer cannot close a child it holds no handle on."""

    TAG: ClassVar[str] = "codex.release"
    handle: str = ""


@frozen(kw_only=True)
class StartTurn:
    TAG: ClassVar[str] = "codex.start_turn"
    conversation_key: str
    input: str


@frozen(kw_only=True)
class TurnStarted:
    TAG: ClassVar[str] = "codex.turn_started"
    turn_id: str


@frozen(kw_only=True)
class NextEvent:
    """Answered with one event, or ``Ok`` once the terminal event was delivered (TU-02)."""

    TAG: ClassVar[str] = "codex.next_event"
    turn_id: str


@frozen(kw_only=True)
class Respond:
    TAG: ClassVar[str] = "codex.respond"
    turn_id: str
    call_id: str
    result: ToolResult


@frozen(kw_only=True)
class Abandon:
    TAG: ClassVar[str] = "codex.abandon"
    turn_id: str


@frozen(kw_only=True)
class TurnUsage:
    """Answered with ``TurnUsageReply``: the token usage the app-server reported for the turn so far."""

    TAG: ClassVar[str] = "codex.turn_usage"
    turn_id: str


@frozen(kw_only=True)
class TurnUsageReply:
    TAG: ClassVar[str] = "codex.turn_usage_reply"
    usage: TokenUsage | None


@frozen(kw_only=True)
class Diagnostics:
    TAG: ClassVar[str] = "codex.diagnostics"


@frozen(kw_only=True)
class DiagnosticsReply:
    TAG: ClassVar[str] = "codex.diagnostics_reply"
    stderr: bytes


@frozen(kw_only=True)
class ChildOutput:
    """One stdout line, one stderr chunk, or the child's exit (``code``), from the reader threads; or
    ``stuck``: the writer thread's write to the child's stdin made no progress for the write timeout."""

    TAG: ClassVar[str] = "codex.child"
    stream: Literal["stdout", "stderr", "exit", "stuck"]
    data: bytes = b""
    code: int | None = None


CODEX_MESSAGES = (
    *CODEX_TYPES,
    AwaitOpen,
    Retain,
    Retained,
    Release,
    StartTurn,
    TurnStarted,
    NextEvent,
    Respond,
    Abandon,
    Diagnostics,
    DiagnosticsReply,
    ChildOutput,
    TurnUsage,
    TurnUsageReply,
)
CODEX_ERRORS = CODEX_TYPE_ERRORS


def codex_registry(max_body_bytes: int = 1 << 20) -> Registry:
    """What a node that hosts only Codex adapters speaks (the facades' private node): the system messages,
    the shared value types and this package's messages and errors. The application's wiring merges
    ``CODEX_MESSAGES`` / ``CODEX_ERRORS`` into its own table instead."""
    return Registry(
        (*SYSTEM_MESSAGES, *AGENT_TYPES, *CODEX_MESSAGES),
        ErrorRegistry().extended(CODEX_ERRORS),
        max_body_bytes=max_body_bytes,
    )
