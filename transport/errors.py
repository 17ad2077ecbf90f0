"""Typed errors that cross the bus: one class per outcome, rebuilt as the same class on the far side.

The tree::

    BusError                      anything a peer can report back over the bus
    ├─ ProtocolError              a frame or message that breaks the wire contract (hostile or buggy peer)
    ├─ NotDelivered               known not delivered: nothing ran, safe to retry
    ├─ Unavailable                outcome unknown (peer or actor gone mid-request): retry only by `idem`
    ├─ Expired                    the request's deadline passed before a reply arrived
    ├─ LimitExceeded              a request asks for more than a documented limit (nothing ran)
    ├─ HandlerError               a handler raised something that is not a BusError (a bug on the far side)
    └─ RemoteError                an error class this side does not know (kept by name, never guessed)

Errors travel as an ``ErrorReply`` body (see ``transport.messages``) carrying the wire name, the message,
the error's own fields and its cause; ``ErrorRegistry`` maps wire names back to classes. Other layers add
their own classes to a registry explicitly, so nothing registers itself at import time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar


class BusError(Exception):
    """Base for every failure a peer can report back over the bus.

    Subclasses set ``WIRE`` (their written-out wire name) and, when they carry structured data, override
    ``wire_fields`` / ``from_wire``. ``retryable`` says whether a bounded retry may resend the same request.
    """

    WIRE: ClassVar[str] = "bus_error"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str = "", **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details

    def wire_fields(self) -> dict[str, Any]:
        """The fields that travel with the error; values must be encodable by the codec."""
        return dict(self.details)

    @classmethod
    def from_wire(cls, message: str, fields: Mapping[str, Any]) -> BusError:
        return cls(message, **fields)

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and isinstance(other, BusError)
            and other.message == self.message
            and other.wire_fields() == self.wire_fields()
        )

    def __hash__(self) -> int:
        return hash((type(self), self.message))

    def __repr__(self) -> str:
        fields = "".join(f", {k}={v!r}" for k, v in self.wire_fields().items())
        return f"{type(self).__name__}({self.message!r}{fields})"


class ProtocolError(BusError):
    """A frame or message that breaks the wire contract; the receiver stays alive and loses nothing else."""

    WIRE = "protocol"


class NotDelivered(BusError):
    """Known not delivered: the message never reached a handler, so a retry cannot duplicate an effect."""

    WIRE = "not_delivered"
    retryable = True


class Unavailable(BusError):
    """The peer or actor went away with the request in flight: the outcome is unknown.

    Not retryable by default: resending could run an effect twice; retry only by idempotency key.
    """

    WIRE = "unavailable"


class Expired(BusError):
    """The request's deadline passed before its terminal reply; a late reply is dropped and counted."""

    WIRE = "expired"


class LimitExceeded(BusError):
    """A request asks for more than a documented limit (a count, a length, a number held at once).

    Nothing ran. ``details`` name the ``field`` and its ``limit``. Not retryable as it is: the same request
    fails the same way (one held past a limit at once may pass later, when others were answered).
    """

    WIRE = "limit_exceeded"


class HandlerError(BusError):
    """The far side's handler raised a non-bus exception, named by ``exc_type``: a bug, reported."""

    WIRE = "handler"


class RemoteError(BusError):
    """An error whose wire name this side does not know; ``wire_name`` keeps it for the reader."""

    WIRE = "remote"


MAX_ERROR_TEXT = 2000
"""Characters of an error's message that travel (or are logged); the rest is cut, its size noted."""


def cut_text(text: str, limit: int = MAX_ERROR_TEXT) -> str:
    """``text`` if it fits in ``limit`` characters, else its start and a note of the size it had."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [cut: {len(text)} characters in all]"


# Names the spec (RULES.md C.1, MB-04, MB-10) uses for the same outcomes.
BusTimeout = Expired
ActorUnavailable = Unavailable

TRANSPORT_ERRORS: tuple[type[BusError], ...] = (
    BusError,
    ProtocolError,
    NotDelivered,
    Unavailable,
    Expired,
    LimitExceeded,
    HandlerError,
    RemoteError,
)


class ErrorRegistry:
    """Wire name -> error class. Built from explicit tuples; a duplicate wire name is a programming error."""

    __slots__ = ("_by_wire",)

    def __init__(self, classes: Iterable[type[BusError]] = TRANSPORT_ERRORS) -> None:
        self._by_wire: dict[str, type[BusError]] = {}
        for cls in classes:
            self._add(cls)

    def _add(self, cls: type[BusError]) -> None:
        known = self._by_wire.get(cls.WIRE)
        if known is not None and known is not cls:
            raise ValueError(f"error wire name {cls.WIRE!r} used by {known.__name__} and {cls.__name__}")
        self._by_wire[cls.WIRE] = cls

    def extended(self, classes: Iterable[type[BusError]]) -> ErrorRegistry:
        new = ErrorRegistry(self._by_wire.values())
        for cls in classes:
            new._add(cls)
        return new

    def lookup(self, wire: str) -> type[BusError] | None:
        return self._by_wire.get(wire)

    def __contains__(self, cls: object) -> bool:
        return isinstance(cls, type) and self._by_wire.get(getattr(cls, "WIRE", "")) is cls

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._by_wire))
