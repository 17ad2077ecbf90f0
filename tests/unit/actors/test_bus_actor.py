"""The invariant of every ``BusActor`` (issue 18): no input, and no failure while answering it, stops the
actor. Error replies are bounded in size; an answer that cannot be encoded is answered with why; an answer
that cannot be sent is counted and logged once, never raised. One in-process node; the echo actor and small
test actors.
"""

from __future__ import annotations

import logging
import queue
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from actors.base import BusActor, Context
from actors.echo import EchoActor
from transport import Node, Peer
from transport.capture import CaptureWriter
from transport.envelope import Header
from transport.errors import MAX_ERROR_TEXT, BusError, Expired, HandlerError, ProtocolError
from transport.messages import Echo, Fail, Ping, Pong
from transport.pending import Reply

WAIT = 10.0


class Quota(BusError):
    WIRE = "test.quota"


class Raiser(BusActor):
    """Raises the BusError an ``Echo.text`` names: ``huge-fields`` (2 MB of details) or ``odd-fields``
    (a value msgpack cannot encode); answers ``Echo(text="unencodable")`` with an unregistered object and
    ``Echo(text="oversized")`` with a reply larger than a frame."""

    def handle(self, message: Any, ctx: Context) -> Any:
        match message:
            case Echo(text="huge-fields"):
                raise Quota("too much", blob=b"x" * (2 << 20))
            case Echo(text="odd-fields"):
                raise Quota("odd", thing=object())
            case Echo(text="unencodable"):
                return object()
            case Echo(text="oversized"):
                return Echo(payload=b"x" * (2 << 20))
        return message


class NodeWhoseRepliesFail(Node):
    """A fake at a chosen point: every reply sent from ``n1/raiser`` raises, as a send to a broken transport
    or capture would. Everything else goes through."""

    def send(self, header: Header, body: bytes, **kwargs: Any) -> None:
        if header.src == "n1/raiser" and header.is_reply:
            raise OSError("no space left on the fake device")
        super().send(header, body, **kwargs)


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    n = make_node("n1", registry=_registry())
    n.spawn(EchoActor, "echo")
    n.spawn(Raiser, "raiser")
    return n


def _registry() -> Any:
    from transport.codec import Registry
    from transport.errors import ErrorRegistry
    from transport.messages import SYSTEM_MESSAGES

    return Registry(SYSTEM_MESSAGES, ErrorRegistry().extended([Quota]))


def send_raw(node: Node, dst: str, kind: str, body: bytes) -> Reply:
    replies: queue.Queue[Reply] = queue.Queue()
    header = node.header(kind, node.client_address(), dst, "ask", timeout=WAIT)
    node.send(header, body, deliver=replies.put, timeout=WAIT)
    return replies.get(timeout=WAIT + 1)


def alive(node: Node, actor: str) -> bool:
    return bool(
        node.request(f"n1/{actor}", Ping(nonce=7), timeout=WAIT) == Pong(nonce=7, actor=f"n1/{actor}")
    )


def test_a_body_of_many_unknown_fields_gets_a_small_error_and_the_actor_lives(node: Node) -> None:
    """Issue 18 item 1: the error used to list every name, 3x the body, and its encoding killed the actor."""
    names = {("\x01" * 8) + str(i): 0 for i in range(60_000)}
    body = msgpack.packb(names)
    assert len(body) < node.registry.max_body_bytes
    reply = send_raw(node, "n1/echo", "echo", body)
    assert type(reply.error) is ProtocolError
    assert "and 59995 more" in reply.error.message
    assert len(reply.error.message) < 1000
    assert alive(node, "echo")


def test_a_huge_error_message_is_cut_with_its_size_noted(node: Node) -> None:
    with pytest.raises(HandlerError) as info:
        node.request("n1/echo", Fail(message="y" * 500_000), timeout=WAIT)
    text = info.value.message
    assert len(text) <= MAX_ERROR_TEXT + 60
    assert text.endswith(f"[cut: {len('RuntimeError: ') + 500_000} characters in all]")
    assert alive(node, "echo")


@pytest.mark.parametrize("which", ["huge-fields", "odd-fields"])
def test_an_error_whose_fields_cannot_travel_goes_without_them(node: Node, which: str) -> None:
    with pytest.raises(Quota) as info:  # still the same class on this side
        node.request("n1/raiser", Echo(text=which), timeout=WAIT)
    assert "[error fields dropped:" in info.value.message
    assert info.value.details == {}
    assert alive(node, "raiser")


def test_a_reply_that_cannot_be_encoded_is_answered_with_why(node: Node) -> None:
    with pytest.raises(HandlerError, match="TypeError: object is not a registered message"):
        node.request("n1/raiser", Echo(text="unencodable"), timeout=WAIT)
    with pytest.raises(ProtocolError, match="exceeds"):
        node.request("n1/raiser", Echo(text="oversized"), timeout=WAIT)
    assert alive(node, "raiser")


def test_an_answer_that_cannot_be_sent_is_counted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    node = NodeWhoseRepliesFail("n1", registry=_registry()).start()
    try:
        ref = node.spawn(Raiser, "raiser")
        caplog.set_level(logging.WARNING, logger="actors.base")
        futures = [node.request_future("n1/raiser", Echo(seq=i), timeout=0.5) for i in range(5)]
        futures.append(node.request_future("n1/raiser", Echo(text="huge-fields"), timeout=0.5))
        for future in futures:
            assert future.exception(WAIT) is not None  # each expires: no answer could be sent
        assert node.stats["answer_send_failures"] == 6
        assert ref.is_alive()
        assert node.lookup("raiser") is ref
        warnings = [r for r in caplog.records if "could not send" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        node.stop()


def test_an_input_that_fails_before_any_handler_is_counted_and_the_actor_lives(
    make_node: Callable[..., Node], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The last guard: a failure outside every error reply (here the actor's capture writer is closed, so
    recording the delivery raises) is counted and logged once; the actor is not stopped."""
    writer = CaptureWriter(tmp_path / "srv.buslog", node="srv", schema="s")
    server = make_node("srv", bind=[f"inproc://kb-{uuid.uuid4().hex}"], capture=writer)
    ref = server.spawn(EchoActor, "echo")
    client = make_node("client")
    client.connect(Peer("srv", server.endpoints[0]), wait=WAIT)
    writer.close()
    caplog.set_level(logging.ERROR, logger="actors.base")
    for i in range(3):
        with pytest.raises(Expired):
            client.request("srv/echo", Echo(seq=i), timeout=0.5)
    assert server.stats["actor_input_failures"] == 3
    assert ref.is_alive() and server.lookup("echo") is ref
    assert len([r for r in caplog.records if "handling echo failed" in r.getMessage()]) == 1
