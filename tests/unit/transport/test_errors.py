"""Tests for transport.errors and the codec's error path: typed errors cross the bus as the same class.

DESIGN.md §2: errors cross the bus as typed error replies and are rebuilt as the same class, with their
fields and cause. MB-06: errors travel as ``sys.error`` bodies with their cause.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from transport.codec import Registry
from transport.errors import (
    TRANSPORT_ERRORS,
    ActorUnavailable,
    BusError,
    BusTimeout,
    ErrorRegistry,
    Expired,
    HandlerError,
    NotDelivered,
    ProtocolError,
    RemoteError,
    Unavailable,
)
from transport.messages import SYSTEM_MESSAGES, ErrorReply

REG = Registry(SYSTEM_MESSAGES)


def over_the_wire(exc: BaseException, sender: Registry = REG, receiver: Registry = REG) -> BusError:
    """What the far side raises: error_reply -> encode -> decode -> rebuild_error."""
    frame = sender.encode(sender.error_reply(exc))
    reply = receiver.decode(ErrorReply.TAG, frame)
    assert type(reply) is ErrorReply
    return receiver.rebuild_error(reply)


def _sample(cls: type[BusError]) -> BusError:
    fields: dict[str, Any] = {
        "peer": "n2",
        "attempt": 3,
        "ratio": 0.5,
        "blob": b"\x00\xff",
        "id": uuid.UUID(int=7),
        "nested": {"a": [1, None, True], "b": {"c": "d"}},
        "missing": None,
    }
    if cls is RemoteError:
        fields["wire_name"] = "quota_exceeded"
    if cls is HandlerError:
        fields["exc_type"] = "KeyError"
    return cls(f"{cls.__name__} happened", **fields)


@pytest.mark.parametrize("cls", TRANSPORT_ERRORS, ids=lambda c: c.__name__)
def test_every_transport_error_round_trips_as_the_same_class(cls: type[BusError]) -> None:
    """DESIGN.md §2 / MB-06: same class, same message, same fields on the far side."""
    exc = _sample(cls)
    back = over_the_wire(exc)
    assert type(back) is cls
    assert back.message == exc.message
    assert back.wire_fields() == exc.wire_fields()
    assert back == exc
    assert str(back) == str(exc)


@pytest.mark.parametrize("cls", TRANSPORT_ERRORS, ids=lambda c: c.__name__)
def test_every_transport_error_round_trips_without_fields(cls: type[BusError]) -> None:
    back = over_the_wire(cls("bare"))
    assert type(back) is cls
    assert back.message == "bare"
    assert back.wire_fields() == {}


def test_error_reply_names_the_wire_name() -> None:
    reply = REG.error_reply(NotDelivered("gone", peer="n2"))
    assert reply == ErrorReply(error="not_delivered", message="gone", fields={"peer": "n2"})


def test_bus_error_cause_chain_is_restored() -> None:
    try:
        try:
            try:
                raise Expired("innermost", after=1.5)
            except Expired as inner:
                raise NotDelivered("middle", peer="n3") from inner
        except NotDelivered as middle:
            raise Unavailable("outer") from middle
    except Unavailable as exc:
        back = over_the_wire(exc)
    assert back == Unavailable("outer")
    middle_back = back.__cause__
    assert type(middle_back) is NotDelivered
    assert middle_back == NotDelivered("middle", peer="n3")
    inner_back = middle_back.__cause__
    assert type(inner_back) is Expired
    assert inner_back == Expired("innermost", after=1.5)
    assert inner_back.__cause__ is None


def test_a_plain_exception_cause_becomes_handler_error_with_exc_type() -> None:
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as os_error:
            raise Unavailable("could not write") from os_error
    except Unavailable as exc:
        reply = REG.error_reply(exc)
        back = over_the_wire(exc)
    assert reply.cause is not None
    assert reply.cause.exc_type == "OSError"
    assert type(back) is Unavailable
    cause = back.__cause__
    assert type(cause) is HandlerError
    assert cause.message == "OSError: [Errno 28] No space left on device"
    assert cause.wire_fields() == {"exc_type": "OSError"}


def test_a_plain_exception_becomes_handler_error() -> None:
    back = over_the_wire(KeyError("tool"))
    assert type(back) is HandlerError
    assert back.message == "KeyError: 'tool'"
    assert back.details["exc_type"] == "KeyError"


def test_a_cyclic_cause_chain_is_bounded() -> None:
    """A cause cycle must not recurse forever on the way out; the chain that arrives is finite."""
    a, b = NotDelivered("a"), Expired("b")
    a.__cause__, b.__cause__ = b, a
    back: BaseException | None = over_the_wire(a)
    names = []
    while back is not None:
        names.append(type(back).__name__)
        back = back.__cause__
    assert names[:2] == ["NotDelivered", "Expired"]
    assert 2 <= len(names) <= 8


def test_an_unknown_wire_name_becomes_remote_error_keeping_the_name() -> None:
    reply = ErrorReply(error="quota_exceeded", message="over quota", fields={"limit": 10, "used": 12})
    back = REG.rebuild_error(REG.decode(ErrorReply.TAG, REG.encode(reply)))
    assert type(back) is RemoteError
    assert back.message == "over quota"
    assert back.details == {"wire_name": "quota_exceeded", "limit": 10, "used": 12}


def test_an_unknown_wire_name_is_kept_across_a_second_hop() -> None:
    """A relay that does not know the class either forwards it as RemoteError with the original name."""
    first = REG.rebuild_error(ErrorReply(error="quota_exceeded", message="over", fields={"limit": 1}))
    second = over_the_wire(first)
    assert type(second) is RemoteError
    assert second.details["wire_name"] == "quota_exceeded"
    assert second.details["limit"] == 1


@pytest.mark.parametrize(
    ("error", "fields"),
    [
        pytest.param("quota_exceeded", {"wire_name": "spoofed"}, id="unknown-with-wire_name-field"),
        pytest.param("quota_exceeded", {"message": "twice"}, id="unknown-with-message-field"),
        pytest.param("quota_exceeded", {b"k": 1}, id="unknown-with-bytes-key"),
        pytest.param("expired", {"message": "twice"}, id="known-with-message-field"),
        pytest.param("expired", {b"k": 1}, id="known-with-bytes-key"),
        pytest.param("remote", {"wire_name": "x", "message": "y"}, id="remote-with-message-field"),
    ],
)
def test_rebuild_error_never_raises_for_hostile_fields(error: str, fields: dict[Any, Any]) -> None:
    """DESIGN.md §3: a peer's error body is hostile too; rebuilding it yields a BusError, never a crash
    of the thread that resolves the reply (the node's I/O thread for a remote reply)."""
    back = REG.rebuild_error(ErrorReply(error=error, message="m", fields=fields))
    assert isinstance(back, BusError)
    if error == "quota_exceeded" and "wire_name" in fields:
        assert type(back) is RemoteError
        assert back.details["wire_name"] == "quota_exceeded"  # the wire name, not the field, wins


def test_retryable_flags() -> None:
    """DESIGN.md §4: NotDelivered is safe to retry; Unavailable (outcome unknown) and Expired are not."""
    assert NotDelivered.retryable is True
    assert Unavailable.retryable is False
    assert Expired.retryable is False
    assert NotDelivered("x").retryable is True
    assert not any(c.retryable for c in TRANSPORT_ERRORS if c is not NotDelivered)


def test_spec_names_are_aliases() -> None:
    """RULES.md MB-04 / MB-10 name the same outcomes BusTimeout and ActorUnavailable."""
    assert BusTimeout is Expired
    assert ActorUnavailable is Unavailable


def test_every_transport_error_is_a_bus_error_with_a_distinct_wire_name() -> None:
    assert all(issubclass(c, BusError) for c in TRANSPORT_ERRORS)
    assert len({c.WIRE for c in TRANSPORT_ERRORS}) == len(TRANSPORT_ERRORS)
    reg = ErrorRegistry()
    assert all(reg.lookup(c.WIRE) is c for c in TRANSPORT_ERRORS)


class _DupA(BusError):
    WIRE = "test.dup"


class _DupB(BusError):
    WIRE = "test.dup"


class _StealsExpired(BusError):
    WIRE = "expired"


def test_error_registry_rejects_two_classes_with_one_wire_name() -> None:
    with pytest.raises(ValueError, match=r"test\.dup"):
        ErrorRegistry((_DupA, _DupB))
    with pytest.raises(ValueError, match="expired"):
        ErrorRegistry().extended([_StealsExpired])
    with pytest.raises(ValueError, match="expired"):
        REG.extended([], errors=[_StealsExpired])


def test_error_registry_accepts_the_same_class_twice() -> None:
    reg = ErrorRegistry((_DupA, _DupA))
    assert reg.lookup("test.dup") is _DupA


class QuotaExceeded(BusError):
    """A test-only error with structured fields (the shape other layers' errors take)."""

    WIRE: ClassVar[str] = "test.quota_exceeded"

    def __init__(self, message: str = "", *, limit: int, used: int, unit: str = "tokens") -> None:
        super().__init__(message)
        self.limit = limit
        self.used = used
        self.unit = unit

    def wire_fields(self) -> dict[str, Any]:
        return {"limit": self.limit, "used": self.used, "unit": self.unit}

    @classmethod
    def from_wire(cls, message: str, fields: Mapping[str, Any]) -> BusError:
        return cls(message, limit=int(fields["limit"]), used=int(fields["used"]), unit=str(fields["unit"]))


def test_extended_registry_round_trips_a_structured_error() -> None:
    reg = REG.extended([], errors=[QuotaExceeded])
    exc = QuotaExceeded("over quota", limit=100, used=130, unit="requests")
    back = over_the_wire(exc, reg, reg)
    assert type(back) is QuotaExceeded
    assert isinstance(back, QuotaExceeded)
    assert (back.message, back.limit, back.used, back.unit) == ("over quota", 100, 130, "requests")
    assert back == exc


def test_extended_does_not_change_the_original() -> None:
    errors = ErrorRegistry()
    extended = errors.extended([QuotaExceeded])
    assert extended.lookup(QuotaExceeded.WIRE) is QuotaExceeded
    assert errors.lookup(QuotaExceeded.WIRE) is None
    assert QuotaExceeded in extended
    assert QuotaExceeded not in errors
    assert REG.extended([], errors=[QuotaExceeded]).schema_hash() != REG.schema_hash()


def test_a_structured_error_missing_its_fields_becomes_protocol_error() -> None:
    reg = REG.extended([], errors=[QuotaExceeded])
    back = reg.rebuild_error(ErrorReply(error=QuotaExceeded.WIRE, message="m", fields={"limit": 1}))
    assert type(back) is ProtocolError
    assert QuotaExceeded.WIRE in back.message


def test_a_receiver_without_the_class_gets_remote_error_with_its_name() -> None:
    reg = REG.extended([], errors=[QuotaExceeded])
    back = over_the_wire(QuotaExceeded("over", limit=1, used=2), reg, REG)
    assert type(back) is RemoteError
    assert back.details == {"wire_name": QuotaExceeded.WIRE, "limit": 1, "used": 2, "unit": "tokens"}


def test_a_sender_without_the_class_sends_it_as_remote_error() -> None:
    """An unregistered subclass is never guessed on the far side: it travels as "remote" with its name."""
    reply = REG.error_reply(QuotaExceeded("over", limit=1, used=2))
    assert reply.error == RemoteError.WIRE
    assert reply.fields["wire_name"] == QuotaExceeded.WIRE
    knows_it = REG.extended([], errors=[QuotaExceeded])
    back = over_the_wire(QuotaExceeded("over", limit=1, used=2), REG, knows_it)
    assert type(back) is RemoteError
    assert back.details["wire_name"] == QuotaExceeded.WIRE


def test_a_structured_error_keeps_its_cause() -> None:
    reg = REG.extended([], errors=[QuotaExceeded])
    try:
        try:
            raise NotDelivered("upstream", peer="n9")
        except NotDelivered as inner:
            raise QuotaExceeded("over", limit=1, used=2) from inner
    except QuotaExceeded as exc:
        back = over_the_wire(exc, reg, reg)
    assert type(back) is QuotaExceeded
    assert back.__cause__ == NotDelivered("upstream", peer="n9")


def test_equality_is_by_class_message_and_fields() -> None:
    assert Expired("a", x=1) == Expired("a", x=1)
    assert Expired("a", x=1) != Expired("a", x=2)
    assert Expired("a") != Unavailable("a")
    assert Expired("a") != "a"
    assert hash(Expired("a", x=1)) == hash(Expired("a", x=1))
    assert repr(Expired("a", x=1)) == "Expired('a', x=1)"
