"""The transport's own message bodies: heartbeat, echo, hello, ok and the error reply; and ``JsonValue``.

Every body is a frozen, slotted, keyword-only dataclass with a written-out ``TAG``. Other layers declare
theirs the same way and pass an explicit tuple to ``transport.codec.Registry``.
"""

from __future__ import annotations

from dataclasses import field
from typing import Annotated, Any, ClassVar, TypeAlias

from transport.records import frozen

# A JSON-like value (tool arguments, provider payloads). On the wire it may also hold bytes, UUIDs and
# registered messages; nesting is bounded by the codec's MAX_DEPTH. Defined here, below the codec, so that
# the codec may import these bodies (``ErrorReply``) and no module of the transport imports in a circle;
# ``transport.codec`` re-exports it.
JsonValue: TypeAlias = Annotated[Any, "kbus.json"]


@frozen(kw_only=True)
class Ping:
    """Application heartbeat: answered by the actor's own thread, so it proves the mailbox is moving."""

    TAG: ClassVar[str] = "sys.ping"
    nonce: int = 0


@frozen(kw_only=True)
class Pong:
    TAG: ClassVar[str] = "sys.pong"
    nonce: int = 0
    actor: str = ""


@frozen(kw_only=True)
class Ok:
    """The reply to a request whose handler returned nothing: every request ends in one terminal reply."""

    TAG: ClassVar[str] = "sys.ok"


@frozen(kw_only=True)
class Hello:
    """Sent by a node on each outbound connection so the peer can route messages back over it."""

    TAG: ClassVar[str] = "sys.hello"
    node: str


@frozen(kw_only=True)
class Resolve:
    """Directory query to ``<node>/node``: where does ``actor`` take traffic on its own socket?"""

    TAG: ClassVar[str] = "sys.resolve"
    actor: str


@frozen(kw_only=True)
class Resolved:
    TAG: ClassVar[str] = "sys.resolved"
    actor: str
    endpoints: tuple[str, ...] = ()


@frozen(kw_only=True)
class StatsQuery:
    """Ask ``<node>/node`` for its counters (``kbus stats``); answered with ``sys.node_stats``."""

    TAG: ClassVar[str] = "sys.stats"


@frozen(kw_only=True)
class ActorStats:
    """One actor's counters: bus messages handled, those answered with an error, items in its mailbox."""

    TAG: ClassVar[str] = "sys.actor_stats"
    actor: str
    handled: int = 0
    failed: int = 0
    mailbox: int = 0


@frozen(kw_only=True)
class NodeStats:
    """A node's counters by name (drops by reason: ``malformed``, ``spoofed``, ``misrouted``, ...) and
    each actor's own."""

    TAG: ClassVar[str] = "sys.node_stats"
    node: str
    counters: dict[str, int] = field(default_factory=dict)
    actors: tuple[ActorStats, ...] = ()


@frozen(kw_only=True)
class ErrorReply:
    """A typed error on the wire: ``error`` is the class's wire name, rebuilt by ``ErrorRegistry``."""

    TAG: ClassVar[str] = "sys.error"
    error: str
    message: str
    fields: dict[str, Any] = field(default_factory=dict)
    cause: ErrorReply | None = None
    # For a cause that is not a BusError (e.g. an OSError inside a provider): its Python type name.
    exc_type: str | None = None


# The echo actor's limits (a request past one gets ``LimitExceeded``, and nothing runs). Every other size
# is bounded by the node's frame size (``node.max_frame_bytes``, 1 MiB by default): ``Echo.payload``,
# ``Echo.text``, ``Echo.data`` (nested at most ``codec.MAX_DEPTH`` deep), ``Hold.note``, ``Fail.message``
# (its error text is cut to ``errors.MAX_ERROR_TEXT`` characters in the reply).
ECHO_MAX_STREAM_PARTS = 10_000  # EchoStream.count: 0 to this
ECHO_MAX_STREAM_BYTES = 16 << 20  # EchoStream.count * len(EchoStream.payload): what one stream may send
ECHO_MAX_HELD = 1024  # Hold: requests one echo actor holds at once (each until its deadline)


@frozen(kw_only=True)
class Echo:
    """Sent back unchanged by the built-in echo actor (ping and benchmarks)."""

    TAG: ClassVar[str] = "echo"
    payload: bytes = b""
    text: str = ""
    seq: int = 0
    data: JsonValue = None


@frozen(kw_only=True)
class EchoStream:
    """Ask the echo actor for ``count`` partial replies followed by one final reply.

    ``count`` is 0 to ``ECHO_MAX_STREAM_PARTS``, and ``count * len(payload)`` at most
    ``ECHO_MAX_STREAM_BYTES``; past either, ``LimitExceeded``."""

    TAG: ClassVar[str] = "echo.stream"
    count: int
    payload: bytes = b""


@frozen(kw_only=True)
class Fail:
    """Ask the echo actor to raise: a ``BusError`` of ``error`` (a wire name) or, if empty, a plain bug."""

    TAG: ClassVar[str] = "echo.fail"
    error: str = ""
    message: str = "failure requested"


@frozen(kw_only=True)
class Hold:
    """Ask the echo actor to accept a request and never answer it (deadline and peer-death tests).

    It is forgotten at its deadline; at most ``ECHO_MAX_HELD`` are held at once (past that,
    ``LimitExceeded``)."""

    TAG: ClassVar[str] = "echo.hold"
    note: str = ""


SYSTEM_MESSAGES: tuple[type[Any], ...] = (
    Ping,
    Pong,
    Ok,
    Hello,
    Resolve,
    Resolved,
    StatsQuery,
    ActorStats,
    NodeStats,
    ErrorReply,
    Echo,
    EchoStream,
    Fail,
    Hold,
)
