"""Issue 18: what a hostile peer can make a node remember is bounded, and the node's timer runs what is due.

One process, real inproc sockets.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest
import zmq

from actors.app.echo import EchoActor
from transport import Node, NotDelivered, Peer, Security
from transport.codec import encode_header
from transport.envelope import Header, new_id
from transport.io_thread import MAX_ROUTES
from transport.messages import Echo, Hello
from transport.node import _SEQ_SENDERS
from transport.pending import Timers

WAIT = 10.0


def test_a_thread_numbers_sends_for_a_bounded_number_of_pairs(make_node: Callable[..., Node]) -> None:
    """Every error tell to a made-up sender address used to add a sequence counter for good."""
    node = make_node("n1")
    for i in range(_SEQ_SENDERS + 500):
        node.header("echo", "n1/echo", f"x{i}/a", "tell")
    assert len(node._tls.seq) == _SEQ_SENDERS
    # The newest pairs keep counting; the oldest started over.
    assert node.header("echo", "n1/echo", f"x{_SEQ_SENDERS + 499}/a", "tell").seq == 2


def test_hellos_under_made_up_names_are_remembered_up_to_a_bound(make_node: Callable[..., Node]) -> None:
    node = make_node("n1", bind=[f"inproc://kb-{uuid.uuid4().hex}"])
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.linger = 0
    sock.sndhwm = 0
    try:
        sock.connect(node.endpoints[0])
        body = node.registry.encode(Hello(node="x"))
        for i in range(MAX_ROUTES + 100):
            hello = Header(
                id=new_id(), kind=Hello.TAG, src=f"h{i}/node", dst="n1/node", flow="tell", ts=time.time()
            )
            sock.send_multipart([b"", encode_header(hello), body])
        # The I/O thread handles its socket in order: once this call runs, it has read every hello before.
        deadline = time.monotonic() + WAIT
        while node.stats["routes_forgotten"] < 100:
            assert time.monotonic() < deadline, f"only {node.stats['routes_forgotten']} routes forgotten"
            node.call_in_io_thread(lambda: None, timeout=WAIT)
        assert node.call_in_io_thread(lambda: len(node._io.routes), timeout=WAIT) == MAX_ROUTES  # type: ignore[union-attr]
    finally:
        sock.close(0)


def test_timers_run_once_when_due_and_not_when_cancelled() -> None:
    now = [0.0]
    timers = Timers(lambda: now[0])
    ran: list[str] = []
    timers.add(1.0, lambda: ran.append("a"))
    cancelled = timers.add(1.0, lambda: ran.append("b"))
    timers.add(3.0, lambda: ran.append("c"))
    timers.cancel(cancelled)
    assert timers.run_due() == 1.0 and ran == []
    now[0] = 2.0
    assert timers.run_due() == 1.0 and ran == ["a"]
    now[0] = 5.0
    assert timers.run_due() is None and ran == ["a", "c"]
    assert len(timers) == 0


def test_a_peer_endpoint_zmq_refuses_does_not_end_the_io_thread(
    make_node: Callable[..., Node], caplog: pytest.LogCaptureFixture
) -> None:
    """``kbus ping foo://x`` ended the client node's I/O thread ("I/O thread crashed")."""
    node = make_node("n1", security=Security(plain_insecure_for_benchmarks=True))
    node.spawn(EchoActor, "echo")
    for endpoint in ("foo://x", "tcp://bad host:1", "tcp://127.0.0.1"):
        node.connect(Peer("far", endpoint))
        with pytest.raises(NotDelivered):
            node.request("far/echo", Echo(), timeout=1.0)
    assert node.request("n1/echo", Echo(seq=2), timeout=WAIT) == Echo(seq=2)
    assert node.call_in_io_thread(lambda: "alive", timeout=WAIT) == "alive"
    assert not any("I/O thread crashed" in r.getMessage() for r in caplog.records)
