"""DESIGN.md §5 over real sockets: tcp is CURVE by default, unlisted keys are refused before anything is
delivered, the authenticated key (not the claimed ``src``) is the identity, ``auth`` is stamped by the
receiver, and key files are private.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from peers.bus_peer import RecorderActor
from zmq.utils.monitor import recv_monitor_message

from actors.base import BusActor, Context
from transport import BusError, KeyPair, Node, NotDelivered, Peer, Security, SecurityError
from transport.codec import Registry, decode_header, encode_header
from transport.envelope import Header, new_id
from transport.messages import SYSTEM_MESSAGES, Echo, Resolve, Resolved
from transport.security import ZapService, create_keys, load_public_key

pytestmark = pytest.mark.integration

SRV = "srv"
WAIT = 20.0
REGISTRY = Registry(SYSTEM_MESSAGES)


class AuthEcho(BusActor):
    """Answers every request with the ``auth`` its node stamped on it (empty: none)."""

    def handle(self, message: Any, ctx: Context) -> Any:
        return Echo(text=ctx.header.auth or "")


class DirectAuthEcho(AuthEcho):
    """The same, taking peers' traffic on its own socket where the node supports that."""

    DIRECT = True


# ------------------------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def raw_dealer(
    endpoint: str, *, keys: KeyPair | None = None, server_key: str | None = None, monitor: int = 0
) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes] | None]]:
    """A bare DEALER (optionally CURVE, optionally monitored) that speaks the bus wire by hand."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    mon = None
    try:
        sock.linger = 0
        sock.sndtimeo = int(WAIT * 1000)  # a send that cannot go out fails the test instead of hanging it
        if keys is not None:
            assert server_key is not None
            sock.curve_secretkey = keys.secret.encode()
            sock.curve_publickey = keys.public.encode()
            sock.curve_serverkey = server_key.encode()
        if monitor:
            mon = sock.get_monitor_socket(monitor)
        sock.connect(endpoint)
        yield sock, mon
    finally:
        if mon is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            mon.close(0)
        sock.close(0)


def send_request(
    sock: zmq.Socket[bytes],
    src: str,
    dst: str,
    message: Any,
    *,
    flow: str = "ask",
    auth: str | None = None,
    flags: int = 0,
) -> bytes:
    header = Header(
        id=new_id(),
        kind=REGISTRY.tag_of(message),
        src=src,
        dst=dst,
        flow=flow,  # type: ignore[arg-type]
        ts=time.time(),
        auth=auth,
    )
    sock.send_multipart([b"", encode_header(header), REGISTRY.encode(message)], flags)
    return header.id


def recv_reply(sock: zmq.Socket[bytes], timeout: float = WAIT) -> tuple[Header, Any]:
    assert sock.poll(int(timeout * 1000)), f"no reply within {timeout}s"
    empty, head, body = sock.recv_multipart()
    assert empty == b""
    header = decode_header(head)
    return header, REGISTRY.decode(header.kind, body)


def wait_for_event(mon: zmq.Socket[bytes], wanted: int, timeout: float = WAIT) -> list[str]:
    """Read monitor events until ``wanted`` shows up; return the names seen (fails on timeout)."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        assert left > 0 and mon.poll(int(left * 1000)), f"no {zmq.Event(wanted).name}; saw {seen}"
        event = int(recv_monitor_message(mon)["event"])
        seen.append(str(zmq.Event(event).name))
        if event == wanted:
            return seen


def curve_server(make_node: Callable[..., Node], allow: dict[str, str]) -> tuple[Node, Peer]:
    """An in-process node bound on tcp://127.0.0.1 with CURVE; ``allow`` maps public key -> node name."""
    keys = KeyPair.generate()
    server = make_node(SRV, bind=["tcp://127.0.0.1:*"], security=Security(keys=keys, allow=allow))
    return server, Peer(SRV, server.endpoints[0], keys.public)


# ------------------------------------------------------------------------------ CURVE is the default
def test_tcp_bind_without_a_key_pair_refuses_to_start() -> None:
    for security in (Security(), Security(allow={KeyPair.generate().public: "c1"})):
        node = Node(SRV, bind=["tcp://127.0.0.1:*"], security=security)
        with pytest.raises(SecurityError):
            node.start()
        assert not node.running


def test_plain_tcp_needs_the_loudly_named_setting(make_node: Callable[..., Node]) -> None:
    plain = Security(plain_insecure_for_benchmarks=True)
    bench = make_node("bench", bind=["tcp://127.0.0.1:*"], security=plain)
    bench.spawn(RecorderActor, "rec")
    client = make_node("plainclient", security=plain)
    client.connect(Peer("bench", bench.endpoints[0]), wait=WAIT)
    assert client.request("bench/rec", Echo(seq=1), timeout=WAIT) == Echo(seq=1)
    assert client.request_future("bench/rec", Echo(seq=2), timeout=WAIT).result(WAIT) == Echo(seq=2)

    # The same plain client against a default (CURVE) node: no handshake, nothing delivered.
    server, link = curve_server(make_node, {})
    server.spawn(RecorderActor, "rec")
    client.connect(Peer(SRV, link.endpoint))  # without the server key it cannot even try CURVE
    with pytest.raises(NotDelivered):
        client.request(f"{SRV}/rec", Echo(seq=3), timeout=5.0)
    with pytest.raises(NotDelivered):
        client.request_future(f"{SRV}/rec", Echo(seq=4), timeout=5.0).result(WAIT)
    # Read the recorder from its own node: nothing reached it.
    assert list(server.request(f"{SRV}/rec", Echo(text="dump"), timeout=WAIT).data) == []


# ------------------------------------------------------------------------------- unlisted client keys
def test_an_unlisted_client_key_is_refused_and_nothing_is_delivered(make_node: Callable[..., Node]) -> None:
    good_keys, bad_keys = KeyPair.generate(), KeyPair.generate()
    server, link = curve_server(make_node, {good_keys.public: "good"})
    server.spawn(RecorderActor, "rec")

    # A bare socket with the unlisted key: its own monitor reports the refused handshake...
    events = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_SUCCEEDED
    with raw_dealer(link.endpoint, keys=bad_keys, server_key=link.server_key, monitor=events) as (sock, mon):
        assert mon is not None
        seen = wait_for_event(mon, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        assert "HANDSHAKE_SUCCEEDED" not in seen
        # Queued if libzmq still holds a pipe, refused (Again) if the failed handshake took it down.
        with contextlib.suppress(zmq.Again):
            send_request(sock, "bad/x", f"{SRV}/rec", Echo(seq=1), flow="tell", flags=zmq.NOBLOCK)
        assert not sock.poll(200), "a refused connection got an answer"

    # ...and a node with that key gets NotDelivered naming the reason, on every path.
    bad = make_node("bad", security=Security(keys=bad_keys), peers=[link])
    with pytest.raises(NotDelivered, match="authentication"):
        bad.request(f"{SRV}/rec", Echo(seq=2), timeout=WAIT)
    errors: queue.SimpleQueue[BusError] = queue.SimpleQueue()
    bad.on_tell_error(lambda error, _id: errors.put(error))
    with pytest.raises(NotDelivered):
        bad.connect(link, wait=5.0)  # the node's own connection never completes a handshake
    assert bad.stats["handshake_failures"] >= 1  # its monitor saw the refusal
    with pytest.raises(NotDelivered):
        bad.request_future(f"{SRV}/rec", Echo(seq=3), timeout=WAIT).result(WAIT)
    bad.tell(f"{SRV}/rec", Echo(seq=4))
    assert isinstance(errors.get(timeout=WAIT), NotDelivered)

    # The recorder saw none of it; a listed key gets through.
    good = make_node("good", security=Security(keys=good_keys))
    good.connect(link, wait=WAIT)
    assert good.request(f"{SRV}/rec", Echo(seq=5), timeout=WAIT) == Echo(seq=5)
    dump = good.request(f"{SRV}/rec", Echo(text="dump"), timeout=WAIT)
    assert list(dump.data) == [5]
    assert server.stats["spoofed"] == 0 and server.stats["unauthenticated"] == 0


def test_clients_with_unlisted_keys_make_one_log_line(
    make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 18 item 6: every refused handshake was a WARNING line, so any stranger could flood the log."""
    caplog.set_level(logging.WARNING, logger="transport.security")
    server, link = curve_server(make_node, {})
    for _ in range(5):
        with raw_dealer(
            link.endpoint,
            keys=KeyPair.generate(),
            server_key=link.server_key,
            monitor=zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        ) as (_, mon):
            assert mon is not None
            wait_for_event(mon, zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    refusals = [r for r in caplog.records if "refused client key" in r.getMessage()]
    assert len(refusals) == 1
    service = ZapService.service_for(server.context)
    assert service is not None and service._providers[SRV].refused == 5


# ----------------------------------------------------------------------------------------- spoofing
def test_a_valid_key_claiming_another_nodes_src_is_dropped_and_counted(
    make_node: Callable[..., Node],
) -> None:
    c1, c2 = KeyPair.generate(), KeyPair.generate()
    server, link = curve_server(make_node, {c1.public: "c1", c2.public: "c2"})
    server.spawn(RecorderActor, "rec")
    with raw_dealer(link.endpoint, keys=c1, server_key=link.server_key) as (sock, _):
        spoofed_ask = send_request(sock, "c2/x", f"{SRV}/rec", Echo(seq=1))
        send_request(sock, "c2/x", f"{SRV}/rec", Echo(seq=2), flow="tell")
        honest = send_request(sock, "c1/x", f"{SRV}/rec", Echo(seq=3))
        # Same connection, so read in order: the first reply is the honest one's; none came for c2.
        header, reply = recv_reply(sock)
        assert header.corr == honest != spoofed_ask
        assert reply == Echo(seq=3)
        assert server.stats["spoofed"] == 2
        dump_id = send_request(sock, "c1/x", f"{SRV}/rec", Echo(text="dump"))
        header, reply = recv_reply(sock)
        assert header.corr == dump_id and list(reply.data) == [3]
        assert not sock.poll(200), "an answer to the spoofed request arrived late"


# ------------------------------------------------------------------------------------ auth stamping
def test_auth_is_stamped_by_the_receiving_node_over_curve(make_node: Callable[..., Node]) -> None:
    c1 = KeyPair.generate()
    server, link = curve_server(make_node, {c1.public: "c1"})
    server.spawn(AuthEcho, "auth")
    server.spawn(DirectAuthEcho, "dauth")
    with raw_dealer(link.endpoint, keys=c1, server_key=link.server_key) as (sock, _):
        for actor in ("auth", "dauth"):
            for forged in ("forged-by-the-sender", None):
                sent = send_request(sock, "c1/x", f"{SRV}/{actor}", Echo(), auth=forged)
                header, reply = recv_reply(sock)
                assert header.corr == sent
                assert reply.text == c1.public, f"{actor}: auth {forged!r} was not replaced by the key"
    client = make_node("c1", security=Security(keys=c1))
    client.connect(link, wait=WAIT)
    for actor in ("auth", "dauth"):
        assert client.request(f"{SRV}/{actor}", Echo(), timeout=WAIT).text == c1.public
        assert client.request_future(f"{SRV}/{actor}", Echo(), timeout=WAIT).result(WAIT).text == c1.public


def test_auth_set_by_the_sender_is_cleared_without_authentication(
    make_node: Callable[..., Node], ipc_dir: Path
) -> None:
    server = make_node(SRV, bind=[f"ipc://{ipc_dir}/srv.sock"])
    server.spawn(AuthEcho, "auth")
    server.spawn(DirectAuthEcho, "dauth")
    with raw_dealer(server.endpoints[0]) as (sock, _):
        for actor in ("auth", "dauth"):
            sent = send_request(sock, "c1/x", f"{SRV}/{actor}", Echo(), auth="forged-by-the-sender")
            header, reply = recv_reply(sock)
            assert header.corr == sent
            assert reply.text == "", f"{actor}: a sender-set auth survived"


# ------------------------------------------------------------------------------ the ZAP authenticator
@pytest.fixture
def own_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    """A private ZeroMQ context, so no other test's nodes share its authenticator; terminated at the end."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ZapService.close(ctx)  # term() waits for every socket, the ZAP socket included
    ctx.term()


def zap_status(ctx: zmq.Context[zmq.Socket[bytes]], domain: str, key: KeyPair) -> bytes:
    """Ask the context's ZAP handler (RFC 27) whether ``key`` may connect to ``domain``: b"200" or b"400"."""
    req: zmq.Socket[bytes] = ctx.socket(zmq.REQ)
    try:
        req.linger = 0
        req.connect("inproc://zeromq.zap.01")
        req.send_multipart(
            [b"1.0", b"1", domain.encode(), b"127.0.0.1", b"", b"CURVE", zmq.utils.z85.decode(key.public)]
        )
        assert req.poll(int(WAIT * 1000)), "the ZAP handler did not answer"
        return req.recv_multipart()[2]
    finally:
        req.close(0)


def test_curve_nodes_started_one_after_another_on_one_context_all_bind(
    own_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """Issue 18 item 10: a node stopping used to stop the context's ZAP authenticator; libzmq frees the
    ZAP endpoint later, on its reaper thread, so the next node's authenticator failed to bind it ("Address
    already in use", seen once in the suite and at nearly every try in a tight loop)."""
    keys = KeyPair.generate()
    for i in range(30):
        node = Node(f"n{i}", bind=["tcp://127.0.0.1:*"], security=Security(keys=keys), context=own_context)
        node.start()  # raised ZMQError(EADDRINUSE) from the second node on, before the fix
        node.stop()


def test_the_zap_endpoint_survives_register_and_unregister_in_a_loop(
    own_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    for _ in range(200):
        ZapService.register(own_context, "d", {})
        ZapService.unregister(own_context, "d")
    # And after an explicit close, the next register waits (bounded) for libzmq to release the endpoint.
    for _ in range(50):
        ZapService.register(own_context, "d", {})
        ZapService.close(own_context)


def test_a_stopped_nodes_domain_is_refused_while_another_node_keeps_the_authenticator(
    own_context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The authenticator outlives a node, so removing the node's domain must close the door (fail closed)."""
    client = KeyPair.generate()
    a = Node(
        "a",
        bind=["tcp://127.0.0.1:*"],
        security=Security(keys=KeyPair.generate(), allow={client.public: "c"}),
        context=own_context,
    ).start()
    b = Node(
        "b",
        bind=["tcp://127.0.0.1:*"],
        security=Security(keys=KeyPair.generate(), allow={client.public: "c"}),
        context=own_context,
    ).start()
    try:
        assert zap_status(own_context, "a", client) == b"200"
        assert zap_status(own_context, "a", KeyPair.generate()) == b"400"
        a.stop()
        assert zap_status(own_context, "a", client) == b"400"  # its domain is gone
        assert zap_status(own_context, "b", client) == b"200"  # the other node's is not
        b.stop()
        assert zap_status(own_context, "b", client) == b"400"  # no domain left: everything is refused
    finally:
        a.stop()
        b.stop()


# ------------------------------------------------------------------------------------ the directory
@pytest.mark.parametrize("over", ["tcp", "ipc"])
def test_a_directory_query_answers_only_endpoints_of_its_own_transport(
    make_node: Callable[..., Node], ipc_dir: Path, over: str
) -> None:
    """Issue 18 item 7: a sys.resolve over tcp revealed the absolute ipc path of a direct actor's socket."""
    server = make_node(
        SRV,
        bind=["tcp://127.0.0.1:*", f"ipc://{ipc_dir}/srv.sock"],
        security=Security(plain_insecure_for_benchmarks=True),
    )
    server.spawn(DirectAuthEcho, "dauth")
    assert server.request(f"{SRV}/dauth", Echo(), timeout=WAIT) == Echo(text="")  # its socket is bound
    assert {e.partition(":")[0] for e in server.direct_endpoints("dauth")} == {"tcp", "ipc"}
    endpoint = server.endpoints[0 if over == "tcp" else 1]
    with raw_dealer(endpoint) as (sock, _):
        sent = send_request(sock, "c1/x", f"{SRV}/node", Resolve(actor="dauth"))
        header, answer = recv_reply(sock)
    assert header.corr == sent and isinstance(answer, Resolved)
    assert answer.endpoints and all(e.startswith(f"{over}://") for e in answer.endpoints), answer.endpoints


# ------------------------------------------------------------------------------------------ key files
def test_create_keys_writes_a_private_secret_and_never_overwrites(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    public, secret = create_keys(folder, "n1")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    keys = KeyPair.load(secret)
    assert keys.public == load_public_key(public)
    before = (public.read_bytes(), secret.read_bytes())
    with pytest.raises(SecurityError, match="not overwriting"):
        create_keys(folder, "n1")
    assert (public.read_bytes(), secret.read_bytes()) == before
    # Losing only the public half still does not let a second call replace the secret.
    public.unlink()
    with pytest.raises(SecurityError):
        create_keys(folder, "n1")
    assert secret.read_bytes() == before[1]


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644, 0o700])
def test_keypair_load_refuses_a_secret_others_can_read(tmp_path: Path, mode: int) -> None:
    _, secret = create_keys(tmp_path / "keys", "n1")
    os.chmod(secret, mode)
    if mode & 0o077:
        with pytest.raises(SecurityError, match="readable by others"):
            KeyPair.load(secret)
    else:
        assert KeyPair.load(secret).public  # owner-only modes are fine
