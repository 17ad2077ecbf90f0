"""Real nodes talking over real sockets: the same request/reply suite over inproc, ipc and tcp+CURVE (MB-08),
peer death mid-request, a peer that stops reading, FIFO per pair over tcp (MB-05), deadlines on arrival.

Out-of-process servers are ``tests/peers/bus_peer.py`` (echo actors, a recorder, a stats actor), started and
ended by PID through the ``spawn_peer`` fixture.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
from conftest import PeerProcess
from peers.bus_peer import RecorderActor, StatsActor

from actors.app.echo import EchoActor
from actors.base import DEFER, LOOP_HOSTS, BusActor, Context, HostPool
from transport import (
    BusError,
    Expired,
    HandlerError,
    KeyPair,
    Node,
    NotDelivered,
    Peer,
    ProtocolError,
    Security,
    Unavailable,
)
from transport.codec import Registry, encode_header
from transport.envelope import Header, new_id
from transport.messages import SYSTEM_MESSAGES, Echo, EchoStream, Fail, Hold, Ping, Pong
from transport.pending import Reply

pytestmark = pytest.mark.integration

SRV = "srv"
CLI = "cli"
WAIT = 20.0  # generous bound for anything that should take milliseconds

MakeKeys = Callable[[str], tuple[KeyPair, Path]]


# ------------------------------------------------------------------------------------------- helpers
def start_server(
    spawn_peer: Callable[..., PeerProcess],
    transport: str,
    ipc_dir: Path,
    make_keys: MakeKeys,
    *,
    clients: Mapping[str, KeyPair],
    args: tuple[str, ...] = (),
) -> tuple[PeerProcess, Peer]:
    """A bus_peer serving ``srv/echo`` over ``transport``; ``clients`` are allow-listed (tcp)."""
    if transport == "ipc":
        peer = spawn_peer("--name", SRV, "--bind", f"ipc://{ipc_dir}/{SRV}.sock", *args)
        return peer, Peer(SRV, peer.endpoint)
    assert transport == "tcp"
    keys, secret = make_keys(SRV)
    allow = [f"--allow={name}={kp.public}" for name, kp in clients.items()]
    peer = spawn_peer(
        "--name", SRV, "--bind", "tcp://127.0.0.1:*", f"--secret-key-file={secret}", *allow, *args
    )
    assert peer.info["public_key"] == keys.public
    assert peer.endpoint.startswith("tcp://127.0.0.1:")
    return peer, Peer(SRV, peer.endpoint, keys.public)


def connect_client(
    make_node: Callable[..., Node], link: Peer, keys: KeyPair | None, name: str = CLI, **kwargs: Any
) -> Node:
    """A client node (no binds) whose I/O thread has finished its handshake with ``link``."""
    node = make_node(name, security=Security(keys=keys), **kwargs)
    node.connect(link, wait=WAIT)
    return node


def server_stats(client: Node, *, timeout: float = WAIT) -> dict[str, int]:
    reply = client.request(f"{SRV}/stats", Echo(text="stats"), timeout=timeout)
    assert isinstance(reply, Echo) and isinstance(reply.data, dict)
    return {str(k): int(v) for k, v in reply.data.items()}


def tell_errors(node: Node) -> queue.SimpleQueue[tuple[BusError, bytes | None]]:
    errors: queue.SimpleQueue[tuple[BusError, bytes | None]] = queue.SimpleQueue()
    node.on_tell_error(lambda error, tell_id: errors.put((error, tell_id)))
    return errors


# ------------------------------------------------------------------------ the suite, over 3 transports
@dataclass
class Bus:
    transport: str
    client: Node

    def dst(self, actor: str) -> str:
        return f"{SRV}/{actor}"


@pytest.fixture(params=["inproc", "ipc", "tcp"])
def bus(
    request: pytest.FixtureRequest,
    make_node: Callable[..., Node],
    spawn_peer: Callable[..., PeerProcess],
    ipc_dir: Path,
    make_keys: MakeKeys,
) -> Bus:
    """A client node in this process and a server node ``srv`` with ``echo``, ``rec`` and ``stats``:
    inproc = both nodes in this process; ipc = server in its own process; tcp = its own process, CURVE,
    the server's key known to the client and the client's key on the server's allowlist."""
    transport: str = request.param
    if transport == "inproc":
        server = make_node(SRV, bind=[f"inproc://kbus-{uuid.uuid4().hex}"])
        server.spawn(EchoActor, "echo")
        server.spawn(RecorderActor, "rec")
        server.spawn(StatsActor, "stats")
        client = connect_client(make_node, Peer(SRV, server.endpoints[0]), None)
        return Bus(transport, client)
    client_keys = KeyPair.generate() if transport == "tcp" else None
    clients = {CLI: client_keys} if client_keys is not None else {}
    _, link = start_server(
        spawn_peer,
        transport,
        ipc_dir,
        make_keys,
        clients=clients,
        args=("--recorder", "rec", "--stats-actor"),
    )
    return Bus(transport, connect_client(make_node, link, client_keys))


def test_ask_gets_the_reply(bus: Bus) -> None:
    sent = Echo(text="hello", seq=7, payload=b"\x00\xff" * 100, data={"k": [1, 2.5, None, "x"]})
    assert bus.client.request(bus.dst("echo"), sent, timeout=WAIT) == sent
    for i in range(20):  # the per-thread channel is reused: every reply answers its own request
        assert bus.client.request(bus.dst("echo"), Echo(seq=i), timeout=WAIT).seq == i


def test_request_future_resolves_with_the_reply(bus: Bus) -> None:
    futures = [bus.client.request_future(bus.dst("echo"), Echo(seq=i), timeout=WAIT) for i in range(20)]
    assert [f.result(WAIT).seq for f in futures] == list(range(20))


def test_stream_yields_partials_then_the_final_reply(bus: Bus) -> None:
    expected = [Echo(payload=b"p", seq=i) for i in range(6)]  # 5 partials (seq 0-4), final has seq 5
    parts = bus.client.stream(bus.dst("echo"), EchoStream(count=5, payload=b"p"), timeout=WAIT)
    assert list(parts) == expected
    future = bus.client.request_future(
        bus.dst("echo"), EchoStream(count=5, payload=b"p"), timeout=WAIT, stream=True
    )
    assert list(future.parts(WAIT)) == expected
    assert future.result(0) == expected[-1]


def test_tells_are_delivered(bus: Bus) -> None:
    errors = tell_errors(bus.client)
    for i in (3, 1, 2):
        bus.client.tell(bus.dst("rec"), Echo(seq=i))
    # The recorder answers "await" once it holds that many: no assumption about which socket a tell takes.
    assert bus.client.request(bus.dst("rec"), Echo(text="await", seq=3), timeout=WAIT).seq == 3
    assert list(bus.client.request(bus.dst("rec"), Echo(text="dump"), timeout=WAIT).data) == [3, 1, 2]
    assert errors.empty()


def test_unknown_actor_is_not_delivered_at_once(bus: Bus) -> None:
    # The deadline is long: an answer that was not immediate would be Expired, not NotDelivered.
    with pytest.raises(NotDelivered, match="srv/nobody"):
        bus.client.request(bus.dst("nobody"), Echo(), timeout=WAIT)
    with pytest.raises(NotDelivered, match="srv/nobody"):
        bus.client.request_future(bus.dst("nobody"), Echo(), timeout=WAIT).result(WAIT + 1)
    errors = tell_errors(bus.client)
    tell_id = bus.client.tell(bus.dst("nobody"), Echo())
    # A later call from this thread to the same address takes the tell's path, so its error is in by then.
    with pytest.raises(NotDelivered):
        bus.client.request(bus.dst("nobody"), Echo(), timeout=WAIT)
    error, about = errors.get(timeout=WAIT)
    assert isinstance(error, NotDelivered) and about == tell_id


def test_handler_error_is_typed_and_the_actor_keeps_serving(bus: Bus) -> None:
    echo = bus.dst("echo")
    with pytest.raises(HandlerError, match="RuntimeError: boom") as bug:
        bus.client.request(echo, Fail(message="boom"), timeout=WAIT)
    assert bug.value.details == {"exc_type": "RuntimeError"}
    with pytest.raises(ProtocolError, match="bad input"):
        bus.client.request(echo, Fail(error="protocol", message="bad input"), timeout=WAIT)
    with pytest.raises(Unavailable, match="typed"):
        bus.client.request_future(echo, Fail(error="unavailable", message="typed"), timeout=WAIT).result(WAIT)
    errors = tell_errors(bus.client)
    tell_id = bus.client.tell(echo, Fail(message="told"))
    assert bus.client.request(echo, Ping(nonce=1), timeout=WAIT).nonce == 1  # the tell's error is back
    error, about = errors.get(timeout=WAIT)
    assert isinstance(error, HandlerError) and "told" in error.message and about == tell_id
    # Still alive and serving, on both paths.
    assert bus.client.request(echo, Echo(text="after"), timeout=WAIT).text == "after"
    assert bus.client.request_future(echo, Echo(text="after"), timeout=WAIT).result(WAIT).text == "after"


def test_ping_is_answered_with_pong(bus: Bus) -> None:
    pong = bus.client.request(bus.dst("echo"), Ping(nonce=41), timeout=WAIT)
    assert pong == Pong(nonce=41, actor="srv/echo")
    pong = bus.client.request_future(bus.dst("rec"), Ping(nonce=42), timeout=WAIT).result(WAIT)
    assert pong == Pong(nonce=42, actor="srv/rec")


# ------------------------------------------------------------------------------- a peer dies mid-request
class LaneAsker(BusActor):
    """On the client's loop pool: asks ``data["dst"]`` an ``Echo`` (or a ``Hold`` with ``data["hold"]`` as
    its note) and answers ``Echo(data={"error": <its class name or None>})``."""

    def handle(self, message: Any, ctx: Context) -> Any:
        hold = message.data.get("hold")
        ask = Hold(note=hold) if hold else Echo()

        def answered(reply: Reply) -> None:
            ctx.reply(Echo(data={"error": None if reply.error is None else type(reply.error).__name__}))

        self.ask(message.data["dst"], ask, answered, timeout=30)
        return DEFER


def lane_asker(client: Node) -> str:
    """A LaneAsker whose way to srv/echo is the lane of its host's thread (none of its sends took the I/O
    thread); new ones are tried until one does, each a real ask."""
    for i in range(50):
        name = f"lane.{i}"
        HostPool.of(client, LOOP_HOSTS).spawn(LaneAsker, name)
        before = client.stats["hops_to_io"]
        reply = client.request(f"{CLI}/{name}", Echo(data={"dst": f"{SRV}/echo"}), timeout=WAIT)
        assert reply.data == {"error": None}
        if client.stats["hops_to_io"] == before:
            return name
    raise AssertionError("no asker took the lane")


@pytest.mark.parametrize("path", ["blocking", "future", "lane"])
@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_peer_killed_mid_request_gives_unavailable(
    transport: str,
    path: str,
    make_node: Callable[..., Node],
    spawn_peer: Callable[..., PeerProcess],
    ipc_dir: Path,
    make_keys: MakeKeys,
) -> None:
    client_keys = KeyPair.generate() if transport == "tcp" else None
    peer, link = start_server(
        spawn_peer,
        transport,
        ipc_dir,
        make_keys,
        clients={CLI: client_keys} if client_keys else {},
        args=("--announce-hold",),
    )
    client = connect_client(make_node, link, client_keys)
    outcome: queue.SimpleQueue[object] = queue.SimpleQueue()
    if path == "blocking":
        # node.request blocks on the calling thread's own channel: run it on a thread of its own.
        def call() -> None:
            try:
                outcome.put(client.request(f"{SRV}/echo", Hold(note="blocking"), timeout=30))
            except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts on it
                outcome.put(exc)

        caller = threading.Thread(target=call, name="blocked-caller")
        caller.start()
    elif path == "lane":
        # A hosted actor's request that left on its host thread's lane, not through the I/O thread.
        asker = lane_asker(client)
        hold = Echo(data={"dst": f"{SRV}/echo", "hold": "lane"})
        future = client.request_future(f"{CLI}/{asker}", hold, timeout=40)
        future.add_done_callback(lambda f: outcome.put(f.exception() or f.result()))
    else:
        future = client.request_future(f"{SRV}/echo", Hold(note="future"), timeout=30)
        future.add_done_callback(lambda f: outcome.put(f.exception() or f.result()))
    peer.expect_line(f"HELD {path}", timeout=WAIT)  # the request is in the actor's hands
    peer.kill()  # SIGKILL by PID: no goodbye on the wire
    result = outcome.get(timeout=40)
    if path == "blocking":
        caller.join(WAIT)
    if path == "lane":
        assert isinstance(result, Echo) and result.data == {"error": "Unavailable"}, result
        return
    assert isinstance(result, Unavailable), f"expected Unavailable, got {result!r}"


# ------------------------------------------------------------------------------ a peer that stops reading
def _flooder(
    link: Peer,
    keys: KeyPair | None,
    stop: threading.Event,
    flooding: threading.Event,
    sent: list[int],
    failures: list[Exception],
    threshold: int,
) -> None:
    """A raw DEALER that sends valid requests as fast as it can and never reads a reply."""
    registry = Registry(SYSTEM_MESSAGES)
    body = registry.encode(Echo(payload=b"f" * 8192))
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.linger = 0
        sock.rcvhwm = 1  # replies pile up at the server, which must not wait for us
        sock.sndhwm = 10
        if keys is not None:
            sock.curve_secretkey = keys.secret.encode()
            sock.curve_publickey = keys.public.encode()
            assert link.server_key is not None
            sock.curve_serverkey = link.server_key.encode()
        sock.connect(link.endpoint)
        n = 0
        while not stop.is_set():
            if not sock.poll(100, zmq.POLLOUT):
                continue
            n += 1
            header = Header(
                id=new_id(),
                kind=Echo.TAG,
                src="flood/x",
                dst=f"{SRV}/echo",
                flow="ask",
                ts=time.time(),
                seq=n,
            )
            try:
                sock.send_multipart([b"", encode_header(header), body], zmq.NOBLOCK)
            except zmq.Again:
                n -= 1
                continue
            sent[0] = n
            if n == threshold:
                flooding.set()
    except Exception as exc:  # noqa: BLE001 - handed to the test thread, which asserts on it
        failures.append(exc)
        flooding.set()
    finally:
        sock.close(0)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_peer_that_stops_reading_does_not_stall_others(
    transport: str,
    make_node: Callable[..., Node],
    spawn_peer: Callable[..., PeerProcess],
    ipc_dir: Path,
    make_keys: MakeKeys,
) -> None:
    client_keys = KeyPair.generate() if transport == "tcp" else None
    flood_keys = KeyPair.generate() if transport == "tcp" else None
    clients = {CLI: client_keys, "flood": flood_keys} if client_keys and flood_keys else {}
    _, link = start_server(
        spawn_peer,
        transport,
        ipc_dir,
        make_keys,
        clients=clients,
        args=("--actor", "echo2", "--stats-actor"),
    )
    client = connect_client(make_node, link, client_keys)
    stop, flooding = threading.Event(), threading.Event()
    sent: list[int] = [0]
    failures: list[Exception] = []
    flooder = threading.Thread(
        target=_flooder, args=(link, flood_keys, stop, flooding, sent, failures, 8000), name="flooder"
    )
    flooder.start()
    try:
        # Never reaching the mark means the server stopped reading: a send blocked on the flooder's pipe.
        assert flooding.wait(60), f"the server took only {sent[0]} requests from the flooder"
        assert not failures, failures
        before = sent[0]
        # The well-behaved client: every request must come back within its (generous) deadline.
        for i in range(100):
            assert client.request(f"{SRV}/echo2", Echo(seq=i), timeout=10).seq == i
            assert client.request_future(f"{SRV}/echo2", Echo(seq=i), timeout=10).result(11).seq == i
        assert sent[0] > before, "the flood stopped while the good client ran: the test proved nothing"
    finally:
        stop.set()
        flooder.join(WAIT)
    assert not failures, failures
    # The server really met a full pipe to the flooder and dropped those replies instead of waiting.
    assert server_stats(client)["dropped_replies"] > 0


# ------------------------------------------------------------------------------------------------ MB-05
@dataclass(frozen=True)
class SendTells:
    """Local (pykka) message to ``SenderActor``: tell ``Echo(seq=n)`` to ``dst`` for n in first..last."""

    dst: str
    first: int
    last: int


class SenderActor(BusActor):
    """An actor that sends numbered tells from its own thread and address (actor -> actor, MB-05)."""

    def __init__(self, node: Node, address: str, errors: queue.SimpleQueue[BusError]) -> None:
        super().__init__(node, address)
        self.errors = errors

    def on_local(self, message: Any) -> Any:
        if isinstance(message, SendTells):
            for n in range(message.first, message.last + 1):
                self.tell_to(message.dst, Echo(seq=n))
            return None
        return super().on_local(message)

    def on_tell_error(self, error: BusError, tell_id: bytes | None) -> None:
        self.errors.put(error)


@pytest.mark.parametrize("sender", ["thread", "actor"])
def test_ten_thousand_tells_over_tcp_arrive_in_order(
    sender: str,
    make_node: Callable[..., Node],
    spawn_peer: Callable[..., PeerProcess],
    ipc_dir: Path,
    make_keys: MakeKeys,
) -> None:
    client_keys = KeyPair.generate()
    _, link = start_server(
        spawn_peer,
        "tcp",
        ipc_dir,
        make_keys,
        clients={CLI: client_keys},
        args=("--recorder", "rec", "--stats-actor"),
    )
    client = connect_client(make_node, link, client_keys)
    rec = f"{SRV}/rec"
    errors: queue.SimpleQueue[BusError] = queue.SimpleQueue()
    client.on_tell_error(lambda error, _id: errors.put(error))
    actor = client.spawn(SenderActor, "sender", errors) if sender == "actor" else None
    total, batch = 10_000, 500
    for first in range(1, total + 1, batch):
        last = min(first + batch - 1, total)
        if actor is not None:
            actor.ask(SendTells(rec, first, last), timeout=WAIT)
        else:
            for n in range(first, last + 1):
                client.tell(rec, Echo(seq=n))
        # Flow control, not ordering: at most one batch in flight, below a socket's send HWM (1000), so
        # at-most-once delivery never has to drop one. "await" answers once that many are recorded.
        assert client.request(rec, Echo(text="await", seq=last), timeout=WAIT).seq == last
    assert errors.empty(), errors.get()
    dump = client.request(rec, Echo(text="dump"), timeout=WAIT)
    assert list(dump.data) == list(range(1, total + 1))
    assert server_stats(client).get("seq_gaps", 0) == 0


# ------------------------------------------------------------------------------- deadline past on arrival
def test_request_expired_on_arrival_is_dropped_and_the_caller_gets_expired(
    make_node: Callable[..., Node],
    spawn_peer: Callable[..., PeerProcess],
    ipc_dir: Path,
    make_keys: MakeKeys,
) -> None:
    skew, long = 600.0, 1200.0
    client_keys = KeyPair.generate()
    _, link = start_server(
        spawn_peer,
        "tcp",
        ipc_dir,
        make_keys,
        clients={CLI: client_keys},
        args=("--recorder", "rec", "--stats-actor"),
    )
    # A client whose wall clock is ten minutes slow: a deadline it stamps with a short timeout is already
    # past over there; one with a long timeout (``long``) is not.
    client = connect_client(make_node, link, client_keys, clock=lambda: time.time() - skew)
    rec = f"{SRV}/rec"

    def stats() -> dict[str, Any]:
        reply = client.request_future(f"{SRV}/stats", Echo(), timeout=long).result(WAIT)
        assert isinstance(reply.data, dict)
        return reply.data

    # Warm both paths up (channel, any per-destination set-up, the I/O thread's connection).
    assert client.request(rec, Echo(text="count"), timeout=long).seq == 0
    assert client.request_future(rec, Echo(text="count"), timeout=long).result(WAIT).seq == 0
    before = stats().get("expired_on_arrival", 0)

    with pytest.raises(Expired):
        client.request(rec, Echo(seq=1), timeout=1.0)
    with pytest.raises(Expired):
        client.request_future(rec, Echo(seq=2), timeout=1.0).result(WAIT)

    # Each query rides the connection its expired request took, so it is read after it: nothing arrived.
    assert list(client.request(rec, Echo(text="dump"), timeout=long).data) == []
    assert list(client.request_future(rec, Echo(text="dump"), timeout=long).result(WAIT).data) == []
    assert stats().get("expired_on_arrival", 0) - before == 2
