"""The invariant of every ``BusActor`` (issue 18): no input, and no failure while answering it, stops the
actor. Error replies are bounded in size; an answer that cannot be encoded is answered with why; an answer
that cannot be sent is counted and logged once, never raised. One in-process node; the echo actor and small
test actors.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from actors.app.echo import EchoActor
from actors.base import DEFER, BusActor, Context, HostPool
from transport import Node, Peer
from transport.capture import CaptureWriter
from transport.envelope import Header
from transport.errors import MAX_ERROR_TEXT, BusError, Expired, HandlerError, NotDelivered, ProtocolError
from transport.messages import Echo, Fail, Hold, Ping, Pong
from transport.node import BARRIER
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


# ------------------------------------------------------------------- deferred requests expire (item 3)
class FakeClock:
    """Wall and monotonic time that move only when the test says so."""

    def __init__(self) -> None:
        self.t = 1_000_000.0

    def wall(self) -> float:
        return self.t

    def mono(self) -> float:
        return self.t - 900_000.0

    def advance(self, seconds: float) -> None:
        self.t += seconds


class CountingEcho(EchoActor):
    """The echo actor, plus a local query of what it keeps: deferred requests, their timers, continuations."""

    def on_local(self, message: Any) -> Any:
        if message == "count":
            return len(self._open), len(self._bus_expiry), len(self._continuations)
        kind, dst, n, timeout = message  # ask dst to hold, n times, from this actor
        assert kind == "ask"
        for _ in range(n):
            self.ask(dst, Hold(), lambda reply: None, timeout=timeout)
        return None


class Keeper(BusActor):
    """Keeps every held request's ctx itself (as the Router or the Codex adapter do) and answers them all
    on ``Echo(text="release")``."""

    def __init__(self, node: Node, address: str) -> None:
        super().__init__(node, address)
        self.held: list[Context] = []
        self.expired_seen = 0

    def handle(self, message: Any, ctx: Context) -> Any:
        if isinstance(message, Hold):
            self.held.append(ctx)
            return DEFER
        released, self.held = self.held, []
        for held in released:
            held.reply(Echo(text="late"))
        return Echo(seq=len(released), data=self.expired_seen)

    def on_expired(self, ctx: Context) -> None:
        self.expired_seen += 1


def run_timers(node: Node) -> None:
    """Let the node's I/O thread run what the clock made due, and wait until it has."""
    node.call_in_io_thread(lambda: (node.pending.expire_due(), node.timers.run_due()), timeout=WAIT)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def timed_node(make_node: Callable[..., Node], clock: FakeClock) -> Node:
    return make_node("n1", clock=clock.wall, monotonic=clock.mono, request_timeout=30.0)


def test_held_requests_are_forgotten_when_their_deadline_passes(timed_node: Node, clock: FakeClock) -> None:
    """Issue 18 item 3: 30,000 holds with 1 s deadlines grew a node by 22 MB for good."""
    ref = timed_node.spawn(CountingEcho, "echo")
    futures = [timed_node.request_future("n1/echo", Hold(), timeout=1.0) for _ in range(1000)]
    assert ref.ask("count", timeout=WAIT) == (1000, 1000, 0)
    clock.advance(0.5)
    run_timers(timed_node)
    assert ref.ask("count", timeout=WAIT) == (1000, 1000, 0)  # not before the deadline
    clock.advance(1.0)
    run_timers(timed_node)
    assert ref.ask("count", timeout=WAIT) == (0, 0, 0)
    assert len(timed_node.timers) == 0 and len(timed_node.pending) == 0
    assert all(isinstance(f.exception(WAIT), Expired) for f in futures)
    assert timed_node.stats["deferred_expired"] == 1000
    assert alive(timed_node, "echo")


def test_an_answered_request_cancels_its_timer(timed_node: Node) -> None:
    ref = timed_node.spawn(CountingEcho, "echo")
    keeper = timed_node.spawn(Keeper, "keeper")
    futures = [timed_node.request_future("n1/keeper", Hold(), timeout=5.0) for _ in range(10)]
    assert timed_node.request("n1/keeper", Echo(text="release"), timeout=WAIT).seq == 10
    assert [f.result(WAIT) for f in futures] == [Echo(text="late")] * 10
    assert len(timed_node.timers) == 0
    assert keeper.is_alive() and ref.is_alive()


def test_answering_an_expired_request_later_is_a_counted_no_op(timed_node: Node, clock: FakeClock) -> None:
    keeper = timed_node.spawn(Keeper, "keeper")
    futures = [timed_node.request_future("n1/keeper", Hold(), timeout=1.0) for _ in range(5)]
    keeper.ask(BARRIER, timeout=WAIT)  # the keeper holds all five (their timers are set) before time moves
    clock.advance(2.0)
    run_timers(timed_node)
    assert all(isinstance(f.exception(WAIT), Expired) for f in futures)
    # The keeper still holds the five contexts and answers them: nothing raises, nothing is sent.
    assert timed_node.request("n1/keeper", Echo(text="release"), timeout=WAIT) == Echo(seq=5, data=5)
    assert timed_node.stats["late_answers"] == 5
    assert alive(timed_node, "keeper")


def test_a_held_request_without_a_deadline_is_answered_expired_after_the_request_timeout(
    timed_node: Node, clock: FakeClock
) -> None:
    """Only a foreign client sends a request without a deadline; it is held at most ``request_timeout``."""
    ref = timed_node.spawn(CountingEcho, "echo")
    replies: queue.Queue[Reply] = queue.Queue()
    header = timed_node.header(Hold.TAG, timed_node.client_address(), "n1/echo", "ask")
    assert header.deadline is None
    timed_node.send(header, timed_node.registry.encode(Hold()), deliver=replies.put, timeout=60.0)
    assert ref.ask("count", timeout=WAIT) == (1, 1, 0)
    clock.advance(31.0)
    run_timers(timed_node)
    reply = replies.get(timeout=WAIT)
    assert isinstance(reply.error, Expired) and "30.0s" in reply.error.message
    assert ref.ask("count", timeout=WAIT) == (0, 0, 0)


def test_an_actors_continuations_expire_with_their_requests(timed_node: Node, clock: FakeClock) -> None:
    """Item 3, the other half: an actor waiting on requests nobody answers forgets them at their deadline."""
    timed_node.spawn(CountingEcho, "target")
    asker = timed_node.spawn(CountingEcho, "asker")
    asker.ask(("ask", "n1/target", 500, 1.0), timeout=WAIT)
    assert asker.ask("count", timeout=WAIT) == (0, 0, 500)
    clock.advance(2.0)
    run_timers(timed_node)
    assert asker.ask("count", timeout=WAIT) == (0, 0, 0)
    assert len(timed_node.pending) == 0


# ---------------------------------------------------------------------------- stopping is bounded (item 2)
class Wedged(BusActor):
    """A fake at a chosen point: its handler blocks until the test releases it."""

    def __init__(self, node: Node, address: str, release: threading.Event) -> None:
        super().__init__(node, address)
        self.release = release

    def handle(self, message: Any, ctx: Context) -> Any:
        self.release.wait(60)
        return None


def test_node_stop_leaves_an_actor_stuck_in_a_handler_behind_and_names_it() -> None:
    release = threading.Event()
    node = Node("n1").start()
    try:
        node.spawn(EchoActor, "echo")
        wedged = node.spawn(Wedged, "wedged", release)
        node.spawn(EchoActor, "after")
        node.tell("n1/wedged", Echo())
        assert node.request("n1/echo", Echo(seq=1), timeout=WAIT) == Echo(seq=1)
        assert node.stop(timeout=0.5) == ("n1/wedged",)
        assert node.stuck == ("n1/wedged",)
        assert not node.running
        assert wedged.is_alive()  # its thread cannot be ended from outside; kbus node exits without it
    finally:
        release.set()
        node.stop()


# ------------------------------------------------------------------------------------ hosted actors
class ThreadEcho(BusActor):
    """Answers with the ident of the thread it runs on."""

    def handle(self, message: Any, ctx: Context) -> Any:
        if message.text == "raise":
            raise RuntimeError("a bug in the hosted actor")
        return Echo(seq=threading.get_ident())


class Hoster(BusActor):
    """Hosts a ThreadEcho as ``guest`` on ``Echo(text="host")``; answers others with its own thread ident."""

    def handle(self, message: Any, ctx: Context) -> Any:
        if message.text == "host":
            self.host_actor(ThreadEcho, "guest")
            return None
        return Echo(seq=threading.get_ident())


def test_a_hosted_actor_runs_on_its_hosts_thread_and_stops_with_it(node: Node) -> None:
    host = node.spawn(Hoster, "host")
    node.request("n1/host", Echo(text="host"), timeout=WAIT)
    host_thread = node.request("n1/host", Echo(), timeout=WAIT).seq
    assert node.request("n1/guest", Echo(), timeout=WAIT).seq == host_thread
    # A bug in the guest's handler is answered as one, and neither the guest nor its host stops.
    with pytest.raises(HandlerError):
        node.request("n1/guest", Echo(text="raise"), timeout=WAIT)
    assert node.request("n1/guest", Echo(), timeout=WAIT).seq == host_thread
    guest = node.lookup("guest")
    assert guest is not None
    host.stop(block=True, timeout=WAIT)
    assert node.lookup("guest") is None
    assert not guest.is_alive()  # type: ignore[attr-defined]
    with pytest.raises(NotDelivered):
        node.request("n1/guest", Echo(), timeout=WAIT)


def test_a_hosted_actor_stopped_by_its_ref_leaves_its_host_serving(node: Node) -> None:
    node.spawn(Hoster, "host")
    node.request("n1/host", Echo(text="host"), timeout=WAIT)
    guest = node.lookup("guest")
    assert guest is not None
    assert guest.stop(block=True, timeout=WAIT) is True
    assert node.lookup("guest") is None
    with pytest.raises(NotDelivered):
        node.request("n1/guest", Echo(), timeout=WAIT)
    assert node.request("n1/host", Echo(), timeout=WAIT).seq > 0
    node.request("n1/host", Echo(text="host"), timeout=WAIT)  # the name is free again
    assert node.request("n1/guest", Echo(), timeout=WAIT).seq > 0


# ------------------------------------------------------------------------------------------ host pools
class Crasher(ThreadEcho):
    """A fake, for a crash at a chosen point: the local message "crash" raises in its handler, as a bug
    would (no bus input can crash an actor)."""

    def on_local(self, message: Any) -> Any:
        if message == "crash":
            raise RuntimeError("a crash at a chosen point")
        return super().on_local(message)


class Companion(ThreadEcho):
    """Places ``<name>.gate`` on its own pool while it is constructed (as a conversation its plan gates)."""

    def __init__(self, node: Node, address: str, *, pool: HostPool) -> None:
        super().__init__(node, address)
        pool.spawn(ThreadEcho, f"{self.name}.gate")


def thread_of(node: Node, name: str) -> int:
    return int(node.request(f"n1/{name}", Echo(), timeout=WAIT).seq)


def test_a_pool_hosts_many_actors_on_as_many_threads_as_it_has_hosts(node: Node) -> None:
    HostPool.configure(node, "t", 2)
    pool = HostPool.of(node, "t")
    pool.hosts()  # started before the count: what follows adds actors, not threads
    before = threading.active_count()
    for i in range(12):
        pool.spawn(ThreadEcho, f"g{i}")
    assert len({thread_of(node, f"g{i}") for i in range(12)}) == 2
    assert threading.active_count() == before
    assert sorted(h.hosted for h in pool.hosts()) == [6, 6]  # each on the host holding fewest
    with pytest.raises(ValueError, match="exists already"):  # a placement's error reaches the caller
        pool.spawn(ThreadEcho, "g0")


def test_a_pool_of_size_0_starts_each_actor_on_its_own_thread(node: Node) -> None:
    HostPool.configure(node, "own", 0)
    pool = HostPool.of(node, "own")
    for i in range(3):
        pool.spawn(ThreadEcho, f"o{i}")
    assert len({thread_of(node, f"o{i}") for i in range(3)}) == 3
    assert pool.hosts() == []


def test_a_hosted_actor_that_crashes_stops_alone_and_its_host_serves_on(node: Node) -> None:
    HostPool.configure(node, "c", 1)
    pool = HostPool.of(node, "c")
    crasher = pool.spawn(Crasher, "crasher")
    pool.spawn(ThreadEcho, "beside")
    host_thread = thread_of(node, "beside")
    assert thread_of(node, "crasher") == host_thread
    crasher.tell("crash")
    assert crasher.actor_stopped.wait(WAIT)
    assert node.lookup("crasher") is None
    with pytest.raises(NotDelivered):
        node.request("n1/crasher", Echo(), timeout=WAIT)
    assert thread_of(node, "beside") == host_thread  # its neighbour and its host live on
    assert pool.hosts()[0].actor_ref.is_alive()
    pool.spawn(ThreadEcho, "after")
    assert thread_of(node, "after") == host_thread


def test_an_actor_placed_from_a_hosts_thread_stays_on_that_host(node: Node) -> None:
    HostPool.configure(node, "p", 2)
    pool = HostPool.of(node, "p")
    for name in ("a", "b"):
        pool.spawn(Companion, name, pool=pool)
    assert thread_of(node, "a") != thread_of(node, "b")
    assert thread_of(node, "a.gate") == thread_of(node, "a")
    assert thread_of(node, "b.gate") == thread_of(node, "b")


def test_an_actor_placed_from_another_pools_host_goes_to_its_own_pool(node: Node) -> None:
    """A tool host's thread (one pool) starting a run (another pool) must not host it on itself: the tool
    may block there waiting for that run, which then could never step."""
    HostPool.configure(node, "tools", 1)
    HostPool.configure(node, "runs", 1)
    tools, runs = HostPool.of(node, "tools"), HostPool.of(node, "runs")
    tools.spawn(Companion, "tool", pool=runs)  # constructed on the tools host, placing its gate on runs
    run_thread = thread_of(node, "tool.gate")
    assert run_thread != thread_of(node, "tool")
    runs.spawn(ThreadEcho, "beside")
    assert thread_of(node, "beside") == run_thread


def test_a_node_stop_stops_its_pools_and_all_they_host(node: Node) -> None:
    HostPool.configure(node, "s", 3)
    pool = HostPool.of(node, "s")
    refs = [pool.spawn(ThreadEcho, f"s{i}") for i in range(6)]
    assert refs[0].stop(block=True, timeout=WAIT) is True  # one stopped alone: the others serve
    assert node.lookup("s0") is None and thread_of(node, "s1") > 0
    hosts = pool.hosts()
    node.stop()
    assert not any(ref.is_alive() for ref in refs)
    assert not any(host.actor_ref.is_alive() for host in hosts)
