"""Tests for transport.node with actors in one process: one node, or two nodes joined over ``inproc://``.

Covers the delivery contract of DESIGN.md §2 and §4 (every request ends in exactly one terminal outcome;
a handler never kills its actor; an actor never blocks on another actor's reply) and RULES.md MB-01,
MB-04, MB-05 and MB-10.
"""

from __future__ import annotations

import ast
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from actors.app.echo import EchoActor
from actors.base import DEFER, BusActor, Context
from transport import Node, Peer
from transport.codec import decode_header, encode_header
from transport.envelope import Header, new_id
from transport.errors import (
    BusError,
    Expired,
    HandlerError,
    NotDelivered,
    ProtocolError,
    RemoteError,
    Unavailable,
)
from transport.messages import Echo, EchoStream, ErrorReply, Fail, Hold, Ok, Ping, Pong
from transport.node import MAX_HELD
from transport.pending import BlockingCallInActor, BusFuture, Reply, current_actor

WAIT = 10.0  # upper bound on every wait in this file; a healthy run needs milliseconds
# (error, id of the failed tell, the actor whose thread heard of it)
ActorTellErrors = queue.Queue[tuple[BusError, bytes | None, Any]]
ACTORS_DIR = Path(__file__).resolve().parents[3] / "actors"


# ------------------------------------------------------------------------------------ test-only actors


class Recorder(BusActor):
    """Records the ``seq`` of every Echo told to it; a request gets the record back."""

    def __init__(self, node: Node, address: str) -> None:
        super().__init__(node, address)
        self.seen: list[int] = []

    def handle(self, message: Any, ctx: Context) -> Any:
        if ctx.wants_reply:
            return Echo(data=list(self.seen))
        self.seen.append(message.seq)
        return None


class Quiet(BusActor):
    """Handles everything by returning None."""

    def handle(self, message: Any, ctx: Context) -> Any:
        return None


class Teller(BusActor):
    """Tells on the test's behalf (a pykka ask of ``("tell", dst, message)``) and reports tell errors."""

    def __init__(self, node: Node, address: str, errors: ActorTellErrors) -> None:
        super().__init__(node, address)
        self.errors = errors

    def on_local(self, message: Any) -> Any:
        op, dst, body = message
        assert op == "tell"
        return self.tell_to(dst, body)

    def on_tell_error(self, error: BusError, tell_id: bytes | None) -> None:
        self.errors.put((error, tell_id, current_actor()))


class Deferrer(BusActor):
    """Holds every ``Hold`` unanswered; ``Echo(text="release")`` answers them (last first) with their
    notes; ``Echo(text="count")`` says how many it holds."""

    def __init__(self, node: Node, address: str) -> None:
        super().__init__(node, address)
        self.held: list[tuple[str, Context]] = []

    def handle(self, message: Any, ctx: Context) -> Any:
        if isinstance(message, Hold):
            self.held.append((message.note, ctx))
            return DEFER
        if message.text == "release":
            released, self.held = self.held, []
            for note, held in reversed(released):
                held.reply(Echo(text=note))
            return Echo(text="released", seq=len(released))
        return Echo(text="count", seq=len(self.held))


def _blocking_calls(node: Node) -> dict[str, Callable[[], Any]]:
    echo = f"{node.name}/echo"
    return {
        "request": lambda: node.request(echo, Echo(), timeout=30),
        "stream": lambda: next(node.stream(echo, EchoStream(count=1), timeout=30)),
        "future.result": lambda: node.request_future(echo, Hold(), timeout=30).result(30),
        "future.exception": lambda: node.request_future(echo, Hold(), timeout=30).exception(30),
        "future.parts": lambda: next(node.request_future(echo, Hold(), timeout=30, stream=True).parts(30)),
        "call_in_io_thread": lambda: node.call_in_io_thread(lambda: 1, timeout=30),
    }


BLOCKING_CALLS = (
    "request",
    "stream",
    "future.result",
    "future.exception",
    "future.parts",
    "call_in_io_thread",
)


class Blocker(BusActor):
    """Tries the blocking call ``Echo.text`` names from its own thread and replies with what happened."""

    def handle(self, message: Any, ctx: Context) -> Any:
        call = _blocking_calls(self.node)[message.text]
        try:
            call()
        except BlockingCallInActor as exc:
            return Echo(text=f"caught {type(exc).__name__}: {exc}")
        return Echo(text="not caught")


class Relay(BusActor):
    """Asks echo without blocking and answers its own caller from the continuation (DEFER + ctx)."""

    def handle(self, message: Any, ctx: Context) -> Any:
        handler_thread = threading.get_ident()
        echo = f"{self.node.name}/echo"

        def then(reply: Reply) -> None:
            if reply.error is not None:
                ctx.fail(reply.error)
                return
            ctx.reply(
                Echo(
                    text=f"relayed {reply.message.text}",
                    data={"same_thread": threading.get_ident() == handler_thread, "actor": current_actor()},
                )
            )

        if isinstance(message, Hold):  # ask something that never answers, with a short deadline
            self.ask(echo, Hold(), then, timeout=float(message.note))
        else:
            self.ask(echo, Echo(text=message.text), then, timeout=WAIT)
        return DEFER


class Wedge(BusActor):
    """Its handler blocks on an event: a wedged actor thread, as a bug or a stuck call would make it."""

    def __init__(self, node: Node, address: str, entered: threading.Event, release: threading.Event) -> None:
        super().__init__(node, address)
        self.entered = entered
        self.release = release

    def handle(self, message: Any, ctx: Context) -> Any:
        self.entered.set()
        self.release.wait(WAIT)
        return message


# ------------------------------------------------------------------------------------------- fixtures


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    n = make_node("n1")
    n.spawn(EchoActor, "echo")
    return n


@pytest.fixture
def pair(make_node: Callable[..., Node]) -> tuple[Node, Node]:
    """(a, b): b binds an inproc endpoint, a connects to it; both run an echo actor."""
    b = make_node("b", bind=[f"inproc://kb-{uuid.uuid4().hex}"])
    b.spawn(EchoActor, "echo")
    a = make_node("a")
    a.spawn(EchoActor, "echo")
    a.connect(Peer("b", b.endpoints[0]), wait=WAIT)
    return a, b


def tell_errors(node: Node) -> queue.Queue[tuple[BusError, bytes | None]]:
    errors: queue.Queue[tuple[BusError, bytes | None]] = queue.Queue()
    node.on_tell_error(lambda error, tell_id: errors.put((error, tell_id)))
    return errors


def dropped_reply_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "dropped a late or duplicate reply" in r.getMessage()]


# ------------------------------------------------------------------------------ requests and replies


def test_request_reply(node: Node) -> None:
    reply = node.request("n1/echo", Echo(text="hi", payload=b"\x00", seq=3, data={"k": [1]}), timeout=WAIT)
    assert reply == Echo(text="hi", payload=b"\x00", seq=3, data={"k": [1]})
    assert len(node.pending) == 0


def test_request_future(node: Node) -> None:
    future = node.request_future("n1/echo", Echo(text="later"), timeout=WAIT)
    assert isinstance(future, BusFuture)
    assert len(future.request_id) == 16
    assert future.result(WAIT) == Echo(text="later")
    assert len(node.pending) == 0


def test_streamed_replies_arrive_in_order_then_the_final_one(node: Node) -> None:
    parts = list(node.stream("n1/echo", EchoStream(count=5, payload=b"p"), timeout=WAIT))
    assert parts == [Echo(payload=b"p", seq=i) for i in range(6)]
    assert len(node.pending) == 0


def test_streamed_future_yields_parts_and_resolves_to_the_final_reply(node: Node) -> None:
    future = node.request_future("n1/echo", EchoStream(count=3), timeout=WAIT, stream=True)
    assert [m.seq for m in future.parts(WAIT)] == [0, 1, 2, 3]
    assert future.result(0) == Echo(seq=3)


class PeekingFuture(BusFuture):
    """A fake: notes, as it is settled, how many items a ``parts()`` reader could already take."""

    def __init__(self) -> None:
        super().__init__()
        self.visible_when_settled: list[int] = []

    def set_result(self, result: Any) -> None:
        self.visible_when_settled.append(self._parts.qsize())
        super().set_result(result)

    def set_exception(self, exception: BaseException | None) -> None:
        self.visible_when_settled.append(self._parts.qsize())
        super().set_exception(exception)


@pytest.mark.parametrize("error", [None, Unavailable("gone")], ids=["reply", "error"])
def test_a_streams_end_is_queued_only_once_its_future_is_settled(error: BusError | None) -> None:
    """A reader on another thread that takes the end at once reads the result with no wait (``result(0)``).

    Queued first, the end could be taken between the two steps, and ``parts()`` raised ``TimeoutError``.
    """
    future = PeekingFuture()
    future._part(Echo(seq=0))
    future._finish(Reply(message=Echo(seq=1), error=error, final=True))
    assert future.visible_when_settled == [1]  # the one part, and not yet the end
    if error is None:
        assert [m.seq for m in future.parts(WAIT)] == [0, 1]
    else:
        with pytest.raises(Unavailable):
            list(future.parts(WAIT))


def test_a_stream_of_zero_parts_is_just_the_final_reply(node: Node) -> None:
    assert list(node.stream("n1/echo", EchoStream(count=0), timeout=WAIT)) == [Echo(seq=0)]


def test_a_plain_ask_gets_only_the_final_reply_of_a_streaming_handler(node: Node) -> None:
    assert node.request("n1/echo", EchoStream(count=4), timeout=WAIT) == Echo(seq=4)
    assert len(node.pending) == 0


def test_tell_is_delivered(node: Node) -> None:
    node.spawn(Recorder, "recorder")
    tell_id = node.tell("n1/recorder", Echo(seq=42))
    assert len(tell_id) == 16
    assert node.request("n1/recorder", Echo(), timeout=WAIT).data == [42]


def test_a_handler_returning_none_answers_ok(node: Node) -> None:
    """Every request ends in one terminal reply, even when the handler returns nothing."""
    node.spawn(Quiet, "quiet")
    assert node.request("n1/quiet", Echo(), timeout=WAIT) == Ok()


def test_request_to_an_unknown_actor_is_not_delivered_at_once(node: Node) -> None:
    """DESIGN.md §4: a known-not-delivered request fails at once, long before its deadline."""
    start = time.monotonic()
    with pytest.raises(NotDelivered, match="no actor"):
        node.request("n1/nobody", Echo(), timeout=30)
    assert time.monotonic() - start < 5
    assert len(node.pending) == 0


def test_request_to_an_unknown_node_is_not_delivered_at_once(node: Node) -> None:
    future = node.request_future("elsewhere/echo", Echo(), timeout=30)
    error = future.exception(5)
    assert isinstance(error, NotDelivered)
    assert len(node.pending) == 0


# ------------------------------------------------------------------------------------ deadlines (MB-04)


def test_a_request_nobody_answers_expires(node: Node) -> None:
    """MB-04: a request whose timeout elapses raises BusTimeout (Expired)."""
    start = time.monotonic()
    with pytest.raises(Expired):
        node.request("n1/echo", Hold(), timeout=0.2)
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 5
    assert len(node.pending) == 0


def test_a_late_reply_is_dropped_counted_and_logged(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """MB-04: the late reply to an expired request is dropped and logged; the caller saw only Expired."""
    caplog.set_level(logging.INFO, logger="transport.pending")
    node.spawn(Deferrer, "deferrer")
    future = node.request_future("n1/deferrer", Hold(note="too late"), timeout=0.2)
    assert isinstance(future.exception(WAIT), Expired)
    assert node.pending.late_replies == 0
    # The deferrer forgot the request at its deadline too (issue 18), so the late reply a slow peer would
    # send is injected here, as the deferrer would have sent it.
    header = node.header(Echo.TAG, "n1/deferrer", future_src(node), "reply", corr=future.request_id)
    node.send(header, node.registry.encode(Echo(text="too late")))
    assert node.pending.late_replies == 1
    assert isinstance(future.exception(0), Expired)  # still the one terminal outcome
    assert len(dropped_reply_logs(caplog)) == 1
    assert len(node.pending) == 0


def future_src(node: Node) -> str:
    return node.client_address(via_node=True)


def test_a_duplicate_reply_is_dropped_and_counted(node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """MB-04: duplicate replies are ignored; exactly one result reaches the caller."""
    caplog.set_level(logging.INFO, logger="transport.pending")
    node.spawn(Deferrer, "deferrer")
    future = node.request_future("n1/deferrer", Hold(), timeout=WAIT)
    client = node.client_address()
    for text in ("first", "second"):
        header = node.header(Echo.TAG, "n1/deferrer", client, "reply", corr=future.request_id)
        node.send(header, node.registry.encode(Echo(text=text)))
    assert future.result(WAIT) == Echo(text="first")
    assert node.pending.late_replies == 1
    assert len(dropped_reply_logs(caplog)) == 1


def test_replies_are_matched_by_correlation_id(node: Node) -> None:
    """MB-04: answered in the reverse order, each reply still reaches its own request."""
    node.spawn(Deferrer, "deferrer")
    futures = {note: node.request_future("n1/deferrer", Hold(note=note), timeout=WAIT) for note in "abc"}
    assert node.request("n1/deferrer", Echo(text="count"), timeout=WAIT).seq == 3
    assert node.request("n1/deferrer", Echo(text="release"), timeout=WAIT).seq == 3
    assert {note: f.result(WAIT).text for note, f in futures.items()} == {"a": "a", "b": "b", "c": "c"}
    assert node.pending.late_replies == 0


# --------------------------------------------------------------------- a handler never kills its actor


def test_a_bus_error_raised_on_ask_arrives_as_the_same_class(node: Node) -> None:
    with pytest.raises(ProtocolError) as info:
        node.request("n1/echo", Fail(error="protocol", message="bad input"), timeout=WAIT)
    assert type(info.value) is ProtocolError
    assert info.value.message == "bad input"
    assert node.request("n1/echo", Echo(text="still here"), timeout=WAIT) == Echo(text="still here")


def test_a_bug_raised_on_ask_arrives_as_handler_error(node: Node) -> None:
    with pytest.raises(HandlerError) as info:
        node.request("n1/echo", Fail(message="oops"), timeout=WAIT)
    assert info.value.message == "RuntimeError: oops"
    assert info.value.details["exc_type"] == "RuntimeError"
    assert node.request("n1/echo", Echo(text="still here"), timeout=WAIT) == Echo(text="still here")


def test_an_unhandled_message_type_arrives_as_a_protocol_error(node: Node) -> None:
    """A registered message the actor has no use for is the sender's mistake (issue 18 item 6: not a bug
    logged with a traceback per frame)."""
    with pytest.raises(ProtocolError, match="echo does not handle Pong"):
        node.request("n1/echo", Pong(), timeout=WAIT)
    assert node.request("n1/echo", Echo(seq=1), timeout=WAIT) == Echo(seq=1)


@pytest.mark.parametrize(
    ("fail", "error_class", "message"),
    [
        pytest.param(Fail(message="bad tell"), HandlerError, "RuntimeError: bad tell", id="bug"),
        pytest.param(Fail(error="protocol", message="bad tell"), ProtocolError, "bad tell", id="bus-error"),
    ],
)
def test_a_handler_raising_on_a_tell_from_an_actor(
    node: Node, fail: Fail, error_class: type[BusError], message: str
) -> None:
    """DESIGN.md §2: the sending actor hears of the error (on its own thread); the target keeps serving."""
    errors: ActorTellErrors = queue.Queue()
    teller = node.spawn(Teller, "teller", errors)
    tell_id = teller.ask(("tell", "n1/echo", fail), timeout=WAIT)
    error, corr, on_thread_of = errors.get(timeout=WAIT)
    assert type(error) is error_class
    assert error.message == message
    assert corr == tell_id
    assert on_thread_of == "n1/teller"
    assert node.request("n1/echo", Echo(text="alive"), timeout=WAIT) == Echo(text="alive")
    assert node.request("n1/teller", Ping(nonce=1), timeout=WAIT) == Pong(nonce=1, actor="n1/teller")
    assert errors.empty()


def test_a_handler_raising_on_a_tell_from_a_plain_thread(node: Node) -> None:
    """DESIGN.md §2: a client thread's tell error reaches ``node.on_tell_error``; the actor keeps serving."""
    errors = tell_errors(node)
    tell_id = node.tell("n1/echo", Fail(message="plain thread"))
    error, corr = errors.get(timeout=WAIT)
    assert type(error) is HandlerError
    assert error.message == "RuntimeError: plain thread"
    assert corr == tell_id
    assert node.request("n1/echo", Echo(text="alive"), timeout=WAIT) == Echo(text="alive")
    assert node.stats["tell_errors"] == 1


def test_a_tell_to_an_unknown_actor_reports_not_delivered(node: Node) -> None:
    errors = tell_errors(node)
    tell_id = node.tell("n1/nobody", Echo())
    error, corr = errors.get(timeout=WAIT)
    assert type(error) is NotDelivered
    assert corr == tell_id


def test_an_actor_tell_to_an_unknown_actor_reports_not_delivered(node: Node) -> None:
    errors: ActorTellErrors = queue.Queue()
    teller = node.spawn(Teller, "teller", errors)
    tell_id = teller.ask(("tell", "n1/nobody", Echo()), timeout=WAIT)
    error, corr, _ = errors.get(timeout=WAIT)
    assert type(error) is NotDelivered
    assert corr == tell_id


def _send_raw(node: Node, kind: str, body: bytes, flow: Any = "ask") -> queue.Queue[Reply]:
    replies: queue.Queue[Reply] = queue.Queue()
    header = node.header(kind, node.client_address(), "n1/echo", flow, timeout=WAIT)
    if flow == "ask":
        node.send(header, body, deliver=replies.put, timeout=WAIT)
    else:
        node.send(header, body)
    return replies


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        pytest.param("echo", b"\xc1", id="undecodable"),
        pytest.param("echo", b"\x81\xa5bogus\x01", id="unknown-field"),
        pytest.param("echo", b"\x92\x01\x02", id="not-a-map"),
        pytest.param("echo", b"\x81\xa3seq\xc3", id="wrong-type"),
        pytest.param("echo.stream", b"\x80", id="missing-field"),
        pytest.param("no.such.kind", b"\x80", id="unknown-kind"),
    ],
)
def test_a_malformed_body_gets_a_protocol_error_reply_and_the_actor_lives(
    node: Node, kind: str, body: bytes
) -> None:
    """DESIGN.md §3: every decoding failure is a ProtocolError reply, and the receiving actor stays alive."""
    replies = _send_raw(node, kind, body)
    reply = replies.get(timeout=WAIT)
    assert reply.final
    assert type(reply.error) is ProtocolError
    assert node.request("n1/echo", Ping(nonce=5), timeout=WAIT) == Pong(nonce=5, actor="n1/echo")
    assert replies.empty()


def test_a_malformed_tell_body_reports_a_protocol_error_to_the_sender(node: Node) -> None:
    errors = tell_errors(node)
    _send_raw(node, "echo", b"\xc1", flow="tell")
    error, _ = errors.get(timeout=WAIT)
    assert type(error) is ProtocolError
    assert node.request("n1/echo", Echo(seq=2), timeout=WAIT) == Echo(seq=2)


# ----------------------------------------------------------------- an actor never blocks (DESIGN.md §2)


@pytest.mark.parametrize("call", BLOCKING_CALLS)
def test_an_actor_cannot_block_on_a_reply(node: Node, call: str) -> None:
    """DESIGN.md §2: waiting for a reply on an actor thread raises BlockingCallInActor at once."""
    node.spawn(Blocker, "blocker")
    start = time.monotonic()
    reply = node.request("n1/blocker", Echo(text=call), timeout=WAIT)
    assert reply.text.startswith("caught BlockingCallInActor: "), reply.text
    assert "n1/blocker" in reply.text
    assert time.monotonic() - start < WAIT / 2
    assert node.request("n1/blocker", Ping(), timeout=WAIT) == Pong(actor="n1/blocker")


def test_the_blocking_call_list_is_complete(node: Node) -> None:
    assert tuple(_blocking_calls(node)) == BLOCKING_CALLS


def test_a_plain_thread_may_block(node: Node) -> None:
    assert current_actor() is None
    assert node.call_in_io_thread(lambda: threading.current_thread().name, timeout=WAIT) == "kbus-io-n1"


def test_an_ask_continuation_runs_on_the_actor_thread(node: Node) -> None:
    """DESIGN.md §2: a wait is a request plus a continuation; the reply arrives through the mailbox."""
    node.spawn(Relay, "relay")
    reply = node.request("n1/relay", Echo(text="hello"), timeout=WAIT)
    assert reply == Echo(text="relayed hello", data={"same_thread": True, "actor": "n1/relay"})
    assert len(node.pending) == 0


def test_an_actor_waiting_on_a_continuation_keeps_serving(node: Node) -> None:
    """MB-03's premise: while the relay's own request is in flight, its mailbox still moves; the
    continuation then gets the terminal Expired and passes it on."""
    node.spawn(Relay, "relay")
    start = time.monotonic()
    future = node.request_future("n1/relay", Hold(note="1.0"), timeout=WAIT)
    assert node.request("n1/relay", Ping(nonce=3), timeout=WAIT) == Pong(nonce=3, actor="n1/relay")
    assert not future.done()
    assert isinstance(future.exception(WAIT), Expired)
    assert time.monotonic() - start < WAIT / 2


# ---------------------------------------------------------------------------- application heartbeat


@pytest.mark.parametrize("actor_class", [BusActor, EchoActor, Recorder, Deferrer], ids=lambda c: c.__name__)
def test_every_bus_actor_answers_ping(node: Node, actor_class: type[BusActor]) -> None:
    """DESIGN.md §4: an application heartbeat passes through the actor's own mailbox."""
    node.spawn(actor_class, "target")
    assert node.request("n1/target", Ping(nonce=11), timeout=WAIT) == Pong(nonce=11, actor="n1/target")


def test_a_wedged_actor_does_not_answer_ping(node: Node) -> None:
    """DESIGN.md §4: the heartbeat catches a wedged actor thread (its ping expires)."""
    entered, release = threading.Event(), threading.Event()
    node.spawn(Wedge, "wedge", entered, release)
    try:
        node.tell("n1/wedge", Echo(text="block"))
        assert entered.wait(WAIT)
        start = time.monotonic()
        with pytest.raises(Expired):
            node.request("n1/wedge", Ping(nonce=1), timeout=0.3)
        assert time.monotonic() - start < WAIT / 2
    finally:
        release.set()
    # Unwedged, it answers again; the pong to the expired ping came late and was dropped (MB-04).
    assert node.request("n1/wedge", Ping(nonce=2), timeout=WAIT) == Pong(nonce=2, actor="n1/wedge")
    assert node.pending.late_replies == 1


# ---------------------------------------------------------------------------------- stop semantics


def test_a_deferred_request_gets_unavailable_when_its_actor_stops(node: Node) -> None:
    """MB-10: the target actor dies mid-request -> a typed ActorUnavailable (Unavailable), not a hang."""
    ref = node.spawn(EchoActor, "holder")
    future = node.request_future("n1/holder", Hold(), timeout=30)
    ref.stop(block=True, timeout=WAIT)  # the stop follows the Hold in the mailbox
    error = future.exception(WAIT)
    assert type(error) is Unavailable
    assert "stopped before answering" in error.message
    assert len(node.pending) == 0


def test_a_request_to_a_stopped_actor_is_not_delivered(node: Node) -> None:
    """Known not delivered (nothing ran): the safe-to-retry outcome, at once."""
    ref = node.spawn(EchoActor, "gone")
    ref.stop(block=True, timeout=WAIT)
    assert "gone" not in node.actors()
    with pytest.raises(NotDelivered):
        node.request("n1/gone", Echo(), timeout=30)


def test_node_stop_fails_in_flight_futures_with_unavailable(pair: tuple[Node, Node]) -> None:
    a, _b = pair
    remote = a.request_future("b/echo", Hold(), timeout=30)
    local = a.request_future("a/echo", Hold(), timeout=30)
    # Both are in flight once the remote echo holds its request (the same connection keeps order).
    assert a.request_future("b/echo", Echo(text="sync"), timeout=WAIT).result(WAIT) == Echo(text="sync")
    assert not remote.done()
    a.stop()
    assert type(remote.exception(WAIT)) is Unavailable
    assert type(local.exception(WAIT)) is Unavailable
    assert len(a.pending) == 0


def test_a_stopped_node_refuses_new_requests(make_node: Callable[..., Node]) -> None:
    node = make_node("n1")
    node.spawn(EchoActor, "echo")
    node.stop()
    assert not node.running
    future = node.request_future("n1/echo", Echo(), timeout=30)
    assert isinstance(future.exception(5), NotDelivered)


# ------------------------------------------------------------------------------------ FIFO (MB-05)


def test_ten_thousand_tells_arrive_in_order(node: Node) -> None:
    """MB-05: between one sender and one actor, messages are delivered in the order sent."""
    node.spawn(Recorder, "recorder")
    for i in range(10_000):
        node.tell("n1/recorder", Echo(seq=i))
    seen = node.request("n1/recorder", Echo(), timeout=30).data
    assert seen == list(range(10_000))


def test_tells_across_an_inproc_connection_arrive_in_order(pair: tuple[Node, Node]) -> None:
    """MB-05 across the socket path (kept below the socket high-water marks: delivery is at-most-once).

    A thread's tells and blocking requests are one ordered stream: the request sent after the tells
    finds all of them delivered."""
    a, b = pair
    b.spawn(Recorder, "recorder")
    for i in range(500):
        a.tell("b/recorder", Echo(seq=i))
    seen = a.request("b/recorder", Echo(), timeout=WAIT).data
    assert seen == list(range(500))
    assert b.stats["seq_gaps"] == 0


class StepClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_held_batch_leaves_tell_linger_after_its_own_first_tell(make_node: Callable[..., Node]) -> None:
    """MB-05 and WIRE.md 7a: what a thread holds leaves ``tell_linger`` after the first tell of that batch
    was held, not earlier. A burst fills one batch (it leaves full) and begins a second; the timer set for
    the first finds the second young, and leaves it to fill until its own deadline. Every tell arrives once,
    in order."""
    clock = StepClock()
    b = make_node("b", bind=[f"inproc://kb-{uuid.uuid4().hex}"])
    b.spawn(Recorder, "recorder")
    a = make_node("a", monotonic=clock, tell_linger=0.001)
    a.connect(Peer("b", b.endpoints[0]), wait=WAIT)

    def run_due_timers() -> None:
        a.call_in_io_thread(a.timers.run_due, timeout=WAIT)

    a.tell("b/recorder", Echo(seq=0))  # the first after a pause: at once
    clock.t += 0.0001
    for i in range(1, MAX_HELD + 1):  # held from here: the timer is set for 1000.0011
        a.tell("b/recorder", Echo(seq=i))
    clock.t += 0.0004
    a.tell("b/recorder", Echo(seq=MAX_HELD + 1))  # the first batch is full: it leaves, this one begins
    a.tell("b/recorder", Echo(seq=MAX_HELD + 2))
    assert a.stats["tell_batches_sent"] == 1
    clock.t += 0.0007  # past the first batch's deadline, not the second's (1000.0015)
    run_due_timers()
    assert a.stats["tell_batches_sent"] == 1
    a.tell("b/recorder", Echo(seq=MAX_HELD + 3))  # still held with them
    clock.t += 0.0004  # past the second batch's deadline
    run_due_timers()
    assert a.stats["tell_batches_sent"] == 2
    seen = a.request("b/recorder", Echo(), timeout=WAIT).data
    assert seen == list(range(MAX_HELD + 4))
    assert b.stats["seq_gaps"] == 0


@pytest.mark.parametrize("held", [3, MAX_HELD], ids=["some-held", "last-batch-left-full"])
def test_a_channels_timer_ends_once_its_thread_has_sent_what_it_held(
    held: int, make_node: Callable[..., Node]
) -> None:
    """A thread that held tells and then sends anything else sends them first (MB-05), and may then keep
    its channel for a whole blocking call. The timer set for what it held must end then, not try the
    channel again every few hundred microseconds until the call returns: with what was held gone, it has
    nothing to send. (``last-batch-left-full``: the burst's last batch left full, nothing is held, and the
    timer is still set.)"""
    clock = StepClock()
    b = make_node("b", bind=[f"inproc://kb-{uuid.uuid4().hex}"])
    b.spawn(Recorder, "recorder")
    a = make_node("a", monotonic=clock, tell_linger=0.001)
    a.connect(Peer("b", b.endpoints[0]), wait=WAIT)
    a.tell("b/recorder", Echo(seq=0))  # at once
    clock.t += 0.0001
    for i in range(1, held + 1):  # held; the channel's timer is set for 1000.0011
        a.tell("b/recorder", Echo(seq=i))
    assert a.request("b/recorder", Echo(), timeout=WAIT).data == list(range(held + 1))  # sent first
    channel = a._tls.lanes["b/recorder"].channel
    timers = len(a.timers)
    with channel.lock:  # as this thread holds it through a blocking call
        clock.t += 0.002
        a.call_in_io_thread(a.timers.run_due, timeout=WAIT)
        assert len(a.timers) == timers - 1  # the timer ran and did not set itself again
    assert b.stats["seq_gaps"] == 0


def test_a_threads_futures_are_their_own_ordered_stream(pair: tuple[Node, Node]) -> None:
    """MB-05 for futures: they travel through the node's I/O thread, as a sender of their own."""
    a, b = pair
    futures = [a.request_future("b/echo", Echo(seq=i), timeout=WAIT) for i in range(300)]
    assert [f.result(WAIT).seq for f in futures] == list(range(300))
    assert b.stats["seq_gaps"] == 0


# ---------------------------------------------------------------------------- two nodes over inproc


def test_requests_and_streams_cross_an_inproc_connection(pair: tuple[Node, Node]) -> None:
    a, _b = pair
    assert a.request("b/echo", Echo(text="blocking"), timeout=WAIT) == Echo(text="blocking")
    assert a.request_future("b/echo", Echo(text="future"), timeout=WAIT).result(WAIT) == Echo(text="future")
    assert [m.seq for m in a.stream("b/echo", EchoStream(count=3), timeout=WAIT)] == [0, 1, 2, 3]
    with pytest.raises(HandlerError):
        a.request("b/echo", Fail(), timeout=WAIT)
    with pytest.raises(NotDelivered):
        a.request("b/nobody", Echo(), timeout=30)


def test_a_hostile_error_reply_does_not_kill_the_io_thread(pair: tuple[Node, Node]) -> None:
    """DESIGN.md §3: an error body from a peer is hostile too. One whose fields clash with the error's
    own arguments is rebuilt as some BusError; the I/O thread that resolves it lives on."""
    a, b = pair
    b.spawn(Deferrer, "deferrer")
    future = a.request_future("b/deferrer", Hold(), timeout=WAIT)
    assert a.request_future("b/deferrer", Echo(text="count"), timeout=WAIT).result(WAIT).seq == 1
    hostile = ErrorReply(error="quota", message="m", fields={"wire_name": "x", "message": "clash"})
    header = b.header(ErrorReply.TAG, "b/deferrer", a.client_address(), "reply", corr=future.request_id)
    b.send(header, b.registry.encode(hostile))
    error = future.exception(WAIT)
    assert isinstance(error, ProtocolError | RemoteError), repr(error)
    assert a.request_future("b/echo", Echo(text="alive"), timeout=WAIT).result(WAIT) == Echo(text="alive")
    assert a.request("a/echo", Echo(text="local"), timeout=WAIT) == Echo(text="local")


def test_hostile_frames_on_the_socket_are_counted_and_dropped(pair: tuple[Node, Node]) -> None:
    """DESIGN.md §3: a frame with no trustworthy header is a counted drop; the node keeps serving."""
    _a, b = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(b.endpoints[0])
        sock.send_multipart([b"", b"\xc1", b"body"])  # undecodable header
        sock.send_multipart([b"no delimiter"])  # wrong framing
        sock.send_multipart([b"", encode_header(_raw_header("b/echo")) + b"\x00", b"\x80"])  # trailing byte
        ping = _raw_header("b/echo")
        sock.send_multipart([b"", encode_header(ping), b.registry.encode(Ping(nonce=9))])
        assert sock.poll(int(WAIT * 1000)), "no reply to the valid ping after the hostile frames"
        parts = sock.recv_multipart()
        reply = decode_header(parts[1])
        assert reply.corr == ping.id
        assert b.registry.decode(reply.kind, parts[2]) == Pong(nonce=9, actor="b/echo")
        assert b.stats["malformed"] == 3
    finally:
        sock.close(0)


def test_a_directory_query_of_many_unknown_fields_does_not_stop_the_io_thread(
    pair: tuple[Node, Node],
) -> None:
    """Issue 18 item 1, on the I/O thread: its error reply used to outgrow a frame, and the exception
    raised while encoding it ended the thread (and with it the node)."""
    _a, b = pair
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    try:
        sock.connect(b.endpoints[0])
        hostile = Header(
            id=new_id(), kind="sys.resolve", src="raw/client", dst="b/node", flow="ask", ts=time.time()
        )
        body = msgpack.packb({"actor": "echo", **{("\x01" * 8) + str(i): 0 for i in range(60_000)}})
        sock.send_multipart([b"", encode_header(hostile), body])
        assert sock.poll(int(WAIT * 1000)), "no answer to the hostile query"
        parts = sock.recv_multipart()
        error = b.registry.decode(decode_header(parts[1]).kind, parts[2])
        assert isinstance(error, ErrorReply) and "more" in error.message
        ping = _raw_header("b/echo")
        sock.send_multipart([b"", encode_header(ping), b.registry.encode(Ping(nonce=3))])
        assert sock.poll(int(WAIT * 1000)), "the node stopped answering after the hostile query"
        parts = sock.recv_multipart()
        assert b.registry.decode(decode_header(parts[1]).kind, parts[2]) == Pong(nonce=3, actor="b/echo")
    finally:
        sock.close(0)


def _raw_header(dst: str) -> Header:
    return Header(id=new_id(), kind=Ping.TAG, src="raw/client", dst=dst, flow="ask", ts=time.time())


# --------------------------------------------------------------------------------------- lint (MB-01)

LOCK_NAMES = frozenset({"Lock", "RLock", "Condition", "Semaphore", "BoundedSemaphore", "allocate_lock"})
LOCK_MODULES = frozenset({"threading", "_thread", "multiprocessing", "asyncio"})


def lock_uses(source: str, filename: str = "<src>") -> list[str]:
    """Every place ``source`` names a lock type: ``threading.Lock()``, ``from threading import RLock``..."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Attribute) and node.attr in LOCK_NAMES:
            found.append(f"{filename}:{node.lineno} {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").partition(".")[0] in LOCK_MODULES:
            names = [a.name for a in node.names if a.name in LOCK_NAMES]
            found += [f"{filename}:{node.lineno} imports {name}" for name in names]
    return found


def test_the_lock_lint_sees_every_form() -> None:
    source = (
        "import threading\nfrom threading import RLock as R\nimport _thread\n"
        "a = threading.Lock()\nb = threading.Condition()\nc = _thread.allocate_lock()\n"
    )
    assert len(lock_uses(source)) == 4
    assert lock_uses("import threading\nthreading.Event()\nqueue = 1\n") == []


def test_actors_contain_no_locks() -> None:
    """MB-01: the mailbox is the only serialisation point; actors contain no locks.

    Provider clients (actors/router/providers/) are exempt: they are not actors but the blocking code the
    Router runs on worker threads, where a lock around a non-thread-safe library (llama.cpp) is right.
    So is the codex facade's lock that makes one private node per process: facades run on the caller's
    threads, not in an actor.
    """
    exempt = {"codex/facade.py"}
    files = sorted(
        p
        for p in ACTORS_DIR.rglob("*.py")
        if "providers" not in p.relative_to(ACTORS_DIR).parts
        and p.relative_to(ACTORS_DIR).as_posix() not in exempt
    )
    assert files, ACTORS_DIR
    found = [use for path in files for use in lock_uses(path.read_text(encoding="utf-8"), path.name)]
    assert not found, "\n".join(found)


def test_a_request_not_yet_sent_survives_a_disconnect_of_its_peer() -> None:
    """Only requests that went out can end as Unavailable (outcome unknown); one still queued for the
    I/O thread gets its own outcome from the send (delivered, or NotDelivered)."""
    from transport.pending import PendingRequest, PendingTable

    table = PendingTable(lambda: 0.0)
    outcomes: list[Reply] = []
    table.add(PendingRequest(b"s" * 16, "n2", 10.0, outcomes.append))
    table.add(PendingRequest(b"q" * 16, "n2", 10.0, outcomes.append))
    table.mark_sent(b"s" * 16)
    assert table.fail_peer("n2", lambda e: Unavailable("gone")) == 1
    assert [type(r.error) for r in outcomes] == [Unavailable]
    assert b"q" * 16 in table


def test_a_direct_actor_that_stops_answers_its_deferred_requests_over_its_own_socket(
    make_node: Callable[..., Node], ipc_dir: Path
) -> None:
    """A held request that came in over a direct actor's own socket ends Unavailable when the actor stops
    (outcome unknown), well before its deadline. The actor answers it before closing that socket, so the
    caller usually reads why ('stopped before answering'); when the close overtakes the answer on a busy
    machine, the caller learns it from the disconnect instead: the same typed outcome either way."""
    server = make_node("srv", bind=[f"ipc://{ipc_dir}/srv.sock"])
    ref = server.spawn(EchoActor, "echo")
    client = make_node("cli", peers=[Peer("srv", f"ipc://{ipc_dir}/srv.sock")])
    client.request("srv/echo", Echo(), timeout=WAIT)  # resolves and uses the direct socket
    assert server.direct_endpoints("echo")
    outcome: queue.Queue[BaseException | None] = queue.Queue()

    def hold() -> None:
        try:
            client.request("srv/echo", Hold(), timeout=WAIT)
            outcome.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.put(exc)

    threading.Thread(target=hold, daemon=True).start()
    # Each look is a round trip through the actor's mailbox (no sleeping), bounded by WAIT.
    deadline = time.monotonic() + WAIT
    while ref.proxy().handled.get(timeout=WAIT) < 2:
        assert time.monotonic() < deadline, "the Hold never reached the echo actor"
    ref.stop(timeout=WAIT)
    error = outcome.get(timeout=WAIT)
    assert isinstance(error, Unavailable), error
    assert "stopped before answering" in str(error) or "disconnected" in str(error)
