"""In-process deliveries without a codec round trip (transport/node.py ``local_message``).

A message that is immutable all the way down goes to an actor of the same node as the object itself; one
whose only mutable parts are JSON values (lists, string-keyed dicts) goes as a copy of those values taken at
the send (``Registry.local_copy``), everything else in it shared; one that might encode past the body bound,
one holding anything else mutable, and every message while the node captures, go as their encoded body. A
reply its sender marks ``moved`` (it has let go of the mutable values in it) goes as the object itself.
Isolation is what every way must keep: what arrived never changes under the receiver, whatever the sender
does afterwards, and the other way round.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.app.echo import EchoActor
from actors.base import BusActor, Context
from transport import Node
from transport.capture import CaptureWriter, read_log
from transport.errors import ProtocolError
from transport.messages import Echo

WAIT = 10.0


class Keep(BusActor):
    """Puts every message it is told into a queue the test reads (the object as it arrived)."""

    def __init__(self, node: Node, address: str, out: queue.SimpleQueue[Any]) -> None:
        super().__init__(node, address)
        self.out = out

    def handle(self, message: Any, ctx: Context) -> Any:
        self.out.put(message)
        return None


@pytest.fixture
def node(make_node: Callable[..., Node]) -> Node:
    return make_node("n1")


def test_mb05_immutable_messages_arrive_as_sent_unencoded_and_in_order(node: Node) -> None:
    """MB-05 over the handover: tells from one thread arrive in the order sent, each the very object."""
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    node.spawn(Keep, "keep", out)
    sent = [Echo(payload=b"x" * 10, text=f"t{i}", seq=i) for i in range(50)]
    for message in sent:
        node.tell("n1/keep", message)
    got = [out.get(timeout=WAIT) for _ in sent]
    assert [m.seq for m in got] == list(range(50))
    assert all(a is b for a, b in zip(got, sent, strict=True))  # no encode, no decode


def test_a_message_holding_a_dict_is_copied_so_the_sender_cannot_change_what_arrived(node: Node) -> None:
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    node.spawn(Keep, "keep", out)
    data: dict[str, Any] = {"k": [1, 2]}
    payload = b"p" * 100
    node.tell("n1/keep", Echo(data=data, payload=payload))
    data["k"].append(3)
    got = out.get(timeout=WAIT)
    assert got.data == {"k": [1, 2]}
    assert got.data is not data and got.data["k"] is not data["k"]
    assert got.payload is payload  # the immutable rest is shared: a copy, not an encode and a decode


def test_what_the_receiver_does_to_a_copied_value_never_reaches_the_sender(node: Node) -> None:
    out: queue.SimpleQueue[Any] = queue.SimpleQueue()
    node.spawn(Keep, "keep", out)
    sent = Echo(data={"k": [1, {"deep": "x"}]})
    node.tell("n1/keep", sent)
    got = out.get(timeout=WAIT)
    got.data["k"][1]["deep"] = "changed"
    got.data["new"] = 1
    assert sent.data == {"k": [1, {"deep": "x"}]}


def test_local_copy_shares_immutable_parts_and_copies_only_json_values() -> None:
    """One walk over a nested message: a batch of router events, one holding a tool call's arguments."""
    from actors.app.wiring import registry
    from actors.router.messages import TurnEventBatch, TurnToolCall, TurnUsage
    from actors.types import TokenUsage

    reg = registry()
    usage = TurnUsage(usage=TokenUsage(input_tokens=3))
    call = TurnToolCall(call_id="c1", name="get_weather", arguments={"city": "Paris", "days": [1, 2]})
    batch = TurnEventBatch(events=(usage, call))
    copy = reg.local_copy(batch)
    assert copy == batch and copy is not batch
    assert copy.events[0] is usage  # nothing mutable in it: shared
    assert copy.events[1] is not call and copy.events[1].arguments is not call.arguments
    assert copy.events[1].arguments["days"] is not call.arguments["days"]
    assert reg.local_copy(usage) is usage  # immutable all the way down: the object itself


def test_a_value_the_wire_cannot_carry_is_not_copied_but_encoded() -> None:
    """No copy where the codec would refuse or change the message: it is encoded and fails (or changes)
    as it would between processes. Inside a JSON value only JSON is copied."""
    from transport.codec import Registry
    from transport.messages import SYSTEM_MESSAGES

    reg = Registry(SYSTEM_MESSAGES, max_body_bytes=1000)
    assert reg.local_copy(Echo(data={1: "an integer key"})) is None
    assert reg.local_copy(Echo(data={"s": {1, 2}})) is None  # a set: the wire makes it a list
    assert reg.local_copy(Echo(data={"n": 1 << 64})) is None  # past msgpack's 64 bits
    assert reg.local_copy(Echo(data={"t": (1, 2)})) is None  # not JSON: the wire makes it a list
    assert reg.local_copy(Echo(data=[b"raw"])) is None  # bytes are not JSON either
    assert reg.local_copy(Echo(data={"m": Echo()})) is None  # a message inside a JSON value
    assert reg.local_copy(Echo(seq=1 << 64)) is None
    assert reg.local_copy(Echo(data={"big": "x" * 300})) is None  # may pass the body bound
    assert reg.local_copy(Echo(data={"small": "x" * 100})) is not None


def test_local_copy_counts_each_class_as_shareable_does_at_every_size_near_the_bound() -> None:
    """``local_copy`` walks a message through a step compiled for its class; for a message with nothing to
    copy it must say yes exactly where ``shareable`` (the plain walk) does, field kinds and nesting alike."""
    import uuid

    from actors.app.wiring import registry
    from actors.router.messages import NextTurnEvent, TurnEventBatch, TurnInput, TurnTextDelta
    from actors.types import ContextItem, ModelContext

    for limit in (600, 1000, 1500):
        reg = registry(max_body_bytes=limit)
        for size in range(400):  # every size: a count off by a few bytes shows at the threshold
            text = "y" * size
            items = (ContextItem(role="user", text=text, call_id=None),) * 2
            context = ModelContext(
                model="m", reasoning_effort=None, instructions=text, items=items, tools=(text, "k")
            )
            for message in (
                Echo(text=text, seq=size, payload=b"p" * size),
                Echo(seq=-(1 << 63), text=text),
                TurnEventBatch(events=(TurnInput(context=context), TurnTextDelta(text=text))),
            ):
                expected = reg.shareable(message)
                assert (reg.local_copy(message) is message) is expected, (limit, size, type(message))
    reg = registry()
    assert reg.local_copy(Echo(seq=(1 << 64) - 1)) is not None and reg.local_copy(Echo(seq=1 << 64)) is None
    assert reg.local_copy(Echo(seq=-(1 << 63) - 1)) is None  # out of msgpack's range either way
    read = NextTurnEvent(operation_id=uuid.uuid4())
    assert reg.local_copy(read) is read  # a UUID field is shared as it is


def test_a_reply_holding_a_list_is_a_copy_and_an_immutable_reply_is_the_object(node: Node) -> None:
    node.spawn(EchoActor, "echo")
    message = Echo(data=[1, 2])
    reply = node.request("n1/echo", message, timeout=WAIT)
    assert reply == message and reply.data is not message.data
    plain = Echo(text="same")
    assert node.request("n1/echo", plain, timeout=WAIT) is plain


class MovingEcho(BusActor):
    """Answers ``Echo(seq=n)`` with a new ``Echo`` holding a list, ``moved`` when the request's text says
    so; keeps each answer (for the test only: a mover lets go of what it sends)."""

    def __init__(self, node: Node, address: str) -> None:
        super().__init__(node, address)
        self.sent: list[Echo] = []

    def handle(self, message: Any, ctx: Context) -> Any:
        answer = Echo(data=[message.seq, {"k": "v"}], seq=message.seq)
        self.sent.append(answer)
        ctx.reply(answer, moved=message.text == "moved")
        return None


def test_a_moved_reply_is_handed_over_as_it_is_and_a_plain_one_as_a_copy(node: Node) -> None:
    """``Context.reply(moved=True)``: the replier has let go of the answer's JSON values, so a requester
    in this process becomes their holder with no copy; without it, the same answer arrives copied."""
    mover = node.spawn(MovingEcho, "mover").proxy()
    moved = node.request("n1/mover", Echo(seq=1, text="moved"), timeout=WAIT)
    plain = node.request("n1/mover", Echo(seq=2), timeout=WAIT)
    sent = mover.sent.get(timeout=WAIT)
    assert moved is sent[0]
    assert plain == sent[1] and plain is not sent[1] and plain.data[1] is not sent[1].data[1]


def test_a_moved_reply_still_travels_as_bytes_while_the_node_captures(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    """Capture records every local message as its bytes: a moved reply too, so a replay sees it."""
    capture = CaptureWriter(tmp_path / "n4.buslog", node="n4", schema="test")
    node = make_node("n4", capture=capture)
    mover = node.spawn(MovingEcho, "mover").proxy()
    reply = node.request("n4/mover", Echo(seq=7, text="moved"), timeout=WAIT)
    (sent,) = mover.sent.get(timeout=WAIT)
    assert reply == sent and reply is not sent
    node.stop()
    sends = [r for r in read_log(tmp_path / "n4.buslog").records if r.at == "send"]
    assert len(sends) == 2 and all(r.frames[1] for r in sends)  # the request and the moved reply, as bytes


def test_a_message_that_might_pass_the_body_bound_is_encoded_and_refused_as_remotely(
    make_node: Callable[..., Node],
) -> None:
    from transport.codec import Registry
    from transport.messages import SYSTEM_MESSAGES

    small = make_node("n2", registry=Registry(SYSTEM_MESSAGES, max_body_bytes=1000))
    small.spawn(EchoActor, "echo")
    assert small.request("n2/echo", Echo(text="x" * 100), timeout=WAIT).text == "x" * 100
    with pytest.raises(ProtocolError, match="exceeds"):
        small.request("n2/echo", Echo(text="x" * 1200), timeout=WAIT)


def test_with_capture_on_every_local_message_is_recorded_as_its_bytes(
    make_node: Callable[..., Node], tmp_path: Path
) -> None:
    capture = CaptureWriter(tmp_path / "n3.buslog", node="n3", schema="test")
    node = make_node("n3", capture=capture)
    node.spawn(EchoActor, "echo")
    for i in range(3):
        node.request("n3/echo", Echo(seq=i), timeout=WAIT)
    node.stop()
    records = [r for r in read_log(tmp_path / "n3.buslog").records if r.at in ("send", "deliver")]
    # Per request: its send, its delivery to the echo actor, the reply's send (a plain thread's future
    # records no delivery of its own).
    assert [r.at for r in records] == ["send", "deliver", "send"] * 3
    assert all(len(r.frames) == 2 and r.frames[1] for r in records)


def _json_bound(value: Any) -> int:
    """The body bound's arithmetic for a JSON value, written plainly: 16 bytes a value, 16 more and 4 a
    character for each map key, 4 bytes a character of a string."""
    if isinstance(value, str):
        return 16 + 4 * len(value)
    if isinstance(value, dict):
        return 16 + sum(16 + 4 * len(key) + _json_bound(item) for key, item in value.items())
    if isinstance(value, list):
        return 16 + sum(_json_bound(item) for item in value)
    return 16


def test_local_copy_bounds_a_json_value_by_the_walks_arithmetic_to_the_byte() -> None:
    """Where a copied JSON value takes the message past the body bound, it is encoded (and fails as it
    would remotely): the copy's count of strings, keys, lists and maps, at every nesting, is the plain
    arithmetic's to the byte. A payload's bytes count one each, so the largest payload still handed over
    beside a value shows what the value was counted."""
    from transport.codec import Registry
    from transport.messages import SYSTEM_MESSAGES

    reg = Registry(SYSTEM_MESSAGES, max_body_bytes=3000)

    def largest_payload(data: Any) -> int:
        fits = [p for p in range(3000) if reg.local_copy(Echo(payload=b"p" * p, data=data)) is not None]
        assert fits == list(range(len(fits)))  # no gaps: one threshold
        return len(fits) - 1

    alone = largest_payload(None)  # data None counts 16, as any scalar
    values: list[Any] = [
        "s" * 9,
        {"key": "v" * 5},
        {"k": "a", "kk": "bb", "n": 1, "f": 1.5, "t": True, "z": None},
        ["x" * 3, "y", 7, None],
        {"args": {"city": "Paris", "days": [1, 2, "three"]}, "units": "metric"},
        [{"a": ["b", {"c": "d" * 11}]}, []],
        {},
    ]
    for value in values:
        assert largest_payload(value) == alone - (_json_bound(value) - 16), value
