"""``kbus stats`` and ``sys.stats`` (issue 18 item 7) against real ``kbus node`` processes fed bad frames.

Every node is a real process (``kbus_node`` fixture, ended by its PID); the bad frames come from a bare
DEALER over real ipc and tcp+CURVE sockets; ``kbus stats`` runs as its own process.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from conftest import KbusNode
from integration.test_node_hardening import REGISTRY, RawClient, echo_node_config, kbus

from transport.codec import encode_header
from transport.envelope import Header, new_id
from transport.messages import Echo, ErrorReply, Fail, Ping, Pong

pytestmark = pytest.mark.integration


@pytest.fixture
def raw_client() -> Any:
    clients: list[RawClient] = []

    def make(endpoint: str) -> RawClient:
        clients.append(RawClient(endpoint))
        return clients[-1]

    yield make
    for client in clients:
        client.close()


def stats(endpoint: str, *extra: str) -> dict[str, Any]:
    done = kbus("stats", endpoint, "--node", "n1", "--json", *extra)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def ask(client: RawClient, kind: str, body: bytes, dst: str = "n1/echo") -> Any:
    sent = client.send(kind, body, dst=dst)
    header, message = client.recv()
    assert header.corr == sent
    return message


def test_kbus_stats_counts_what_bad_frames_cost_and_what_each_actor_handled(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode], raw_client: Callable[[str], RawClient]
) -> None:
    config = echo_node_config(ipc_dir)
    config.write_text(config.read_text() + '[actors.quiet]\ntype = "echo"\n')
    kbus_node(config)
    endpoint = f"ipc://{ipc_dir}/n1.sock"
    before = stats(endpoint)
    assert before["node"] == "n1"
    for key in ("malformed", "spoofed", "misrouted", "not_delivered", "expired_on_arrival"):
        assert before["counters"][key] == 0, key  # named even before anything is counted
    client = raw_client(endpoint)
    for garbage in (b"\xc1", b"\x93\x01\x02\x03", msgpack_array_of(15)):
        client.sock.send_multipart([b"", garbage, b""])  # undecodable, or not a 16-slot header
    client.sock.send_multipart([b"", b"only one frame after the delimiter"])  # the wrong shape
    for _ in range(2):
        error = ask(client, Echo.TAG, REGISTRY.encode(Echo()), dst="n2/echo")
        assert isinstance(error, ErrorReply) and error.error == "not_delivered"
    error = ask(client, Echo.TAG, REGISTRY.encode(Echo()), dst="n1/ghost")
    assert isinstance(error, ErrorReply) and error.error == "not_delivered"
    send_expired(client)
    for i in range(5):
        assert ask(client, Echo.TAG, REGISTRY.encode(Echo(seq=i))) == Echo(seq=i)
    for _ in range(2):
        error = ask(client, Fail.TAG, REGISTRY.encode(Fail(error="protocol")))
        assert isinstance(error, ErrorReply) and error.error == "protocol"
    error = ask(client, Echo.TAG, b"\x81\xa3bad\x01")  # a body with a field echo does not have
    assert isinstance(error, ErrorReply) and error.error == "protocol"
    # The same connection, in order: every frame above was taken in before this ping is answered.
    assert ask(client, Ping.TAG, REGISTRY.encode(Ping(nonce=1))) == Pong(nonce=1, actor="n1/echo")

    after = stats(endpoint)
    counters = after["counters"]
    assert counters["malformed"] == 4
    assert counters["misrouted"] == 2
    assert counters["not_delivered"] == 1
    assert counters["expired_on_arrival"] == 1
    assert counters["spoofed"] == 0
    assert after["actors"]["echo"] == {"handled": 5 + 2 + 1 + 1, "failed": 3, "mailbox": 0}
    assert after["actors"]["quiet"] == {"handled": 0, "failed": 0, "mailbox": 0}

    text = kbus("stats", endpoint, "--node", "n1")
    assert text.returncode == 0, text.stderr
    assert "actor echo: handled 9, failed 3, mailbox 0" in text.stdout
    assert any(line.split() == ["malformed", "4"] for line in text.stdout.splitlines())


def msgpack_array_of(n: int) -> bytes:
    return bytes([0x90 + n]) + b"\xc0" * n  # a fixarray of n nils


def send_expired(client: RawClient) -> None:
    """A request whose deadline passed before it arrived: dropped unanswered, and counted."""
    now = time.time()
    header = Header(
        id=new_id(), kind=Echo.TAG, src="raw/c", dst="n1/echo", flow="ask", ts=now, deadline=now - 60.0
    )
    client.sock.send_multipart([b"", encode_header(header), REGISTRY.encode(Echo())])


def test_kbus_stats_over_curve_counts_a_spoofed_src(
    ipc_dir: Path, kbus_node: Callable[..., KbusNode]
) -> None:
    keys = ipc_dir / "keys"
    for name in ("n1", "c1"):
        made = kbus("keys", name, "--dir", str(keys))
        assert made.returncode == 0, made.stderr
    c1_public, c1_secret = zmq.auth.load_certificate(keys / "c1.key_secret")
    n1_public, _ = zmq.auth.load_certificate(keys / "n1.key")
    config = ipc_dir / "n1.toml"
    config.write_text(
        '[node]\nname = "n1"\nbind = ["tcp://127.0.0.1:0"]\n'
        '[security]\nsecret_key_file = "keys/n1.key_secret"\n'
        f'allow = [{{ node = "c1", public_key = "{c1_public.decode()}" }}]\n'
        '[actors.echo]\ntype = "echo"\n'
    )
    port = kbus_node(config).port
    endpoint = f"tcp://127.0.0.1:{port}"
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        sock.linger = 0
        sock.curve_publickey, sock.curve_secretkey = c1_public, c1_secret
        assert c1_secret is not None
        sock.curve_serverkey = n1_public
        sock.connect(endpoint)
        now = time.time()
        for src, nonce in (("evil/x", 1), ("c1/x", 2)):  # c1's key claiming another node, then its own
            header = Header(
                id=new_id(), kind=Ping.TAG, src=src, dst="n1/echo", flow="ask", ts=now, deadline=now + 20
            )
            sock.send_multipart([b"", encode_header(header), REGISTRY.encode(Ping(nonce=nonce))])
        assert sock.poll(20_000), "no answer to the honest ping"
        _, _, body = sock.recv_multipart()
        assert REGISTRY.decode(Pong.TAG, body) == Pong(nonce=2, actor="n1/echo")
    finally:
        sock.close(0)
    report = stats(endpoint, "--server-key", str(keys / "n1.key"), "--key", str(keys / "c1.key_secret"))
    assert report["counters"]["spoofed"] == 1
    assert report["actors"]["echo"]["handled"] == 1
