"""Tests for the I/O thread's hand-over of a burst as one mailbox item (transport.envelope.InboundBatch).

A batch must change nothing an actor or a sender can see: the items are handled in arrival order, each
with its own error path, and a batch that finds its actor stopped fails every message in it. Covers
RULES.md MB-05 (per-sender FIFO) on the batched path and DESIGN.md §2 (bad input never kills an actor).
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq

from actors.base import BusActor, Context
from transport import Node
from transport.codec import BATCH_TAG, decode_header, encode_batch_body, encode_header, split_batch
from transport.envelope import Header, Inbound, InboundBatch, TellBatch, new_id
from transport.errors import BusError, HandlerError, NotDelivered, ProtocolError
from transport.messages import Echo, ErrorReply, Hello, Ping

WAIT = 10.0


class BatchRecorder(BusActor):
    """Records the ``seq`` of every Echo told to it and counts the batches its mailbox handed it."""

    def __init__(self, node: Node, address: str) -> None:
        super().__init__(node, address)
        self.seen: list[int] = []
        self.batches = 0

    def _handle_receive(self, message: Any) -> Any:
        if type(message) is InboundBatch:
            self.batches += 1
        return super()._handle_receive(message)

    def handle(self, message: Any, ctx: Context) -> Any:
        if ctx.wants_reply:
            return Echo(seq=self.batches, data=list(self.seen))
        if message.text == "raise":
            raise RuntimeError("a bug in the handler")
        self.seen.append(message.seq)
        return None

    def on_tell_error(self, error: BusError, tell_id: bytes | None) -> None:
        self.seen.append(-1)  # where in the order the tell error came


def _tell(node: Node, dst: str, seq: int, body: bytes, src: str = "n1/client.raw") -> Inbound:
    header = Header(id=new_id(), kind="echo", src=src, dst=dst, flow="tell", ts=time.time(), seq=seq)
    return Inbound(header, body, None)


def _errors(node: Node) -> queue.Queue[tuple[BusError, bytes | None]]:
    errors: queue.Queue[tuple[BusError, bytes | None]] = queue.Queue()
    node.on_tell_error(lambda error, tell_id: errors.put((error, tell_id)))
    return errors


def test_a_batch_is_handled_in_order_and_a_bad_item_fails_alone(make_node: Callable[..., Node]) -> None:
    """MB-05 and DESIGN.md §2: a malformed body inside a batch gets its own ProtocolError tell error;
    the items before and after it are handled, in order, and the actor keeps serving."""
    node = make_node("n1")
    ref = node.spawn(BatchRecorder, "rec")
    errors = _errors(node)
    items = [_tell(node, "n1/rec", i + 1, node.registry.encode(Echo(seq=i))) for i in range(5)]
    bad = _tell(node, "n1/rec", 6, b"\xc1")
    ref.tell(InboundBatch([*items[:3], bad, *items[3:]]))
    reply = node.request("n1/rec", Echo(), timeout=WAIT)
    assert reply.data == [0, 1, 2, 3, 4]
    assert reply.seq == 1
    error, tell_id = errors.get(timeout=WAIT)
    assert type(error) is ProtocolError
    assert tell_id == bad.header.id
    assert errors.empty()


def test_a_batch_for_a_stopped_actor_fails_every_message(make_node: Callable[..., Node]) -> None:
    """Every tell in a batch that finds its actor gone is reported NotDelivered to its sender, and the
    actor's name is released."""
    node = make_node("n1")
    ref = node.spawn(BatchRecorder, "rec")
    ref.stop()
    errors = _errors(node)
    batch = [_tell(node, "n1/rec", i + 1, node.registry.encode(Echo(seq=i))) for i in range(3)]
    node.call_in_io_thread(lambda: node.deliver_batch("rec", ref, batch), timeout=WAIT)
    failed = [errors.get(timeout=WAIT) for _ in batch]
    assert all(type(error) is NotDelivered for error, _ in failed)
    assert [tell_id for _, tell_id in failed] == [inbound.header.id for inbound in batch]
    assert node.lookup("rec") is None


def _frame_tells(
    node: Node, dst: str, first_seq: int, bodies: list[bytes], kinds: list[str] | None = None
) -> TellBatch:
    """The ``TellBatch`` of one batch frame of ``bodies`` (each an ``echo`` unless ``kinds`` says), as the
    I/O thread makes it."""
    items: list[Any] = []
    for body, kind in zip(bodies, kinds or ["echo"] * len(bodies), strict=True):
        items += [new_id(), kind, body]
    batch = Header(
        id=new_id(), kind=BATCH_TAG, src="n1/client.raw", dst=dst, flow="tell", ts=time.time(), seq=first_seq
    )
    return split_batch(batch, encode_batch_body(items))


def test_frame_tells_and_single_messages_in_one_item_keep_arrival_order(
    make_node: Callable[..., Node],
) -> None:
    """MB-05 and DESIGN.md §2 where a mailbox item mixes lone messages and a batch frame's tells (each
    tell's Inbound made as the actor takes it): all are handled in arrival order, and a malformed body in
    the frame fails alone, reported by its own id."""
    node = make_node("n1")
    ref = node.spawn(BatchRecorder, "rec")
    errors = _errors(node)
    encode = node.registry.encode
    first = _tell(node, "n1/rec", 1, encode(Echo(seq=0)))
    frame = _frame_tells(node, "n1/rec", 2, [encode(Echo(seq=1)), b"\xc1", encode(Echo(seq=2))])
    last = _tell(node, "n1/rec", 5, encode(Echo(seq=3)))
    ref.tell(InboundBatch([first, frame, last]))
    ref.tell(_frame_tells(node, "n1/rec", 6, [encode(Echo(seq=4)), encode(Echo(seq=5))]))  # alone
    reply = node.request("n1/rec", Echo(), timeout=WAIT)
    assert reply.data == [0, 1, 2, 3, 4, 5]
    error, tell_id = errors.get(timeout=WAIT)
    assert type(error) is ProtocolError
    assert tell_id == frame.ids[1]
    assert errors.empty()


def test_frame_tells_the_actor_answers_itself_or_its_handler_raises_on_take_their_own_way(
    make_node: Callable[..., Node],
) -> None:
    """DESIGN.md §2 on a batch frame's tells: a ping told is not handed to the handler (as a lone one is
    not), a tell error goes to ``on_tell_error`` in its place in the order, and a handler that raises on
    one tell reports a ``HandlerError`` for that tell's id alone; the tells around them are handled."""
    node = make_node("n1")
    ref = node.spawn(BatchRecorder, "rec")
    errors = _errors(node)
    registry = node.registry
    bodies = [
        registry.encode(Echo(seq=1)),
        registry.encode(Ping(nonce=7)),
        registry.encode_error(NotDelivered("gone")),
        registry.encode(Echo(seq=2, text="raise")),
        registry.encode(Echo(seq=3)),
    ]
    kinds = ["echo", Ping.TAG, ErrorReply.TAG, "echo", "echo"]
    frame = _frame_tells(node, "n1/rec", 1, bodies, kinds)
    ref.tell(frame)
    reply = node.request("n1/rec", Echo(), timeout=WAIT)
    assert reply.data == [1, -1, 3]
    error, tell_id = errors.get(timeout=WAIT)
    assert type(error) is HandlerError
    assert tell_id == frame.ids[3]
    assert errors.empty()


def test_frame_tells_for_a_stopped_actor_each_fail_by_their_own_id(make_node: Callable[..., Node]) -> None:
    """A batch that finds its actor gone reports every tell of a frame in it NotDelivered, each by its own
    id (not the frame's), after the lone message before it."""
    node = make_node("n1")
    ref = node.spawn(BatchRecorder, "rec")
    ref.stop()
    errors = _errors(node)
    lone = _tell(node, "n1/rec", 1, node.registry.encode(Echo(seq=0)))
    frame = _frame_tells(node, "n1/rec", 2, [node.registry.encode(Echo(seq=i)) for i in range(3)])
    node.call_in_io_thread(lambda: node.deliver_batch("rec", ref, [lone, frame]), timeout=WAIT)
    failed = [errors.get(timeout=WAIT) for _ in range(4)]
    assert all(type(error) is NotDelivered for error, _ in failed)
    assert [tell_id for _, tell_id in failed] == [lone.header.id, *frame.ids]


def test_a_burst_read_in_one_wake_up_arrives_as_batches_in_order(make_node: Callable[..., Node]) -> None:
    """MB-05 over the socket path: 300 tells queued while the I/O thread is busy are read in one go and
    handed over in batches; every one arrives, in order, and the malformed one fails alone."""
    node = make_node("n1", bind=[f"inproc://kb-{uuid.uuid4().hex}"])
    node.spawn(BatchRecorder, "rec")
    entered, gate = threading.Event(), threading.Event()

    def hold_io_thread() -> None:
        entered.set()
        gate.wait(WAIT)

    holder = threading.Thread(target=lambda: node.call_in_io_thread(hold_io_thread, timeout=WAIT))
    holder.start()
    assert entered.wait(WAIT)
    raw = node.context.socket(zmq.DEALER)
    answers: list[tuple[Header, Any]] = []
    try:
        raw.linger = 0
        raw.connect(node.endpoints[0])
        # Introduce "x" as a node does, so that errors for its tells have a way back over this connection.
        hello = Header(id=new_id(), kind=Hello.TAG, src="x/node", dst="n1/node", flow="tell", ts=time.time())
        raw.send_multipart([b"", encode_header(hello), node.registry.encode(Hello(node="x"))])
        bad_id = b""
        for i in range(300):
            item = _tell(
                node,
                "n1/rec",
                i + 1,
                b"\xc1" if i == 150 else node.registry.encode(Echo(seq=i)),
                src="x/raw",
            )
            if i == 150:
                bad_id = item.header.id
            raw.send_multipart([b"", encode_header(item.header), item.body])
        # The question goes the same way, behind the tells: its answer sees all of them.
        ask = Header(id=new_id(), kind="echo", src="x/raw", dst="n1/rec", flow="ask", ts=time.time(), seq=301)
        raw.send_multipart([b"", encode_header(ask), node.registry.encode(Echo())])
        gate.set()
        holder.join(WAIT)
        while not answers or answers[-1][0].flow != "reply":
            assert raw.poll(int(WAIT * 1000))
            _, head, body = raw.recv_multipart()
            header = decode_header(head)
            answers.append((header, node.registry.decode(header.kind, body)))
    finally:
        gate.set()
        raw.close(0)
    (error_header, error), (_, reply) = answers
    assert error_header.flow == "tell" and error_header.corr == bad_id
    assert error.error == ProtocolError.WIRE
    assert reply.data == [i for i in range(300) if i != 150]
    assert reply.seq >= 1  # at least one burst went in as a batch
    assert node.stats["seq_gaps"] == 0
