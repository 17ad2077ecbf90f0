"""A burst of tells coalesced into ``sys.batch`` frames (transport/WIRE.md 7a), between real processes.

A plain thread's tells that follow each other closely leave as one frame; the receiving node (its I/O
thread, or a direct actor's own socket) splits it and hands the burst to the actor as one mailbox item.
None of that may show: every tell arrives once, in the order sent, with its own ``seq`` (MB-05); capture
records each tell on both sides; a malformed or oversized batch is refused with a typed error and the
actor lives on; a burst cut by a full queue loses nothing unreported (exactly the tells that could not
leave are reported ``NotDelivered``, by id).

The server is ``tests/peers/bus_peer.py`` in its own process: ``rec`` is a direct actor (its own socket),
``nrec`` is reached through its node's I/O thread only.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from conftest import PeerProcess

from transport import BusError, Node, NotDelivered, Peer, Security
from transport.capture import CaptureWriter, read_log
from transport.codec import BATCH_TAG, MAX_BATCH_ITEMS, Registry, decode_header, encode_header
from transport.envelope import Header, new_id
from transport.messages import SYSTEM_MESSAGES, Echo, ErrorReply, Hello, NodeStats, Resolve, StatsQuery
from transport.sockets import SocketOptions

pytestmark = pytest.mark.integration

WAIT = 20.0
REGISTRY = Registry(SYSTEM_MESSAGES)


def _server(spawn_peer: Callable[..., PeerProcess], ipc_dir: Path, *args: str) -> tuple[PeerProcess, Peer]:
    peer = spawn_peer(
        "--name",
        "srv",
        "--bind",
        f"ipc://{ipc_dir}/srv.sock",
        "--recorder",
        "rec",
        "--node-recorder",
        "nrec",
        *args,
    )
    return peer, Peer("srv", peer.endpoint)


def _client(make_node: Callable[..., Node], link: Peer, **kwargs: Any) -> Node:
    node = make_node("cli", security=Security(), **kwargs)
    node.connect(link, wait=WAIT)
    return node


def _dump(node: Node, actor: str) -> list[int]:
    reply = node.request(f"srv/{actor}", Echo(text="dump"), timeout=WAIT)
    return list(reply.data)


def _server_counters(node: Node) -> dict[str, int]:
    stats = node.request("srv/node", StatsQuery(), timeout=WAIT)
    assert isinstance(stats, NodeStats)
    return dict(stats.counters)


@pytest.mark.parametrize("actor", ["rec", "nrec"])
def test_a_burst_arrives_whole_in_order_with_its_seq_mb05(
    actor: str, make_node: Callable[..., Node], spawn_peer: Callable[..., PeerProcess], ipc_dir: Path
) -> None:
    """MB-05: 3000 tells from one thread, most of them coalesced, arrive all and in the order sent,
    and the receiving node counts no sequence gap (each tell kept its own seq)."""
    _, link = _server(spawn_peer, ipc_dir)
    client = _client(make_node, link)
    errors: list[BusError] = []
    client.on_tell_error(lambda error, _id: errors.append(error))
    for i in range(3000):
        client.tell(f"srv/{actor}", Echo(seq=i))
    assert _dump(client, actor) == list(range(3000))
    assert errors == []
    assert client.stats["tell_batches_sent"] > 0  # the burst did go as batches
    counters = _server_counters(client)
    assert counters["tell_batches_received"] == client.stats["tell_batches_sent"]
    assert counters["seq_gaps"] == 0
    assert counters.get("malformed_batches", 0) == 0


def test_a_burst_of_large_tells_leaves_in_batches_within_the_body_limit_mb05(
    make_node: Callable[..., Node], spawn_peer: Callable[..., PeerProcess], ipc_dir: Path
) -> None:
    """MB-05 and the limits: 40 tells of 60,000 bytes each (2.4 MB, far past one body's 1 MiB limit) from
    one thread: the sender cuts the burst into batches by their bytes, not only by their count, so every
    batch is taken, and all 40 arrive in order."""
    _, link = _server(spawn_peer, ipc_dir)
    # A linger longer than the test: no batch leaves on the timer, and no tell after a pause (a loaded
    # machine) leaves alone, so only the byte bound (and the dump's request) cuts the burst.
    client = _client(make_node, link, tell_linger=60.0)
    errors: list[BusError] = []
    client.on_tell_error(lambda error, _id: errors.append(error))
    payload = b"x" * 60_000
    for i in range(40):
        client.tell("srv/rec", Echo(payload=payload, seq=i))
    assert _dump(client, "rec") == list(range(40))
    assert errors == []
    # Half the body limit per batch: the 39 held after the first (2.3 MB) cannot leave in fewer than five.
    assert client.stats["tell_batches_sent"] >= 5
    counters = _server_counters(client)
    assert counters["tell_batches_received"] == client.stats["tell_batches_sent"]
    assert counters.get("malformed_batches", 0) == 0


@pytest.mark.parametrize("actor", ["rec", "nrec"])
def test_interleaved_senders_each_keep_their_order_mb05(
    actor: str, make_node: Callable[..., Node], spawn_peer: Callable[..., PeerProcess], ipc_dir: Path
) -> None:
    """MB-05 per sender: four threads tell the same actor at once; each one's tells arrive complete and
    in its own order (batches of different senders interleave, never mix), and no seq gap is counted."""
    _, link = _server(spawn_peer, ipc_dir)
    client = _client(make_node, link)
    per_thread = 1500
    start = threading.Barrier(4)

    def sender(k: int) -> None:
        start.wait(WAIT)
        for i in range(per_thread):
            client.tell(f"srv/{actor}", Echo(seq=k * 100_000 + i))

    threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
        assert not thread.is_alive()
    # Each sender's tells leave before its thread ends? Not necessarily: held ones leave on the timer.
    # The count request waits until all 6000 were recorded (bounded by WAIT).
    reply = client.request(f"srv/{actor}", Echo(text="await", seq=4 * per_thread), timeout=WAIT)
    assert reply.seq == 4 * per_thread
    seen = _dump(client, actor)
    for k in range(4):
        mine = [s - k * 100_000 for s in seen if s // 100_000 == k]
        assert mine == list(range(per_thread))
    assert client.stats["tell_batches_sent"] > 0
    assert _server_counters(client)["seq_gaps"] == 0


def test_a_lone_tell_held_by_a_burst_leaves_on_its_own(
    make_node: Callable[..., Node], spawn_peer: Callable[..., PeerProcess], ipc_dir: Path
) -> None:
    """The tail of a burst is never stranded: nothing else is sent by the thread afterwards, and the
    held tells still arrive (the node's I/O thread sends them ``tell_linger`` later)."""
    _, link = _server(spawn_peer, ipc_dir)
    client = _client(make_node, link)
    done = threading.Event()

    def burst() -> None:
        for i in range(5):
            client.tell("srv/nrec", Echo(seq=i))
        done.set()

    thread = threading.Thread(target=burst)
    thread.start()
    thread.join(WAIT)
    assert done.is_set()
    # Asked from another thread, whose own send flushes nothing of the first one's.
    reply = client.request("srv/nrec", Echo(text="await", seq=5), timeout=WAIT)
    assert reply.seq == 5
    assert _dump(client, "nrec") == list(range(5))


def test_capture_records_every_tell_of_a_batch_on_both_sides(
    make_node: Callable[..., Node], spawn_peer: Callable[..., PeerProcess], ipc_dir: Path, tmp_path: Path
) -> None:
    """MB-07: capture sees each tell of a coalesced burst as its own message, on the sending node (a
    ``send`` record) and on the receiving one (a ``deliver`` record), with the same header bytes."""
    server_log = tmp_path / "srv.buslog"
    client_log = tmp_path / "cli.buslog"
    _, link = _server(spawn_peer, ipc_dir, "--capture", str(server_log))
    client = _client(
        make_node, link, capture=CaptureWriter(client_log, node="cli", schema=REGISTRY.schema_hash())
    )
    ids = [client.tell("srv/nrec", Echo(seq=i)) for i in range(400)]
    assert _dump(client, "nrec") == list(range(400))
    assert client.stats["tell_batches_sent"] > 0
    client.stop()

    def tells(path: Path, at: str) -> list[tuple[bytes, bytes]]:
        out = []
        for record in read_log(path).records:
            if record.at == at and decode_header(record.frames[0]).kind == Echo.TAG:
                header = decode_header(record.frames[0])
                if header.flow == "tell":
                    out.append((record.frames[0], record.frames[1]))
        return out

    sent = tells(client_log, "send")
    assert [decode_header(h).id for h, _ in sent] == ids
    assert [decode_header(h).seq for h, _ in sent] == list(range(1, 401))
    assert [REGISTRY.decode(Echo.TAG, b).seq for _, b in sent] == list(range(400))
    # The server's capture is flushed by its own writer thread: wait (bounded) for all 400 records.
    deadline = time.monotonic() + WAIT
    while True:
        delivered = tells(server_log, "deliver") if server_log.exists() else []
        if len(delivered) >= 400 or time.monotonic() > deadline:
            break
        time.sleep(0.05)  # polling a file another process writes: no event to wait on
    assert [decode_header(h)._replace(auth=None) for h, _ in delivered] == [decode_header(h) for h, _ in sent]
    assert [b for _, b in delivered] == [b for _, b in sent]


# ------------------------------------------------------------------------- malformed and oversized
class _RawClient:
    """A raw DEALER speaking WIRE.md by hand (the way tests/peers/wire_client.py does)."""

    def __init__(self, endpoint: str, *, hello: bool = True) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(endpoint)
        if not hello:  # a direct actor's socket answers over the connection a message came in on
            return
        hello = Header(
            id=new_id(), kind=Hello.TAG, src="raw/node", dst="srv/node", flow="tell", ts=time.time()
        )
        self.send(hello, REGISTRY.encode(Hello(node="raw")))

    def send(self, header: Header, body: bytes) -> None:
        self.sock.send_multipart([b"", encode_header(header), body])

    def batch(self, dst: str, body: bytes, seq: int = 0) -> Header:
        header = Header(
            id=new_id(), kind=BATCH_TAG, src="raw/x", dst=dst, flow="tell", ts=time.time(), seq=seq
        )
        self.send(header, body)
        return header

    def ask(self, dst: str, message: Any) -> Any:
        header = Header(
            id=new_id(), kind=REGISTRY.tag_of(message), src="raw/x", dst=dst, flow="ask", ts=time.time()
        )
        self.send(header, REGISTRY.encode(message))
        while True:
            answer, body = self.next()
            if answer.corr == header.id:
                return REGISTRY.decode(answer.kind, body)

    def next(self) -> tuple[Header, bytes]:
        assert self.sock.poll(int(WAIT * 1000)), "no answer within the bound"
        _, head, body = self.sock.recv_multipart()
        return decode_header(head), body

    def close(self) -> None:
        self.sock.close(0)


def _items(seqs: range) -> list[Any]:
    out: list[Any] = []
    for s in seqs:
        out += (new_id(), Echo.TAG, REGISTRY.encode(Echo(seq=s)))
    return out


@pytest.mark.parametrize("actor", ["rec", "nrec"])
def test_a_malformed_or_oversized_batch_is_refused_typed_and_the_actor_lives(
    actor: str, spawn_peer: Callable[..., PeerProcess], ipc_dir: Path
) -> None:
    """DESIGN.md §2 and WIRE.md 7a: a batch body that is not the documented array, one holding a bad
    item, or one of more than MAX_BATCH_ITEMS tells is answered with one error tell (``protocol`` or
    ``limit_exceeded``, ``corr`` = the batch's id) and nothing of it is delivered; a good batch after
    them arrives, in order, and the actor answers."""
    peer, _ = _server(spawn_peer, ipc_dir)
    endpoint = peer.endpoint
    if actor == "rec":  # the direct actor's own socket (WIRE.md 11): the same frames, split there
        raw = _RawClient(endpoint)
        resolved = raw.ask("srv/node", Resolve(actor="rec"))
        raw.close()
        endpoint = resolved.endpoints[0]
    raw = _RawClient(endpoint, hello=actor != "rec")
    try:
        dst = f"srv/{actor}"
        bad_bodies = {
            "not msgpack": b"\xc1",
            "a map": msgpack.packb({"items": []}),
            "empty": msgpack.packb([]),
            "not triples": msgpack.packb([new_id(), Echo.TAG]),
            "short id": msgpack.packb([b"\x01" * 8, Echo.TAG, b""]),
            "nested batch": msgpack.packb([new_id(), BATCH_TAG, b""]),
            "str body": msgpack.packb([new_id(), Echo.TAG, "x"]),
        }
        refused = {name: raw.batch(dst, body).id for name, body in bad_bodies.items()}
        too_many = raw.batch(dst, msgpack.packb(_items(range(MAX_BATCH_ITEMS + 1))))
        good = raw.batch(dst, msgpack.packb(_items(range(10))), seq=1)
        answers = {}
        for _ in range(len(refused) + 1):
            header, body = raw.next()
            assert header.flow == "tell" and header.kind == ErrorReply.TAG
            answers[header.corr] = REGISTRY.decode(header.kind, body)
        for name, batch_id in refused.items():
            assert answers[batch_id].error == "protocol", name
        assert answers[too_many.id].error == "limit_exceeded"
        assert answers[too_many.id].fields["limit"] == MAX_BATCH_ITEMS
        dump = raw.ask(dst, Echo(text="dump"))
        assert list(dump.data) == list(range(10))  # only the good batch, in order: the actor lives
        assert good.id not in answers
    finally:
        raw.close()


# ------------------------------------------------------------------------------- a full queue
def test_a_burst_cut_by_a_full_queue_reports_exactly_the_lost_tells(
    make_node: Callable[..., Node], spawn_peer: Callable[..., PeerProcess], ipc_dir: Path
) -> None:
    """No tell is lost unreported: the server is stopped (SIGSTOP) while a client with a tiny send
    queue tells 20000; the tells that could not leave are reported NotDelivered by id, and once the
    server runs again it has recorded exactly all the others, in order."""
    peer, link = _server(spawn_peer, ipc_dir)
    client = _client(make_node, link, options=SocketOptions(max_message_bytes=(1 << 20) + 65536, sndhwm=2))
    failed: queue.SimpleQueue[tuple[BusError, bytes | None]] = queue.SimpleQueue()
    client.on_tell_error(lambda error, tell_id: failed.put((error, tell_id)))
    client.tell("srv/nrec", Echo(seq=-1))  # the lane exists before the server stops
    assert client.request("srv/nrec", Echo(text="await", seq=1), timeout=WAIT).seq == 1
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        seq_of = {}
        for i in range(20000):
            seq_of[client.tell("srv/nrec", Echo(seq=i, payload=b"p" * 200))] = i
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    # This thread's next send first sends (or fails) what it still holds, and waits for a flush the I/O
    # thread may be doing: once it is answered, every failure has been reported. FIFO (MB-05): the count
    # sees every tell that was delivered.
    # Its queue may still be full for a moment after SIGCONT: NotDelivered means nothing ran (retry).
    deadline = time.monotonic() + WAIT
    while True:
        try:
            count = client.request("srv/nrec", Echo(text="count"), timeout=WAIT).seq
            break
        except NotDelivered:
            assert time.monotonic() < deadline, "the server never took a request again"
            time.sleep(0.01)  # the server's reading is not an event this process can wait on
    lost: set[int] = set()
    while not failed.empty():
        error, tell_id = failed.get_nowait()
        assert isinstance(error, NotDelivered)
        assert tell_id in seq_of
        lost.add(seq_of[tell_id])
    assert lost, "the queue never filled: the test did not cut the burst"
    expected = [i for i in range(20000) if i not in lost]
    assert count == 1 + len(expected)
    assert _dump(client, "nrec") == [-1, *expected]
