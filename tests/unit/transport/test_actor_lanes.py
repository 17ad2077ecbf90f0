"""An actor thread's lanes (transport/inbox.py): a hosted actor's sends to a peer's direct actor leave on a
socket its host's thread owns and their answers come back on it, with no I/O-thread hand-off; each
(sender, receiver) pair keeps the way its first message took (MB-05); a lane to an actor that stopped is
dropped and the node's path answers (issue 15, item 6); a "no socket of its own" answer is asked again
later; a disconnect as a request leaves on a lane ends it
Unavailable. Two nodes over real ipc sockets."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from actors.app.echo import EchoActor
from actors.app.wiring import registry
from actors.base import DEFER, LOOP_HOSTS, BusActor, Context, HostPool
from transport import Node, Peer, inbox
from transport.errors import Expired, NotDelivered, Unavailable
from transport.messages import Echo
from transport.pending import Reply

WAIT = 20.0
ASKS = 20
PAIRS = 50  # new senders tried, at most, before the lane must be up (each one is real traffic, no sleep)


class Asker(BusActor):
    """Answers ``Echo(seq=n, data={"dst": d})`` once it has asked ``d`` n times in a row (each ask after
    the answer to the one before), with the seqs it got back, or the first error's name."""

    def handle(self, message: Any, ctx: Context) -> Any:
        self._ctx, self._dst, self._left, self._got = ctx, message.data["dst"], message.seq, []
        self._next(None)
        return DEFER

    def _next(self, reply: Reply | None) -> None:
        if reply is not None:
            if reply.error is not None:
                self._ctx.reply(Echo(data={"error": type(reply.error).__name__}))
                return
            self._got.append(reply.message.seq)
        if self._left == 0:
            self._ctx.reply(Echo(data={"seqs": self._got}))
            return
        self._left -= 1
        self.ask(self._dst, Echo(seq=len(self._got)), self._next, timeout=2.0)


def started_echo(server: Node) -> Any:
    """srv/echo, once it has answered: its thread binds its own socket before it reads anything, so from
    then on the node's answer to a resolve names that socket."""
    echo = server.spawn(EchoActor, "echo")
    server.request("srv/echo", Echo(), timeout=WAIT)
    return echo


def connected_client(make_node: Callable[..., Node], ipc_dir: Path, **kwargs: Any) -> Node:
    """A node connected to srv, its handshake done: an actor's first send there finds the connection (an
    actor's send to a peer not connected yet is NotDelivered at once)."""
    client = make_node("cli", registry=registry(), **kwargs)
    client.connect(Peer("srv", f"ipc://{ipc_dir}/srv.sock"), wait=WAIT)
    return client


@pytest.fixture
def pair(make_node: Callable[..., Node], ipc_dir: Path) -> tuple[Node, Node, Any]:
    server = make_node("srv", registry=registry(), bind=[f"ipc://{ipc_dir}/srv.sock"])
    echo = started_echo(server)
    return connected_client(make_node, ipc_dir), server, echo


names = itertools.count()


def asks(client: Node, n: int = ASKS, name: str | None = None) -> tuple[dict[str, Any], int]:
    """``n`` asks to srv/echo from an asker on the client's loop pool (a new one unless ``name``): its
    answer, and how many sends the client's I/O thread took meanwhile."""
    if name is None:
        name = f"asker.{next(names)}"
        HostPool.of(client, LOOP_HOSTS).spawn(Asker, name)
    before = client.stats["hops_to_io"]
    reply = client.request(f"cli/{name}", Echo(seq=n, data={"dst": "srv/echo"}), timeout=WAIT)
    return reply.data, client.stats["hops_to_io"] - before


def until_a_lane(client: Node) -> tuple[str, dict[str, Any]]:
    """New askers until one's asks all took the lane: its name and answer."""
    for _ in range(PAIRS):
        name = f"asker.{next(names)}"
        HostPool.of(client, LOOP_HOSTS).spawn(Asker, name)
        data, hops = asks(client, name=name)
        if hops == 0:
            return name, data
    raise AssertionError(f"no asker took the lane in {PAIRS} tries")


def test_a_hosted_actors_asks_to_a_peers_direct_actor_take_its_lane(pair: tuple[Node, Node, Any]) -> None:
    client, server, _ = pair
    assert server.direct_endpoints("echo")
    first, hops = asks(client)
    # Unresolved yet: through the node, and one more send there, the question where srv/echo listens.
    assert first == {"seqs": list(range(ASKS))} and hops == ASKS + 1
    name, data = until_a_lane(client)
    assert data == {"seqs": list(range(ASKS))}
    again, hops = asks(client, name=name)
    assert again == {"seqs": list(range(ASKS))} and hops == 0  # the pair keeps its lane


def test_mb05_a_pair_that_began_through_the_node_stays_there(pair: tuple[Node, Node, Any]) -> None:
    """MB-05: one sender's messages to one receiver arrive in order, so a pair never changes its way
    (two sockets would not keep their order): the first asker keeps the node's path after the lane is up."""
    client, _, _ = pair
    name = "asker.first"
    HostPool.of(client, LOOP_HOSTS).spawn(Asker, name)
    _, hops = asks(client, name=name)
    assert hops == ASKS + 1  # and the resolve
    until_a_lane(client)
    data, hops = asks(client, name=name)
    assert data == {"seqs": list(range(ASKS))} and hops == ASKS


def test_a_receiver_without_its_own_socket_yet_is_asked_again_later(
    make_node: Callable[..., Node], ipc_dir: Path
) -> None:
    """A resolve answered before the receiver had its own socket (it binds on its own thread, so a peer may
    ask while it starts, or before it exists) holds ``RESOLVE_AGAIN_AFTER`` seconds of the asking node's
    clock: pairs that start meanwhile go through the node; one that starts later asks again, and the pairs
    after the new answer take the lane."""
    skew = [0.0]
    server = make_node("srv", registry=registry(), bind=[f"ipc://{ipc_dir}/srv.sock"])
    client = connected_client(make_node, ipc_dir, monotonic=lambda: time.monotonic() + skew[0])
    data, hops = asks(client, n=1)
    assert data == {"error": NotDelivered.__name__} and hops == 2  # the resolve, and the ask
    started_echo(server)
    data, hops = asks(client)
    assert data == {"seqs": list(range(ASKS))} and hops == ASKS  # the answer holds: no second resolve
    skew[0] += inbox.RESOLVE_AGAIN_AFTER
    data, hops = asks(client)
    assert data == {"seqs": list(range(ASKS))} and hops == ASKS + 1  # asked again
    _, data = until_a_lane(client)
    assert data == {"seqs": list(range(ASKS))}


def test_a_lane_to_an_actor_that_stopped_gives_way_to_the_nodes_answer(pair: tuple[Node, Node, Any]) -> None:
    """The receiver stops: what its lane can no longer take goes through the node, which answers that the
    actor is gone; nothing waits past its deadline meanwhile."""
    client, _, echo = pair
    until_a_lane(client)
    echo.stop(block=True, timeout=WAIT)
    for _ in range(PAIRS):
        data, _ = asks(client, n=1)
        error = data.get("error")
        # A message the lane took just before it saw the close can only end at its deadline (Expired) or
        # as the connection's loss; every outcome is a typed one, and none hangs.
        assert error in {NotDelivered.__name__, Expired.__name__, Unavailable.__name__}, data
        if error == NotDelivered.__name__:
            return
    raise AssertionError("the node's NotDelivered never came back")


def test_a_disconnect_as_a_request_leaves_on_a_lane_ends_it_unavailable(
    pair: tuple[Node, Node, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The peer's connection drops (the I/O thread fails what was sent over it) just as a request leaves on
    a lane, before the lane's thread runs again: the request ends Unavailable, not at its deadline. The
    drop is faked at that frame (``fail_peer`` called from inside the send), where no real peer can be made
    to die; without the fake the echo would answer."""
    client, _, _ = pair
    name, _ = until_a_lane(client)
    real_send = inbox.send_envelope

    def send_then_drop(sock: Any, *frames: bytes) -> None:
        real_send(sock, *frames)
        client.pending.fail_peer("srv", lambda _: Unavailable("srv disconnected (faked at this frame)"))

    monkeypatch.setattr(inbox, "send_envelope", send_then_drop)
    data, hops = asks(client, n=1, name=name)
    assert data == {"error": Unavailable.__name__} and hops == 0
